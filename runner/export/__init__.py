"""`runner export`: a checkpoint as a LoRA adapter, a merged model, or a GGUF file."""

from __future__ import annotations

import logging

import hydra
from omegaconf import DictConfig, OmegaConf

from runner.errors import UserError, user_errors_pass_hydra
from runner.paths import CONF_DIR
from runner.schema import Export, typed

# Options that belong to one format, by the bare name a user may try first. (`dtype=` alone
# would select `runner train`'s dtype group.)
_NAMESPACED = {"dtype": "merged.dtype", "quantization": "gguf.quantization"}


def check_argv(argv: list[str]) -> None:
    """Point a bare dtype= or quantization= at the key it means, before Hydra's own error."""
    for argument in argv:
        key, _, value = argument.partition("=")
        if key in _NAMESPACED:
            raise UserError(key, value, f"write {_NAMESPACED[key]}={value}")


@hydra.main(config_path=str(CONF_DIR), config_name="export", version_base="1.3")
def main(cfg: DictConfig) -> None:
    """Entry of `runner export [overrides]`."""
    from runner.export.write import export

    logging.getLogger("gguf").setLevel(logging.WARNING)  # its per-file chatter names temp files
    with user_errors_pass_hydra():
        cfg = typed(cfg, Export)
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
