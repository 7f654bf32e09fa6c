"""`runner deploy [overrides]`: serve checkpoints behind an OpenAI-compatible HTTP API."""

from __future__ import annotations

import hydra
from omegaconf import DictConfig

from runner.errors import user_errors_pass_hydra
from runner.paths import CONF_DIR


@hydra.main(config_path=str(CONF_DIR), config_name="deploy", version_base="1.3")
def app(cfg: DictConfig) -> None:
    """Hydra entry point of `runner deploy`: serve until interrupted."""
    from runner.deploy.serve import deploy

    with user_errors_pass_hydra():
        deploy(cfg)
