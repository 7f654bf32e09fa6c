"""Weight names and layouts between Hugging Face checkpoints and torchtune's modules.

Each family gives a table of Hugging Face names -> torchtune names ("{}" stands for the layer
number); the same table, read backwards, converts the other way, and PEFT's adapter names are
its module names with PEFT's suffixes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from runner.families._family import AttentionDims

# The decoder layout Llama set out, which Mistral and Qwen2 follow.
LLAMA_NAMES = {
    "model.embed_tokens.weight": "tok_embeddings.weight",
    "model.layers.{}.self_attn.q_proj.weight": "layers.{}.attn.q_proj.weight",
    "model.layers.{}.self_attn.k_proj.weight": "layers.{}.attn.k_proj.weight",
    "model.layers.{}.self_attn.v_proj.weight": "layers.{}.attn.v_proj.weight",
    "model.layers.{}.self_attn.o_proj.weight": "layers.{}.attn.output_proj.weight",
    "model.layers.{}.mlp.gate_proj.weight": "layers.{}.mlp.w1.weight",
    "model.layers.{}.mlp.up_proj.weight": "layers.{}.mlp.w3.weight",
    "model.layers.{}.mlp.down_proj.weight": "layers.{}.mlp.w2.weight",
    "model.layers.{}.input_layernorm.weight": "layers.{}.sa_norm.scale",
    "model.layers.{}.post_attention_layernorm.weight": "layers.{}.mlp_norm.scale",
    "model.norm.weight": "norm.scale",
    "lm_head.weight": "output.weight",
}
# The output projection of a model whose embeddings are tied: not a weight of its own.
TIED = ("lm_head.weight", "output.weight")
# torchtune's LoRA parameter suffix -> PEFT's, after the module name.
PEFT_SUFFIXES = {
    "lora_a.weight": "lora_A.weight",
    "lora_b.weight": "lora_B.weight",
    "magnitude": "lora_magnitude_vector",
}
PEFT_PREFIX = "base_model.model."
_LAYER = re.compile(r"\.(\d+)\.")


@dataclass(frozen=True)
class WeightNames:
    """One family's weight names, and whether q/k rows change order between the two sides.

    A Hugging Face weight may stand for several torchtune ones (Phi-3's qkv_proj holds q_proj,
    k_proj and v_proj rows, one after the other): its table entry is then a tuple.
    """

    hf_to_tune: dict[str, str | tuple[str, ...]]
    # torchtune's Llama RoPE rotates adjacent pairs and Hugging Face's rotates halves, so the
    # rows of q_proj and k_proj are permuted between them; Qwen2 rotates halves on both sides.
    permute_qk: bool

    def to_tune(self, name: str) -> str:
        names = self.to_tune_parts(name)
        if len(names) != 1:
            raise KeyError(f"{name!r} holds {', '.join(names)}: fused on the Hugging Face side")
        return names[0]

    def to_tune_parts(self, name: str) -> tuple[str, ...]:
        """The torchtune weights one Hugging Face weight holds, in row order."""
        parts = _rename(name, {hf: _parts(tune) for hf, tune in self.hf_to_tune.items()})
        return tuple(parts.split("|"))

    def to_hf(self, name: str) -> str:
        return self.to_hf_part(name)[0]

    def to_hf_part(self, name: str) -> tuple[str, int, int]:
        """The Hugging Face weight holding a torchtune one, its place and the number of parts."""
        table = {}
        for hf, tune in self.hf_to_tune.items():
            parts = (tune,) if isinstance(tune, str) else tune
            table.update({part: f"{hf}|{i}|{len(parts)}" for i, part in enumerate(parts)})
        hf, index, count = _rename(name, table).split("|")
        return hf, int(index), int(count)


def _parts(tune: str | tuple[str, ...]) -> str:
    return tune if isinstance(tune, str) else "|".join(tune)


def _rename(name: str, table: dict[str, str]) -> str:
    match = _LAYER.search(name)
    pattern = f"{name[: match.start()]}.{{}}.{name[match.end() :]}" if match else name
    if pattern not in table:
        raise KeyError(f"unexpected weight {name!r}: not a weight of this model family")
    return (
        table[pattern].format(*[match.group(1)] * table[pattern].count("{}"))
        if match
        else (table[pattern])
    )


def _rows(tune_names: tuple[str, ...], dims: AttentionDims, total: int) -> list[int]:
    """Row counts of the torchtune weights fused in one Hugging Face weight of `total` rows:
    q/k/v by their head counts, any other parts (gate and up) in equal shares."""
    heads = [
        _qk_heads(n, dims) or (dims.num_kv_heads if ".attn.v_proj." in n else 0) for n in tune_names
    ]
    if all(heads):
        return [h * dims.head_dim for h in heads]
    return [total // len(tune_names)] * len(tune_names)


def pairs_to_halves(rows: torch.Tensor, heads: int, head_dim: int) -> torch.Tensor:
    """Per head, torchtune's adjacent-pair row order -> Hugging Face's rotate-halves order."""
    return rows.view(heads, head_dim // 2, 2, -1).transpose(1, 2).reshape(rows.shape)


def halves_to_pairs(rows: torch.Tensor, heads: int, head_dim: int) -> torch.Tensor:
    """Per head, Hugging Face's rotate-halves row order -> torchtune's adjacent pairs."""
    return rows.view(heads, 2, head_dim // 2, -1).transpose(1, 2).reshape(rows.shape)


def _qk_heads(tune_name: str, dims: AttentionDims) -> int | None:
    """The head count whose rows a torchtune q/k weight (or LoRA B) holds; None for others."""
    if ".attn.q_proj." in tune_name:
        return dims.num_heads
    if ".attn.k_proj." in tune_name:
        return dims.num_kv_heads
    return None


def to_tune(
    state: dict[str, torch.Tensor], names: WeightNames, dims: AttentionDims, *, tied: bool
) -> dict[str, torch.Tensor]:
    """Hugging Face names and layouts -> torchtune's."""
    converted = {}
    for name, value in state.items():
        if name.endswith("rotary_emb.inv_freq") or (tied and name in TIED):
            continue
        tune_names = names.to_tune_parts(name)
        pieces = (
            value.split(_rows(tune_names, dims, value.shape[0])) if len(tune_names) > 1 else [value]
        )
        for tune_name, piece in zip(tune_names, pieces, strict=True):
            heads = _qk_heads(tune_name, dims)
            if names.permute_qk and heads and tune_name.endswith(".weight"):
                piece = halves_to_pairs(piece, heads, dims.head_dim)
            converted[tune_name] = piece
    return converted


