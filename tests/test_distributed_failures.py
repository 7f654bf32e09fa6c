"""How a run of several processes or nodes fails or stops, and says so: a rank's own error,
a rank killed, a node that does not come back, a preemption of one worker or one node, nodes
that train different runs, and the votes the ranks take within the collective timeout."""

from __future__ import annotations

import datetime
import json
import os
import re
import signal
import time
from pathlib import Path

import pytest

from tests.conftest import free_port
from tests.distributed_runs import (
    BASE,
    KILL_RANK_1,
    ONE_BY_TWO,
    finish,
    hooked_env,
    losing_env,
    node_args,
    start,
    wait_for,
)

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


@pytest.mark.long
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


@pytest.mark.long
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


@pytest.mark.long  # a worker signalled mid-run
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


@pytest.mark.long
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

    import runner.trainer.parallel  # noqa: F401  imported once here, not in each rank (~4 s)

    # Forked from this worker, which has imported what the ranks use and computes on one thread
    # (conftest's _one_thread), as runner forks a CPU run's workers: spawned, each rank imported
    # torch and runner's trainer again.
    args = (free_port(), tmp_path, nodes)
    processes = mp.start_processes(_vote, args=args, nprocs=2, join=False, start_method="fork")
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


@pytest.mark.long
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


@pytest.mark.long
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
