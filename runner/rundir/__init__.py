"""The run directory contract (see DESIGN.md): the status record, metrics, whole checkpoints,
and the sweeps made of run directories.

Everything downstream (sweeps, deploy, export, repro, runs/logs/stop/resume) reads run
directories through this module, so each rule (which checkpoint is whole, which is the best,
which run of a sweep is the best) is written once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import json
import logging
import math
import os
import re
import shutil
import socket
import threading
import time
import typing
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, NotRequired, TypedDict

from runner.errors import UserError

STATES = ("created", "initializing", "running", "checkpointing", "completed", "failed", "cancelled")
ACTIVE_STATES = ("created", "initializing", "running", "checkpointing")
FINAL_STATES = ("completed", "failed", "cancelled")
RECIPE_FILE = "recipe.yaml"
HEARTBEAT_FILE = "heartbeat"
LOG_FILE = "train.log"
# Held (flock) by the process that trains the run, for as long as it runs; see run_lock.
LOCK_FILE = ".lock"
# A live run touches its heartbeat every HEARTBEAT_EVERY_S; older than HEARTBEAT_STALE_S is dead.
HEARTBEAT_EVERY_S = 10.0
HEARTBEAT_STALE_S = 120.0
STATUS_FILE = "status.json"
# Bumped when status.json changes meaning; files without a version read as version 0.
STATUS_VERSION = 1
METRICS_FILE = "metrics.jsonl"
CHECKPOINTS_DIR = "checkpoints"
_CHECKPOINT_NAME = re.compile(r"^step_(\d+)$")

# The files of a checkpoint directory (checkpoints/step_<N>/), in Hugging Face's and PEFT's
# names, so that transformers and peft load it as it is.
HF_CONFIG_FILE = "config.json"
MODEL_FILE = "model.safetensors"
# A hub repo's weights in several files, listed by this index.
SHARDED_INDEX = "model.safetensors.index.json"
ADAPTER_CONFIG_FILE = "adapter_config.json"
ADAPTER_FILE = "adapter_model.safetensors"
GENERATION_CONFIG = "generation_config.json"
TRAINING_STATE_FILE = "training_state.pt"
# Where transformers reads a chat template kept apart from tokenizer_config.json.
CHAT_TEMPLATE_FILE = "chat_template.jinja"
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    CHAT_TEMPLATE_FILE,
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
)
# The largest header the safetensors library reads; a larger length is not a header's.
_SAFETENSORS_MAX_HEADER = 100_000_000
# A checkpoint whose files are damaged is renamed to this prefix + its name (kept to inspect).
DAMAGED_PREFIX = ".damaged-"

log = logging.getLogger(__name__)


def now_iso() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def write_text_atomic(path: Path, text: str) -> None:
    """Writes under a temporary name and renames it, so readers (and a run killed mid-write,
    then resumed) never see half a file."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def write_json_atomic(path: Path, data: Any) -> None:
    write_text_atomic(path, json.dumps(data, indent=2) + "\n")


def weight_files(checkpoint_dir: Path) -> list[Path]:
    """The safetensors files holding a checkpoint's weights (one, or the shards of an index)."""
    if (checkpoint_dir / SHARDED_INDEX).is_file():
        index = json.loads((checkpoint_dir / SHARDED_INDEX).read_text())
        return [checkpoint_dir / name for name in sorted(set(index["weight_map"].values()))]
    return [checkpoint_dir / MODEL_FILE]


def check_safetensors(path: Path, *, key: str) -> None:
    """A UserError naming `path` (under config key `key`) unless it is a whole safetensors file:
    one whose header parses and places every tensor's bytes within the file."""
    problem = _safetensors_problem(path)
    if problem:
        raise UserError(key, str(path), f"{problem}; download, copy or save it again")