def to_hf(
    state: dict[str, torch.Tensor], names: WeightNames, dims: AttentionDims, *, tied: bool
) -> dict[str, torch.Tensor]:
    """torchtune names and layouts -> Hugging Face's: the inverse of to_tune."""
    converted: dict[str, torch.Tensor] = {}
    fused: dict[str, list[torch.Tensor | None]] = {}
    for name, value in state.items():
        if tied and name in TIED:
            continue
        heads = _qk_heads(name, dims)
        if names.permute_qk and heads and name.endswith(".weight"):
            value = pairs_to_halves(value, heads, dims.head_dim)
        hf_name, index, count = names.to_hf_part(name)
        fused.setdefault(hf_name, [None] * count)[index] = value
    for hf_name, parts in fused.items():
        assert all(p is not None for p in parts), f"{hf_name}: a fused part is missing"
        converted[hf_name] = parts[0] if len(parts) == 1 else torch.cat(parts)
    return converted


class FusedAdapterError(ValueError):
    """A torchtune adapter of a module that Hugging Face's model fuses with others."""

    def __init__(self, module: str, hf_name: str) -> None:
        super().__init__(
            f"{module} is part of {hf_name} in the Hugging Face model, which a PEFT adapter "
            "of the same rank cannot hold"
        )


def _split(name: str, suffixes: dict[str, str]) -> tuple[str, str]:
    for suffix in suffixes:
        if name.endswith(f".{suffix}"):
            return name.removesuffix(f".{suffix}"), suffix
    raise KeyError(f"unexpected adapter weight {name!r}: not a LoRA parameter")


def to_peft(
    state: dict[str, torch.Tensor], names: WeightNames, dims: AttentionDims
) -> dict[str, torch.Tensor]:
    """torchtune adapter names and layouts -> PEFT's, onto the Hugging Face model."""
    converted = {}
    for name, value in state.items():
        module, suffix = _split(name, PEFT_SUFFIXES)
        heads = _qk_heads(name, dims)
        if names.permute_qk and heads and suffix == "lora_b.weight":
            value = pairs_to_halves(value, heads, dims.head_dim)
        hf_name, _, count = names.to_hf_part(f"{module}.weight")
        if count > 1:
            raise FusedAdapterError(module, hf_name)
        hf_module = hf_name.removesuffix(".weight")
        converted[f"{PEFT_PREFIX}{hf_module}.{PEFT_SUFFIXES[suffix]}"] = value
    return converted


def from_peft(
    state: dict[str, torch.Tensor], names: WeightNames, dims: AttentionDims
) -> dict[str, torch.Tensor]:
    """PEFT adapter names and layouts -> torchtune's: the inverse of to_peft."""
    ours = {peft: tune for tune, peft in PEFT_SUFFIXES.items()}
    converted = {}
    for name, value in state.items():
        hf_module, suffix = _split(name.removeprefix(PEFT_PREFIX), ours)
        module = names.to_tune(f"{hf_module}.weight").removesuffix(".weight")
        tune_name = f"{module}.{ours[suffix]}"
        heads = _qk_heads(tune_name, dims)
        if names.permute_qk and heads and suffix == "lora_B.weight":
            value = halves_to_pairs(value, heads, dims.head_dim)
        converted[tune_name] = value
    return converted
