"""Tiny real-format checkpoints of every supported family, written by `transformers`.

    write_tiny_checkpoint("qwen2_5", path)

writes what a hub repo of that family holds (config.json, model.safetensors,
generation_config.json, tokenizer.json, tokenizer_config.json with the family's published
chat template), at dimensions small enough for a CPU test. Tests point `model.source` at it,
as a plain directory or laid out as a hub cache snapshot.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from tokenizers import (
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)

from tests.published_templates import (
    GEMMA_TEMPLATE,
    LLAMA3_1_TEMPLATE,
    LLAMA3_2_TEMPLATE,
    MISTRAL_TEMPLATE,
    PHI3_TEMPLATE,
    PHI4_TEMPLATE,
    QWEN2_5_TEMPLATE,
    SMOLLM2_TEMPLATE,
)

FAMILIES = (
    "llama3_2",
    "llama3_1",
    "qwen2_5",
    "mistral",
    "gemma",
    "gemma2",
    "phi3",
    "phi4",
    "smollm2",
)
# The model family (runner/models/families/) each fixture family is a checkpoint of.
FAMILY_OF = {
    "llama3_2": "llama3",
    "llama3_1": "llama3",
    "smollm2": "llama3",
    "qwen2_5": "qwen2",
    "mistral": "mistral",
    "gemma": "gemma",
    "gemma2": "gemma2",
    "phi3": "phi3",
    "phi4": "phi3",
}
# Fixture families whose chat template refuses a system message.
NO_SYSTEM_ROLE = ("gemma", "gemma2")

# The pre-tokenizer split patterns of Llama 3's tiktoken and Qwen2's tokenizer.json.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_CORPUS = [
    "Reverse the word. Uppercase the word. You are a helpful assistant. Answer briefly.",
    "You are Qwen, created by Alibaba Cloud. Cutting Knowledge Date: December 2023",
    "Today Date: 26 Jul 2024. system user assistant The quick brown fox jumps over the lazy dog.",
    "THE QUICK BROWN FOX JUMPS OVER THE LAZY DOG 0123456789 hello world\n\n",
]


def _byte_level(split: str, vocab_size: int) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(split), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_CORPUS, trainer)
    return tokenizer


def _metaspace(special: list[str], vocab_size: int) -> Tokenizer:
    """A SentencePiece-style BPE (▁ for spaces), special tokens first, as Mistral's."""
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tokenizer.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    printable = [chr(c) for c in range(33, 127)]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=special,
        initial_alphabet=["▁", *printable],
        show_progress=False,
    )
    tokenizer.train_from_iterator(_CORPUS, trainer)
    return tokenizer


# family -> (HF config class name, architecture, tokenizer files, extra config.json fields)
_LLAMA3_SPECIAL = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|reserved_special_token_0|>",
    "<|finetune_right_pad_id|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eom_id|>",
    "<|eot_id|>",
    "<|python_tag|>",
]
_QWEN2_SPECIAL = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|box_start|>",
    "<tool_call>",
    "</tool_call>",
]
_MISTRAL_SPECIAL = ["<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[TOOL_CALLS]"]


def _tokenizer(family: str) -> tuple[Tokenizer, dict[str, Any]]:
    """The fixture tokenizer and its tokenizer_config.json, as the family's hub repos hold them."""
    if family.startswith("llama3"):
        tokenizer = _byte_level(_LLAMA3_SPLIT, 320)
        tokenizer.add_special_tokens(_LLAMA3_SPECIAL)
        bos = tokenizer.token_to_id("<|begin_of_text|>")
        tokenizer.post_processor = processors.Sequence(
            [
                processors.ByteLevel(trim_offsets=False),
                processors.TemplateProcessing(
                    single="<|begin_of_text|> $A",
                    pair="<|begin_of_text|> $A <|begin_of_text|> $B",
                    special_tokens=[("<|begin_of_text|>", bos)],
                ),
            ]
        )
        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": "<|begin_of_text|>",
            "eos_token": "<|eot_id|>",
            "clean_up_tokenization_spaces": True,
            "model_input_names": ["input_ids", "attention_mask"],
            "model_max_length": 131072,
            "chat_template": LLAMA3_2_TEMPLATE if family == "llama3_2" else LLAMA3_1_TEMPLATE,
        }
        return tokenizer, config
    if family == "qwen2_5":
        tokenizer = _byte_level(_QWEN2_SPLIT, 320)
        tokenizer.normalizer = normalizers.NFC()
        tokenizer.add_special_tokens(_QWEN2_SPECIAL)
        tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
        config = {
            "tokenizer_class": "Qwen2Tokenizer",
            "bos_token": None,
            "eos_token": "<|im_end|>",
            "pad_token": "<|endoftext|>",
            "errors": "replace",
            "split_special_tokens": False,
            "clean_up_tokenization_spaces": False,
            "model_max_length": 131072,
            "chat_template": QWEN2_5_TEMPLATE,
        }
        return tokenizer, config
    if family == "mistral":
        tokenizer = _metaspace(_MISTRAL_SPECIAL, 300)
        config = {
            "tokenizer_class": "LlamaTokenizer",
            "bos_token": "<s>",
            "eos_token": "</s>",
            "unk_token": "<unk>",
            "add_bos_token": True,
            "add_eos_token": False,
            "legacy": False,
            "clean_up_tokenization_spaces": False,
            "model_max_length": 1000000000000000019884624838656,
            "chat_template": MISTRAL_TEMPLATE,
        }
        return tokenizer, config
    return _more_tokenizers(family)


