"""What a family module declares (Family), and the config.json readings every family shares."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from runner.models.families._weights import AttentionDims, WeightNames

# builder argument -> config.json key, in every family.
SHARED_ARGS = {
    "vocab_size": "vocab_size",
    "num_layers": "num_hidden_layers",
    "num_heads": "num_attention_heads",
    "num_kv_heads": "num_key_value_heads",
    "embed_dim": "hidden_size",
    "intermediate_dim": "intermediate_size",
    "max_seq_len": "max_position_embeddings",
    "norm_eps": "rms_norm_eps",
}


class Unsupported(ValueError):
    """A config.json setting that the family's torchtune builder does not build."""


@dataclass(frozen=True, eq=False)
class Family:
    """Everything runner knows about one model family; one module of runner/models/families each."""

    name: str
    model_type: str  # config.json's model_type
    architecture: str  # config.json's architectures[0]
    # torchtune builder -> its LoRA twin (same arguments plus the LoRA ones). The first builds
    # model=hf sources and every option whose builder node names no _component_.
    builders: dict[str, str]
    # config.json -> builder arguments beyond SHARED_ARGS and rope_base (raises Unsupported)
    extra_args: Callable[[dict[str, Any]], dict[str, Any]]
    # builder arguments -> config.json keys beyond the shared ones (for a random-init model)
    extra_config: Callable[[dict[str, Any]], dict[str, Any]]
    weights: WeightNames
    # config.json hidden_act values the builders' MLP computes (Gemma's GeGLU is gelu-tanh),
    # and the key transformers reads it from (Gemma 2: hidden_activation).
    activations: tuple[str, ...] = ("silu",)
    activation_key: str = "hidden_act"
    # Whether the builders take head_dim (Gemma's is not hidden_size / num_attention_heads).
    own_head_dim: bool = False
    # Whether the output projection is the embeddings whatever the builder's arguments (Gemma's
    # builders take no tie_word_embeddings).
    always_tied: bool = False
    # Whether its attention takes flex attention's block mask, the mask of packs on a GPU
    # (torchtune's Gemma 2 attention raises NotImplementedError on one).
    block_mask: bool = True

    @property
    def builder(self) -> str:
        """The torchtune builder of the whole model."""
        return next(iter(self.builders))

    @property
    def lora_builder(self) -> str:
        """The builder's LoRA twin."""
        return self.builders[self.builder]


def head_dim(config: dict[str, Any]) -> int:
    """Channels per attention head: config.json's head_dim, else hidden_size / heads."""
    return config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]


def attention_dims(config: dict[str, Any]) -> AttentionDims:
    """The attention shape of a config.json, for the weight converters."""
    return AttentionDims(
        num_heads=config["num_attention_heads"],
        num_kv_heads=config["num_key_value_heads"],
        head_dim=head_dim(config),
    )


def rope(config: dict[str, Any]) -> dict[str, Any]:
    """RoPE settings, from transformers 5's rope_parameters or 4's rope_theta + rope_scaling."""
    if config.get("rope_parameters"):
        return dict(config["rope_parameters"])
    return {**(config.get("rope_scaling") or {}), "rope_theta": config["rope_theta"]}


def rope_type(rope: dict[str, Any]) -> str:
    """The RoPE scaling type of `rope` settings; default without scaling."""
    return rope.get("rope_type") or rope.get("type") or "default"


def cut_at_window(config: dict[str, Any], builder: str) -> dict[str, Any]:
    """{"max_seq_len": window} where config.json's sliding window is shorter than the context.

    torchtune's `builder` attends to the whole sequence: the same model as the window's for
    sequences up to the window, so sequences are cut there (Phi-3 mini: 2047, Mistral v0.1: 4096).
    """
    window = config.get("sliding_window")
    if window is None or window >= config["max_position_embeddings"]:
        return {}
    warnings.warn(
        f"sequences are truncated to sliding_window={window} tokens: torchtune's {builder} "
        "attends to the whole sequence, which is the same model up to the window",
        stacklevel=3,
    )
    return {"max_seq_len": window}
