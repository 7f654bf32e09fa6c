"""Serving through runner.api: `deploy` starts `runner deploy` detached, and a Deployment waits
for its URL and stops it."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import tempfile
import time
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from omegaconf import ListConfig

from runner.api.configs import compose, environment, listed, working_dir
from runner.api.processes import last_error, start
from runner.errors import UserError
from runner.paths import user_path

_URL_LINE = re.compile(r"OpenAI-compatible API at (http://\S+)")


def deploy(
    overrides: Sequence[str], *, cwd: str | os.PathLike[str] | None = None, env: Any = None
) -> Deployment:
    """`runner deploy OVERRIDES` (checkpoint=<run, checkpoint or sweep dir>, port=0 for any free
    port); returns at once: Deployment.wait_ready() gives its URL."""
    from runner.deploy.selection import check_given, check_servable

    overrides, env, base = listed(overrides), environment(env), working_dir(cwd)
    config = compose(overrides, "deploy")
    check_given(config)  # nothing to serve: the server's process refused it, after the return
    # A checkpoint that is not there, refused here as a bad option is: the server's process
    # refused it after the call had returned a Deployment, whose console file was left behind.
    given = config.checkpoint
    for path in given if isinstance(given, ListConfig) else [given]:
        if isinstance(path, str):
            check_servable(base / user_path(path))
    handle, name = tempfile.mkstemp(prefix="runner-deploy-", suffix=".log")
    os.close(handle)
    console = Path(name)
    return Deployment(start(["deploy", *overrides], console, base, env), console)


class Deployment:
    """A running `runner deploy`: its OpenAI-compatible URL once ready, and stop()."""

    def __init__(self, process: subprocess.Popen[bytes], console: Path) -> None:
        self.process, self.console_path = process, console
        self.url: str | None = None
        self._ended_console: str | None = None
        # A handle dropped without stop() (or a caller that exits): the console file of a
        # server that has ended goes with it, where one was left in /tmp; a live server's stays.
        weakref.finalize(self, _remove_if_ended, process, console)

    def console(self) -> str:
        """What the server process has printed so far (all it printed, once it has ended)."""
        if self._ended_console is not None:
            return self._ended_console
        return self.console_path.read_text(errors="replace") if self.console_path.exists() else ""

    def _ended(self) -> None:
        """The server has ended: its console is kept here and its temporary file removed (one
        was left in /tmp for every deployment)."""
        if self._ended_console is None:
            self._ended_console = self.console()
            self.console_path.unlink(missing_ok=True)

    def wait_ready(self, timeout: float = 300.0) -> str:
        """The base URL (http://host:port/v1) once the models are loaded and it serves; a
        UserError with the server's message if it ended instead."""
        deadline = time.monotonic() + timeout
        while self.url is None:
            found = _URL_LINE.search(self.console())
            if found:
                self.url = found.group(1)
            elif self.process.poll() is not None:
                error = last_error(self.console_path) or f"exit code {self.process.returncode}"
                self._ended()
                raise UserError("runner deploy", None, f"ended before it served: {error}")
            elif time.monotonic() > deadline:
                raise TimeoutError(f"runner deploy not ready after {timeout:.0f} s")
            else:
                time.sleep(0.2)
        _wait_health(self.url.removesuffix("/v1") + "/health", deadline)
        return self.url

    def stop(self, timeout: float = 60.0) -> int:
        """Drains and stops the server (SIGTERM); its exit code. uvicorn raises the signal again
        once it has shut down cleanly, so a clean stop is -SIGTERM (-15), as for `kill`."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        code = self.process.wait(timeout)
        self._ended()
        return code


def _remove_if_ended(process: subprocess.Popen[bytes], console: Path) -> None:
    if process.poll() is not None:
        console.unlink(missing_ok=True)


def _wait_health(url: str, deadline: float) -> None:
    import urllib.request

    while True:
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                if response.status == 200:
                    return
        except OSError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{url} does not answer") from None
        time.sleep(0.2)
