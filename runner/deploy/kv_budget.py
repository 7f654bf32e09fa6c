"""How much memory the running batch's KV cache may take, and whether waiting sequences fit in
it (transformers.kv_cache_gib).

The batch's buffers are dense (kv_cache.py): every row as wide as the widest, grown by doubling
in rows or tokens, never shrunk while the batch runs, and copied as they grow, the old buffers
beside the new ones until the copy is done. So a sequence joins the batch only if the batch
with it fits for the rest of its life: every running and joining row decoding to its
max_tokens, the buffers then as large as BatchCache makes them (`grown`), half as much again
while they grow, and beside them the cache that the joining prompts' prefill writes. Sequences
that do not fit wait, in order, for running ones to finish (as text-generation-inference's
max_batch_total_tokens and vLLM's KV cache blocks bound a batch by memory); one that could not
fit even alone fails at once, naming the key. The attention mask, ids and positions beside the
buffers are left out: a byte or eight a row and token, against kilobytes of keys and values.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from runner.deploy.kv_cache import BatchCache, grown

GIB = 1 << 30
# transformers.kv_cache_gib: null on CUDA: this share of the device's memory free when the engine
# first admits a sequence (the blocks torch has cached and not used counted as free), split
# evenly among the engines serving on the device. The rest is for the prefills' activations,
# the decode step's CUDA graphs and logits. On the CPU, null sets no bound.
KV_CACHE_SHARE = 0.8


def default_budget(device: torch.device, engines: int) -> float:
    """transformers.kv_cache_gib: null on a CUDA `device`, in bytes."""
    free, _ = torch.cuda.mem_get_info(device)
    unused = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return KV_CACHE_SHARE * (free + unused) / engines


@dataclass(frozen=True)
class Joining:
    """What admitting sequences asks of the batch's memory: its rows after they join, the
    longest prompt prefix among them (the prefill writes all but each prompt's last token), and
    the most decode steps any row, running or joining, has left."""

    rows: int
    prefix: int
    steps: int


@dataclass
class KvBudget:
    """The bytes the batch's KV cache may take, and what one token of one row takes in it."""

    limit: float
    token_bytes: int
    padded: bool
    compiled: bool
    # The host a step ahead of the device (engine.py): a finished row is computed once more.
    overlap: bool

    def peak(self, joining: Joining, cache: BatchCache | None, prefill_rows: int) -> float:
        """The most the batch's KV cache takes, in bytes, from the admission of `joining` on
        (into the running batch's `cache`, None: fresh buffers), the prefill of `prefill_rows`
        prompts included."""
        end = max(cache.end if cache is not None else 0, joining.prefix)
        tokens = end + joining.steps + (1 if self.overlap else 0)
        capacity = cache.capacity if cache is not None else (0, 0)
        final = grown(capacity, joining.rows, tokens, padded=self.padded, compiled=self.compiled)
        buffers = final[0] * final[1] * self.token_bytes
        # Each growth at least doubles: the old buffers beside the new are at most half as large.
        growing = 1.5 if final != capacity else 1.0
        return growing * buffers + prefill_rows * joining.prefix * self.token_bytes

    def refusal(self, prompt_ids: Sequence[int], max_tokens: int, peak: float) -> str:
        """Why a sequence that could not fit even alone fails."""
        return (
            f"a prompt of {len(prompt_ids)} tokens and max_tokens={max_tokens} need "
            f"{_size(peak, peak)} of KV cache, more than this engine's "
            f"{_size(self.limit, peak)} "
            "(transformers.kv_cache_gib): ask for fewer tokens, or serve with a larger "
            "transformers.kv_cache_gib"
        )


def _size(n: float, larger: float) -> str:
    """Bytes in GiB, or in MiB where `larger`, of the sizes said together, is below a tenth of
    one (a small cache read "0.00 GiB")."""
    return f"{n / GIB:.2f} GiB" if larger >= GIB / 10 else f"{n / 2**20:.2f} MiB"
