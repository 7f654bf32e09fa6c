"""One training process: what surrounds a recipe's setup and train loop.

The process group (gloo on CPU, nccl on GPU, with the collective timeout), CPU threads, the
pinned kernel path, the log file, the heartbeat, SIGTERM (the loop saves at the next step
boundary, see STOP), and the run's final state: completed, cancelled or failed with
the error. recipes/finetune.py runs through it.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import re
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf

from runner.config.schema import read_recipe
from runner.console import outlive_the_reader
from runner.errors import (
    Diverged,
    UserError,
    address_space_limit,
    error_line,
    redact_text,
    user_error_in,
)
from runner.paths import shell_path
from runner.rundir import LOG_FILE, STATUS_FILE, Heartbeat, RunDir, join_run_lock
from runner.rundir.manifest import record_kernels
from runner.trainer import determinism
from runner.trainer.parent import LAUNCHER_PID_ENV, PR_SET_PDEATHSIG, stop_signals_to
from runner.trainer.progress import Reporter

log = logging.getLogger("runner.recipe")


class StopRequest:
    """Set by SIGTERM (a preemption, `runner stop`) or SIGINT (Ctrl-C); the loop checks it at
    each step boundary (FinetuneRecipe._stop_due) and saves a checkpoint before it stops."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self.signal = signal.SIGTERM

    def request(self, signum: int) -> None:
        self.signal = signal.Signals(signum)
        self._event.set()

    def clear(self) -> None:
        self._event.clear()
        self.signal = signal.SIGTERM

    def is_set(self) -> bool:
        return self._event.is_set()


STOP = StopRequest()


def tell(line: str) -> None:
    """A line for the user on stderr that train.log keeps too (its console handler shows
    warnings only): how a run resumed, stopped or failed, which `runner logs` shows after."""
    log.info(line)
    print(line, file=sys.stderr, flush=True)


