"""What to serve: a checkpoint dir, a run dir's latest or best checkpoint, or a sweep's best run."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig, ListConfig, OmegaConf

from runner.errors import UserError
from runner.paths import pasteable, user_path
from runner.rundir import (
    ACTIVE_STATES,
    SWEEP_MARKERS,
    RunDir,
    best_run,
    is_checkpoint_dir,
    is_run_dir,
    is_sweep_dir,
    sweep_runs,
)
from runner.rundir.metrics import known_mode

log = logging.getLogger(__name__)

_MODES = ("min", "max")
_CHECKPOINT_CHOICES = ("latest", "best")
SAY_WHAT = (
    "say what to serve: checkpoint=<checkpoint dir | run dir | sweep dir>, or a list "
    "checkpoint=[a,b] to serve several"
)


@dataclass(frozen=True)
class ServedCheckpoint:
    """A whole checkpoint directory and the model name clients ask for it by.

    aliases: other names a request may give it by (the path as given in `checkpoint=` and the
    checkpoint's own path, which were its name before short names), never listed.
    """

    name: str
    path: Path
    aliases: tuple[str, ...] = ()


def short_name(checkpoint: Path) -> str:
    """The default model name: a run's checkpoint as `<run>/<step>`, the run named by its last
    two folders (outputs/<date>/<time>, or multirun's <time>/<job>), so that no client learns
    where the server's files lie; any other checkpoint by its folder's name."""
    run = checkpoint.parent.parent
    if checkpoint.parent.name == "checkpoints" and is_run_dir(run):
        return f"{run.parent.name}/{run.name}/{checkpoint.name}"
    return checkpoint.name


def check_given(config: DictConfig) -> None:
    """`checkpoint=` names something to serve: left out (???), null, "", or a null or "" in its
    list is refused by name (null was a TypeError's traceback, and a null in a list "no such
    directory" of 'None')."""
    if OmegaConf.is_missing(config, "checkpoint"):
        raise UserError("checkpoint", "???", SAY_WHAT)
    given = config.checkpoint
    listed = enumerate(given) if isinstance(given, ListConfig) else [(None, given)]
    for index, path in listed:
        # "" was read as "." (the directory deploy ran in), and served were it a run's.
        if path is None or (isinstance(path, str) and not path.strip()):
            key = "checkpoint" if index is None else f"checkpoint[{index}]"
            raise UserError(key, "null" if path is None else path, SAY_WHAT)


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
    # `~` as the shell reads it unquoted (a quoted checkpoint='~/run' was no such directory).
    paths = [str(user_path(p)) for p in ([paths] if isinstance(paths, str) else paths)]
    if not paths:
        raise UserError("checkpoint", paths, "name at least one checkpoint, run or sweep dir")
    names = [names] if isinstance(names, str) else list(names or [])
    if any(not isinstance(name, str) or not name.strip() for name in names):
        # Served as "" (or " "), which /v1/models/{name} cannot address.
        raise UserError(
            "served_model_name", names, "give each checkpoint a name of some text, or null"
        )
    if names and len(names) != len(paths):
        raise UserError(
            "served_model_name", names, f"give one name per checkpoint ({len(paths)}) or null"
        )
    # The paths the operator named are trusted roots; what they lead to must stay inside.
    roots = [user_path(root).resolve() for root in [*allowed_roots, *paths]]
    chosen = [
        check_inside_roots(path, roots)
        for path in _choose_each(paths, checkpoint=checkpoint, metric=metric, mode=mode)
    ]
    if names:
        served = [ServedCheckpoint(n, p) for n, p in zip(names, chosen, strict=True)]
    else:
        served = _short_named(paths, chosen)
    if len({s.name for s in served}) != len(served):
        raise UserError(
            "served_model_name",
            names or [s.name for s in served],
            "each served checkpoint needs its own name: give one per checkpoint, "
            "e.g. served_model_name=[a,b]",
        )
    return served


def _choose_each(
    paths: list[str], *, checkpoint: str, metric: str | None, mode: str | None
) -> list[Path]:
    """`choose_checkpoint` of each path. Beside a sweep, whose runs select.metric ranks, a run
    dir served from its latest checkpoint ignores the metric with a warning, not an error; beside
    a run or sweep dir, a checkpoint dir is served as it is."""
    beside_a_sweep = (
        metric is not None and checkpoint != "best" and any(is_sweep_dir(Path(p)) for p in paths)
    )
    others = any(not is_checkpoint_dir(Path(p)) for p in paths)
    chosen = []
    for path in map(Path, paths):
        if others and is_checkpoint_dir(path):
            chosen.append(path)  # served as it is; select.* picks among the others
        elif beside_a_sweep and is_run_dir(path):
            log.warning(
                "select.metric=%s ranks the runs of a sweep: run dir %s serves its latest "
                "checkpoint (select.checkpoint=best picks a run's checkpoint by the metric)",
                metric,
                path,
            )
            chosen.append(choose_checkpoint(path, checkpoint=checkpoint, metric=None, mode=None))
        else:
            chosen.append(choose_checkpoint(path, checkpoint=checkpoint, metric=metric, mode=mode))
    return chosen


def _short_named(paths: list[str], chosen: list[Path]) -> list[ServedCheckpoint]:
    """Each checkpoint under its short name, and under its paths where no other is so named."""
    names = [short_name(path) for path in chosen]
    return [
        ServedCheckpoint(
            name,
            path,
            tuple(
                sorted({os.path.normpath(given), str(Path(given).resolve()), str(path)} - {*names})
            ),
        )
        for given, path, name in zip(paths, chosen, names, strict=True)
    ]


def choose_checkpoint(path: Path, *, checkpoint: str, metric: str | None, mode: str | None) -> Path:
    """The checkpoint dir that `path` stands for: itself, its run's pick, or its sweep's pick.

    metric None: what each run recorded as its best (its training objective); mode None: the
    recorded mode, or the known direction of `metric`.
    """
    if mode is not None and mode not in _MODES:
        raise UserError("select.mode", mode, "use min or max")
    if checkpoint not in _CHECKPOINT_CHOICES:
        raise UserError("select.checkpoint", checkpoint, "use latest or best")
    check_servable(path)
    if is_checkpoint_dir(path):
        if metric is not None or checkpoint == "best":
            # A checkpoint dir is served as it is: select.* would pick nothing, and a typo there
            # would go unseen.
            key, value = ("select.metric", metric) if metric else ("select.checkpoint", checkpoint)
            raise UserError(
                key,
                value,
                f"{path} is a checkpoint dir, served as it is: drop select.*, or pass its run "
                "dir to pick among the run's checkpoints",
            )
        return path
    # A status.json cut short (a full disk, a copy stopped midway) records no state or best:
    # such a run is named as one without it. (It served its latest, or said "recorded no best
    # checkpoint (unknown at step None)".)
    unreadable = is_run_dir(path) and RunDir(path).status().state == "unknown"
    if is_run_dir(path) and not unreadable:
        run = RunDir(path)
        if metric is not None and checkpoint != "best":
            # Without select.checkpoint=best a run dir serves its latest: no metric picks that.
            raise UserError(
                "select.metric",
                metric,
                f"{path} is a run dir, served from its latest checkpoint unless told "
                f"select.checkpoint=best: add select.checkpoint=best to pick its checkpoint by "
                f"{metric}, or drop select.metric",
            )
    elif is_sweep_dir(path):
        run = choose_run(path, sweep_runs(path), metric=metric, mode=mode)
    elif (latest := RunDir(path).latest_checkpoint()) is not None:
        # A run's directory without its status.json (a partial copy, a clean-up): no state or
        # best to pick by, but its checkpoints serve as they are.
        why = "cannot be read (cut short, or not runner's)" if unreadable else "is missing"
        raise UserError(
            "checkpoint",
            str(path),
            f"a run dir whose status.json {why}, so it has no recorded state or best to "
            f"pick by; name one of its checkpoints, e.g. its latest: "
            f"{pasteable('checkpoint', str(latest))}",
        )
    else:
        raise UserError(
            "checkpoint",
            str(path),
            "not a checkpoint dir (config.json), a run dir (status.json) or a sweep dir "
            f"({' or '.join(SWEEP_MARKERS)}, beside its run dirs 0/, 1/, ...): pass e.g. "
            "outputs/<date>/<time> or multirun/<date>/<time>",
        )
    if checkpoint == "best":
        return best_checkpoint(run, metric=metric, mode=mode)
    return latest_checkpoint(run)


def latest_checkpoint(run: RunDir) -> Path:
    """The whole checkpoint with the highest step."""
    latest = run.latest_checkpoint()
    if latest is None:
        raise UserError(
            "checkpoint",
            str(run.path),
            f"{run.without_checkpoint()}, or deploy another run",
        )
    return latest


def _mode_of(metric: str, mode: str | None) -> str:
    if mode is not None:
        return mode
    known = known_mode(metric)
    if known is None:
        raise UserError(
            "select.mode", mode, f"say whether {metric} is better lower or higher: min or max"
        )
    return known


def best_checkpoint(run: RunDir, *, metric: str | None, mode: str | None) -> Path:
    """The run's recorded best checkpoint, else the whole checkpoint whose step's eval line
    has the best `metric`."""
    if metric is None:
        chosen = run.best_checkpoint(None, mode)
        if chosen is None:
            recorded = run.best(None, mode)
            state, _ = run.effective_state()
            if recorded is not None:
                why = (
                    f"recorded its best at step {recorded['step']}, whose checkpoint is no "
                    "longer among its checkpoints (deleted, or set aside as damaged)"
                )
            else:
                at = f"{state} at step {run.status().step}"
                if state in ACTIVE_STATES:
                    why = f"has not recorded a best checkpoint yet ({at})"
                else:
                    why = f"recorded no best checkpoint ({at})"
            raise UserError(
                "select.checkpoint",
                "best",
                f"{run.path} {why}: select.checkpoint=latest serves its latest, or name a "
                "metrics.jsonl key to judge by, e.g. select.metric=loss",
            )
        return chosen
    check_recorded(metric, [run], f"{run.path}")
    chosen = run.best_checkpoint(metric, _mode_of(metric, mode))
    if chosen is None:
        raise UserError(
            "select.metric",
            metric,
            f"no checkpoint of {run.path} has an eval line with it: pick a metric that "
            "metrics.jsonl records at checkpoint steps, or select.checkpoint=latest",
        )
    return chosen


def check_recorded(metric: str, runs: list[RunDir], where: str) -> None:
    """Refuse a metric that none of `runs` recorded in metrics.jsonl, naming those they did."""
    recorded = sorted(set().union(*(run.metric_names() for run in runs)))
    if metric not in recorded:
        known = f"pick one of: {', '.join(recorded)}" if recorded else "none is recorded yet"
        raise UserError(
            "select.metric", metric, f"{where} never recorded it in metrics.jsonl; {known}"
        )


def choose_run(
    sweep_dir: Path, runs: list[RunDir], *, metric: str | None, mode: str | None
) -> RunDir:
    """The sweep's best run (`runner.rundir.best_run`) by `metric`, or by the metric its runs
    recorded their best by, which must be one."""
    if not any(run.status().state == "completed" and run.checkpoints() for run in runs):
        states = ", ".join(f"{run.path.name}: {run.status().state}" for run in runs) or "none"
        raise UserError(
            "checkpoint",
            str(sweep_dir),
            f"this sweep has no completed run with a checkpoint yet (its runs: {states}): wait "
            "for one, or serve one of its runs itself (SWEEP/<job>)",
        )
    if metric is None:
        recorded = {(b["metric"], b["mode"]) for run in runs if (b := run.best())}
        if len(recorded) != 1:
            raise UserError(
                "select.metric",
                metric,
                f"the runs of {sweep_dir} recorded their best by {sorted(recorded) or 'nothing'}: "
                "name the metric to rank them by, e.g. select.metric=eval_loss",
            )
        ((metric, recorded_mode),) = recorded
        mode = mode or recorded_mode
    else:
        check_recorded(metric, runs, f"the runs of {sweep_dir}")
    best = best_run(runs, metric, _mode_of(metric, mode))
    if best is None:
        raise UserError(
            "select.metric",
            metric,
            f"no completed run in {sweep_dir} has a checkpoint and a value for it in "
            "metrics.jsonl: pick another metric (e.g. loss or eval_loss) or wait for a run",
        )
    return best


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


def check_servable(path: Path) -> None:
    """`path` is a directory runner serves from (a checkpoint, run or sweep dir), or a
    UserError naming what it is instead."""
    if path.is_file() and path.suffix == ".gguf":
        raise UserError(
            "checkpoint",
            str(path),
            "a GGUF file is for llama.cpp (e.g. llama-server -m FILE), not for runner, which "
            "takes a checkpoint dir, a run dir or a sweep dir: pass the one it was exported from",
        )
    if not path.is_dir():
        found = "a file" if path.exists() else "no such directory"
        raise UserError(
            "checkpoint", str(path), f"{found}: pass a checkpoint dir, a run dir or a sweep dir"
        )
