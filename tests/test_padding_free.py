"""Padding-free rows and packs: they train what padded batches train, and their attention
(per sample on the CPU, a dense mask for Gemma 2, a flex-attention BlockMask on CUDA) keeps each
sample to itself."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from torchtune.modules.attention_utils import create_block_causal_mask  # the reference

from runner.data.transforms import InstructToMessages, collate, forward_parts, pack_rows
from runner.models.attention import (
    RowAttention,
    Samples,
    dense_block_causal_mask,
)
from runner.models.tokenizer import ChatTokenizer
from runner.models.torchtune_boundary import (
    CROSS_ENTROPY_IGNORE_IDX,
    SFTTransform,
    gemma2_builders,
    llama3_2_builders,
)
from runner.paths import TINY_TOKENIZER_DIR

CPU = torch.device("cpu")
# A template with no header: the first message's content is the first token.
CONTENT_FIRST = "{% for message in messages %}{{ message['content'] }}\n{% endfor %}"
WORDS = ["ab", "cde", "fg hij", "k", "lmnop qr st", "uv", "wxyz a b c", "de"]


def tiny_llama(vocab_size: int) -> torch.nn.Module:
    """A two-layer Llama 3.2 of width 32 (grouped-query attention, as the real ones)."""
    return llama3_2_builders.llama3_2(
        vocab_size=vocab_size, num_layers=2, num_heads=4, num_kv_heads=2, embed_dim=32,
        intermediate_dim=64, max_seq_len=256,
    )  # fmt: skip


@pytest.fixture
def content_first_samples(tmp_path: Path) -> list[dict[str, Any]]:
    return make_content_first_samples(tmp_path)


def make_content_first_samples(tmp_path: Path) -> list[dict[str, Any]]:
    """Instruct samples of mixed lengths with train_on_input=true under CONTENT_FIRST: each
    sample's first token is trained (its label is not the ignore index)."""
    template = tmp_path / "content_first.jinja"
    template.write_text(CONTENT_FIRST)
    tokenizer = ChatTokenizer(str(TINY_TOKENIZER_DIR), chat_template=str(template))
    columns = {"instruction": "instruction", "input": None, "output": "output"}
    transform = SFTTransform(InstructToMessages(columns, True, None), tokenizer)
    samples = [
        transform({"instruction": f"Reverse: {words}", "output": words[::-1]}) for words in WORDS
    ]
    assert all(int(s["labels"][0]) == s["tokens"][0] for s in samples)
    return samples


def tiny_gemma2(vocab_size: int) -> torch.nn.Module:
    return gemma2_builders.gemma2(
        vocab_size=vocab_size, num_layers=1, num_heads=2, head_dim=8, num_kv_heads=1,
        embed_dim=16, intermediate_dim=32, max_seq_len=64,
    )  # fmt: skip


# How the padding-free rows are laid out and attended: one row with attention per sample (the
# CPU's default for torchtune's attention), rows of at most 40 tokens (a model that takes no
# longer: several rows, padded to the fullest) attended per sample, and rows as long as the
# longest sample under the dense mask (Gemma 2's attention).
LAYOUTS = {"one-row": (256, "samples"), "rows-of-40": (40, "samples"), "dense": (None, "dense")}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_padding_free_trains_as_padded_when_a_samples_first_token_trains(
    content_first_samples: list[dict[str, Any]], layout: str
) -> None:
    """No sample's first token is a target of the previous sample's last token in its row, and
    no position attends to another sample's: the same trained tokens, loss and gradients as the
    padded batch (one step of the tiny model, on the CPU in fp32)."""
    torch.manual_seed(0)
    model = tiny_llama(vocab_size=ChatTokenizer(str(TINY_TOKENIZER_DIR)).vocab_size)
    row_limit, kind = LAYOUTS[layout]
    attention = RowAttention.of(model, CPU)
    assert attention == RowAttention("samples", 256)
    attention = RowAttention(kind, row_limit)
    pad_id = 0

    def loss_and_grads(padding_free: bool) -> tuple[torch.Tensor, int, list[torch.Tensor]]:
        batch = collate(
            content_first_samples,
            packed=False,
            padding_free=padding_free,
            padding_idx=pad_id,
            row_limit=row_limit,
        )
        if padding_free:  # the case under test: rows of several samples
            rows, width = batch["tokens"].shape
            assert rows < len(content_first_samples)
            assert (rows == 1) == (layout == "one-row")
            assert row_limit is None or width <= row_limit
        logits = model(batch["tokens"], **attention.inputs(batch, CPU))
        labels = batch["labels"].reshape(-1)
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.size(-1)), labels, ignore_index=CROSS_ENTROPY_IGNORE_IDX
        )
        model.zero_grad()
        loss.backward()
        trained = int((labels != CROSS_ENTROPY_IGNORE_IDX).sum())
        return loss.detach(), trained, [p.grad.clone() for p in model.parameters()]

    padded_loss, padded_tokens, padded_grads = loss_and_grads(False)
    free_loss, free_tokens, free_grads = loss_and_grads(True)
    assert free_tokens == padded_tokens
    # The same sums over other row shapes: float32 adds in another order (1e-5 relative).
    torch.testing.assert_close(free_loss, padded_loss, rtol=1e-5, atol=1e-6)
    for free, padded in zip(free_grads, padded_grads, strict=True):
        torch.testing.assert_close(free, padded, rtol=1e-4, atol=1e-6)


