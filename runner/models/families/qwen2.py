"""Qwen2 and Qwen2.5: config.json model_type "qwen2"."""

from __future__ import annotations

from typing import Any

from runner.models.families._family import Family, Unsupported, rope, rope_type
from runner.models.families._weights import LLAMA_NAMES, WeightNames

# Llama's layout plus biases on the q, k and v projections.
QWEN2_NAMES = {
    **LLAMA_NAMES,
    **{
        f"model.layers.{{}}.self_attn.{proj}.bias": f"layers.{{}}.attn.{proj}.bias"
        for proj in ("q_proj", "k_proj", "v_proj")
    },
}


def builder_args(config: dict[str, Any]) -> dict[str, Any]:
    """config.json -> builder arguments beyond the shared ones; Unsupported where it cannot."""
    if rope_type(rope(config)) != "default":
        raise Unsupported(f"rope scaling {rope(config)}")
    if config.get("use_sliding_window"):
        raise Unsupported("use_sliding_window=true")
    return {"tie_word_embeddings": config["tie_word_embeddings"]}


def config_keys(builder: dict[str, Any]) -> dict[str, Any]:
    """Builder arguments -> config.json keys beyond the shared ones (for a random-init model)."""
    return {"use_sliding_window": False, "sliding_window": None}


FAMILY = Family(
    name="qwen2",
    model_type="qwen2",
    architecture="Qwen2ForCausalLM",
    builders={"torchtune.models.qwen2.qwen2": "torchtune.models.qwen2.lora_qwen2"},
    extra_args=builder_args,
    extra_config=config_keys,
    weights=WeightNames(QWEN2_NAMES, permute_qk=False),
)
