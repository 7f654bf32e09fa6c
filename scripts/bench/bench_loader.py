"""Training tokens/s with 0, 1 and 2 DataLoader workers per process (dataset.num_workers).

    python scripts/bench/bench_loader.py [--device cpu] [--steps 60] [--repeats 3] [--workers 0 1 2]

Each arm is `runner train` on the embedded default (the tiny model on the sample task, whose
records are short, so that tokenizing is the largest share of a step it can be) with nothing
but dataset.num_workers changed, fp32 on the CPU (bf16_mixed on CUDA), no evaluation and no
checkpoint. The arms take turns --repeats times with the order rotated, so that a neighbour on
the machine hits all alike. tokens/s of a run is the median of its logged per-step figures after
the first 5 steps; the table gives the median over repeats and the range, and each arm's ratio
to 0 workers. The batches are the same in every arm (tests/test_loader.py).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

WARMUP = 5


def tokens_per_s(workers: int, args: argparse.Namespace, root: Path, repeat: int) -> float:
    run = root / f"w{workers}_r{repeat}"
    precision = ["compute=cpu", "dtype=fp32"] if args.device == "cpu" else ["compute=gpu"]
    command = [sys.executable, "-m", "runner", "train", *precision, f"max_steps={args.steps}"]
    command += [f"dataset.num_workers={workers}", "runtime.log_every_n_steps=1"]
    command += ["runtime.progress_bar=false", "runtime.save_every_n_steps=null"]
    command += ["eval.strategy=no", "dataset.eval_samples=0", f"hydra.run.dir={run}"]
    subprocess.run(command, check=True, capture_output=True, cwd=root)
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return statistics.median(line["tokens_per_s"] for line in lines if line["step"] > WARMUP)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 1, 2])
    args = parser.parse_args()
    if args.steps <= WARMUP:
        parser.error(
            f"--steps {args.steps}: at least {WARMUP + 1}, "
            f"the first {WARMUP} are warm-up, not timed"
        )
    arms = list(args.workers)
    figures: dict[int, list[float]] = {arm: [] for arm in arms}
    with tempfile.TemporaryDirectory() as scratch:
        for repeat in range(args.repeats):
            order = arms[repeat % len(arms) :] + arms[: repeat % len(arms)]
            for workers in order:
                figures[workers].append(tokens_per_s(workers, args, Path(scratch), repeat))
    base = statistics.median(figures[arms[0]])
    print(f"device {args.device}, {args.steps} steps, {args.repeats} repeats (median [range])")
    print(f"{'num_workers':>11}  {'tokens/s':>22}  ratio to {arms[0]}")
    for workers in arms:
        values = figures[workers]
        median = statistics.median(values)
        spread = f"{median:8.0f} [{min(values):.0f}-{max(values):.0f}]"
        print(f"{workers:>11}  {spread:>22}  {median / base:.2f}")


if __name__ == "__main__":
    main()
