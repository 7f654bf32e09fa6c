"""Gemma 2 (2B, 9B, 27B): config.json model_type "gemma2".

torchtune 0.6.1's gemma2 builders soft-cap the final norm's output instead of the logits, which
is not the model transformers runs; the builders here are torchtune's with the final norm a
plain Gemma RMSNorm and the cap applied to the logits, as Gemma 2 does.
"""

from __future__ import annotations

from typing import Any

import torch

from runner.models.families._family import Family, Unsupported, head_dim
from runner.models.families._weights import LLAMA_NAMES, WeightNames
from runner.models.families.gemma import check_gemma, refuse_output_lora

# A Gemma 2 layer norms the attention and MLP outputs too (torchtune's sa_scale, mlp_scale).
GEMMA2_NAMES = {
    **{k: v for k, v in LLAMA_NAMES.items() if "post_attention_layernorm" not in k},
    "model.layers.{}.post_attention_layernorm.weight": "layers.{}.sa_scale.scale",
    "model.layers.{}.pre_feedforward_layernorm.weight": "layers.{}.mlp_norm.scale",
    "model.layers.{}.post_feedforward_layernorm.weight": "layers.{}.mlp_scale.scale",
}


def _sliding_layers(config: dict[str, Any]) -> bool:
    """Whether the config's sliding-window layers are torchtune's: every other, from the first."""
    types = config.get("layer_types")
    if types is None:
        return True
    expected = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(len(types))]
    return list(types) == expected


def builder_args(config: dict[str, Any]) -> dict[str, Any]:
    """config.json -> builder arguments beyond the shared ones; Unsupported where it cannot."""
    check_gemma(config)
    if not config.get("sliding_window") or not _sliding_layers(config):
        raise Unsupported(
            f"sliding_window={config.get('sliding_window')} on layers {config.get('layer_types')}"
        )
    return {
        "head_dim": head_dim(config),
        "hidden_capping_value": config["attn_logit_softcapping"],
        "final_capping_value": config["final_logit_softcapping"],
        "sliding_window_size": config["sliding_window"],
        "query_pre_attn_scalar": config["query_pre_attn_scalar"],
    }


def config_keys(builder: dict[str, Any]) -> dict[str, Any]:
    """Builder arguments -> config.json keys beyond the shared ones (for a random-init model)."""
    return {
        "head_dim": builder["head_dim"],
        "hidden_act": "gelu_pytorch_tanh",
        "hidden_activation": "gelu_pytorch_tanh",
        "attention_bias": False,
        "attn_logit_softcapping": builder["hidden_capping_value"],
        "final_logit_softcapping": builder["final_capping_value"],
        "sliding_window": builder["sliding_window_size"],
        "query_pre_attn_scalar": builder["query_pre_attn_scalar"] or builder["head_dim"],
        "tie_word_embeddings": True,
    }


class SoftCappedOutput:
    """The tied output projection, its logits soft-capped: cap * tanh(logits / cap).

    A plain callable like torchtune's TiedLinear, so the embedding is not registered twice.
    """

    def __init__(self, output: Any, cap: float | None) -> None:
        self.output, self.cap = output, cap

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.output(x)
        if self.cap is None:
            return logits
        return torch.tanh(logits / self.cap) * self.cap


def _cap_logits(model: Any, final_capping_value: float | None) -> Any:
    model.norm = model.norm.rms_norm  # the RMSNorm torchtune's Gemma2FinalNorm wraps
    model.output = SoftCappedOutput(model.output, final_capping_value)
    return model


def gemma2(
    *,
    vocab_size: int,
    num_layers: int,
    num_heads: int,
    head_dim: int,
    num_kv_heads: int,
    embed_dim: int,
    intermediate_dim: int,
    max_seq_len: int,
    attn_dropout: float = 0.0,
    norm_eps: float = 1e-6,
    rope_base: int = 10_000,
    hidden_capping_value: float | None = 50.0,
    final_capping_value: float | None = 30.0,
    sliding_window_size: int = 4096,
    query_pre_attn_scalar: int | None = None,
) -> Any:
    """torchtune's gemma2 with Gemma 2's logit soft-capping (Gemma 2's defaults: attention
    logits capped at 50, final logits at 30)."""
    from runner.models.torchtune_boundary import gemma2_builders

    args = {
        k: v for k, v in locals().items() if k not in ("gemma2_builders", "final_capping_value")
    }
    return _cap_logits(gemma2_builders.gemma2(**args), final_capping_value)


def lora_gemma2(
    *, final_capping_value: float | None = 30.0, apply_lora_to_output: bool = False, **args: Any
) -> Any:
    """torchtune's lora_gemma2 with Gemma 2's logit soft-capping."""
    from runner.models.torchtune_boundary import gemma2_builders

    refuse_output_lora(apply_lora_to_output)
    return _cap_logits(gemma2_builders.lora_gemma2(**args), final_capping_value)


FAMILY = Family(
    name="gemma2",
    model_type="gemma2",
    architecture="Gemma2ForCausalLM",
    builders={"runner.models.families.gemma2.gemma2": "runner.models.families.gemma2.lora_gemma2"},
    extra_args=builder_args,
    extra_config=config_keys,
    weights=WeightNames(GEMMA2_NAMES, permute_qk=True),
    # transformers' Gemma 2 reads hidden_activation, and "gelu" there is the exact GELU.
    activations=("gelu_pytorch_tanh",),
    activation_key="hidden_activation",
    own_head_dim=True,
    always_tied=True,
    block_mask=False,
)
