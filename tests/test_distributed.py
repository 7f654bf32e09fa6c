"""Several processes and several "nodes" on loopback: one run directory, the same losses at the
same global batch, checkpoints that move between world sizes, a lost worker or node that comes
back and ends with the same losses.

Every layout trains 6 steps at a global batch of 8 sequences: 1 node x 1 process with 4
micro-batches of 2, 1 x 2 with 2 micro-batches, 2 nodes x 2 processes with 1.
"""

from __future__ import annotations

import json
import re
import shutil
import signal
import time
from pathlib import Path

import pytest

from runner.rundir import RunDir
from tests.cli_forks import ForkedCli
from tests.conftest import free_port, losses
from tests.distributed_runs import (
    BASE,
    KILL_RANK_1,
    ONE_BY_ONE,
    ONE_BY_TWO,
    STEPS,
    finish,
    hooked_env,
    losing_env,
    node_args,
    start,
    two_nodes,
)

RELATIVE = 1e-5


# What each layout's `runner train` printed (filled by the layouts fixture).
OUTPUTS: dict[str, str] = {}


SUMMARY_LINE = re.compile(
    r"^(train loss|eval loss|held-out exact match|run directory|checkpoint|best|status|try next):"
)


def train(cli: ForkedCli, cwd: Path, run_dir: Path, *args: str) -> str:
    """One node's `runner train`, forked from the suite's warm CLI server; its output."""
    result = cli(["train", *BASE, *args, f"hydra.run.dir={run_dir}"], cwd, timeout_s=300)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    return result.stdout + result.stderr


def assert_close(got: dict[int, float], want: dict[int, float]) -> float:
    """Per-step losses agree within RELATIVE; returns the largest relative difference."""
    assert sorted(got) == sorted(want)
    worst = max(abs(got[s] - want[s]) / abs(want[s]) for s in want)
    assert worst <= RELATIVE, (worst, got, want)
    return worst