def _safetensors_problem(path: Path) -> str:
    """What is wrong with a safetensors file ("" if nothing), read from its header alone: 8 bytes
    giving the header's length, the header (JSON), then the tensors' bytes it locates."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            header_size = int.from_bytes(f.read(8), "little") if size >= 8 else 0
            if not 2 <= header_size <= min(size - 8, _SAFETENSORS_MAX_HEADER):
                return f"is cut short or not safetensors: a header of {header_size} bytes in {size}"
            header = json.loads(f.read(header_size))
    except FileNotFoundError:
        return "is missing"
    except OSError as err:
        return f"does not read ({err})"
    except ValueError as err:  # not JSON, or not UTF-8
        return f"is not safetensors: its header is not JSON ({err})"
    if not isinstance(header, dict):
        return "is not safetensors: its header is not a JSON object"
    data_size = size - 8 - header_size
    for name, tensor in header.items():
        if name == "__metadata__":
            continue
        offsets = tensor.get("data_offsets") if isinstance(tensor, dict) else None
        if not (
            isinstance(offsets, list)
            and len(offsets) == 2
            and all(isinstance(offset, int) for offset in offsets)
            and 0 <= offsets[0] <= offsets[1]
        ):
            return f"is not safetensors: tensor {name!r} has no [begin, end] data_offsets"
        if offsets[1] > data_size:
            end = 8 + header_size + offsets[1]
            return f"is cut short: tensor {name!r} ends at byte {end}, the file at {size}"
    return ""


def _training_state_problem(path: Path) -> str:
    """What is wrong with a training_state.pt ("" if nothing, or if there is none).

    torch.save writes a zip archive whose central directory is the last thing in the file, so a
    file cut short has none: zipfile finds that from the file's tail, without reading the state.
    """
    if not path.exists():
        return ""
    try:
        with zipfile.ZipFile(path):
            return ""
    except (OSError, zipfile.BadZipFile) as err:
        return f"is cut short or not written by torch.save ({err})"


def checkpoint_problem(checkpoint: Path) -> str:
    """What is wrong with a checkpoint's files ("" if nothing): each safetensors file and the
    training state it holds. A file it lacks is not looked for: a checkpoint is committed whole,
    by a rename, and its kind (full, LoRA, LoRA with merged weights) says which it holds."""
    for path in sorted(checkpoint.glob("*.safetensors")):
        problem = _safetensors_problem(path)
        if problem:
            return f"{path} {problem}"
    state = checkpoint / TRAINING_STATE_FILE
    problem = _training_state_problem(state)
    return f"{state} {problem}" if problem else ""


class Best(TypedDict):
    """The best evaluation a run recorded by its objective, and the checkpoint saved at it."""

    metric: str
    mode: str
    step: int
    value: float
    checkpoint: NotRequired[str]


@dataclass(frozen=True)
class Status:
    """status.json: where a run is in its lifecycle. Unset fields are left out of the file."""

    state: str = "unknown"
    step: int | None = None
    total_steps: int | None = None
    first_loss: float | None = None
    loss: float | None = None
    eval: dict[str, float] | None = None  # the last evaluation: its step and each metric
    best: Best | None = None
    error: str | None = None
    created_at: str | None = None
    started_at: str | None = None
    ended_at: str | None = None
    updated_at: str | None = None
    heartbeat_at: str | None = None
    host: str | None = None
    pid: int | None = None  # the process that wrote this status
    launcher_pid: int | None = None  # the process `runner stop` signals
    version: int = 0

    @classmethod
    def from_json(cls, data: object) -> Status:
        """The status a parsed status.json holds, of any version: a field that is missing or
        of the wrong type reads as unset, and fields this version does not know are ignored."""
        if not isinstance(data, dict):
            return cls()
        known = {field.name for field in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known and _fits(k, v)})

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}


def _fits(name: str, value: object) -> bool:
    """Whether `value` has the type of Status field `name` (a float field takes an int too)."""
    if value is None or isinstance(value, bool):
        return False
    if name == "best":
        return _is_best(value)
    kind = _FIELD_KINDS[name]
    return isinstance(value, int | float) if kind is float else isinstance(value, kind)


def _is_best(value: object) -> bool:
    if not isinstance(value, dict):
        return False
    return (
        isinstance(value.get("metric"), str)
        and value.get("mode") in ("min", "max")
        and isinstance(value.get("step"), int)
        and number(value.get("value")) is not None
    )


def _field_kinds() -> dict[str, type]:
    """Each Status field's type without its `| None`: str, int, float or dict."""
    kinds = {}
    for name, hint in typing.get_type_hints(Status).items():
        kind = (typing.get_args(hint) or (hint,))[0]
        kinds[name] = typing.get_origin(kind) or kind
    return kinds


