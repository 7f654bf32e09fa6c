"""`runner export`: a checkpoint as a LoRA adapter, a merged model, or a GGUF file."""

from __future__ import annotations

import logging

import hydra
from omegaconf import DictConfig, OmegaConf

from runner.errors import UserError, user_errors_pass_hydra
from runner.paths import CONF_DIR


@hydra.main(config_path=str(CONF_DIR), config_name="export", version_base="1.3")
def main(cfg: DictConfig) -> None:
    """Entry of `runner export [overrides]`."""
    from runner.export.write import export

    logging.getLogger("gguf").setLevel(logging.WARNING)  # its per-file chatter names temp files
    with user_errors_pass_hydra():
        if OmegaConf.is_missing(cfg, "checkpoint"):
            raise UserError(
                "checkpoint", "???", "say what to export: checkpoint=<checkpoint | run | sweep dir>"
            )
        path = export(
            checkpoint=str(cfg.checkpoint),
            select=dict(cfg.select),
            format=cfg.format,
            dtype=cfg.merged.dtype,
            quantization=cfg.gguf.quantization,
            base=cfg.base,
            out=cfg.out,
        )
        print(path)
