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


def _wavelengths(settings: dict[str, Any]) -> tuple[float, float]:
    """The wavelengths between which Llama 3 scaling blends (original context / high and / low
    frequency factor): with the factor, all that its frequencies depend on (transformers'
    _compute_llama3_parameters, torchtune's Llama3ScaledRoPE, vLLM's and llama.cpp's alike)."""
    context = settings["original_max_position_embeddings"]
    return context / settings["high_freq_factor"], context / settings["low_freq_factor"]


def llama3_rope(max_seq_len: int) -> dict[str, Any]:
    """LLAMA3_ROPE as config.json gives it for a context of `max_seq_len`.

    transformers warns on every load of a config whose original_max_position_embeddings is not
    below max_position_embeddings (model=tiny: 8192 and 8192). There the three keys are halved
    together until it is: their ratios, the wavelengths, stay exactly the same (halving is exact
    in floating point), and so do the frequencies, bit for bit.
    """
    rope = dict(LLAMA3_ROPE)
    context = rope["original_max_position_embeddings"]
    while context >= max_seq_len and context > 1:
        context //= 2
        rope = {
            "low_freq_factor": rope["low_freq_factor"] / 2,
            "high_freq_factor": rope["high_freq_factor"] / 2,
            "original_max_position_embeddings": context,
        }
    return rope


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
        not math.isclose(theirs, ours)
        for theirs, ours in zip(_wavelengths(settings), _wavelengths(LLAMA3_ROPE), strict=True)
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
            **llama3_rope(builder["max_seq_len"]),
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
