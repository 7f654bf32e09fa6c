"""The `python -m runner ...` processes runner.api starts, detached so that they outlive the
caller, and what it reads of them: the console file beside each run directory, the last
`error:` line, the process's end."""

from __future__ import annotations

import subprocess
import sys
import time
import uuid
from datetime import datetime
from pathlib import Path

from runner.rundir import pid_alive


def new_dir(root: Path) -> Path:
    """A directory under `root` named by date and time, made here so no other launch takes it."""
    now = datetime.now()
    path = root / now.strftime("%Y-%m-%d") / f"{now:%H-%M-%S}-{uuid.uuid4().hex[:6]}"
    path.mkdir(parents=True)
    return path.resolve()


def console_of(path: Path) -> Path:
    return path.with_name(f".{path.name}.console.log")


def start(
    args: list[str], console: Path, cwd: Path, env: dict[str, str] | None
) -> subprocess.Popen[bytes]:
    """`python -m runner ARGS` detached: its own session, output appended to `console`."""
    with open(console, "ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "runner", *args],
            cwd=cwd,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def last_error(console: Path) -> str | None:
    """The message of the last `error: ...` line a runner command printed."""
    if not console.exists():
        return None
    errors = [line for line in console.read_text().splitlines() if line.startswith("error: ")]
    return errors[-1].removeprefix("error: ") if errors else None


def wait_gone(pid: int, process: subprocess.Popen[bytes] | None) -> None:
    """Until process `pid` has ended (reaping it when `process` is it; a zombie, a child of
    this process that another handle started, has ended, and is left to that handle)."""
    while True:
        if process is not None and process.pid == pid:
            process.wait()
            return
        if not pid_alive(pid):
            return
        time.sleep(0.1)
