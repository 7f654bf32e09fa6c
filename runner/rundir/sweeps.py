"""A sweep directory: the run directories of one multirun, and which of them is the best."""

from __future__ import annotations

import math
from pathlib import Path

from runner.paths import shell_path
from runner.rundir.run import RunDir, best_key, is_run_dir

# A sweep's summary of its jobs (runner.job.sweep writes it as each job ends).
SUMMARY_JSON = "summary.json"
# What marks a sweep directory: Hydra's basic sweeper writes multirun.yaml there as the sweep
# starts; a sweeper that does not (Optuna's) leaves runner's summary.json there as its first
# job ends.
SWEEP_MARKERS = ("multirun.yaml", SUMMARY_JSON)


def is_sweep_dir(path: Path) -> bool:
    """Whether `path` is a sweep directory (multirun.yaml or summary.json), not any folder of
    run directories."""
    return any((path / name).is_file() for name in SWEEP_MARKERS)


def sweep_runs(sweep_dir: Path) -> list[RunDir]:
    """The run directories directly inside a sweep directory, in job order (0, 1, ..., 10)."""
    jobs = [child for child in sweep_dir.iterdir() if child.is_dir() and is_run_dir(child)]
    jobs.sort(key=lambda p: (not p.name.isdigit(), int(p.name) if p.name.isdigit() else p.name))
    return [RunDir(job) for job in jobs]


def its_jobs_instead(path: Path) -> str | None:
    """What a command that takes a run says of a sweep directory given instead: a sweep's, and
    its jobs to give; None where `path` is no sweep's, or holds no job yet."""
    jobs = sweep_runs(path) if is_sweep_dir(path) else []
    if not jobs:
        return None
    return (
        f"a sweep directory, not a run: give one of its jobs ({shell_path(jobs[0].path)}, ...; "
        f"`runner runs {shell_path(path)}` lists them)"
    )


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
    best = best_key(scores, mode)
    return runs[best] if best is not None else None