def test_rows_hold_the_batch_in_as_few_and_as_short_rows_as_the_limit_allows(
    content_first_samples: list[dict[str, Any]],
) -> None:
    lengths = sorted(len(s["tokens"]) for s in content_first_samples)
    total = sum(lengths)
    (one_row,) = pack_rows(content_first_samples, padding_idx=0, row_limit=total)
    assert one_row["seq_lens"].tolist() == sorted(lengths, reverse=True)  # nothing padded
    limit = lengths[-1] + 3
    limited = pack_rows(content_first_samples, padding_idx=0, row_limit=limit)
    (width,) = {len(row["tokens"]) for row in limited}
    assert lengths[-1] <= width <= limit and len(limited) > 1
    # Every sample whole in some row, and the rest of each row one padding sequence.
    segments = Counter(n for row in limited for n in row["seq_lens"].tolist())
    assert not Counter(lengths) - segments
    assert sum((segments - Counter(lengths)).elements()) == len(limited) * width - total
    unlimited = pack_rows(content_first_samples, padding_idx=0)
    assert {len(row["tokens"]) for row in unlimited} == {lengths[-1]}
    # compile=true's gathered attention asks for 2 rows at the least (RowAttention.min_rows):
    # two about half as long where one would hold them all; one a sample where there are fewer.
    halves = pack_rows(content_first_samples, padding_idx=0, row_limit=total, min_rows=2)
    assert len(halves) == 2 and len(halves[0]["tokens"]) < total * 0.5 + lengths[-1]
    pair = content_first_samples[:2]
    assert len(pack_rows(pair, padding_idx=0, row_limit=total, min_rows=3)) == 2


def test_a_samples_first_label_is_ignored_in_packs_too(
    content_first_samples: list[dict[str, Any]],
) -> None:
    """PackedDataset's packs (samples' positions restarting at 0) lose the same targets."""
    packs = pack_rows(content_first_samples, padding_idx=0)
    batch = collate(packs, packed=True, padding_idx=0)
    starts = batch["input_pos"] == 0
    # Shifted: the position before each sample's first token (and each row's last) trains none.
    before_start = torch.hstack((starts[:, 1:], torch.ones_like(starts[:, :1])))
    assert (batch["labels"][before_start] == CROSS_ENTROPY_IGNORE_IDX).all()
    assert (batch["labels"] != CROSS_ENTROPY_IGNORE_IDX).any()


def test_the_dense_mask_from_positions_is_torchtunes(
    content_first_samples: list[dict[str, Any]],
) -> None:
    packs = pack_rows(content_first_samples, padding_idx=0)
    input_pos = torch.stack([p["input_pos"] for p in packs])
    expected = create_block_causal_mask([p["seq_lens"] for p in packs])
    assert torch.equal(dense_block_causal_mask(input_pos), expected)


