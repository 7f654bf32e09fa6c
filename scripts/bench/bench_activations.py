"""What keeping fewer activations for backward (runner.models.activation_memory) saves and
costs, in one process: bench_peers' model and data, trained the same steps twice side by side,
with torchtune's modules as they are (plain) and with runner's feed-forward and RMSNorm (lean).

    python scripts/bench/bench_activations.py [--lengths mixed] [--repeats 3] [--size default]

Prints, for the largest step's batch, the bytes the forward keeps for backward (parameters left
out: saved_tensors_hooks, each storage once), then the step time of each arm: both train the
same 12 batches of 16 samples (runner's one row, SDPA per sample, fused AdamW, clip at 1.0,
fp32 on the CPU), one step of each in turn, the order alternating, --repeats passes (the first
step left out as warm-up); the table gives the summed time and the median and range of
plain/lean over the steps. Peak RSS is not printed: both arms share one process, and glibc's
heap holds what either freed (bench_peers --preload gives each arm's own peak).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import weakref
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

sys.path.insert(0, str(Path(__file__).resolve().parent))
import peers_setup  # noqa: E402  (the model's shapes and data, as peers_setup.py's)

from runner.data.transforms import collate  # noqa: E402
from runner.models.activation_memory import keep_fewer_activations  # noqa: E402
from runner.models.attention import RowAttention  # noqa: E402

BATCH, STEPS = 16, 12
CPU = torch.device("cpu")


def build(size: str, lean: bool) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = peers_setup.random_model(size)
    if lean:
        keep_fewer_activations(model, CPU)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)


def saved_bytes(model: torch.nn.Module, inputs: dict) -> int:
    """Bytes of the tensors a forward keeps for backward, each storage once, parameters out."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages: dict[int, int] = {}

    def keep(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in params:
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        model(**inputs)
    return sum(storages.values())


class PeakBytes(TorchDispatchMode):
    """The most bytes of tensors made inside the block that were alive at once (each storage
    once; a storage counts until it is freed): the live peak that a GPU's
    max_memory_allocated gives, on any device."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0
        self._counted: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._count(t.untyped_storage())
        return out

    def _count(self, storage: torch.UntypedStorage) -> None:
        key, size = storage.data_ptr(), storage.nbytes()
        if key in self._counted or size == 0:
            return
        self._counted.add(key)
        self.live += size
        self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._freed, key, size)

    def _freed(self, key: int, size: int) -> None:
        self.live -= size
        self._counted.discard(key)


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", choices=peers_setup.LENGTHS, default="mixed")
    parser.add_argument("--size", choices=peers_setup.SIZES, default="default")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    samples = peers_setup.tokenized_samples(args.size, BATCH * STEPS, args.lengths)
    arms = {"plain": build(args.size, lean=False), "lean": build(args.size, lean=True)}
    attention = RowAttention.of(arms["plain"][0], CPU)
    RowAttention.of(arms["lean"][0], CPU)

    def inputs_of(chunk: list[dict]) -> tuple[dict, torch.Tensor]:
        batch = collate(
            chunk, packed=False, padding_free=True, padding_idx=0, row_limit=attention.row_limit
        )
        return {"tokens": batch["tokens"], **attention.inputs(batch, CPU)}, batch["labels"]

    batches = [inputs_of(samples[i * BATCH : (i + 1) * BATCH]) for i in range(STEPS)]
    largest, _ = max(batches, key=lambda b: b[0]["tokens"].numel())
    kept = {arm: saved_bytes(model, largest) for arm, (model, _) in arms.items()}
    print(
        f"kept for backward at the largest step ({largest['tokens'].numel()} tokens): "
        f"plain {kept['plain'] / 2**20:.0f} MiB, lean {kept['lean'] / 2**20:.0f} MiB "
        f"({1 - kept['lean'] / kept['plain']:.0%} fewer)"
    )
    times: dict[str, list[float]] = {arm: [] for arm in arms}
    for repeat in range(args.repeats):
        for i, (inputs, labels) in enumerate(batches):
            for arm in list(arms) if (i + repeat) % 2 == 0 else list(arms)[::-1]:
                model, optimizer = arms[arm]
                start = time.perf_counter()
                logits = model(**inputs)
                F.cross_entropy(logits.reshape(-1, logits.size(-1)), labels.reshape(-1)).backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                if repeat or i:
                    times[arm].append(time.perf_counter() - start)
    for arm, seconds in times.items():
        print(f"{arm:<6} {sum(seconds):7.2f} s over {len(seconds)} steps")
    ratios = [p / q for p, q in zip(times["plain"], times["lean"], strict=True)]
    print(
        f"plain/lean step time: median {statistics.median(ratios):.3f}, "
        f"range {min(ratios):.3f}-{max(ratios):.3f}"
    )


if __name__ == "__main__":
    main(sys.argv[1:])
