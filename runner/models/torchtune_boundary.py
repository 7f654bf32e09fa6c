"""The boundary to torchtune: every torchtune import in runner and recipes/ goes through here.

torchtune is pinned at 0.6.1 and no longer developed; swapping one of these pieces for another
library's touches this file only.
"""

from __future__ import annotations

from typing import Any

from runner.notices import keep_notices_off_the_console

keep_notices_off_the_console(drop=False)

# torchtune's imports come after the filters: torchao warns as it is imported.
# ruff: noqa: E402
import torchtune.models.gemma as gemma_builders
import torchtune.models.gemma2 as gemma2_builders
import torchtune.models.llama3_1 as llama3_1_builders
import torchtune.models.llama3_2 as llama3_2_builders
from torch import nn
from torchao.dtypes.nf4tensor import to_nf4
from torchtune.data import (
    CROSS_ENTROPY_IGNORE_IDX,
    OpenAIToMessages,
    ShareGPTToMessages,
    padded_collate_sft,
)
from torchtune.data import Message as TorchtuneMessage
from torchtune.data._utils import truncate
from torchtune.datasets import PackedDataset
from torchtune.datasets._sft import SFTTransform
from torchtune.models import convert_weights
from torchtune.models.gemma2._attention import Gemma2Attention
from torchtune.modules import (
    FeedForward,
    MultiHeadAttention,
    RMSNorm,
    TransformerDecoder,
    TransformerSelfAttentionLayer,
)
from torchtune.modules.low_precision import FrozenNF4Linear
from torchtune.modules.peft import (
    LoRALinear,
    disable_adapter,
    get_adapter_params,
    get_adapter_state_dict,
    get_lora_module_names,
    get_merged_lora_ckpt,
    set_trainable_params,
)
from torchtune.training import (
    compile_loss,
    gather_cpu_state_dict,
    set_activation_checkpointing,
    set_default_dtype,
)
from torchtune.training.lr_schedulers import get_cosine_schedule_with_warmup
from torchtune.utils._import_guard import _SUPPORTS_FLEX_ATTENTION

# Whether torchtune's attention runs flex attention over a BlockMask (a GPU of compute
# capability 7.5 or more); where not, it takes a dense mask only.
SUPPORTS_FLEX_ATTENTION: bool = _SUPPORTS_FLEX_ATTENTION

__all__ = [
    "CROSS_ENTROPY_IGNORE_IDX",
    "FeedForward",
    "FrozenNF4Linear",
    "Gemma2Attention",
    "SUPPORTS_FLEX_ATTENTION",
    "compile_loss",
    "LoRALinear",
    "MultiHeadAttention",
    "disable_adapter",
    "gather_cpu_state_dict",
    "gemma_builders",
    "gemma2_builders",
    "llama3_1_builders",
    "llama3_2_builders",
    "get_adapter_params",
    "get_adapter_state_dict",
    "get_merged_lora_ckpt",
    "peft_adapter_config",
    "set_trainable_params",
    "Message",
    "OpenAIToMessages",
    "PackedDataset",
    "RMSNorm",
    "SFTTransform",
    "ShareGPTToMessages",
    "TransformerDecoder",
    "TransformerSelfAttentionLayer",
    "get_cosine_schedule_with_warmup",
    "init_like_hf",
    "padded_collate_sft",
    "set_activation_checkpointing",
    "set_default_dtype",
    "to_nf4",
    "truncate",
]


class Message(TorchtuneMessage):
    """torchtune's message, with the speaker's `name` (OpenAI's chat format) that a chat template
    may write; None where the message has none."""

    def __init__(
        self,
        role: str,
        content: str | list[dict[str, Any]],
        masked: bool = False,
        ipython: bool = False,
        eot: bool = True,
        name: str | None = None,
    ) -> None:
        super().__init__(role, content, masked=masked, ipython=ipython, eot=eot)
        self.name = name

    @classmethod
    def named(cls, message: TorchtuneMessage, name: str | None) -> Message:
        """torchtune's `message` (as its chat transforms give it) with the speaker's `name`."""
        return cls(
            message.role,
            message.content,
            masked=message.masked,
            ipython=message.ipython,
            eot=message.eot,
            name=name,
        )


def init_like_hf(model: nn.Module, initializer_range: float) -> None:
    """Hugging Face's init: N(0, initializer_range) for linear and embedding weights, zero biases.

    torchtune's builders leave embeddings at N(0, 1), which starts the loss near 240.
    """
    for module in model.modules():
        if isinstance(module, nn.Linear | nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=initializer_range)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)


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
