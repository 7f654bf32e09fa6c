"""The console of a long-lived command (`runner train`, `runner deploy`), whose reader may go.

`runner train ... | head`, a closed terminal or ssh session, a full disk under `2>file`: a write
to the console fails (EPIPE, EIO, ENOSPC), and each process of the run met it as an error in
whatever wrote (the loop's step line), which failed the run without a checkpoint. The console is
a side channel (train.log keeps every line; a server answers over HTTP), so once it fails its
descriptor is pointed at /dev/null and the process goes on. A closed terminal also sends
SIGHUP, which such a command takes as it takes SIGTERM, unless started with it ignored (nohup).
"""

from __future__ import annotations

import errno
import os
import signal
import sys
from typing import Any, TextIO

# The errors of a console whose reader or disk is gone.
_GONE = (errno.EPIPE, errno.EIO, errno.ENOSPC)


class _Console:
    """A stream (sys.stdout, sys.stderr) that survives the loss of what reads it."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except OSError as err:
            self._gone(err)
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except OSError as err:
            self._gone(err)

    def _gone(self, err: OSError) -> None:
        if err.errno not in _GONE:
            raise err
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, self._stream.fileno())  # every stream on the descriptor, a handler's too
        os.close(devnull)
        try:
            self._stream.flush()  # what was buffered goes to /dev/null now
        except OSError:
            pass

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def outlive_the_reader() -> None:
    """sys.stdout and sys.stderr of this process (and the processes it forks) survive their
    reader going away. Once per process; a stream that is closed (None) stays as it is."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is not None and not isinstance(stream, _Console):
            setattr(sys, name, _Console(stream))


def takeable(signals: tuple[signal.Signals, ...]) -> list[signal.Signals]:
    """Of `signals`, those this process may take a handler for: one it was started with
    ignored (nohup's SIGHUP, a background job's SIGINT) stays ignored."""
    return [signum for signum in signals if signal.getsignal(signum) is not signal.SIG_IGN]
