"""`runner validate` and `runner estimate`: what they print is what a run would be and need."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from runner.components import instantiate
from runner.config.resolve import resolve_recipe
from runner.data import train_dataset
from runner.job.preflight import estimate
from tests.conftest import ESTIMATE_DATA
from tests.test_config import compose_train


def test_validate_prints_the_recipe_and_checks_and_writes_nothing(runner_cli, tmp_path) -> None:
    result = runner_cli("validate", "compute=cpu", "dtype=fp32", "batch_size=7")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "batch_size: 7" in result.stdout
    assert "_component_: torchtune.models.llama3_2.llama3_2" in result.stdout
    assert "ok  train      " in result.stdout and "(32000 records)" in result.stdout
    assert list(tmp_path.iterdir()) == []


def test_validate_reports_missing_data(runner_cli, tmp_path) -> None:
    result = runner_cli("validate", "dataset.validation.source=/nope.jsonl")
    assert result.returncode == 2
    assert "dataset.validation.source='/nope.jsonl': no such file" in result.stderr
    assert list(tmp_path.iterdir()) == []


def test_estimate_counts_parameters_and_optimizer_memory(tmp_path: Path) -> None:
    recipe = resolve_recipe(
        compose_train(["compute=cpu", "dtype=fp32", "batch_size=32", ESTIMATE_DATA]), tmp_path
    )
    found = estimate(recipe)
    model = instantiate(recipe.model.builder)
    params = list(model.parameters())
    assert found.parameters == sum(p.numel() for p in params)
    optimizer = torch.optim.AdamW(params)
    model(torch.zeros(1, 4, dtype=torch.long)).sum().backward()
    optimizer.step()
    states = [t for s in optimizer.state.values() for t in s.values() if t.dim() > 0]
    assert found.weights_bytes == sum(p.numel() * p.element_size() for p in params)
    assert found.gradients_bytes == sum(p.grad.numel() * p.grad.element_size() for p in params)
    assert found.optimizer_bytes == sum(t.numel() * t.element_size() for t in states)
    assert found.steps_per_epoch == 512 // 32 and found.tokens_per_epoch > 512 * 40


def test_estimate_shards_over_the_world_and_halves_in_bf16(tmp_path: Path) -> None:
    one = estimate(
        resolve_recipe(compose_train(["compute=cpu", "dtype=fp32", ESTIMATE_DATA]), tmp_path)
    )
    two = estimate(
        resolve_recipe(
            compose_train(["compute=cpu", "compute.nproc_per_node=2", "dtype=bf16", ESTIMATE_DATA]),
            tmp_path,
        )
    )
    assert two.world_size == 2
    assert two.weights_bytes == one.weights_bytes // 4
    assert two.steps_per_epoch == one.steps_per_epoch // 2


def test_estimate_cli(runner_cli) -> None:
    result = runner_cli("estimate", "compute=cpu", "dtype=fp32", ESTIMATE_DATA)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "1,051,776 parameters, fp32, cpu x 1" in result.stdout
    assert "optimizer steps per epoch" in result.stdout
    assert "model=tiny is runner's llama3 family (random init)" in result.stdout
    # A zoo model whose source is not downloaded is priced by its family, not called random.
    result = runner_cli("estimate", "compute=cpu", "model=llama3_2_1b", "method=lora")
    assert result.returncode == 0, result.stderr[-2000:]
    assert (
        "model=llama3_2_1b is runner's llama3 family "
        "(hf://meta-llama/Llama-3.2-1B-Instruct, not here yet)"
    ) in result.stdout


def test_estimate_prices_a_gpu_layout_from_any_machine(runner_cli, tmp_path: Path) -> None:
    """docs/getting-started.md: estimate is what to run before spending accelerator time, so it
    prices a GPU layout on a machine without one (it builds the model on the meta device)."""
    gpu_layout = ["compute=multi_gpu", "compute.nproc_per_node=8", "model=llama3_2_1b"]
    result = runner_cli("estimate", *gpu_layout, "dtype=bf16")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "1,235,814,400 parameters, bf16, cuda x 8" in result.stdout
    # A full fine-tune's bf16 weights, sharded over the 8 processes by FSDP2.
    per_device = 1_235_814_400 * 2 / 8 / 2**30
    assert f"weights        {per_device:.3f} GiB per device" in result.stdout
    # dtype=auto prices what the run on the GPUs would use.
    result = runner_cli("estimate", "compute=gpu", "model=llama3_2_1b")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "1,235,814,400 parameters, bf16_mixed, cuda x 1" in result.stdout
    if torch.cuda.is_available():
        return
    # Without GPUs to count, auto has no number to price; training still needs the GPUs here.
    result = runner_cli("estimate", "compute=multi_gpu")
    assert result.returncode == 2
    assert "compute.nproc_per_node='auto'" in result.stderr
    assert "compute.nproc_per_node=8" in result.stderr
    out_root = tmp_path / "outputs"
    result = runner_cli("train", *gpu_layout, f"runtime.output_root={out_root}")
    assert result.returncode == 2
    assert "compute='multi_gpu': no CUDA GPU is visible" in result.stderr
    assert not out_root.exists()


def test_estimate_counts_the_activations_of_one_forward_pass(tmp_path: Path) -> None:
    base = ["compute=cpu", "dtype=fp32", "batch_size=16", ESTIMATE_DATA]
    whole = estimate(resolve_recipe(compose_train(base), tmp_path))
    assert whole.longest_sample is not None and whole.activations_bytes is not None
    # Room for four of the longest samples in one forward pass: a quarter of the batch's.
    cap = f"dataset.max_forward_tokens={4 * whole.longest_sample}"
    parts = estimate(resolve_recipe(compose_train([*base, cap]), tmp_path))
    assert parts.activations_bytes is not None
    assert parts.activations_bytes * 4 == whole.activations_bytes


def test_estimate_prices_a_layers_activations_as_the_trained_model_keeps_them(
    tmp_path: Path,
) -> None:
    """A layer's activations are what torchtune's layer, as runner trains it, keeps for backward
    (saved_tensors_hooks, each storage once), at a feed-forward of 2 and of 16 widths: a GPT
    layer's count (Korthikanti et al.) ignored the feed-forward's width, 1.2x low at Llama's 4
    widths and 3.5x at 16 (explore76b F2)."""
    from runner.job.preflight import _activations
    from runner.models.activation_memory import keep_fewer_activations
    from tests.conftest import load_script

    saved_bytes = load_script("bench/bench_activations").saved_bytes
    seq, batch = 256, 2
    for widths in (2, 16):
        estimated, measured = {}, {}
        for layers in (1, 3):
            args = ["compute=cpu", "dtype=fp32", f"batch_size={batch}", "dataset.packing=false"]
            args += [f"model.builder.num_layers={layers}"]
            args += [f"model.builder.intermediate_dim={widths * 128}"]  # tiny's width: 128
            recipe = resolve_recipe(compose_train(args), tmp_path)
            estimated[layers] = _activations(recipe, seq)[0] * 4  # fp32
            torch.manual_seed(0)
            model = keep_fewer_activations(instantiate(recipe.model.builder), torch.device("cpu"))
            tokens = torch.randint(0, 264, (batch, seq))
            measured[layers] = saved_bytes(model, {"tokens": tokens})
        per_layer = (estimated[3] - estimated[1]) / 2, (measured[3] - measured[1]) / 2
        # Within 2%: the attention's logsumexp, a value a head and token, is left out.
        assert abs(per_layer[0] / per_layer[1] - 1) < 0.02, (widths, per_layer)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("loss", ["ce", "chunked_ce"])
def test_estimate_prices_the_logits_as_the_loss_keeps_them(
    tmp_path: Path, loss: str, dtype: str
) -> None:
    """The activations at a step's live peak (PeakBytes: what a GPU's max_memory_allocated
    counts), a token more, at a vocabulary where the logits outweigh the layers: the logits were
    priced as one fp32 copy, where loss=ce keeps 3 of them at the peak, and loss=chunked_ce
    about 1.7 (explore76b measured as much by peak RSS)."""
    from runner.job.preflight import BYTES, _activations
    from runner.models.activation_memory import keep_fewer_activations
    from runner.models.backends.base import set_output_chunks
    from tests.conftest import load_script

    peak_bytes = load_script("bench/bench_activations").PeakBytes
    vocab, batch = 16384, 2
    estimated, measured = {}, {}
    for seq in (128, 256):
        args = ["compute=cpu", f"dtype={dtype}", f"batch_size={batch}", f"loss={loss}"]
        args += ["dataset.packing=false", f"model.builder.vocab_size={vocab}"]
        recipe = resolve_recipe(compose_train(args), tmp_path)
        values, logits_bytes = _activations(recipe, seq)
        estimated[seq] = values * BYTES[dtype][1] + logits_bytes
        torch.manual_seed(0)
        model = keep_fewer_activations(instantiate(recipe.model.builder), torch.device("cpu"))
        model.to(torch.float32 if dtype == "fp32" else torch.bfloat16)
        loss_fn = instantiate(recipe.loss)
        set_output_chunks(model, getattr(loss_fn, "num_output_chunks", 0))
        tokens, labels = torch.randint(0, vocab, (2, batch, seq))
        # The gradients a step before leaves, which the step measured adds to: a whole step
        # made them (bf16 on a CPU: seconds), to the same byte.
        for parameter in model.parameters():
            parameter.grad = torch.zeros_like(parameter)
        with peak_bytes() as peak:
            _forward_and_backward(model, loss_fn, tokens, labels)
        measured[seq] = peak.peak
    per_token = [(found[256] - found[128]) / (128 * batch) for found in (estimated, measured)]
    assert abs(per_token[0] / per_token[1] - 1) < 0.05, per_token


def _forward_and_backward(
    model: torch.nn.Module, loss_fn: Any, tokens: torch.Tensor, labels: torch.Tensor
) -> None:
    """A step's loss and backward, as runner.trainer.objectives.Supervised computes them."""
    logits = model(tokens)
    if isinstance(logits, list):  # chunked output, for a chunked loss
        value = loss_fn(logits, labels)
    else:
        value = loss_fn(logits.reshape(-1, logits.size(-1)).float(), labels.reshape(-1))
    del logits
    value.backward()


