"""The model zoo (conf/model/*.yaml): each option builds its family's model with the dimensions
and parameter count of its hub repo's published config.json, with no download."""

from __future__ import annotations

import re
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from runner.components import instantiate
from runner.config.model import resolve_model
from runner.config.resolve import resolve_recipe
from runner.job.preflight import estimate, print_estimate
from runner.models.families import builder_args, check_source_matches, family_named, family_of
from runner.paths import CONF_DIR
from tests.test_families import ZOO, model_config


def test_every_model_option_gets_its_familys_builder_and_lora_twin() -> None:
    for option in ZOO:
        model = model_config([f"model={option}"])
        for key in ("family", "source", "tokenizer", "chat_template", "checkpoint_format"):
            assert key in model, (option, key)
        if model.builder is not None:
            recipe = asdict(resolve_model(model, need_files=False))
            builders = family_named(model.family).builders
            assert recipe["lora_builder"] == builders[recipe["builder"]["_component_"]], option


# The published config.json of each zoo option's hub repo (the keys that shape the model).
_LLAMA = {
    "model_type": "llama",
    "vocab_size": 128256,
    "hidden_act": "silu",
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-05,
    "rope_theta": 500000.0,
    "attention_bias": False,
    "mlp_bias": False,
    "num_key_value_heads": 8,
}
_LLAMA_ROPE = {
    "rope_type": "llama3",
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
_QWEN = {
    "model_type": "qwen2",
    "hidden_act": "silu",
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "use_sliding_window": False,
    "sliding_window": 32768,
}
_GEMMA = {
    "vocab_size": 256000,
    "head_dim": 256,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-06,
    "rope_theta": 10000.0,
    "attention_bias": False,
    "tie_word_embeddings": True,
}
_GEMMA2 = {
    "model_type": "gemma2",
    "hidden_act": "gelu_pytorch_tanh",
    "hidden_activation": "gelu_pytorch_tanh",
    "attn_logit_softcapping": 50.0,
    "final_logit_softcapping": 30.0,
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
}
PUBLISHED = {
    "llama3_2_1b": {
        **_LLAMA,
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_attention_heads": 32,
        "num_hidden_layers": 16,
        "head_dim": 64,
        "rope_scaling": {**_LLAMA_ROPE, "factor": 32.0},
        "tie_word_embeddings": True,
    },
    "llama3_2_3b": {
        **_LLAMA,
        "hidden_size": 3072,
        "intermediate_size": 8192,
        "num_attention_heads": 24,
        "num_hidden_layers": 28,
        "head_dim": 128,
        "rope_scaling": {**_LLAMA_ROPE, "factor": 32.0},
        "tie_word_embeddings": True,
    },
    "llama3_1_8b": {
        **_LLAMA,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_attention_heads": 32,
        "num_hidden_layers": 32,
        "rope_scaling": {**_LLAMA_ROPE, "factor": 8.0},
        "tie_word_embeddings": False,
    },
    "qwen2_5_0_5b": {
        **_QWEN,
        "vocab_size": 151936,
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_attention_heads": 14,
        "num_hidden_layers": 24,
        "num_key_value_heads": 2,
        "tie_word_embeddings": True,
    },
    "qwen2_5_1_5b": {
        **_QWEN,
        "vocab_size": 151936,
        "hidden_size": 1536,
        "intermediate_size": 8960,
        "num_attention_heads": 12,
        "num_hidden_layers": 28,
        "num_key_value_heads": 2,
        "tie_word_embeddings": True,
    },
    "qwen2_5_7b": {
        **_QWEN,
        "vocab_size": 152064,
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "num_attention_heads": 28,
        "num_hidden_layers": 28,
        "num_key_value_heads": 4,
        "tie_word_embeddings": False,
    },
    "llama3_3_70b": {
        **_LLAMA,
        "hidden_size": 8192,
        "intermediate_size": 28672,
        "num_attention_heads": 64,
        "num_hidden_layers": 80,
        "rope_scaling": {**_LLAMA_ROPE, "factor": 8.0},
        "tie_word_embeddings": False,
    },
    **{
        f"smollm2_{size}": {
            **_LLAMA,
            "vocab_size": 49152,
            "max_position_embeddings": 8192,
            "rope_scaling": None,
            "tie_word_embeddings": True,
            **dims,
        }
        for size, dims in {
            "135m": {
                "hidden_size": 576,
                "intermediate_size": 1536,
                "num_attention_heads": 9,
                "num_hidden_layers": 30,
                "num_key_value_heads": 3,
                "rope_theta": 100000,
            },
            "360m": {
                "hidden_size": 960,
                "intermediate_size": 2560,
                "num_attention_heads": 15,
                "num_hidden_layers": 32,
                "num_key_value_heads": 5,
                "rope_theta": 100000,
            },
            "1_7b": {
                "hidden_size": 2048,
                "intermediate_size": 8192,
                "num_attention_heads": 32,
                "num_hidden_layers": 24,
                "num_key_value_heads": 32,
                "rope_theta": 130000,
            },
        }.items()
    },
    "gemma_2b": {
        **_GEMMA,
        "model_type": "gemma",
        "hidden_act": "gelu",
        "hidden_size": 2048,
        "intermediate_size": 16384,
        "num_attention_heads": 8,
        "num_hidden_layers": 18,
        "num_key_value_heads": 1,
    },
    "gemma2_2b": {
        **_GEMMA,
        **_GEMMA2,
        "hidden_size": 2304,
        "intermediate_size": 9216,
        "num_attention_heads": 8,
        "num_hidden_layers": 26,
        "num_key_value_heads": 4,
    },
    "gemma2_9b": {
        **_GEMMA,
        **_GEMMA2,
        "hidden_size": 3584,
        "intermediate_size": 14336,
        "num_attention_heads": 16,
        "num_hidden_layers": 42,
        "num_key_value_heads": 8,
    },
    "phi3_mini": {
        "model_type": "phi3",
        "vocab_size": 32064,
        "hidden_act": "silu",
        "hidden_size": 3072,
        "intermediate_size": 8192,
        "num_attention_heads": 32,
        "num_hidden_layers": 32,
        "num_key_value_heads": 32,
        "max_position_embeddings": 4096,
        "original_max_position_embeddings": 4096,
        "rms_norm_eps": 1e-05,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "sliding_window": 2047,
        "tie_word_embeddings": False,
    },
    "phi4": {
        "model_type": "phi3",
        "vocab_size": 100352,
        "hidden_act": "silu",
        "hidden_size": 5120,
        "intermediate_size": 17920,
        "num_attention_heads": 40,
        "num_hidden_layers": 40,
        "num_key_value_heads": 10,
        "max_position_embeddings": 16384,
        "original_max_position_embeddings": 16384,
        "rms_norm_eps": 1e-05,
        "rope_theta": 250000,
        "rope_scaling": None,
        "sliding_window": None,
        "tie_word_embeddings": False,
    },
    **{
        option: {
            "model_type": "llama",
            "hidden_act": "silu",
            "hidden_size": 4096,
            "intermediate_size": 11008,
            "num_attention_heads": 32,
            "num_hidden_layers": 32,
            "num_key_value_heads": 32,
            "rms_norm_eps": 1e-05,
            "rope_scaling": None,
            "tie_word_embeddings": False,
            **published,
        }
        for option, published in {
            "llama2_7b": {
                "vocab_size": 32000,
                "max_position_embeddings": 4096,
                "rope_theta": 10000.0,
            },
            "code_llama2_7b": {
                "vocab_size": 32016,
                "max_position_embeddings": 16384,
                "rope_theta": 1000000,
            },
        }.items()
    },
    "mistral_7b": {
        "model_type": "mistral",
        "vocab_size": 32768,
        "hidden_act": "silu",
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_attention_heads": 32,
        "num_hidden_layers": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-05,
        "rope_theta": 1000000.0,
        "sliding_window": None,
        "tie_word_embeddings": False,
    },
}


@pytest.mark.parametrize("option", sorted(PUBLISHED))
def test_zoo_option_builds_its_hub_repos_model(option: str) -> None:
    model = model_config([f"model={option}"])
    # The instruct (chat) checkpoints; Phi-4 has no base release beside it.
    assert model.source.startswith("hf://")
    assert re.search(r"-Instruct|-instruct|-it$|-chat-", model.source) or option == "phi4"
    config = PUBLISHED[option]
    family = family_of(config, model.source)
    assert family.name == model.family
    # Raises unless every argument but max_seq_len agrees with the config.json.
    check_source_matches(
        family,
        OmegaConf.to_container(model.builder),
        builder_args(family, config, ""),
        model.source,
    )
    # Phi-3 mini's sequences end at its sliding window (runner/models/families/phi3.py).
    window = config.get("sliding_window") if config["model_type"] == "phi3" else None
    assert model.builder.max_seq_len == (window or config["max_position_embeddings"])


# Parameter counts of the hub repos (their model cards and safetensors index totals).
PARAMETERS = {
    "gemma_2b": 2_506_172_416,
    "gemma2_2b": 2_614_341_888,
    "phi3_mini": 3_821_079_552,
    "phi4": 14_659_507_200,
    "smollm2_135m": 134_515_008,
    "llama2_7b": 6_738_415_616,
    "llama3_3_70b": 70_553_706_496,
}


@pytest.mark.parametrize("option", sorted(PARAMETERS))
def test_zoo_option_has_its_hub_repos_parameter_count(option: str) -> None:
    builder = resolve_model(model_config([f"model={option}"]), need_files=False).builder
    with torch.device("meta"):
        model = instantiate(OmegaConf.create(builder))
    assert sum(p.numel() for p in model.parameters()) == PARAMETERS[option]


def test_estimate_of_a_zoo_option_needs_no_download(capsys, tmp_path: Path) -> None:
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        overrides = ["model=llama3_2_1b", "compute=cpu", "dtype=bf16"]
        cfg = compose("train", overrides=[*overrides, f"runtime.cache_dir={tmp_path}"])
    recipe = resolve_recipe(cfg, tmp_path, fetch=False)
    print_estimate(recipe, estimate(recipe))
    # Llama 3.2 1B's published parameter count; the data needs the tokenizer, not here.
    out = capsys.readouterr().out
    assert "1,235,814,400 parameters, bf16" in out and "activations    not estimated" in out
    # Each dtype's state is priced all the same, as a bound: docs/config.md says estimate prints
    # each one's memory.
    (by_dtype,) = [line for line in out.splitlines() if line.startswith("by dtype")]
    assert by_dtype.startswith("by dtype       at least fp32 ") and "bf16 " in by_dtype
