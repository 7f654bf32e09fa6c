"""Attention over rows that hold several samples (padding-free rows, PackedDataset's packs):
each position sees the earlier positions of its own sample only. The samples' positions each
start at 0 (input_pos), and the mask that keeps them apart is made from them in the step, in
the form the model's attention takes best on its device (`RowAttention`):

- "flex": a flex-attention BlockMask, which computes only the blocks that hold a visible
  position (torchtune's attention on CUDA of compute capability 7.5 and up); its rows stay as
  long as their longest sample, as create_block_mask builds the dense mask first;
- "samples": no mask at all: SDPA runs causal on each sample's span alone (`Samples`), so no
  position is computed against another sample's and the rows can be as long as the model
  takes (everywhere else torchtune's MultiHeadAttention runs: the CPU, older GPUs);
- "dense": the [rows, s, s] boolean mask that SDPA takes (Gemma 2's attention, which does its
  own arithmetic on the mask; its rows stay as long as their longest sample, the mask being
  quadratic in them).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from torch.nn.attention.flex_attention import BlockMask

# torchtune's MultiHeadAttention._attention_call: (q, k, v, mask, dropout_p, is_causal) -> output.
AttentionCall = Callable[..., torch.Tensor]


def _documents(input_pos: torch.Tensor) -> torch.Tensor:
    """Each position's sample: the count of sample starts up to it (PackedDataset's padding,
    whose positions go on from its last sample's, joins that sample and is never trained)."""
    return (input_pos == 0).cumsum(dim=1)


def dense_block_causal_mask(input_pos: torch.Tensor) -> torch.Tensor:
    """The [rows, s, s] boolean block-causal mask that SDPA takes, of rows whose samples'
    positions each start at 0, on input_pos's device."""
    document = _documents(input_pos)
    width = document.shape[1]
    causal = torch.ones(width, width, dtype=torch.bool, device=input_pos.device).tril()
    return (document[:, :, None] == document[:, None, :]) & causal


def flex_block_causal_mask(input_pos: torch.Tensor) -> BlockMask:
    """The same mask as a flex-attention BlockMask, on input_pos's device."""
    from torch.nn.attention.flex_attention import create_block_mask

    document = _documents(input_pos)
    rows, width = document.shape

    def mask_mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return (q_idx >= kv_idx) & (document[b, q_idx] == document[b, kv_idx])

    return create_block_mask(mask_mod, rows, None, width, width, device=input_pos.device.type)


@dataclass(frozen=True)
class Samples:
    """Where each sample of a batch lies, as the mask of attention per sample: for each row,
    its samples in order as runs of equal length, (start, length, count), covering the row (a
    pack's trailing padding joins its last sample, as in `_documents`). pack_rows puts a
    batch's samples longest first, so samples of one length lie side by side and a run's
    attention is one SDPA call (all of a batch's, where every sample is as long)."""

    rows: tuple[tuple[tuple[int, int, int], ...], ...]

    @classmethod
    def of(cls, input_pos: torch.Tensor) -> Samples:
        """The samples of rows whose positions each start at 0."""
        width = input_pos.shape[1]
        rows = []
        for starts in (input_pos == 0).tolist():
            begins = [i for i, start in enumerate(starts) if start or i == 0]
            runs: list[tuple[int, int, int]] = []
            for begin, end in zip(begins, [*begins[1:], width], strict=True):
                if runs and runs[-1][1] == end - begin:
                    start, length, count = runs[-1]
                    runs[-1] = (start, length, count + 1)
                else:
                    runs.append((begin, end - begin, 1))
            rows.append(tuple(runs))
        return cls(tuple(rows))

    # Runs eagerly under torch.compile: the spans are Python numbers that change every batch,
    # which a compiled graph would be specialized on (and recompiled for) one by one.
    @torch.compiler.disable
    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float
    ) -> torch.Tensor:
        """Causal SDPA over each sample's span of q, k, v ([rows, heads, s, head_dim]) alone."""
        rows = []
        for r, runs in enumerate(self.rows):
            pieces = []
            for start, length, count in runs:
                # The run's samples of row r, as a batch: [count, heads, length, head_dim].
                q_run, k_run, v_run = (
                    x[r, :, start : start + length * count].unflatten(1, (count, length))
                    for x in (q, k, v)
                )
                out = F.scaled_dot_product_attention(
                    q_run.transpose(0, 1),
                    k_run.transpose(0, 1),
                    v_run.transpose(0, 1),
                    dropout_p=dropout_p,
                    is_causal=True,
                )
                pieces.append(out.transpose(0, 1).flatten(1, 2))
            rows.append(torch.cat(pieces, dim=1))
        return torch.stack(rows)


def _per_sample(original: AttentionCall) -> AttentionCall:
    """torchtune's attention call, which also takes a Samples mask."""

    def attention_call(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: Any,
        dropout_p: float,
        is_causal: bool,
    ) -> torch.Tensor:
        if isinstance(mask, Samples):
            return mask.attend(q, k, v, dropout_p)
        return original(q, k, v, mask=mask, dropout_p=dropout_p, is_causal=is_causal)

    attention_call.per_sample = True  # type: ignore[attr-defined]
    return attention_call


@dataclass(frozen=True)
class RowAttention:
    """How a model attends within rows of several samples on its device (the module's
    docstring): `kind`, and the longest row its batches may be built in (`row_limit`: None for
    rows as long as their longest sample)."""

    kind: str
    row_limit: int | None

    @classmethod
    def of(cls, model: nn.Module, device: torch.device) -> RowAttention:
        """The best way `model` takes on `device`; for "samples", its attention modules are
        given the call that takes a Samples mask (once)."""
        from runner.models.torchtune_boundary import (
            SUPPORTS_FLEX_ATTENTION,
            Gemma2Attention,
            MultiHeadAttention,
        )

        modules = list(model.modules())
        if any(isinstance(module, Gemma2Attention) for module in modules):
            return cls("dense", None)
        attentions = [m for m in modules if isinstance(m, MultiHeadAttention)]
        # The longest row the decoder takes (torchtune's TransformerDecoder refuses longer).
        limit = getattr(model, "max_seq_len", None)
        if not attentions or not isinstance(limit, int):  # not torchtune's decoder
            return cls("dense", None)
        if device.type == "cuda" and SUPPORTS_FLEX_ATTENTION:
            return cls("flex", None)
        for module in attentions:
            if not getattr(module._attention_call, "per_sample", False):
                module._attention_call = _per_sample(module._attention_call)
        return cls("samples", limit)

    def mask(self, input_pos: torch.Tensor) -> torch.Tensor | BlockMask | Samples:
        """The mask of rows whose samples' positions each start at 0 (on input_pos's device)."""
        if self.kind == "flex":
            return flex_block_causal_mask(input_pos)
        if self.kind == "samples":
            return Samples.of(input_pos)
        return dense_block_causal_mask(input_pos)

    def inputs(self, batch: dict[str, Any], device: torch.device) -> dict[str, Any]:
        """The model's keyword inputs beside the tokens: a batch of rows of several samples
        (one with input_pos) gets its positions and mask on `device`; any other, none."""
        if "input_pos" not in batch:
            return {}
        input_pos = batch["input_pos"].to(device)
        return {"input_pos": input_pos, "mask": self.mask(input_pos)}
