"""Shared fixtures: the real CLI in a subprocess, with outputs under a temporary directory."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from runner import resolvers
from runner.rundir import RunDir
from tests.cli_forks import ForkedCli

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


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked `gpu` run where CUDA is visible and are skipped elsewhere (CI has no GPU)."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is false)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True, scope="session")
def _resolvers() -> None:
    """Tests that compose conf/ themselves need the runner_* resolvers, as the CLI registers."""
    resolvers.register()


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str


@pytest.fixture(scope="session")
def hermetic_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """No hub access, caches in a temporary directory, one thread per process."""
    home = tmp_path_factory.mktemp("hf_home")
    env = dict(os.environ)
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", HF_HOME=str(home))
    env.pop("OMP_NUM_THREADS", None)
    return env


@pytest.fixture(scope="session")
def forked_cli(hermetic_env: dict[str, str]) -> Iterator[ForkedCli]:
    """The real CLI forked per command from a server that imported torch and Hydra once."""
    cli = ForkedCli(hermetic_env)
    yield cli
    cli.close()


# Commands that start no training: a process forked from the warm server runs them (the same
# `runner.cli.main`, exit status and output), sparing each ~5 s of imports. Trainings, and any
# call with its own environment (read by torch and huggingface_hub at import), start a fresh
# interpreter as a user's `runner` does.
FORKED_COMMANDS = {
    "validate",
    "estimate",
    "download",
    "deploy",
    "export",
    "runs",
    "logs",
    "stop",
    "cluster",
}


@pytest.fixture
def runner_cli(hermetic_env: dict[str, str], forked_cli: ForkedCli, tmp_path: Path):
    """Runs `runner ARGS...` as a user would; returns exit code and output."""

    def run(*args: str, cwd: Path = tmp_path, env: dict[str, str] | None = None) -> Result:
        if env is None and args and args[0] in FORKED_COMMANDS:
            forked = forked_cli(list(args), cwd, timeout_s=600)
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


def losses(run_dir: Path) -> dict[int, float]:
    """Per-step training losses recorded in a run directory's metrics.jsonl."""
    return RunDir(run_dir).losses()
