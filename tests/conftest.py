"""Shared fixtures: the real CLI in a subprocess, with outputs under a temporary directory."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

import pytest

from runner.config import interpolations
from runner.rundir import RunDir
from tests.cli_forks import READ_AT_IMPORT, ForkedCli

if TYPE_CHECKING:
    from runner.deploy.engine import TransformersEngine

# The deploy tests' module-scoped fixtures (tests/serving.py).
pytest_plugins = ["tests.serving"]

# Fast settings for the tiny model; every test that trains starts from these. They mean the CPU
# in fp32 on any machine (compute=auto and dtype=auto pick CUDA and bf16_mixed where a GPU is
# visible); a later override on the same line wins, as Hydra keeps the last.
QUICK = [
    "compute=cpu",
    "dtype=fp32",
    "runtime.progress_bar=false",
    "runtime.loggers=[tensorboard]",
    "dataset.eval_samples=16",
    "eval.max_samples=64",
]
# `runner estimate` tokenizes the whole training split to count its tokens (4-5 s for the sample
# data's 32,000 records); the estimate tests check the model's, optimizer's and dtypes' figures,
# which a slice of the split gives as well.
ESTIMATE_DATA = "dataset.split='train[:512]'"


# The files that take longest go first: xdist hands out whole files in collection order, and
# the longest starting last would run on alone (test_distributed.py, which waits on nodes,
# comes early anyway, in the order of its name).
LONGEST_FILES = ("test_repro.py", "test_lifecycle.py")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The longest files first; tests marked `gpu` run where CUDA is visible and are skipped
    elsewhere (CI has no GPU)."""
    import torch

    items.sort(key=lambda item: item.path.name not in LONGEST_FILES)  # stable: else as collected

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is false)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# What torch.compile compiles with on the CPU (TORCHINDUCTOR_COMPILE_THREADS): inductor's default,
# a pool of compile processes, one per core, costs each compiling process a pool of fresh
# interpreters importing torch, for no gain where two workers already share the cores (a compiled
# run, 65.9 CPU-seconds, took 61.0 with one). A GPU machine keeps the default: its compiles are
# of a 1B model, on many cores.
COMPILE_THREADS = 1


@pytest.fixture(autouse=True, scope="session")
def _one_thread() -> None:
    """What a test computes in its own process runs on one thread, as its subprocesses do
    (hermetic_env): two xdist workers share the cores, and a second thread in each would only
    spin waiting for the other worker's. It compiles in this process too (COMPILE_THREADS)."""
    import torch

    torch.set_num_threads(1)
    if not torch.cuda.is_available():
        import torch._inductor.config

        torch._inductor.config.compile_threads = COMPILE_THREADS


@pytest.fixture(autouse=True, scope="session")
def _resolvers() -> None:
    """Tests that compose conf/ themselves need the runner_* resolvers, as the CLI registers."""
    interpolations.register()


# The line Python's fatal-error handler ends a crashed process's report with (a segfault's
# thread stacks, faulthandler): every extension module loaded, over 3,000 characters with torch
# and transformers, which pushed the stacks out of the output's tail that a failing test prints.
_EXTENSION_MODULES = re.compile(r"^Extension modules: .*\(total: \d+\)\n?", re.MULTILINE)


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str

    def __post_init__(self) -> None:
        self.stderr = _EXTENSION_MODULES.sub("", self.stderr)


@pytest.fixture
def fresh_dynamo() -> Iterator[None]:
    """Compiled code and torch._dynamo's counters of this test alone (its caches are per
    process)."""
    import torch
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


@pytest.fixture(scope="session")
def hermetic_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """No hub access, caches in a temporary directory, one thread per process."""
    home = tmp_path_factory.mktemp("hf_home")
    env = dict(os.environ)
    # One thread per process: two xdist workers share the cores, and a second thread per
    # process would only wait on the other worker's (OpenMP spins while it waits).
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", HF_HOME=str(home), OMP_NUM_THREADS="1")
    import torch

    if not torch.cuda.is_available():
        env.setdefault("TORCHINDUCTOR_COMPILE_THREADS", str(COMPILE_THREADS))
    return env


@pytest.fixture(scope="session")
def forked_cli(hermetic_env: dict[str, str]) -> Iterator[ForkedCli]:
    """The real CLI forked per command from a server that imported torch and Hydra once."""
    cli = ForkedCli(hermetic_env)
    yield cli
    cli.close()


# A process forked from the warm server runs each command (the same `runner.cli.main`, exit
# status and output), sparing each ~4 s of imports; a training of one process runs in it as in
# a user's `runner`, and several processes start under elastic_launch, forked from it as a
# user's `runner` forks them on the CPU (runner/job/launch.py).
# A call with its own environment forks too, its variables set in the fork, unless it sets one
# that torch or huggingface_hub read at import (cli_forks.READ_AT_IMPORT); such a call, and every
# call of a test marked `gpu` (the server sees no GPU: tests/cli_forks.py), starts a fresh
# interpreter.
FORKED_COMMANDS = {
    "train",
    "repro",
    "validate",
    "estimate",
    "download",
    "deploy",
    "export",
    "runs",
    "logs",
    "stop",
    "resume",
    "cluster",
}


