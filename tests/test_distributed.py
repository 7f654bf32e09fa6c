"""Several processes and several "nodes" on loopback: one run directory, the same losses at the
same global batch, checkpoints that move between world sizes, a lost worker, a preemption.

Every layout trains 6 steps at a global batch of 8 sequences: 1 node x 1 process with 4
micro-batches of 2, 1 x 2 with 2 micro-batches, 2 nodes x 2 processes with 1.
"""

from __future__ import annotations

import datetime
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
from tests.cli_forks import ForkedCli
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


def node_args(port: int, *extra: str) -> list[str]:
    """The `runner train` line of one of two nodes x two processes meeting at 127.0.0.1:port."""
    return [
        *BASE,
        "compute=multi_node",
        "compute.device=cpu",
        "compute.nnodes=2",
        "compute.nproc_per_node=2",
        "compute.master_addr=127.0.0.1",
        f"compute.master_port={port}",
        "gradient_accumulation_steps=1",
        *extra,
    ]


def two_nodes(env: dict[str, str], cwd: Path, run_dir: Path, *extra: str) -> list[tuple[int, str]]:
    """Starts `runner train` twice, as nodes 0 and 1 of a c10d rendezvous on 127.0.0.1."""
    args = node_args(free_port(), f"hydra.run.dir={run_dir}", *extra)
    nodes = [start(env, cwd, *args, f"compute.node_rank={rank}") for rank in (0, 1)]
    return [finish(node) for node in nodes]


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
def layouts(
    hermetic_env: dict[str, str], forked_cli: ForkedCli, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Path]:
    """The same 6 steps trained as 1x1, 1x2 and 2x2 (nodes x processes)."""
    root = tmp_path_factory.mktemp("layouts")
    runs = {name: root / name for name in ("1x1", "1x2", "2x2")}
    OUTPUTS["1x1"] = train(forked_cli, root, runs["1x1"], *ONE_BY_ONE)
    OUTPUTS["1x2"] = train(forked_cli, root, runs["1x2"], *ONE_BY_TWO)
    for code, output in two_nodes(hermetic_env, root, runs["2x2"]):
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


# Loaded by every Python process the test starts (it is first on PYTHONPATH): rank 1 of the
# first attempt kills itself with SIGKILL in its 5th optimizer step, after the step-3 checkpoint.
KILL_RANK_1 = """
import os
import signal
import torch.optim

_step, _calls = torch.optim.AdamW.step, [0]

def step(self, *args, **kwargs):
    # Read at the call: a worker forked from the launcher inherits this hook from it.
    if os.environ.get("RANK") == "1" and os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0":
        _calls[0] += 1
        if _calls[0] == 5:
            os.kill(os.getpid(), signal.SIGKILL)
    return _step(self, *args, **kwargs)

torch.optim.AdamW.step = step
"""


def hooked_env(env: dict[str, str], tmp_path: Path, hook: str) -> dict[str, str]:
    """`env` with `hook` as the sitecustomize.py of every Python process it starts (first on
    its PYTHONPATH): a fresh launcher loads it at its start, and its forked workers keep it."""
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(hook)
    path = ":".join(p for p in (str(hooks), env.get("PYTHONPATH", "")) if p)
    return {**env, "PYTHONPATH": path}


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


# Loaded as KILL_RANK_1 is: rank 1 runs out of host memory in its 2nd optimizer step (a real
# allocation torch's CPU allocator refuses: more bytes than any address space holds).
OOM_RANK_1 = """
import os
import torch
import torch.optim

_step, _calls = torch.optim.AdamW.step, [0]

def step(self, *args, **kwargs):
    if os.environ.get("RANK") == "1":
        _calls[0] += 1
        if _calls[0] == 2:
            torch.empty(2**60, dtype=torch.uint8)
    return _step(self, *args, **kwargs)

torch.optim.AdamW.step = step
"""


