"""What a training process knows of the launcher that started it (runner.job.launch), so that it
stops when the launcher dies (runner.trainer.process), and the one way each of them takes the
stop signals for a stretch of its life."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterator
from typing import Any

from runner.console import takeable

# The launcher's process id, in the environment of the workers it starts.
LAUNCHER_PID_ENV = "RUNNER_LAUNCHER_PID"
# prctl's option for the signal a process gets when its parent dies (<linux/prctl.h>).
PR_SET_PDEATHSIG = 1
# What a user or a scheduler stops a run with: Ctrl-C, SIGTERM (runner stop, kill, Slurm), and
# SIGHUP (the terminal or ssh session the run was started in, closed): it killed the run
# without a checkpoint, its status left `running`.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

Handler = Callable[[int, Any], None]


@contextlib.contextmanager
def stop_signals_to(handler: Handler) -> Iterator[dict[signal.Signals, Any]]:
    """`handler` takes the STOP_SIGNALS inside the block, which gets the handlers it replaced
    (to hand a second signal back to them); they come back as the block ends. A signal this
    process was started with ignored stays ignored: `nohup runner train` outlives its terminal's
    SIGHUP, and a job started in the background of a script, Ctrl-C (POSIX shells start it with
    SIGINT ignored). Off the main thread, where Python lets no handler be set, the block runs
    with the signals as they are."""
    if threading.current_thread() is not threading.main_thread():
        yield {}
        return
    previous = {signum: signal.signal(signum, handler) for signum in takeable(STOP_SIGNALS)}
    try:
        yield previous
    finally:
        for signum, before in previous.items():
            signal.signal(signum, before)
