"""LoRA / QLoRA fine-tune recipe: the full recipe with a frozen base and trainable adapters.

    python -m runner.recipes.lora_finetune RUN_DIR/recipe.yaml

The model comes from its backend (runner.models.backends): with torchtune's, the LoRA twin of the
model's builder (named by its family, runner.models.families) with the method's arguments, and with
`quantize_base` (method=qlora) NF4 base projections (torchao); with transformers', peft's LoRA on
transformers' model class. The base comes from `model.source`, or from `seed` exactly as the full
recipe initializes it, and is then written once to RUN/base_model/ in Hugging Face format: the
base that each checkpoint's PEFT adapter names. Only adapter parameters train and enter the
optimizer. Checkpoints hold adapter_config.json + adapter_model.safetensors (PEFT), tokenizer
files, generation_config.json and training_state.pt, plus merged config.json + model.safetensors
with `method.save_merged`. Everything else (data, loop, FSDP2, resume, SIGTERM) is the full
recipe's.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, cast

import torch
from omegaconf import OmegaConf
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

from runner.models.backends import LoraBuild
from runner.models.checkpoint import write_lora_checkpoint
from runner.models.torchtune_boundary import gather_cpu_state_dict
from runner.train import process

from .full_finetune import FullFinetuneRecipe

# Adapter weights load into a model whose base is already in place.
ADAPTER_ONLY = StateDictOptions(full_state_dict=True, cpu_offload=True, strict=False)


class LoraFinetuneRecipe(FullFinetuneRecipe):
    """Trains low-rank adapters on a frozen (optionally NF4-quantized) base."""

    def _build_model(self) -> torch.nn.Module:
        # The frozen base in the compute dtype: only what trains needs master weights.
        build = LoraBuild(
            lora=self.cfg.method.builder,
            device=self.place.device,
            dtype=self.place.dtype,
            compute_dtype=self.place.compute_dtype,
            base_state=self._base_model_state,
            seed=self.cfg.seed,
        )
        model = self.backend.build_lora(build)
        return self._prepare_model(model)

    def _gather_model_state(self) -> dict[str, Any]:
        if self.cfg.method.builder.quantize_base and self.place.world_size > 1:
            # torch's full-state-dict API cannot gather NF4 shards; torchtune's gather can (the
            # state is rank 0's only: the other ranks write nothing).
            gathered: dict[str, Any] = gather_cpu_state_dict(self.model, self.is_rank_zero)
            return gathered
        return super()._gather_model_state()

    def _write_checkpoint(
        self, out_dir: Path, model_state: dict[str, Any], training_state: dict[str, Any]
    ) -> None:
        method = self.cfg.method
        lora = cast(dict[str, Any], OmegaConf.to_container(method.builder))
        adapter = self.backend.adapter_state(model_state)
        merged = None
        if method.save_merged:
            merged = {k: v.to(torch.float32) for k, v in model_state.items()}
            merged = self.backend.merged_hf_state(merged, lora)
        write_lora_checkpoint(
            out_dir,
            adapter_state=self.backend.adapter_to_peft(
                {k: v.to(torch.float32) for k, v in adapter.items()}
            ),
            adapter_config=self.backend.peft_config(lora, method.base_model_dir),
            hf_config=self._hf_config(),
            tokenizer_dir=Path(self.cfg.model.tokenizer.path),
            chat_template=self._chat_template(),
            training_state=training_state,
            stop_token_ids=self.tokenizer.stop_tokens,
            merged_state=merged,
            source_dir=Path(self.cfg.model.source) if self.cfg.model.source else None,
        )

    def _load_model_weights(self, checkpoint: Path) -> None:
        adapter = self.backend.read_adapter(checkpoint)
        dtype = self.place.dtype
        set_model_state_dict(
            self.model, {k: v.to(dtype) for k, v in adapter.items()}, options=ADAPTER_ONLY
        )


def run(recipe_path: str | Path) -> dict[str, Any]:
    """Runs the LoRA recipe at `recipe_path` in this process (one of several under torchrun)."""
    return process.run(recipe_path, LoraFinetuneRecipe)


if __name__ == "__main__":
    run(sys.argv[1])
