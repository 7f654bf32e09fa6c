"""Phi-3 and Phi-4: config.json model_type "phi3" (Phi-4 is the Phi-3 architecture).

Hugging Face's Phi-3 fuses q, k and v into qkv_proj and gate and up into gate_up_proj;
torchtune's phi3 keeps them apart, so the weight conversion splits and fuses them. model=phi4
is this family's builder at Phi-4's dimensions (torchtune's phi4_14b is the same builder).
"""

from __future__ import annotations

import math
from typing import Any

from runner.models.families._family import Family, Unsupported, cut_at_window, rope, rope_type
from runner.models.families._weights import LLAMA_NAMES, WeightNames

PHI3_NAMES: dict[str, str | tuple[str, ...]] = {
    **{
        k: v
        for k, v in LLAMA_NAMES.items()
        if not any(p in k for p in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"))
    },
    "model.layers.{}.self_attn.qkv_proj.weight": (
        "layers.{}.attn.q_proj.weight",
        "layers.{}.attn.k_proj.weight",
        "layers.{}.attn.v_proj.weight",
    ),
    "model.layers.{}.mlp.gate_up_proj.weight": (
        "layers.{}.mlp.w1.weight",
        "layers.{}.mlp.w3.weight",
    ),
}


def builder_args(config: dict[str, Any]) -> dict[str, Any]:
    """config.json -> builder arguments beyond the shared ones; Unsupported where it cannot."""
    settings = rope(config)
    if rope_type(settings) != "default":
        raise Unsupported(f"rope scaling {settings}")
    # transformers 5 keeps it in rope_parameters, 4 at the top level.
    partial = settings.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
    if not math.isclose(partial, 1.0):
        raise Unsupported(f"partial_rotary_factor={partial}")
    if config["tie_word_embeddings"]:
        raise Unsupported("tie_word_embeddings=true")
    return cut_at_window(config, "phi3")


def config_keys(builder: dict[str, Any]) -> dict[str, Any]:
    """Builder arguments -> config.json keys beyond the shared ones (for a random-init model)."""
    # Phi3Config's default pad_token_id (32000) is past a smaller vocabulary's end.
    return {
        "sliding_window": None,
        "rope_scaling": None,
        "partial_rotary_factor": 1.0,
        "pad_token_id": None,
    }


FAMILY = Family(
    name="phi3",
    model_type="phi3",
    architecture="Phi3ForCausalLM",
    builders={"torchtune.models.phi3.phi3": "torchtune.models.phi3.lora_phi3"},
    extra_args=builder_args,
    extra_config=config_keys,
    # Phi-3 rotates halves on both sides.
    weights=WeightNames(PHI3_NAMES, permute_qk=False),
)
