"""torchtune's backend: a runner family's builder (runner/models/families/), weights converted to
and from Hugging Face's names by the family."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn

from runner.components import instantiate, plain_dict
from runner.models.backends.base import Backend, LoraBuild
from runner.models.checkpoint import read_adapter_state, read_model_state
from runner.models.families import peft_config, tune_to_hf, tune_to_peft
from runner.models.nf4 import SCALER_BLOCK, base_projections, quantize_base
from runner.models.torchtune_boundary import (
    TransformerSelfAttentionLayer,
    get_adapter_params,
    get_adapter_state_dict,
    get_merged_lora_ckpt,
    init_like_hf,
    peft_adapter_config,
    set_default_dtype,
    set_trainable_params,
)


class TorchtuneBackend(Backend):
    """torchtune's TransformerDecoder, built by the family's builder (model.builder)."""

    def _hf_config(self) -> dict[str, Any]:
        return plain_dict(self.model_cfg.hf_config)

    def build(self, device: torch.device, dtype: torch.dtype) -> nn.Module:
        cfg = self.model_cfg
        with set_default_dtype(dtype), device:
            model = instantiate(cfg.builder)
            init_like_hf(model, cfg.initializer_range)
        if cfg.source is not None:
            model.load_state_dict(read_model_state(Path(cfg.source)))
        return model

    def layers(self, model: nn.Module) -> list[nn.Module]:
        layers = model.get_submodule("layers")
        assert isinstance(layers, nn.ModuleList), "torchtune's decoder keeps its layers in one"
        return list(layers)

    def layer_classes(self, model: nn.Module) -> set[type]:
        return {TransformerSelfAttentionLayer}

    def meta_model(self, lora: dict[str, Any] | None) -> nn.Module:
        node = self.model_cfg.builder
        if lora is not None:
            node = OmegaConf.merge(node, lora, {"quantize_base": False})
        with torch.device("meta"):
            return instantiate(node)

    def to_hf(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return tune_to_hf(state, self._hf_config())

    def read_weights(self, checkpoint_dir: Path) -> dict[str, torch.Tensor]:
        return read_model_state(checkpoint_dir)

    def build_lora(self, build: LoraBuild) -> nn.Module:
        state = build.base_state()
        lora = dict(build.lora)
        # torchtune's builder quantizes every base projection to NF4 in torchao's default blocks
        # as it builds; where one does not divide into them, the base is built in the compute
        # dtype and quantized after loading, projection by projection (runner.models.nf4).
        projections = base_projections(self.meta_model(lora), build.world_size)
        after = lora["quantize_base"] and any(p.scaler_block != SCALER_BLOCK for p in projections)
        # The adapters' own init draws from the seed, whether the base was built or read.
        torch.manual_seed(build.seed)
        # The frozen base in the compute dtype: only what trains needs master weights.
        with set_default_dtype(build.compute_dtype), build.device:
            node = OmegaConf.merge(
                self.model_cfg.builder, lora, {"quantize_base": not after and lora["quantize_base"]}
            )
            assert isinstance(node, DictConfig)  # a merge of mappings
            model = instantiate(node)
        missing, unexpected = model.load_state_dict(state, strict=False)
        adapter = get_adapter_params(model)
        assert not unexpected and set(missing) <= set(adapter), (missing, unexpected)
        if after:
            quantize_base(model, build.world_size)
        for param in adapter.values():
            param.data = param.data.to(build.dtype)
        set_trainable_params(model, adapter)
        return model

    def adapter_state(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return get_adapter_state_dict(state)

    def adapter_to_peft(self, adapter: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return tune_to_peft(adapter, self._hf_config())

    def read_adapter(self, checkpoint_dir: Path) -> dict[str, torch.Tensor]:
        return read_adapter_state(checkpoint_dir, self._hf_config())

    def peft_config(self, lora: dict[str, Any], base_dir: str) -> dict[str, Any]:
        # A family whose Hugging Face model fuses projections (Phi-3) adapts the fused modules.
        return peft_config(peft_adapter_config(lora, base_dir), self._hf_config())

    def merged_hf_state(
        self, state: dict[str, torch.Tensor], lora: dict[str, Any]
    ) -> dict[str, torch.Tensor]:
        merged = get_merged_lora_ckpt(state, lora["lora_rank"], lora["lora_alpha"])
        return self.to_hf(merged)
