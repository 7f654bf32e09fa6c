"""What trains, and how it is built, saved and loaded: every parameter (full, dpo) or LoRA
adapters on a frozen base (lora, qlora, lora_dpo, qlora_dpo).

The model comes from its backend (runner.models.backends). Full weights are saved as config.json
+ model.safetensors. LoRA builds, with torchtune's backend, the LoRA twin of the model's builder
(named by its family, runner.models.families) with the method's arguments, and with
`quantize_base` (qlora) NF4 base projections (torchao); with transformers', peft's LoRA on
transformers' model class. Only adapter parameters train. Its checkpoints hold
adapter_config.json + adapter_model.safetensors (PEFT), plus merged config.json +
model.safetensors with `method.save_merged`; every checkpoint also holds the tokenizer files,
generation_config.json and training_state.pt.

The base that LoRA adapts, and that a preference method's reference keeps, comes from
`model.source`, or from `seed` exactly as a full run initializes it, and is then written once to
RUN/base_model/ in Hugging Face format (the base that each checkpoint's PEFT adapter names). The
reference of full DPO is a frozen copy of it; LoRA's is the same model with its adapters off.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)

from runner.components import plain_dict
from runner.models.backends import Backend, LoraBuild
from runner.models.chat_template import with_system_prompt
from runner.models.checkpoint import (
    MODEL_FILE,
    write_base_model,
    write_checkpoint,
    write_lora_checkpoint,
)
from runner.models.tokenizer import ChatTokenizer
from runner.models.torchtune_boundary import disable_adapter, gather_cpu_state_dict
from runner.trainer.checkpointing import FULL
from runner.trainer.objectives import Reference
from runner.trainer.parallel import Placement

# The recipe's logger: train.log's, in every process layout (runner.trainer.process).
log = logging.getLogger("runner.recipe")
# Adapter weights load into a model whose base is already in place.
ADAPTER_ONLY = StateDictOptions(full_state_dict=True, cpu_offload=True, strict=False)
# Shards a built model and wraps it as the run asks (runner.trainer.parallel.prepare_model).
Prepare = Callable[[nn.Module], nn.Module]


@dataclass(frozen=True)
class ModelFiles:
    """What every checkpoint (and the base model) holds beside its weights."""

    hf_config: dict[str, Any]
    tokenizer_dir: Path
    # model.chat_template's text (None: the tokenizer's own), as the base model carries it.
    chat_template: str | None
    # What each checkpoint carries: that, with the run's system prompt where it has one.
    checkpoint_template: str | None
    stop_token_ids: list[int]
    # The checkpoint fine-tuned from (model.source), whose generation_config.json is kept.
    source_dir: Path | None


def model_files(
    model: DictConfig, tokenizer: ChatTokenizer, new_system_prompt: str | None
) -> ModelFiles:
    """The ModelFiles of a recipe's model section, its tokenizer, and the system prompt its
    chats trained with (dataset.new_system_prompt)."""
    given = tokenizer.chat_template_file
    template = None if given is None else Path(given).read_text()
    trained = template
    if new_system_prompt is not None and tokenizer.template is not None:
        trained = with_system_prompt(tokenizer.template, new_system_prompt)
    return ModelFiles(
        hf_config=plain_dict(model.hf_config),
        tokenizer_dir=Path(model.tokenizer.path),
        chat_template=template,
        checkpoint_template=trained,
        stop_token_ids=tokenizer.stop_tokens,
        source_dir=None if model.source is None else Path(model.source),
    )


class FullWeights:
    """Every parameter trains; checkpoints hold the whole model."""

    def __init__(
        self,
        backend: Backend,
        place: Placement,
        files: ModelFiles,
        *,
        method: DictConfig,
        seed: int,
    ) -> None:
        self.backend, self.place, self.files, self.method = backend, place, files, method
        self.seed = seed

    def build(self, prepare: Prepare, *, reference: bool) -> tuple[nn.Module, Reference | None]:
        """The model to train and, when asked, a frozen copy of its starting weights."""
        device, dtype = self.place.device, self.place.dtype
        if not reference:
            return prepare(self.backend.build(device, dtype)), None
        base = None if self.files.source_dir is not None else self.base_state()
        policy = self.backend.build(device, dtype)
        frozen = self.backend.build(device, dtype)
        if base is not None:
            base = {k: v.to(dtype) for k, v in base.items()}
            policy.load_state_dict(base)
            frozen.load_state_dict(base)
        frozen.requires_grad_(False)
        # Sharded as the policy is: each rank holds its share, and gathers it for a forward.
        frozen = prepare(frozen).eval()
        return prepare(policy), frozen

    def base_state(self) -> dict[str, torch.Tensor]:
        """The starting weights that LoRA adapts and DPO's reference keeps: model.source's, else
        RUN/base_model, written from the seed once (the weights a full run starts from)."""
        if self.files.source_dir is not None:
            return self.backend.read_weights(self.files.source_dir)
        base_dir = Path(self.method.base_model_dir)
        if (base_dir / MODEL_FILE).is_file():
            return self.backend.read_weights(base_dir)
        base = self.backend.build(self.place.device, self.place.dtype)
        state = {k: v.to("cpu", torch.float32) for k, v in base.state_dict().items()}
        if self.place.is_rank_zero:
            write_base_model(
                base_dir,
                model_state=self.backend.to_hf(state),
                hf_config=self.files.hf_config,
                tokenizer_dir=self.files.tokenizer_dir,
                chat_template=self.files.chat_template,
                stop_token_ids=self.files.stop_token_ids,
            )
        return state

    def saves_whole_model(self) -> bool:
        """Whether each checkpoint holds every weight of the model (in fp32), or only those
        that train (a LoRA run's adapters)."""
        return True

    def gather(self, model: nn.Module) -> dict[str, Any]:
        """Full weights on the CPU of every rank (every rank joins)."""
        return get_model_state_dict(model, options=FULL)

    def write(
        self, out_dir: Path, model_state: dict[str, Any], training_state: dict[str, Any]
    ) -> None:
        """Writes a checkpoint of the whole model in Hugging Face format (rank 0)."""
        files = self.files
        write_checkpoint(
            out_dir,
            model_state=self.backend.to_hf(
                {k: v.to(torch.float32) for k, v in model_state.items()}
            ),
            hf_config=files.hf_config,
            tokenizer_dir=files.tokenizer_dir,
            chat_template=files.checkpoint_template,
            training_state=training_state,
            stop_token_ids=files.stop_token_ids,
            source_dir=files.source_dir,
        )

    def load(self, model: nn.Module, checkpoint: Path) -> None:
        """Loads a checkpoint's weights into the model (every rank)."""
        weights = self.backend.read_weights(checkpoint)
        dtype = self.place.dtype
        set_model_state_dict(model, {k: v.to(dtype) for k, v in weights.items()}, options=FULL)


class LoraWeights(FullWeights):
    """Low-rank adapters train on a frozen (optionally NF4-quantized) base."""

    def build(self, prepare: Prepare, *, reference: bool) -> tuple[nn.Module, Reference | None]:
        """The adapted model and, when asked, the same model with its adapters off."""
        # The frozen base in the compute dtype: only what trains needs master weights.
        build = LoraBuild(
            lora=self.method.builder,
            device=self.place.device,
            dtype=self.place.dtype,
            compute_dtype=self.place.compute_dtype,
            base_state=self.base_state,
            seed=self.seed,
            world_size=self.place.world_size,
        )
        if self.method.quantization is not None and self.place.is_rank_zero:
            log.info("QLoRA base: %s", self.method.quantization)
        model = prepare(self.backend.build_lora(build))
        return model, (lambda tokens: _base_forward(model, tokens)) if reference else None

    def saves_whole_model(self) -> bool:
        """The adapters alone; the merged model too with method.save_merged."""
        return bool(self.method.save_merged)

    def gather(self, model: nn.Module) -> dict[str, Any]:
        """The full state on the CPU (every rank joins; with an NF4 base on several ranks, only
        rank 0 gets it)."""
        if self.method.builder.quantize_base and self.place.world_size > 1:
            # torch's full-state-dict API cannot gather NF4 shards; torchtune's gather can (the
            # state is rank 0's only: the other ranks write nothing).
            gathered: dict[str, Any] = gather_cpu_state_dict(model, self.place.is_rank_zero)
            return gathered
        return super().gather(model)

    def write(
        self, out_dir: Path, model_state: dict[str, Any], training_state: dict[str, Any]
    ) -> None:
        """Writes the PEFT adapter (and the merged model with method.save_merged) (rank 0)."""
        files, backend = self.files, self.backend
        lora = plain_dict(self.method.builder)
        adapter = backend.adapter_state(model_state)
        merged = None
        if self.method.save_merged:
            merged = {k: _fp32_copy(v) for k, v in model_state.items()}
            merged = backend.merged_hf_state(merged, lora)
        write_lora_checkpoint(
            out_dir,
            adapter_state=backend.adapter_to_peft(
                {k: v.to(torch.float32) for k, v in adapter.items()}
            ),
            adapter_config=backend.peft_config(lora, self.method.base_model_dir),
            hf_config=files.hf_config,
            tokenizer_dir=files.tokenizer_dir,
            chat_template=files.checkpoint_template,
            training_state=training_state,
            stop_token_ids=files.stop_token_ids,
            merged_state=merged,
            source_dir=files.source_dir,
        )

    def load(self, model: nn.Module, checkpoint: Path) -> None:
        """Loads a checkpoint's adapter onto the model's base (every rank)."""
        adapter = self.backend.read_adapter(checkpoint)
        dtype = self.place.dtype
        set_model_state_dict(
            model, {k: v.to(dtype) for k, v in adapter.items()}, options=ADAPTER_ONLY
        )


def _fp32_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A weight in fp32, never the live tensor: .to() gives an fp32 weight itself, and the merge
    adds the adapter into it in place, into the base that goes on training. (torchao's NF4
    tensors take no .to(copy=True); their .to() dequantizes into a new tensor.)"""
    converted = tensor.to(torch.float32)
    return converted.clone() if converted is tensor else converted


def _base_forward(model: nn.Module, tokens: torch.Tensor) -> Any:
    """The base's logits: the model with its adapters off, deterministic (no dropout), as a
    separate frozen model would be."""
    was_training = model.training
    model.eval()
    try:
        with _adapters_off(model):
            return model(tokens)
    finally:
        model.train(was_training)


def _adapters_off(model: nn.Module) -> contextlib.AbstractContextManager[None]:
    peft_model = getattr(model, "hf", None)  # the transformers backend's peft model
    adapters_off: contextlib.AbstractContextManager[None]
    if peft_model is not None and hasattr(peft_model, "disable_adapter"):
        adapters_off = peft_model.disable_adapter()
    else:
        adapters_off = disable_adapter(model)
    return adapters_off
