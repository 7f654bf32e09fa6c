"""Qwen2 and Qwen2.5: config.json model_type "qwen2"."""

from __future__ import annotations

from typing import Any

from runner.families._family import Family, GGUFFacts, Unsupported, rope, rope_type
from runner.families._weights import LLAMA_NAMES, WeightNames

# Llama's layout plus biases on the q, k and v projections.
QWEN2_NAMES = {
    **LLAMA_NAMES,
    **{
        f"model.layers.{{}}.self_attn.{proj}.bias": f"layers.{{}}.attn.{proj}.bias"
        for proj in ("q_proj", "k_proj", "v_proj")
    },
}


def builder_args(config: dict[str, Any]) -> dict[str, Any]:
    if rope_type(rope(config)) != "default":
        raise Unsupported(f"rope scaling {rope(config)}")
    if config.get("use_sliding_window"):
        raise Unsupported("use_sliding_window=true")
    return {"tie_word_embeddings": config["tie_word_embeddings"]}


def config_keys(builder: dict[str, Any]) -> dict[str, Any]:
    return {"use_sliding_window": False, "sliding_window": None}


FAMILY = Family(
    name="qwen2",
    model_type="qwen2",
    architecture="Qwen2ForCausalLM",
    builders={"torchtune.models.qwen2.qwen2": "torchtune.models.qwen2.lora_qwen2"},
    extra_args=builder_args,
    extra_config=config_keys,
    weights=WeightNames(QWEN2_NAMES, permute_qk=False),
    gguf=GGUFFacts(
        arch="qwen2",
        permute_qk=False,
        pre_tokenizers={
            "e636dc30a262dcc0d8c323492e32ae2b70728f4df7dfe9737d9f920a282b8aea": "qwen2",
            # Qwen3's tokenizer, which llama.cpp also names qwen2.
            "d4540891389ea895b53b399da6ac824becc30f2fba0e9ddbb98f92e55ca0e97c": "qwen2",
        },
    ),
)
