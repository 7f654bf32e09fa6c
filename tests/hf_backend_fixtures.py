"""Tiny checkpoints of architectures no runner family builds, written by transformers."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from tests.fixtures import _tokenizer

# Architectures the transformers backend trains in the tests: Qwen3 (q/k norms, separate
# q/k/v projections, untied head) and GPT-2 (learned positions, fused qkv in Conv1D, tied head).
ARCHITECTURES = ("qwen3", "gpt2")


def _config(arch: str, vocab_size: int, bos: int, eos: int) -> Any:
    from transformers import GPT2Config, LlamaConfig, Qwen3Config

    if arch == "qwen3":
        return Qwen3Config(
            vocab_size=vocab_size,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            max_position_embeddings=2048,
            tie_word_embeddings=False,
            bos_token_id=bos,
            eos_token_id=eos,
        )
    if arch == "gpt2":
        # No dropout: transformers' loss on a batch is then the training step's, exactly.
        return GPT2Config(
            vocab_size=vocab_size,
            n_positions=1024,
            n_embd=64,
            n_layer=2,
            n_head=4,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            bos_token_id=bos,
            eos_token_id=eos,
        )
    if arch == "llama":
        # The benchmark's model: about 25M parameters with the fixture tokenizer.
        return LlamaConfig(
            vocab_size=vocab_size,
            hidden_size=512,
            intermediate_size=1536,
            num_hidden_layers=8,
            num_attention_heads=8,
            num_key_value_heads=4,
            max_position_embeddings=8192,
            rope_theta=500000.0,
            tie_word_embeddings=False,
            bos_token_id=bos,
            eos_token_id=eos,
        )
    raise ValueError(arch)


def write_arch_checkpoint(arch: str, path: Path, seed: int = 0) -> Path:
    """A random `arch` checkpoint (qwen3, gpt2, llama) with the fixture's ChatML tokenizer."""
    from transformers import AutoModelForCausalLM

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer, tokenizer_config = _tokenizer("qwen2_5")
    tokenizer.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    bos, eos = tokenizer.token_to_id("<|endoftext|>"), tokenizer.token_to_id("<|im_end|>")
    config = _config(arch, tokenizer.get_vocab_size(), bos, eos)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 1:  # random norms and biases: a misplaced one shows
                param.normal_(1.0 if "norm" in name or "ln" in name else 0.0, 0.1)
    model.save_pretrained(path)
    return path