_FIELD_KINDS = _field_kinds()


def number(value: object) -> float | None:
    """`value` as a float when it is a number (not a bool); NaN stays NaN."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def is_run_dir(path: Path) -> bool:
    """Whether `path` is a training run directory (it has a status file)."""
    return (path / STATUS_FILE).is_file()


def is_checkpoint_dir(path: Path) -> bool:
    """Whether `path` is a checkpoint itself: a Hugging Face model or a PEFT adapter dir."""
    return (path / HF_CONFIG_FILE).is_file() or (path / ADAPTER_CONFIG_FILE).is_file()


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

    def write_status(self, state: str, **fields: Any) -> Status:
        """Moves the run to `state`, keeping earlier fields and stamping times and heartbeat."""
        assert state in STATES, state
        status = self.status()
        now = now_iso()
        changes: dict[str, Any] = {}
        if status.created_at is None:
            changes["created_at"] = now
        if state == "initializing":
            changes.update(started_at=now, ended_at=None, error=None)
        if state in FINAL_STATES:
            changes["ended_at"] = now
        changes.update(fields)
        changes.update(state=state, updated_at=now, heartbeat_at=now, version=STATUS_VERSION)
        changes.update(host=socket.gethostname(), pid=os.getpid())
        status = dataclasses.replace(status, **changes)
        write_json_atomic(self.path / STATUS_FILE, status.to_json())
        return status

    def touch_heartbeat(self) -> None:
        (self.path / HEARTBEAT_FILE).touch()

    def seconds_since_heartbeat(self) -> float | None:
        path = self.path / HEARTBEAT_FILE
        return time.time() - path.stat().st_mtime if path.exists() else None

    def effective_state(self) -> tuple[str, str | None]:
        """The recorded state, or `failed` with a reason when an active run's process is gone."""
        status = self.status()
        if status.state not in ACTIVE_STATES:
            return status.state, None
        pid = status.launcher_pid or status.pid
        if status.host == socket.gethostname() and pid and not _alive(pid):
            return "failed", f"process {pid} is gone and the status was never updated"
        age = self.seconds_since_heartbeat()
        if age is not None and age > HEARTBEAT_STALE_S:
            return "failed", f"no heartbeat for {age:.0f} s"
        return status.state, None

    # ---- metrics --------------------------------------------------------------------------
    def append_metrics(self, record: dict[str, Any]) -> None:
        with open(self.path / METRICS_FILE, "a") as f:
            f.write(json.dumps(record) + "\n")

    def read_metrics(self) -> list[dict[str, Any]]:
        """The lines of metrics.jsonl; one cut short (still being written) is skipped."""
        try:
            text = (self.path / METRICS_FILE).read_text()
        except OSError:
            return []
        records = []
        for line in text.splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict) and isinstance(record.get("step"), int):
                records.append(record)
        return records

    def losses(self) -> dict[int, float]:
        """Per-step training losses, by step, from metrics.jsonl."""
        return {r["step"]: r["loss"] for r in self.read_metrics() if "loss" in r}

    def truncate_metrics(self, last_step: int) -> None:
        """Drops metric lines past `last_step`: a resumed run logs those steps again."""
        kept = [r for r in self.read_metrics() if r["step"] <= last_step]
        tmp = self.path / f".{METRICS_FILE}.tmp"
        tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
        os.replace(tmp, self.path / METRICS_FILE)

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
            match = _CHECKPOINT_NAME.match(child.name)
            if match and child.is_dir():
                found.append((int(match.group(1)), child))
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

    def remove_leftovers(self) -> list[Path]:
        """Removes what a killed save or prune left in checkpoints/ (.tmp-step_N, .deleting-*)."""
        if not self.checkpoints_dir.is_dir():
            return []
        found = [
            child
            for child in self.checkpoints_dir.iterdir()
            if child.is_dir() and child.name.startswith((".tmp-", ".deleting-"))
        ]
        for child in found:
            shutil.rmtree(child)
        return found

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
        final = self.checkpoint_path(step)
        if final.exists():  # the same step saved by an earlier attempt of this run
            _remove_tree(final)
        os.replace(tmp, final)
        for old_step, old in self.checkpoints()[: -max(keep_last, 1)]:
            if old_step != keep_step:
                _remove_tree(old)
        return final

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
        step = _pick(scores, mode)
        return checkpoints[step] if step is not None else None

    def objective_value(self, metric: str) -> tuple[float, int] | None:
        """(value, step) that ranks this run by `metric`: its recorded best when that is by
        `metric`, else the last value of `metric` in metrics.jsonl (NaN if it diverged)."""
        best = self.best(metric)
        if best is not None:
            return float(best["value"]), best["step"]
        scored = [(number(r.get(metric)), r["step"]) for r in self.read_metrics()]
        scored = [(value, step) for value, step in scored if value is not None]
        return scored[-1] if scored else None


