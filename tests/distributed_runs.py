"""What the tests of several processes and several "nodes" on loopback share: the training line
of each layout, starting and finishing `runner train`, and the hooks that kill a rank or a node
(a sitecustomize.py first on the PYTHONPATH of every process a test starts)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from tests.cli_forks import ForkedCli, Started
from tests.conftest import free_port

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


def two_nodes(cli: ForkedCli, cwd: Path, run_dir: Path, *extra: str) -> list[tuple[int, str]]:
    """Starts `runner train` twice at once, forked from the suite's warm CLI server, as nodes 0
    and 1 of a c10d rendezvous on 127.0.0.1."""
    args = ["train", *node_args(free_port(), f"hydra.run.dir={run_dir}", *extra)]
    nodes = [cli.start([*args, f"compute.node_rank={rank}"], cwd, 300) for rank in (0, 1)]
    return [(done.returncode, done.stdout + done.stderr) for done in map(Started.wait, nodes)]


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
