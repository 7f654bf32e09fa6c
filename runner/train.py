"""`runner train`: compose the config groups, resolve one recipe, launch it."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import hydra
import yaml
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from runner.errors import UserError, UserErrorExit
from runner.launch import launch
from runner.manifest import build_manifest, write_manifest
from runner.paths import CONF_DIR
from runner.resolve import resolve_recipe
from runner.rundir import RunDir


def train(cfg: DictConfig, run_dir: Path, overrides: list[str]) -> dict[str, Any] | None:
    """Resolves `cfg` into run_dir/recipe.yaml and trains; resume=RUN continues RUN's recipe."""
    run = RunDir(run_dir)
    try:
        return _train(cfg, run, overrides)
    except UserError:
        if cfg.resume is None:  # a fresh run that never started: leave nothing behind
            shutil.rmtree(run_dir, ignore_errors=True)
        raise


def _train(cfg: DictConfig, run: RunDir, overrides: list[str]) -> dict[str, Any] | None:
    if cfg.resume is not None:
        extra = [o for o in overrides if not o.startswith("resume=")]
        if extra:
            raise UserError(
                "resume",
                cfg.resume,
                f"a resumed run continues its recorded recipe; drop the other overrides {extra}",
            )
        if not run.recipe_path.is_file():
            raise UserError("resume", cfg.resume, "not a run directory (it has no recipe.yaml)")
        recipe = yaml.safe_load(run.recipe_path.read_text())
    else:
        recipe = resolve_recipe(cfg, run.path)
        run.recipe_path.write_text(yaml.safe_dump(recipe, sort_keys=False))
        write_manifest(run, build_manifest(recipe, overrides, Path.cwd()))
        run.write_status("created", step=0, total_steps=recipe["training"]["max_steps"])
    result = launch(recipe, run.recipe_path)
    _print_summary(run, result)
    return result


def _print_summary(run: RunDir, result: dict[str, Any] | None) -> None:
    status = run.read_status()
    checkpoint = run.latest_checkpoint()
    lines = [f"run directory: {run.path}", f"checkpoint:    {checkpoint}"]
    if result is not None and result.get("first_loss") is not None:
        lines.insert(0, f"train loss:    {result['first_loss']:.4f} -> {result['last_loss']:.4f}")
    if result is not None and result.get("exact_match") is not None:
        lines.insert(1, f"held-out exact match: {result['exact_match']:.1%}")
    lines.append(f"status:        {status.get('state')} at step {status.get('step')}")
    lines.append(f"try next:      runner deploy checkpoint={checkpoint}")
    print("\n".join(lines), flush=True)


@hydra.main(config_path=str(CONF_DIR), config_name="train", version_base="1.3")
def main(cfg: DictConfig) -> None:
    """Hydra entry point of `runner train`."""
    hydra_cfg = HydraConfig.get()
    try:
        train(cfg, Path(hydra_cfg.runtime.output_dir), list(hydra_cfg.overrides.task))
    except UserError as err:
        raise UserErrorExit(err) from err
