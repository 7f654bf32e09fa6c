"""The model families runner fine-tunes: what each one's config.json, builder and weights are.

One row per family. A Hugging Face checkpoint's config.json names its family (`model_type`);
the row says which torchtune builder builds it, how config.json maps to the builder's
arguments and back, and how its weights convert between Hugging Face's names and torchtune's.
The chat format is the tokenizer's (runner/tokenizer.py reads it from the chat template).
"""

from __future__ import annotations

import inspect
import json
import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from runner import tune
from runner.components import resolve_component
from runner.errors import UserError

# torchtune builder -> its LoRA twin (same arguments plus the LoRA ones).
LORA_BUILDERS = {
    "torchtune.models.llama3_2.llama3_2": "torchtune.models.llama3_2.lora_llama3_2",
    "torchtune.models.llama3_1.llama3_1": "torchtune.models.llama3_1.lora_llama3_1",
    "torchtune.models.qwen2.qwen2": "torchtune.models.qwen2.lora_qwen2",
    "torchtune.models.mistral.mistral": "torchtune.models.mistral.lora_mistral",
}
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
# torchtune's Llama3ScaledRoPE has these fixed; a config.json with others needs another model.
LLAMA3_ROPE = {
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


@dataclass(frozen=True)
class Family:
    """What runner knows about one model family."""

    name: str
    model_type: str  # config.json's model_type
    architecture: str  # config.json's architectures[0]
    builder: str  # the torchtune builder for a checkpoint of this family
    tied_embeddings: bool  # whether the builder takes tie_word_embeddings
    # config.json -> builder arguments beyond SHARED_ARGS and rope_base (raises what's unsupported)
    extra_args: Callable[[dict[str, Any]], dict[str, Any]]
    # builder arguments -> config.json keys beyond the shared ones (for a random-init model)
    extra_config: Callable[[dict[str, Any]], dict[str, Any]]
    hf_to_tune: Callable[..., dict[str, torch.Tensor]]
    tune_to_hf: Callable[..., dict[str, Any]]

    @property
    def lora_builder(self) -> str:
        return LORA_BUILDERS[self.builder]


class Unsupported(ValueError):
    """A config.json setting that the family's torchtune builder does not build."""


def _head_dim(config: dict[str, Any]) -> int:
    return config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]


def _rope(config: dict[str, Any]) -> dict[str, Any]:
    """RoPE settings, from transformers 5's rope_parameters or 4's rope_theta + rope_scaling."""
    if config.get("rope_parameters"):
        return dict(config["rope_parameters"])
    return {**(config.get("rope_scaling") or {}), "rope_theta": config["rope_theta"]}


def _rope_type(rope: dict[str, Any]) -> str:
    return rope.get("rope_type") or rope.get("type") or "default"


def _llama3_args(config: dict[str, Any]) -> dict[str, Any]:
    rope = _rope(config)
    for key in ("attention_bias", "mlp_bias"):
        if config.get(key):
            raise Unsupported(f"{key}=true")
    if _rope_type(rope) == "default":
        # Llama3ScaledRoPE with factor 1 leaves every frequency as it is.
        return {"scale_factor": 1, "tie_word_embeddings": config["tie_word_embeddings"]}
    if _rope_type(rope) != "llama3" or any(
        not math.isclose(rope[k], v) for k, v in LLAMA3_ROPE.items()
    ):
        raise Unsupported(f"rope scaling {rope}")
    return {"scale_factor": rope["factor"], "tie_word_embeddings": config["tie_word_embeddings"]}


def _llama3_config(builder: dict[str, Any]) -> dict[str, Any]:
    return {
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": float(builder["scale_factor"]),
            **LLAMA3_ROPE,
        },
        "attention_bias": False,
        "mlp_bias": False,
    }


def _qwen2_args(config: dict[str, Any]) -> dict[str, Any]:
    if _rope_type(_rope(config)) != "default":
        raise Unsupported(f"rope scaling {_rope(config)}")
    if config.get("use_sliding_window"):
        raise Unsupported("use_sliding_window=true")
    return {"tie_word_embeddings": config["tie_word_embeddings"]}


def _mistral_args(config: dict[str, Any]) -> dict[str, Any]:
    if _rope_type(_rope(config)) != "default":
        raise Unsupported(f"rope scaling {_rope(config)}")
    if config["tie_word_embeddings"]:
        raise Unsupported("tie_word_embeddings=true")
    if config.get("sliding_window") is not None:
        warnings.warn(
            f"sliding_window={config['sliding_window']} is ignored: torchtune's mistral attends "
            "to the whole sequence (the same model for sequences up to the window)",
            stacklevel=2,
        )
    return {}


def _llama_weights(convert: Callable[..., dict[str, Any]]) -> Callable[..., dict[str, Any]]:
    """Llama's converters permute q/k for torchtune's RoPE; drop a tied output projection."""

    def run(state: dict[str, Any], *, tie_word_embeddings: bool, **dims: Any) -> dict[str, Any]:
        if tie_word_embeddings:
            state = {k: v for k, v in state.items() if k not in ("lm_head.weight", "output.weight")}
        return convert(state, **dims)

    return run


