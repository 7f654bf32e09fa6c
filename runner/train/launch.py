"""Starts the recipe: in this process, or under torch.distributed's elastic agent.

On several nodes the same `runner train` line runs on each; every node's agent meets the others
in a c10d rendezvous at the recipe's `compute.rdzv_endpoint`, under a run id derived from the run
directory (the same on every node by construction). A failed worker makes the agents restart the
whole group (up to `compute.max_restarts`), which resumes from the latest whole checkpoint.
A deterministic run always starts fresh worker processes, so that the pinned kernel path
(runner.train.determinism) is in their environment before torch loads.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import logging
import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from runner.config import platforms
from runner.rundir import RunDir
from runner.train import determinism

# Tells a worker its launcher's process id, so that it stops when the launcher dies
# (runner/train/process.py).
LAUNCHER_PID_ENV = "RUNNER_LAUNCHER_PID"
# The training loop of every method (recipes/finetune.py), a module that `python -m` runs.
RECIPE_MODULE = "runner.recipes.finetune"
# The exit status of a run stopped by SIGTERM after saving (128 + SIGTERM), as shells report it.
EXIT_SIGTERM = 128 + signal.SIGTERM

log = logging.getLogger(__name__)


def launch(recipe: DictConfig, recipe_path: Path) -> dict[str, Any] | None:
    """Runs the recipe; one process without restarts runs in-process, more under elastic_launch.

    Returns the recipe's result when it ran in this process. A run stopped by SIGTERM exits 143.
    """
    os.environ.update(recipe.runtime.env)
    compute = recipe.compute
    nnodes, nproc_per_node = compute.nnodes, compute.nproc_per_node
    deterministic = recipe.runtime.deterministic
    if deterministic:
        determinism.check_machine()
    log.info(
        "launch: %d node(s) x %d process(es); platform: %s",
        nnodes,
        nproc_per_node,
        platforms.detect(compute.platform).describe(),
    )
    if nnodes * nproc_per_node == 1 and compute.max_restarts == 0 and not deterministic:
        result: dict[str, Any] = importlib.import_module(RECIPE_MODULE).run(recipe_path)
        return result
    pinned = determinism.pinned_environment() if deterministic else {}
    with _environment({**pinned, LAUNCHER_PID_ENV: str(os.getpid())}):
        _elastic_launch(recipe, recipe_path)
    return None


@contextlib.contextmanager
def _environment(values: dict[str, str]) -> Iterator[None]:
    """`values` in os.environ (which the workers inherit) for the duration, then as before."""
    before = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _rendezvous_config(recipe: DictConfig) -> Any:
    from torch.distributed.launcher.api import LaunchConfig

    compute = recipe.compute
    rdzv_configs = {}
    if compute.rdzv_timeout_s is not None:
        # join: how long the nodes wait for each other; read: for the store to come up.
        rdzv_configs = {
            "join_timeout": compute.rdzv_timeout_s,
            "read_timeout": compute.rdzv_timeout_s,
        }
    run_id = "runner-" + hashlib.sha256(recipe.run_dir.encode()).hexdigest()[:16]
    return LaunchConfig(
        min_nodes=compute.nnodes,
        max_nodes=compute.nnodes,
        nproc_per_node=compute.nproc_per_node,
        run_id=run_id,
        rdzv_backend="c10d",
        rdzv_endpoint=compute.rdzv_endpoint,
        rdzv_configs=rdzv_configs,
        max_restarts=compute.max_restarts,
        monitor_interval=0.5,
    )


def _elastic_launch(recipe: DictConfig, recipe_path: Path) -> None:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError
    from torch.distributed.launcher.api import elastic_launch

    config = _rendezvous_config(recipe)
    log.info("rendezvous: c10d at %s, run id %s", config.rdzv_endpoint, config.run_id)
    run = RunDir(recipe.run_dir)
    # The agent's shared TCPStore outlives a restart with the last attempt's keys, so restarted
    # gloo ranks can read a dead peer's address ("connectFullMesh ... Connection refused"); a
    # store per attempt, hosted by rank 0, starts each attempt clean.
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    try:
        elastic_launch(config, entrypoint=sys.executable)("-m", RECIPE_MODULE, str(recipe_path))
    except SignalException as err:
        # The agent has already passed the signal on and waited for the workers to save.
        name = signal.Signals(err.sigval).name
        print(f"stopped by {name}; status in {recipe.run_dir}/status.json", file=sys.stderr)
        raise SystemExit(128 + int(err.sigval)) from None
    except ChildFailedError as err:
        rank, failure = min(err.failures.items())
        error = run.status().error or "see its output above"
        print(
            f"training failed after {config.max_restarts} restart(s) (compute.max_restarts): "
            f"rank {rank} exited with {failure.exitcode}; {error}",
            file=sys.stderr,
        )
        raise SystemExit(1) from None
    except RendezvousError as err:
        why = f"{type(err).__name__}: {err}" if str(err) else type(err).__name__
        print(
            f"the {config.min_nodes} nodes did not all meet at {config.rdzv_endpoint} within "
            f"compute.rdzv_timeout_s={recipe.compute.rdzv_timeout_s} s ({why}); start the "
            "same `runner train` line on every node, with the same compute.master_addr, "
            "compute.master_port and run directory",
            file=sys.stderr,
        )
        raise SystemExit(1) from None
    # Workers stopped by SIGTERM end cleanly (no restart) and leave the run `cancelled`.
    status = run.status()
    if status.state == "cancelled":
        print(f"{status.error}; status in {run.path}/status.json", file=sys.stderr)
        raise SystemExit(EXIT_SIGTERM)