def test_a_ranks_own_error_is_the_runs_not_the_lost_contact_it_causes(
    hermetic_env, tmp_path: Path
) -> None:
    """Rank 0, which writes status.json, only loses contact with a rank that failed on its own
    (here out of memory; a thread it could not start under a pids limit, a file it could not
    read): the run's error, in status.json, train.log and the last line, is that rank's own. Out
    of memory is one line with what takes less, not a traceback."""
    run_dir = tmp_path / "failed"
    args = [*BASE, *ONE_BY_TWO, "compute.max_restarts=1", f"hydra.run.dir={run_dir}"]
    code, output = finish(start(hooked_env(hermetic_env, tmp_path, OOM_RANK_1), tmp_path, *args))
    assert code == 1 and "Traceback" not in output, output[-3000:]
    assert "[rank1]: out of memory on the host after " in output, output[-3000:]
    cause = r"rank 1 failed: out of memory on the host after \d step\(s\): RuntimeError: \["
    last = output.strip().splitlines()[-1]
    assert last.startswith("training failed after 1 restart(s) (compute.max_restarts): "), last
    assert re.search(cause, last) and "lower batch_size=2 (a larger gradient_acc" in last, last
    status = json.loads((run_dir / "status.json").read_text())
    assert status["state"] == "failed" and status["error"] == last, status
    log = (run_dir / "train.log").read_text()
    assert last in log
    # While the group restarts, status.json names the same cause (rank 0 reads the record).
    assert re.search(
        r"restarting \(1 restart\(s\) left of compute.max_restarts\) after " + cause, log
    )
    # Kept until rank 1 starts again (a restart, a resume), which clears it.
    assert (run_dir / ".failed-rank1").read_text().startswith("out of memory on the host")


def test_a_rank_killed_by_a_signal_is_named_not_the_lost_contact_it_causes(
    hermetic_env, tmp_path: Path
) -> None:
    """A rank killed (the kernel's out-of-memory killer sends SIGKILL) records nothing: its
    launcher records it from its exit, as the rank's own failure, which every node names, not
    rank 0's lost contact with it."""
    run_dir = tmp_path / "killed"
    args = [*BASE, *ONE_BY_TWO, "compute.max_restarts=0", f"hydra.run.dir={run_dir}"]
    code, output = finish(start(hooked_env(hermetic_env, tmp_path, KILL_RANK_1), tmp_path, *args))
    assert code == 1 and "Traceback" not in output, output[-3000:]
    last = output.strip().splitlines()[-1]
    assert last.startswith(
        "training failed after 0 restart(s) (compute.max_restarts): rank 1 failed: killed by "
        "SIGKILL (the kernel's out-of-memory killer"
    ), output[-3000:]
    status = json.loads((run_dir / "status.json").read_text())
    assert status["state"] == "failed" and status["error"] == last, status


def test_sigterm_to_one_worker_saves_a_checkpoint_and_exits_143(
    hermetic_env, tmp_path: Path
) -> None:
    """SIGTERM to rank 0 alone (a preempted node: the others must stop with it, not restart the
    group). SIGTERM to a launcher, which its agent passes on to its workers, is the two-node
    test's (test_sigterm_to_one_node_stops_every_node_at_once)."""
    run_dir = tmp_path / "preempted"
    args = [*BASE, *ONE_BY_TWO, "max_steps=400", "runtime.save_every_n_steps=null"]
    proc = start(hermetic_env, tmp_path, *args, f"hydra.run.dir={run_dir}")
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + 600
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.1)
    status = json.loads((run_dir / "status.json").read_text())
    os.kill(status["pid"], signal.SIGTERM)  # rank 0 writes the status
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


# Loaded by every Python process of the node a test loses (first on its PYTHONPATH there): in
# that node's first life, its local rank 0 kills the node's whole process tree (launcher,
# agent and workers) with SIGKILL in its 5th optimizer step, after the step-3 checkpoint.
LOSE_NODE = """
import glob
import os
import signal
import torch.optim

_marker = os.environ["RUNNER_TEST_LOSE_NODE"]
_step, _calls = torch.optim.AdamW.step, [0]

def _tree(pid):
    children = []
    for path in glob.glob(f"/proc/{pid}/task/*/children"):
        children += [int(c) for c in open(path).read().split()]
    return [pid] + [p for child in children for p in _tree(child)]

def step(self, *args, **kwargs):
    # Read at the call: a worker forked from the launcher inherits this hook from it.
    if os.environ.get("LOCAL_RANK") == "0" and not os.path.exists(_marker):
        _calls[0] += 1
        if _calls[0] == 5:
            open(_marker, "w").close()
            for pid in _tree(int(os.environ["RUNNER_LAUNCHER_PID"])):
                os.kill(pid, signal.SIGKILL)
    return _step(self, *args, **kwargs)

torch.optim.AdamW.step = step
"""


