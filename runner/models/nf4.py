"""QLoRA's NF4 base for torchtune's models (torchao): which base projections quantize, in which
blocks, and the quantization itself.

torchao's NF4 quantizes a weight in blocks of 64 and its per-block scalers again in blocks of 256
(16384 weights), whole blocks only. A projection whose blocks of 64 do not divide into scaler
blocks of 256 (SmolLM2's 576 x 576 has 5184 blocks) takes the largest scaler block under 256 that
divides them (216): the same 4 bits a weight, a few more bytes of scalers. One that is not whole
blocks of 64 stays in the compute dtype. Sharded over several processes (FSDP2), each rank's share
must be whole scaler blocks of 256, as torchao shards them; a projection that is not stays in the
compute dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

NF4_BLOCK = 64
SCALER_BLOCK = 256
# torchtune's module names in Hugging Face's words (the names a user's config.json model has).
HF_NAMES = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj", "output_proj": "o_proj"}


@dataclass(frozen=True)
class Projection:
    """One frozen base projection of a QLoRA model and how its weight is kept."""

    name: str
    shape: tuple[int, int]
    # The scaler block its NF4 weight uses; None: kept in the compute dtype.
    scaler_block: int | None


def scaler_block(numel: int, world_size: int) -> int | None:
    """The scaler block NF4 quantizes a weight of `numel` weights with, sharded over
    `world_size` processes; None where it cannot (the weight stays in the compute dtype)."""
    if numel % NF4_BLOCK:
        return None
    blocks = numel // NF4_BLOCK
    if world_size > 1:
        return SCALER_BLOCK if blocks % (SCALER_BLOCK * world_size) == 0 else None
    return max(size for size in range(1, SCALER_BLOCK + 1) if blocks % size == 0)


def base_projections(model: nn.Module, world_size: int) -> list[Projection]:
    """The projections torchtune's QLoRA keeps in NF4 (every linear of the decoder layers, and
    the output projection when it carries an adapter), each with its scaler block. Works on a
    model on the meta device."""
    from runner.models.torchtune_boundary import LoRALinear

    found = []
    for name, module in model.named_modules():
        if name.rpartition(".")[2] in ("lora_a", "lora_b") or not isinstance(
            module, nn.Linear | LoRALinear
        ):
            continue
        if not (name.startswith("layers.") or isinstance(module, LoRALinear)):
            continue
        rows, columns = module.weight.shape
        found.append(Projection(name, (rows, columns), scaler_block(rows * columns, world_size)))
    return found


def quantize_base(model: nn.Module, world_size: int) -> list[Projection]:
    """Quantizes in place, to NF4, each base projection that `scaler_block` allows (its weights
    already loaded); returns every base projection."""
    import torch

    from runner.models.torchtune_boundary import FrozenNF4Linear, LoRALinear, to_nf4

    projections = base_projections(model, world_size)
    for projection in projections:
        if projection.scaler_block is None:
            continue
        module = model.get_submodule(projection.name)
        base = module.weight
        assert isinstance(base, torch.Tensor), "a linear projection's weight"
        weight = to_nf4(base.detach(), NF4_BLOCK, projection.scaler_block)
        if isinstance(module, LoRALinear):
            module.weight = nn.Parameter(weight, requires_grad=False)
            module._quantize_base = True
            continue
        frozen = FrozenNF4Linear(
            module.in_features,
            module.out_features,
            bias=module.bias is not None,
            device=base.device,
            dtype=base.dtype,
            block_size=NF4_BLOCK,
            scaler_block_size=projection.scaler_block,
        )
        frozen.weight = nn.Parameter(weight, requires_grad=False)
        if isinstance(module.bias, torch.Tensor):
            frozen.bias = nn.Parameter(module.bias.detach(), requires_grad=False)
        parent, _, child = projection.name.rpartition(".")
        setattr(model.get_submodule(parent), child, frozen)
    return projections


def describe(projections: list[Projection], world_size: int) -> str:
    """One line: which projections are in NF4 (with which scaler block) and which are not."""
    whole = (
        "blocks of 64 weights"
        if world_size == 1
        else f"blocks of {NF4_BLOCK} x {SCALER_BLOCK} weights on each of {world_size} processes"
    )
    kinds: dict[str, set[str]] = {}
    for projection in projections:
        if projection.scaler_block is None:
            how = f"in the compute dtype (not whole {whole})"
        else:
            how = f"in NF4 (blocks of 64, scalers in blocks of {projection.scaler_block})"
        rows, columns = projection.shape
        short = projection.name.split(".")[-1]
        kinds.setdefault(how, set()).add(f"{HF_NAMES.get(short, short)} {rows}x{columns}")
    return "; ".join(f"{how}: {', '.join(sorted(names))}" for how, names in kinds.items())
