"""A GGUF file (llama.cpp's format) from a Hugging Face Llama or Qwen2 model, with `gguf`.

The layout follows llama.cpp's own converter (convert_hf_to_gguf.py): the same metadata keys,
tensor names, q/k permutation for the llama architecture, rope_freqs for Llama 3 RoPE scaling,
and the same rule for which tensors stay F32. What differs by family (llama.cpp architecture,
q/k permutation, pre-tokenizer hashes) is each family's `gguf` facts (runner/families/).
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path
from typing import Any

import gguf
import torch
from gguf import GGMLQuantizationType, GGUFValueType, LlamaFileType, TokenType

from runner.errors import UserError
from runner.families import FAMILIES, GGUFFacts, head_dim, rope, rope_type

# quantization= option -> the file type recorded in the header and the type of 2-D weights.
QUANTIZATIONS = {
    "f16": (LlamaFileType.MOSTLY_F16, GGMLQuantizationType.F16),
    "q8_0": (LlamaFileType.MOSTLY_Q8_0, GGMLQuantizationType.Q8_0),
}


# llama.cpp picks its pre-tokenizer (the regex split before BPE) by name. Its converter names it
# by hashing the token ids of this text; each family lists the hashes of its tokenizers.
_CHECK_TEXT = (
    "\n \n\n \n\n\n \t \t\t \t\n  \n   \n    \n     \n\U0001f680 (normal) \U0001f636\u200d"
    "\U0001f32b\ufe0f (multiple emojis concatenated) \u2705 \U0001f999\U0001f999 3 33 333 3333 "
    "33333 333333 3333333 33333333 3.3 3..3 3...3 \u1780\u17b6\u1793\u17cb\u178f\u17c2\u1796"
    "\u17b7\u179f\u17c1\u179f\u17a2\u17b6\u1785\U0001f601 ?\u6211\u60f3\u5728apple\u5de5\u4f5c"
    "1314151\u5929\uff5e ------======= \u043d\u0435\u0449\u043e \u043d\u0430 \u0411\u044a\u043b"
    "\u0433\u0430\u0440\u0441\u043a\u0438 ''''''```````\"\"\"\"......!!!!!!?????? I've been "
    "'told he's there, 'RE you sure? 'M not sure I'll make it, 'D you like some tea? We'Ve a'lL"
)


class _Writer(gguf.GGUFWriter):
    """GGUFWriter that can also write an empty typed array (a byte-level BPE with no merges).

    gguf 0.19 has no public way: add_key_value stores the value and _pack_val, which
    write_kv_data_to_file calls, refuses an empty array; and llama.cpp refuses a gpt2 tokenizer
    without tokenizer.ggml.merges, so the key cannot be left out.
    """

    def _pack_val(
        self, val: Any, vtype: GGUFValueType, add_vtype: bool, sub_type: GGUFValueType | None = None
    ) -> bytes:
        if vtype == GGUFValueType.ARRAY and sub_type is not None and len(val) == 0:
            head = self._pack("I", vtype) if add_vtype else b""
            return head + self._pack("I", sub_type) + self._pack("Q", 0)
        return super()._pack_val(val, vtype, add_vtype, sub_type)


def family_of(config: dict[str, Any]) -> GGUFFacts:
    """The llama.cpp facts of a config.json's family; other families are a user error."""
    exportable = {f.architecture: f.gguf for f in FAMILIES.values() if f.gguf is not None}
    architectures = config.get("architectures") or []
    for name in architectures:
        if name in exportable:
            return exportable[name]
    raise UserError(
        "format",
        "gguf",
        f"GGUF export supports {', '.join(exportable)}; this checkpoint is {architectures}: "
        "export format=merged and convert it with llama.cpp's convert_hf_to_gguf.py",
    )


