"""config.json <-> a family's torchtune builder arguments, both directions."""

from __future__ import annotations

import inspect
import math
from typing import Any

from runner.components import resolve_component
from runner.errors import UserError
from runner.models.families._family import SHARED_ARGS, Family, Unsupported, head_dim, rope


def builder_component(family: Family, builder: dict[str, Any]) -> str:
    """The torchtune builder of a builder node: its _component_, one of the family's builders,
    or the family's first builder when it names none."""
    component = builder.get("_component_") or family.builder
    if component not in family.builders:
        raise UserError(
            "model.builder._component_",
            component,
            f"the {family.name} family builds with {', '.join(family.builders)}; name one of "
            "them or leave _component_ out",
        )
    return component


def unbuilt_setting(family: Family, config: dict[str, Any]) -> str | None:
    """The config.json setting that torchtune's builder of `family` does not build
    (`attention_bias=true`, another RoPE scaling), or None where it builds the model."""
    try:
        activation = config.get(family.activation_key)
        if activation not in family.activations:
            raise Unsupported(f"{family.activation_key}={activation}")
        dim = head_dim(config)
        if not family.own_head_dim and dim * config["num_attention_heads"] != config["hidden_size"]:
            raise Unsupported(f"head_dim={dim} (not hidden_size / num_attention_heads)")
        family.extra_args(config)
    except Unsupported as err:
        return str(err)
    return None


def builder_args(family: Family, config: dict[str, Any], source: str) -> dict[str, Any]:
    """The builder arguments (without _component_) that build the model a config.json describes."""
    unbuilt = unbuilt_setting(family, config)
    if unbuilt is not None:
        # model.backend=auto sends such a source to transformers (runner.config.model).
        raise UserError(
            "model.source",
            source,
            f"its config.json sets {unbuilt}, which torchtune's {family.name} builder does not "
            "build; model=hf with model.backend=auto trains it through transformers' own class",
        )
    args = {ours: config[theirs] for ours, theirs in SHARED_ARGS.items()}
    return {**args, "rope_base": rope(config)["rope_theta"], **family.extra_args(config)}


def full_builder_args(family: Family, builder: dict[str, Any]) -> dict[str, Any]:
    """A builder node's arguments with the builder's own defaults filled in."""
    component = builder_component(family, builder)
    function = resolve_component(component, "model.builder._component_")
    defaults = {
        name: p.default
        for name, p in inspect.signature(function).parameters.items()
        if p.default is not inspect.Parameter.empty
    }
    args = {k: v for k, v in builder.items() if k != "_component_"}
    return {"tie_word_embeddings": False, **defaults, **args}


def ties_embeddings(family: Family, builder: dict[str, Any]) -> bool:
    """Whether a builder node's model ties its output projection to the embeddings."""
    return family.always_tied or bool(full_builder_args(family, builder)["tie_word_embeddings"])


def check_source_matches(
    family: Family, builder: dict[str, Any], derived: dict[str, Any], source: str
) -> None:
    """A UserError naming model.source when the builder would not build the source's model.

    max_seq_len may differ: it sizes the RoPE cache and the truncation, not the weights.
    """
    ours = full_builder_args(family, builder)
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
    args = full_builder_args(family, builder)
    return {
        "architectures": [family.architecture],
        "model_type": family.model_type,
        **{theirs: args[ours] for ours, theirs in SHARED_ARGS.items()},
        "head_dim": args["embed_dim"] // args["num_heads"],
        "hidden_act": family.activations[0],
        "rope_theta": float(args["rope_base"]),
        "tie_word_embeddings": args["tie_word_embeddings"],
        # Last, so that a family sets what its builders fix (Gemma: head_dim, tied embeddings).
        **family.extra_config(args),
        "initializer_range": initializer_range,
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
        "torch_dtype": "float32",
    }
