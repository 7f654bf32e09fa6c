"""Mistral (7B v0.3): config.json model_type "mistral"."""

from __future__ import annotations

from typing import Any

from runner.models.families._family import Family, Unsupported, cut_at_window, rope, rope_type
from runner.models.families._weights import LLAMA_NAMES, WeightNames


def builder_args(config: dict[str, Any]) -> dict[str, Any]:
    """config.json -> builder arguments beyond the shared ones; Unsupported where it cannot."""
    if rope_type(rope(config)) != "default":
        raise Unsupported(f"rope scaling {rope(config)}")
    if config["tie_word_embeddings"]:
        raise Unsupported("tie_word_embeddings=true")
    return cut_at_window(config, "mistral")


def config_keys(builder: dict[str, Any]) -> dict[str, Any]:
    """Builder arguments -> config.json keys beyond the shared ones (for a random-init model)."""
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
