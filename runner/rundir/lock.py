"""The run lock: which processes train a run directory, so that no second trainer enters it.

Every process of a live run holds a shared flock on RUN/.lock: the launcher from before anything
is written into the run until it exits (run_lock), and each worker it starts from before that
worker writes anything until it exits (join_run_lock). A trainer enters a run only by taking the
lock exclusively, which any holder refuses, and then keeps it shared. So the run stays locked
until its last process is gone, whichever ends first: a launcher killed -9 leaves its workers
saving a checkpoint under the lock, and no `runner train` can take the run from them meanwhile.
Readers learn from the lock alone whether any process of the run still lives (lock_held).

flock ends with the process that took it, kill -9 included, so a dead run never stays locked.
A file system without flock (some shared ones) runs unlocked, with a warning.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

from runner.errors import UserError
from runner.paths import shell_path

# The package's logger (runner.rundir), which log lines named before the package had modules.
log = logging.getLogger(__package__)
LOCK_FILE = ".lock"
# A sweep's own process holds its sweep directory's while it runs (a run's lock is not it: a
# sweep directory read as a run that is starting).
SWEEP_LOCK_FILE = ".sweep.lock"
# Set while a process holds a run's lock, so that the workers it starts find the lock to join.
RUN_LOCK_ENV = "RUNNER_RUN_LOCK"
# Nobody holds the lock exclusively for more than an instant (a trainer entering, a reader
# looking), so a try that meets an exclusive holder tries again for this long before it gives up.
_RETRY_S = 0.25
_NO_FLOCK = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS)
# The run locks this process holds, by lock file: a second run_lock of one is a no-op.
_held: dict[Path, int] = {}


class RunLocked(UserError):
    """Another process trains this run directory (it holds the run's lock)."""


@contextlib.contextmanager
def run_lock(run_dir: Path, *, key: str) -> Iterator[None]:
    """Keeps a second trainer out of `run_dir` while this process (and the workers it starts)
    train it: a RunLocked under config key `key`, naming the process that holds the lock, if
    another already does. Taking a lock this process already holds does nothing."""
    run_dir.mkdir(parents=True, exist_ok=True)
    path = (run_dir / LOCK_FILE).resolve()
    if path in _held:
        yield
        return
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    outer = os.environ.get(RUN_LOCK_ENV)
    try:
        if _enter(fd, path, run_dir, key):
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()} {socket.gethostname()}\n".encode(), 0)
            # Shared from now on, so that the workers can hold it beside this process. Linux
            # converts a flock in one step, so no other trainer can enter in between.
            fcntl.flock(fd, fcntl.LOCK_SH)
            _held[path] = fd
            os.environ[RUN_LOCK_ENV] = str(path)
        yield
    finally:
        if _held.get(path) == fd:
            del _held[path]
            if outer is None:
                os.environ.pop(RUN_LOCK_ENV, None)
            else:
                os.environ[RUN_LOCK_ENV] = outer
        os.close(fd)


def held_here(run_dir: Path) -> bool:
    """Whether this process holds `run_dir`'s lock (took it with run_lock)."""
    return (run_dir / LOCK_FILE).resolve() in _held


def _enter(fd: int, path: Path, run_dir: Path, key: str) -> bool:
    """Takes the lock exclusively (False: this file system has no flock); RunLocked if held."""
    deadline = time.monotonic() + _RETRY_S
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() < deadline:
                time.sleep(0.01)
                continue
            raise RunLocked(key, str(run_dir), _held_by(fd, path, run_dir, key)) from None
        except OSError as err:
            if err.errno not in _NO_FLOCK:
                raise
            log.warning("%s: no lock on this file system (%s); train it from one place", path, err)
            return False


