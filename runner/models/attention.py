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
- "gathered": the same per-sample causal SDPA where the layers are compiled (`Gathered`): the
  samples gathered by index tensors into a few buckets of like length, each padded to its
  longest, so that the attention is traced into each layer's graph (no graph break) and a new
  batch's samples are new tensor values and symbolic sizes, not new Python numbers (no
  recompile);
- "varlen": no mask either: FlashAttention's variable-length kernel (torch.nn.attention.varlen,
  CUDA, bf16 or fp16) over the rows flattened into one sequence, given where each sample starts
  (`Spans`): no position is computed against another sample's, none is padding, nothing is
  compiled for it, and the rows can be as long as the model takes (chosen with
  `attention=varlen`);
- "dense": the [rows, s, s] boolean mask that SDPA takes (Gemma 2's attention, which does its
  own arithmetic on the mask; its rows stay as long as their longest sample, the mask being
  quadratic in them).

Where the layers are compiled (compile=true), the attention call runs inside each layer's graph:
flex attention is called there directly (torchtune's call wraps its own compiled flex attention
in torch.compiler.disable, a graph break in every layer; pytorch issue 149767), the varlen
kernel is an operator the graph calls, and the CPU's per-sample attention is "gathered" (this
torch has no CPU backward for flex attention). Where they are not, flex attention is compiled
on its own with symbolic sizes (torchtune's, compiled for one shape at a time, runs uncompiled
once padding-free rows have brought it 8 widths).
Flex attention, and SDPA on the CPU, take the keys and values as many as the model has
(grouped-query attention), not copied once per query head as torchtune's attention passes them.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from runner.devices import to_device

if TYPE_CHECKING:
    from torch.nn.attention.flex_attention import BlockMask

# torchtune's MultiHeadAttention._attention_call: (q, k, v, mask, dropout_p, is_causal) -> output.
AttentionCall = Callable[..., torch.Tensor]


def _documents(input_pos: torch.Tensor) -> torch.Tensor:
    """Each position's sample: the count of sample starts up to it (PackedDataset's padding,
    whose positions go on from its last sample's, joins that sample and is never trained)."""
    return (input_pos == 0).cumsum(dim=1)


def _sample_starts(input_pos: torch.Tensor) -> torch.Tensor:
    """Whether each position of the rows laid end to end ([rows * width]) begins a sample:
    where its position is 0, and at each row's start (a sample never spans two rows)."""
    starts = (input_pos == 0).flatten()
    starts[:: input_pos.shape[1]] = True
    return starts


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
        """Causal SDPA over each sample's span of q ([rows, heads, s, head_dim]) and k, v
        ([rows, kv_heads, s, head_dim], kv_heads dividing heads) alone."""
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
                    enable_gqa=k.shape[1] != q.shape[1],
                )
                pieces.append(out.transpose(0, 1).flatten(1, 2))
            rows.append(torch.cat(pieces, dim=1))
        return torch.stack(rows)


# Gathered's buckets: up to this many groups of like length, each padded to its own longest
# sample. Each count is one graph variant (compiled once), so it stays small; 4 cut the padded
# attention of bench_peers' mixed lengths (16 samples of 39-369 tokens) to 1.32x the samples'
# own, from 5.0x in one bucket (medians over its steps; bench_peers.py prints both).
BUCKETS = 4
# Bucket boundaries are searched among this many of the sorted samples' places at most, so that
# the search stays a few thousand steps for the hundreds of samples of long packs.
_CUT_CANDIDATES = 64


