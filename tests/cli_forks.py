"""The real `runner` CLI, one forked process per command.

Each command still runs in a process of its own, through `runner.cli.main` exactly as
`python -m runner` calls it, with its own working directory, stdout, stderr and exit status; what
it saves is the ~5 s of importing torch, transformers and Hydra, which this server does once
before it forks. Nothing runs torch compute in the server itself, so forking it is safe.

The server is for the CPU alone. A CUDA context cannot survive a fork, and importing torchtune
asks for the GPU's compute capability, which creates one; so the server starts with no GPU
visible (CUDA_VISIBLE_DEVICES empty), checks that CUDA stayed uninitialised, and tests marked
`gpu` run the CLI in fresh interpreters instead (tests/conftest.py).

A command may be given environment variables that the runner reads as it runs (the platform's
BT_LOAD_CHECKPOINT_DIR, HOME for a path given with `~`): the fork sets them before it runs the
command. Not those read as the interpreter starts (PYTHONPATH) or as the preloaded modules
import (torch's thread and kernel settings, huggingface_hub's paths and offline switches): a
command that needs those set runs in a fresh interpreter (tests/conftest.py), and the client
refuses them here.

Protocol (one JSON object per line): the client writes {"argv": [...], "cwd": "...",
"env": {...}}; the server forks the command and answers {"pid": N} at once. {"wait": N,
"timeout_s": T} is answered when that command ends: {"returncode": N, "stdout": "...",
"stderr": "..."}, with returncode negative (the signal) when the command was killed, as
subprocess reports it. So several commands can run at once (the nodes of one run), each waited
for in turn. A request {"probe": true} is answered with what the server's own process sees of
CUDA.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

# What the subcommands import lazily; imported here once so that each fork starts warm.
PRELOAD = (
    "torch",
    "transformers",
    # transformers' Auto classes: their first import scans every model's module for its names
    # (several seconds), which each fork would otherwise repeat.
    "transformers.models.auto.tokenization_auto",
    "transformers.models.auto.modeling_auto",
    "hydra",
    "torchtune",
    "datasets",
    # What datasets' builders patch for streaming, on every load of a data file.
    "scipy.io",
    "runner.cli",
    "runner.job.job",
    "runner.job.start",
    "runner.recipes.finetune",
    "runner.job.preflight",
    "runner.hub.download",
    "runner.deploy",
    "runner.export",
    "runner.job.repro",
    "runner.job.lifecycle",
    "runner.job.cluster",
)


# What the interpreter reads from the environment as it starts (PYTHONPATH, its sitecustomize)
# and the preloaded modules as they import: set in a fork, too late.
READ_AT_IMPORT = (
    "ATEN_",
    "CUDA_",
    "HF_",
    "MKL_",
    "OMP_",
    "PYTHON",
    "PYTORCH_",
    "TORCH",
    "TRANSFORMERS_",
)


def _child(argv: list[str], cwd: str, env: dict[str, str], stdout: str, stderr: str) -> None:
    """Runs `runner ARGV` in this (forked) process and exits with its status; never returns."""
    code = 1
    try:
        os.setpgid(0, 0)
        os.environ.update(env)
        os.chdir(cwd)
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)  # the server's stdin carries the requests
        for fd, path in ((1, stdout), (2, stderr)):
            os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
        sys.argv = [str(Path(sys.modules["runner.cli"].__file__).with_name("__main__.py")), *argv]
        from runner.cli import main

        code = main()
    except SystemExit as exit:  # as the interpreter maps sys.exit's argument to a status
        if isinstance(exit.code, int) or exit.code is None:
            code = exit.code or 0
        else:
            print(exit.code, file=sys.stderr)
            code = 1
    except BaseException:  # noqa: BLE001 - reported as an uncaught exception would be
        traceback.print_exc()
        code = 1
    finally:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code if isinstance(code, int) else 1)


def _wait(pid: int, timeout_s: float) -> int:
    """The child's status as subprocess reports it; kills its process group past timeout_s."""
    deadline = time.monotonic() + timeout_s
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() > deadline:
            os.killpg(pid, signal.SIGKILL)
            return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        time.sleep(0.02)


