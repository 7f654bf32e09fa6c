"""Does the embedded default learn its task every time? `runner train` per seed, each scored.

    python scripts/checks/default_learns.py                     # seeds 0-4, this machine's kernels
    python scripts/checks/default_learns.py --capability avx2   # ATen pinned to its AVX2 kernels
    python scripts/checks/default_learns.py --seeds 0 1 -- dtype=bf16_mixed   # overrides after --

Each seed is one `runner train seed=S` through the real CLI, with no other overrides than those
given, in a fresh process (so ATEN_CPU_CAPABILITY takes effect); runs go one at a time unless
--jobs says otherwise (then wall times share the cores). It prints each seed's held-out exact
match, eval loss and wall time (the whole command: start-up, training and evaluations), then the
median and range, and exits 1 if any seed ends below --min-exact-match. The README's quickstart
figures come from this script.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from runner.rundir import RunDir


def train_one(seed: int, overrides: list[str], out: Path, env: dict[str, str]) -> dict:
    """One seed's run: exact match, eval loss and wall seconds (None where it failed)."""
    run_dir = out / f"seed_{seed}"
    command = [sys.executable, "-m", "runner", "train", f"seed={seed}", *overrides]
    command += ["runtime.progress_bar=false", f"hydra.run.dir={run_dir}"]
    started = time.perf_counter()
    proc = subprocess.run(command, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - started
    if proc.returncode != 0:
        print(f"seed {seed} failed (exit {proc.returncode}):\n{proc.stderr[-2000:]}")
        return {"seed": seed, "exact_match": None, "eval_loss": None, "wall_s": wall}
    evaluation = RunDir(run_dir).status().eval or {}
    return {
        "seed": seed,
        "exact_match": evaluation.get("eval_exact_match"),
        "eval_loss": evaluation.get("eval_loss"),
        "wall_s": wall,
    }


def summary(values: list[float], fmt: str) -> str:
    return (
        f"median {fmt.format(statistics.median(values))}, "
        f"range {fmt.format(min(values))} - {fmt.format(max(values))}"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument(
        "--capability",
        default=None,
        help="ATEN_CPU_CAPABILITY for the runs (avx2, avx512, default); unset: the machine's own",
    )
    parser.add_argument("--jobs", type=int, default=1, help="seeds trained at once")
    parser.add_argument("--min-exact-match", type=float, default=0.95)
    parser.add_argument("--keep", type=Path, help="keep the run directories here")
    parser.add_argument("overrides", nargs="*", help="extra `runner train` overrides, after --")
    args = parser.parse_args()

    env = dict(os.environ)
    if args.capability:
        env["ATEN_CPU_CAPABILITY"] = args.capability
    if args.jobs > 1:
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // args.jobs))
    with tempfile.TemporaryDirectory() as tmp:
        out = args.keep or Path(tmp)
        with ThreadPoolExecutor(args.jobs) as pool:
            rows = list(
                pool.map(lambda s: train_one(s, args.overrides, out, env), sorted(args.seeds))
            )
    probe = "import torch; print(torch.backends.cpu.get_cpu_capability(), torch.get_num_threads())"
    kernels = subprocess.run(
        [sys.executable, "-c", probe], env=env, capture_output=True, text=True
    ).stdout.split()
    print(
        f"runner train {' '.join(args.overrides) or '(no overrides)'}: kernels {kernels[0]}, "
        f"{kernels[1]} thread(s) per run, {args.jobs} run(s) at a time, {os.cpu_count()} cores"
    )
    print(f"{'seed':>4}  {'exact match':>11}  {'eval loss':>9}  {'wall s':>7}")
    for row in rows:
        em = "failed" if row["exact_match"] is None else f"{row['exact_match']:.1%}"
        loss = "-" if row["eval_loss"] is None else f"{row['eval_loss']:.4f}"
        print(f"{row['seed']:>4}  {em:>11}  {loss:>9}  {row['wall_s']:>7.1f}")
    scores = [r["exact_match"] for r in rows if r["exact_match"] is not None]
    if scores:
        print(f"exact match: {summary(scores, '{:.1%}')}")
    print(f"wall time:   {summary([r['wall_s'] for r in rows], '{:.0f} s')}")
    ok = len(scores) == len(rows) and min(scores) >= args.min_exact_match
    print(f"every seed >= {args.min_exact_match:.0%}: {'yes' if ok else 'NO'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
