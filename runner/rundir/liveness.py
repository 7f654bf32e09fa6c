"""The heartbeat that tells readers a run still runs, where its lock (runner.rundir.lock) cannot:
from another machine, or on a file system without flock."""

from __future__ import annotations

import threading

from runner.rundir.run import HEARTBEAT_EVERY_S, RunDir


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