_GEMMA_SPECIAL = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>", "<mask>"]
_PHI3_SPECIAL = [
    "<unk>",
    "<s>",
    "</s>",
    "<|endoftext|>",
    "<|assistant|>",
    "<|system|>",
    "<|user|>",
    "<|end|>",
]
_PHI4_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_sep|>", "<|im_end|>", "<|dummy_87|>"]
_SMOLLM2_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def _more_tokenizers(family: str) -> tuple[Tokenizer, dict[str, Any]]:
    """Gemma's and Phi-3's SentencePiece-style tokenizers, Phi-4's and SmolLM2's byte-level."""
    if family in ("gemma", "gemma2"):
        tokenizer = _metaspace(_GEMMA_SPECIAL, 300)
        # Gemma's own pipeline, which transformers 5 builds for GemmaTokenizer: spaces written
        # as ▁ by the normalizer, none put before the text, and bytes for unknown characters.
        tokenizer.normalizer = normalizers.Replace(" ", "▁")
        tokenizer.pre_tokenizer = pre_tokenizers.Split(" ", "merged_with_previous")
        tokenizer.decoder = decoders.Sequence(
            [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
        )
        tokenizer.post_processor = processors.TemplateProcessing(
            single="<bos> $A", pair="<bos> $A <bos> $B", special_tokens=[("<bos>", 2)]
        )
        config = {
            # As Gemma's hub repos say: transformers 5 builds the class's own pipeline (no
            # Metaspace, no space before the text) over tokenizer.json's vocabulary and merges.
            "tokenizer_class": "GemmaTokenizer",
            "bos_token": "<bos>",
            "eos_token": "<eos>",
            "pad_token": "<pad>",
            "unk_token": "<unk>",
            "clean_up_tokenization_spaces": False,
            "model_max_length": 1000000000000000019884624838656,
            "chat_template": GEMMA_TEMPLATE,
        }
        return tokenizer, config
    if family == "phi3":
        tokenizer = _metaspace(_PHI3_SPECIAL, 300)
        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": "<s>",
            "eos_token": "<|endoftext|>",
            "pad_token": "<|endoftext|>",
            "unk_token": "<unk>",
            "clean_up_tokenization_spaces": False,
            "model_max_length": 4096,
            "chat_template": PHI3_TEMPLATE,
        }
        return tokenizer, config
    special = _PHI4_SPECIAL if family == "phi4" else _SMOLLM2_SPECIAL
    if family not in ("phi4", "smollm2"):
        raise ValueError(f"unknown family {family!r}; known: {FAMILIES}")
    tokenizer = _byte_level(_LLAMA3_SPLIT, 320)
    tokenizer.add_special_tokens(special)
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|endoftext|>" if family == "phi4" else "<|im_start|>",
        "eos_token": "<|im_end|>",
        "pad_token": "<|dummy_87|>" if family == "phi4" else "<|im_end|>",
        "clean_up_tokenization_spaces": False,
        "model_max_length": 16384 if family == "phi4" else 8192,
        "chat_template": PHI4_TEMPLATE if family == "phi4" else SMOLLM2_TEMPLATE,
    }
    return tokenizer, config


def _config(config_class: Any, **values: Any) -> Any:
    """config_class(**values): the keywords as each family's hub repo writes them (rope_theta,
    rope_scaling), which transformers 4 types and transformers 5 takes untyped (its configs
    type rope_parameters, and read these into it)."""
    return config_class(**values)


def _model_config(family: str, vocab_size: int, tokenizer: Tokenizer, width: int = 64) -> Any:
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    dims = {
        "vocab_size": vocab_size,
        "hidden_size": width,
        "intermediate_size": 2 * width,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "hidden_act": "silu",
        "initializer_range": 0.02,
    }
    if family.startswith("llama3"):
        factor = 32.0 if family == "llama3_2" else 8.0
        return _config(
            LlamaConfig,
            **dims,
            max_position_embeddings=131072,
            rms_norm_eps=1e-5,
            rope_theta=500000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": factor,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
            tie_word_embeddings=family == "llama3_2",
            bos_token_id=tokenizer.token_to_id("<|begin_of_text|>"),
            eos_token_id=[
                tokenizer.token_to_id(t) for t in ("<|end_of_text|>", "<|eom_id|>", "<|eot_id|>")
            ],
        )
    if family == "qwen2_5":
        return _config(
            Qwen2Config,
            **dims,
            max_position_embeddings=32768,
            rms_norm_eps=1e-6,
            rope_theta=1000000.0,
            tie_word_embeddings=True,
            use_sliding_window=False,
            sliding_window=None,
            max_window_layers=2,
            bos_token_id=tokenizer.token_to_id("<|endoftext|>"),
            eos_token_id=tokenizer.token_to_id("<|im_end|>"),
        )
    if family in ("gemma", "gemma2", "phi3", "phi4", "smollm2"):
        return _more_model_configs(family, dims, tokenizer)
    return _config(
        MistralConfig,
        **dims,
        head_dim=16,
        max_position_embeddings=32768,
        rms_norm_eps=1e-5,
        rope_theta=1000000.0,
        sliding_window=None,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )


