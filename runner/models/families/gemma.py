"""Gemma (2B, 7B): config.json model_type "gemma"."""

from __future__ import annotations

from typing import Any

from runner.errors import UserError
from runner.models.families._family import Family, Unsupported, head_dim, rope, rope_type
from runner.models.families._weights import LLAMA_NAMES, WeightNames

# transformers reads Gemma's legacy hidden_act "gelu" as the tanh approximation, as the
# released checkpoints meant; torchtune's gemma_mlp computes GELU(approximate="tanh").
GELU_TANH = ("gelu_pytorch_tanh", "gelu")


def check_gemma(config: dict[str, Any]) -> None:
    """What Gemma and Gemma 2 share: RoPE without scaling, no biases, tied embeddings."""
    if rope_type(rope(config)) != "default":
        raise Unsupported(f"rope scaling {rope(config)}")
    if config.get("attention_bias"):
        raise Unsupported("attention_bias=true")
    # torchtune's Gemma builders always tie the output projection to the embeddings.
    if not config["tie_word_embeddings"]:
        raise Unsupported("tie_word_embeddings=false")


def builder_args(config: dict[str, Any]) -> dict[str, Any]:
    """config.json -> builder arguments beyond the shared ones; Unsupported where it cannot."""
    check_gemma(config)
    return {"head_dim": head_dim(config)}


def config_keys(builder: dict[str, Any]) -> dict[str, Any]:
    """Builder arguments -> config.json keys beyond the shared ones (for a random-init model)."""
    return {
        "head_dim": builder["head_dim"],
        "hidden_act": "gelu_pytorch_tanh",
        "hidden_activation": "gelu_pytorch_tanh",
        "attention_bias": False,
        "tie_word_embeddings": True,
    }


def refuse_output_lora(apply_lora_to_output: bool) -> None:
    """Gemma ties its output projection to the embeddings, which LoRA cannot adapt."""
    if apply_lora_to_output:
        raise UserError(
            "method.apply_lora_to_output",
            True,
            "Gemma ties its output projection to the embeddings, which LoRA cannot adapt; "
            "leave it false",
        )


def lora_gemma(*, apply_lora_to_output: bool = False, **args: Any) -> Any:
    """torchtune's lora_gemma, which takes no apply_lora_to_output (the output is tied)."""
    from runner.models.torchtune_boundary import gemma_builders

    refuse_output_lora(apply_lora_to_output)
    return gemma_builders.lora_gemma(**args)


FAMILY = Family(
    name="gemma",
    model_type="gemma",
    architecture="GemmaForCausalLM",
    # Norms scale by 1 + weight on both sides, embeddings by sqrt(embed_dim): the same weights.
    builders={"torchtune.models.gemma.gemma": "runner.models.families.gemma.lora_gemma"},
    extra_args=builder_args,
    extra_config=config_keys,
    weights=WeightNames(LLAMA_NAMES, permute_qk=True),
    activations=GELU_TANH,
    own_head_dim=True,
    always_tied=True,
)
