"""One run's directory (the contract docs/run-directory.md gives): its status, metrics and
whole checkpoints, and which of them is the latest and the best.

Everything downstream (sweeps, deploy, export, repro, runs/logs/stop/resume) reads runs through
RunDir, so each rule (which checkpoint is whole, which is the best) is written once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
import re
import shutil
import socket
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

from runner.rundir.checkpoint_files import ADAPTER_CONFIG_FILE, checkpoint_problem
from runner.rundir.io import now_iso, write_json_atomic, write_text_atomic
from runner.rundir.lock import lock_held, pid_alive, pid_stopped
from runner.rundir.status import (
    ACTIVE_STATES,
    FINAL_STATES,
    STALLED,
    STATES,
    STATUS_FILE,
    STATUS_VERSION,
    STOPPING,
    Best,
    Status,
    number,
)

RECIPE_FILE = "recipe.yaml"
HEARTBEAT_FILE = "heartbeat"
LOG_FILE = "train.log"
# A live run touches its heartbeat every HEARTBEAT_EVERY_S; older than HEARTBEAT_STALE_S, the run
# is dead, or, where its processes still hold its lock, stalled.
HEARTBEAT_EVERY_S = 10.0
HEARTBEAT_STALE_S = 120.0
METRICS_FILE = "metrics.jsonl"
CHECKPOINTS_DIR = "checkpoints"
# The base a LoRA run from random init adapts, written once (Hugging Face format).
BASE_MODEL_DIR = "base_model"
# What `profile.enabled=true` writes (runner.trainer.profiling).
PROFILE_DIR = "profile"
# Where a run keeps the ids of its tracker runs (MLflow's), so that a resumed run logs to the
# same one; W&B keeps its files in RUN/wandb/.
TRACKERS_FILE = "trackers.json"
WANDB_DIR = "wandb"
_CHECKPOINT_NAME = re.compile(r"^step_(\d+)$")
# A checkpoint whose files are damaged is renamed to this prefix + its name (kept to inspect).
DAMAGED_PREFIX = ".damaged-"
# A rank's own error, for the launchers to name (RunDir.record_failure): `.failed-rank<N>`.
FAILED_RANK_PREFIX = ".failed-rank"

# The package's logger (runner.rundir), which log lines named before the package had modules.
log = logging.getLogger(__package__)


def is_run_dir(path: Path) -> bool:
    """Whether `path` is a training run directory (it has a status file)."""
    return (path / STATUS_FILE).is_file()


def run_around(path: Path) -> Path | None:
    """The run directory that `path` lies inside (not `path` itself), or None: `runner runs`
    looks for no run inside another (find_runs)."""
    return next((up for up in path.resolve().parents if is_run_dir(up)), None)


def lora_base(adapter_dir: Path) -> Path | None:
    """The base model a LoRA checkpoint (a PEFT adapter dir) loads onto; None if it names none.

    A checkpoint of a run that holds its own base (RUN/base_model/) takes that one, wherever the
    run now lies: its adapter_config.json names the base by the absolute path it had in training,
    which a moved run lost and a copied one still points at. Any other takes the base that its
    adapter_config.json names (`base_model_name_or_path`, kept as peft wrote it).
    """
    own = own_base(adapter_dir)
    if own is not None:
        return own
    named = json.loads((adapter_dir / ADAPTER_CONFIG_FILE).read_text()).get(
        "base_model_name_or_path"
    )
    return Path(named) if named else None


def own_base(adapter_dir: Path) -> Path | None:
    """The base that the run of a LoRA checkpoint holds in its own directory (RUN/base_model/,
    written from the seed), wherever the run lies now; None where it holds none."""
    run = adapter_dir.parent.parent
    if adapter_dir.parent.name == CHECKPOINTS_DIR and is_run_dir(run):
        if (run / BASE_MODEL_DIR).is_dir():
            return run / BASE_MODEL_DIR
    return None


class RunDir:
    """One run's directory; every downstream command reads runs through this."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)

    @property
    def recipe_path(self) -> Path:
        """The run's recipe.yaml."""
        return self.path / RECIPE_FILE

    @property
    def checkpoints_dir(self) -> Path:
        """The directory holding the run's checkpoints (step_<N>/)."""
        return self.path / CHECKPOINTS_DIR

    @property
    def profile_dir(self) -> Path:
        """Where the profiled steps' trace, ops and summary go (profile.enabled=true)."""
        return self.path / PROFILE_DIR

    # ---- status ---------------------------------------------------------------------------
    def status(self) -> Status:
        """The run's status; a missing or unreadable status.json reads as state `unknown`."""
        try:
            data = json.loads((self.path / STATUS_FILE).read_text())
        except (OSError, ValueError):
            return Status()
        return Status.from_json(data)

    def read_status(self) -> dict[str, Any]:
        """The run's status as the JSON object status.json holds (its set fields)."""
        return self.status().to_json()

    def write_status(self, state: str, *, new_start: bool = False, **fields: Any) -> Status:
        """Moves the run to `state`, keeping earlier fields and stamping times and heartbeat.
        new_start: the write of a launcher that starts the run again (a resume, a restart),
        which closes the start before it at that start's last heartbeat, before this write
        stamps a new one (the minutes between a kill and the resume counted as trained)."""
        assert state in STATES, state
        status = self.status()
        now = now_iso()
        changes: dict[str, Any] = {}
        if status.created_at is None:
            changes["created_at"] = now
        if new_start and status.started_at:
            status = dataclasses.replace(
                status, earlier_s=round(status.span_so_far(), 3), started_at=None
            )
        if state == "initializing":
            if status.started_at:  # started again (a resume, a restart): its time so far kept
                changes["earlier_s"] = round(status.span_so_far(), 3)
            changes.update(started_at=now, ended_at=None, error=None)
        if state in FINAL_STATES:
            changes["ended_at"] = now
        changes.update(fields)
        changes.update(state=state, updated_at=now, heartbeat_at=now, version=STATUS_VERSION)
        changes.update(host=socket.gethostname(), pid=os.getpid())
        status = dataclasses.replace(status, **changes)
        write_json_atomic(self.path / STATUS_FILE, status.to_json())
        return status

    def record_failure(self, rank: int, message: str | None) -> None:
        """Rank `rank`'s own error (not a peer lost), for the launchers to name: status.json is
        rank 0's, which only loses contact with a rank that failed so. Kept until the rank
        starts again (an attempt the agent restarts, a resume), which clears it (None)."""
        path = self.path / f"{FAILED_RANK_PREFIX}{rank}"
        if message is None:
            path.unlink(missing_ok=True)
        else:
            write_text_atomic(path, message)

    def first_failure(self, since: float) -> tuple[int, str] | None:
        """The rank whose own error was recorded first since `since` (a time.time()), and the
        error: the others' failures follow from it."""
        recorded = []
        for path in self.path.glob(f"{FAILED_RANK_PREFIX}*"):
            with contextlib.suppress(OSError, ValueError):
                rank = int(path.name.removeprefix(FAILED_RANK_PREFIX))
                when, message = path.stat().st_mtime, path.read_text().strip()
                if when >= since and message:
                    recorded.append((when, rank, message))
        return min(recorded)[1:] if recorded else None

    def touch_heartbeat(self) -> None:
        """Marks the run alive now (the heartbeat file's mtime)."""
        (self.path / HEARTBEAT_FILE).touch()

    def seconds_since_heartbeat(self) -> float | None:
        """How long ago the run last marked itself alive: its heartbeat, or a later status
        write (a resumed run's launcher writes one before its workers beat); None: it never
        beat."""
        try:
            age = time.time() - (self.path / HEARTBEAT_FILE).stat().st_mtime
        except OSError:
            return None
        written = self.status().heartbeat_at
        with contextlib.suppress(ValueError, TypeError):
            age = min(age, time.time() - datetime.fromisoformat(str(written)).timestamp())
        return age

    def effective_state(self) -> tuple[str, str | None]:
        """The state of the run as its processes stand, with the reason where it is not the
        recorded one: the one reading of it that `runner runs`, stop, resume and the API share.

        A final state recorded is the state. An active one stands while any process of the run
        holds its lock, but reads `stalled` once its heartbeat is older than HEARTBEAT_STALE_S
        (its processes live but are stopped or hung), and `stopping` once the launcher is gone
        (its workers are saving and will record how the run ended); with no process of it left
        (lock free, or where the lock cannot tell: launcher gone, or no heartbeat for
        HEARTBEAT_STALE_S) it reads `failed`, as the run ended without saying so.
        """
        status = self.status()
        if status.state not in ACTIVE_STATES:
            return status.state, None
        pid = status.launcher_pid or status.pid
        here = status.host == socket.gethostname()
        gone = here and pid is not None and not pid_alive(pid)
        # From another machine a free lock proves nothing: some shared file systems keep flock
        # to the machine that took it.
        held = lock_held(self.path) if here else None
        age = self.seconds_since_heartbeat()
        stale = age is not None and age > HEARTBEAT_STALE_S
        if held:
            if stale:
                return STALLED, self._stalled_reason(age or 0.0, status)
            if gone:
                return STOPPING, f"its launcher, process {pid}, is gone; its workers are saving"
            return status.state, None
        if gone:
            return "failed", f"process {pid} is gone and the status was never updated"
        if held is False:
            return "failed", "no process of the run is left and the status was never updated"
        if stale:
            return "failed", f"no heartbeat for {age:.0f} s"
        return status.state, None

    @staticmethod
    def _stalled_reason(age: float, status: Status) -> str:
        """What a stalled run's processes are doing, as far as this machine can tell."""
        pids = sorted({p for p in (status.launcher_pid, status.pid) if p is not None})
        stopped = [pid for pid in pids if pid_stopped(pid)]
        if stopped:
            listed = " ".join(map(str, stopped))
            doing = f"stopped (SIGSTOP, Ctrl-Z): process {listed}; `kill -CONT {listed}` continues"
        else:
            doing = "its processes live but do not beat: hung, or starved of CPU"
        return f"no heartbeat for {age:.0f} s; {doing}"

    # ---- metrics --------------------------------------------------------------------------
    def append_metrics(self, record: dict[str, Any]) -> None:
        """Adds one line (one step's record) to metrics.jsonl."""
        with open(self.path / METRICS_FILE, "a") as f:
            f.write(json.dumps(record) + "\n")

    def read_metrics(self) -> list[dict[str, Any]]:
        """The lines of metrics.jsonl; one cut short (still being written) is skipped."""
        try:
            text = (self.path / METRICS_FILE).read_text()
        except OSError:
            return []
        return [record for line in text.splitlines() if (record := _record(line)) is not None]

    def records_from_end(self) -> Iterator[dict[str, Any]]:
        """metrics.jsonl's records, last first, read from the file's end a block at a time: a
        listing wants the last few of a long run's thousands."""
        try:
            file = open(self.path / METRICS_FILE, "rb")  # noqa: SIM115 - closed by the with below
        except OSError:
            return
        with file:
            end, carried = file.seek(0, os.SEEK_END), b""
            while end > 0:
                start = max(0, end - (1 << 16))
                file.seek(start)
                lines = (file.read(end - start) + carried).split(b"\n")
                # The block's first line may begin in the block before: carried to it.
                carried = lines.pop(0) if start else b""
                for line in reversed(lines):
                    if (record := _record(line)) is not None:
                        yield record
                end = start

    def metric_names(self) -> set[str]:
        """The keys that metrics.jsonl records a number under, step aside."""
        return {
            key
            for record in self.read_metrics()
            for key, value in record.items()
            if key != "step" and number(value) is not None
        }

    def losses(self) -> dict[int, float]:
        """Per-step training losses, by step, from metrics.jsonl (those logged as numbers)."""
        return {
            r["step"]: r["loss"] for r in self.read_metrics() if number(r.get("loss")) is not None
        }

    def truncate_metrics(self, last_step: int) -> None:
        """Drops metric lines past `last_step`: a resumed run logs those steps again."""
        kept = [r for r in self.read_metrics() if r["step"] <= last_step]
        write_text_atomic(self.path / METRICS_FILE, "".join(json.dumps(r) + "\n" for r in kept))

    def has_tracker_runs(self) -> bool:
        """Whether W&B or MLflow holds a run that names this directory (RUN/wandb/, the MLflow
        id in trackers.json): such a directory is kept, failed, even before its first step."""
        return (self.path / TRACKERS_FILE).is_file() or (self.path / WANDB_DIR).is_dir()

    # ---- checkpoints ----------------------------------------------------------------------
    def checkpoint_path(self, step: int) -> Path:
        """Where the whole checkpoint of `step` lives (once it is written)."""
        return self.checkpoints_dir / f"step_{step}"

    def checkpoints(self) -> list[tuple[int, Path]]:
        """Whole checkpoints as (step, path), oldest first; temporary ones are not listed."""
        if not self.checkpoints_dir.is_dir():
            return []
        found = []
        for child in self.checkpoints_dir.iterdir():
            step = checkpoint_step(child)
            if step is not None and child.is_dir():
                found.append((step, child))
        return sorted(found)

    def latest_checkpoint(self) -> Path | None:
        """The newest whole checkpoint: the one resume, deploy and export pick.

        A newer one whose files are damaged (cut short by a full disk or a killed copy) is set
        aside as checkpoints/.damaged-step_N, with a warning naming the file, so that neither
        resume nor pruning counts it again.
        """
        for _, checkpoint in reversed(self.checkpoints()):
            # One linked in from elsewhere is not this run's to read or move: deploy checks
            # where a link leads before it reads anything, and its loader checks the weights.
            problem = "" if checkpoint.is_symlink() else checkpoint_problem(checkpoint)
            if not problem:
                return checkpoint
            _set_aside(checkpoint, problem)
        return None

    def without_checkpoint(self) -> str:
        """What deploy, export and push say of a run with no whole checkpoint: that one is yet to
        come, or, where the run has ended, what would train one (none will come by waiting)."""
        state, _ = self.effective_state()
        if state not in FINAL_STATES:
            return "the run has no whole checkpoint yet (checkpoints/step_<N>/): wait for one"
        again = "train it again" if state == "completed" else f"`runner resume {self.path}`"
        return (
            f"the run ended {state} with no whole checkpoint (checkpoints/step_<N>/: none saved, "
            f"or all removed since): {again} to make one"
        )

    def remove_leftovers(self) -> list[Path]:
        """Removes what a killed save or prune left in checkpoints/ (.tmp-step_N, .deleting-*)."""
        if not self.checkpoints_dir.is_dir():
            return []
        found = [
            child
            for child in self.checkpoints_dir.iterdir()
            if (child.is_dir() or child.is_symlink())
            and child.name.startswith((".tmp-", ".deleting-"))
        ]
        for child in found:
            _delete(child)
        return found

    def fresh_checkpoint_tmp(self, step: int) -> Path:
        """Where to write step `step`'s checkpoint; a leftover of a crashed save is removed."""
        tmp = self.checkpoints_dir / f".tmp-step_{step}"
        if tmp.exists():
            _remove_tree(tmp)
        return tmp

    def commit_checkpoint(self, tmp: Path, step: int) -> Path:
        """Renames a fully written checkpoint (flushed: sync_tree) into place."""
        final = self.checkpoint_path(step)
        if final.exists() or final.is_symlink():  # the same step saved by an earlier attempt
            _remove_tree(final)
        os.replace(tmp, final)
        _sync_dir(self.checkpoints_dir)
        return final

    def prune_checkpoints(self, keep_last: int, keep_step: int | None = None) -> None:
        """Removes all but the last `keep_last` checkpoints, and the one of `keep_step` (the
        run's best), whatever its age."""
        for old_step, old in self.checkpoints()[: -max(keep_last, 1)]:
            if old_step != keep_step:
                _remove_tree(old)

    # ---- the best -------------------------------------------------------------------------
    def best(self, metric: str | None = None, mode: str | None = None) -> Best | None:
        """The best evaluation the run recorded (metric, mode, step, value, checkpoint), if any
        and if it is by `metric` and `mode` (None: whichever)."""
        best = self.status().best
        if best is None or metric not in (None, best["metric"]) or mode not in (None, best["mode"]):
            return None
        return best

    def best_checkpoint(self, metric: str | None = None, mode: str | None = None) -> Path | None:
        """The run's best whole checkpoint by `metric` and `mode` (None: by its objective): its
        recorded best's when that is by them and still kept; else, with both given, the whole
        checkpoint whose step's metrics line has the best value of `metric`."""
        checkpoints = dict(self.checkpoints())
        best = self.best(metric, mode)
        if best is not None and best["step"] in checkpoints:
            return checkpoints[best["step"]]
        if metric is None or mode is None:
            return None
        scores = {}
        for record in self.read_metrics():
            value = number(record.get(metric))
            if record["step"] in checkpoints and value is not None and not math.isnan(value):
                scores[record["step"]] = value
        step = best_key(scores, mode)
        return checkpoints[step] if step is not None else None

    def objective_value(self, metric: str) -> tuple[float, int] | None:
        """(value, step) that ranks this run by `metric`: its recorded best when that is by
        `metric`, else the last value of `metric` in metrics.jsonl (NaN if it diverged)."""
        best = self.best(metric)
        if best is not None:
            return float(best["value"]), best["step"]
        scored = [
            (value, record["step"])
            for record in self.read_metrics()
            if (value := number(record.get(metric))) is not None
        ]
        return scored[-1] if scored else None