def _log_to_file(path: Path) -> None:
    """Sends the recipe's log lines to the run's log file, unless Hydra already does."""
    root = logging.getLogger()
    if any(getattr(h, "baseFilename", None) == str(path) for h in root.handlers):
        return
    handler = logging.FileHandler(path)
    # Hydra's format (conf/hydra/job_logging/runner.yaml), as a one-process run writes it.
    handler.setFormatter(logging.Formatter("[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.INFO)


def _start_process(cfg: DictConfig) -> bool:
    """Kernel path, process group and CPU threads for this process; whether it has peers."""
    if cfg.runtime.deterministic:
        determinism.apply_in_process()
    distributed = int(os.environ.get("WORLD_SIZE", 1)) > 1
    if distributed and not dist.is_initialized():
        dist.init_process_group(
            "nccl" if cfg.compute.device == "cuda" else "gloo",
            # A dead or hung peer ends the run with a timeout error instead of a hang.
            timeout=timedelta(seconds=cfg.compute.collective_timeout_s),
        )
    # OMP_NUM_THREADS where set (a parallel sweep's share, the pinned path), else a fair share of
    # the cores for each of this machine's processes (a launcher that trains in itself computed
    # on one thread until here: runner.job.launch.as_launcher).
    # OpenMP's list form (4,2: 4 threads, 2 in each nested region) gives its first count, as
    # OpenMP reads it (runner.config.runtime.check_threads checked the form).
    threads = os.environ.get("OMP_NUM_THREADS", "").partition(",")[0].strip()
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    share = max(1, (os.cpu_count() or 1) // local_world)
    torch.set_num_threads(int(threads) if threads.isdigit() else share)
    return distributed


class Recipe(Protocol):
    """What a process needs of a recipe (recipes/finetune.py's FinetuneRecipe)."""

    @property
    def run(self) -> RunDir: ...

    @property
    def reporter(self) -> Reporter: ...

    @property
    def step(self) -> int: ...

    @property
    def total_steps(self) -> int: ...

    @property
    def stopped_by(self) -> str | None:
        """Why the loop stopped before total_steps (SIGTERM), or None."""

    @property
    def last_eval(self) -> dict[str, float] | None: ...

    def setup(self) -> None: ...

    def train(self) -> dict[str, Any]: ...

    def best_checkpoint(self) -> dict[str, Any] | None: ...

    def cleanup(self) -> None: ...


def run(recipe_path: str | Path, recipe_class: Callable[[DictConfig], Recipe]) -> dict[str, Any]:
    """Runs `recipe_class` on the recipe at `recipe_path` in this process (one of several under
    torchrun): process group, threads, log file, heartbeat, SIGTERM, and the final status."""
    outlive_the_reader()  # a worker started as a fresh interpreter: its console, as its launcher's
    cfg = read_recipe(Path(recipe_path))
    _check_own_run(Path(recipe_path), cfg)
    RunDir(cfg.run_dir).record_failure(_rank(), None)  # an earlier attempt's, gone with it
    _join_launcher_lock()
    distributed = _start_process(cfg)
    recipe = recipe_class(cfg)
    status, rank_zero = recipe.reporter.status, recipe.reporter.is_rank_zero
    heartbeat = Heartbeat(recipe.run) if rank_zero else None
    if heartbeat is not None:
        _log_to_file(recipe.run.path / LOG_FILE)
        heartbeat.start()
        record_kernels(recipe.run, determinism.kernel_settings())
    try:
        with stop_signals():
            _stop_with_launcher(several_nodes=cfg.compute.nnodes > 1)
            recipe.setup()
            result = recipe.train()
        if recipe.stopped_by is None:
            result["eval"] = recipe.last_eval
            result["best"] = recipe.best_checkpoint()
            result["checkpoint"] = str(recipe.run.latest_checkpoint())
            status("completed", step=recipe.step, total_steps=recipe.total_steps)
        else:
            reason = f"{recipe.stopped_by}, after saving its checkpoint"
            status("cancelled", step=recipe.step, error=reason)
    except BaseException as err:
        state = "cancelled" if isinstance(err, KeyboardInterrupt) else "failed"
        at_step = {"step": err.step} if isinstance(err, Diverged) else {}
        lost = lost_peer_line(err)
        short = out_of_memory_line(err, cfg, recipe.step)
        message = short or _error_message(err, cfg)
        if lost is None and state == "failed" and not rank_zero:
            recipe.run.record_failure(_rank(), message)  # its peers lose contact with it after
        if lost is not None:
            # The rank that failed of its own error recorded it before its peers lost it (each
            # record left is this attempt's: every rank cleared its own before the group met).
            message = rank_failed(recipe.run.first_failure(since=0)) or message
        left = _restarts_left()
        if state == "failed" and left:
            # The elastic agents start the workers again (a lost node may come back within
            # compute.rdzv_timeout_s): the run lives on; the launcher records a failure at last.
            state = "initializing"
            message = f"restarting ({left} restart(s) left of compute.max_restarts) after {message}"
        with contextlib.suppress(UserError):  # its disk, full still: the error below says it
            status(state, error=message, **at_step)
        # The console's is the CLI's; an error told in one line keeps its traceback here.
        log.info("%s at step %d: %s", state, recipe.step, message, exc_info=short is not None)
        if lost is None and short is None:
            raise  # a bug: its traceback is the report
        # Not a bug but a peer gone, or memory run out: one line, then the launcher's message.
        tell(lost or (f"[rank{_rank()}]: {short}" if distributed else str(short)))
        if lost is not None:
            # The agent names the first worker it finds ended: the peer gone first, where it is
            # on this node (killed by a signal, it recorded nothing), not this rank after it.
            time.sleep(2 * AGENT_MONITOR_INTERVAL_S)
        raise SystemExit(1) from None
    finally:
        if heartbeat is not None:
            heartbeat.stop()
        recipe.cleanup()
        if distributed:
            dist.destroy_process_group()
    if recipe.stopped_by is not None:
        if rank_zero:
            tell(
                f"{recipe.stopped_by}: checkpoint {recipe.run.latest_checkpoint()}; "
                f"`runner resume {shell_path(cfg.run_dir)}` continues"
            )
        # A worker of the elastic agent ends cleanly, so that no agent restarts the group; the
        # launcher reads `cancelled` and exits 143 itself (runner/job/launch.py).
        if "TORCHELASTIC_RUN_ID" not in os.environ:
            raise SystemExit(128 + STOP.signal)  # 143 for SIGTERM, 130 for Ctrl-C
    return result


def user_error_exit(err: BaseException) -> SystemExit | None:
    """How a worker (of runner's launcher, or of torchrun) ends on a user error: its one line,
    as the CLI prints it, led by the rank where there are ranks, and the CLI's exit status for
    it, which the launcher passes on; None for any other error, a bug, whose traceback is the
    report. Left to the interpreter, a user error came as its chain of tracebacks (a full disk's
    three), and exit 1."""
    user_error = user_error_in(err)
    if user_error is None:
        return None
    rank = f"[rank{_rank()}]: " if "RANK" in os.environ else ""
    print(f"{rank}error: {user_error}", file=sys.stderr, flush=True)
    return SystemExit(user_error.exit_code)


def _restarts_left() -> int:
    """How many more times the elastic agent starts this process's group again once it fails
    (torch elastic's environment of its workers; 0 for a process of no agent's)."""
    count = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    most = os.environ.get("TORCHELASTIC_MAX_RESTARTS")
    return 0 if count is None or most is None else max(0, int(most) - int(count))


def _check_own_run(recipe_path: Path, cfg: DictConfig) -> None:
    """A recipe.yaml that lies in a run directory trains that run. One copied along with its
    run (cp -r RUN COPY) still names RUN in run_dir, which a torchrun of the copy would write
    into: refused, naming both."""
    home = recipe_path.resolve().parent
    if (home / STATUS_FILE).is_file() and home != Path(cfg.run_dir).resolve():
        raise UserError(
            "run_dir",
            cfg.run_dir,
            f"{recipe_path} lies in the run directory {home}, copied or moved from "
            f"{cfg.run_dir}; `runner resume {shell_path(home)}` goes on with the run where it "
            f"lies (and records it there), or give {cfg.run_dir}/recipe.yaml",
        )


@contextlib.contextmanager
def stop_signals() -> Iterator[None]:
    """SIGTERM and SIGINT ask the loop to stop at its next step boundary (a second Ctrl-C
    interrupts at once); the previous handlers come back after. A launcher takes them from
    the moment it records its process in the run's status (runner.job.job), so that a stop
    typed as the run starts, before its loop, is kept until the loop's first step boundary:
    it killed the process there, which left the run `created` with no checkpoint."""
    with stop_signals_to(_on_stop_signal):
        yield


def _join_launcher_lock() -> None:
    """A worker of the elastic agent holds the run's lock beside its launcher until it exits,
    so that no other trainer can take the run while it still writes there, even once the
    launcher is gone; a worker whose launcher died before it joined ends without writing."""
    launcher = os.environ.get(LAUNCHER_PID_ENV)
    if launcher is not None and not join_run_lock(int(launcher)):
        print(f"launcher {launcher} is gone: this worker leaves the run alone", file=sys.stderr)
        raise SystemExit(1)


def _stop_with_launcher(*, several_nodes: bool) -> None:
    """A worker of the elastic agent stops, as on SIGTERM, when its launcher dies (kill -9
    included), instead of training on unseen with nothing to report its end: it saves, records
    the run cancelled and exits, which frees the run's lock (_join_launcher_lock).

    On several nodes it dies at once instead (SIGKILL): its node has left the rendezvous with
    its agent, and a stop that all ranks agree on would end the other nodes' groups as
    `cancelled`, where their agents should restart the group for the node to rejoin.

    The agent runs inside the launcher's process and starts the workers from its main thread,
    which lives as long as the launcher: so the launcher is the parent whose death
    PR_SET_PDEATHSIG reports. A launcher gone before the signal was asked for has left this
    process to another parent, which the check after it sees.
    """
    launcher = os.environ.get(LAUNCHER_PID_ENV)
    if launcher is None or not sys.platform.startswith("linux"):
        return
    death = signal.SIGKILL if several_nodes else signal.SIGTERM
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, death, 0, 0, 0) != 0:
        log.warning("no parent-death signal (prctl: %s)", os.strerror(ctypes.get_errno()))
    if os.getppid() != int(launcher):
        if several_nodes:
            os.kill(os.getpid(), signal.SIGKILL)
        STOP.request(signal.SIGTERM)


def _on_stop_signal(signum: int, frame: Any) -> None:
    STOP.request(signum)
    if signum == signal.SIGINT:
        signal.signal(signal.SIGINT, signal.default_int_handler)


# What gloo and NCCL say when a peer's process or node is gone, or silent past the collective
# timeout. A backend error that says none of them (a shape mismatch, a bad argument) is a bug.
_LOST_PEER = re.compile(
    r"Connection (?:reset|closed) by peer|Broken pipe|Connection refused|[Tt]imed out|"
    r"Socket Timeout|communicator was aborted|collective operation timeout"
)
_PEER_ADDRESS = re.compile(r"\[([0-9A-Fa-f.:]+)\]:(\d+)")


def _from_backend(err: BaseException) -> bool:
    """gloo and NCCL report a lost or silent peer as a plain RuntimeError naming themselves."""
    return isinstance(err, RuntimeError) and ("gloo" in str(err) or "NCCL" in str(err))


def lost_peer_line(err: BaseException) -> str | None:
    """One line for an error that says this worker's peer is gone: which peer (the address the
    backend names), during which collective; None for any other error."""
    text = str(err)
    found = _LOST_PEER.search(text)
    if not (isinstance(err, dist.DistError) or (_from_backend(err) and found)):
        return None
    address = _PEER_ADDRESS.search(text)
    peer = f"its peer at {address[1]}:{address[2]}" if address else "a peer"
    why = found[0] if found else type(err).__name__
    return (
        f"[rank{_rank()}]: lost {peer} during {_collective(err)} ({why}): a process or node of the "
        "run is gone or hung"
    )


def _rank() -> int:
    """This process's rank in the run (0 for a process of none)."""
    return dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", 0))


def _collective(err: BaseException) -> str:
    """The torch.distributed call that raised `err`, from its traceback."""
    names = [
        frame.name
        for frame in traceback.extract_tb(err.__traceback__)
        if f"torch{os.sep}distributed{os.sep}" in frame.filename and frame.name != "wrapper"
    ]
    return names[-1] if names else "a collective"


# How this process's lines say a run was ended by its machine (ended_from_outside reads them).
OUT_OF_MEMORY = "out of memory on"
KILLED_BY = "killed by"
# What torch's CPU allocator says where it gets no memory (a CUDA one raises OutOfMemoryError).
_HOST_OUT_OF_MEMORY = "DefaultCPUAllocator: can't allocate memory"


def out_of_memory_line(err: BaseException, cfg: DictConfig, done: int) -> str | None:
    """One line for an error that says memory ran out, with the settings that take less, after
    `done` steps; None for any other error. Not a bug but a config too big for the device: the
    traceback says nothing more to its user."""
    if isinstance(err, torch.OutOfMemoryError):
        where = "the GPU"
    elif isinstance(err, MemoryError) or _HOST_OUT_OF_MEMORY in str(err):
        where = "the host"
    else:
        return None
    length = OmegaConf.select(cfg, "dataset.max_seq_len")
    fix = (
        f"lower batch_size={cfg.batch_size} (a larger gradient_accumulation_steps keeps the "
        f"global batch) or dataset.max_seq_len={length}"
        + ("" if cfg.activation_checkpointing else ", or set activation_checkpointing=true")
        + "; `runner estimate` gives the memory a config takes"
    )
    limit = address_space_limit()
    if where == "the host" and limit is not None:
        fix += f"; this process may map at most {limit / 2**30:.1f} GiB (ulimit -v)"
    return f"{OUT_OF_MEMORY} {where} after {done} step(s): {error_line(err).splitlines()[0]}; {fix}"


LOST_CONTACT = "lost contact with another rank"
# How often the launcher's elastic agent looks at its workers (runner/job/launch.py).
AGENT_MONITOR_INTERVAL_S = 0.5


def killed_by(signal_name: str) -> str:
    """A rank's own failure where a signal killed it (recorded by its launcher, RunDir's
    record_failure): SIGKILL is mostly the kernel's out-of-memory killer's."""
    if signal_name != "SIGKILL":
        return f"{KILLED_BY} {signal_name}"
    return (
        f"{KILLED_BY} SIGKILL (the kernel's out-of-memory killer sends it where the host runs out "
        "of memory: `dmesg` says so, and `runner estimate` prices a run's memory; or a `kill -9`)"
    )


def ended_from_outside(error: str) -> bool:
    """Whether a run's error says it was ended by its machine, not by its computation: a process
    killed, a peer lost, memory run out (the lines above)."""
    return any(said in error for said in (LOST_CONTACT, f"{KILLED_BY} ", f"{OUT_OF_MEMORY} "))


def rank_failed(cause: tuple[int, str] | None) -> str | None:
    """The run's error where a rank failed of its own (RunDir.first_failure's) and its peers only
    lost contact with it; None where none recorded one."""
    return None if cause is None else f"rank {cause[0]} failed: {cause[1]}"


def _error_message(err: BaseException, cfg: DictConfig) -> str:
    # status.json and train.log keep it: a library's message may hold a URL's password.
    message = redact_text(error_line(err))
    if isinstance(err, dist.DistError) or _from_backend(err):
        return (
            f"{LOST_CONTACT} (a dead or hung peer; collectives wait at most "
            f"compute.collective_timeout_s={cfg.compute.collective_timeout_s} s): {message}"
        )
    return message
