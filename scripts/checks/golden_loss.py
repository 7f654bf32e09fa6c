"""Golden-loss check: a fixed tiny config's per-step losses against a stored file, exactly.

    python scripts/checks/golden_loss.py           # exit 0 on a match, 1 on drift, 2 on bad input
                                                   # (.ci/run runs it)
    python scripts/checks/golden_loss.py --update  # rewrite the stored file on an intended change

runtime.deterministic=true pins the kernel path (runner/trainer/determinism.py: ATen's AVX2
kernels, one thread, MKL's reproducible mode), so the numbers are the same on any x86-64 machine
with AVX2, with or without AVX-512, whatever its core count; nothing needs setting by hand.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from runner.rundir import RunDir

GOLDEN = Path(__file__).resolve().parents[2] / "tests" / "golden" / "tiny_losses.json"
OVERRIDES = [
    "model=tiny",
    "dataset=sample",
    "compute=cpu",
    "dtype=fp32",
    "loss=chunked_ce",
    "optimizer.lr=2e-3",
    "max_steps=8",
    "batch_size=8",
    "seed=0",
    "runtime.log_every_n_steps=1",
    "runtime.save_every_n_steps=null",
    "runtime.deterministic=true",
    "runtime.progress_bar=false",
    "runtime.loggers=[]",
    "dataset.eval_samples=0",
]


def train_losses() -> dict[str, float]:
    """Per-step losses of the golden config, trained in a fresh process."""
    with tempfile.TemporaryDirectory() as tmp:
        proc = subprocess.run(
            [sys.executable, "-m", "runner", "train", *OVERRIDES, f"hydra.run.dir={tmp}/run"],
            capture_output=True,
            text=True,
        )
        if proc.returncode != 0:
            sys.exit(f"the golden run failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
        return {str(step): loss for step, loss in RunDir(Path(tmp) / "run").losses().items()}


def read_golden(golden: Path) -> dict[int, float]:
    """The stored per-step losses; a ValueError saying what is wrong with the file."""
    try:
        stored = json.loads(golden.read_text())
        losses = stored["losses"]
        return {int(step): float(loss) for step, loss in losses.items()}
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as err:
        raise ValueError(
            f"--golden={golden}: not a stored losses file ({type(err).__name__}: {err}); give "
            'one that --update wrote: {"losses": {"STEP": LOSS, ...}}'
        ) from None


def check(losses: dict[str, float], stored: dict[int, float], name: str) -> int:
    """Compares `losses` with the stored ones, step by step and exactly; prints the report and
    returns the exit status (0 on a match, 1 on drift)."""
    from runner.job.repro import compare_losses, print_report

    drifts = compare_losses(stored, {int(k): v for k, v in losses.items()})
    print_report(drifts, f"{len(losses)} steps equal to {name}")
    return 1 if drifts else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--update", action="store_true", help="rewrite the stored losses")
    parser.add_argument("--golden", type=Path, default=GOLDEN, help="the stored losses file")
    args = parser.parse_args()
    stored: dict[int, float] = {}
    if not args.update:  # before the minute of training
        try:
            stored = read_golden(args.golden)
        except ValueError as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
    losses = train_losses()
    if args.update:
        args.golden.write_text(json.dumps({"overrides": OVERRIDES, "losses": losses}, indent=2))
        print(f"wrote {len(losses)} losses to {args.golden}")
        return 0
    return check(losses, stored, args.golden.name)


if __name__ == "__main__":
    sys.exit(main())
