"""What a live trainer holds in its run directory: the lock that keeps a second trainer out, and
the heartbeat that tells readers it still runs."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import threading
from collections.abc import Iterator
from pathlib import Path

from runner.errors import UserError
from runner.rundir.run import HEARTBEAT_EVERY_S, RunDir

# The package's logger (runner.rundir), which log lines named before the package had modules.
log = logging.getLogger(__package__)
# Held (flock) by the process that trains the run, for as long as it runs; see run_lock.
LOCK_FILE = ".lock"


class Heartbeat:
    """Touches a run's heartbeat file from a background thread while the run is alive."""

    def __init__(self, run: RunDir) -> None:
        self.run = run
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, daemon=True, name="heartbeat")

    def _beat(self) -> None:
        while not self._stop.is_set():
            self.run.touch_heartbeat()
            self._stop.wait(HEARTBEAT_EVERY_S)

    def start(self) -> None:
        """Starts beating (once now, then every HEARTBEAT_EVERY_S)."""
        self._thread.start()

    def stop(self) -> None:
        """Stops beating and waits for the thread to end."""
        self._stop.set()
        self._thread.join()


class RunLocked(UserError):
    """Another process trains this run directory (it holds the run's lock)."""


@contextlib.contextmanager
def run_lock(run_dir: Path, *, key: str) -> Iterator[None]:
    """Keeps a second trainer out of `run_dir` while this process trains it: a UserError under
    config key `key`, naming the process that holds the lock, if another already does.

    flock ends with the process that took it, kill -9 included, so a dead trainer never leaves
    the run locked. A file system without flock (some shared ones) runs unlocked, with a warning.
    """
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / LOCK_FILE
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            raise RunLocked(
                key,
                str(run_dir),
                f"the run is being trained by process {holder} (it holds {path}); wait for it "
                f"to end, or `runner stop {run_dir}` and then resume it",
            ) from None
        except OSError as err:
            if err.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                raise
            log.warning("%s: no lock on this file system (%s); train it from one place", path, err)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)
