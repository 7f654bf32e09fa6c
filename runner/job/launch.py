"""Starts the recipe: in this process, or under torch.distributed's elastic agent.

On several nodes the same `runner train` line runs on each; every node's agent meets the others
in a c10d rendezvous at the recipe's `compute.rdzv_endpoint` (runner.job.rendezvous: torch's
c10d handler, plus each node's identity), under a run id derived from what the nodes share: the
platform's job id where there is one, else the rendezvous address. The store lives with node
rank 0. A failed worker or a lost node makes the agents restart the whole group (up to
`compute.max_restarts`); a lost node started again with the same line joins it, and the group
resumes from the latest whole checkpoint.
How the workers start: the workers of a CPU run are forked from the launcher, which has
already imported torch, torchtune and the rest while it resolved the recipe (a worker then
starts at once, not after those imports: ~4.75 s, scripts/bench/startup_times.py). The workers of a
GPU run start as fresh interpreters, since a CUDA context cannot survive a fork; so do those of
a deterministic run, so that the pinned kernel path (runner.trainer.determinism) is in their
environment before torch loads. A fork is safe because the launcher computes on one CPU thread
(as_launcher): a GNU OpenMP thread pool, once made, does not survive a fork, and the forked
worker's first parallel region would hang. A process that has trained in itself (a sweep's
earlier job) has made that pool, so its later jobs start fresh interpreters too.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import importlib
import logging
import os
import signal
import socket
import stat
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from runner.components import plain_dict
from runner.config import platforms
from runner.console import takeable
from runner.errors import UserError
from runner.job import stops
from runner.rundir import ACTIVE_STATES, RunDir
from runner.trainer import determinism
from runner.trainer.parent import LAUNCHER_PID_ENV, PR_SET_PDEATHSIG, STOP_SIGNALS

# The training loop of every method (recipes/finetune.py), a module that `python -m` runs.
RECIPE_MODULE = "runner.recipes.finetune"
# The exit status of a run stopped by SIGTERM after saving (128 + SIGTERM), as shells report it.
EXIT_SIGTERM = 128 + signal.SIGTERM

log = logging.getLogger(__name__)

# Whether this process has trained in itself, and so made its OpenMP pool (see above).
_trained_here = False


def as_launcher() -> None:
    """Keeps this process's own torch work (resolving the recipe, checking the data) on one CPU
    thread, so that it can fork the workers of a CPU run. Call it before any torch compute; a
    run trained in this process sets its own threads (runner.trainer.process)."""
    import torch

    torch.set_num_threads(1)


def in_process(recipe: DictConfig) -> bool:
    """Whether `launch` runs the recipe in this process: one process, no restarts, and not
    the pinned kernel path (whose environment a fresh worker starts with)."""
    compute = recipe.compute
    one = compute.nnodes * compute.nproc_per_node == 1
    return one and compute.max_restarts == 0 and not recipe.runtime.deterministic


def launch(
    recipe: DictConfig, recipe_path: Path, node_rank: int | None = None
) -> dict[str, Any] | None:
    """Runs the recipe; one process without restarts runs in-process, more under elastic_launch.

    `node_rank`: this node's place in a multi-node run, where known (node_rank_of). Returns the
    recipe's result when it ran in this process. A run stopped by SIGTERM exits 143.
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
    if in_process(recipe):
        global _trained_here
        _trained_here = True
        result: dict[str, Any] = importlib.import_module(RECIPE_MODULE).run(recipe_path)
        return result
    pinned = determinism.pinned_environment() if deterministic else {}
    with environment({**pinned, LAUNCHER_PID_ENV: str(os.getpid())}):
        _elastic_launch(recipe, recipe_path, node_rank)
    return None


def _why_fresh(recipe: DictConfig) -> str | None:
    """Why the workers start as fresh interpreters; None: they fork from this process (the
    module's docstring says when)."""
    import torch

    if recipe.compute.device != "cpu" or torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        return "CUDA does not survive a fork"
    if recipe.runtime.deterministic:
        return "a deterministic run pins its kernel path before torch loads"
    if _trained_here or torch.get_num_threads() != 1:
        return "this process has computed on several threads, and OpenMP does not survive a fork"
    return None


