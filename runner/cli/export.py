"""`runner export`: a checkpoint as a LoRA adapter, a merged model, or a GGUF file."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import hydra
from omegaconf import DictConfig, OmegaConf

from runner.config.fields import override_key
from runner.config.schema import Export, typed
from runner.errors import UserError, user_errors_pass_hydra
from runner.paths import CONF_DIR, user_path

if TYPE_CHECKING:  # imported where used: runner.export loads what `--help` must not
    from runner.export.write import ExportRequest

# Options that belong to one format, by the bare name a user may try first. (`dtype=` alone
# would select `runner train`'s dtype group.)
_NAMESPACED = {"dtype": "merged.dtype", "quantization": "gguf.quantization"}


def check_argv(argv: list[str]) -> None:
    """Point a bare dtype= or quantization= at the key it means, before Hydra's own error; and
    refuse an option of another format than the one exported, which would be ignored unseen
    (format=adapter merged.dtype=bf16 wrote an fp32 adapter)."""
    given = [(override_key(argument), argument.partition("=")) for argument in argv]
    # The last format= given, as Hydra takes it.
    formats = [value for key, (_, _, value) in given if key == "format"]
    exported = formats[-1] if formats else "merged"
    for owned, (key, _, value) in given:
        if key in _NAMESPACED:
            raise UserError(key, value, f"write {_NAMESPACED[key]}={value}")
        owner = owned.split(".")[0]
        if owner in ("merged", "gguf") and owner != exported:
            raise UserError(
                key, value, f"only format={owner} reads it; drop it, or give format={owner}"
            )


@hydra.main(config_path=str(CONF_DIR), config_name="export", version_base="1.3")
def app(cfg: DictConfig) -> None:
    """Entry of `runner export [overrides]`."""
    from runner.export.write import export

    logging.getLogger("gguf").setLevel(logging.WARNING)  # its per-file chatter names temp files
    with user_errors_pass_hydra():
        cfg = typed(cfg, Export)
        if OmegaConf.is_missing(cfg, "checkpoint"):
            raise UserError(
                "checkpoint", "???", "say what to export: checkpoint=<checkpoint | run | sweep dir>"
            )
        push = _push_request(cfg)
        request = _export_request(cfg)
        path = export(request)
        print(path)
        if push is not None:
            from runner.deploy.selection import choose_checkpoint
            from runner.hub.push import push as upload

            target, token = push
            # The checkpoint export chose: the model card describes the run it came from.
            chosen = choose_checkpoint(user_path(request.checkpoint), **request.select)
            pushed = upload(
                path, target, key="push_to", token=token, private=cfg.private, checkpoint=chosen
            )
            print(pushed)


def _export_request(cfg: DictConfig) -> ExportRequest:
    """The request the typed `runner export` config makes."""
    from runner.export.write import ExportRequest, Selection

    select = Selection(
        checkpoint=cfg.select.checkpoint, metric=cfg.select.metric, mode=cfg.select.mode
    )
    return ExportRequest(
        checkpoint=str(cfg.checkpoint),
        select=select,
        format=cfg.format,
        dtype=cfg.merged.dtype,
        quantization=cfg.gguf.quantization,
        merged_quantization=cfg.merged.quantization,
        base=cfg.base,
        out=cfg.out,
    )


def _push_request(cfg: DictConfig) -> tuple | None:
    """push_to and hf_token checked before anything is written (None: no push)."""
    if cfg.push_to is None:
        return None
    from runner.hub.push import parse_target, push_token

    return parse_target(cfg.push_to, "push_to"), push_token(cfg.hf_token, key="hf_token")
