"""Checkpoints in Hugging Face format, plus the training state needed to resume."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from runner.models.families import hf_to_tune, peft_to_tune, read_config

# A checkpoint's file names are the run directory contract's, defined once in runner.rundir.
from runner.rundir import (
    ADAPTER_CONFIG_FILE,
    ADAPTER_FILE,
    CHAT_TEMPLATE_FILE,
    GENERATION_CONFIG,
    HF_CONFIG_FILE,
    MODEL_FILE,
    TOKENIZER_FILES,
    TRAINING_STATE_FILE,
    check_safetensors,
    eos_token_ids,
    no_training_state,
    read_generation_config,
    readable_as_umask,
    weight_files,
)


def write_checkpoint(
    out_dir: Path,
    *,
    model_state: dict[str, torch.Tensor],
    hf_config: dict[str, Any],
    tokenizer_dir: Path,
    training_state: dict[str, Any],
    stop_token_ids: list[int],
    source_dir: Path | None = None,
    chat_template: str | None = None,
) -> None:
    """Writes a directory that `transformers` loads as it is, plus training_state.pt.

    `model_state` is in Hugging Face names (the backend's to_hf); the other files are
    write_model_files'.
    """
    out_dir.mkdir(parents=True, exist_ok=False)
    write_hf_model(out_dir, model_state, hf_config)
    write_model_files(out_dir, hf_config, tokenizer_dir, stop_token_ids, source_dir, chat_template)
    torch.save(training_state, out_dir / TRAINING_STATE_FILE)


def write_hf_model(
    out_dir: Path, model_state: dict[str, torch.Tensor], hf_config: dict[str, Any]
) -> None:
    """config.json and model.safetensors; `model_state` is in Hugging Face names and layouts."""
    hf_state = {k: v.contiguous() for k, v in model_state.items()}
    save_file(hf_state, str(out_dir / MODEL_FILE), metadata={"format": "pt"})
    readable_as_umask(out_dir / MODEL_FILE)
    (out_dir / HF_CONFIG_FILE).write_text(json.dumps(hf_config, indent=2) + "\n")


def write_model_files(
    out_dir: Path,
    hf_config: dict[str, Any],
    tokenizer_dir: Path,
    stop_token_ids: list[int],
    source_dir: Path | None = None,
    chat_template: str | None = None,
) -> None:
    """What every checkpoint holds beside its weights: generation config and tokenizer files.

    A model fine-tuned from `source_dir` keeps that checkpoint's generation_config.json, its
    eos_token_id joined by `stop_token_ids`: the tokens the run's own evaluation stops at, the
    template's end of a turn among them. A base model's eos is its end of text, and a chat
    fine-tune of it ends each answer with <|eot_id|> or <|im_end|>: served with the base's eos
    alone, it answered to max_tokens. A `chat_template` (the text of model.chat_template's
    file, or the template with the run's system prompt: runner.trainer.weights.model_files) is
    written as chat_template.jinja, where transformers reads it before the tokenizer's own, so
    deploy and export render chats as the run trained on them.
    """
    generation: dict[str, Any] | None = {
        "bos_token_id": hf_config.get("bos_token_id"),
        "do_sample": False,
    }
    if source_dir is not None and (source_dir / GENERATION_CONFIG).is_file():
        generation = read_generation_config(source_dir)
        if generation is None:  # no JSON object: not ours to mend, kept as the source has it
            shutil.copy2(source_dir / GENERATION_CONFIG, out_dir / GENERATION_CONFIG)
    if generation is not None:
        _write_generation_config(out_dir, generation, stop_token_ids)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).exists():
            shutil.copy2(tokenizer_dir / name, out_dir / name)
    if chat_template is not None:
        (out_dir / CHAT_TEMPLATE_FILE).write_text(chat_template)


def _write_generation_config(
    out_dir: Path, generation: dict[str, Any], stop_token_ids: list[int]
) -> None:
    own = eos_token_ids(generation.get("eos_token_id"))
    generation["eos_token_id"] = [*own, *(t for t in stop_token_ids if t not in own)]
    (out_dir / GENERATION_CONFIG).write_text(json.dumps(generation, indent=2) + "\n")


def write_lora_checkpoint(
    out_dir: Path,
    *,
    adapter_state: dict[str, torch.Tensor],
    adapter_config: dict[str, Any],
    hf_config: dict[str, Any],
    tokenizer_dir: Path,
    training_state: dict[str, Any],
    stop_token_ids: list[int],
    merged_state: dict[str, torch.Tensor] | None,
    source_dir: Path | None = None,
    chat_template: str | None = None,
) -> None:
    """A PEFT adapter (adapter_config.json, adapter_model.safetensors) that peft loads onto the
    base named by adapter_config's base_model_name_or_path; with `merged_state`, also the merged
    weights as config.json + model.safetensors. `adapter_state` is in PEFT's names, `merged_state`
    in Hugging Face's (the backend's)."""
    out_dir.mkdir(parents=True, exist_ok=False)
    peft_state = {k: v.contiguous() for k, v in adapter_state.items()}
    save_file(peft_state, str(out_dir / ADAPTER_FILE), metadata={"format": "pt"})
    readable_as_umask(out_dir / ADAPTER_FILE)
    (out_dir / ADAPTER_CONFIG_FILE).write_text(json.dumps(adapter_config, indent=2) + "\n")
    if merged_state is not None:
        write_hf_model(out_dir, merged_state, hf_config)
    write_model_files(out_dir, hf_config, tokenizer_dir, stop_token_ids, source_dir, chat_template)
    torch.save(training_state, out_dir / TRAINING_STATE_FILE)


def write_base_model(
    out_dir: Path,
    *,
    model_state: dict[str, torch.Tensor],
    hf_config: dict[str, Any],
    tokenizer_dir: Path,
    stop_token_ids: list[int],
    chat_template: str | None = None,
) -> None:
    """A whole Hugging Face model directory (`model_state` in Hugging Face names), written
    under a temporary name and renamed."""
    tmp = out_dir.with_name(f".tmp-{out_dir.name}")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    write_hf_model(tmp, model_state, hf_config)
    write_model_files(tmp, hf_config, tokenizer_dir, stop_token_ids, chat_template=chat_template)
    tmp.rename(out_dir)


def read_model_state(checkpoint_dir: Path) -> dict[str, torch.Tensor]:
    """Loads the weights of a checkpoint in torchtune's names (safetensors: no code runs); a file
    that is missing or cut short is a UserError naming it."""
    state: dict[str, torch.Tensor] = {}
    for path in weight_files(checkpoint_dir):
        check_safetensors(path, key="checkpoint")
        state.update(load_file(str(path)))
    return hf_to_tune(state, read_config(checkpoint_dir))


def read_training_state(checkpoint_dir: Path) -> dict[str, Any]:
    """Loads optimizer, scheduler, position and RNG state with weights_only (no code runs)."""
    path = checkpoint_dir / TRAINING_STATE_FILE
    if not path.is_file():
        raise no_training_state(checkpoint_dir)
    return torch.load(path, weights_only=True)


def read_adapter_state(checkpoint_dir: Path, hf_config: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Loads a PEFT adapter of this run's model in torchtune's names (safetensors: no code runs)."""
    check_safetensors(checkpoint_dir / ADAPTER_FILE, key="checkpoint")
    return peft_to_tune(load_file(str(checkpoint_dir / ADAPTER_FILE)), hf_config)
