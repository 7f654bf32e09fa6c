"""`runner repro RUN_DIR`: re-run a recorded run and compare; exit 1 on drift (for CI)."""

from __future__ import annotations

from runner.cli.arguments import ArgumentParser, path_argument
from runner.job.repro import CROSS_PATH_TOLERANCE, repro


def main(argv: list[str]) -> int:
    """Entry point of `runner repro`."""
    parser = ArgumentParser(
        prog="runner repro",
        description="Re-run a recorded run and compare per-step losses, checkpoint hashes and "
        "the manifest. Exit 0 on a match, 1 on drift, 2 on a user error.",
    )
    parser.add_argument(
        "run_dir",
        type=path_argument("RUN_DIR", "give a run directory"),
        metavar="RUN_DIR",
        help="a run directory",
    )
    parser.add_argument("--steps", type=int, help="re-run and compare only the first N steps")
    parser.add_argument(
        "--tolerance",
        type=float,
        default=None,
        help="relative tolerance of every metric, checkpoint hashes then not compared "
        "(default: exact on the recorded kernel path and for deterministic runs; "
        f"{CROSS_PATH_TOLERANCE:g} where a non-deterministic run is re-run on another device, "
        "GPU model, CPU kernel capability or thread count)",
    )
    parser.add_argument(
        "--out",
        type=path_argument("--out", "give the new run's directory, or leave --out off"),
        help="the new run directory (default: beside RUN_DIR)",
    )
    args = parser.parse_args(argv)
    return repro(args.run_dir, steps=args.steps, tolerance=args.tolerance, out=args.out)
