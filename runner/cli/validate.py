"""`runner validate [overrides]`: the resolved recipe; whether its weights and data are there."""

from __future__ import annotations

import hydra
from omegaconf import DictConfig

from runner.errors import user_errors_pass_hydra
from runner.paths import CONF_DIR


@hydra.main(config_path=str(CONF_DIR), config_name="train", version_base="1.3")
def app(cfg: DictConfig) -> None:
    """Hydra entry point of `runner validate`."""
    from runner.job.preflight import validate

    with user_errors_pass_hydra():
        validate(cfg)
