"""status.json: where a run is in its lifecycle, and the best evaluation it recorded.

Read leniently: a file of any version, or cut short, reads as a Status (unknown fields left out,
a field of the wrong type unset), since `runner runs` lists whatever it finds.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from datetime import datetime
from typing import Any, NotRequired, TypedDict

STATES = ("created", "initializing", "running", "checkpointing", "completed", "failed", "cancelled")
ACTIVE_STATES = ("created", "initializing", "running", "checkpointing")
FINAL_STATES = ("completed", "failed", "cancelled")
# Shown, never recorded: the run's launcher is gone and its workers, which still hold the run's
# lock, are saving a checkpoint before they record how the run ended (RunDir.effective_state).
STOPPING = "stopping"
# Shown, never recorded: the run's processes live (they hold its lock) but its heartbeat is
# older than HEARTBEAT_STALE_S: stopped (SIGSTOP, a paused job) or hung (RunDir.effective_state).
STALLED = "stalled"
STATUS_FILE = "status.json"
# Bumped when status.json changes meaning; files without a version read as version 0.
STATUS_VERSION = 1


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
    # The seconds its earlier starts ran, each to its end or last heartbeat (a resume's before).
    earlier_s: float | None = None
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

    def seconds(self) -> float | None:
        """How long the run has trained, over its starts: from its latest start to its end,
        and its earlier starts' own (None until it ends)."""
        if not self.ended_at:
            return None
        if not self.started_at:  # ended before its latest start trained (stopped before it)
            return self.earlier_s
        return (self.earlier_s or 0.0) + _span_s(self.started_at, self.ended_at)

    def span_so_far(self) -> float:
        """Its latest start's seconds, to its end or else its last heartbeat (a process killed
        outright), with its earlier starts': what a start after it adds to earlier_s."""
        end = self.ended_at or self.heartbeat_at
        if not (self.started_at and end):
            return self.earlier_s or 0.0
        return (self.earlier_s or 0.0) + max(0.0, _span_s(self.started_at, end))

    def to_json(self) -> dict[str, Any]:
        """The JSON object status.json holds: the set fields."""
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}


def number(value: object) -> float | None:
    """`value` as a float when it is a number (not a bool); NaN stays NaN."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def _fits(name: str, value: object) -> bool:
    """Whether `value` has the type of Status field `name` (a float field takes an int too), a
    state is one of STATES, and a time is one with its zone: a state another version or a hand
    wrote (`paused`) reads as unknown, not as a run to signal."""
    if value is None or isinstance(value, bool):
        return False
    if name == "best":
        return _is_best(value)
    if name == "state":
        return value in STATES
    if name.endswith("_at"):
        return isinstance(value, str) and _zoned_time(value)
    kind = _FIELD_KINDS[name]
    return isinstance(value, int | float) if kind is float else isinstance(value, kind)


def _zoned_time(text: str) -> bool:
    try:
        return datetime.fromisoformat(text).tzinfo is not None
    except ValueError:
        return False


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


def _span_s(start: str, end: str) -> float:
    """The seconds from one ISO time to another."""
    return (datetime.fromisoformat(end) - datetime.fromisoformat(start)).total_seconds()
