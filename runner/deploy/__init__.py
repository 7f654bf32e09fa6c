"""`runner deploy`: serve checkpoints behind an OpenAI-compatible HTTP API."""

from __future__ import annotations

import hydra
from omegaconf import DictConfig

from runner.errors import UserError
from runner.paths import CONF_DIR

# Hydra reports any exception raised in a task as a traceback and exits 1. A UserError is carried
# out of hydra.main instead, so that the CLI prints it as one message and exits 2.
_user_errors: list[UserError] = []


def main() -> None:
    """Entry of `runner deploy [overrides]`."""
    _user_errors.clear()
    _deploy()
    if _user_errors:
        raise _user_errors[0]


@hydra.main(config_path=str(CONF_DIR), config_name="deploy", version_base="1.3")
def _deploy(cfg: DictConfig) -> None:
    from runner.deploy.serve import deploy

    try:
        deploy(cfg)
    except UserError as error:
        _user_errors.append(error)