def packed_rows(samples: list[dict[str, Any]]) -> torch.Tensor:
    """input_pos of rows as long as the longest sample: several samples a row, and padding."""
    packs = pack_rows(samples, padding_idx=0)
    assert any(len(p["seq_lens"]) > 1 for p in packs) and any(
        p["labels"][-1] == CROSS_ENTROPY_IGNORE_IDX for p in packs
    )
    return torch.stack([p["input_pos"] for p in packs])


def test_attention_per_sample_is_sdpa_under_the_dense_mask(
    content_first_samples: list[dict[str, Any]],
) -> None:
    """SDPA on each sample's span alone gives what SDPA over the whole rows under the dense
    block-causal mask gives, forward and backward, padding included."""
    input_pos = packed_rows(content_first_samples)
    samples = Samples.of(input_pos)
    rows, width = input_pos.shape
    assert len(samples.rows) == rows
    for runs in samples.rows:  # each row covered, in order, by runs of equal-length samples
        ends = [start + length * count for start, length, count in runs]
        assert [start for start, _, _ in runs] == [0, *ends[:-1]] and ends[-1] == width
        assert all(a[1] != b[1] for a, b in zip(runs, runs[1:], strict=False))
    # pack_rows puts the samples longest first: those of one length share a run.
    assert any(count > 1 for runs in samples.rows for _, _, count in runs)
    assert_attends_as_the_dense_mask(samples.attend, input_pos)


