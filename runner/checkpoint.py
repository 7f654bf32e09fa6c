"""Checkpoints in Hugging Face format, plus the training state needed to resume."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from runner.tune import hf_to_tune, tune_to_hf

MODEL_FILE = "model.safetensors"
TRAINING_STATE_FILE = "training_state.pt"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def write_checkpoint(
    out_dir: Path,
    *,
    model_state: dict[str, torch.Tensor],
    hf_config: dict[str, Any],
    tokenizer_dir: Path,
    training_state: dict[str, Any],
    stop_token_ids: list[int],
) -> None:
    """Writes a directory that `transformers` loads as it is, plus training_state.pt."""
    out_dir.mkdir(parents=True, exist_ok=False)
    hf_state = {k: v.contiguous() for k, v in tune_to_hf(model_state, hf_config).items()}
    save_file(hf_state, str(out_dir / MODEL_FILE), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
    generation = {
        "bos_token_id": hf_config["bos_token_id"],
        "eos_token_id": stop_token_ids,
        "do_sample": False,
    }
    (out_dir / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).exists():
            shutil.copy2(tokenizer_dir / name, out_dir / name)
    torch.save(training_state, out_dir / TRAINING_STATE_FILE)


def read_model_state(checkpoint_dir: Path) -> dict[str, torch.Tensor]:
    """Loads the weights of a checkpoint in torchtune's names (safetensors: no code runs)."""
    config = json.loads((checkpoint_dir / "config.json").read_text())
    return hf_to_tune(load_file(str(checkpoint_dir / MODEL_FILE)), config)


def read_training_state(checkpoint_dir: Path) -> dict[str, Any]:
    """Loads optimizer, scheduler, position and RNG state with weights_only (no code runs)."""
    return torch.load(checkpoint_dir / TRAINING_STATE_FILE, weights_only=True)