def buckets(lengths: list[int], count: int = BUCKETS) -> list[list[int]]:
    """The samples (indices into `lengths`) in `min(count, len // 2)` groups of like length, at
    least 2 a group (a size of 1 is one dynamo specializes, a graph of its own), chosen to
    pad least: the groups of the sorted lengths whose attention, size x longest squared,
    sums least (dynamic programming over the cut places)."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    ordered = [lengths[i] for i in order]
    n, groups = len(order), max(1, min(count, len(order) // 2))
    places = list(range(2, n - 1))  # a cut before these keeps 2 or more on each side
    if len(places) > _CUT_CANDIDATES:
        step = len(places) / _CUT_CANDIDATES
        places = sorted({places[int(i * step)] for i in range(_CUT_CANDIDATES)})
    ends = [*places, n]

    def cost(begin: int, end: int) -> int:
        return (end - begin) * ordered[end - 1] ** 2

    # best[j][e]: the least cost of the first e samples in j + 1 groups, and its last cut.
    best: list[dict[int, tuple[int, int]]] = [{e: (cost(0, e), 0) for e in ends if e >= 2}]
    for _ in range(1, groups):
        best.append(
            {
                e: min(
                    (previous + cost(b, e), b)
                    for b, (previous, _) in best[-1].items()
                    if e - b >= 2
                )
                for e in ends
                if any(e - b >= 2 for b in best[-1])
            }
        )
    cuts, end = [n], n
    for level in reversed(best[1:]):
        end = level[end][1]
        cuts.append(end)
    bounds = [0, *reversed(cuts)]
    return [order[b:e] for b, e in zip(bounds, bounds[1:], strict=False)]


@dataclass(frozen=True)
class Gathered:
    """Where each sample of a batch lies, as index tensors (the same per-sample causal SDPA as
    `Samples`, in a form torch.compile traces), the samples in `buckets` of like length:
    `gathers`, one [samples, longest] a bucket, hold each sample's positions in the flattened
    rows, in order, padded past its end with later positions, and `scatter` [rows * width]
    each position's place in the buckets' outputs, flattened and joined. A sample's own
    positions see only its own earlier ones under the causal mask; what its padding computes
    is never scattered back, so it gets no gradient. Each sample costs as much as its bucket's
    longest (PackedDataset's trailing padding, whose positions go on from its last sample's,
    lengthens that sample, as in `_documents`; pack_rows' padding is a sample of its own)."""

    gathers: tuple[torch.Tensor, ...]
    scatter: torch.Tensor

    @classmethod
    def of(cls, input_pos: torch.Tensor) -> Gathered:
        """The samples of rows whose positions each start at 0, on input_pos's device."""
        device, total = input_pos.device, input_pos.numel()
        starts = _sample_starts(input_pos)
        first_at = starts.nonzero().flatten()  # each sample's first position
        first = first_at.tolist()  # the one host read: the starts, which size the buckets
        lengths = [e - b for b, e in zip(first, [*first[1:], total], strict=True)]
        gathers, place, base = [], [0] * len(first), 0
        for group in buckets(lengths):
            longest = max(2, *(lengths[i] for i in group))  # a width of 1 would specialize too
            for slot, sample in enumerate(group):
                place[sample] = base + slot * longest
            begins = torch.tensor([first[i] for i in group], device=device)
            gather = (begins[:, None] + torch.arange(longest, device=device)).clamp(max=total - 1)
            _dynamic(gather, 0, 1)
            gathers.append(gather)
            base += len(group) * longest
        of_sample = starts.cumsum(0) - 1  # each position's sample
        offset = torch.arange(total, device=device) - first_at[of_sample]
        scatter = torch.tensor(place, device=device)[of_sample] + offset
        _dynamic(scatter, 0)
        return cls(tuple(gathers), scatter)

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float
    ) -> torch.Tensor:
        """Causal SDPA over each sample's span of q ([rows, heads, s, head_dim]) and k, v
        ([rows, kv_heads, s, head_dim], kv_heads dividing heads) alone."""
        rows, heads, width, head_dim = q.shape
        flat = [x.transpose(1, 2).flatten(0, 1) for x in (q, k, v)]  # [rows * width, heads, d]
        outs = []
        for gather in self.gathers:  # [samples, heads, longest, head_dim] each
            q_b, k_b, v_b = (x[gather].transpose(1, 2) for x in flat)
            out = F.scaled_dot_product_attention(
                q_b, k_b, v_b, dropout_p=dropout_p, is_causal=True, enable_gqa=k.shape[1] != heads
            )
            outs.append(out.transpose(1, 2).reshape(-1, heads, head_dim))
        out = torch.cat(outs)[self.scatter]
        return out.view(rows, width, heads, head_dim).transpose(1, 2)


