"""The boundary to torchtune: every torchtune import in runner and recipes/ goes through here.

torchtune is pinned at 0.6.1 and no longer developed; swapping one of these pieces for another
library's touches this file only.
"""

from __future__ import annotations

from typing import Any

import torch
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
from torchtune.models import convert_weights
from torchtune.models.convert_weights import _FROM_HF, _TO_PEFT_KEYS, get_mapped_key
from torchtune.models.convert_weights import hf_to_tune as llama_hf_to_tune
from torchtune.models.convert_weights import tune_to_hf as llama_tune_to_hf
from torchtune.models.qwen2 import qwen2_hf_to_tune, qwen2_tune_to_hf
from torchtune.modules import TransformerDecoder, TransformerSelfAttentionLayer
from torchtune.modules.attention_utils import create_block_causal_mask
from torchtune.modules.peft import (
    get_adapter_params,
    get_adapter_state_dict,
    get_lora_module_names,
    get_merged_lora_ckpt,
    set_trainable_params,
)
from torchtune.training import (
    gather_cpu_state_dict,
    set_activation_checkpointing,
    set_default_dtype,
)
from torchtune.training.lr_schedulers import get_cosine_schedule_with_warmup

__all__ = [
    "CROSS_ENTROPY_IGNORE_IDX",
    "gather_cpu_state_dict",
    "get_adapter_params",
    "get_adapter_state_dict",
    "get_merged_lora_ckpt",
    "peft_adapter_config",
    "peft_to_tune",
    "set_trainable_params",
    "tune_to_peft",
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


def _dims(config: dict[str, Any]) -> dict[str, int]:
    """A Hugging Face config.json's attention dimensions, as torchtune's converters take them."""
    heads = config["num_attention_heads"]
    return {
        "num_heads": heads,
        "num_kv_heads": config["num_key_value_heads"],
        "dim": config["hidden_size"],
        "head_dim": config.get("head_dim") or config["hidden_size"] // heads,
    }


def peft_adapter_config(lora: dict[str, Any], base_model_name_or_path: str) -> dict[str, Any]:
    """PEFT's adapter_config.json for the arguments of a torchtune LoRA builder."""
    modules = get_lora_module_names(
        list(lora["lora_attn_modules"]), lora["apply_lora_to_mlp"], lora["apply_lora_to_output"]
    )
    return convert_weights.tune_to_peft_adapter_config(
        {
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "r": lora["lora_rank"],
            "lora_alpha": lora["lora_alpha"],
            "lora_dropout": lora["lora_dropout"],
            "bias": "none",
            "target_modules": modules,
        },
        base_model_name_or_path=base_model_name_or_path,
    )


def tune_to_peft(state_dict: dict[str, torch.Tensor], config: dict[str, Any]) -> dict[str, Any]:
    """torchtune adapter names and layouts -> PEFT's, onto the Hugging Face model of `config`."""
    return convert_weights.tune_to_peft_adapter_weights(state_dict, **_dims(config))


def peft_to_tune(state_dict: dict[str, torch.Tensor], config: dict[str, Any]) -> dict[str, Any]:
    """PEFT adapter names and layouts -> torchtune's: the inverse of tune_to_peft."""
    mapping = {}
    for tune_name, peft_name in _TO_PEFT_KEYS.items():
        for hf_key, tune_key in _FROM_HF.items():
            if tune_key is None or tune_name == "magnitude":
                continue
            peft_key = hf_key.replace(".weight", f".{peft_name}.weight")
            mapping[peft_key] = tune_key.replace(".weight", f".{tune_name}.weight")
    dims = _dims(config)
    converted = {}
    for key, value in state_dict.items():
        new_key = get_mapped_key(key.removeprefix("base_model.model."), mapping)
        heads = {"q_proj": dims["num_heads"], "k_proj": dims["num_kv_heads"]}
        for name, n_heads in heads.items():
            if f"attn.{name}.lora_b" in new_key:
                # Undo the rotary-layout permutation that tune_to_peft applies to lora_B rows.
                rank = value.shape[-1]
                value = (
                    value.view(n_heads, 2, dims["head_dim"] // 2, rank)
                    .transpose(1, 2)
                    .reshape(dims["head_dim"] * n_heads, rank)
                )
        converted[new_key] = value
    return converted
