"""attention=varlen: rows of several samples attend through torch's variable-length
FlashAttention (torch.nn.attention.varlen), a CUDA kernel. Here, on the CPU, torch's own
operators run (the varlen_attn call as the installed torch takes it, its autograd formula, its
fake implementation under torch.compile), over a reference kernel registered for the CPU that
computes what FlashAttention's documentation says it computes; on a GPU, the last test runs
the kernel itself. The recipe's checks refuse varlen where it cannot run, naming the key."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

from runner.data.transforms import pack_rows
from runner.models.attention import VARLEN_KEYWORDS, RowAttention, Spans, dense_block_causal_mask
from runner.models.torchtune_boundary import CROSS_ENTROPY_IGNORE_IDX
from tests.test_compiled_attention import eager_and_compiled, mixed_length_batches, train_steps
from tests.test_padding_free import CPU, make_content_first_samples, packed_rows, tiny_llama


def _spans(cu_seq: torch.Tensor) -> list[tuple[int, int]]:
    bounds = cu_seq.tolist()
    return list(zip(bounds, bounds[1:], strict=False))


def _expanded(x: torch.Tensor, heads: int) -> torch.Tensor:
    """Grouped keys or values ([tokens, kv_heads, d]) once per query head of their group."""
    return x.repeat_interleave(heads // x.shape[1], dim=1)


def reference_forward(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seq_q: torch.Tensor,
    cu_seq_k: torch.Tensor,
    max_q: int,
    max_k: int,
    is_causal: bool = False,
    scale: float | None = None,
    window_size: list[int] | None = None,
    enable_gqa: bool = False,
    seqused_k: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    num_splits: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """torch_attn::_varlen_attn on the CPU: each span of the flattened tokens attends to its
    own (causal where asked), in fp32, keys and values grouped; (output, logsumexp, rng)."""
    assert torch.equal(cu_seq_q, cu_seq_k) and cu_seq_q.dtype == torch.int32
    # FlashAttention's contract: half precision alone (its CUDA kernel refuses fp32).
    assert query.dtype == key.dtype == value.dtype and query.dtype in (torch.bfloat16, torch.half)
    spans = _spans(cu_seq_q)
    # runner passes the longest span (FlashAttention sizes its grid by it).
    assert max_q == max_k == max(2, max(end - begin for begin, end in spans))
    heads, out = query.shape[1], torch.empty_like(query)
    for begin, end in spans:
        q, k, v = (x[begin:end].float().transpose(0, 1) for x in (query, key, value))
        k, v = (_expanded(x.transpose(0, 1), heads).transpose(0, 1) for x in (k, v))
        out[begin:end] = F.scaled_dot_product_attention(q, k, v, is_causal=is_causal).transpose(
            0, 1
        )
    lse = torch.zeros(heads, query.shape[0])  # unused by reference_backward
    return out, lse, torch.zeros(2, dtype=torch.uint64)


def reference_backward(
    grad_out: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    cu_seq_q: torch.Tensor,
    cu_seq_k: torch.Tensor,
    max_q: int,
    max_k: int,
    is_causal: bool,
    rng_state: torch.Tensor,
    scale: float | None = None,
    window_size: list[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """torch_attn::_varlen_attn_backward on the CPU: softmax attention's gradients, span by
    span in fp32, those of grouped keys and values summed over their query heads."""
    heads, kv_heads, head_dim = query.shape[1], key.shape[1], query.shape[2]
    grads = [torch.zeros(x.shape, dtype=torch.float32) for x in (query, key, value)]
    for begin, end in _spans(cu_seq_q):
        length = end - begin
        q, g = (x[begin:end].float().transpose(0, 1) for x in (query, grad_out))  # [h, l, d]
        k, v = (_expanded(x[begin:end].float(), heads).transpose(0, 1) for x in (key, value))
        scores = q @ k.transpose(1, 2) * head_dim**-0.5
        if is_causal:
            causal = torch.ones(length, length, dtype=torch.bool).tril()
            scores = scores.masked_fill(~causal, float("-inf"))
        p = scores.softmax(-1)
        dv = p.transpose(1, 2) @ g
        dp = g @ v.transpose(1, 2)
        ds = p * (dp - (dp * p).sum(-1, keepdim=True)) * head_dim**-0.5
        dq, dk = ds @ k, ds.transpose(1, 2) @ q
        grads[0][begin:end] = dq.transpose(0, 1)
        for grad, full in ((grads[1], dk), (grads[2], dv)):  # summed over each group's heads
            grad[begin:end] = full.transpose(0, 1).unflatten(1, (kv_heads, -1)).sum(2)
    dq, dk, dv = (grad.to(x.dtype) for grad, x in zip(grads, (query, key, value), strict=True))
    return dq, dk, dv


@pytest.fixture(scope="module")
def varlen_on_the_cpu() -> Iterator[None]:
    """The reference kernels registered for torch's varlen operators on the CPU (this torch
    has no CPU kernel for them; on CUDA its FlashAttention kernels stay as they are)."""
    assert VARLEN_KEYWORDS == {"window_size": (-1, 0), "enable_gqa": True}  # torch 2.13's
    torch.library.register_kernel("torch_attn::_varlen_attn", "cpu", reference_forward)
    torch.library.register_kernel("torch_attn::_varlen_attn_backward", "cpu", reference_backward)
    yield


def test_spans_are_each_samples_first_token_in_the_flattened_rows(tmp_path: Path) -> None:
    """Packs of several samples, the last of each padded (PackedDataset's padding, whose
    positions go on from its last sample's, joins it): the starts are each sample's first
    token counted over the rows laid end to end, then the total; the longest is the longest
    sample's length."""
    packs = pack_rows(make_content_first_samples(tmp_path), padding_idx=0)
    input_pos = torch.stack([p["input_pos"] for p in packs])
    rows, width = input_pos.shape
    lengths = [int(n) for p in packs for n in p["seq_lens"]]
    spans = Spans.of(input_pos, CPU)
    assert spans.starts.dtype == torch.int32
    assert spans.starts.tolist() == [0, *torch.tensor(lengths).cumsum(0).tolist()]
    assert spans.starts[-1] == rows * width and spans.longest.shape == (max(lengths), 0)
    # pack_rows pads a row with a sequence of its own; PackedDataset's padding instead goes on
    # from the row's last sample's positions, and joins that sample: one start fewer.
    row = next(
        r
        for r, pack in enumerate(packs)  # a row ending in padding: two labels ignored, or more
        if len(pack["seq_lens"]) > 1 and (pack["labels"][-2:] == CROSS_ENTROPY_IGNORE_IDX).all()
    )
    pad = int(width - packs[row]["seq_lens"][-1])  # where the padding sequence starts
    continued = input_pos.clone()
    continued[row, pad:] = continued[row, pad - 1] + torch.arange(1, width - pad + 1)
    starts = Spans.of(continued, CPU).starts.tolist()
    assert starts == [s for s in spans.starts.tolist() if s != row * width + pad]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32-eval"])
def test_varlen_attention_is_sdpa_under_the_dense_mask(
    tmp_path: Path, dtype: torch.dtype, varlen_on_the_cpu: None
) -> None:
    """Through torch's varlen_attn, each sample attends to its own earlier tokens alone: what
    SDPA over the whole rows under the dense block-causal mask gives, forward and backward,
    padding included, with as many key heads as query heads and with half as many. bf16 in,
    bf16 out; fp32 (a bf16_mixed run's evaluation, outside autocast) is computed in bf16."""
    input_pos = packed_rows(make_content_first_samples(tmp_path))
    rows, width = input_pos.shape
    spans = RowAttention("varlen", 256).mask(input_pos)
    assert isinstance(spans, Spans)
    mask = dense_block_causal_mask(input_pos)[:, None]
    for kv_heads in (4, 2):
        torch.manual_seed(0)
        # Inputs bf16 can hold, so that both sides start from the same numbers.
        q = torch.randn(rows, 4, width, 8).bfloat16().to(dtype).requires_grad_()
        k, v = (torch.randn(rows, kv_heads, width, 8).bfloat16().to(dtype) for _ in range(2))
        k.requires_grad_(), v.requires_grad_()
        expanded = [x.float().repeat_interleave(4 // kv_heads, dim=1) for x in (k, v)]
        dense = F.scaled_dot_product_attention(q.float(), *expanded, attn_mask=mask)
        dense_grads = torch.autograd.grad(dense.square().sum(), (q, k, v))
        out = spans.attend(q, k, v, dropout_p=0.0)
        assert out.dtype == dtype and out.shape == q.shape
        grads = torch.autograd.grad(out.float().square().sum(), (q, k, v))
        # The output and the gradients rounded to bf16 (8 bits of mantissa): 1e-2.
        torch.testing.assert_close(out.float(), dense, atol=1e-2, rtol=1e-2)
        for got, expected in zip(grads, dense_grads, strict=True):
            torch.testing.assert_close(got.float(), expected.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.long  # compiles
def test_compiled_layers_call_varlen_inside_their_graphs(
    fresh_dynamo: None, varlen_on_the_cpu: None
) -> None:
    """compile=true (each decoder layer compiled, runner.trainer.parallel) with attention=varlen
    on padding-free batches of mixed lengths, each another width, count of rows and longest
    sample: no graph break, no recompile after the first batch (the longest sample is a
    symbolic size, not a number compiled in), and the eager layers' losses."""
    eager, compiled = eager_and_compiled(50)
    varlen = RowAttention("varlen", 256)
    batches = mixed_length_batches(4, varlen)
    longest = [int(Spans.of(b["input_pos"], CPU).longest.shape[0]) for b in batches]
    assert len(set(longest)) == len(batches)  # each batch's longest sample is another
    first = train_steps(compiled, batches[:1], varlen)
    with torch._dynamo.config.patch(error_on_recompile=True):  # raises on any recompile
        rest = train_steps(compiled, batches[1:], varlen)
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    # Another kernel's summation order (inductor's fused matmuls; the same bf16 attention),
    # compounded over the steps: 1e-3.
    torch.testing.assert_close(
        torch.stack(first + rest),
        torch.stack(train_steps(eager, batches, varlen)),
        rtol=1e-3,
        atol=1e-3,
    )


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["attention=sdpa"], "attention='sdpa': choose one of: auto, flex, varlen"),
        (
            ["attention=varlen", "dataset.padding_free=true"],
            "attention='varlen': flex and varlen are CUDA's kernels (on the CPU, rows of several "
            "samples attend per sample); set attention=auto",
        ),
    ],
    ids=["unknown", "on-the-cpu"],
)
def test_an_attention_the_run_cannot_take_is_refused_by_name(
    runner_cli, tmp_path: Path, overrides: list[str], message: str
) -> None:
    result = runner_cli("train", "compute=cpu", *overrides, f"hydra.run.dir={tmp_path / 'run'}")
    assert result.returncode == 2, result.stderr[-2000:]
    assert message in result.stderr
    assert not (tmp_path / "run" / "recipe.yaml").exists()


@pytest.mark.gpu
def test_varlen_trains_as_flex_attention_on_cuda(tmp_path: Path) -> None:
    """The kernel itself: a bf16 forward and backward of the tiny Llama on CUDA over packs of
    several samples, attending through varlen and through flex attention (CUDA's default):
    the same loss and gradients, to bf16's rounding."""
    from runner.data.transforms import collate

    cuda = torch.device("cuda")
    packs = pack_rows(make_content_first_samples(tmp_path), padding_idx=0)
    batch = collate(packs, packed=True, padding_idx=0)
    torch.manual_seed(0)
    model = tiny_llama(int(batch["tokens"].max()) + 1).to(cuda, torch.bfloat16)
    assert RowAttention.of(model, cuda, "varlen") == RowAttention("varlen", 256)
    results = []
    for attention in (RowAttention("flex", None), RowAttention("varlen", 256)):
        logits = model(batch["tokens"].to(cuda), **attention.inputs(batch, cuda))
        loss = F.cross_entropy(logits.flatten(0, 1).float(), batch["labels"].to(cuda).flatten())
        grads = torch.autograd.grad(loss, list(model.parameters()))
        results.append((loss.detach(), grads))
    (flex_loss, flex_grads), (varlen_loss, varlen_grads) = results
    # Two bf16 kernels, each rounding its output and gradients to 8 bits of mantissa.
    torch.testing.assert_close(varlen_loss, flex_loss, rtol=1e-2, atol=1e-2)
    for got, expected in zip(varlen_grads, flex_grads, strict=True):
        torch.testing.assert_close(got.float(), expected.float(), rtol=5e-2, atol=5e-2)


# What CUDA's checks see (runner.config.dataset.kernel_refusal, fed from torch and the GPU there).
H100 = {"family": "llama3_2", "block_mask": True, "dtype": "bf16_mixed", "capability": (9, 0)}
H100 |= {"torch_version": "2.13.0", "has_flex": True, "has_varlen": True}


@pytest.mark.parametrize(
    ("attention", "changed", "refusal"),
    [
        ("varlen", {}, None),
        ("flex", {}, None),
        ("varlen", {"dtype": "bf16"}, None),
        ("flex", {"capability": (7, 5)}, None),
        (
            "varlen",
            {"dtype": "fp32"},
            "FlashAttention computes in bf16: set dtype=bf16_mixed or dtype=bf16, or "
            "attention=auto",
        ),
        (
            "varlen",
            {"capability": (7, 5)},
            "FlashAttention needs compute capability 8.0 or more, and this GPU's is 7.5; set "
            "attention=auto",
        ),
        (
            "flex",
            {"capability": (7, 0), "has_flex": False},
            "flex attention needs compute capability 7.5 or more, and this GPU's is 7.0; set "
            "attention=auto",
        ),
        (
            "varlen",
            {"has_varlen": False, "torch_version": "2.9.1"},
            "torch 2.9.1 has no torch.nn.attention.varlen (2.10 and later have it); set "
            "attention=auto",
        ),
        (
            "flex",
            {"family": "gemma2", "block_mask": False},
            "torchtune's gemma2 attention does its own arithmetic on a dense mask, which it "
            "always gets; set attention=auto",
        ),
        # No GPU here (runner estimate pricing a GPU layout): what the GPU decides is left to it.
        ("varlen", {"capability": None, "has_flex": False}, None),
        ("flex", {"capability": None, "has_flex": False}, None),
        (
            "varlen",
            {"capability": None, "has_flex": False, "dtype": "fp32"},
            "FlashAttention computes in bf16: set dtype=bf16_mixed or dtype=bf16, or "
            "attention=auto",
        ),
    ],
    ids=[
        "varlen",
        "flex",
        "varlen-bf16",
        "flex-turing",
        "fp32",
        "turing",
        "volta",
        "old-torch",
        "gemma2",
        "varlen-no-gpu-here",
        "flex-no-gpu-here",
        "fp32-no-gpu-here",
    ],
)
def test_what_cuda_refuses_of_each_kernel_and_why(
    attention: str, changed: dict[str, object], refusal: str | None
) -> None:
    from runner.config.dataset import kernel_refusal

    assert kernel_refusal(attention, **(H100 | changed)) == refusal  # type: ignore[arg-type]