def checkpoint_step(path: Path) -> int | None:
    """The step of a checkpoint's directory by its name (step_<N>), else None."""
    match = _CHECKPOINT_NAME.match(path.name)
    return int(match.group(1)) if match else None


def _record(line: str | bytes) -> dict[str, Any] | None:
    """A metrics.jsonl line's record; None for one cut short (still being written) or not one."""
    try:
        record = json.loads(line)
    except ValueError:
        return None
    return record if isinstance(record, dict) and isinstance(record.get("step"), int) else None


def best_key(scores: dict[int, float], mode: str) -> int | None:
    """The key of the lowest (min) or highest (max) score; the first such key on a tie."""
    assert mode in ("min", "max"), mode
    if not scores:
        return None
    pick = min if mode == "min" else max
    return pick(scores, key=lambda key: scores[key])


def _set_aside(checkpoint: Path, problem: str) -> None:
    """Renames a damaged checkpoint out of the listing; it stays there for the user to inspect."""
    aside = checkpoint.with_name(f"{DAMAGED_PREFIX}{checkpoint.name}")
    copies = 1
    while aside.exists():  # set aside before: keep that one too
        copies += 1
        aside = checkpoint.with_name(f"{DAMAGED_PREFIX}{checkpoint.name}-{copies}")
    try:
        os.replace(checkpoint, aside)
    except FileNotFoundError:
        return  # another process of this run set it aside first, and warned
    except OSError as err:
        log.warning(
            "checkpoint %s is damaged, skipped: %s (not set aside: %s)", checkpoint, problem, err
        )
        return
    log.warning(
        "checkpoint %s is damaged, set aside as %s (delete it when done): %s",
        checkpoint.name,
        aside,
        problem,
    )


def sync_tree(path: Path) -> None:
    """Flushes a checkpoint's files and folders to the disk, before the rename that makes it
    whole, as torch's distributed checkpoint writer does (sync_files): after a crash of the
    machine (not of the process), a file system may keep a rename whose files it never wrote,
    and the whole-looking checkpoint holds empty files."""
    for folder, _, files in os.walk(path):
        for name in files:
            fd = os.open(os.path.join(folder, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _sync_dir(Path(folder))


def _sync_dir(path: Path) -> None:
    """Flushes a folder's entries (a rename into it, the files made in it) to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError:  # some file systems take no fsync of a folder
        pass
    finally:
        os.close(fd)


def _remove_tree(path: Path) -> None:
    # Rename first so a crash mid-delete leaves a name that is never picked up.
    doomed = path.with_name(f".deleting-{path.name}")
    os.replace(path, doomed)
    _delete(doomed)


def _delete(path: Path) -> None:
    """A checkpoint linked in from elsewhere (moved to other storage, linked back) loses its
    link alone: where it leads is not this run's to delete."""
    if path.is_symlink():
        path.unlink()
    else:
        shutil.rmtree(path)