def assert_attends_as_the_dense_mask(attend: Any, input_pos: torch.Tensor) -> None:
    """`attend(q, k, v, dropout_p=0.0)` over rows of `input_pos` gives what SDPA over the whole
    rows under the dense block-causal mask gives, forward and backward: with as many key and
    value heads as query heads, and with half as many (grouped-query attention, each key and
    value head serving two query heads in a row)."""
    rows, width = input_pos.shape
    mask = dense_block_causal_mask(input_pos)[:, None]
    for kv_heads in (4, 2):
        torch.manual_seed(0)
        q = torch.randn(rows, 4, width, 8, requires_grad=True)
        k, v = (torch.randn(rows, kv_heads, width, 8, requires_grad=True) for _ in range(2))
        expanded = [x.repeat_interleave(4 // kv_heads, dim=1) for x in (k, v)]
        dense = torch.nn.functional.scaled_dot_product_attention(q, *expanded, attn_mask=mask)
        dense_grads = torch.autograd.grad(dense.square().sum(), (q, k, v))
        out = attend(q, k, v, dropout_p=0.0)
        grads = torch.autograd.grad(out.square().sum(), (q, k, v))
        # Other kernels, other summation order: float32 to 1e-5.
        torch.testing.assert_close(out, dense, atol=1e-5, rtol=1e-5)
        for got, expected in zip(grads, dense_grads, strict=True):
            torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


# flex attention without torch.compile runs unfused, and says so: a forward on a few rows.
@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_the_block_mask_attends_as_the_dense_mask(
    content_first_samples: list[dict[str, Any]],
) -> None:
    """The BlockMask that CUDA gets, built here on the CPU: flex attention over it (forward:
    this torch has no CPU backward for flex) equals SDPA over the dense mask."""
    from torch.nn.attention.flex_attention import BlockMask, flex_attention

    input_pos = packed_rows(content_first_samples)
    block = RowAttention("flex", None).mask(input_pos)
    assert isinstance(block, BlockMask)
    rows, width = input_pos.shape
    torch.manual_seed(0)
    q, k, v = (torch.randn(rows, 2, width, 8) for _ in range(3))
    dense = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=dense_block_causal_mask(input_pos)[:, None]
    )
    # Other kernels, other summation order: float32 to 1e-5.
    torch.testing.assert_close(
        flex_attention(q, k, v, block_mask=block), dense, atol=1e-5, rtol=1e-5
    )


def test_how_each_model_attends_within_rows_on_the_cpu() -> None:
    """torchtune's attention runs per sample, in rows as long as the model takes; Gemma 2's own
    attention and any other model take the dense mask, in rows as long as their longest
    sample. Each attention module is given the per-sample call once, however often asked."""
    llama = tiny_llama(vocab_size=64)
    assert RowAttention.of(llama, CPU) == RowAttention("samples", 256)
    calls = [m._attention_call for m in llama.modules() if hasattr(m, "_attention_call")]
    assert len(calls) == 2 and all(hasattr(c, "torchtune_call") for c in calls)
    RowAttention.of(llama, CPU)
    assert calls == [m._attention_call for m in llama.modules() if hasattr(m, "_attention_call")]
    assert RowAttention.of(tiny_gemma2(vocab_size=64), CPU) == RowAttention("dense", None)
    assert RowAttention.of(torch.nn.Linear(2, 2), CPU) == RowAttention("dense", None)


@pytest.mark.gpu
def test_cuda_takes_a_block_mask_except_for_gemma2() -> None:
    cuda = torch.device("cuda")
    assert RowAttention.of(tiny_llama(vocab_size=64), cuda) == RowAttention("flex", None)
    assert RowAttention.of(tiny_gemma2(vocab_size=64), cuda) == RowAttention("dense", None)


@dataclass
class Step:
    """What one_step saw: the step's loss, the weights after it, its forward passes (their
    [rows, width]), the tokens it counts for tokens/s, and with `evaluate` the eval_loss after
    it and the evaluation's passes."""

    loss: torch.Tensor
    weights: list[torch.Tensor]
    forwards: list[tuple[int, int]]
    tokens: float
    eval_loss: float | None = None
    eval_forwards: list[tuple[int, int]] | None = None


def one_step(
    samples: list[dict[str, Any]],
    max_forward_tokens: int | None,
    *,
    evaluate: bool = False,
) -> Step:
    """One optimizer step (SGD, lr 1: the weights move by the step's gradient) of the
    supervised objective over `samples` as one padding-free batch. In a process group already
    joined, this process is placed, and the model sharded, as runner does it. With
    `evaluate`, the same samples are then evaluated as the validation split."""
    from omegaconf import OmegaConf

    from runner.models.backends.torchtune import TorchtuneBackend
    from runner.trainer.objectives import Supervised
    from runner.trainer.optimization import Optimization
    from runner.trainer.parallel import placement, prepare_model

    torch.manual_seed(0)
    tokenizer = ChatTokenizer(str(TINY_TOKENIZER_DIR))
    model = tiny_llama(tokenizer.vocab_size)
    place = placement("cpu", "fp32", collective_timeout_s=60)
    if place.world_size > 1:
        prepare_model(
            model, TorchtuneBackend(None), place, activation_checkpointing=False, compile=False
        )
    dataset = {"packing": False, "padding_free": True, "max_forward_tokens": max_forward_tokens}
    objective = Supervised(
        place,
        tokenizer,
        dataset=OmegaConf.create(dataset),
        method=OmegaConf.create({}),
    )
    objective.attach(model, torch.nn.CrossEntropyLoss(ignore_index=-100), None)
    sgd = {"_component_": "torch.optim.SGD", "lr": 1.0, "warmup_steps": 0, "cosine_decay": False}
    optim = Optimization(
        OmegaConf.create(sgd), model.parameters(), total_steps=1, clip_grad_norm=None
    )
    forwards: list[tuple[int, int]] = []
    model.register_forward_pre_hook(lambda _, args: forwards.append(tuple(args[0].shape)))
    loss, tokens = objective.step([objective.collate(samples)], optim)
    weights = [getattr(p, "full_tensor", p.detach)().detach().clone() for p in model.parameters()]
    step = Step(loss, weights, list(forwards), float(tokens))
    if evaluate:
        shares = iter([(samples, len(samples))])
        evaluated = objective.eval_metrics(shares, None, wanted=["eval_loss"])
        step.eval_loss, step.eval_forwards = evaluated["eval_loss"], forwards[len(step.forwards) :]
    return step


def test_a_batch_over_max_forward_tokens_runs_in_parts_with_the_same_step(
    content_first_samples: list[dict[str, Any]],
) -> None:
    whole = one_step(content_first_samples, None)
    cap = max(len(s["tokens"]) for s in content_first_samples) + 4
    parts = one_step(content_first_samples, cap)
    assert len(whole.forwards) == 1 and len(parts.forwards) > 1
    assert all(rows * width <= cap for rows, width in parts.forwards)
    # The same sums in another grouping: fp32 rounding of the loss and of each gradient.
    assert torch.allclose(whole.loss, parts.loss, rtol=1e-6)
    for want, got in zip(whole.weights, parts.weights, strict=True):
        assert torch.allclose(want, got, rtol=1e-5, atol=1e-6)


def test_forward_parts_take_whole_rows_up_to_the_cap() -> None:
    batch = {"tokens": torch.zeros(5, 10), "labels": torch.ones(5, 10)}
    assert forward_parts(batch, None) == [batch] and forward_parts(batch, 50) == [batch]
    assert [p["tokens"].shape[0] for p in forward_parts(batch, 25)] == [2, 2, 1]
    assert [p["labels"].shape[0] for p in forward_parts(batch, 7)] == [1] * 5  # a row alone


def _rank_step(rank: int, port: int, out: Path, cap: int | None) -> None:
    """Rank `rank` of two gloo processes on loopback: one capped step over its share of the
    samples (rank 0 the first two, rank 1 the other six), saved to out/rank{rank}.pt."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        samples = make_content_first_samples(out)
        share = samples[:2] if rank == 0 else samples[2:]
        torch.save(one_step(share, cap, evaluate=True), out / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_max_forward_tokens_with_two_processes_keeps_the_ranks_in_step(tmp_path: Path) -> None:
    # Two real processes sharded by FSDP2: rank 1's six samples need more capped forward passes
    # than rank 0's two, so rank 0 runs passes that train nothing to meet its collectives, in
    # the step and in the evaluation after it. The step is still one process's step over all
    # eight samples (a per-token mean), and the evaluation one process's evaluation.
    import torch.multiprocessing as mp

    from tests.conftest import free_port

    samples = make_content_first_samples(tmp_path)
    cap = max(len(s["tokens"]) for s in samples) + 4
    processes = mp.spawn(_rank_step, args=(free_port(), tmp_path, cap), nprocs=2, join=False)
    deadline = time.monotonic() + 120
    while not processes.join(timeout=5):
        if time.monotonic() > deadline:  # a rank waits in a collective the other never joins
            for process in processes.processes:
                process.kill()
            pytest.fail("the two ranks did not finish one step in 120 s")
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1)]
    alone = one_step(samples[:2], cap)  # rank 0's share in a process of its own
    assert len(ranks[0].forwards) == len(ranks[1].forwards) > len(alone.forwards)
    # tokens/s counts every rank's own positions (it was rank 0's times two).
    both = alone.tokens + one_step(samples[2:], cap).tokens
    assert ranks[0].tokens == ranks[1].tokens == both != 2 * alone.tokens
    assert len(ranks[0].eval_forwards) == len(ranks[1].eval_forwards)
    whole = one_step(samples, None, evaluate=True)
    for rank in ranks:
        # The same sums in another grouping and order: fp32 rounding.
        assert torch.allclose(rank.loss, whole.loss, rtol=1e-6)
        for want, got in zip(whole.weights, rank.weights, strict=True):
            assert torch.allclose(want, got, rtol=1e-5, atol=1e-6)
        assert rank.eval_loss == pytest.approx(whole.eval_loss, rel=1e-5)


def test_a_forward_pass_with_no_trained_token_adds_nothing(
    content_first_samples: list[dict[str, Any]],
) -> None:
    # The longest sample, its answer cut off: no label trained, so the whole batch's loss is
    # the others' alone; capped, it is a forward pass of its own whose mean would be nan.
    longest = max(content_first_samples, key=lambda s: len(s["tokens"]))
    untrained = {**longest, "tokens": longest["tokens"] * 2}
    untrained["labels"] = [CROSS_ENTROPY_IGNORE_IDX] * len(untrained["tokens"])
    samples = [untrained, *content_first_samples]
    whole = one_step(samples, None)
    parts = one_step(samples, len(untrained["tokens"]))
    assert parts.forwards[0] == (1, len(untrained["tokens"]))  # the untrained sample's own pass
    assert torch.isfinite(parts.loss) and torch.allclose(whole.loss, parts.loss, rtol=1e-6)
    for want, got in zip(whole.weights, parts.weights, strict=True):
        assert torch.allclose(want, got, rtol=1e-5, atol=1e-6)
