"""The attention mask of a batch whose rows hold several samples (packs, padding-free rows):
each position sees the earlier positions of its own sample only."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from torch.nn.attention.flex_attention import BlockMask


def takes_block_mask(model: nn.Module, device: torch.device) -> bool:
    """Whether `model`'s attention runs flex attention over a BlockMask on `device`: torchtune's
    attention does where flex is supported (CUDA, compute capability 7.5 and up), except Gemma
    2's, which takes no block mask (and gets the dense one)."""
    from runner.models.torchtune_boundary import SUPPORTS_FLEX_ATTENTION, Gemma2Attention

    if device.type != "cuda" or not SUPPORTS_FLEX_ATTENTION:
        return False
    return not any(isinstance(module, Gemma2Attention) for module in model.modules())


def _documents(input_pos: torch.Tensor) -> torch.Tensor:
    """Each position's sample: the count of sample starts up to it (PackedDataset's padding,
    whose positions go on from its last sample's, joins that sample and is never trained)."""
    return (input_pos == 0).cumsum(dim=1)


def dense_block_causal_mask(input_pos: torch.Tensor) -> torch.Tensor:
    """The [rows, s, s] boolean block-causal mask that SDPA takes, of rows whose samples'
    positions each start at 0, on input_pos's device."""
    document = _documents(input_pos)
    width = document.shape[1]
    causal = torch.ones(width, width, dtype=torch.bool, device=input_pos.device).tril()
    return (document[:, :, None] == document[:, None, :]) & causal


def block_causal_mask(input_pos: torch.Tensor, *, flex: bool) -> torch.Tensor | BlockMask:
    """The block-causal mask of rows whose samples' positions each start at 0, on input_pos's
    device: a flex-attention BlockMask (`flex`: only the blocks that hold a visible position
    are computed), else the dense mask."""
    if not flex:
        return dense_block_causal_mask(input_pos)
    from torch.nn.attention.flex_attention import create_block_mask

    document = _documents(input_pos)
    rows, width = document.shape

    def mask_mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return (q_idx >= kv_idx) & (document[b, q_idx] == document[b, kv_idx])

    return create_block_mask(mask_mod, rows, None, width, width, device=input_pos.device.type)


def model_inputs(batch: dict[str, Any], device: torch.device, *, flex: bool) -> dict[str, Any]:
    """The batch's mask and input_pos on `device`, where it has them; a batch of packed rows
    without a mask (collated for CUDA) gets its block-causal mask built there."""
    inputs: dict[str, Any] = {
        key: batch[key].to(device) for key in ("mask", "input_pos") if key in batch
    }
    if "input_pos" in inputs and "mask" not in inputs:
        inputs["mask"] = block_causal_mask(inputs["input_pos"], flex=flex)
    return inputs
