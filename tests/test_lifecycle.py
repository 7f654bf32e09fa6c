"""Runs you can list, follow, stop and resume; a dead process never shows as running."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.conftest import QUICK

LONG_JOB = [
    *QUICK,
    "max_steps=100",
    "runtime.save_every_n_steps=5",
    "runtime.log_every_n_steps=1",
    "dataset.eval_samples=0",
]


def start_run(env: dict[str, str], run_dir: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "runner", "train", *LONG_JOB, f"hydra.run.dir={run_dir}"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


def wait_for_checkpoint(run_dir: Path, proc: subprocess.Popen, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stderr.read()[-2000:]
        if list((run_dir / "checkpoints").glob("step_*")):
            return
        time.sleep(0.2)
    raise AssertionError("no checkpoint in time")


def state_of(run_dir: Path) -> dict:
    return json.loads((run_dir / "status.json").read_text())


def test_a_killed_run_shows_as_failed(runner_cli, hermetic_env, tmp_path: Path) -> None:
    run_dir = tmp_path / "outputs" / "killed"
    proc = start_run(hermetic_env, run_dir)
    wait_for_checkpoint(run_dir, proc)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert state_of(run_dir)["state"] in ("running", "checkpointing")  # as the dead process left it
    listing = runner_cli("runs", str(tmp_path / "outputs"))
    assert listing.returncode == 0
    (line,) = [ln for ln in listing.stdout.splitlines() if "killed" in ln]
    assert line.split()[1] == "failed", listing.stdout
    logs = runner_cli("logs", str(run_dir))
    assert "step 1/100 loss" in logs.stdout


def test_stop_then_resume_through_the_cli(runner_cli, hermetic_env, tmp_path: Path) -> None:
    run_dir = tmp_path / "outputs" / "stopped"
    proc = start_run(hermetic_env, run_dir)
    wait_for_checkpoint(run_dir, proc)
    stop = runner_cli("stop", str(run_dir))
    assert stop.returncode == 0, stop.stdout + stop.stderr
    assert proc.wait(timeout=120) == 143
    status = state_of(run_dir)
    assert status["state"] == "cancelled" and 0 < status["step"] < 100
    assert (run_dir / "checkpoints" / f"step_{status['step']}").is_dir()
    again = runner_cli("stop", str(run_dir))
    assert again.returncode == 2 and "already cancelled" in again.stderr
    resumed = runner_cli("resume", str(run_dir))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert state_of(run_dir)["state"] == "completed" and state_of(run_dir)["step"] == 100
    listing = runner_cli("runs", str(tmp_path / "outputs"))
    assert "completed" in listing.stdout and "100/100" in listing.stdout


def test_lifecycle_commands_refuse_what_is_not_a_run(runner_cli, tmp_path: Path) -> None:
    for command in ("logs", "stop", "resume"):
        result = runner_cli(command, str(tmp_path))
        assert result.returncode == 2 and "not a run directory" in result.stderr
    assert runner_cli("runs", str(tmp_path)).stdout.startswith("no runs under")