def write_gguf(
    path: Path,
    *,
    state_dict: dict[str, torch.Tensor],
    config: dict[str, Any],
    tokenizer: Any,
    quantization: str,
    name: str,
) -> None:
    """Write a model (Hugging Face names, fp32) and its tokenizer as one GGUF file."""
    family = family_of(config)
    file_type, weight_type = QUANTIZATIONS[quantization]
    writer = _Writer(path, family.arch)
    writer.add_name(name)
    writer.add_file_type(file_type)
    _add_hparams(writer, config)
    _add_tokenizer(writer, tokenizer, vocab_size=config["vocab_size"])
    for gguf_name, tensor in _tensors(state_dict, config, family):
        data = tensor.to(torch.float32).numpy()
        # As llama.cpp's converter: 1-D tensors and norms stay F32, matrices take the quant type.
        qtype = GGMLQuantizationType.F32 if data.ndim <= 1 else weight_type
        try:
            packed = gguf.quants.quantize(data, qtype)
        except gguf.QuantError:  # a row length Q8_0's 32-wide blocks do not divide
            qtype = GGMLQuantizationType.F16
            packed = gguf.quants.quantize(data, qtype)
        writer.add_tensor(gguf_name, packed, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _add_hparams(writer: gguf.GGUFWriter, config: dict[str, Any]) -> None:
    writer.add_vocab_size(config["vocab_size"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_key_length(head_dim(config))
    writer.add_value_length(head_dim(config))
    writer.add_rope_dimension_count(head_dim(config))
    writer.add_rope_freq_base(float(rope(config)["rope_theta"]))
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    scaling = rope_type(rope(config))
    if scaling == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope(config)["factor"])
    elif scaling not in ("default", "llama3"):  # llama3 scaling travels as rope_freqs
        raise UserError(
            "format",
            "gguf",
            f"this checkpoint's RoPE scaling {scaling!r} is not supported by the GGUF export: "
            "export format=merged and convert it with llama.cpp's convert_hf_to_gguf.py",
        )


def _add_tokenizer(writer: gguf.GGUFWriter, tokenizer: Any, *, vocab_size: int) -> None:
    """Byte-level BPE vocabulary, merges, special ids and chat template ("gpt2" in llama.cpp)."""
    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    model = spec["model"]
    if model["type"] != "BPE" or "ByteLevel" not in json.dumps(spec["decoder"]):
        raise UserError(
            "format",
            "gguf",
            f"the GGUF export handles byte-level BPE tokenizers (Llama 3, Qwen2); this one is "
            f"{model['type']}: export format=merged and convert with llama.cpp's converter",
        )
    by_id = {index: text for text, index in tokenizer.get_vocab().items()}
    added = tokenizer.added_tokens_decoder
    tokens, types = [], []
    for index in range(vocab_size):
        if index not in by_id:
            tokens.append(f"[PAD{index}]")
            types.append(TokenType.UNUSED)
        elif index in added:
            tokens.append(added[index].content)
            types.append(TokenType.CONTROL if added[index].special else TokenType.USER_DEFINED)
        else:
            tokens.append(by_id[index])
            types.append(TokenType.NORMAL)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(_pre_tokenizer(tokenizer, merges))
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_key_value(
        gguf.Keys.Tokenizer.MERGES, merges, GGUFValueType.ARRAY, sub_type=GGUFValueType.STRING
    )
    for kind in ("bos", "eos", "pad", "unk"):
        token_id = getattr(tokenizer, f"{kind}_token_id")
        if token_id is not None:
            getattr(writer, f"add_{kind}_token_id")(token_id)
    with_special = tokenizer("a").input_ids
    without = tokenizer("a", add_special_tokens=False).input_ids
    writer.add_add_bos_token(tokenizer.bos_token_id is not None and with_special[:1] != without[:1])
    writer.add_add_eos_token(
        tokenizer.eos_token_id is not None and with_special[-1:] != without[-1:]
    )
    if isinstance(tokenizer.chat_template, str):
        writer.add_chat_template(tokenizer.chat_template)


def _pre_tokenizer(tokenizer: Any, merges: list[str]) -> str:
    """llama.cpp's name for the tokenizer's pre-tokenizer, found as llama.cpp's converter does."""
    ids = tokenizer.backend_tokenizer.encode(_CHECK_TEXT).ids  # as tokenizer.encode, unbounded
    digest = hashlib.sha256(str(ids).encode()).hexdigest()
    known = {
        h: name for f in FAMILIES.values() if f.gguf for h, name in f.gguf.pre_tokenizers.items()
    }
    if digest in known:
        return known[digest]
    if not merges:
        # Without merges every byte is its own token however the text is split first.
        return "llama-bpe"
    raise UserError(
        "format",
        "gguf",
        "this tokenizer's pre-tokenizer is not one the GGUF export knows (Llama 3, Qwen2): "
        "export format=merged and convert it with llama.cpp's convert_hf_to_gguf.py",
    )


def _permute(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """Hugging Face's rotate-halves row order -> llama.cpp's adjacent pairs (per head)."""
    return (
        weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def _tensors(
    state_dict: dict[str, torch.Tensor], config: dict[str, Any], family: GGUFFacts
) -> list[tuple[str, torch.Tensor]]:
    arch = {name: arch for arch, name in gguf.MODEL_ARCH_NAMES.items()}[family.arch]
    names = gguf.get_tensor_name_map(arch, config["num_hidden_layers"])
    out = []
    for hf_name, tensor in state_dict.items():
        if hf_name == "lm_head.weight" and config.get("tie_word_embeddings"):
            continue  # llama.cpp reuses token_embd when output.weight is absent
        if hf_name.endswith("rotary_emb.inv_freq"):
            continue
        gguf_name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if gguf_name is None:
            raise UserError(
                "format", "gguf", f"no GGUF name for tensor {hf_name}: export format=merged instead"
            )
        if family.permute_qk and hf_name.endswith("q_proj.weight"):
            tensor = _permute(tensor, config["num_attention_heads"])
        elif family.permute_qk and hf_name.endswith("k_proj.weight"):
            tensor = _permute(tensor, config["num_key_value_heads"])
        out.append((gguf_name, tensor))
    settings = rope(config)
    if rope_type(settings) == "llama3":
        out.append(("rope_freqs.weight", _llama3_rope_factors(settings, head_dim(config))))
    return out


def _llama3_rope_factors(rope: dict[str, Any], head_dim: int) -> torch.Tensor:
    """Per-frequency divisors of Llama 3 RoPE scaling, which llama.cpp reads as rope_freqs."""
    base, factor = float(rope["rope_theta"]), float(rope["factor"])
    low, high = float(rope["low_freq_factor"]), float(rope["high_freq_factor"])
    old_context = float(rope["original_max_position_embeddings"])
    freqs = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    factors = []
    for freq in freqs.tolist():
        wavelength = 2 * math.pi / freq
        if wavelength < old_context / high:
            factors.append(1.0)
        elif wavelength > old_context / low:
            factors.append(factor)
        else:
            smooth = (old_context / wavelength - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(factors, dtype=torch.float32)
