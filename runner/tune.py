"""The boundary to torchtune: every torchtune import in runner and recipes/ goes through here.

torchtune is pinned at 0.6.1 and no longer developed; swapping one of these pieces for another
library's touches this file only.
"""

from __future__ import annotations

from torch import nn
from torchtune.data import (
    CROSS_ENTROPY_IGNORE_IDX,
    Message,
    OpenAIToMessages,
    ShareGPTToMessages,
    padded_collate_packed,
    padded_collate_sft,
)
from torchtune.data._utils import truncate
from torchtune.datasets import PackedDataset
from torchtune.datasets._sft import SFTTransform
from torchtune.models.convert_weights import hf_to_tune as llama_hf_to_tune
from torchtune.models.convert_weights import tune_to_hf as llama_tune_to_hf
from torchtune.models.qwen2 import qwen2_hf_to_tune, qwen2_tune_to_hf
from torchtune.modules import TransformerDecoder, TransformerSelfAttentionLayer
from torchtune.modules.attention_utils import create_block_causal_mask
from torchtune.training import set_activation_checkpointing, set_default_dtype
from torchtune.training.lr_schedulers import get_cosine_schedule_with_warmup

__all__ = [
    "CROSS_ENTROPY_IGNORE_IDX",
    "Message",
    "OpenAIToMessages",
    "PackedDataset",
    "SFTTransform",
    "ShareGPTToMessages",
    "TransformerDecoder",
    "TransformerSelfAttentionLayer",
    "create_block_causal_mask",
    "get_cosine_schedule_with_warmup",
    "init_like_hf",
    "llama_hf_to_tune",
    "llama_tune_to_hf",
    "padded_collate_packed",
    "padded_collate_sft",
    "qwen2_hf_to_tune",
    "qwen2_tune_to_hf",
    "set_activation_checkpointing",
    "set_default_dtype",
    "truncate",
]


def init_like_hf(model: nn.Module, initializer_range: float) -> None:
    """Hugging Face's init: N(0, initializer_range) for linear and embedding weights, zero biases.

    torchtune's builders leave embeddings at N(0, 1), which starts the loss near 240.
    """
    for module in model.modules():
        if isinstance(module, nn.Linear | nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=initializer_range)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)
