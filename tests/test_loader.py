"""Loader workers (dataset.num_workers): the same batches as none, and out of the way of a stop."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from tests.conftest import QUICK, losses

STEPS = [*QUICK, "max_steps=6", "runtime.log_every_n_steps=1", "dataset.eval_samples=0"]


def test_workers_train_on_the_same_batches_as_the_training_process(runner_cli, tmp_path: Path):
    curves = {}
    for workers in (0, 2):
        run = tmp_path / f"workers_{workers}"
        result = runner_cli(
            "train", *STEPS, f"dataset.num_workers={workers}", f"hydra.run.dir={run}"
        )
        assert result.returncode == 0, result.stderr[-3000:]
        assert OmegaConf.load(run / "recipe.yaml").dataset.num_workers == workers
        curves[workers] = losses(run)
    assert sorted(curves[0]) == list(range(1, 7))
    # The same samples in the same batches through the same kernels: equal to the last bit.
    assert curves[2] == curves[0]


def children(pid: int) -> list[int]:
    return [int(child) for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def logged_steps(run: Path) -> int:
    path = run / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.is_file() else 0


@pytest.mark.long  # a run's process group signalled mid-run
def test_workers_leave_a_stop_signal_to_the_training_process(
    runner_cli, hermetic_env: dict[str, str], tmp_path: Path
) -> None:
    """`runner stop` signals the launcher's whole process group, loader workers too (and so does
    Ctrl-C the terminal's): a worker that died of it would fail the training process's next
    batch. The workers ignore it; the training process saves and ends cancelled."""
    run = tmp_path / "run"
    args = [*QUICK, "max_steps=400", "runtime.save_every_n_steps=null", "dataset.num_workers=2"]
    args += ["runtime.log_every_n_steps=1", "dataset.eval_samples=0"]
    proc = subprocess.Popen(  # one process: the recipe runs in the launcher, workers beside it
        [sys.executable, "-m", "runner", "train", *args, f"hydra.run.dir={run}"],
        env=hermetic_env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )

    def wait_for_step(after: int) -> int:
        deadline = time.monotonic() + 300  # a guard against a hang, not a timing
        while logged_steps(run) <= after:
            assert proc.poll() is None, proc.stderr.read()[-3000:]
            assert time.monotonic() < deadline, "no step logged in time"
            time.sleep(0.05)
        return logged_steps(run)

    wait_for_step(0)
    workers = children(proc.pid)
    assert len(workers) == 2
    for worker in workers:
        os.kill(worker, signal.SIGTERM)
    wait_for_step(wait_for_step(logged_steps(run)) + 2)  # fresh batches came after the signal
    assert sorted(children(proc.pid)) == sorted(workers)
    stop = runner_cli("stop", str(run))
    assert stop.returncode == 0, stop.stdout + stop.stderr
    assert proc.wait(timeout=300) == 143, proc.stderr.read()[-3000:]
    status = json.loads((run / "status.json").read_text())
    assert status["state"] == "cancelled", status
    assert (run / "checkpoints" / f"step_{status['step']}").is_dir()
