"""Several processes and several "nodes" on loopback: one run directory, the same losses at the
same global batch, checkpoints that move between world sizes, a lost worker, a preemption.

Every layout trains 6 steps at a global batch of 8 sequences: 1 node x 1 process with 4
micro-batches of 2, 1 x 2 with 2 micro-batches, 2 nodes x 2 processes with 1.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from runner.rundir import RunDir
from tests.conftest import free_port, losses

STEPS = 6
# The layouts run on CPU processes in fp32, also where a GPU is visible (compute=multi_node's
# device is auto); only the Baseten test below leaves the device to the machine.
BASE = [
    "dtype=fp32",
    "runtime.progress_bar=false",
    "runtime.loggers=[]",
    "dataset.eval_samples=0",
    "eval.max_samples=32",
    f"max_steps={STEPS}",
    "runtime.save_every_n_steps=3",
    "runtime.log_every_n_steps=1",
    "batch_size=2",
]
ONE_BY_ONE = ["compute=cpu", "gradient_accumulation_steps=4"]
ONE_BY_TWO = [
    "compute=multi_node",
    "compute.device=cpu",
    "compute.nproc_per_node=2",
    "gradient_accumulation_steps=2",
]
ONE_BY_FOUR = ["compute=cpu", "compute.nproc_per_node=4", "gradient_accumulation_steps=1"]
RELATIVE = 1e-5
# What each layout's `runner train` printed (filled by the layouts fixture).
OUTPUTS: dict[str, str] = {}
SUMMARY_LINE = re.compile(
    r"^(train loss|eval loss|held-out exact match|run directory|checkpoint|best|status|try next):"
)


def start(env: dict[str, str], cwd: Path, *args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "runner", "train", *args],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def finish(proc: subprocess.Popen, timeout: float = 300) -> tuple[int, str]:
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out + err


def two_nodes(env: dict[str, str], cwd: Path, run_dir: Path, *extra: str) -> list[tuple[int, str]]:
    """Starts `runner train` twice, as nodes 0 and 1 of a c10d rendezvous on 127.0.0.1."""
    args = [
        *BASE,
        "compute=multi_node",
        "compute.device=cpu",
        "compute.nnodes=2",
        "compute.nproc_per_node=2",
        "compute.master_addr=127.0.0.1",
        f"compute.master_port={free_port()}",
        "gradient_accumulation_steps=1",
        f"hydra.run.dir={run_dir}",
        *extra,
    ]
    nodes = [start(env, cwd, *args, f"compute.node_rank={rank}") for rank in (0, 1)]
    return [finish(node) for node in nodes]


def train(env: dict[str, str], cwd: Path, run_dir: Path, *args: str) -> str:
    code, output = finish(start(env, cwd, *BASE, *args, f"hydra.run.dir={run_dir}"))
    assert code == 0, output[-3000:]
    return output


def assert_close(got: dict[int, float], want: dict[int, float]) -> float:
    """Per-step losses agree within RELATIVE; returns the largest relative difference."""
    assert sorted(got) == sorted(want)
    worst = max(abs(got[s] - want[s]) / abs(want[s]) for s in want)
    assert worst <= RELATIVE, (worst, got, want)
    return worst


@pytest.fixture(scope="module")
def layouts(
    hermetic_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Path]:
    """The same 6 steps trained as 1x1, 1x2 and 2x2 (nodes x processes)."""
    root = tmp_path_factory.mktemp("layouts")
    runs = {name: root / name for name in ("1x1", "1x2", "2x2")}
    OUTPUTS["1x1"] = train(hermetic_env, root, runs["1x1"], *ONE_BY_ONE)
    OUTPUTS["1x2"] = train(hermetic_env, root, runs["1x2"], *ONE_BY_TWO)
    for code, output in two_nodes(hermetic_env, root, runs["2x2"]):
        assert code == 0, output[-3000:]
        assert f"run directory: {runs['2x2']}" in output
    return runs


def summary_labels(output: str) -> list[str]:
    """The labels of the end-of-run summary's lines (runner.train.job), in order."""
    return [line.split(":")[0] for line in output.splitlines() if SUMMARY_LINE.match(line)]


def test_two_processes_print_the_summary_one_process_prints(layouts: dict[str, Path]) -> None:
    one, two = summary_labels(OUTPUTS["1x1"]), summary_labels(OUTPUTS["1x2"])
    assert one == two, (OUTPUTS["1x1"][-2000:], OUTPUTS["1x2"][-2000:])
    assert one[0] == "train loss" and "checkpoint" in one and one[-1] == "try next"


def test_two_nodes_finish_in_one_run_directory(layouts: dict[str, Path]) -> None:
    run_dir = layouts["2x2"]
    assert sorted(p.name for p in run_dir.parent.iterdir()) == ["1x1", "1x2", "2x2"]
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_3", "step_6"]
    assert (run_dir / "checkpoints" / "step_6" / "model.safetensors").is_file()
    status = json.loads((run_dir / "status.json").read_text())
    assert (status["state"], status["step"]) == ("completed", STEPS)
    # One writer: every step logged once, not once per rank or per node; one evaluation, at
    # the last step.
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
    assert [r["step"] for r in lines if "loss" in r] == list(range(1, STEPS + 1))
    assert [r["step"] for r in lines if "eval_loss" in r] == [STEPS]
    recipe = (run_dir / "recipe.yaml").read_text()
    assert "nnodes: 2" in recipe and "nproc_per_node: 2" in recipe


def test_losses_agree_across_layouts_at_one_global_batch(layouts: dict[str, Path]) -> None:
    reference = losses(layouts["1x1"])
    worst = {name: assert_close(losses(layouts[name]), reference) for name in ("1x2", "2x2")}
    print(f"largest relative loss difference vs 1x1: {worst}")