@pytest.fixture(scope="module")
def layouts(forked_cli: ForkedCli, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The same 6 steps trained as 1x1, 1x2 and 2x2 (nodes x processes)."""
    root = tmp_path_factory.mktemp("layouts")
    runs = {name: root / name for name in ("1x1", "1x2", "2x2")}
    OUTPUTS["1x1"] = train(forked_cli, root, runs["1x1"], *ONE_BY_ONE)
    OUTPUTS["1x2"] = train(forked_cli, root, runs["1x2"], *ONE_BY_TWO)
    for code, output in two_nodes(forked_cli, root, runs["2x2"]):
        assert code == 0, output[-3000:]
        assert f"run directory: {runs['2x2']}" in output
    return runs


def summary_labels(output: str) -> list[str]:
    """The labels of the end-of-run summary's lines (runner.job.job), in order."""
    return [line.split(":")[0] for line in output.splitlines() if SUMMARY_LINE.match(line)]


def test_two_processes_print_the_summary_one_process_prints(layouts: dict[str, Path]) -> None:
    one, two = summary_labels(OUTPUTS["1x1"]), summary_labels(OUTPUTS["1x2"])
    assert one == two, (OUTPUTS["1x1"][-2000:], OUTPUTS["1x2"][-2000:])
    assert one[0] == "train loss" and "checkpoint" in one and one[-1] == "try next"


def test_the_workers_of_a_cpu_run_fork_from_its_launcher(layouts: dict[str, Path]) -> None:
    """Already warm, they skip torch's imports (runner.job.launch); the losses they train are
    those of one process (test_losses_agree_across_layouts_at_one_global_batch)."""
    for name in ("1x2", "2x2"):
        assert "workers: forked" in (layouts[name] / "train.log").read_text()


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


def resumed_on(cli, layouts, tmp_path: Path, source: str, *layout: str) -> dict[int, float]:
    """Continues `source`'s step-3 checkpoint with another layout, in a copy of its run dir."""
    run_dir = tmp_path / f"from-{source}"
    shutil.copytree(layouts[source], run_dir)
    shutil.rmtree(run_dir / "checkpoints" / "step_6")
    output = train(cli, tmp_path, run_dir, *layout)
    assert f"resuming from {run_dir / 'checkpoints' / 'step_3'} at step 3" in output
    return losses(run_dir)


def test_checkpoint_of_four_ranks_resumes_on_one(forked_cli, layouts, tmp_path: Path) -> None:
    resumed = resumed_on(forked_cli, layouts, tmp_path, "2x2", *ONE_BY_ONE)
    assert_close(resumed, losses(layouts["1x1"]))


def test_checkpoint_of_one_rank_resumes_on_two(forked_cli, layouts, tmp_path: Path) -> None:
    resumed = resumed_on(forked_cli, layouts, tmp_path, "1x1", *ONE_BY_TWO)
    assert_close(resumed, losses(layouts["1x1"]))


@pytest.mark.long
def test_killed_worker_restarts_the_group_and_ends_with_the_same_loss(
    hermetic_env, layouts, tmp_path: Path
) -> None:
    run_dir = tmp_path / "killed"
    env = hooked_env(hermetic_env, tmp_path, KILL_RANK_1)
    code, output = finish(start(env, tmp_path, *BASE, *ONE_BY_TWO, f"hydra.run.dir={run_dir}"))
    assert code == 0, output[-3000:]
    assert f"resuming from {run_dir / 'checkpoints' / 'step_3'} at step 3" in output
    assert output.count("failed (exitcode") == 1, output[-3000:]  # one restart was enough
    status = json.loads((run_dir / "status.json").read_text())
    assert (status["state"], status["step"]) == ("completed", STEPS)
    straight = losses(layouts["1x2"])
    assert losses(run_dir) == straight  # exact: same layout, replayed from the checkpoint


@pytest.mark.long
def test_a_lost_node_started_again_rejoins_and_the_run_ends_with_the_same_losses(
    hermetic_env, layouts, tmp_path: Path
) -> None:
    """Node 1 is lost after the step-3 checkpoint; its line started again joins node 0's
    restarted group, which resumes from the checkpoint."""
    run_dir = tmp_path / "rejoined"
    args = [*node_args(free_port(), "compute.rdzv_timeout_s=90"), f"hydra.run.dir={run_dir}"]
    node0 = start(hermetic_env, tmp_path, *args, "compute.node_rank=0")
    lost_env = losing_env(hermetic_env, tmp_path)
    node1 = start(lost_env, tmp_path, *args, "compute.node_rank=1")
    assert node1.wait(timeout=300) == -signal.SIGKILL
    assert node0.poll() is None  # waiting for the lost node
    # Alive while node 0 waits for it: its workers' failure is a restart, not the run's end
    # (status.json and `runner runs` read `failed` for the whole wait).
    deadline = time.monotonic() + 60
    while "restarting" not in (RunDir(run_dir).status().error or ""):
        assert time.monotonic() < deadline, RunDir(run_dir).status()
        time.sleep(0.5)
    assert RunDir(run_dir).effective_state() == ("initializing", None)
    node1 = start(lost_env, tmp_path, *args, "compute.node_rank=1")  # the same line again
    (code0, out0), (code1, out1) = finish(node0), finish(node1)
    assert code0 == 0 and code1 == 0, (out0[-3000:], out1[-3000:])
    assert f"resuming from {run_dir / 'checkpoints' / 'step_3'} at step 3" in out0 + out1
    status = json.loads((run_dir / "status.json").read_text())
    assert (status["state"], status["step"]) == ("completed", STEPS)
    assert status["launcher_pid"] == node0.pid  # the returning node left node 0's status be
    assert losses(run_dir) == losses(layouts["2x2"])  # exact: same layout, from the checkpoint


def test_baseten_variables_need_no_flags(forked_cli: ForkedCli, tmp_path: Path) -> None:
    checkpoint_dir = tmp_path / "bt_checkpoints"
    baseten = {
        "BT_GROUP_SIZE": "1",
        "BT_NODE_RANK": "0",
        "BT_LEADER_ADDR": "127.0.0.1",
        "BT_TRAINING_JOB_ID": "job42",
        "BT_CHECKPOINT_DIR": str(checkpoint_dir),
    }
    done = forked_cli(["train", *BASE, "compute=multi_node"], tmp_path, 300, env=baseten)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    run_dir = checkpoint_dir / "baseten-job42"
    assert f"run directory: {run_dir}" in output
    assert (run_dir / "checkpoints" / f"step_{STEPS}" / "model.safetensors").is_file()
    log = (run_dir / "train.log").read_text()
    assert "baseten: nnodes=1 (BT_GROUP_SIZE), node_rank=0 (BT_NODE_RANK)" in log
