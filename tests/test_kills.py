"""kill -9 of `runner train` at chosen moments, each followed by `runner train resume=RUN`: the
per-step losses equal those of a run never killed, and the final checkpoint is there.

One run directory goes through every moment in turn (each resume is killed at the next one),
so the test costs one run's training and a start-up per moment. A moment is found by polling
the run directory and the launcher's output, never by a hook inside the code under test.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from runner.rundir import RunDir
from tests.conftest import losses

STEPS = 8
ARGS = [
    "compute=cpu",
    "dtype=fp32",
    "runtime.progress_bar=false",
    "runtime.loggers=[]",
    "dataset.eval_samples=0",
    "eval.strategy=no",
    f"max_steps={STEPS}",
    "runtime.save_every_n_steps=3",
    "runtime.log_every_n_steps=1",
]
# Tries at a moment that a busy machine can let slip by (the first, between two file writes);
# the suite runs two workers at once (pytest -n 2), so the machine is busier than one run makes it.
TRIES = 5


@dataclass
class Moment:
    name: str
    reached: Callable[[Path, str], bool]  # (run directory, launcher output so far)
    hit: Callable[[Path], bool]  # after the kill: whether it landed at the moment meant
    poll_s: float = 0.02


def _step_logged(step: int) -> Callable[[Path, str], bool]:
    return lambda run_dir, _: step in losses(run_dir)


MOMENTS = [
    Moment(
        "after recipe.yaml, before status.json",
        lambda run_dir, _: (run_dir / "recipe.yaml").exists(),
        lambda run_dir: not (run_dir / "status.json").exists(),
        poll_s=0.002,  # the window between the two writes is tens of milliseconds
    ),
    Moment(
        "during or just after the step-3 checkpoint's save",
        lambda run_dir, _: any((run_dir / "checkpoints").glob("*step_3")),
        lambda run_dir: max(losses(run_dir), default=0) == 3,
    ),
    Moment(
        "mid-training, between checkpoints (step 5)",
        _step_logged(5),
        lambda run_dir: RunDir(run_dir).latest_checkpoint().name == "step_3",
    ),
    Moment(
        "after the final summary, before the launcher exits",
        lambda _, output: "try next:" in output,
        lambda run_dir: RunDir(run_dir).status().state == "completed",
    ),
]


def start(env: dict[str, str], output: Path, *args: str) -> subprocess.Popen:
    with open(output, "w") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "runner", "train", *args],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )


def kill_at(moment: Moment, proc: subprocess.Popen, run_dir: Path, output: Path) -> None:
    """kill -9 of `proc` as soon as `moment` is reached (an AssertionError if it ends first)."""
    deadline = time.monotonic() + 300  # a guard against a hang (pytest -n 2 on a busy machine)
    while not moment.reached(run_dir, output.read_text()):
        assert proc.poll() is None, f"exit {proc.returncode} before {moment.name}:\n" + tail(output)
        assert time.monotonic() < deadline, f"{moment.name} not reached in 300 s"
        time.sleep(moment.poll_s)
    proc.kill()
    proc.wait()


def tail(output: Path) -> str:
    return output.read_text()[-3000:]


@pytest.mark.long
def test_kill_9_at_chosen_moments_then_resume(hermetic_env, tmp_path: Path) -> None:
    started = time.monotonic()
    straight_dir, run_dir = tmp_path / "straight", tmp_path / "killed"
    straight = start(
        hermetic_env, tmp_path / "straight.out", *ARGS, f"hydra.run.dir={straight_dir}"
    )
    hits: dict[str, bool] = {}
    logged: dict[str, dict[int, float]] = {}  # the losses on disk after each kill
    for index, moment in enumerate(MOMENTS):
        output = tmp_path / f"launch_{index}.out"
        for _ in range(TRIES if index == 0 else 1):
            if index == 0:
                shutil.rmtree(run_dir, ignore_errors=True)
                proc = start(hermetic_env, output, *ARGS, f"hydra.run.dir={run_dir}")
            else:
                proc = start(hermetic_env, output, f"resume={run_dir}")
            kill_at(moment, proc, run_dir, output)
            if moment.hit(run_dir):
                break
        hits[moment.name], logged[moment.name] = moment.hit(run_dir), losses(run_dir)
    output = tmp_path / "final.out"
    final = start(hermetic_env, output, f"resume={run_dir}")
    assert final.wait(timeout=300) == 0, tail(output)
    assert straight.wait(timeout=300) == 0, tail(tmp_path / "straight.out")
    assert f"completed at step {STEPS}: nothing to train" in output.read_text(), tail(output)
    want = losses(straight_dir)
    # A moment passes when the kill landed there and every loss on disk after it, written by
    # the launches before and resumed after earlier kills, is the straight run's, exactly.
    verdicts = {
        name: "passed" if hits[name] and all(want[s] == v for s, v in got.items()) else "failed"
        for name, got in logged.items()
    }
    failed = [name for name, verdict in verdicts.items() if verdict == "failed"]
    print(
        f"\nkill test: {len(MOMENTS)} moments, {len(MOMENTS) - len(failed)} passed, "
        f"{len(failed)} failed, in {time.monotonic() - started:.0f} s"
    )
    for name, verdict in verdicts.items():
        print(f"  {name}: {verdict}{'' if hits[name] else ' (kill missed the moment)'}")
    assert not failed, (verdicts, logged, want)
    assert losses(run_dir) == want
    assert sorted(losses(run_dir)) == list(range(1, STEPS + 1))
    assert (run_dir / "checkpoints" / f"step_{STEPS}" / "model.safetensors").is_file()
