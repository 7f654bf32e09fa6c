"""A stop (SIGTERM, Ctrl-C) to a launcher of workers before its elastic agent holds the stop
signals, and how such a launcher exits on one (runner.job.launch starts the workers; a run in
this process takes its stops in runner.trainer.process)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

from runner.rundir import RunDir
from runner.trainer.parent import stop_signals_to


@contextlib.contextmanager
def stops_before_workers(run: RunDir) -> Iterator[None]:
    """SIGTERM and Ctrl-C to a launcher of workers, from the moment the run's status names it
    until the elastic agent takes them as it starts the workers, end the run cancelled, with
    nothing trained, and the launcher with 128 + the signal. Left to the default action, the
    launcher died there, and the run stayed `created`.

    In runner's own code the stop is raised as StopBeforeWorkers, a BaseException as Ctrl-C's
    KeyboardInterrupt is: an Exception was swallowed by code that catches every one (a logging
    handler's emit, which prints "--- Logging error ---" and goes on), or remade from its message
    alone (OmegaConf's attribute access: a TypeError, a traceback, and the run left `created`).
    In torch's start-up (from agent_holds_stops) it is what the agent's own handlers raise,
    SignalException, which torch answers as a stop. A stop nothing took within RESEND_S is sent
    again (Resend); once the workers run, the agent's handler takes it, once, and stops them as
    on any stop."""
    from torch.distributed.elastic.multiprocessing.api import SignalException

    global _resend
    resend = _resend = Resend()

    def raise_it(signum: int, frame: Any) -> None:
        sigval = signal.Signals(signum)
        resend.pending(sigval)
        if resend.in_torch:
            raise SignalException(f"Process {os.getpid()} got signal: {sigval}", sigval=sigval)
        raise StopBeforeWorkers(sigval)

    resend.handler = raise_it
    with stop_signals_to(raise_it), resend:
        try:
            yield
        except BaseException as err:  # before _elastic_launch's answer
            stop: BaseException | None = err
            # Python 3.11 remakes an exception raised in a class attribute's __set_name__ (a
            # dataclass field of a module torch imports as the stop comes: LaunchConfig's) as a
            # RuntimeError caused by it: the stop is found down the chain of causes.
            while stop is not None and not isinstance(stop, (SignalException, StopBeforeWorkers)):
                stop = stop.__cause__
            if stop is None:
                raise
            resend.taken.set()
            raise ended_by_stop(run, stop.sigval) from None


class StopBeforeWorkers(BaseException):
    """A stop signal a launcher took before its workers started (stops_before_workers)."""

    def __init__(self, sigval: signal.Signals) -> None:
        super().__init__(f"stopped by {sigval.name}")
        self.sigval = sigval


# How long a stop signal may go untaken before the launcher sends it again (Resend).
RESEND_S = 1.0


class Resend:
    """A thread, for the stops_before_workers block, that sends a pending stop signal again
    while nothing has taken it: as often as it takes while `handler` (the block's) holds the
    signal, and once to the elastic agent's handler once that holds it (more would cut short
    the agent's wait for its workers to save). The signal handler only notes the signal (no
    lock: the main thread it interrupts may hold any); `taken` is set where a SignalException
    is caught, and as the block ends."""

    def __init__(self) -> None:
        self.taken = threading.Event()
        self.handler: Any = None
        self.in_torch = False  # inside elastic_launch: the handler raises torch's SignalException
        self._signal: tuple[signal.Signals, float] | None = None
        self._thread = threading.Thread(target=self._run, name="resend-stop", daemon=True)

    def pending(self, sigval: signal.Signals) -> None:
        if self._signal is None:
            self._signal = (sigval, time.monotonic())

    def _run(self) -> None:
        while not self.taken.wait(RESEND_S / 4):
            pending = self._signal
            if pending is not None and time.monotonic() - pending[1] >= RESEND_S:
                self._signal = (pending[0], time.monotonic())
                ours = signal.getsignal(pending[0]) is self.handler
                os.kill(os.getpid(), pending[0])
                if not ours:
                    return  # the agent's: it stops the workers, and waits for them

    def __enter__(self) -> None:
        self._thread.start()

    def __exit__(self, *exc: object) -> None:
        self.taken.set()


# The latest stops_before_workers block's, which runner.job.launch tells where the agent holds the
# stop signals (agent_holds_stops) and where it took a stop (stop_taken).
_resend = Resend()


def ended_by_stop(run: RunDir, sigval: signal.Signals) -> SystemExit:
    """How a launcher of workers that a stop signal ended exits (128 + the signal): the run
    recorded `cancelled` where its workers had recorded nothing, and the stop said once on this
    console, where no worker here said it with its checkpoint (a stop before the workers
    started was said nowhere)."""
    from runner.trainer.process import tell

    status = run.status()
    if status.state == "created":
        before = f"it went on from step {status.step}" if status.step else "its first step"
        run.write_status("cancelled", error=f"stopped by {sigval.name} before {before}")
    if not _told_by_a_worker(run):
        tell(f"stopped by {sigval.name}; status in {run.path}/status.json")
    return SystemExit(128 + int(sigval))


def _told_by_a_worker(run: RunDir) -> bool:
    """Whether a worker of this machine recorded the run's stop, and so told it on this console
    with its checkpoint and the command that continues it (a second line said it again)."""
    status = run.status()
    return (
        status.state == "cancelled"
        and status.host == socket.gethostname()
        and status.pid != os.getpid()
    )


def agent_holds_stops() -> None:
    """From here the elastic agent's handlers hold the stop signals (set just before
    elastic_launch): the block's handler raises torch's SignalException, which the agent answers
    as a stop."""
    _resend.in_torch = True


def stop_taken() -> None:
    """The stop was taken (the elastic agent's SignalException caught): nothing sends it again."""
    _resend.taken.set()
