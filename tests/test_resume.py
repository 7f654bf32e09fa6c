"""A run resumed from its checkpoint at step N gives the same per-step losses as a straight run."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.conftest import QUICK, losses

N = 6


def straight_then_resumed(runner_cli, tmp_path: Path, *extra: str, n: int = N) -> tuple[dict, dict]:
    """Losses of 2n steps straight, and of the same run cut at its step-n checkpoint, resumed."""
    straight = tmp_path / "straight"
    result = runner_cli(
        "train",
        *QUICK,
        *extra,
        f"max_steps={2 * n}",
        f"runtime.save_every_n_steps={n}",
        "runtime.log_every_n_steps=1",
        "dataset.eval_samples=0",
        "gradient_accumulation_steps=2",
        "batch_size=8",
        f"hydra.run.dir={straight}",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    # The same run killed right after its step-N checkpoint: drop what came later.
    interrupted = tmp_path / "interrupted"
    shutil.copytree(straight, interrupted)
    shutil.rmtree(interrupted / "checkpoints" / f"step_{2 * n}")
    recipe = (interrupted / "recipe.yaml").read_text().replace(str(straight), str(interrupted))
    (interrupted / "recipe.yaml").write_text(recipe)
    result = runner_cli("train", f"resume={interrupted}")
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"resuming from {interrupted / 'checkpoints' / f'step_{n}'}" in result.stderr
    return losses(straight), losses(interrupted)


@pytest.mark.parametrize("nproc", [1, 2])
def test_resume_gives_bit_identical_losses(runner_cli, tmp_path: Path, nproc: int) -> None:
    straight, resumed = straight_then_resumed(
        runner_cli, tmp_path, "compute=cpu", f"compute.nproc_per_node={nproc}"
    )
    assert sorted(resumed) == list(range(1, 2 * N + 1))
    assert resumed == straight  # exact float equality, step by step


def test_resume_refuses_other_overrides(runner_cli, tmp_path: Path) -> None:
    result = runner_cli("train", f"resume={tmp_path}", "max_steps=5")
    assert result.returncode == 2
    assert "drop the other overrides ['max_steps=5']" in result.stderr


def test_resume_of_a_non_run_directory_is_a_user_error(runner_cli, tmp_path: Path) -> None:
    result = runner_cli("train", f"resume={tmp_path}")
    assert result.returncode == 2
    assert "not a run directory" in result.stderr
