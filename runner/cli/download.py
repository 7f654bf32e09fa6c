"""`runner download [overrides]`: the hf:// models and datasets a config names, into the cache."""

from __future__ import annotations

import hydra
from omegaconf import DictConfig

from runner.errors import user_errors_pass_hydra
from runner.paths import CONF_DIR


@hydra.main(config_path=str(CONF_DIR), config_name="train", version_base="1.3")
def app(cfg: DictConfig) -> None:
    """Hydra entry point of `runner download`."""
    from runner.config.dataset import check_dataset_source_given
    from runner.config.model import check_model_source_given
    from runner.config.schema import typed
    from runner.hub.download import download

    with user_errors_pass_hydra():
        # The same config as `runner train`: a value it would refuse is refused before any fetch,
        # and a model or dataset option without its source is not "nothing to download".
        cfg = typed(cfg)
        check_model_source_given(cfg.model)
        check_dataset_source_given(cfg.dataset)
        download(cfg)