class _LineOnly(logging.Filter):
    """torch reports a forked worker's failure with the traceback of its own
    ProcessExitedException, under the worker's own: the line alone says it."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.exc_info, record.exc_text = None, None
        return True


class _StopPassedOn(logging.Filter):
    """The elastic agent's warnings as it passes a stop on to its workers, which runner's own
    lines say (stopped at step N, the checkpoint, the status): off the console."""

    NOTICES = (
        "Received %s death signal, shutting down workers",
        "Closing process %s via signal %s",
    )

    def filter(self, record: logging.LogRecord) -> bool:
        return record.msg not in self.NOTICES


def _quiet_torch_elastic(forked: bool) -> None:
    """Filters torch elastic's loggers, once a process (_LineOnly where workers are forked)."""
    agent = logging.getLogger("torch.distributed.elastic.agent.server.api")
    workers = logging.getLogger("torch.distributed.elastic.multiprocessing.api")
    wanted = [(agent, _StopPassedOn), (workers, _StopPassedOn)]
    for torch_log, quiet in wanted + ([(workers, _LineOnly)] if forked else []):
        if not any(isinstance(f, quiet) for f in torch_log.filters):
            torch_log.addFilter(quiet())


def node_rank_of(compute: DictConfig, recipe: DictConfig) -> int | None:
    """This node's rank: 0 on one node; else compute.node_rank as given or read from the
    platform (None where neither says, and c10d alone tells the nodes apart)."""
    if recipe.compute.nnodes == 1:
        return 0
    # A resume composes the default compute group, which has no node_rank.
    given = compute.node_rank if "node_rank" in compute else None
    if given is None:
        given = platforms.detect(recipe.compute.platform).values.get("node_rank")
    return None if given is None else int(given)


@contextlib.contextmanager
def environment(values: dict[str, str]) -> Iterator[None]:
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


def _forked_worker(recipe_path: str) -> None:
    """A worker forked from its launcher (runner.job.launch), put in the state a fresh
    interpreter starts in, then run as `python -m RECIPE_MODULE recipe_path` runs it."""
    # Its own session, as torch starts a fresh worker (start_new_session).
    os.setsid()
    # None of the launcher's sockets (its rendezvous store above all, which must go with it)
    # stays open in the worker, as none passes to a fresh one (close_fds).
    for name in os.listdir("/proc/self/fd") if sys.platform.startswith("linux") else ():
        with contextlib.suppress(OSError):  # the listing's own descriptor, closed by now
            if stat.S_ISSOCK(os.fstat(int(name)).st_mode):
                os.close(int(name))
    # torch.multiprocessing asks for SIGINT when the parent dies; _stop_with_launcher asks for
    # the worker's own signal, and checks for a launcher already gone, once it joined the run
    # (runner.trainer.process).
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, 0, 0, 0, 0)
    # The launcher's handlers: the elastic agent's of the stop signals (one ignored stays so,
    # as across a fresh interpreter's exec); Hydra's logging (its console, and RUN/train.log,
    # which rank 0 alone writes: _log_to_file).
    for signum in takeable(STOP_SIGNALS):
        default = signal.default_int_handler if signum == signal.SIGINT else signal.SIG_DFL
        signal.signal(signum, default)
    logging.root.handlers.clear()
    logging.root.setLevel(logging.WARNING)
    try:
        importlib.import_module(RECIPE_MODULE).run(recipe_path)
    except KeyboardInterrupt:
        sys.excepthook(*sys.exc_info())
        raise SystemExit(128 + signal.SIGINT) from None
    except Exception as err:  # noqa: BLE001 - a user error is one line, any other its traceback
        from runner.trainer.process import user_error_exit

        ended = user_error_exit(err)
        if ended is not None:
            raise ended from None
        sys.excepthook(*sys.exc_info())  # torch.distributed's: each line names the rank
        raise SystemExit(1) from None
    if os.getppid() != int(os.environ[LAUNCHER_PID_ENV]):
        # Its launcher died (and the worker saved and stopped): torch's wrapper around this
        # function would wait for it to take the result, for ever. A launcher that dies during
        # that wait ends the worker with the parent-death signal.
        _exit_now()
    # torch's wrapper puts the result into its queue's pipe, then waits for the agent to have
    # read every worker's: an agent that is shutting down on a stop (runner stop, Ctrl-C) never
    # does, and killed the saved workers 30 s later ("Unable to shutdown process ... via 15"),
    # the run's processes and its lock held all that while. The result is in the pipe by then,
    # where the agent reads it after this process has gone, as after any worker's end.
    threading.Thread(target=_exit_soon, daemon=True, name="exit-after-result").start()


