"""What to serve: a checkpoint dir, a run dir's latest or best checkpoint, or a sweep's best run."""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

from runner.errors import UserError
from runner.evaluate import METRIC_MODES, TRAINING_METRIC_MODES

_STEP_DIR = re.compile(r"step_(\d+)")
_MODES = ("min", "max")
_CHECKPOINT_CHOICES = ("latest", "best")


@dataclass(frozen=True)
class ServedCheckpoint:
    """A whole checkpoint directory and the model name clients ask for it by."""

    name: str
    path: Path


def resolve_checkpoints(
    paths: str | list[str],
    *,
    names: str | list[str] | None,
    allowed_roots: list[str],
    checkpoint: str,
    metric: str | None,
    mode: str | None,
) -> list[ServedCheckpoint]:
    """Turn the `checkpoint=` paths into whole checkpoint dirs, each under a unique name."""
    paths = [paths] if isinstance(paths, str) else list(paths)
    if not paths:
        raise UserError("checkpoint", paths, "name at least one checkpoint, run or sweep dir")
    names = [names] if isinstance(names, str) else list(names or [])
    if names and len(names) != len(paths):
        raise UserError(
            "served_model_name", names, f"give one name per checkpoint ({len(paths)}) or null"
        )
    names = names or [os.path.normpath(path) for path in paths]
    if len(set(names)) != len(names):
        raise UserError("served_model_name", names, "each served checkpoint needs its own name")
    # The paths the operator named are trusted roots; what they lead to must stay inside.
    roots = [Path(root).resolve() for root in [*allowed_roots, *paths]]
    served = []
    for name, path in zip(names, paths, strict=True):
        chosen = choose_checkpoint(Path(path), checkpoint=checkpoint, metric=metric, mode=mode)
        served.append(ServedCheckpoint(name, check_inside_roots(chosen, roots)))
    return served


def choose_checkpoint(path: Path, *, checkpoint: str, metric: str | None, mode: str | None) -> Path:
    """The checkpoint dir that `path` stands for: itself, its run's pick, or its sweep's pick.

    metric None: what each run recorded as its best (its training objective); mode None: the
    recorded mode, or the known direction of `metric`.
    """
    if mode is not None and mode not in _MODES:
        raise UserError("select.mode", mode, "use min or max")
    if checkpoint not in _CHECKPOINT_CHOICES:
        raise UserError("select.checkpoint", checkpoint, "use latest or best")
    if not path.is_dir():
        raise UserError("checkpoint", str(path), "no such directory")
    if (path / "config.json").is_file() or (path / "adapter_config.json").is_file():
        return path
    if is_run_dir(path):
        if checkpoint == "best":
            return best_checkpoint(path, metric=metric, mode=mode)
        return latest_checkpoint(path)
    runs = sweep_runs(path)
    if runs:
        run = best_run(path, runs, metric=metric, mode=mode)
        if checkpoint == "best":
            return best_checkpoint(run, metric=metric, mode=mode)
        return latest_checkpoint(run)
    raise UserError(
        "checkpoint",
        str(path),
        "not a checkpoint dir (config.json), a run dir (status.json) or a sweep dir (run dirs "
        "0/, 1/, ...): pass e.g. outputs/<date>/<time> or multirun/<date>/<time>",
    )


def is_run_dir(path: Path) -> bool:
    """Whether `path` is a training run directory."""
    return (path / "status.json").is_file()


def sweep_runs(path: Path) -> list[Path]:
    """The run directories directly inside a sweep directory."""
    runs = [child for child in path.iterdir() if child.is_dir() and is_run_dir(child)]
    return sorted(runs, key=lambda run: (len(run.name), run.name))


def whole_checkpoints(run_dir: Path) -> dict[int, Path]:
    """Step -> directory of every whole checkpoint; a `.tmp-` one is still being written."""
    checkpoints_dir = run_dir / "checkpoints"
    if not checkpoints_dir.is_dir():
        return {}
    found = {}
    for child in checkpoints_dir.iterdir():
        match = _STEP_DIR.fullmatch(child.name)
        if match and child.is_dir():
            found[int(match.group(1))] = child
    return found


def latest_checkpoint(run_dir: Path) -> Path:
    """The whole checkpoint with the highest step."""
    checkpoints = whole_checkpoints(run_dir)
    if not checkpoints:
        raise UserError(
            "checkpoint",
            str(run_dir),
            "this run has no whole checkpoint yet (checkpoints/step_<N>/): wait for one, or "
            "deploy another run",
        )
    return checkpoints[max(checkpoints)]


def recorded_best(run_dir: Path) -> dict | None:
    """The best evaluation the run recorded in status.json (metric, mode, step, value)."""
    try:
        status = json.loads((run_dir / "status.json").read_text())
    except (OSError, ValueError):
        return None
    best = status.get("best") if isinstance(status, dict) else None
    return best if isinstance(best, dict) else None


