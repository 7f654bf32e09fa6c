"""Llama 3 (3, 3.1, 3.2): config.json model_type "llama"."""

from __future__ import annotations

import math
from typing import Any

from runner.models.families._family import Family, Unsupported, rope, rope_type
from runner.models.families._weights import LLAMA_NAMES, WeightNames

# torchtune's Llama3ScaledRoPE has these fixed; a config.json with others needs another model.
LLAMA3_ROPE = {
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def builder_args(config: dict[str, Any]) -> dict[str, Any]:
    """config.json -> builder arguments beyond the shared ones; Unsupported where it cannot."""
    for key in ("attention_bias", "mlp_bias"):
        if config.get(key):
            raise Unsupported(f"{key}=true")
    settings = rope(config)
    if rope_type(settings) == "default":
        # Llama3ScaledRoPE with factor 1 leaves every frequency as it is.
        return {"scale_factor": 1, "tie_word_embeddings": config["tie_word_embeddings"]}
    if rope_type(settings) != "llama3" or any(
        not math.isclose(settings[k], v) for k, v in LLAMA3_ROPE.items()
    ):
        raise Unsupported(f"rope scaling {settings}")
    return {
        "scale_factor": settings["factor"],
        "tie_word_embeddings": config["tie_word_embeddings"],
    }


def config_keys(builder: dict[str, Any]) -> dict[str, Any]:
    """Builder arguments -> config.json keys beyond the shared ones (for a random-init model)."""
    return {
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": float(builder["scale_factor"]),
            **LLAMA3_ROPE,
        },
        "attention_bias": False,
        "mlp_bias": False,
    }


def lora_llama3_2(
    *,
    apply_lora_to_output: bool = False,
    tie_word_embeddings: bool = True,
    scale_factor: int = 32,
    **args: Any,
) -> Any:
    """torchtune's lora_llama3_2, but LoRA on an untied output projection: torchtune's refuses
    apply_lora_to_output even there, and lora_llama3_1 builds that same model (tied, it stays
    refused: method.py says so before launch)."""
    from runner.models.torchtune_boundary import llama3_1_builders, llama3_2_builders

    if apply_lora_to_output and not tie_word_embeddings:
        return llama3_1_builders.lora_llama3_1(
            apply_lora_to_output=True, scale_factor=scale_factor, **args
        )
    return llama3_2_builders.lora_llama3_2(
        apply_lora_to_output=apply_lora_to_output,
        tie_word_embeddings=tie_word_embeddings,
        scale_factor=scale_factor,
        **args,
    )


FAMILY = Family(
    name="llama3",
    model_type="llama",
    architecture="LlamaForCausalLM",
    builders={
        "torchtune.models.llama3_2.llama3_2": "runner.models.families.llama3.lora_llama3_2",
        # The same model without tied embeddings (model=llama3_1_8b names it).
        "torchtune.models.llama3_1.llama3_1": "torchtune.models.llama3_1.lora_llama3_1",
    },
    extra_args=builder_args,
    extra_config=config_keys,
    weights=WeightNames(LLAMA_NAMES, permute_qk=True),
)