def _more_model_configs(family: str, dims: dict[str, Any], tokenizer: Tokenizer) -> Any:
    from transformers import Gemma2Config, GemmaConfig, LlamaConfig, Phi3Config

    ids = tokenizer.token_to_id
    if family == "gemma":
        # Gemma's head_dim is its own (2B: 256 with hidden_size 2048 and 8 heads).
        return _config(
            GemmaConfig,
            **{**dims, "hidden_act": "gelu_pytorch_tanh"},
            head_dim=32,
            max_position_embeddings=8192,
            rms_norm_eps=1e-6,
            rope_theta=10000.0,
            tie_word_embeddings=True,
            bos_token_id=ids("<bos>"),
            eos_token_id=ids("<eos>"),
            pad_token_id=ids("<pad>"),
        )
    if family == "gemma2":
        # A window of 8 tokens, so that the sliding-window layers attend differently in a test.
        return _config(
            Gemma2Config,
            **{**dims, "hidden_act": "gelu_pytorch_tanh"},
            hidden_activation="gelu_pytorch_tanh",
            head_dim=32,
            max_position_embeddings=8192,
            rms_norm_eps=1e-6,
            rope_theta=10000.0,
            attn_logit_softcapping=50.0,
            final_logit_softcapping=30.0,
            query_pre_attn_scalar=24,
            sliding_window=8,
            tie_word_embeddings=True,
            bos_token_id=ids("<bos>"),
            eos_token_id=[ids("<eos>"), ids("<end_of_turn>")],
            pad_token_id=ids("<pad>"),
        )
    if family in ("phi3", "phi4"):
        phi3 = family == "phi3"
        return _config(
            Phi3Config,
            **dims,
            max_position_embeddings=4096 if phi3 else 16384,
            original_max_position_embeddings=4096 if phi3 else 16384,
            rms_norm_eps=1e-5,
            rope_theta=10000.0 if phi3 else 250000.0,
            # Phi-3 mini's window is the whole 4K context less one; Phi-4 has none.
            sliding_window=2047 if phi3 else None,
            tie_word_embeddings=False,
            bos_token_id=ids("<s>") if phi3 else ids("<|endoftext|>"),
            eos_token_id=ids("<|endoftext|>") if phi3 else ids("<|im_end|>"),
            pad_token_id=ids("<|endoftext|>") if phi3 else ids("<|dummy_87|>"),
        )
    # SmolLM2: the Llama architecture with plain RoPE and tied embeddings.
    return _config(
        LlamaConfig,
        **dims,
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
        rope_theta=100000.0,
        tie_word_embeddings=True,
        bos_token_id=ids("<|im_start|>"),
        eos_token_id=ids("<|im_end|>"),
    )


def write_family_tokenizer(family: str, path: Path) -> Tokenizer:
    """`family`'s fixture tokenizer (one of FAMILIES) into `path`: tokenizer.json and
    tokenizer_config.json, as its hub repo holds them. Returns the tokenizer."""
    path.mkdir(parents=True, exist_ok=True)
    tokenizer, tokenizer_config = _tokenizer(family)
    tokenizer.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    return tokenizer


def write_tiny_checkpoint(family: str, path: Path, seed: int = 0, width: int = 64) -> Path:
    """A tiny random checkpoint of `family` in Hugging Face's layout, written by transformers.

    family: one of FAMILIES (a published model's name, FAMILY_OF gives its family). width:
    hidden_size (256 makes every projection a whole number of QLoRA's NF4 blocks). Returns
    `path`.
    """
    from transformers import AutoModelForCausalLM

    path = Path(path)
    tokenizer = write_family_tokenizer(family, path)
    config = _model_config(family, tokenizer.get_vocab_size(), tokenizer, width)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # Random norms and biases, so that a wrongly mapped one changes the logits.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
                param.normal_(1.0 if name.endswith("norm.weight") else 0.0, 0.1)
    model.save_pretrained(path)
    return path


def write_hub_snapshot(
    family: str, hub_cache: Path, repo_id: str, revision: str = "a" * 40
) -> Path:
    """The same checkpoint laid out as huggingface_hub's cache holds a downloaded repo.

    hub_cache is HF_HUB_CACHE (HF_HOME/hub); returns the snapshot directory, which
    `huggingface_hub.snapshot_download(repo_id, local_files_only=True)` finds offline.
    """
    repo_dir = Path(hub_cache) / f"models--{repo_id.replace('/', '--')}"
    (repo_dir / "refs").mkdir(parents=True, exist_ok=True)
    (repo_dir / "refs" / "main").write_text(revision)
    return write_tiny_checkpoint(family, repo_dir / "snapshots" / revision)