def test_eval_metrics_agree_across_layouts(layouts: dict[str, Path]) -> None:
    """Each rank evaluates its share of the validation split; the sums add up to one rank's."""

    def evaluation(run_dir: Path) -> list[float]:
        (line,) = [r for r in RunDir(run_dir).read_metrics() if "eval_loss" in r]
        return [line["eval_loss"], line["eval_token_accuracy"]]

    reference = evaluation(layouts["1x1"])
    for name in ("1x2", "2x2"):
        assert evaluation(layouts[name]) == pytest.approx(reference, rel=RELATIVE)


def resumed_on(env, layouts, tmp_path: Path, source: str, *layout: str) -> dict[int, float]:
    """Continues `source`'s step-3 checkpoint with another layout, in a copy of its run dir."""
    run_dir = tmp_path / f"from-{source}"
    shutil.copytree(layouts[source], run_dir)
    shutil.rmtree(run_dir / "checkpoints" / "step_6")
    output = train(env, tmp_path, run_dir, *layout)
    assert f"resuming from {run_dir / 'checkpoints' / 'step_3'} at step 3" in output
    return losses(run_dir)


def test_checkpoint_of_four_ranks_resumes_on_one(hermetic_env, layouts, tmp_path: Path) -> None:
    resumed = resumed_on(hermetic_env, layouts, tmp_path, "2x2", *ONE_BY_ONE)
    assert_close(resumed, losses(layouts["1x1"]))


def test_checkpoint_of_one_rank_resumes_on_four(hermetic_env, layouts, tmp_path: Path) -> None:
    resumed = resumed_on(hermetic_env, layouts, tmp_path, "1x1", *ONE_BY_FOUR)
    assert_close(resumed, losses(layouts["1x1"]))


# Loaded by every Python process the test starts (it is first on PYTHONPATH): rank 1 of the
# first attempt kills itself with SIGKILL in its 5th optimizer step, after the step-3 checkpoint.
KILL_RANK_1 = """
import os
if os.environ.get("RANK") == "1" and os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0":
    import signal
    import torch.optim

    _step, _calls = torch.optim.AdamW.step, [0]

    def step(self, *args, **kwargs):
        _calls[0] += 1
        if _calls[0] == 5:
            os.kill(os.getpid(), signal.SIGKILL)
        return _step(self, *args, **kwargs)

    torch.optim.AdamW.step = step
"""


def test_killed_worker_restarts_the_group_and_ends_with_the_same_loss(
    hermetic_env, layouts, tmp_path: Path
) -> None:
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(KILL_RANK_1)
    path = ":".join(p for p in (str(hooks), hermetic_env.get("PYTHONPATH", "")) if p)
    run_dir = tmp_path / "killed"
    output = train({**hermetic_env, "PYTHONPATH": path}, tmp_path, run_dir, *ONE_BY_TWO)
    assert f"resuming from {run_dir / 'checkpoints' / 'step_3'} at step 3" in output
    assert output.count("failed (exitcode") == 1, output[-3000:]  # one restart was enough
    status = json.loads((run_dir / "status.json").read_text())
    assert (status["state"], status["step"]) == ("completed", STEPS)
    straight = losses(layouts["1x2"])
    assert losses(run_dir) == straight  # exact: same layout, replayed from the checkpoint


@pytest.mark.parametrize("target", ["launcher", "one worker"])
def test_sigterm_saves_a_checkpoint_and_exits_143(
    hermetic_env, tmp_path: Path, target: str
) -> None:
    """SIGTERM to `runner train` (the agent passes it on), or to rank 0 alone (a preempted node:
    the others must stop with it, not restart the group)."""
    run_dir = tmp_path / "preempted"
    args = [*BASE, *ONE_BY_TWO, "max_steps=400", "runtime.save_every_n_steps=null"]
    proc = start(hermetic_env, tmp_path, *args, f"hydra.run.dir={run_dir}")
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + 600
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.1)
    status = json.loads((run_dir / "status.json").read_text())
    pid = proc.pid if target == "launcher" else status["pid"]  # rank 0 writes the status
    os.kill(pid, signal.SIGTERM)
    code, output = finish(proc)
    assert code == 143, output[-3000:]
    status = json.loads((run_dir / "status.json").read_text())
    assert status["state"] == "cancelled", status
    assert "SIGTERM" in status["error"] and 2 <= status["step"] < 400
    checkpoint = run_dir / "checkpoints" / f"step_{status['step']}"
    assert (checkpoint / "model.safetensors").is_file()
    assert (checkpoint / "training_state.pt").is_file()
    assert [p.name for p in (run_dir / "checkpoints").iterdir()] == [checkpoint.name]
    assert "resuming from" not in output  # stopped, not restarted


def test_baseten_variables_need_no_flags(hermetic_env, tmp_path: Path) -> None:
    checkpoint_dir = tmp_path / "bt_checkpoints"
    baseten = {
        "BT_GROUP_SIZE": "1",
        "BT_NODE_RANK": "0",
        "BT_LEADER_ADDR": "127.0.0.1",
        "BT_TRAINING_JOB_ID": "job42",
        "BT_CHECKPOINT_DIR": str(checkpoint_dir),
    }
    code, output = finish(start({**hermetic_env, **baseten}, tmp_path, *BASE, "compute=multi_node"))
    assert code == 0, output[-3000:]
    run_dir = checkpoint_dir / "baseten-job42"
    assert f"run directory: {run_dir}" in output
    assert (run_dir / "checkpoints" / f"step_{STEPS}" / "model.safetensors").is_file()
    log = (run_dir / "train.log").read_text()
    assert "baseten: nnodes=1 (BT_GROUP_SIZE), node_rank=0 (BT_NODE_RANK)" in log