def _exit_soon(after_s: float = 1.0) -> None:
    time.sleep(after_s)
    _exit_now()


def _exit_now() -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _rendezvous_config(recipe: DictConfig, node_rank: int | None) -> Any:
    from torch.distributed.launcher.api import LaunchConfig

    from runner.job import rendezvous
    from runner.rundir.manifest import hashed_config
    from runner.trainer.process import AGENT_MONITOR_INTERVAL_S

    compute = recipe.compute
    identity = rendezvous.NodeIdentity(
        node_rank=node_rank,
        host=socket.gethostname(),
        run_dir=recipe.run_dir,
        config=hashed_config(plain_dict(recipe)),
    )
    rdzv_configs = rendezvous.parameters(identity)
    if compute.rdzv_timeout_s is not None:
        # join: how long the nodes wait for each other; read: for the store to come up.
        rdzv_configs["join_timeout"] = rdzv_configs["read_timeout"] = compute.rdzv_timeout_s
    # What every node of one job shares; the run directories are compared once they meet.
    shared = platforms.detect(compute.platform).job_id or compute.rdzv_endpoint
    rendezvous.register()
    return LaunchConfig(
        min_nodes=compute.nnodes,
        max_nodes=compute.nnodes,
        nproc_per_node=compute.nproc_per_node,
        run_id="runner-" + hashlib.sha256(shared.encode()).hexdigest()[:16],
        rdzv_backend=rendezvous.BACKEND,
        rdzv_endpoint=compute.rdzv_endpoint,
        rdzv_configs=rdzv_configs,
        max_restarts=compute.max_restarts,
        monitor_interval=AGENT_MONITOR_INTERVAL_S,
    )


def _elastic_launch(recipe: DictConfig, recipe_path: Path, node_rank: int | None) -> None:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError
    from torch.distributed.launcher.api import elastic_launch

    from runner.trainer.process import killed_by, tell

    config = _rendezvous_config(recipe, node_rank)
    log.info("rendezvous: c10d at %s, run id %s", config.rdzv_endpoint, config.run_id)
    run = RunDir(recipe.run_dir)
    # The agent's shared TCPStore outlives a restart with the last attempt's keys, so restarted
    # gloo ranks can read a dead peer's address ("connectFullMesh ... Connection refused"); a
    # store per attempt, hosted by rank 0, starts each attempt clean.
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    # The elastic agent takes its signals over even where this process ignores them (nohup's
    # SIGHUP, a background job's SIGINT), and stopped the workers with them: left out.
    named = tuple(signal.Signals[name.strip()] for name in config.signals_to_handle.split(","))
    config.signals_to_handle = ",".join(signum.name for signum in takeable(named))
    why_fresh = _why_fresh(recipe)
    log.info("workers: %s", f"fresh interpreters ({why_fresh})" if why_fresh else "forked")
    launched = time.time()
    stops.agent_holds_stops()
    _quiet_torch_elastic(forked=why_fresh is None)
    try:
        if why_fresh is None:
            config.start_method = "fork"
            elastic_launch(config, entrypoint=_forked_worker)(str(recipe_path))
        else:
            elastic_launch(config, entrypoint=sys.executable)("-m", RECIPE_MODULE, str(recipe_path))
    except SignalException as err:
        # The agent has already passed the signal on and waited for the workers to save.
        stops.stop_taken()
        ended = stops.ended_by_stop(run, err.sigval)
        _check_out()
        raise ended from None
    except ChildFailedError as err:
        # Killed by a signal, a rank recorded nothing of its own. Where one was killed outright
        # (SIGKILL: the out-of-memory killer, kill -9), it is the cause, and the others' signals
        # follow from it: a peer that crashed in its collective as that rank vanished (SIGSEGV
        # in gloo), recorded in the same instant, was named instead as the lower rank.
        killed = {rank: f for rank, f in err.failures.items() if f.exitcode < 0}
        outright = {rank: f for rank, f in killed.items() if f.signal_name() == "SIGKILL"}
        for rank, failure in (outright or killed).items():
            run.record_failure(rank, killed_by(failure.signal_name()))
        status = run.status()
        error = status.error or "see its output above"
        failed = f"training failed after {config.max_restarts} restart(s) (compute.max_restarts):"
        why = _why_failed(status.error, run.first_failure(since=launched))
        if error.startswith(failed):  # another node's launcher said it
            message = error
        elif why is not None:
            message = f"{failed} {why}"
        else:
            rank, failure = min(err.failures.items())
            message = f"{failed} rank {rank} exited with {failure.exitcode}; {error}"
        if status.state in ACTIVE_STATES or why is not None:
            run.write_status("failed", error=message)
        tell(message)
        # A worker that ended on a user error (a full disk, a file it cannot read) exits as the
        # CLI does on one (user_error_exit): so does the run.
        exits = {failure.exitcode for failure in err.failures.values()}
        raise SystemExit(UserError.exit_code if UserError.exit_code in exits else 1) from None
    except RendezvousError as err:
        message = _rendezvous_failure(err, recipe.compute, node_rank, run.latest_checkpoint())
        # Every node that reports it writes the same; a node that lost its group has no rank 0.
        run.write_status("failed", error=message)
        tell(message)
        raise SystemExit(1) from None
    # Workers stopped by SIGTERM end cleanly (no restart) and leave the run `cancelled`.
    status = run.status()
    if status.state == "cancelled":
        tell(f"{status.error}; status in {run.path}/status.json")
        raise SystemExit(EXIT_SIGTERM)


