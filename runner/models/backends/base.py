"""The interface each model backend implements (see runner.models.backends)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn


@runtime_checkable
class ChunkedOutput(Protocol):
    """Either backend's model: its logits whole (0) or in chunks along the sequence."""

    def set_num_output_chunks(self, num_output_chunks: int) -> None: ...


def set_output_chunks(model: nn.Module, num_output_chunks: int) -> None:
    """Has `model` return its logits in `num_output_chunks` chunks along the sequence, as
    CEWithChunkedOutputLoss takes them (0: whole)."""
    assert isinstance(model, ChunkedOutput), f"{type(model).__name__} is no backend's model"
    model.set_num_output_chunks(num_output_chunks)


@dataclass(frozen=True)
class LoraBuild:
    """What `Backend.build_lora` builds: the method's LoRA arguments (method.builder), the
    device, the adapters' dtype and the frozen base's compute dtype, where the base weights
    come from, and the seed of the adapters' init."""

    lora: Mapping[str, Any]
    device: torch.device
    dtype: torch.dtype
    compute_dtype: torch.dtype
    # The base weights in the model's names, read or built only when asked for.
    base_state: Callable[[], dict[str, torch.Tensor]]
    seed: int
    # The processes the model is sharded over (which NF4 blocks a base projection can take).
    world_size: int = 1


class Backend(ABC):
    """How one kind of model is built, sharded, saved and adapted; one per recipe process."""

    def __init__(self, model: Any) -> None:
        # The recipe's model section (runner.config.schema.RecipeModel).
        self.model_cfg = model

    # ---- the model ----------------------------------------------------------------------
    @abstractmethod
    def build(self, device: torch.device, dtype: torch.dtype) -> nn.Module:
        """The model in `dtype` on `device`: model.source's weights, else a random init drawn
        from the current RNG."""

    @abstractmethod
    def layers(self, model: nn.Module) -> list[nn.Module]:
        """The decoder layers, as their parent holds them (FSDP2 shards each)."""

    @abstractmethod
    def layer_classes(self, model: nn.Module) -> set[type]:
        """The decoder layer classes (activation checkpointing wraps their instances)."""

    @abstractmethod
    def meta_model(self, lora: dict[str, Any] | None) -> nn.Module:
        """The model on the meta device (with LoRA adapters for `lora`), for counting."""

    # ---- checkpoints --------------------------------------------------------------------
    @abstractmethod
    def to_hf(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The model's full state -> Hugging Face names and layouts of model.hf_config."""

    @abstractmethod
    def read_weights(self, checkpoint_dir: Path) -> dict[str, torch.Tensor]:
        """A Hugging Face checkpoint's weights in the model's names (safetensors only)."""

    # ---- LoRA ---------------------------------------------------------------------------
    @abstractmethod
    def build_lora(self, build: LoraBuild) -> nn.Module:
        """The model with trainable adapters in `build.dtype` on a frozen base in
        `build.compute_dtype`: model.source's, else `build.base_state()` (model names).
        The adapters' init draws from `build.seed`, set after the base is read or built."""

    @abstractmethod
    def adapter_state(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The adapter entries of a LoRA model's full state (model names)."""

    @abstractmethod
    def adapter_to_peft(self, adapter: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Adapter state -> PEFT's adapter_model.safetensors names."""

    @abstractmethod
    def read_adapter(self, checkpoint_dir: Path) -> dict[str, torch.Tensor]:
        """A checkpoint's PEFT adapter in the model's names."""

    @abstractmethod
    def peft_config(self, lora: dict[str, Any], base_dir: str) -> dict[str, Any]:
        """adapter_config.json for the method's LoRA arguments, onto the base at `base_dir`."""

    @abstractmethod
    def merged_hf_state(
        self, state: dict[str, torch.Tensor], lora: dict[str, Any]
    ) -> dict[str, torch.Tensor]:
        """A LoRA model's full fp32 state with the adapters merged, in Hugging Face names."""