def _held_by(fd: int, path: Path, run_dir: Path, key: str) -> str:
    """Who holds the lock, and what to do about it."""
    pid, _, host = os.pread(fd, 256, 0).decode(errors="replace").strip().partition(" ")
    here = host in ("", socket.gethostname())
    where = "" if here else f" on host {host}"
    if here and pid.isdigit() and not pid_alive(int(pid)):
        holder = (
            f"the workers of process {pid}, its launcher, which is gone: they are saving a "
            "checkpoint and will end the run as cancelled"
        )
    else:
        holder = f"process {pid or 'unknown'}{where}"
    if key == "hydra.run.dir":
        fix = (
            "give another hydra.run.dir for a new run (or leave it out), or wait for that run "
            f"to end (`runner stop {shell_path(run_dir)}` ends it, and `runner resume "
            f"{shell_path(run_dir)}` then "
            "continues it)"
        )
    else:
        fix = f"wait for it to end, or `runner stop {run_dir}` and then resume it"
    return f"the run is being trained by {holder} (it holds {path}); {fix}"


def join_run_lock(launcher_pid: int) -> bool:
    """Holds the run's lock beside the launcher that started this process (the lock that
    RUN_LOCK_ENV names, if any) until this process exits; call it before writing into the run.

    False when the launcher was gone before this process joined: the run may be another
    trainer's by now, and this process must leave it alone.
    """
    path = os.environ.get(RUN_LOCK_ENV)
    if path is None:
        return True
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        return False  # the run directory went with a launcher that failed
    deadline = time.monotonic() + 10 * _RETRY_S
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            if time.monotonic() >= deadline:
                os.close(fd)
                return False
            time.sleep(0.01)
    # Held shared beside the launcher, the lock kept every other trainer out since the launcher
    # took it; were the launcher gone, another trainer may have come in before this process.
    if os.getppid() != launcher_pid:
        os.close(fd)
        return False
    _held[Path(path)] = fd  # open, so held, until this process exits
    return True


def hold_until_exit(directory: Path, name: str = SWEEP_LOCK_FILE) -> None:
    """Holds a shared flock on DIRECTORY/NAME until this process exits, so that a reader tells
    from lock_held whether it still lives: a sweep's own process holds its sweep directory's.
    Nothing is held where the file system has no flock."""
    path = (directory / name).resolve()
    if path in _held:
        return
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)  # a reader's exclusive look lasts an instant
    except OSError as err:
        os.close(fd)
        if err.errno not in _NO_FLOCK:
            raise
        return
    _held[path] = fd  # open, so held, until this process exits


def lock_held(run_dir: Path, name: str = LOCK_FILE) -> bool | None:
    """Whether any process of the run holds its lock (so some process of the run still lives;
    `name`: SWEEP_LOCK_FILE for a sweep's process); None when that cannot be told: no lock file
    (a run of several nodes takes none), or no flock on this file system."""
    try:
        # Read-write: where flock is made of fcntl locks (NFS), an exclusive one needs it.
        fd = os.open(run_dir / name, os.O_RDWR)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return None
    finally:
        os.close(fd)  # which releases what the look took
    return False


def pid_alive(pid: int) -> bool:
    """Whether process `pid` of this machine runs: it exists and has not ended. A zombie, whose
    parent has not reaped it yet, has ended: a run's launcher killed by a caller that started it
    read as alive until that caller reaped it, and a wait for it to end (runner.api's stop of a
    run launched in the same process, through a second handle) never ended."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's: it exists
    return _process_state(pid) not in ("Z", "X")


def pid_stopped(pid: int) -> bool:
    """Whether process `pid` of this machine is stopped (SIGSTOP, SIGTSTP: Ctrl-Z, a paused
    job), as /proc tells; False where there is no /proc."""
    return _process_state(pid) in ("T", "t")


def _process_state(pid: int) -> str | None:
    """The state letter /proc gives process `pid` (R, S, T, Z, ...); None where it cannot."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The state follows the command name, which is in parentheses and may hold any character.
    fields = stat.rpartition(")")[2].split()
    return fields[0] if fields else None
