"""Runs you can list, follow, stop and resume; a dead process never shows as running."""

from __future__ import annotations

import fcntl
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


# A guard against a hang, not a timing: under `pytest -n 2` on a loaded machine the first
# checkpoint of a run has taken over 180 s.
def wait_for_checkpoint(run_dir: Path, proc: subprocess.Popen, timeout: float = 600) -> None:
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
    assert proc.wait(timeout=300) == 143
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


TWO_PROCESSES = [
    "compute=cpu",
    "dtype=fp32",
    "compute.nproc_per_node=2",
    "max_steps=400",
    "runtime.progress_bar=false",
    "runtime.loggers=[]",
    "runtime.log_every_n_steps=1",
    "runtime.save_every_n_steps=null",
    "dataset.eval_samples=0",
]


def start_two_processes(env: dict[str, str], run_dir: Path) -> tuple[subprocess.Popen, list[int]]:
    """A 2-process CPU run under the elastic agent, once it has logged 2 steps; its workers."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "runner", "train", *TWO_PROCESSES, f"hydra.run.dir={run_dir}"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own process group, as a shell's foreground job
    )
    metrics, deadline = run_dir / "metrics.jsonl", time.monotonic() + 600
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0][-3000:]
        time.sleep(0.1)
    children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
    return proc, [int(pid) for pid in children]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (its parent, the test, has not reaped it yet) is gone too.
    return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"


def snapshot(run_dir: Path) -> dict[str, tuple[int, int]]:
    return {
        str(p.relative_to(run_dir)): (p.stat().st_size, p.stat().st_mtime_ns)
        for p in sorted(run_dir.rglob("*"))
    }


def test_a_second_trainer_is_kept_out_and_workers_die_with_their_launcher(
    runner_cli, hermetic_env, tmp_path: Path
) -> None:
    run_dir = tmp_path / "outputs" / "two"
    proc, workers = start_two_processes(hermetic_env, run_dir)
    assert len(workers) == 2
    # Frozen, the run writes nothing itself: whatever changes is the second trainer's doing.
    for pid in (proc.pid, *workers):
        os.kill(pid, signal.SIGSTOP)
    before, recipe = snapshot(run_dir), (run_dir / "recipe.yaml").read_text()
    try:
        second = runner_cli("train", f"resume={run_dir}")
        assert second.returncode == 2, second.stderr[-3000:]
        assert f"resume='{run_dir}'" in second.stderr
        assert f"trained by process {proc.pid}" in second.stderr
        assert "Traceback" not in second.stderr
        assert snapshot(run_dir) == before
        into = runner_cli("train", *TWO_PROCESSES, f"hydra.run.dir={run_dir}")
        assert into.returncode == 2 and f"trained by process {proc.pid}" in into.stderr
        assert (run_dir / "recipe.yaml").read_text() == recipe
    finally:
        for pid in (proc.pid, *workers):
            os.kill(pid, signal.SIGCONT)
    os.kill(proc.pid, signal.SIGKILL)
    proc.communicate()
    deadline = time.monotonic() + 30
    while any(alive(pid) for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(alive(pid) for pid in workers), "workers outlived their launcher"
    status = state_of(run_dir)
    # Told by the parent-death signal, they stopped as on SIGTERM: saved, and ended cancelled.
    assert status["state"] == "cancelled" and "SIGTERM" in status["error"], status
    assert (run_dir / "checkpoints" / f"step_{status['step']}").is_dir()
    with open(run_dir / ".lock") as lock:  # and the lock went with the launcher
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)


def test_ctrl_c_of_a_two_process_run_saves_and_exits_130(hermetic_env, tmp_path: Path) -> None:
    run_dir = tmp_path / "interrupted"
    proc, _ = start_two_processes(hermetic_env, run_dir)
    os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C: the terminal signals the foreground group
    output, _ = proc.communicate(timeout=300)
    assert proc.returncode == 130, output[-3000:]
    assert "Traceback" not in output and "KeyboardInterrupt" not in output, output[-3000:]
    status = state_of(run_dir)
    assert status["state"] == "cancelled" and "SIGINT" in status["error"], status
    assert [p.name for p in (run_dir / "checkpoints").iterdir()] == [f"step_{status['step']}"]
    assert f"`runner resume {run_dir}` continues" in output
