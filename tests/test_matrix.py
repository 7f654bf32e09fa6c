"""Every method on every model: each `method` on each family fixture the tests write (the
torchtune families and the transformers backend's Qwen3 and GPT-2), two steps on the CPU. Each
pair trains (finite losses, a checkpoint transformers or peft loads) or is refused before launch
by a message naming the key, the value and why; none ends in a traceback. README's methods table
is this matrix.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from runner.config.method import METHOD_NAMES, PREFERENCE_METHODS
from runner.job.lifecycle import runs_table
from runner.rundir import RunDir
from tests.conftest import QUICK, losses
from tests.fixtures import (
    FAMILIES,
    _model_config,
    write_family_tokenizer,
    write_tiny_checkpoint,
)
from tests.hf_backend_fixtures import ARCHITECTURES, write_arch_checkpoint

MODELS = (*FAMILIES, *ARCHITECTURES)
# Pairs refused before launch: (key, words of the reason). None today: every method trains
# every model.
REFUSED: dict[tuple[str, str], tuple[str, str]] = {}
# The suite's quick settings, smaller still: two steps of two samples, no tracker, no generated
# answers (each preference option has none; the SFT data says so again).
MATRIX = [
    *QUICK,
    "max_steps=2",
    "batch_size=2",
    "runtime.loggers=[]",
    "runtime.log_every_n_steps=1",
    "dataset.eval_samples=0",
    "eval.max_samples=4",
]


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("matrix")
    written = {family: write_tiny_checkpoint(family, root / family) for family in FAMILIES}
    written.update({arch: write_arch_checkpoint(arch, root / arch) for arch in ARCHITECTURES})
    return written


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[str]]:
    """Small datasets (the shipped ones' first records): the data check reads every record."""
    from runner.paths import ASSETS_DIR

    root = tmp_path_factory.mktemp("matrix-data")
    files = {}
    for name, asset, count in [
        ("train", "sample/train.jsonl", 16),
        ("validation", "sample/validation.jsonl", 4),
        ("pairs", "preference/train.jsonl", 20),
    ]:
        lines = (ASSETS_DIR / asset).read_text().splitlines()[:count]
        files[name] = root / f"{name}.jsonl"
        files[name].write_text("\n".join(lines) + "\n")
    return {
        "sft": [
            f"dataset.source={files['train']}",
            f"dataset.validation.source={files['validation']}",
            "dataset.eval_samples=0",
        ],
        "preference": [
            "dataset=preference",
            f"dataset.source={files['pairs']}",
            "dataset.validation.held_out=20%",
        ],
    }


@pytest.mark.parametrize("method", METHOD_NAMES)
@pytest.mark.parametrize("model", MODELS)
def test_each_method_trains_each_model_or_is_refused_by_name(
    sources: dict[str, Path], data, runner_cli, tmp_path: Path, model: str, method: str
) -> None:
    source, run_dir = sources[model], tmp_path / "run"
    kind = "preference" if method in PREFERENCE_METHODS else "sft"
    result = runner_cli(
        "train",
        "model=hf",
        f"model.source={source}",
        f"method={method}",
        *MATRIX,
        *data[kind],
        f"hydra.run.dir={run_dir}",
    )
    assert "Traceback" not in result.stderr + result.stdout, result.stderr[-3000:]
    if (model, method) in REFUSED:
        key, why = REFUSED[model, method]
        assert result.returncode != 0 and not (run_dir / "checkpoints").exists()
        assert key in result.stderr and why in result.stderr, result.stderr[-2000:]
        return
    assert result.returncode == 0, result.stderr[-3000:]
    found = losses(run_dir)
    assert sorted(found) == [1, 2] and all(math.isfinite(v) for v in found.values()), found
    if kind == "preference":
        assert "held-out reward accuracy" in result.stdout and "reward margin" in result.stdout
        assert " margin " in runs_table([RunDir(run_dir)], tmp_path)
    checkpoint = run_dir / "checkpoints" / "step_2"
    tokens = torch.randint(0, 64, (1, 12), generator=torch.Generator().manual_seed(0))
    if method in ("full", "dpo"):
        loaded = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    else:
        config = json.loads((checkpoint / "adapter_config.json").read_text())
        assert config["peft_type"] == "LORA"
        base = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
        loaded = PeftModel.from_pretrained(base, checkpoint)
    with torch.no_grad():
        assert torch.isfinite(loaded(tokens).logits).all()


def test_qlora_trains_a_model_of_576_wide_projections(data, runner_cli, tmp_path: Path) -> None:
    """SmolLM2-135M's shape (hidden 576, 9 heads, 3 key-value heads; two layers): no projection
    is whole scaler blocks of 256, so each takes the largest that divides it (216); validate and
    train.log say so, and two steps train on the CPU."""
    source = tmp_path / "smollm2-576"
    tokenizer = write_family_tokenizer("smollm2", source)
    config = _model_config("smollm2", tokenizer.get_vocab_size(), tokenizer, width=576)
    config.num_attention_heads, config.num_key_value_heads = 9, 3
    config.head_dim, config.intermediate_size = 64, 1536
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(source)
    args = [
        "model=hf",
        f"model.source={source}",
        "method=qlora",
        *MATRIX,
        *data["sft"],
        "eval.strategy=no",
    ]
    quantized = "in NF4 (blocks of 64, scalers in blocks of 216): k_proj 192x576"
    validated = runner_cli("validate", *args)
    assert validated.returncode == 0, validated.stderr[-3000:]
    assert f"ok  base       torchao: {quantized}" in validated.stdout
    run_dir = tmp_path / "run"
    result = runner_cli("train", *args, f"hydra.run.dir={run_dir}")
    assert result.returncode == 0, result.stderr[-3000:]
    assert quantized in (run_dir / "train.log").read_text()
    assert all(math.isfinite(v) for v in losses(run_dir).values())
    base = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    PeftModel.from_pretrained(base, run_dir / "checkpoints" / "step_2")


def test_a_cpu_bitsandbytes_base_passes_gradients_after_an_eval_forward(
    sources: dict[str, Path],
) -> None:
    """bitsandbytes repacks a 4-bit weight for its CPU inference kernel (no backward) on the first
    eval-mode forward without grad, as an evaluation or DPO's reference runs; runner's QLoRA base
    opts out, so the adapters below an unadapted projection (o_proj) still get gradients."""
    from types import SimpleNamespace

    from runner.models.backends.base import LoraBuild
    from runner.models.backends.transformers import TransformersBackend

    backend = TransformersBackend(SimpleNamespace(source=str(sources["qwen3"])))
    lora = {
        "lora_attn_modules": ["q_proj", "v_proj"],
        "apply_lora_to_mlp": False,
        "apply_lora_to_output": False,
        "lora_rank": 4,
        "lora_alpha": 8,
        "lora_dropout": 0.0,
        "quantize_base": True,
    }
    cpu = torch.device("cpu")
    model = backend.build_lora(
        LoraBuild(lora, cpu, torch.float32, torch.float32, base_state=dict, seed=0)
    )
    for name, param in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.1)
    tokens = torch.randint(0, 64, (1, 12), generator=torch.Generator().manual_seed(0))
    model.eval()
    with torch.no_grad():
        model(tokens)
    model.train()
    model(tokens).sum().backward()
    grads = {n: p.grad for n, p in model.named_parameters() if "layers.0" in n and "lora_A" in n}
    assert grads and all(g is not None and g.abs().sum() > 0 for g in grads.values()), grads