def _varlen_keywords() -> dict[str, Any] | None:
    """The keywords that make torch's varlen_attn causal and let its keys and values be fewer
    than its queries, as the installed torch names them (2.10: is_causal; later: window_size,
    and from 2.12 enable_gqa, without which grouped keys are refused); None where this torch
    has no varlen_attn."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    keywords: dict[str, Any] = (
        {"is_causal": True} if "is_causal" in params else {"window_size": (-1, 0)}
    )
    if "enable_gqa" in params:
        keywords["enable_gqa"] = True
    return keywords


VARLEN_KEYWORDS = _varlen_keywords()


@dataclass(frozen=True)
class Spans:
    """Where each sample of a batch lies, as FlashAttention's variable-length attention takes
    it: the rows flattened into one sequence of tokens, `starts` each sample's first token in
    it and then the total ([samples + 1], int32, on the device), and the longest sample's
    length as the size of `longest` ([longest, 0], empty), so that a compiled layer reads it
    as a symbolic size where a Python number would be compiled into the graph (a new graph for
    each batch's). Each row starts a sample; PackedDataset's trailing padding joins its row's
    last sample, as in `_documents`."""

    starts: torch.Tensor
    longest: torch.Tensor

    @classmethod
    def of(cls, input_pos: torch.Tensor, device: torch.device) -> Spans:
        """The samples of rows whose positions each start at 0; computed where input_pos is
        (the loader's batch, on the host: no read back from the device), then copied."""
        total = torch.tensor([input_pos.numel()], device=input_pos.device)
        starts = torch.cat((_sample_starts(input_pos).nonzero().flatten(), total))
        longest = max(2, int(starts.diff().max()))  # a size of 1 would be specialized
        spans = cls(
            to_device(starts.to(torch.int32), device), torch.empty(longest, 0, device=device)
        )
        _dynamic(spans.starts, 0)
        _dynamic(spans.longest, 0)
        return spans

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float
    ) -> torch.Tensor:
        """Causal attention over each sample's span of q ([rows, heads, s, head_dim]) and k, v
        ([rows, kv_heads, s, head_dim], kv_heads dividing heads) alone."""
        from torch.nn.attention.varlen import varlen_attn

        if dropout_p > 0.0:  # torch's varlen_attn has no dropout
            raise ValueError(
                "torch's variable-length attention has no dropout: set the model's attention "
                "dropout to 0.0, or attention=auto"
            )
        assert VARLEN_KEYWORDS is not None  # attention=varlen is refused on such a torch
        rows, heads, width, head_dim = q.shape
        # FlashAttention computes in bf16 or fp16 (the recipe's dtype, checked); fp32 comes
        # from a bf16_mixed run's evaluation alone, which runs outside autocast.
        half = torch.bfloat16 if q.dtype == torch.float32 else q.dtype
        q_flat, k_flat, v_flat = (
            x.transpose(1, 2).reshape(rows * width, x.shape[1], head_dim).to(half)
            for x in (q, k, v)
        )
        starts, longest = self.starts, self.longest.shape[0]
        out = varlen_attn(
            q_flat, k_flat, v_flat, starts, starts, longest, longest, **VARLEN_KEYWORDS
        )
        assert isinstance(out, torch.Tensor)  # no auxiliary outputs were asked for
        return out.to(q.dtype).view(rows, width, heads, head_dim).transpose(1, 2)


def _flex(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: BlockMask,
    dropout_p: float,
    *,
    in_graph: bool,
) -> torch.Tensor:
    """Flex attention over the BlockMask: called as it is where a compiled layer traces it into
    its own graph, else compiled on its own (`_compiled_flex`)."""
    from torch.nn.attention.flex_attention import flex_attention

    if dropout_p > 0.0:  # as torchtune's call refuses it
        raise ValueError("Flex attention does not support dropout. Please set dropout to 0.0.")
    if in_graph:
        out = flex_attention(q, k, v, block_mask=mask, enable_gqa=True)
    else:
        out = _compiled_flex()(q, k, v, block_mask=mask, enable_gqa=True)
    assert isinstance(out, torch.Tensor)  # no auxiliary outputs were asked for
    return out


@functools.cache
def _compiled_flex() -> Callable[..., Any]:
    """flex_attention compiled on its own, for layers that are not (uncompiled, it computes
    and keeps every score: slow, and quadratic in memory). Its sizes become symbolic at the
    second shape it sees (dynamo's automatic dynamic), so rows of a new width or count each
    batch (padding-free rows) reuse one graph. torchtune's own compiles it with
    dynamic=False, a graph per shape: past dynamo's limit of 8 recompiles it falls back to
    the uncompiled implementation for the rest of the run."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention)


def _grouped(x: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """Keys or values that torchtune's attention expanded for grouped-query attention
    ([rows, heads, s, head_dim], each of the kv_heads repeated heads // kv_heads times in a
    row), as the kv_heads they were: each group's first."""
    heads = x.shape[1]
    return x if heads == kv_heads else x[:, :: heads // kv_heads].contiguous()


def _rows_call(original: AttentionCall, compiled: bool, kv_heads: int) -> AttentionCall:
    """torchtune's attention call, which also takes a Samples, Gathered or Spans mask, and
    calls flex attention itself: inside the graph of a compiled layer, compiled on its own in
    another (`_compiled_flex`).

    torchtune's MultiHeadAttention copies each of the `kv_heads` keys and values once for each
    query head of its group before the call. Flex attention, FlashAttention's variable-length
    kernel and SDPA on the CPU take them as they were, kv_heads wide (enable_gqa), so backward
    keeps a group's keys and values once, not once a query head (a quarter at Llama 3.2 1B's 8
    of 32 heads), and gets their gradients summed in the kernel. On CUDA, SDPA's kernels for
    grouped keys are its flash ones (compute capability 8.0 and up) and its math one, and the
    GPUs where SDPA runs here rather than flex attention (below 7.5) have only the math one:
    there they stay expanded, for the memory-efficient kernel."""
    from torch.nn.attention.flex_attention import BlockMask

    def attention_call(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: Any,
        dropout_p: float,
        is_causal: bool,
    ) -> torch.Tensor:
        if isinstance(mask, Samples | Gathered):
            if q.device.type == "cpu":  # SDPA's grouped kernels: CUDA's need flex's GPUs
                k, v = _grouped(k, kv_heads), _grouped(v, kv_heads)
            return mask.attend(q, k, v, dropout_p)
        if isinstance(mask, BlockMask):
            k, v = _grouped(k, kv_heads), _grouped(v, kv_heads)
            return _flex(q, k, v, mask, dropout_p, in_graph=compiled)
        if isinstance(mask, Spans):
            return mask.attend(q, _grouped(k, kv_heads), _grouped(v, kv_heads), dropout_p)
        return original(q, k, v, mask=mask, dropout_p=dropout_p, is_causal=is_causal)

    attention_call.torchtune_call = original  # type: ignore[attr-defined]
    attention_call.compiled = compiled  # type: ignore[attr-defined]
    return attention_call


def _compiled(model: nn.Module) -> bool:
    """Whether the model's decoder layers were compiled (nn.Module.compile, as
    runner.trainer.parallel.prepare_model compiles them, keeps the compiled call in
    `_compiled_call_impl`: torch's attribute, read here alone)."""
    return any(getattr(m, "_compiled_call_impl", None) is not None for m in model.modules())


@dataclass(frozen=True)
class RowAttention:
    """How a model attends within rows of several samples on its device (the module's
    docstring): `kind`, the longest row its batches may be built in (`row_limit`: None for
    rows as long as their longest sample), and the fewest rows (`min_rows`)."""

    kind: str
    row_limit: int | None
    # "gathered" builds batches of 2 rows or more: a count of 1 is one dynamo specializes (a
    # graph of its own), so a run whose batches are one row until one is not compiles again then,
    # in the middle of its run (bench_peers' mixed lengths: 5 s at step 7 of 12, more than
    # the step itself). The gathered attention does not see the rows: only the count changes.
    min_rows: int = 1

    @classmethod
    def of(cls, model: nn.Module, device: torch.device, kernel: str = "auto") -> RowAttention:
        """The best way `model` takes on `device`, compiled or not (`kernel`, the recipe's
        `attention`: auto, or flex or varlen on CUDA, as runner.config.dataset.check_attention
        allows); torchtune's attention modules are given the call that takes each kind's mask
        (over torchtune's own, however often asked)."""
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
        compiled = _compiled(model)
        for module in attentions:
            call = module._attention_call
            if getattr(call, "compiled", None) != compiled:
                original = getattr(call, "torchtune_call", call)
                module._attention_call = _rows_call(original, compiled, module.num_kv_heads)
        if device.type == "cuda" and kernel == "varlen":
            if compiled:
                _first_layer_input_dynamic(model)
            return cls("varlen", limit)
        if device.type == "cuda" and SUPPORTS_FLEX_ATTENTION:
            return cls("flex", None)
        if not compiled:
            return cls("samples", limit)
        _first_layer_input_dynamic(model)
        return cls("gathered", limit, min_rows=2)

    def mask(
        self, input_pos: torch.Tensor
    ) -> torch.Tensor | BlockMask | Samples | Gathered | Spans:
        """The mask of rows whose samples' positions each start at 0 (on input_pos's device)."""
        if self.kind == "varlen":
            return Spans.of(input_pos, input_pos.device)
        if self.kind == "flex":
            return flex_block_causal_mask(input_pos)
        if self.kind == "samples":
            return Samples.of(input_pos)
        if self.kind == "gathered":
            return Gathered.of(input_pos)
        return dense_block_causal_mask(input_pos)

    def inputs(self, batch: dict[str, Any], device: torch.device) -> dict[str, Any]:
        """The model's keyword inputs beside the tokens: a batch of rows of several samples
        (one with input_pos), as the loader made it, gets its positions and mask on `device`;
        any other, none. The varlen spans are read from the loader's positions, on the host:
        from the device's, the host would wait for every kernel queued before."""
        if "input_pos" not in batch:
            return {}
        input_pos = to_device(batch["input_pos"], device)
        if self.kind in ("gathered", "varlen"):  # symbolic in compiled layers from the first
            _dynamic(input_pos, 0, 1)
        if self.kind == "varlen":
            return {"input_pos": input_pos, "mask": Spans.of(batch["input_pos"], device)}
        return {"input_pos": input_pos, "mask": self.mask(input_pos)}


def _dynamic(tensor: torch.Tensor, *dims: int) -> None:
    """Marks the sizes that change with every batch symbolic in the graphs compiled from
    `tensor`, from the first (maybe_: a size of 1, which dynamo specializes, is no error)."""
    for dim in dims:
        torch._dynamo.maybe_mark_dynamic(tensor, dim)


def _first_layer_input_dynamic(model: nn.Module) -> None:
    """The rows and width of the compiled decoder layers' input, the token embeddings' output
    (made outside them: a layer's own hooks run inside its compiled call), marked symbolic:
    the first batch's graph then serves every later batch's shape, where dynamo would compile
    once more for the first new width and again for the first new count of rows (each a
    step of seconds, in the middle of a run)."""
    embeddings = getattr(model, "tok_embeddings", None)
    if isinstance(embeddings, nn.Module) and not getattr(embeddings, "_runner_dynamic", False):
        embeddings.register_forward_hook(lambda module, args, out: _dynamic(out, 0, 1))
        embeddings._runner_dynamic = True  # type: ignore[assignment]