def _why_failed(error: str | None, recorded: tuple[int, str] | None) -> str | None:
    """Why the workers failed, where rank 0 only lost contact with the rank that failed first
    (or wrote nothing): the failure recorded of that rank, its own error or the signal that
    killed it; None where rank 0's own error in status.json is the run's."""
    from runner.trainer.process import LOST_CONTACT, rank_failed

    named = rank_failed(recorded)
    lost = error is None or error.startswith(LOST_CONTACT)
    return named if lost or (named is not None and error == named) else None


def _check_out() -> None:
    """Lets the other nodes' agents, whose workers stopped with ours, end at once."""
    from runner.job import rendezvous

    try:
        rendezvous.check_out()
    except Exception as err:  # noqa: BLE001 - they wait out torch's exit barrier instead
        log.warning("could not check out of the agents' exit barrier: %s", err)


def _rendezvous_failure(
    err: Exception, compute: DictConfig, node_rank: int | None, latest: Path | None
) -> str:
    """What went wrong in the rendezvous, in the user's words, with what to do."""
    from runner.job.rendezvous import NodesDisagree, NodesMissing

    where = f"at {compute.rdzv_endpoint}"
    within = f"within compute.rdzv_timeout_s={compute.rdzv_timeout_s} s"
    resume = (
        f"start the job again on every node to resume from {latest}"
        if latest is not None
        else "start the job again on every node"
    )
    if isinstance(err, NodesDisagree):
        return (
            f"the nodes that met {where} train different runs: {err}; start the same "
            "`runner train` line (the same overrides and hydra.run.dir) on every node"
        )
    if isinstance(err, NodesMissing) and err.after_loss:
        return f"{err} {within}; the run stops here: {resume}"
    if isinstance(err, NodesMissing):
        return (
            f"the {compute.nnodes} nodes did not all meet {where} {within} ({err}); start the "
            "same `runner train` line on every node, with the same compute.master_addr and "
            "compute.master_port"
        )
    why = f"{type(err).__name__}: {err}" if str(err) else type(err).__name__
    cause = err.__cause__
    if cause is not None:
        why += f" ({type(cause).__name__}: {cause})"
    if node_rank == 0:
        return f"node 0 could not host the rendezvous store {where} ({why}); is the port in use?"
    return (
        f"lost the rendezvous store {where}, which node 0 hosts: node 0 was lost or stopped, or "
        f"did not start {within} ({why}); {resume}"
    )
