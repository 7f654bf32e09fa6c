"""`runner repro` passes on a faithful re-run and names what changed when it drifts."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from runner.paths import SAMPLE_DATA_DIR
from runner.repro import compare_losses
from tests.conftest import QUICK

SHORT = [
    *QUICK,
    "max_steps=4",
    "batch_size=8",
    "runtime.log_every_n_steps=1",
    "runtime.save_every_n_steps=2",
    "runtime.deterministic=true",
    "dataset.eval_samples=0",
]


def train_on_own_data(runner_cli, tmp_path: Path, *extra: str) -> Path:
    """A short deterministic run on a private copy of the sample data."""
    data = tmp_path / "data"
    shutil.copytree(SAMPLE_DATA_DIR, data)
    run = tmp_path / "run"
    result = runner_cli(
        "train",
        *SHORT,
        *extra,
        f"dataset.source={data / 'train.jsonl'}",
        f"dataset.validation.source={data / 'validation.jsonl'}",
        f"hydra.run.dir={run}",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return run


@pytest.mark.parametrize("nproc", [1, 2])
def test_repro_of_a_fresh_run_matches(runner_cli, tmp_path: Path, nproc: int) -> None:
    run = train_on_own_data(runner_cli, tmp_path, "compute=cpu", f"compute.nproc_per_node={nproc}")
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["world_size"] == nproc and manifest["deterministic"] is True
    assert set(manifest["checkpoints"]) == {"2", "4"}
    assert manifest["packages"]["torch"] and manifest["data"]["source"]["sha256"]
    result = runner_cli("repro", str(run), "--out", str(tmp_path / "again"))
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert "repro: match (4 logged steps" in result.stdout


def test_drift_is_reported_with_its_reason(runner_cli, tmp_path: Path) -> None:
    run = train_on_own_data(runner_cli, tmp_path)

    # A changed learning rate in the recorded config.
    recipe = (run / "recipe.yaml").read_text()
    (run / "recipe.yaml").write_text(recipe.replace("lr: 0.002", "lr: 0.003"))
    # Warmup starts at lr 0, so the first step's update is empty and step 3 is the first to differ.
    result = runner_cli("repro", str(run), "--steps", "3", "--out", str(tmp_path / "lr"))
    assert result.returncode == 1, result.stderr[-3000:]
    assert "config.optimizer.lr" in result.stdout and "loss at step 3" in result.stdout
    (run / "recipe.yaml").write_text(recipe)

    # A different package version recorded than installed.
    manifest = json.loads((run / "manifest.json").read_text())
    manifest["packages"]["transformers"] = "0.0.1"
    (run / "manifest.json").write_text(json.dumps(manifest))
    result = runner_cli("repro", str(run), "--steps", "2", "--out", str(tmp_path / "pkg"))
    assert result.returncode == 1
    assert "packages.transformers" in result.stdout and "0.0.1" in result.stdout
    assert "loss at step" not in result.stdout  # the numbers themselves still agree

    # A changed data file at the recorded path.
    train_file = tmp_path / "data" / "train.jsonl"
    lines = train_file.read_text().splitlines()
    train_file.write_text("\n".join(reversed(lines)) + "\n")
    result = runner_cli("repro", str(run), "--steps", "2", "--out", str(tmp_path / "data2"))
    assert result.returncode == 1
    assert "data.source.sha256" in result.stdout


def test_repro_of_something_else_is_a_user_error(runner_cli, tmp_path: Path) -> None:
    result = runner_cli("repro", str(tmp_path))
    assert result.returncode == 2
    assert "not a run directory" in result.stderr


def test_one_ulp_is_drift() -> None:
    loss = 5.592266082763672
    assert compare_losses({1: loss}, {1: loss}) == []
    (drift,) = compare_losses({1: loss}, {1: math.nextafter(loss, math.inf)})
    assert drift.what == "loss at step 1"


def test_golden_loss_check_fails_on_one_ulp(tmp_path: Path, hermetic_env) -> None:
    root = Path(__file__).resolve().parent.parent
    golden = json.loads((root / "tests" / "golden" / "tiny_losses.json").read_text())
    golden["losses"]["5"] = math.nextafter(golden["losses"]["5"], 0.0)
    (tmp_path / "golden.json").write_text(json.dumps(golden))
    proc = subprocess.run(
        [
            sys.executable,
            str(root / "scripts" / "golden_loss.py"),
            "--golden",
            str(tmp_path / "golden.json"),
        ],
        env=hermetic_env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr[-2000:]
    assert "loss at step 5" in proc.stdout
