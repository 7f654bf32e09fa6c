"""Packed rows under compile=true: each decoder layer's attention is inside its compiled graph
(no graph break, torch._dynamo's own count), a new batch's samples recompile nothing, and the
attention still keeps each sample to itself (the dense block-causal mask's result)."""

from __future__ import annotations

import copy
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from torch._dynamo.utils import counters

from runner.data.transforms import collate, pack_rows
from runner.models.attention import BUCKETS, Gathered, RowAttention, buckets
from runner.models.torchtune_boundary import CROSS_ENTROPY_IGNORE_IDX
from tests.test_padding_free import (
    CPU,
    assert_attends_as_the_dense_mask,
    make_content_first_samples,
    packed_rows,
    tiny_llama,
)


def graph_breaks() -> int:
    return sum(counters["graph_break"].values())


def test_gathered_attention_is_sdpa_under_the_dense_mask(tmp_path: Path) -> None:
    """Each sample gathered into a bucket of like length, padded to the bucket's longest, and
    scattered back gives what SDPA over the whole rows under the dense block-causal mask
    gives, forward and backward, padding included."""
    input_pos = packed_rows(make_content_first_samples(tmp_path))
    rows, width = input_pos.shape
    gathered = Gathered.of(input_pos)
    samples = int((input_pos == 0).sum())
    assert samples > rows  # several samples a row
    assert len(gathered.gathers) == min(BUCKETS, samples // 2) > 1
    assert sum(len(gather) for gather in gathered.gathers) == samples
    widths = [gather.shape[1] for gather in gathered.gathers]
    assert widths == sorted(widths) and widths[-1] == width  # the longest fills one row
    assert_attends_as_the_dense_mask(gathered.attend, input_pos)


def test_buckets_hold_every_sample_at_least_two_a_bucket_padding_least() -> None:
    """bench_peers' kind of batch (a long right tail of lengths): the buckets pad the attention
    (size x longest squared) to a few percent over the samples' own, where one batch padded to
    its longest computes 4 times it; every bucket holds 2 or more (a size of 1 is a graph of
    its own), and every sample is in one bucket."""
    lengths = [182, 18, 97, 55, 26, 155, 64, 32, 109, 59, 70, 67, 101, 62, 78, 56]
    groups = buckets(lengths)
    assert sorted(i for group in groups for i in group) == list(range(len(lengths)))
    assert len(groups) == BUCKETS and all(len(group) >= 2 for group in groups)

    def padded(groups: list[list[int]]) -> int:
        return sum(len(g) * max(lengths[i] for i in g) ** 2 for g in groups)

    own = sum(length**2 for length in lengths)
    assert padded([list(range(len(lengths)))]) > 4 * own
    assert padded(groups) < 1.25 * own
    # Fewer samples than two a bucket: fewer buckets; one sample: one bucket of it.
    assert buckets([3, 9, 4, 1, 5]) == [[3, 0, 2], [4, 1]]
    assert buckets([7]) == [[0]]


WIDTH = 48  # each pack's tokens, as PackedDataset's packs are all dataset.max_seq_len long


def to_width(pack: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The pack padded to WIDTH tokens, the padding one more sequence (as pack_rows pads)."""
    free = WIDTH - len(pack["tokens"])
    tail = {
        "tokens": torch.zeros(free, dtype=torch.long),
        "labels": torch.full((free,), CROSS_ENTROPY_IGNORE_IDX),
        "input_pos": torch.arange(free),
        "seq_lens": torch.tensor([free]),
    }
    return {key: torch.cat((pack[key], tail[key])) for key in pack} if free else pack


def packed_batches(samples: list[dict[str, Any]], steps: int) -> list[dict[str, Any]]:
    """`steps` batches of two packs of WIDTH tokens, each of other samples (rotated)."""
    batches = []
    for step in range(steps):
        turned = samples[step:] + samples[:step]
        packs = pack_rows(turned[: len(samples) - step % 2], padding_idx=0, row_limit=WIDTH)
        batches.append(collate([to_width(p) for p in packs[:2]], packed=True, padding_idx=0))
    return batches


def train_steps(
    model: torch.nn.Module, batches: list[dict[str, Any]], attention: RowAttention | None = None
) -> list[torch.Tensor]:
    """One SGD step per batch on the CPU in fp32, the rows attending as the CPU's default
    does or as `attention` asks; each step's loss."""
    default = RowAttention.of(model, CPU)  # the attention modules get runner's call
    attention = attention or default
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for batch in batches:
        logits = model(batch["tokens"], **attention.inputs(batch, CPU))
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())
        loss.backward()  # type: ignore[no-untyped-call]
        sgd.step()
        sgd.zero_grad()
        losses.append(loss.detach())
    return losses


def eager_and_compiled(vocab_size: int) -> tuple[torch.nn.Module, torch.nn.Module]:
    """Two tiny Llamas of the same weights on the CPU in fp32: one eager, one whose decoder
    layers are compiled as runner's compile=true compiles them (runner.trainer.parallel)."""
    from runner.models.backends.torchtune import TorchtuneBackend
    from runner.trainer.parallel import Placement, prepare_model

    torch.manual_seed(0)
    eager = tiny_llama(vocab_size)
    compiled = tiny_llama(vocab_size)
    compiled.load_state_dict(eager.state_dict())
    place = Placement(0, 1, CPU, torch.float32, torch.float32)
    prepare_model(
        compiled, TorchtuneBackend(None), place, activation_checkpointing=False, compile=True
    )
    return eager, compiled


@pytest.mark.long  # compiles
def test_compiled_packed_steps_break_no_graph_and_recompile_nothing(
    tmp_path: Path, fresh_dynamo: None
) -> None:
    """runner's compile=true (each decoder layer compiled, runner.trainer.parallel) on packs of
    other samples at each step: no graph break, no recompile after the first step, and the
    eager per-sample attention's losses (compute=cpu dtype=fp32)."""
    samples = make_content_first_samples(tmp_path)
    batches = packed_batches(samples, steps=3)
    starts = [b["input_pos"].eq(0).nonzero().tolist() for b in batches]
    assert starts[0] != starts[1] != starts[2]  # the samples lie elsewhere at each step
    eager, compiled = eager_and_compiled(max(int(b["tokens"].max()) for b in batches) + 1)
    assert RowAttention.of(compiled, CPU).kind == "gathered"
    assert RowAttention.of(eager, CPU).kind == "samples"

    first = train_steps(compiled, batches[:1])
    assert graph_breaks() == 0, dict(counters["graph_break"])
    with torch._dynamo.config.patch(error_on_recompile=True):  # raises on any recompile
        rest = train_steps(compiled, batches[1:])
    assert graph_breaks() == 0, dict(counters["graph_break"])
    # Another kernel's summation order (one SDPA over padded samples, inductor's fused
    # matmuls), compounded over three steps: float32 to 1e-4.
    torch.testing.assert_close(
        torch.stack(first + rest), torch.stack(train_steps(eager, batches)), rtol=1e-4, atol=1e-5
    )


def mixed_length_batches(steps: int, attention: RowAttention) -> list[dict[str, Any]]:
    """`steps` padding-free batches (the default layout) of 13 or 16 samples whose lengths
    have a long right tail (log-normal, 2-200 tokens, as bench_peers' mixed data), each in
    the rows that `attention` takes (the tiny Llama's: at most 256 tokens, at least 2 rows
    where compiled): 2 to 4 rows a batch, of another width each."""
    rng = random.Random(0)
    batches = []
    for step in range(steps):
        samples = []
        for _ in range(16 if step % 3 else 13):
            tokens = [rng.randrange(1, 50) for _ in range(int(rng.lognormvariate(3.5, 0.8)))]
            tokens = tokens[:200] or [1, 2]
            samples.append({"tokens": tokens, "labels": tokens})
        batches.append(
            collate(
                samples,
                packed=False,
                padding_idx=0,
                padding_free=True,
                row_limit=attention.row_limit,
                min_rows=attention.min_rows,
            )
        )
    return batches


@pytest.mark.long  # compiles
def test_compiled_mixed_lengths_compile_once(fresh_dynamo: None) -> None:
    """compile=true on padding-free batches of mixed lengths, whose samples the attention
    gathers into buckets of like length: the first batch's graph serves every later one
    (other widths, another count of rows, other buckets' sizes: all symbolic from the first;
    the old code compiled again at the second step, and at the first batch of another count
    of rows), breaks no graph, and gives the eager per-sample losses."""
    eager, compiled = eager_and_compiled(50)
    batches = mixed_length_batches(6, RowAttention.of(compiled, CPU))
    assert len({b["tokens"].shape[0] for b in batches}) > 1  # the count of rows changes
    assert len({b["tokens"].shape[1] for b in batches}) == len(batches)  # and every width
    first = train_steps(compiled, batches[:1])
    with torch._dynamo.config.patch(error_on_recompile=True):  # raises on any recompile
        rest = train_steps(compiled, batches[1:])
    assert graph_breaks() == 0, dict(counters["graph_break"])
    # As in the packed test above: float32 to 1e-4 over the steps.
    torch.testing.assert_close(
        torch.stack(first + rest), torch.stack(train_steps(eager, batches)), rtol=1e-4, atol=1e-5
    )


def test_a_compiled_layer_calls_flex_attention_inside_its_graph(
    tmp_path: Path, fresh_dynamo: None
) -> None:
    """CUDA's way, checked here: a compiled layer given the flex-attention BlockMask attends in
    its own graph (torchtune's call wraps flex attention in torch.compiler.disable, a break in
    each layer), recompiles for no new batch of packs, and equals the dense mask's SDPA.
    Forward only and traced without inductor: this torch has no CPU backward for flex
    attention, and inductor's CPU flex kernel is not the CUDA one under test."""
    samples = make_content_first_samples(tmp_path)
    batches = packed_batches(samples, steps=2)
    vocab = max(int(b["tokens"].max()) for b in batches) + 1
    torch.manual_seed(0)
    model = tiny_llama(vocab).eval()
    for layer in model.layers:
        layer.compile(backend="aot_eager")
    RowAttention.of(model, CPU)  # the attention modules get runner's call
    flex = RowAttention("flex", None)
    reference = RowAttention("dense", None)
    with torch.no_grad():
        for step, batch in enumerate(batches):
            with torch._dynamo.config.patch(error_on_recompile=step > 0):
                out = model(batch["tokens"], **flex.inputs(batch, CPU))
            model_dense = model(batch["tokens"], **reference.inputs(batch, CPU))
            # Other kernels, other summation order: float32 to 1e-5.
            torch.testing.assert_close(out, model_dense, atol=1e-5, rtol=1e-5)
    assert graph_breaks() == 0, dict(counters["graph_break"])


@pytest.mark.long  # compiles
def test_runner_train_compiled_with_packing_logs_no_graph_break(runner_cli, tmp_path: Path) -> None:
    """The issue's command, shorter: `runner train compile=true dataset.packing=true` on the CPU
    logs torch._dynamo's counts at its last step, no graph break among them (the old per-sample
    attention broke each layer's graph; `TORCH_LOGS=graph_breaks` showed it at its call)."""
    from tests.conftest import QUICK

    run = tmp_path / "run"
    result = runner_cli(
        "train",
        *QUICK,
        "compile=true",
        "dataset.packing=true",
        "dataset.max_seq_len=256",
        "batch_size=2",
        "max_steps=3",
        "eval.strategy=no",
        "dataset.eval_samples=0",
        f"hydra.run.dir={run}",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    log = (run / "train.log").read_text()
    # One graph for the decoder layers (all alike), one for the compiled loss: none per step.
    assert "compiled: 0 graph breaks, 2 graphs compiled" in log, log[-2000:]


# Uncompiled, flex attention would say so and run unfused: that warning fails the test.
@pytest.mark.filterwarnings("error:flex_attention called without torch.compile")
@pytest.mark.parametrize(
    "compiled",
    [
        # Inductor compiles flex attention's own graphs on the CPU (tens of seconds): long.
        pytest.param(False, id="eager layers", marks=pytest.mark.long),
        pytest.param(True, id="compiled layers"),
    ],
)
def test_flex_attention_holds_its_graphs_through_padding_free_batches(
    compiled: bool, fresh_dynamo: None
) -> None:
    """CUDA's way with the default padding-free rows, each batch another width and count of
    rows (forward only, checked here: this torch has no CPU backward for flex attention). Flex
    attention stays compiled through a dozen shapes, in graphs of its own beside eager layers
    (torchtune's, compiled for one shape at a time, ran unfused from the ninth) or in the
    compiled layers' graphs, a handful of graphs in all (the first shape's, the symbolic one
    after it, one row's), and equals the dense mask's SDPA."""
    torch.manual_seed(0)
    reference = tiny_llama(50).eval()  # the dense mask, uncompiled: no graph of its own
    model = copy.deepcopy(reference)
    if compiled:
        for layer in model.layers:
            layer.compile(backend="aot_eager")
    RowAttention.of(model, CPU)  # the attention modules get runner's call
    flex, dense = RowAttention("flex", None), RowAttention("dense", None)
    batches = mixed_length_batches(12, flex)
    assert len({b["tokens"].shape[1] for b in batches}) > 8  # past dynamo's limit of 8 shapes
    with torch.no_grad():
        for batch in batches:
            out = model(batch["tokens"], **flex.inputs(batch, CPU))
            expected = reference(batch["tokens"], **dense.inputs(batch, CPU))
            # Other kernels, other summation order: float32 to 1e-5.
            torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    assert counters["stats"]["unique_graphs"] <= 3, dict(counters["stats"])
    assert graph_breaks() == 0, dict(counters["graph_break"])