def _cuda() -> dict[str, object]:
    """What this process sees of CUDA, without initialising it."""
    import torch

    return {
        "initialized": torch.cuda.is_initialized(),
        "visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
    }


def _outputs(scratch: str, pid: int) -> tuple[str, str]:
    """Where the command forked as `pid` writes its stdout and its stderr."""
    return os.path.join(scratch, f"{pid}.out"), os.path.join(scratch, f"{pid}.err")


def _read_once(path: str) -> str:
    with open(path, errors="replace") as f:
        text = f.read()
    os.unlink(path)
    return text


def serve() -> None:
    """Answers commands read from stdin until it closes."""
    for name in PRELOAD:
        importlib.import_module(name)
    assert not _cuda()["initialized"], "a preloaded module initialised CUDA: forks would fail"
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # stray prints of the server must not corrupt the answers
    with tempfile.TemporaryDirectory() as scratch:
        for line in sys.stdin:
            request = json.loads(line)
            if request.get("probe"):
                answer = _cuda()
            elif "wait" in request:
                pid = request["wait"]
                code = _wait(pid, request["timeout_s"])
                stdout, stderr = (_read_once(path) for path in _outputs(scratch, pid))
                answer = {"returncode": code, "stdout": stdout, "stderr": stderr}
            else:
                pid = os.fork()
                if pid == 0:
                    own = _outputs(scratch, os.getpid())
                    _child(request["argv"], request["cwd"], request["env"], *own)
                answer = {"pid": pid}
            answers.write(json.dumps(answer) + "\n")
            answers.flush()


@dataclass
class Forked:
    returncode: int
    stdout: str
    stderr: str


class Started:
    """A command running in the server (ForkedCli.start); wait() gives its outcome."""

    def __init__(self, cli: ForkedCli, pid: int, timeout_s: float) -> None:
        self.cli, self.pid, self.timeout_s = cli, pid, timeout_s

    def wait(self) -> Forked:
        return Forked(**self.cli._ask({"wait": self.pid, "timeout_s": self.timeout_s}))


class ForkedCli:
    """The client: `cli(argv, cwd)` runs one command in the server and returns its outcome;
    `cli.start(argv, cwd)` starts one and returns at once."""

    def __init__(self, env: dict[str, str]) -> None:
        self.server = subprocess.Popen(
            [sys.executable, __file__],
            env={**env, "CUDA_VISIBLE_DEVICES": ""},
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    def __call__(
        self, argv: list[str], cwd: Path, timeout_s: float, env: dict[str, str] | None = None
    ) -> Forked:
        """`env`: variables the command reads as it runs, set in its fork (see the module's
        docstring); one the preloaded modules read at import is refused."""
        return self.start(argv, cwd, timeout_s, env).wait()

    def start(
        self, argv: list[str], cwd: Path, timeout_s: float, env: dict[str, str] | None = None
    ) -> Started:
        """The command started; its process group is killed `timeout_s` after its wait() began."""
        env = env or {}
        early = sorted(name for name in env if name.upper().startswith(READ_AT_IMPORT))
        assert not early, f"{early} are read at import: run this command in a fresh interpreter"
        answer = self._ask({"argv": argv, "cwd": str(cwd), "env": env})
        return Started(self, answer["pid"], timeout_s)

    def probe(self) -> dict[str, object]:
        """What the server's process sees of CUDA."""
        return self._ask({"probe": True})

    def _ask(self, request: dict[str, object]) -> dict:
        self.server.stdin.write(json.dumps(request) + "\n")
        self.server.stdin.flush()
        line = self.server.stdout.readline()
        assert line, f"the CLI fork server ended (exit {self.server.poll()})"
        return json.loads(line)

    def close(self) -> None:
        self.server.stdin.close()
        self.server.wait(timeout=60)


if __name__ == "__main__":
    serve()