def sweep_runs(sweep_dir: Path) -> list[RunDir]:
    """The run directories directly inside a sweep directory, in job order (0, 1, ..., 10)."""
    jobs = [child for child in sweep_dir.iterdir() if child.is_dir() and is_run_dir(child)]
    jobs.sort(key=lambda p: (not p.name.isdigit(), int(p.name) if p.name.isdigit() else p.name))
    return [RunDir(job) for job in jobs]


def best_run(runs: list[RunDir], metric: str, mode: str) -> RunDir | None:
    """The best run of a sweep: of the completed runs with a whole checkpoint, the one whose
    objective value (`RunDir.objective_value`) is lowest (mode min) or highest (max).

    A NaN value never wins; of equal values, the earlier run in `runs` does. The sweep summary
    and deploy's choice of a sweep's run both use this rule.
    """
    scores = {}
    for index, run in enumerate(runs):
        scored = run.objective_value(metric)
        if scored is None or math.isnan(scored[0]):
            continue
        if run.status().state == "completed" and run.checkpoints():
            scores[index] = scored[0]
    index = _pick(scores, mode)
    return runs[index] if index is not None else None


def _pick(scores: dict[int, float], mode: str) -> int | None:
    """The key of the lowest (min) or highest (max) score; the first such key on a tie."""
    assert mode in ("min", "max"), mode
    if not scores:
        return None
    pick = min if mode == "min" else max
    return pick(scores, key=lambda key: scores[key])


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


def _remove_tree(path: Path) -> None:
    # Rename first so a crash mid-delete leaves a name that is never picked up.
    doomed = path.with_name(f".deleting-{path.name}")
    os.replace(path, doomed)
    shutil.rmtree(doomed)


class RunLocked(UserError):
    """Another process trains this run directory (it holds the run's lock)."""


@contextlib.contextmanager
def run_lock(run_dir: Path, *, key: str) -> Iterator[None]:
    """Keeps a second trainer out of `run_dir` while this process trains it: a UserError under
    config key `key`, naming the process that holds the lock, if another already does.

    flock ends with the process that took it, kill -9 included, so a dead trainer never leaves
    the run locked. A file system without flock (some shared ones) runs unlocked, with a warning.
    """
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / LOCK_FILE
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            raise RunLocked(
                key,
                str(run_dir),
                f"the run is being trained by process {holder} (it holds {path}); wait for it "
                f"to end, or `runner stop {run_dir}` and then resume it",
            ) from None
        except OSError as err:
            if err.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                raise
            log.warning("%s: no lock on this file system (%s); train it from one place", path, err)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)