def losing_env(env: dict[str, str], tmp_path: Path) -> dict[str, str]:
    """`env` for the node that the LOSE_NODE hook kills once."""
    return {
        **hooked_env(env, tmp_path, LOSE_NODE),
        "RUNNER_TEST_LOSE_NODE": str(tmp_path / "node-lost"),
    }


def wait_for(path: Path, proc: subprocess.Popen, within_s: float = 300) -> None:
    deadline = time.monotonic() + within_s
    while not path.exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.2)


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


def test_a_node_that_does_not_come_back_fails_the_run_naming_it(
    hermetic_env, tmp_path: Path
) -> None:
    """Node 1 starts first (torch alone would host the rendezvous store there) and is lost for
    good: node 0, which hosts the store, ends within the rendezvous timeout, naming node 1."""
    run_dir, timeout_s = tmp_path / "lost", 20
    port = free_port()
    args = [*node_args(port, f"compute.rdzv_timeout_s={timeout_s}"), f"hydra.run.dir={run_dir}"]
    node1 = start(losing_env(hermetic_env, tmp_path), tmp_path, *args, "compute.node_rank=1")
    wait_for(run_dir / "status.json", node1)  # written just before its launch
    node0 = start(hermetic_env, tmp_path, *args, "compute.node_rank=0")
    assert node1.wait(timeout=300) == -signal.SIGKILL
    lost_at = time.monotonic()
    code, output = finish(node0)
    waited = time.monotonic() - lost_at
    assert code == 1, output[-3000:]
    assert timeout_s <= waited < timeout_s + 45, waited
    assert "node 1 (" in output and "left the group and did not come back" in output, output[-3000:]
    assert f"compute.rdzv_timeout_s={timeout_s}" in output
    # Node 0's workers, whose peers went with node 1, say so in a line each: no traceback.
    assert "Traceback" not in output, output[-6000:]
    lost = [line for line in output.splitlines() if "lost its peer at 127.0.0.1:" in line]
    assert lost and all(" during " in line for line in lost), output[-6000:]
    status = json.loads((run_dir / "status.json").read_text())
    assert status["state"] == "failed" and "node 1 (" in status["error"], status
    assert (run_dir / "checkpoints" / "step_3" / "model.safetensors").is_file()


def test_a_backend_error_that_is_no_lost_peer_keeps_its_traceback() -> None:
    """Only what gloo and NCCL say of a peer gone is one line; a bug stays a traceback."""
    from runner.trainer.process import lost_peer_line

    mismatch = "[../third_party/gloo/gloo/transport/tcp/pair.cc:446] op.preamble.length <= "
    assert lost_peer_line(RuntimeError(f"{mismatch}op.nbytes. 8 vs 4")) is None
    assert lost_peer_line(ValueError("Connection reset by peer")) is None  # not the backend's
    reset = "[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Read error [10.0.0.2]:41"
    line = lost_peer_line(RuntimeError(f"{reset}: Connection reset by peer"))
    assert line == (
        "[rank0]: lost its peer at 10.0.0.2:41 during a collective (Connection reset by peer): "
        "a process or node of the run is gone or hung"
    )


