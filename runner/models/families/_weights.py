"""Weight names and layouts between Hugging Face checkpoints and torchtune's modules.

Each family gives a table of Hugging Face names -> torchtune names ("{}" stands for the layer
number); the same table, read backwards, converts the other way, and PEFT's adapter names are
its module names with PEFT's suffixes.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AttentionDims:
    """A config.json's attention shape, as the weight converters need it."""

    num_heads: int
    num_kv_heads: int
    head_dim: int


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

    hf_to_tune: Mapping[str, str | tuple[str, ...]]
    # torchtune's Llama RoPE rotates adjacent pairs and Hugging Face's rotates halves, so the
    # rows of q_proj and k_proj are permuted between them; Qwen2 rotates halves on both sides.
    permute_qk: bool

    def to_tune(self, name: str) -> str:
        """The torchtune name of a Hugging Face weight that is not fused."""
        names = self.to_tune_parts(name)
        if len(names) != 1:
            raise KeyError(f"{name!r} holds {', '.join(names)}: fused on the Hugging Face side")
        return names[0]

    def to_tune_parts(self, name: str) -> tuple[str, ...]:
        """The torchtune weights one Hugging Face weight holds, in row order."""
        parts = _rename(name, {hf: _parts(tune) for hf, tune in self.hf_to_tune.items()})
        return tuple(parts.split("|"))

    def to_hf(self, name: str) -> str:
        """The Hugging Face weight that holds a torchtune one."""
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
        present = [part for part in parts if part is not None]
        assert len(present) == len(parts), f"{hf_name}: a fused part is missing"
        converted[hf_name] = present[0] if len(present) == 1 else torch.cat(present)
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
    """torchtune adapter names and layouts -> PEFT's, onto the Hugging Face model.

    Adapters of modules Hugging Face fuses (Phi-3's q/k/v in qkv_proj) become one adapter of
    the fused module: A stacks the parts' A, B holds each part's B on its own rows and rank
    columns (zeros for a part not adapted), so B @ A is each part's update on its rows. Its rank
    is the parts' sum; peft_config gives it the alpha that keeps alpha / rank.
    """
    converted = {}
    fused: dict[str, list[dict[str, torch.Tensor]]] = {}
    for name, value in state.items():
        module, suffix = _split(name, PEFT_SUFFIXES)
        heads = _qk_heads(name, dims)
        if names.permute_qk and heads and suffix == "lora_b.weight":
            value = pairs_to_halves(value, heads, dims.head_dim)
        hf_name, index, count = names.to_hf_part(f"{module}.weight")
        hf_module = hf_name.removesuffix(".weight")
        if count == 1:
            converted[f"{PEFT_PREFIX}{hf_module}.{PEFT_SUFFIXES[suffix]}"] = value
        elif suffix == "magnitude":
            raise FusedAdapterError(module, hf_name)
        else:
            fused.setdefault(hf_module, [{} for _ in range(count)])[index][suffix] = value
    for hf_module, parts in fused.items():
        rows = _rows(names.to_tune_parts(f"{hf_module}.weight"), dims, _present_rows(parts))
        a, b = _fuse_adapter(parts, rows)
        converted[f"{PEFT_PREFIX}{hf_module}.lora_A.weight"] = a
        converted[f"{PEFT_PREFIX}{hf_module}.lora_B.weight"] = b
    return converted


def _present_rows(parts: list[dict[str, torch.Tensor]]) -> int:
    """The fused weight's rows, for parts in equal shares (gate and up): from one part's B."""
    b = next(p["lora_b.weight"] for p in parts if p)
    return b.shape[0] * len(parts)


def _fuse_adapter(
    parts: list[dict[str, torch.Tensor]], rows: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    present = next(p for p in parts if p)
    rank, width = present["lora_a.weight"].shape
    dtype = present["lora_a.weight"].dtype
    a = torch.zeros(rank * len(parts), width, dtype=dtype)
    b = torch.zeros(sum(rows), rank * len(parts), dtype=dtype)
    start = 0
    for index, (part, count) in enumerate(zip(parts, rows, strict=True)):
        if part:
            a[index * rank : (index + 1) * rank] = part["lora_a.weight"]
            b[start : start + count, index * rank : (index + 1) * rank] = part["lora_b.weight"]
        start += count
    return a, b


def from_peft(
    state: dict[str, torch.Tensor], names: WeightNames, dims: AttentionDims
) -> dict[str, torch.Tensor]:
    """PEFT adapter names and layouts -> torchtune's: the inverse of to_peft (a fused module's
    parts whose A is all zeros were not adapted, and are left out)."""
    ours = {peft: tune for tune, peft in PEFT_SUFFIXES.items()}
    converted = {}
    for name, value in state.items():
        hf_module, suffix = _split(name.removeprefix(PEFT_PREFIX), ours)
        modules = [n.removesuffix(".weight") for n in names.to_tune_parts(f"{hf_module}.weight")]
        if len(modules) > 1:
            converted.update(_unfuse_adapter(state, name, modules, suffix, dims))
            continue
        tune_name = f"{modules[0]}.{ours[suffix]}"
        heads = _qk_heads(tune_name, dims)
        if names.permute_qk and heads and suffix == "lora_B.weight":
            value = halves_to_pairs(value, heads, dims.head_dim)
        converted[tune_name] = value
    return converted


def _unfuse_adapter(
    state: dict[str, torch.Tensor],
    name: str,
    modules: list[str],
    suffix: str,
    dims: AttentionDims,
) -> dict[str, torch.Tensor]:
    """One fused module's A or B -> its parts' (the inverse of _fuse_adapter)."""
    a = state[name.replace("lora_B.weight", "lora_A.weight")]
    rank = a.shape[0] // len(modules)
    b = state[name.replace("lora_A.weight", "lora_B.weight")]
    rows = _rows(tuple(f"{m}.weight" for m in modules), dims, b.shape[0])
    converted, start = {}, 0
    for index, (module, count) in enumerate(zip(modules, rows, strict=True)):
        ranks = slice(index * rank, (index + 1) * rank)
        if a[ranks].any():
            if suffix == "lora_A.weight":
                converted[f"{module}.lora_a.weight"] = a[ranks]
            else:
                converted[f"{module}.lora_b.weight"] = b[start : start + count, ranks]
        start += count
    return converted


def peft_config(config: dict, names: WeightNames) -> dict:
    """PEFT's adapter_config.json for the Hugging Face model: targets that Hugging Face fuses
    become the fused module, its rank and alpha the parts' sum (the same alpha / rank)."""
    targets = list(config["target_modules"])
    short = {hf: hf.split(".")[-2] for hf in names.hf_to_tune}
    llama = {tune: hf for hf, tune in LLAMA_NAMES.items()}
    rank_pattern, alpha_pattern = dict(config.get("rank_pattern") or {}), {}
    for hf, tune in names.hf_to_tune.items():
        if isinstance(tune, str):
            continue
        parts = [llama[t].split(".")[-2] for t in tune]
        if any(p in targets for p in parts):
            targets = [t for t in targets if t not in parts] + [short[hf]]
            rank_pattern[short[hf]] = config["r"] * len(parts)
            alpha_pattern[short[hf]] = config["lora_alpha"] * len(parts)
    if not alpha_pattern:
        return config
    alpha_pattern = {**(config.get("alpha_pattern") or {}), **alpha_pattern}
    return {
        **config,
        "target_modules": targets,
        "rank_pattern": rank_pattern,
        "alpha_pattern": alpha_pattern,
    }
