"""dtype=bf16_mixed: bf16 compute over fp32 master weights keeps the small updates that pure bf16
rounds away, and works with every method, several processes and resume (on CPU, autocast)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from runner.config.resolve import resolve_recipe
from runner.job.preflight import estimate
from runner.models.checkpoint import read_training_state
from tests.cli_forks import ForkedCli
from tests.conftest import ESTIMATE_DATA, QUICK
from tests.test_config import compose_train
from tests.test_lora import QLORA
from tests.test_resume import straight_then_resumed

# AdamW moves each weight by about lr a step; at 1e-5 that is below half a bf16 ulp of a
# typical weight of model=tiny (std 0.02: ulp 2**-6 * 2**-7 ~ 1.2e-4 around 0.02).
SMALL_STEPS = [
    *QUICK,
    "compute=cpu",
    "max_steps=4",
    "batch_size=8",
    "optimizer.lr=1e-5",
    "optimizer.warmup_steps=0",
    "optimizer.cosine_decay=false",
    "runtime.save_every_n_steps=null",
    "runtime.loggers=[]",
    "eval.strategy=no",
]


@pytest.fixture(scope="module")
def small_runs(tmp_path_factory: pytest.TempPathFactory, forked_cli: ForkedCli) -> dict[str, Path]:
    """4 small steps in bf16_mixed and in pure bf16, and for each a run at lr 1e-30 that keeps
    the initial weights (the same seed initializes the same weights)."""
    root = tmp_path_factory.mktemp("small_steps")
    runs = {}
    for dtype in ("bf16_mixed", "bf16"):
        for name, lr in ((dtype, []), (f"{dtype}-init", ["optimizer.lr=1e-30"])):
            runs[name] = root / name
            argv = ["train", *SMALL_STEPS, f"dtype={dtype}", *lr, f"hydra.run.dir={runs[name]}"]
            proc = forked_cli(argv, root, timeout_s=600)
            assert proc.returncode == 0, proc.stderr[-3000:]
    return runs


def changed_fraction(small_runs: dict[str, Path], dtype: str) -> float:
    """The fraction of the first attention projection's weights that 4 small steps changed."""
    name = "model.layers.0.self_attn.q_proj.weight"
    final = "checkpoints/step_4/model.safetensors"
    trained = load_file(small_runs[dtype] / final)
    before = load_file(small_runs[f"{dtype}-init"] / final)[name]
    # Checkpoints hold the trained parameters in float32 (bf16 values exactly, for pure bf16).
    assert trained[name].dtype == torch.float32
    return (trained[name] != before).float().mean().item()


def test_mixed_precision_keeps_updates_that_pure_bf16_rounds_away(small_runs) -> None:
    mixed = changed_fraction(small_runs, "bf16_mixed")
    pure = changed_fraction(small_runs, "bf16")
    assert mixed > 0.9, mixed
    assert pure < 0.2, pure


def test_mixed_precision_keeps_fp32_master_weights_and_optimizer_state(small_runs) -> None:
    state = read_training_state(small_runs["bf16_mixed"] / "checkpoints" / "step_4")
    moments = [
        value
        for per_param in state["optimizer"]["state"].values()
        for key, value in per_param.items()
        if key in ("exp_avg", "exp_avg_sq")
    ]
    assert moments and all(m.dtype == torch.float32 for m in moments)


@pytest.mark.parametrize(
    "extra",
    [
        pytest.param(["compute.nproc_per_node=1"], id="full"),
        pytest.param(["compute.nproc_per_node=2"], id="full-2proc", marks=pytest.mark.long),
        # Each trains twice over (straight, then stopped and resumed): the adapters' resumes in
        # `pytest -m long`, the whole model's here.
        pytest.param(["method=lora", "optimizer.lr=1e-2"], id="lora", marks=pytest.mark.long),
        pytest.param([*QLORA, "optimizer.lr=1e-2"], id="qlora", marks=pytest.mark.long),
    ],
)
def test_mixed_precision_resumes_exactly(runner_cli, tmp_path: Path, extra: list[str]) -> None:
    straight, resumed = straight_then_resumed(
        runner_cli, tmp_path, "compute=cpu", "dtype=bf16_mixed", *extra, n=2
    )
    assert sorted(resumed) == [1, 2, 3, 4]
    assert resumed == straight


def test_estimate_prices_each_precision(tmp_path: Path) -> None:
    found = {
        dtype: estimate(
            resolve_recipe(
                compose_train(["compute=cpu", f"dtype={dtype}", ESTIMATE_DATA]), tmp_path
            )
        )
        for dtype in ("fp32", "bf16_mixed", "bf16")
    }
    params = found["fp32"].parameters
    # Master weights, gradients and AdamW moments in fp32, plus autocast's bf16 weight copy.
    assert found["bf16_mixed"].weights_bytes == params * (4 + 2)
    assert found["bf16_mixed"].optimizer_bytes == found["fp32"].optimizer_bytes == 8 * params
    assert found["bf16"].optimizer_bytes == 4 * params
    assert found["bf16"].activations_bytes < found["fp32"].activations_bytes
    assert found["bf16_mixed"].total_by_dtype == found["fp32"].total_by_dtype