FAMILIES = {
    family.name: family
    for family in (
        Family(
            name="llama3",
            model_type="llama",
            architecture="LlamaForCausalLM",
            builder="torchtune.models.llama3_2.llama3_2",
            tied_embeddings=True,
            extra_args=_llama3_args,
            extra_config=_llama3_config,
            hf_to_tune=_llama_weights(tune.llama_hf_to_tune),
            tune_to_hf=_llama_weights(tune.llama_tune_to_hf),
        ),
        Family(
            name="qwen2",
            model_type="qwen2",
            architecture="Qwen2ForCausalLM",
            builder="torchtune.models.qwen2.qwen2",
            tied_embeddings=True,
            extra_args=_qwen2_args,
            extra_config=lambda builder: {"use_sliding_window": False, "sliding_window": None},
            hf_to_tune=tune.qwen2_hf_to_tune,
            tune_to_hf=tune.qwen2_tune_to_hf,
        ),
        Family(
            name="mistral",
            model_type="mistral",
            architecture="MistralForCausalLM",
            builder="torchtune.models.mistral.mistral",
            tied_embeddings=False,
            extra_args=_mistral_args,
            extra_config=lambda builder: {"sliding_window": None},
            hf_to_tune=_llama_weights(tune.llama_hf_to_tune),
            tune_to_hf=_llama_weights(tune.llama_tune_to_hf),
        ),
    )
}
BY_MODEL_TYPE = {family.model_type: family for family in FAMILIES.values()}


def family_named(name: str, key: str = "model.family") -> Family:
    if name not in FAMILIES:
        raise UserError(key, name, f"choose one of: {', '.join(FAMILIES)}")
    return FAMILIES[name]


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


def builder_args(family: Family, config: dict[str, Any], source: str) -> dict[str, Any]:
    """The builder arguments (without _component_) that build the model a config.json describes."""
    head_dim = _head_dim(config)
    try:
        if config["hidden_act"] != "silu":
            raise Unsupported(f"hidden_act={config['hidden_act']}")
        if head_dim * config["num_attention_heads"] != config["hidden_size"]:
            raise Unsupported(f"head_dim={head_dim} (not hidden_size / num_attention_heads)")
        extra = family.extra_args(config)
    except Unsupported as err:
        raise UserError(
            "model.source",
            source,
            f"its config.json sets {err}, which torchtune's {family.name} builder does not "
            "build; fine-tune a checkpoint without it",
        ) from err
    args = {ours: config[theirs] for ours, theirs in SHARED_ARGS.items()}
    return {**args, "rope_base": _rope(config)["rope_theta"], **extra}


def full_builder_args(builder: dict[str, Any]) -> dict[str, Any]:
    """A builder node's arguments with the builder's own defaults filled in."""
    function = resolve_component(builder["_component_"], "model.builder._component_")
    defaults = {
        name: p.default
        for name, p in inspect.signature(function).parameters.items()
        if p.default is not inspect.Parameter.empty
    }
    args = {k: v for k, v in builder.items() if k != "_component_"}
    return {"tie_word_embeddings": False, **defaults, **args}


def check_source_matches(builder: dict[str, Any], derived: dict[str, Any], source: str) -> None:
    """A UserError naming model.source when the builder would not build the source's model.

    max_seq_len may differ: it sizes the RoPE cache and the truncation, not the weights.
    """
    ours = full_builder_args(builder)
    for key, theirs in derived.items():
        if key == "max_seq_len":
            continue
        mine = ours.get(key)
        same = mine == theirs or (
            isinstance(mine, int | float)
            and isinstance(theirs, int | float)
            and math.isclose(mine, theirs, rel_tol=1e-9)
        )
        if not same:
            raise UserError(
                "model.source",
                source,
                f"its config.json gives {key}={theirs} but model.builder.{key}={mine}; pick the "
                "model option of this checkpoint, or model=hf to build what the source describes",
            )


def hf_config(
    family: Family,
    builder: dict[str, Any],
    *,
    initializer_range: float,
    bos_token_id: int | None,
    eos_token_id: int,
) -> dict[str, Any]:
    """The config.json of the Hugging Face model equal to a builder's (for random init)."""
    args = full_builder_args(builder)
    config = {
        "architectures": [family.architecture],
        "model_type": family.model_type,
        **{theirs: args[ours] for ours, theirs in SHARED_ARGS.items()},
        "head_dim": args["embed_dim"] // args["num_heads"],
        "hidden_act": "silu",
        "rope_theta": float(args["rope_base"]),
        **family.extra_config(args),
        "tie_word_embeddings": args["tie_word_embeddings"],
        "initializer_range": initializer_range,
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
        "torch_dtype": "float32",
    }
    return config


def _weight_dims(config: dict[str, Any]) -> dict[str, Any]:
    config = complete_config(config)
    return {
        "num_heads": config["num_attention_heads"],
        "num_kv_heads": config["num_key_value_heads"],
        "dim": config["hidden_size"],
        "head_dim": _head_dim(config),
        "tie_word_embeddings": config["tie_word_embeddings"],
    }


def hf_to_tune(state: dict[str, torch.Tensor], config: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Hugging Face parameter names and layouts -> torchtune's, for the config's family."""
    family = BY_MODEL_TYPE[config["model_type"]]
    return family.hf_to_tune(state, **_weight_dims(config))


def tune_to_hf(state: dict[str, torch.Tensor], config: dict[str, Any]) -> dict[str, torch.Tensor]:
    """torchtune parameter names and layouts -> Hugging Face's, for the config's family."""
    family = BY_MODEL_TYPE[config["model_type"]]
    return family.tune_to_hf(state, **_weight_dims(config))
