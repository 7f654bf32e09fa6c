"""bench_peers.py's torchtune arms: `tune run full_finetune_single_device` on the same
checkpoint, data and optimizer, as its user gets it (tune_default) and at its best (tune_best:
packed, fused AdamW); losses and step times from its DiskLogger file."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

from peers_setup import CLIP_GRAD_NORM, OPTIMIZER, SEED


def tune_config(spec: dict, out: Path, best: bool) -> str:
    """torchtune's full_finetune_single_device config for the same model, data and optimizer:
    as its user gets it (its instruct_dataset unpacked, each batch padded to its longest
    sample; torch.optim.AdamW's default, for-each kernel), or `best`: `dataset.packed: True`
    (PackedDataset's packs, with tokenizer.max_seq_len, which packing needs) and AdamW's fused
    kernel."""
    shape = spec["shape"]
    packs = spec["tune_packs"]
    config = {
        "output_dir": str(out),
        "model": {
            "_component_": "torchtune.models.llama3_2.llama3_2",
            "vocab_size": shape["vocab"],
            "num_layers": shape["layers"],
            "num_heads": shape["heads"],
            "num_kv_heads": shape["kv_heads"],
            "embed_dim": shape["hidden"],
            "intermediate_dim": shape["mlp"],
            "max_seq_len": 2048,
            "rope_base": 500000,
            "norm_eps": 1e-5,
            # The checkpoint's config.json has no rope scaling.
            "scale_factor": 1,
            "tie_word_embeddings": False,
        },
        "tokenizer": {
            "_component_": "runner.models.tokenizer.ChatTokenizer",
            "path": spec["checkpoint"],
            "max_seq_len": packs["max_seq_len"] if best else None,
        },
        "dataset": {
            "_component_": "torchtune.datasets.instruct_dataset",
            "source": "json",
            "data_files": spec["data"],
            "split": "train",
            "column_map": {"input": "input", "output": "output"},
            "train_on_input": False,
            "packed": best,
        },
        "seed": SEED,
        "shuffle": True,
        "checkpointer": {
            "_component_": "torchtune.training.FullModelHFCheckpointer",
            "checkpoint_dir": spec["checkpoint"],
            "checkpoint_files": ["model.safetensors"],
            "recipe_checkpoint": None,
            "output_dir": str(out),
            "model_type": "LLAMA3",
        },
        "resume_from_checkpoint": False,
        "batch_size": packs["batch_size"] if best else spec["batch_size"],
        "epochs": 1,
        "max_steps_per_epoch": packs["steps"] if best else spec["steps"],
        "gradient_accumulation_steps": 1,
        "optimizer": {
            "_component_": "torch.optim.AdamW",
            **OPTIMIZER,
            "betas": list(OPTIMIZER["betas"]),
            **({"fused": True} if best else {}),
        },
        "optimizer_in_bwd": False,
        "loss": {"_component_": "torchtune.modules.loss.CEWithChunkedOutputLoss"},
        "clip_grad_norm": CLIP_GRAD_NORM,
        "compile": False,
        "device": "cpu",
        "dtype": "fp32",
        "enable_activation_checkpointing": False,
        "enable_activation_offloading": False,
        "metric_logger": {
            "_component_": "torchtune.training.metric_logging.DiskLogger",
            "log_dir": str(out / "logs"),
            "filename": "log.txt",
        },
        "log_every_n_steps": 1,
        "log_peak_memory_stats": False,
        "profiler": {"_component_": "torchtune.training.setup_torch_profiler", "enabled": False},
    }
    return json.dumps(config, indent=2)  # JSON is YAML


def tune_command(config: Path) -> list[str]:
    # `tune run`, through this interpreter (its console script may not be on PATH).
    return [
        sys.executable,
        "-m",
        "torchtune._cli.tune",
        "run",
        "full_finetune_single_device",
        "--config",
        str(config),
    ]


TUNE_VALUE = r"{}:(?:tensor\()?([-+\d.eE]+)"


def read_tune(log_file: Path, trained_per_step: list[int]) -> dict:
    """Losses and step times from the DiskLogger file: a step's time is its trained (label)
    tokens over the tokens_per_second_per_gpu that the recipe logs for it."""
    losses, rates = [], []
    for line in log_file.read_text().splitlines():
        loss = re.search(TUNE_VALUE.format("loss"), line)
        rate = re.search(TUNE_VALUE.format("tokens_per_second_per_gpu"), line)
        if loss and rate:
            losses.append(float(loss[1]))
            rates.append(float(rate[1]))
    times = [tokens / rate for tokens, rate in zip(trained_per_step, rates, strict=False)]
    return {"losses": losses, "step_times": times}
