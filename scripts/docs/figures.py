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
  overrides (from the sweep's summary.json);
- docs/images/bench_peers.png: each arm's tokens/s (median and range over repeats) and runner's
  ratio to it, from the figures a real run of scripts/bench/bench_peers.py wrote
  (docs/data/bench_peers.json, refreshed by `python scripts/bench/bench_peers.py --json
  docs/data/bench_peers.json`: that run takes a quarter of an hour, so this script draws the
  recorded one rather than running it).
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

DOCS = Path(__file__).resolve().parents[2] / "docs"
IMAGES = DOCS / "images"
BENCH_PEERS = DOCS / "data" / "bench_peers.json"
# bench_peers' arms as its table names them, in the order drawn (top to bottom).
PEER_LABELS = {
    "runner": "runner train",
    "compiled": "runner train compile=true",
    "bare": "bare loop, runner's batches",
    "tune_best": "torchtune, packed, fused AdamW",
    "tune_default": "torchtune, its defaults",
    "hf_best": "HF Trainer, flattened, fused AdamW",
    "hf_default": "HF Trainer, its defaults",
    "padded": "runner train, padded batches",
    "capped": "runner train, capped forward",
}
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


def draw_bench_peers(figures: Path, out: Path) -> None:
    """Each arm's tokens/s, its range whiskered, labelled with runner's ratio to it."""
    record = json.loads(figures.read_text())
    arms = [arm for arm in PEER_LABELS if arm in record["arms"]]
    rows = [record["arms"][arm] for arm in arms]
    ours = record["arms"]["runner"]["tokens_s"]
    fig, ax = plt.subplots(figsize=(8, 0.45 * len(arms) + 1.6), dpi=110)
    y = list(range(len(arms)))[::-1]
    medians = [row["tokens_s"] for row in rows]
    whiskers = [
        [m - row["low"] for m, row in zip(medians, rows, strict=True)],
        [row["high"] - m for m, row in zip(medians, rows, strict=True)],
    ]
    colors = ["tab:blue" if arm in ("runner", "compiled") else "tab:gray" for arm in arms]
    ax.barh(y, medians, xerr=whiskers, color=colors, capsize=3)
    for row_y, arm, row in zip(y, arms, rows, strict=True):
        ratio = "" if arm == "runner" else f", ours/{arm} {ours / row['tokens_s']:.2f}"
        ax.text(row["high"], row_y, f"  {row['tokens_s']:,.0f}{ratio}", va="center", fontsize=8)
    ax.set_yticks(y, [PEER_LABELS[arm] for arm in arms], fontsize=8)
    ax.set_xlabel("tokens/s (median of repeats; whiskers: range)")
    ax.set_xlim(0, max(row["high"] for row in rows) * 1.45)
    ax.set_title(f"{record['command']}  ({record['date']})", fontsize=8)
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--default-run", type=Path, help="a run of the default; else train one")
    parser.add_argument("--sweep-dir", type=Path, help="a sweep directory; else run the sweep")
    parser.add_argument("--out", type=Path, default=IMAGES, help="where the PNGs go")
    parser.add_argument("--keep", type=Path, help="train into this directory and keep the runs")
    parser.add_argument(
        "--bench-peers", type=Path, default=BENCH_PEERS, help="bench_peers.py --json's figures"
    )
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
    draw_bench_peers(args.bench_peers, args.out / "bench_peers.png")
    print(f"wrote default_run.png, sweep.png and bench_peers.png in {args.out}")


if __name__ == "__main__":
    main()
