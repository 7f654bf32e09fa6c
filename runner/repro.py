"""`runner repro RUN_DIR`: re-run a recorded run and fail on drift (for CI).

Exit codes: 0 the re-run matches, 1 drift (numbers or record differ), 2 a user error.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import yaml

from runner.errors import UserError
from runner.launch import launch
from runner.manifest import (
    MANIFEST_FILE,
    RUN_SPECIFIC_KEYS,
    build_manifest,
    read_manifest,
    write_manifest,
)
from runner.rundir import RunDir

MAX_ROWS = 20


@dataclass(frozen=True)
class Drift:
    """One difference between the recorded run and its re-run."""

    what: str
    recorded: Any
    rerun: Any


def _flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(value, dict):
        return {prefix: value}
    flat: dict[str, Any] = {}
    for key, child in value.items():
        flat.update(_flatten(child, f"{prefix}.{key}" if prefix else str(key)))
    return flat


def _diff(what: str, recorded: Any, rerun: Any, skip: tuple[str, ...] = ()) -> list[Drift]:
    a, b = _flatten(recorded), _flatten(rerun)
    keys = sorted(k for k in set(a) | set(b) if not k.startswith(skip))
    return [
        Drift(f"{what}.{k}" if k else what, a.get(k), b.get(k))
        for k in keys
        if a.get(k) != b.get(k)
    ]


def compare_losses(
    recorded: dict[int, float], rerun: dict[int, float], tolerance: float = 0.0
) -> list[Drift]:
    """Per-step losses at the steps both logged: equal (tolerance 0) or within `tolerance`."""
    steps = sorted(set(recorded) & set(rerun))
    if not steps:
        return [Drift("losses", sorted(recorded)[:5], sorted(rerun)[:5])]
    drifts = []
    for step in steps:
        a, b = recorded[step], rerun[step]
        same = a == b if tolerance == 0 else abs(a - b) <= tolerance * max(abs(a), abs(b))
        if not same:
            drifts.append(Drift(f"loss at step {step}", a, b))
    return drifts


def compare_records(recorded: dict[str, Any], rerun: dict[str, Any]) -> list[Drift]:
    """What differs in the manifests: config, data, tokenizer, packages, build, world, device."""
    drifts = _diff("config", recorded["config"], rerun["config"], skip=RUN_SPECIFIC_KEYS)
    for key in (
        "tokenizer_sha256",
        "packages",
        "python",
        "torch_build",
        "world_size",
        "deterministic",
    ):
        drifts += _diff(key, recorded[key], rerun[key])
    for split in sorted(set(recorded["data"]) | set(rerun["data"])):
        drifts += _diff(
            f"data.{split}.sha256",
            recorded["data"].get(split, {}).get("sha256"),
            rerun["data"].get(split, {}).get("sha256"),
        )
    drifts += _diff("hardware.device", recorded["hardware"]["device"], rerun["hardware"]["device"])
    common = sorted(set(recorded["checkpoints"]) & set(rerun["checkpoints"]), key=int)
    for step in common:
        drifts += _diff(
            f"checkpoint {step}", recorded["checkpoints"][step], rerun["checkpoints"][step]
        )
    return drifts


def print_report(drifts: list[Drift], compared: str) -> None:
    """One line on a match; on drift, a table of what differs, recorded beside re-run."""
    if not drifts:
        print(f"repro: match ({compared})")
        return
    width = max(len(d.what) for d in drifts[:MAX_ROWS])
    print(f"repro: DRIFT, {len(drifts)} difference(s)")
    print(f"{'what':<{width}}  {'recorded':>24}  {'re-run':>24}")
    for d in drifts[:MAX_ROWS]:
        print(f"{d.what:<{width}}  {str(d.recorded):>24.24}  {str(d.rerun):>24.24}")
    if len(drifts) > MAX_ROWS:
        print(f"... and {len(drifts) - MAX_ROWS} more")


def repro(run_dir: Path, *, steps: int | None, tolerance: float, out: Path | None) -> int:
    """Re-runs the recorded recipe of `run_dir` into a new run directory and compares."""
    recorded = RunDir(run_dir)
    if not (recorded.recipe_path.is_file() and (recorded.path / MANIFEST_FILE).is_file()):
        raise UserError(
            "RUN_DIR",
            str(run_dir),
            "not a run directory with recipe.yaml and "
            f"{MANIFEST_FILE}; give a directory `runner train` made",
        )
    if steps is not None and steps < 1:
        raise UserError("--steps", steps, "give a number of steps >= 1")
    stamp = datetime.now().strftime("%Y-%m-%d_%H-%M-%S")
    rerun = RunDir(out or recorded.path.with_name(f"{recorded.path.name}-repro-{stamp}"))
    if rerun.path.exists():
        raise UserError("--out", str(rerun.path), "already exists; give a new directory")
    rerun.path.mkdir(parents=True)
    recipe = yaml.safe_load(recorded.recipe_path.read_text())
    recipe.update(run_dir=str(rerun.path.resolve()), stop_at_step=steps)
    rerun.recipe_path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    recorded_manifest = read_manifest(recorded)
    write_manifest(rerun, build_manifest(recipe, recorded_manifest["overrides"], Path.cwd()))
    rerun.write_status("created", step=0, total_steps=recipe["training"]["max_steps"])
    launch(recipe, rerun.recipe_path)
    recorded_losses = recorded.losses()
    if steps is not None:
        recorded_losses = {s: v for s, v in recorded_losses.items() if s <= steps}
    loss_drifts = compare_losses(recorded_losses, rerun.losses(), tolerance)
    drifts = loss_drifts + compare_records(recorded_manifest, read_manifest(rerun))
    print(f"re-run directory: {rerun.path}")
    steps_compared = len(set(recorded_losses) & set(rerun.losses()))
    print_report(drifts, f"{steps_compared} logged steps; checkpoint hashes and record agree")
    return 1 if drifts else 0


def main(argv: list[str]) -> int:
    """Entry point of `runner repro`."""
    parser = argparse.ArgumentParser(
        prog="runner repro",
        description="Re-run a recorded run and compare per-step losses, checkpoint hashes and "
        "the manifest. Exit 0 on a match, 1 on drift, 2 on a user error.",
    )
    parser.add_argument("run_dir", type=Path, metavar="RUN_DIR", help="a run directory")
    parser.add_argument("--steps", type=int, help="re-run and compare only the first N steps")
    parser.add_argument(
        "--tolerance",
        type=float,
        default=0.0,
        help="relative loss tolerance (0: exact, right for CPU runs)",
    )
    parser.add_argument("--out", type=Path, help="the new run directory (default: beside RUN_DIR)")
    args = parser.parse_args(argv)
    return repro(args.run_dir, steps=args.steps, tolerance=args.tolerance, out=args.out)
