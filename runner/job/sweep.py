"""Sweep summaries: a table of a multirun's jobs, the best one, and a plot of their loss curves.

The summary is rewritten as each job ends (SweepSummary.on_job_end) and once more, printed,
when the sweep ends, and again when a job is resumed on its own (refresh_sweep_of); it is built
from the run directories alone.
"""

from __future__ import annotations

import json
import math
from datetime import datetime
from pathlib import Path
from typing import Any

import yaml
from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig

from runner.errors import UserError, user_errors_pass_hydra
from runner.rundir import SUMMARY_JSON, RunDir, Status, best_run, sweep_runs, write_json_atomic

SUMMARY_TABLE = "summary.md"
LOSS_PLOT = "loss_curves.png"


def _duration_s(status: Status) -> float | None:
    if not (status.started_at and status.ended_at):
        return None
    start, end = (datetime.fromisoformat(t) for t in (status.started_at, status.ended_at))
    return (end - start).total_seconds()


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
        "duration_s": _duration_s(status),
    }


def summarize(sweep_dir: Path, metric: str, mode: str) -> dict[str, Any]:
    """Rows for every job directory of a sweep, and the best run by `metric` (`best_run`)."""
    runs = sweep_runs(sweep_dir)
    rows = [job_row(run, metric) for run in runs]
    best = best_run(runs, metric, mode)
    return {
        "sweep_dir": str(sweep_dir),
        "metric": metric,
        "mode": mode,
        "best": rows[runs.index(best)] if best is not None else None,
        "failed": sum(r["state"] == "failed" for r in rows),
        "runs": rows,
    }


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


def _varying(rows: list[dict[str, Any]]) -> dict[str, str]:
    """Each job's overrides less those every job shares: what the sweep varied."""
    common = set.intersection(*(set(r["overrides"]) for r in rows)) if len(rows) > 1 else set()
    return {r["job"]: " ".join(o for o in r["overrides"] if o not in common) for r in rows}


def table(summary: dict[str, Any]) -> str:
    """The summary as a Markdown table (printed at the end of a sweep)."""
    head = ["job", "overrides", "state", "step", "final loss", summary["metric"], "seconds"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    varying = _varying(summary["runs"])
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
    return "\n".join(lines)


def plot_losses(sweep_dir: Path, summary: dict[str, Any]) -> Path:
    """A PNG of every job's training loss against its step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    varying = _varying(summary["runs"])
    for row in summary["runs"]:
        points = sorted(RunDir(row["run_dir"]).losses().items())
        if points:
            ax.plot(*zip(*points, strict=True), label=f"{row['job']}: {varying[row['job']]}")
    ax.set(xlabel="step", ylabel="training loss", yscale="log", title=str(sweep_dir))
    ax.legend(fontsize="small")
    fig.tight_layout()
    out = sweep_dir / LOSS_PLOT
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def write_summary(sweep_dir: Path, metric: str, mode: str) -> dict[str, Any]:
    summary = summarize(sweep_dir, metric, mode)
    write_json_atomic(sweep_dir / SUMMARY_JSON, summary)
    tmp = sweep_dir / f".{SUMMARY_TABLE}.tmp"
    tmp.write_text(table(summary) + "\n")
    tmp.replace(sweep_dir / SUMMARY_TABLE)
    return summary


def refresh_sweep_of(run_dir: Path) -> None:
    """A sweep's job trained again on its own (`runner resume SWEEP/N`): the sweep's summary
    and plot say where its jobs now stand, ranked as the sweep ranked them."""
    sweep_dir = run_dir.parent
    if not (sweep_dir / SUMMARY_JSON).is_file():
        return  # not a sweep's job, or one that ended before its first job did
    recorded = json.loads((sweep_dir / SUMMARY_JSON).read_text())
    summary = write_summary(sweep_dir, recorded["metric"], recorded["mode"])
    plot_losses(sweep_dir, summary)


# objective.mode as Optuna's sweeper names the same direction.
OPTUNA_DIRECTIONS = {"min": "minimize", "max": "maximize"}
HIGHER_OR_LOWER = {"min": "lower", "max": "higher"}


def check_direction(sweeper: DictConfig, objective: DictConfig) -> None:
    """An Optuna sweep (a sweeper with a direction) optimizes what each job returns, its
    objective.metric: in the direction of objective.mode, or it would seek the worst job."""
    if "direction" not in sweeper:
        return  # Hydra's basic sweeper: the summary ranks by objective.mode
    direction = sweeper.direction
    direction = getattr(direction, "name", direction)  # Optuna's Direction enum, or its name
    wanted = OPTUNA_DIRECTIONS[objective.mode]
    other = "max" if objective.mode == "min" else "min"
    if direction != wanted:
        raise UserError(
            "hydra.sweeper.direction",
            direction if isinstance(direction, str) else list(direction),
            f"the jobs return {objective.metric}, which objective.mode={objective.mode} says is "
            f"better {HIGHER_OR_LOWER[objective.mode]}; set hydra.sweeper.direction={wanted} "
            f"(or objective.mode={other}, if it is better {HIGHER_OR_LOWER[other]})",
        )


class SweepSummary(Callback):
    """Hydra callback: checks an Optuna sweep's direction, keeps the sweep directory's summary
    current, prints it at the end."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        # Hydra turns an Exception of a callback into a warning; a UserErrorExit ends the run.
        with user_errors_pass_hydra():
            check_direction(config.hydra.sweeper, config.objective)

    def on_job_end(self, config: DictConfig, job_return: Any, **kwargs: Any) -> None:
        if HydraConfig.get().mode == RunMode.MULTIRUN:
            sweep_dir = Path(HydraConfig.get().sweep.dir)
            write_summary(sweep_dir, config.objective.metric, config.objective.mode)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        summary = write_summary(sweep_dir, config.objective.metric, config.objective.mode)
        plot = plot_losses(sweep_dir, summary)
        print(table(summary))
        print(f"sweep directory: {sweep_dir}\nsummary: {sweep_dir / SUMMARY_TABLE}\nplot: {plot}")
        # Hydra's multirun returns nothing to its caller: the sweep's exit code leaves from here.
        code = exit_code(sweep_dir)
        if code:
            raise SystemExit(code)
