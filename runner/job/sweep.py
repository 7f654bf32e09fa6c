"""Sweep summaries: a table of a multirun's jobs, the best one, and a plot of their loss curves.

The summary is rewritten as each job ends (SweepSummary.on_job_end) and once more, printed,
when the sweep ends, and again when a job is resumed on its own (refresh_sweep_of); it is built
from the run directories alone.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import yaml
from hydra.core.hydra_config import HydraConfig
from hydra.errors import HydraException
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from runner.config.fields import as_typed, override_key, parsed_overrides
from runner.console import takeable
from runner.errors import UserError, user_errors_pass_hydra
from runner.job.lifecycle import request_stop
from runner.job.sweep_start import check_sweep, make_sweep_dir
from runner.rundir import (
    ACTIVE_STATES,
    SUMMARY_JSON,
    RunDir,
    best_run,
    hold_until_exit,
    is_sweep_dir,
    sweep_runs,
    write_json_atomic,
    write_text_atomic,
)
from runner.trainer.parent import STOP_SIGNALS

SUMMARY_TABLE = "summary.md"
LOSS_PLOT = "loss_curves.png"
# The sweep's own process, which its jobs' processes (a parallel launcher's workers) inherit:
# a job stopped there ends as a cancelled run, and the sweep's own process ends the sweep.
SWEEP_PID_ENV = "RUNNER_SWEEP_PID"
# Written in the sweep directory by a parallel sweep told to stop (the signal's number): its
# jobs not yet started start no training, and the sweep exits 128 + that number.
STOP_FILE = ".stopping"


def job_row(run: RunDir, metric: str) -> dict[str, Any]:
    """What the summary says of one job, read from its run directory."""
    status = run.status()
    overrides_file = run.path / ".hydra" / "overrides.yaml"
    overrides = yaml.safe_load(overrides_file.read_text()) if overrides_file.exists() else []
    losses = list(run.losses().values())
    # The run's recorded best by `metric` (its objective), else the last value of it.
    scored = run.objective_value(metric)
    checkpoint = run.checkpoint_path(scored[1]) if scored else None
    return {
        "job": run.path.name,
        "run_dir": str(run.path),
        "overrides": overrides,
        "state": status.state,
        "error": status.error,
        "step": status.step,
        "total_steps": status.total_steps,
        "final_loss": losses[-1] if losses else None,
        "metric": scored[0] if scored else None,
        "metric_step": scored[1] if scored else None,
        "metric_checkpoint": str(checkpoint) if checkpoint and checkpoint.is_dir() else None,
        "duration_s": status.seconds(),
    }


def summarize(sweep_dir: Path, metric: str, mode: str) -> dict[str, Any]:
    """Rows for every job directory of a sweep, the best run by `metric` (`best_run`), and how
    many jobs the sweep has (None where that is not known ahead: Optuna's trials)."""
    runs = sweep_runs(sweep_dir)
    rows = [job_row(run, metric) for run in runs]
    best = best_run(runs, metric, mode)
    return {
        "sweep_dir": str(sweep_dir),
        "metric": metric,
        "mode": mode,
        "best": rows[runs.index(best)] if best is not None else None,
        "failed": sum(r["state"] == "failed" for r in rows),
        "jobs": _grid_size(sweep_dir),
        "runs": rows,
    }


def _grid_size(sweep_dir: Path) -> int | None:
    """The number of jobs of a grid sweep, from Hydra's record of it (multirun.yaml): the
    product of its swept values' counts; None for another sweeper, or no record."""
    record = sweep_dir / "multirun.yaml"
    if not record.is_file():
        return None
    hydra = OmegaConf.load(record).hydra
    if "BasicSweeper" not in str(hydra.sweeper.get("_target_", "")):
        return None
    size = 1
    for override in parsed_overrides(as_typed(hydra.overrides.task)):
        if override.is_sweep_override():
            try:
                size *= len(list(override.sweep_string_iterator()))
            except HydraException:  # glob() where this process has no Hydra of its own
                return None
    return size


def exit_code(sweep_dir: Path) -> int:
    """What `runner train -m` exits with: the number of failed jobs its summary.json records."""
    summary = json.loads((sweep_dir / SUMMARY_JSON).read_text())
    failed: int = summary["failed"]
    return min(failed, 255)


def _fmt(value: Any, digits: int = 4) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return "nan" if math.isnan(value) else f"{value:.{digits}g}"
    return str(value)


def _varying(summary: dict[str, Any]) -> dict[str, str]:
    """Each job's overrides less those of the keys the sweep's command fixed, and those every
    job shares: what the sweep varied (a sweep stopped after its first job has one row, which
    shares all of its overrides with itself)."""
    rows = summary["runs"]
    record = Path(summary["sweep_dir"]) / "multirun.yaml"
    fixed: set[str] = set()
    if record.is_file():
        given = parsed_overrides(as_typed(OmegaConf.load(record).hydra.overrides.task))
        fixed = {o.key_or_group for o in given if not o.is_sweep_override()}
    shared = set.intersection(*(set(r["overrides"]) for r in rows)) if len(rows) > 1 else set()
    return {
        r["job"]: " ".join(
            o for o in r["overrides"] if o not in shared and override_key(o) not in fixed
        )
        for r in rows
    }


def table(summary: dict[str, Any]) -> str:
    """The summary as a Markdown table (printed at the end of a sweep)."""
    head = ["job", "overrides", "state", "step", "final loss", summary["metric"], "seconds"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    varying = _varying(summary)
    for r in summary["runs"]:
        step = f"{_fmt(r['step'])}/{_fmt(r['total_steps'])}"
        cells = [
            r["job"],
            varying[r["job"]],
            r["state"],
            step,
            _fmt(r["final_loss"]),
            _fmt(r["metric"]),
            _fmt(r["duration_s"], 3),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    best = summary["best"]
    if best:
        lines.append(
            f"\nbest by {summary['metric']} ({summary['mode']}): job {best['job']} "
            f"({varying[best['job']]}), checkpoint {best['metric_checkpoint']}"
        )
    for r in summary["runs"]:
        if r["state"] == "failed":
            lines.append(f"job {r['job']} failed: {r['error']}")
    jobs, ran = summary.get("jobs"), len(summary["runs"])
    if jobs is not None and ran < jobs:
        # A sweep stopped midway read as a finished one, its best chosen among the jobs run.
        best_of = f" (the best is of the {ran} that have)" if best else ""
        each_on = "".join(
            f", job {r['job']} {_goes_on_from(RunDir(r['run_dir']))}"
            for r in summary["runs"]
            if r["state"] == "cancelled"
        )
        lines.append(
            f"{jobs - ran} of {jobs} jobs not started{best_of}; a sweep stopped before them "
            f"goes on by its own command with hydra.sweep.dir={summary['sweep_dir']}{each_on}"
        )
    return "\n".join(lines)


def _goes_on_from(run: RunDir) -> str:
    """Where a stopped job goes on as its sweep runs again: its newest checkpoint, or step 0
    where it saved none (stopped before its first step, or its checkpoints since removed)."""
    saved = run.checkpoints()
    return f"from its checkpoint of step {saved[-1][0]}" if saved else "from step 0 (no checkpoint)"


def plot_losses(sweep_dir: Path, summary: dict[str, Any]) -> Path | None:
    """A PNG of every job's training loss against its step; None where no job logged one (all
    failed at their checks): an empty plot, and matplotlib's "No artists with labels found to
    put in legend" on the console."""
    curves = {
        row["job"]: sorted(RunDir(row["run_dir"]).losses().items()) for row in summary["runs"]
    }
    if not any(curves.values()):
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    varying = _varying(summary)
    for job, points in curves.items():
        if points:
            ax.plot(*zip(*points, strict=True), label=f"{job}: {varying[job]}")
    ax.set(xlabel="step", ylabel="training loss", yscale="log", title=str(sweep_dir))
    ax.legend(fontsize="small")
    fig.tight_layout()
    out = sweep_dir / LOSS_PLOT
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def write_summary(sweep_dir: Path, metric: str, mode: str) -> dict[str, Any]:
    summary = summarize(sweep_dir, metric, mode)
    # Both under names of this process's own: the jobs of a parallel sweep write them at once,
    # and one's rename took the other's file (a FileNotFoundError that failed the sweep).
    write_json_atomic(sweep_dir / SUMMARY_JSON, summary)
    write_text_atomic(sweep_dir / SUMMARY_TABLE, table(summary) + "\n")
    return summary


def refresh_sweep_of(run_dir: Path) -> None:
    """A sweep's job trained again on its own (`runner resume SWEEP/N`): the sweep's summary
    and plot say where its jobs now stand, ranked as the sweep ranked them."""
    sweep_dir = run_dir.parent
    if (sweep_dir / SUMMARY_JSON).is_file():
        recorded = json.loads((sweep_dir / SUMMARY_JSON).read_text())
        metric, mode = recorded["metric"], recorded["mode"]
    elif is_sweep_dir(sweep_dir) and RunDir(run_dir).recipe_path.is_file():
        # Its process was killed before its first job ended, and wrote none: the job's own
        # objective, which that process would have ranked it by.
        objective = yaml.safe_load(RunDir(run_dir).recipe_path.read_text())["objective"]
        metric, mode = objective["metric"], objective["mode"]
    else:
        return  # not a sweep's job
    summary = write_summary(sweep_dir, metric, mode)
    plot_losses(sweep_dir, summary)


def in_sweep_process() -> bool:
    """Whether this process is the sweep's own (its jobs run here one after another), not one
    of a parallel launcher's workers."""
    return os.environ.get(SWEEP_PID_ENV, str(os.getpid())) == str(os.getpid())


def stopping(sweep_dir: Path) -> bool:
    """Whether a parallel sweep has been told to stop (its jobs not yet started start none)."""
    return (sweep_dir / STOP_FILE).is_file()


def _stop_parallel_jobs_on_signals(sweep_dir: Path) -> None:
    """A parallel sweep's own process told to stop (Ctrl-C, SIGTERM) stops every job running
    as `runner stop` does, each saving a checkpoint and ending cancelled, starts no other, and
    then ends as a sequential sweep does (SweepSummary.on_multirun_end). Left to joblib, Ctrl-C
    killed the jobs without a checkpoint, and SIGTERM left them training on as orphans. A
    second signal ends it at once."""

    def on_signal(signum: int, frame: Any) -> None:
        if stopping(sweep_dir):
            for other in STOP_SIGNALS:
                signal.signal(other, signal.SIG_DFL)
            signal.signal(signal.SIGINT, signal.default_int_handler)
            signal.raise_signal(signum)
            return
        (sweep_dir / STOP_FILE).write_text(f"{signum}\n")
        name = signal.Signals(signum).name
        print(f"{name}: stopping the sweep's running jobs, starting no other", file=sys.stderr)
        threading.Thread(target=_stop_jobs, args=(sweep_dir,), daemon=True).start()

    _trackers_outlive_a_hangup()
    for signum in takeable(STOP_SIGNALS):
        signal.signal(signum, on_signal)


def _trackers_outlive_a_hangup() -> None:
    """joblib's and multiprocessing's resource trackers, started here with SIGHUP ignored (which
    stays so across their exec). They ignore SIGINT and SIGTERM themselves, not SIGHUP: a closed
    terminal's hangup killed them while the sweep stopped its jobs, and each job's end printed
    their KeyError tracebacks and "resource_tracker: process died unexpectedly"."""
    from multiprocessing import resource_tracker

    from joblib.externals.loky.backend import resource_tracker as loky_tracker

    before = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        resource_tracker.ensure_running()
        loky_tracker.ensure_running()
    finally:
        signal.signal(signal.SIGHUP, before)


def _stop_jobs(sweep_dir: Path) -> None:
    """Stops each job of the sweep that runs, and each that starts after (one that had passed
    its check of STOP_FILE as the signal came), until the sweep's process ends."""
    stopped: set[Path] = set()
    while True:
        for run in sweep_runs(sweep_dir):
            if run.path not in stopped and run.status().state in ACTIVE_STATES:
                with contextlib.suppress(UserError, ProcessLookupError):
                    request_stop(run)
                    stopped.add(run.path)
        time.sleep(0.2)


class SweepSummary(Callback):
    """Hydra callback: checks an Optuna sweep's direction, keeps the sweep directory's summary
    current, prints it at the end; stops a parallel sweep's jobs as a signal asks."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        # Hydra turns an Exception of a callback into a warning; a UserErrorExit ends the run.
        parallel = "joblib" in str(config.hydra.launcher.get("_target_", ""))
        with user_errors_pass_hydra():
            check_sweep(config)
            make_sweep_dir(config)
        # Until this process ends, its sweep runs: a handle on the directory waits on it. Taken
        # once the checks above passed: runner.api's sweep returns then, and not before.
        hold_until_exit(Path(config.hydra.sweep.dir))
        os.environ[SWEEP_PID_ENV] = str(os.getpid())
        if parallel:
            sweep_dir = Path(config.hydra.sweep.dir)
            sweep_dir.mkdir(parents=True, exist_ok=True)
            (sweep_dir / STOP_FILE).unlink(missing_ok=True)  # a sweep stopped before, again
            _stop_parallel_jobs_on_signals(sweep_dir)

    def on_job_end(self, config: DictConfig, job_return: Any, **kwargs: Any) -> None:
        if HydraConfig.get().mode == RunMode.MULTIRUN:
            sweep_dir = Path(HydraConfig.get().sweep.dir)
            write_summary(sweep_dir, config.objective.metric, config.objective.mode)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        summary = write_summary(sweep_dir, config.objective.metric, config.objective.mode)
        plot = plot_losses(sweep_dir, summary)
        print(table(summary))
        drawn = plot or "none (no job logged a training loss)"
        print(f"sweep directory: {sweep_dir}\nsummary: {sweep_dir / SUMMARY_TABLE}\nplot: {drawn}")
        # Hydra's multirun returns nothing to its caller: the sweep's exit code leaves from here.
        code = exit_code(sweep_dir)
        if stopping(sweep_dir):  # a parallel sweep stopped: as the signal's sequential one
            code = 128 + int((sweep_dir / STOP_FILE).read_text())
            (sweep_dir / STOP_FILE).unlink()
        if code:
            raise SystemExit(code)
