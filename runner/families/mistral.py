"""Mistral (7B v0.3): config.json model_type "mistral"."""

from __future__ import annotations

import warnings
from typing import Any

from runner.families._family import Family, Unsupported, rope, rope_type
from runner.families._weights import LLAMA_NAMES, WeightNames


def builder_args(config: dict[str, Any]) -> dict[str, Any]:
    if rope_type(rope(config)) != "default":
        raise Unsupported(f"rope scaling {rope(config)}")
    if config["tie_word_embeddings"]:
        raise Unsupported("tie_word_embeddings=true")
    window = config.get("sliding_window")
    if window is not None and window < config["max_position_embeddings"]:
        # torchtune's mistral attends to the whole sequence: the same model as the window's for
        # sequences up to the window, so sequences are cut there (Mistral 7B v0.1: 4096).
        warnings.warn(
            f"sequences are truncated to sliding_window={window} tokens: torchtune's mistral "
            "attends to the whole sequence, which is the same model up to the window",
            stacklevel=2,
        )
        return {"max_seq_len": window}
    return {}


def config_keys(builder: dict[str, Any]) -> dict[str, Any]:
    return {"sliding_window": None}


FAMILY = Family(
    name="mistral",
    model_type="mistral",
    architecture="MistralForCausalLM",
    builders={"torchtune.models.mistral.mistral": "torchtune.models.mistral.lora_mistral"},
    extra_args=builder_args,
    extra_config=config_keys,
    weights=WeightNames(LLAMA_NAMES, permute_qk=True),
)
