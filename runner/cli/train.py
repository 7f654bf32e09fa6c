"""`runner train [overrides]` and `runner train -m [sweep overrides]`: Hydra's app, train.yaml."""

from __future__ import annotations

import os
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from runner.config.fields import as_typed
from runner.errors import user_errors_pass_hydra
from runner.job.job import sweep_job, train
from runner.paths import CONF_DIR


def _share_cores(jobs: int) -> None:
    """A job of a parallel sweep trains on its share of the cores; its processes inherit it."""
    if jobs > 1 and not os.environ.get("OMP_NUM_THREADS"):
        os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // jobs))


@hydra.main(config_path=str(CONF_DIR), config_name="train", version_base="1.3")
def app(cfg: DictConfig) -> float | None:
    """Hydra entry point of `runner train` (and of each job of `runner train -m`)."""
    hydra_cfg = HydraConfig.get()
    run_dir, overrides = Path(hydra_cfg.runtime.output_dir), as_typed(hydra_cfg.overrides.task)
    if hydra_cfg.mode == RunMode.MULTIRUN:
        _share_cores(hydra_cfg.launcher.get("n_jobs") or 1)
        return sweep_job(cfg, run_dir, overrides)
    with user_errors_pass_hydra():
        train(cfg, run_dir, overrides)
    return None
