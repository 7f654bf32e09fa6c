"""The run directory contract: status file, metrics, and whole checkpoints (see DESIGN.md)."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import threading
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

STATES = ("created", "initializing", "running", "checkpointing", "completed", "failed", "cancelled")
RECIPE_FILE = "recipe.yaml"
HEARTBEAT_FILE = "heartbeat"
LOG_FILE = "train.log"
ACTIVE_STATES = ("created", "initializing", "running", "checkpointing")
# A live run touches its heartbeat every HEARTBEAT_EVERY_S; older than HEARTBEAT_STALE_S is dead.
HEARTBEAT_EVERY_S = 10.0
HEARTBEAT_STALE_S = 120.0
STATUS_FILE = "status.json"
METRICS_FILE = "metrics.jsonl"
CHECKPOINTS_DIR = "checkpoints"
_CHECKPOINT_NAME = re.compile(r"^step_(\d+)$")


def now_iso() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def write_json_atomic(path: Path, data: Any) -> None:
    """Writes JSON under a temporary name and renames it, so readers never see half a file."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)


class RunDir:
    """One run's directory; every downstream command reads runs through this."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)

    @property
    def recipe_path(self) -> Path:
        return self.path / RECIPE_FILE

    @property
    def checkpoints_dir(self) -> Path:
        return self.path / CHECKPOINTS_DIR

    def read_status(self) -> dict[str, Any]:
        path = self.path / STATUS_FILE
        return json.loads(path.read_text()) if path.exists() else {}

    def write_status(self, state: str, **fields: Any) -> dict[str, Any]:
        """Moves the run to `state`, keeping earlier fields and stamping times and heartbeat."""
        assert state in STATES, state
        status = self.read_status()
        now = now_iso()
        status.setdefault("created_at", now)
        if state == "initializing":
            status.update(started_at=now, ended_at=None, error=None)
        if state in ("completed", "failed", "cancelled"):
            status["ended_at"] = now
        status.update(fields, state=state, updated_at=now, heartbeat_at=now)
        status.update(host=socket.gethostname(), pid=os.getpid())
        write_json_atomic(self.path / STATUS_FILE, status)
        return status

    def touch_heartbeat(self) -> None:
        (self.path / HEARTBEAT_FILE).touch()

    def seconds_since_heartbeat(self) -> float | None:
        path = self.path / HEARTBEAT_FILE
        return time.time() - path.stat().st_mtime if path.exists() else None

    def effective_state(self) -> tuple[str, str | None]:
        """The recorded state, or `failed` with a reason when an active run's process is gone."""
        status = self.read_status()
        state = status.get("state", "unknown")
        if state not in ACTIVE_STATES:
            return state, None
        pid = status.get("launcher_pid") or status.get("pid")
        if status.get("host") == socket.gethostname() and pid and not _alive(pid):
            return "failed", f"process {pid} is gone and the status was never updated"
        age = self.seconds_since_heartbeat()
        if age is not None and age > HEARTBEAT_STALE_S:
            return "failed", f"no heartbeat for {age:.0f} s"
        return state, None

    def append_metrics(self, record: dict[str, Any]) -> None:
        with open(self.path / METRICS_FILE, "a") as f:
            f.write(json.dumps(record) + "\n")

    def read_metrics(self) -> list[dict[str, Any]]:
        path = self.path / METRICS_FILE
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    def losses(self) -> dict[int, float]:
        """Per-step training losses, by step, from metrics.jsonl."""
        return {r["step"]: r["loss"] for r in self.read_metrics() if "loss" in r}

    def truncate_metrics(self, last_step: int) -> None:
        """Drops metric lines past `last_step`: a resumed run logs those steps again."""
        kept = [r for r in self.read_metrics() if r["step"] <= last_step]
        tmp = self.path / f".{METRICS_FILE}.tmp"
        tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
        os.replace(tmp, self.path / METRICS_FILE)

    def checkpoints(self) -> list[tuple[int, Path]]:
        """Whole checkpoints as (step, path), oldest first; temporary ones are not listed."""
        if not self.checkpoints_dir.is_dir():
            return []
        found = []
        for child in self.checkpoints_dir.iterdir():
            match = _CHECKPOINT_NAME.match(child.name)
            if match and child.is_dir():
                found.append((int(match.group(1)), child))
        return sorted(found)

    def latest_checkpoint(self) -> Path | None:
        found = self.checkpoints()
        return found[-1][1] if found else None

    def fresh_checkpoint_tmp(self, step: int) -> Path:
        """Where to write step `step`'s checkpoint; a leftover of a crashed save is removed."""
        tmp = self.checkpoints_dir / f".tmp-step_{step}"
        if tmp.exists():
            _remove_tree(tmp)
        return tmp

    def commit_checkpoint(
        self, tmp: Path, step: int, keep_last: int, keep_step: int | None = None
    ) -> Path:
        """Renames a fully written checkpoint into place, then prunes to the last `keep_last`.

        The checkpoint of `keep_step` (the run's best) is kept as well, whatever its age.
        """
        final = self.checkpoints_dir / f"step_{step}"
        if final.exists():  # the same step saved by an earlier attempt of this run
            _remove_tree(final)
        os.replace(tmp, final)
        for old_step, old in self.checkpoints()[: -max(keep_last, 1)]:
            if old_step != keep_step:
                _remove_tree(old)
        return final

    def best(self) -> dict[str, Any] | None:
        """The best evaluation the run recorded (metric, mode, step, value, checkpoint), if any."""
        return self.read_status().get("best")

    def objective_value(self, metric: str) -> tuple[float, int] | None:
        """(value, step) that ranks this run by `metric`: its recorded best when that is by
        `metric`, else the last value of `metric` in metrics.jsonl."""
        best = self.best()
        if best is not None and best["metric"] == metric:
            return best["value"], best["step"]
        scored = [r for r in self.read_metrics() if metric in r]
        return (scored[-1][metric], scored[-1]["step"]) if scored else None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


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
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def _remove_tree(path: Path) -> None:
    # Rename first so a crash mid-delete leaves a name that is never picked up.
    doomed = path.with_name(f".deleting-{path.name}")
    os.replace(path, doomed)
    shutil.rmtree(doomed)
