"""The `python -m runner ...` processes runner.api starts, detached so that they outlive the
caller, and what it reads of them: the console file beside each run directory, the last
`error:` line, the process's end."""

from __future__ import annotations

import ast
import contextlib
import subprocess
import sys
import time
import uuid
from datetime import datetime
from pathlib import Path

from runner.errors import UserError
from runner.rundir import pid_alive


def new_dir(root: Path) -> Path:
    """A directory under `root` named by date and time, made here so no other launch takes it."""
    path = new_name(root)
    path.mkdir(parents=True)
    return path.resolve()


def new_name(root: Path) -> Path:
    """The name of a new directory under `root`: by date and time, and a random suffix."""
    now = datetime.now()
    return root / now.strftime("%Y-%m-%d") / f"{now:%H-%M-%S}-{uuid.uuid4().hex[:6]}"


def missing(path: Path) -> list[Path]:
    """`path` and those of its parents that do not exist yet, deepest first: what making it
    makes, and what to remove again if what it was made for is refused."""
    return [p for p in (path, *path.parents) if not p.exists()]


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


def last_error(console: Path, after: int = 0) -> str | None:
    """The message of the last `error: ...` line a runner command printed (past byte `after`:
    a console file that another command's output came before)."""
    if not console.exists():
        return None
    printed = console.read_bytes()[after:].decode(errors="replace")
    errors = [line for line in printed.splitlines() if line.startswith("error: ")]
    return errors[-1].removeprefix("error: ") if errors else None


def printed_error(line: str, command: str) -> UserError:
    """The UserError a runner command printed as `error: LINE`: its key, value and fix read
    back from UserError's own form (`key='value': fix`, `key: fix`), so that it says LINE
    again; one that reads back otherwise is `command`'s, with LINE as its fix."""
    equals, colon = line.find("="), line.find(": ")
    if 0 < equals < colon:
        key, rest = line[:equals], line[equals + 1 :]
        for at in (i for i in range(len(rest)) if rest.startswith(": ", i)):
            given = rest[:at]
            value = {"true": True, "false": False}.get(given, given)
            with contextlib.suppress(ValueError, SyntaxError, MemoryError, RecursionError):
                value = ast.literal_eval(given)
            error = UserError(key, value, rest[at + 2 :])
            if str(error) == line:
                return error
    elif colon > 0:
        error = UserError(line[:colon], None, line[colon + 2 :])
        if str(error) == line:
            return error
    return UserError(command, None, line)


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