def test_estimate_prices_packed_rows_linearly_in_their_length(tmp_path: Path) -> None:
    """Fused attention (SDPA, flex, varlen) keeps no scores for backward: the activations of
    a row twice as long are twice as many. Korthikanti et al.'s 5as/h term counted them, 81 GiB
    for the tiny model's 8,192-token packed rows, which trained on a 23 GiB machine."""
    found = {}
    for length in (1024, 2048):
        given = ["compute=cpu", "dtype=fp32", "batch_size=4", ESTIMATE_DATA]
        given += ["dataset.packing=true", f"dataset.max_seq_len={length}"]
        found[length] = estimate(resolve_recipe(compose_train(given), tmp_path)).activations_bytes
    assert found[1024] is not None and found[2048] is not None
    assert abs(found[2048] / found[1024] - 2) < 1e-6


def test_estimate_prices_dpo_as_it_trains(tmp_path: Path) -> None:
    """Full DPO's frozen reference is built as the policy is, in the master dtype (fp32 under
    bf16_mixed: priced at 2 bytes a weight, it was 2 bytes short); a pair's answers are two
    rows of a forward pass, each padded to the longer (priced as one row of both, the
    activations of unequal answers were up to half the run's)."""
    pairs = tmp_path / "pairs.jsonl"
    with pairs.open("w") as f:
        for i in range(16):
            long, short = "word " * 60, "no"
            chosen, rejected = (long, short) if i % 2 else (short, long)
            f.write(json.dumps({"prompt": "Say.", "chosen": chosen, "rejected": rejected}) + "\n")
    args = ["compute=cpu", "method=dpo", "dataset=preference", f"dataset.source={pairs}"]
    args += ["eval.strategy=no", "batch_size=4"]
    found = estimate(resolve_recipe(compose_train([*args, "dtype=bf16_mixed"]), tmp_path))
    # The policy and the reference in fp32, and autocast's bf16 copy of the policy.
    assert found.weights_bytes == found.parameters * (4 + 4 + 2)
    recipe = resolve_recipe(compose_train([*args, "dtype=fp32"]), tmp_path)
    tokenizer = instantiate(recipe.model.tokenizer)
    rows = [
        max(len(pair["chosen_tokens"]), len(pair["rejected_tokens"]))
        for pair in train_dataset(recipe.dataset, tokenizer)
    ]
    assert estimate(recipe).longest_sample == max(rows)


def test_validate_refuses_a_split_smaller_than_one_global_batch(runner_cli, tmp_path) -> None:
    """`runner validate` said ok to 3 records at batch_size=16, which `runner train` refuses
    before it starts (it would train nothing)."""
    data = tmp_path / "three.jsonl"
    rows = [{"instruction": f"say {n}", "input": "", "output": str(n)} for n in range(3)]
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    given = [f"dataset.source={data}", "dataset.validation.source=null", "eval.strategy=no"]
    result = runner_cli("validate", "compute=cpu", *given)
    assert result.returncode == 2, result.stdout[-2000:]
    assert result.stderr.strip().splitlines()[-1] == (
        "error: batch_size=16: the training split has 3 records, fewer than one global batch of "
        "16 (batch_size x gradient_accumulation_steps=1 x 1 process(es)); give batch_size=3 or "
        "less, or add records"
    )
    assert "Traceback" not in result.stderr
    assert runner_cli("validate", "compute=cpu", *given, "batch_size=3").returncode == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["three.jsonl"]
