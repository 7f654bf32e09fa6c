"""Writes that readers never see half done, and the time stamps the run directory records."""

from __future__ import annotations

import json
import os
import socket
from datetime import UTC, datetime
from pathlib import Path


def now_iso() -> str:
    """The current UTC time to the second, as status.json records times."""
    return datetime.now(UTC).isoformat(timespec="seconds")


def write_text_atomic(path: Path, text: str) -> None:
    """Writes under a temporary name and renames it, so readers (and a run killed mid-write,
    then resumed) never see half a file. The name is this process's own: the nodes of a run
    write one status.json on shared storage, and one's rename took another's file."""
    tmp = path.with_name(f".{path.name}.{socket.gethostname()}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def write_json_atomic(path: Path, data: object) -> None:
    """`data` as indented JSON, written as write_text_atomic writes."""
    write_text_atomic(path, json.dumps(data, indent=2) + "\n")