def forks(node: pytest.Item, args: tuple[str, ...], env: dict[str, str] | None) -> bool:
    """Whether `runner_cli(*args, env=env)` in the test `node` runs in the fork server."""
    if node.get_closest_marker("gpu") is not None:
        return False
    read_at_import = any(name.upper().startswith(READ_AT_IMPORT) for name in env or {})
    return not read_at_import and bool(args) and args[0] in FORKED_COMMANDS


@pytest.fixture
def runner_cli(
    request: pytest.FixtureRequest,
    hermetic_env: dict[str, str],
    forked_cli: ForkedCli,
    tmp_path: Path,
):
    """Runs `runner ARGS...` as a user would; returns exit code and output."""

    def run(*args: str, cwd: Path = tmp_path, env: dict[str, str] | None = None) -> Result:
        if forks(request.node, args, env):
            forked = forked_cli(list(args), cwd, timeout_s=600, env=env)
            return Result(forked.returncode, forked.stdout, forked.stderr)
        proc = subprocess.run(
            [sys.executable, "-m", "runner", *args],
            cwd=cwd,
            env={**hermetic_env, **(env or {})},
            capture_output=True,
            text=True,
            timeout=600,
        )
        return Result(proc.returncode, proc.stdout, proc.stderr)

    return run


@contextlib.contextmanager
def sweep_lock_held(sweep: Path) -> Iterator[None]:
    """The sweep directory's lock held inside the block by another process, as a running
    sweep's own process holds it (runner.rundir.hold_until_exit)."""
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import time; from pathlib import Path; from runner.rundir import hold_until_exit; "
            f"hold_until_exit(Path({str(sweep)!r})); print(flush=True); time.sleep(120)",
        ],
        stdout=subprocess.PIPE,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == b"\n"
        yield
    finally:
        holder.kill()
        holder.wait()


@contextlib.contextmanager
def files_limited_to(size: int) -> Iterator[None]:
    """This process may write no file past `size` bytes inside the block (`ulimit -f`): a disk
    that refuses a write, made real without a full disk (Python ignores SIGXFSZ, so the write
    fails with EFBIG or stops short)."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (size, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))


@contextlib.contextmanager
def transformers_warnings() -> Iterator[list[str]]:
    """The messages transformers' loggers warn with inside the block (its library logger does
    not propagate to the root logger that caplog watches)."""
    import logging

    messages: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: messages.append(record.getMessage())  # type: ignore[method-assign]
    library = logging.getLogger("transformers")
    library.addHandler(handler)
    try:
        yield messages
    finally:
        library.removeHandler(handler)


def losses(run_dir: Path) -> dict[int, float]:
    """Per-step training losses recorded in a run directory's metrics.jsonl."""
    return RunDir(run_dir).losses()


def ctrl_c_after_two_steps(args: list[str], env: dict[str, str], metrics: Path) -> str:
    """`runner ARGS` interrupted by Ctrl-C (SIGINT) once `metrics` (its run's metrics.jsonl)
    holds two steps more than it held before; its exit code checked (130), its stderr
    returned."""
    before = len(metrics.read_text().splitlines()) if metrics.exists() else 0
    proc = subprocess.Popen(
        [sys.executable, "-m", "runner", *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 600
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= before + 2):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.1)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 130, err[-3000:]
    return err


def load_script(where: str) -> ModuleType:
    """scripts/FOLDER/NAME.py imported as module NAME, `where` being "FOLDER/NAME" (scripts/ is
    not a package)."""
    path = Path(__file__).resolve().parent.parent / "scripts" / f"{where}.py"
    name = path.stem
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # where dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def free_port() -> int:
    """A loopback port free now (a server started right after binds it)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def greedy_texts(
    engine: TransformersEngine, prompts: list[list[int]], max_tokens: int
) -> list[str]:
    """A serving engine's greedy answers (runner.deploy.engine, in this process) to prompts
    sent together."""
    import asyncio

    from runner.deploy.generation import SamplingRequest

    async def one(ids: list[int]) -> str:
        request = SamplingRequest(ids, max_tokens, 0.0, 1.0, 0, [], 1, stream=False)
        return "".join([event.text async for event in engine.submit([request]).events()])

    async def together() -> list[str]:
        return list(await asyncio.gather(*map(one, prompts)))

    return asyncio.run(together())


@contextlib.contextmanager
def deploy_server(
    args: list[str], *, cwd: Path, env: dict[str, str], up_within_s: float
) -> Iterator[str]:
    """`runner deploy ARGS` on a free port in its own process, once /health answers: its base
    URL; terminated on leaving. An AssertionError with its output if it exits or is not up in
    `up_within_s`."""
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "runner", "deploy", *args, f"port={port}"],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + up_within_s
        while True:
            assert server.poll() is None, server.stdout.read()[-3000:]
            assert time.monotonic() < deadline, "the server did not come up"
            try:
                with urllib.request.urlopen(f"{url}/health") as response:
                    if response.status == 200:
                        break
            except OSError:
                time.sleep(0.3)
        yield url
    finally:
        server.terminate()
        server.wait(timeout=60)