def _vote(rank: int, port: int, out: Path, nodes: int) -> None:
    """Rank `rank` of two gloo processes on loopback, on one node or each on its own (as
    torchrun's LOCAL_WORLD_SIZE says), placed as runner places a rank: two votes, then rank 0
    votes alone while rank 1 hangs; what it saw goes to out/rank{rank}.json."""
    import torch.distributed as dist

    from runner.trainer.parallel import any_rank, placement
    from runner.trainer.process import lost_peer_line

    os.environ["LOCAL_WORLD_SIZE"] = str(2 // nodes)
    timeout = datetime.timedelta(seconds=2)  # as runner's process group: the collective timeout
    address = f"tcp://127.0.0.1:{port}"
    dist.init_process_group("gloo", init_method=address, rank=rank, world_size=2, timeout=timeout)
    try:
        place = placement("cpu", "fp32", collective_timeout_s=2)
        group = place.vote_group
        seen = {
            "group": None if group is None else dist.get_backend(group),
            "default_group": group == dist.group.WORLD,
            "votes": [any_rank(rank == 1, place), any_rank(False, place)],
        }
        if rank == 0:
            started = time.monotonic()
            try:
                seen["lost"] = f"voted {any_rank(True, place)} alone"
            except RuntimeError as err:
                seen["lost"] = lost_peer_line(err)
            seen["waited_s"] = time.monotonic() - started
        else:
            while not (out / "rank0.json").exists():  # hung, not gone, until rank 0 is done
                time.sleep(0.1)
        (out / f"rank{rank}.json").write_text(json.dumps(seen))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("nodes", [1, 2])
def test_the_ranks_vote_over_gloo_of_their_own_within_the_collective_timeout(
    tmp_path: Path, nodes: int
) -> None:
    """On one node the votes of each step (a SIGTERM stop, max_forward_tokens' passes) go over a
    gloo group other than the default one, which on GPUs is NCCL's, whose results the host
    reads only once the GPU has run every kernel queued before; across nodes, over the default
    group (gloo would need each node's hostname to resolve to an address the others reach).
    Either way the ranks agree, and a hung peer fails the vote within
    compute.collective_timeout_s, reported as a lost peer."""
    import torch.multiprocessing as mp

    processes = mp.spawn(_vote, args=(free_port(), tmp_path, nodes), nprocs=2, join=False)
    deadline = time.monotonic() + 60
    while not processes.join(timeout=5):
        if time.monotonic() > deadline:  # rank 0's vote waits past the timeout it was given
            for process in processes.processes:
                process.kill()
            pytest.fail("the ranks' votes did not end in 60 s")
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for seen in ranks:
        assert seen["group"] == ("gloo" if nodes == 1 else None) and not seen["default_group"]
        assert seen["votes"] == [True, False], seen
    assert "during all_reduce" in str(ranks[0]["lost"]), ranks[0]
    assert 2 <= ranks[0]["waited_s"] < 30, ranks[0]


def test_nodes_with_different_run_directories_fail_at_once(hermetic_env, tmp_path: Path) -> None:
    """They meet (on the rendezvous address they share), compare and stop, long before
    compute.rdzv_timeout_s."""
    dirs = [tmp_path / "run-a", tmp_path / "run-b"]
    args = node_args(free_port(), "compute.rdzv_timeout_s=600")
    started = time.monotonic()
    nodes = [
        start(hermetic_env, tmp_path, *args, f"compute.node_rank={rank}", f"hydra.run.dir={d}")
        for rank, d in enumerate(dirs)
    ]
    results = [finish(node) for node in nodes]
    assert time.monotonic() - started < 300
    for (code, output), run_dir in zip(results, dirs, strict=True):
        assert code == 1, output[-3000:]
        assert "train different runs" in output and "run directory" in output, output[-3000:]
        assert str(dirs[0]) in output and str(dirs[1]) in output
        status = json.loads((run_dir / "status.json").read_text())
        assert status["state"] == "failed" and str(dirs[1 - dirs.index(run_dir)]) in status["error"]


def test_sigterm_to_one_node_stops_every_node_at_once(hermetic_env, tmp_path: Path) -> None:
    """A node preempted alone (`runner stop` there, an evicted pod): every rank saves, and the
    other node ends too, not held for 300 s in torch's exit barrier by the stopped agent."""
    run_dir = tmp_path / "preempted"
    args = node_args(free_port(), "max_steps=400", "runtime.save_every_n_steps=null")
    nodes = [
        start(hermetic_env, tmp_path, *args, f"hydra.run.dir={run_dir}", f"compute.node_rank={r}")
        for r in (0, 1)
    ]
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + 600
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
        assert all(n.poll() is None for n in nodes) and time.monotonic() < deadline
        time.sleep(0.1)
    signalled = time.monotonic()
    os.kill(nodes[1].pid, signal.SIGTERM)
    results = [finish(node) for node in nodes]
    assert time.monotonic() - signalled < 120
    for code, output in results:
        assert code == 143, output[-3000:]
    status = json.loads((run_dir / "status.json").read_text())
    assert status["state"] == "cancelled" and "SIGTERM" in status["error"], status
    checkpoint = run_dir / "checkpoints" / f"step_{status['step']}"
    assert (checkpoint / "model.safetensors").is_file()
    assert (checkpoint / "training_state.pt").is_file()
    assert [p.name for p in (run_dir / "checkpoints").iterdir()] == [checkpoint.name]
    assert all("resuming from" not in output for _, output in results)  # stopped, not restarted
    # Each worker ended as it saved, not killed by its shutting-down agent 30 s on.
    assert all("Unable to shutdown process" not in output for _, output in results)
    # The agent passing the stop on is not for the console: runner's own lines say it.
    assert "death signal" not in results[1][1] and "via signal SIGTERM" not in results[1][1]
