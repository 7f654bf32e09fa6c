"""The model families runner fine-tunes, one module each, found here.

A family module (llama3.py, qwen2.py, mistral.py, gemma.py, gemma2.py, phi3.py) defines
FAMILY: its torchtune builders and their LoRA twins, how config.json maps to the builder's
arguments and back, and its weight names on both sides (PEFT adapter names included). Chats are
rendered with the tokenizer's own chat template, never a family default.
Adding a family is adding a module here and its options in conf/model/. A Hugging Face
checkpoint's config.json names its family (`model_type`).
"""

from __future__ import annotations

import importlib
import json
import pkgutil
from pathlib import Path
from typing import Any

import torch

from runner.errors import UserError
from runner.models.families import _weights
from runner.models.families._builder import (
    builder_args,
    builder_component,
    check_source_matches,
    full_builder_args,
    hf_config,
    ties_embeddings,
    unbuilt_setting,
)
from runner.models.families._family import (
    SHARED_ARGS,
    Family,
    attention_dims,
    head_dim,
    rope,
    rope_type,
)

__all__ = [
    "FAMILIES",
    "Family",
    "builder_args",
    "builder_component",
    "check_source_matches",
    "complete_config",
    "family_named",
    "family_of",
    "full_builder_args",
    "head_dim",
    "hf_config",
    "hf_to_tune",
    "peft_config",
    "peft_to_tune",
    "read_config",
    "rope",
    "rope_type",
    "ties_embeddings",
    "tune_to_hf",
    "tune_to_peft",
    "unbuilt_setting",
]


def _discover() -> dict[str, Family]:
    """FAMILY of every module in this package whose name does not start with _."""
    families = {}
    for module in pkgutil.iter_modules(__path__):
        if not module.name.startswith("_"):
            family = importlib.import_module(f"{__name__}.{module.name}").FAMILY
            families[family.name] = family
    return families


FAMILIES = _discover()
BY_MODEL_TYPE = {family.model_type: family for family in FAMILIES.values()}
assert len(BY_MODEL_TYPE) == len(FAMILIES), "two families read the same model_type"


def family_named(name: str, key: str = "model.family") -> Family:
    """The family of a model.family value; a UserError naming `key` if none."""
    if name not in FAMILIES:
        raise UserError(key, name, f"choose one of: {', '.join(FAMILIES)}")
    return FAMILIES[name]


def family_of(config: dict[str, Any], source: str) -> Family:
    """The family a config.json belongs to; a UserError naming model.source if none."""
    model_type = config.get("model_type")
    if model_type not in BY_MODEL_TYPE:
        known = ", ".join(f"{f.model_type} ({f.name})" for f in FAMILIES.values())
        raise UserError(
            "model.source",
            source,
            f"its config.json has model_type={model_type!r}; runner fine-tunes: {known}",
        )
    return BY_MODEL_TYPE[model_type]


def complete_config(config: dict[str, Any]) -> dict[str, Any]:
    """A config.json with transformers' defaults for the keys it leaves out (a diff-saved one)."""
    needed = (*SHARED_ARGS.values(), "tie_word_embeddings", "hidden_act")
    if config.get("model_type") in BY_MODEL_TYPE and not all(k in config for k in needed):
        from transformers import AutoConfig

        config = {**AutoConfig.for_model(config["model_type"]).to_dict(), **config}
    return config


def read_config(directory: Path) -> dict[str, Any]:
    """A checkpoint's config.json, completed with transformers' defaults."""
    return complete_config(json.loads((directory / "config.json").read_text()))


def hf_to_tune(state: dict[str, torch.Tensor], config: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Hugging Face parameter names and layouts -> torchtune's, for the config's family."""
    config = complete_config(config)
    family = BY_MODEL_TYPE[config["model_type"]]
    return _weights.to_tune(
        state, family.weights, attention_dims(config), tied=config["tie_word_embeddings"]
    )


def tune_to_hf(state: dict[str, torch.Tensor], config: dict[str, Any]) -> dict[str, torch.Tensor]:
    """torchtune parameter names and layouts -> Hugging Face's, for the config's family."""
    config = complete_config(config)
    family = BY_MODEL_TYPE[config["model_type"]]
    return _weights.to_hf(
        state, family.weights, attention_dims(config), tied=config["tie_word_embeddings"]
    )


def tune_to_peft(state: dict[str, torch.Tensor], config: dict[str, Any]) -> dict[str, Any]:
    """torchtune adapter names and layouts -> PEFT's, onto the Hugging Face model of `config`."""
    family = BY_MODEL_TYPE[config["model_type"]]
    return _weights.to_peft(state, family.weights, attention_dims(config))


def peft_to_tune(state: dict[str, torch.Tensor], config: dict[str, Any]) -> dict[str, Any]:
    """PEFT adapter names and layouts -> torchtune's: the inverse of tune_to_peft."""
    family = BY_MODEL_TYPE[config["model_type"]]
    return _weights.from_peft(state, family.weights, attention_dims(config))


def peft_config(adapter_config: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    """PEFT's adapter_config.json for the Hugging Face model of `config`: a family whose model
    fuses projections (Phi-3) adapts the fused modules at the parts' summed rank and alpha."""
    family = BY_MODEL_TYPE[config["model_type"]]
    return _weights.peft_config(adapter_config, family.weights)
