"""`runner train compile=true` beside the same run eager, on rows of several samples, in one run.

    python scripts/bench/bench_compile.py [--layout packing] [--repeats 3] [--steps 8]
        [--warmup 3] [--batch-size 4] [--seq-len 1024] [--device cpu]

Each arm is `runner train` on the tiny model and the sample data (fp32 on the CPU), its
subprocess of its own, the arms taking turns --repeats times (eager, compiled, eager, compiled,
...: a neighbour on the machine hits both alike). --layout packing: dataset.packing=true
(PackedDataset's packs of --seq-len tokens, --batch-size packs a step); padding-free: the
default, each batch of --batch-size samples in rows. tokens/s: the steps after --warmup (the
compiled arm's first steps compile), from the run's metrics.jsonl (each step logged); peak RSS
from os.wait4. With TORCH_LOGS unset, the compiled arm's graph breaks and recompiles are
counted from its train.log line. Prints each
repeat, then the median and range of each arm and compiled/eager.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def overrides(args: argparse.Namespace, compile: bool, run: Path) -> list[str]:
    """The arm's command line beside `runner train`."""
    layout = (
        [
            "dataset.packing=true",
            f"dataset.max_seq_len={args.seq_len}",
        ]
        if args.layout == "packing"
        else []
    )
    return [
        f"compute={args.device}",
        "dtype=fp32",
        f"compile={str(compile).lower()}",
        *layout,
        f"batch_size={args.batch_size}",
        f"max_steps={args.warmup + args.steps}",
        "runtime.log_every_n_steps=1",
        "runtime.save_every_n_steps=null",
        "runtime.progress_bar=false",
        "runtime.loggers=[]",
        "eval.strategy=no",
        "dataset.eval_samples=0",
        f"hydra.run.dir={run}",
    ]


def run_arm(args: argparse.Namespace, compile: bool, run: Path) -> dict[str, float]:
    """One arm's run: tokens/s after the warm-up, the first step's seconds, peak RSS (MiB)."""
    command = [sys.executable, "-m", "runner", "train", *overrides(args, compile, run)]
    started = time.perf_counter()
    with (run.parent / f"{run.name}.log").open("w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
        _, status, usage = os.wait4(process.pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{' '.join(command)} failed; see {run.parent / run.name}.log")
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in metrics if "tokens_per_s" in m]
    timed = [m["tokens_per_s"] for m in steps if m["step"] > args.warmup]
    # Every step carries about the same tokens: the rate over the steps is the harmonic mean.
    figures = {
        "tokens_per_s": len(timed) / sum(1 / rate for rate in timed),
        "first_step_tokens_per_s": steps[0]["tokens_per_s"],
        "peak_rss_mib": usage.ru_maxrss / 1024,
        "seconds": time.perf_counter() - started,
    }
    found = re.search(r"(\d+) graph breaks, (\d+) graphs compiled", (run / "train.log").read_text())
    if found:
        figures["graph_breaks"], figures["graphs_compiled"] = float(found[1]), float(found[2])
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layout", choices=["packing", "padding-free"], default="packing")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8, help="timed steps after the warm-up")
    parser.add_argument("--warmup", type=int, default=3, help="steps not timed")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=1024, help="tokens a pack (packing)")
    parser.add_argument("--device", choices=["cpu", "gpu"], default="cpu")
    args = parser.parse_args()
    if args.steps < 1:
        parser.error(
            f"--steps {args.steps}: at least 1, the steps timed after --warmup's {args.warmup}"
        )
    print(f"bench_compile: {vars(args)}, {os.cpu_count()} cores", flush=True)
    results: dict[str, list[dict[str, float]]] = {"eager": [], "compiled": []}
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            for arm in results:
                run = Path(tmp) / f"{arm}_{repeat}"
                figures = run_arm(args, arm == "compiled", run)
                results[arm].append(figures)
                shown = ", ".join(f"{key} {value:,.1f}" for key, value in figures.items())
                print(f"repeat {repeat} {arm}: {shown}", flush=True)
    medians = {}
    for arm, runs in results.items():
        rates = sorted(r["tokens_per_s"] for r in runs)
        medians[arm] = statistics.median(rates)
        rss = statistics.median(r["peak_rss_mib"] for r in runs)
        print(
            f"{arm:9} tokens/s median {medians[arm]:,.0f} (range {rates[0]:,.0f}-{rates[-1]:,.0f})"
            f" after {args.warmup} warm-up steps; peak RSS median {rss:,.0f} MiB"
        )
    print(f"compiled/eager: {medians['compiled'] / medians['eager']:.2f}")


if __name__ == "__main__":
    main()
