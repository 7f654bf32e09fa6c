"""Redraw the docs' pictures from real runs: one command, `python scripts/docs/figures.py`.

    python scripts/docs/figures.py                                  # train both, then draw
    python scripts/docs/figures.py --default-run RUN --sweep-dir SWEEP   # draw from runs you have

Without --default-run it trains the embedded default (`runner train seed=0`, about 2 minutes on
two CPU cores); without --sweep-dir it runs a small learning-rate sweep (`runner train -m
optimizer.lr=... max_steps=150`, a few minutes). Both go through the real CLI, in a temporary
directory (--keep DIR: in DIR, kept), in fresh processes. It writes, from each run's metrics.jsonl:

- docs/images/default_run.png: the training loss, and the held-out token accuracy and exact
  match of each evaluation, over the steps of the default run;
- docs/images/sweep.png: each sweep job's training loss over its steps, labelled by its
  overrides (from the sweep's summary.json).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # no display: the figures go to files
import matplotlib.pyplot as plt  # noqa: E402

IMAGES = Path(__file__).resolve().parents[2] / "docs" / "images"
# A sweep small enough to run in minutes: three learning rates around the default's (1e-3),
# 150 steps each, evaluated once at the end on 50 held-out prompts.
# Every run here logs lines, not a progress bar (its output is kept for a failure's message).
QUIET_KEY = "runtime.progress_bar="
QUIET = QUIET_KEY + "false"
SWEEP_OVERRIDES = [
    "optimizer.lr=3e-4,1e-3,3e-3",
    "max_steps=150",
    "eval.steps=150",
    "dataset.eval_samples=50",
]


def runner(args: list[str]) -> None:
    """One `runner` command in a fresh process; its failure ends this script with its output."""
    command = [sys.executable, "-m", "runner", *args, QUIET]
    print("$", " ".join(command[2:]), flush=True)
    proc = subprocess.run(command, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"failed (exit {proc.returncode}):\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")


def metrics(run_dir: Path) -> list[dict]:
    """The run's metrics.jsonl records (a run directory's contract: every run writes it)."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        sys.exit(f"{run_dir}: no metrics.jsonl; give a runner run directory")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    """Steps and values of one metric, in step order."""
    points = sorted((r["step"], r[key]) for r in records if key in r)
    return [s for s, _ in points], [v for _, v in points]


def draw_default(run_dir: Path, out: Path) -> None:
    records = metrics(run_dir)
    fig, loss_ax = plt.subplots(figsize=(8, 4.2), dpi=110)
    steps, loss = series(records, "loss")
    loss_ax.plot(steps, loss, color="tab:blue", linewidth=1, label="training loss")
    loss_ax.set_yscale("log")
    loss_ax.set_xlabel("optimizer step")
    loss_ax.set_ylabel("training loss (log scale)", color="tab:blue")
    score_ax = loss_ax.twinx()
    for key, label, color in (
        ("eval_token_accuracy", "held-out token accuracy", "tab:orange"),
        ("eval_exact_match", "held-out exact match", "tab:green"),
    ):
        steps, values = series(records, key)
        score_ax.plot(steps, [100 * v for v in values], "o-", color=color, label=label)
    score_ax.set_ylim(0, 105)
    score_ax.set_ylabel("held-out score (%)")
    handles = loss_ax.get_legend_handles_labels()[0] + score_ax.get_legend_handles_labels()[0]
    # Below the axes: inside, it would cover the loss curve or the scores somewhere.
    fig.legend(handles=handles, loc="lower center", ncol=3, frameon=False)
    loss_ax.set_title("runner train (model=tiny, dataset=sample, seed 0)")
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(out)
    plt.close(fig)


def sweep_jobs(sweep_dir: Path) -> tuple[list[str], list[tuple[str, Path]]]:
    """The overrides every job shares, and each job's label (the overrides it does not share,
    and its objective's value) and run directory, in job order, from the sweep's summary.json."""
    summary = sweep_dir / "summary.json"
    if not summary.is_file():
        sys.exit(f"{sweep_dir}: no summary.json; give the directory of a `runner train -m` sweep")
    record = json.loads(summary.read_text())
    rows = record["runs"]
    common = set.intersection(*(set(r["overrides"]) for r in rows)) if len(rows) > 1 else set()
    # This script's own override says nothing of the sweep.
    shared = (
        [o for o in rows[0]["overrides"] if o in common and not o.startswith(QUIET_KEY)]
        if rows
        else []
    )
    jobs = []
    for row in rows:
        label = " ".join(o for o in row["overrides"] if o not in common)
        if row["metric"] is not None:
            label += f" ({record['metric']} {row['metric']:.3g})"
        jobs.append((label, Path(row["run_dir"])))
    return shared, jobs


def draw_sweep(sweep_dir: Path, out: Path) -> None:
    shared, jobs = sweep_jobs(sweep_dir)
    fig, ax = plt.subplots(figsize=(8, 4.2), dpi=110)
    for label, run_dir in jobs:
        steps, loss = series(metrics(run_dir), "loss")
        ax.plot(steps, loss, linewidth=1.2, label=label)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("training loss")
    ax.set_title("runner train -m ..., each job with " + " ".join(shared), fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--default-run", type=Path, help="a run of the default; else train one")
    parser.add_argument("--sweep-dir", type=Path, help="a sweep directory; else run the sweep")
    parser.add_argument("--out", type=Path, default=IMAGES, help="where the PNGs go")
    parser.add_argument("--keep", type=Path, help="train into this directory and keep the runs")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="runner-figures-") as scratch:
        tmp = args.keep or Path(scratch)
        default_run = args.default_run or Path(tmp) / "default"
        if args.default_run is None:
            runner(["train", "seed=0", f"hydra.run.dir={default_run}"])
        sweep_dir = args.sweep_dir or Path(tmp) / "sweep"
        if args.sweep_dir is None:
            runner(["train", "-m", *SWEEP_OVERRIDES, f"hydra.sweep.dir={sweep_dir}"])
        draw_default(default_run, args.out / "default_run.png")
        draw_sweep(sweep_dir, args.out / "sweep.png")
    print(f"wrote {args.out / 'default_run.png'} and {args.out / 'sweep.png'}")


if __name__ == "__main__":
    main()
