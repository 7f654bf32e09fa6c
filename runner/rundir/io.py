"""Writes that readers never see half done, what a write the disk refused says, and the time
stamps the run directory records."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import resource
import shutil
import socket
from datetime import UTC, datetime
from pathlib import Path

from runner.errors import UserError
from runner.paths import shell_path

# What a write that found no room fails with: a full disk, a file-size limit, a quota.
NO_ROOM = (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)
# The key that placed the run and its value, as KEY=VALUE (resume=RUN, hydra.run.dir=DIR,
# runtime.output_root=ROOT, or a sweep job's hydra.sweep.dir=DIR), in the environment the job
# trains the run in (runner.job.launch.environment), so that its trainers' errors, workers'
# too, name what the user typed.
RUN_KEY_ENV = "RUNNER_RUN_KEY"


def now_iso() -> str:
    """The current UTC time to the second, as status.json records times."""
    return datetime.now(UTC).isoformat(timespec="seconds")


def write_text_atomic(path: Path, text: str) -> None:
    """Writes under a temporary name and renames it, so readers (and a run killed mid-write,
    then resumed) never see half a file. The name is this process's own: the nodes of a run
    write one status.json on shared storage, and one's rename took another's file."""
    tmp = path.with_name(f".{path.name}.{socket.gethostname()}.{os.getpid()}.tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):  # a full disk's part written, or nothing
            tmp.unlink(missing_ok=True)
        raise


def write_json_atomic(path: Path, data: object) -> None:
    """`data` as indented JSON, written as write_text_atomic writes."""
    write_text_atomic(path, json.dumps(data, indent=2) + "\n")


def size_text(n: float) -> str:
    """A size as people read it: 200 B, 5.8 MiB, 13.0 GiB."""
    if n < 1024:
        return f"{n:.0f} B"
    for unit in ("KiB", "MiB", "GiB"):
        n /= 1024
        if n < 1024:
            return f"{n:.1f} {unit}"
    return f"{n / 1024:.1f} TiB"


def tree_size(path: Path) -> int:
    """The bytes of the files under `path`, or of `path` where it is a file; one that goes
    while they are counted counts nothing."""
    if path.is_file():
        return path.stat().st_size
    size = 0
    for file in path.rglob("*"):
        with contextlib.suppress(OSError):
            size += file.stat().st_size if file.is_file() else 0
    return size


def file_size_limit() -> int | None:
    """The largest file this process may write (`ulimit -f`); None: no limit."""
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    return None if limit == resource.RLIM_INFINITY else limit


def room_fix(make_room: str) -> str:
    """How a write the disk refused goes through: `make_room`, or first, where this process
    may write no file past a size, that limit raised."""
    if file_size_limit() is None:
        return make_room
    return f"raise the file-size limit (ulimit -f) or {make_room}"


def free_space(path: Path) -> int:
    """The bytes free on the disk of `path`, or of where it will be made (its nearest parent
    that exists)."""
    there = path
    while not there.exists() and there != there.parent:
        there = there.parent
    return shutil.disk_usage(there).free


def room_on(path: Path) -> str:
    """The room a write to `path` (or where it will be) has, as a message says it: its disk's
    free space, and the file-size limit where one is set."""
    room = f"its disk has {size_text(free_space(path))} free"
    limit = file_size_limit()
    if limit is not None:
        room += f", and files are limited to {size_text(limit)} here (ulimit -f)"
    return room


# What safetensors says of an OSError (the OS's text and errno), and numpy's tofile of a write
# that stopped short, which carries no errno.
_LIBRARY_OS_ERROR = re.compile(r"I/O error: (.+?) \(os error (\d+)\)")
_SHORT_WRITE = re.compile(r"^\d+ requested and \d+ written$")


def no_room_cause(err: BaseException) -> str | None:
    """What a write that found no room (NO_ROOM) failed with, in words its user reads: "No
    space left on device"; None for an error of any other cause."""
    if isinstance(err, OSError) and err.errno in NO_ROOM:
        return err.strerror
    said = _LIBRARY_OS_ERROR.search(str(err))
    if said and int(said[2]) in NO_ROOM:
        return said[1]
    if isinstance(err, OSError) and err.errno is None and _SHORT_WRITE.match(str(err)):
        return "a file's write stopped short"
    return None


def not_written(run_dir: Path, what: str, err: BaseException, needs: str = "") -> UserError:
    """Why `what` (its status.json, the checkpoint of step 6) could not be written into the
    run directory `run_dir`: the disk's room and what the run `needs` of it, or what else
    refused it, and how the run goes on once it can be written. `err`: the OSError, or the
    error of a write that stopped short (torch.save's "[enforce fail at inline_container.cc]
    unexpected pos", which says nothing to its user; safetensors' "I/O error: ...")."""
    resume = f"`runner resume {shell_path(run_dir)}` goes on from its last whole checkpoint"
    key, _, value = os.environ.get(RUN_KEY_ENV, f"hydra.run.dir={run_dir}").partition("=")
    if isinstance(err, OSError) and err.errno not in NO_ROOM:
        # Not the room: a read-only disk, a file where a directory belongs, permissions.
        where = f": {err.filename}" if err.filename else ""
        return UserError(
            key,
            value,
            f"{what} could not be written ({err.strerror}{where}); once it can be, {resume}",
        )
    if isinstance(err, OSError):
        cause = f"{err.strerror}: {err.filename}" if err.filename else err.strerror
    else:
        cause = no_room_cause(err) or "a file's write stopped short"
    # Not runtime.keep_last_n_checkpoints: a resume goes on with the recipe the run started.
    fix = room_fix("make room")
    return UserError(
        key,
        value,
        f"{what} could not be written ({cause}); {room_on(run_dir)}{needs and '; ' + needs}: "
        f"{fix}, then {resume}",
    )