def _recorded_pick(run_dir: Path, metric: str | None, mode: str | None) -> dict | None:
    """The run's recorded best when it answers for `metric` and `mode` (None: any)."""
    best = recorded_best(run_dir)
    if best is None or metric not in (None, best["metric"]) or mode not in (None, best["mode"]):
        return None
    return best


def _mode_of(metric: str, mode: str | None) -> str:
    if mode is not None:
        return mode
    known = {**TRAINING_METRIC_MODES, **METRIC_MODES}
    if metric not in known:
        raise UserError(
            "select.mode", mode, f"say whether {metric} is better lower or higher: min or max"
        )
    return known[metric]


def best_checkpoint(run_dir: Path, *, metric: str | None, mode: str | None) -> Path:
    """The run's recorded best checkpoint, else the whole checkpoint whose step's eval line
    has the best `metric`."""
    checkpoints = whole_checkpoints(run_dir)
    best = _recorded_pick(run_dir, metric, mode)
    if best is not None and best["step"] in checkpoints:
        return checkpoints[best["step"]]
    if metric is None:
        raise UserError(
            "select.metric",
            metric,
            f"{run_dir} recorded no best checkpoint (it trained without evaluation, or its best "
            "was deleted): name a metrics.jsonl key, e.g. select.metric=loss, or "
            "select.checkpoint=latest",
        )
    mode = _mode_of(metric, mode)
    scores = {}
    for line in read_metrics(run_dir):
        step, value = line.get("step"), _number(line.get(metric))
        if step in checkpoints and value is not None:
            scores[step] = value
    if not scores:
        raise UserError(
            "select.metric",
            metric,
            f"no checkpoint of {run_dir} has an eval line with it: pick a metric that "
            "metrics.jsonl records at checkpoint steps, or select.checkpoint=latest",
        )
    pick = min if mode == "min" else max
    return checkpoints[pick(scores, key=lambda step: scores[step])]


def best_run(sweep_dir: Path, runs: list[Path], *, metric: str | None, mode: str | None) -> Path:
    """The completed run of a sweep whose recorded best (else last) `metric` value is best.

    metric None: the metric the runs recorded their best by, which must be one.
    """
    if metric is None:
        recorded = {(b["metric"], b["mode"]) for run in runs if (b := recorded_best(run))}
        if len(recorded) != 1:
            raise UserError(
                "select.metric",
                metric,
                f"the runs of {sweep_dir} recorded their best by {sorted(recorded) or 'nothing'}: "
                "name the metric to rank them by, e.g. select.metric=eval_loss",
            )
        ((metric, recorded_mode),) = recorded
        mode = mode or recorded_mode
    mode = _mode_of(metric, mode)
    scores = {}
    for run in runs:
        best = _recorded_pick(run, metric, None)
        value = _number(best["value"]) if best else last_value(run, metric)
        if run_state(run) == "completed" and value is not None and whole_checkpoints(run):
            scores[run] = value
    if not scores:
        raise UserError(
            "select.metric",
            metric,
            f"no completed run in {sweep_dir} has a checkpoint and a value for it in "
            "metrics.jsonl: pick another metric (e.g. loss or eval_loss) or wait for a run",
        )
    pick = min if mode == "min" else max
    return pick(scores, key=lambda run: scores[run])


def run_state(run_dir: Path) -> str | None:
    """The lifecycle state recorded in the run's status.json, if it can be read."""
    try:
        status = json.loads((run_dir / "status.json").read_text())
    except (OSError, ValueError):
        return None
    return status.get("state") if isinstance(status, dict) else None


def read_metrics(run_dir: Path) -> list[dict]:
    """The run's metrics.jsonl lines; a line being written (cut short) is skipped."""
    try:
        text = (run_dir / "metrics.jsonl").read_text()
    except OSError:
        return []
    lines = []
    for raw in text.splitlines():
        try:
            line = json.loads(raw)
        except ValueError:
            continue
        if isinstance(line, dict):
            lines.append(line)
    return lines


def last_value(run_dir: Path, metric: str) -> float | None:
    """The last value of `metric` in the run's metrics.jsonl."""
    values = [_number(line.get(metric)) for line in read_metrics(run_dir)]
    values = [value for value in values if value is not None]
    return values[-1] if values else None


def check_inside_roots(path: Path, roots: list[Path]) -> Path:
    """Resolve `path` and each file in it, and refuse any that lead outside the allowed roots."""
    resolved = path.resolve()
    for target in [resolved, *(child.resolve() for child in resolved.iterdir())]:
        if not any(target.is_relative_to(root) for root in roots):
            raise UserError(
                "allowed_roots",
                [str(root) for root in roots],
                f"{path} leads to {target}, outside every allowed root: add that directory "
                "to allowed_roots if you trust it",
            )
    return resolved


def _number(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float) or math.isnan(value):
        return None
    return float(value)
