"""A GGUF file (llama.cpp's format) from a Hugging Face causal LM, with `gguf`.

The architecture and tensor names come from gguf's own tables (gguf.MODEL_ARCH_NAMES,
gguf.get_tensor_name_map). The layout follows llama.cpp's converter (convert_hf_to_gguf.py): the
same metadata keys, the q/k permutation of its llama architecture, Gemma's norms stored with
their 1 added, rope_freqs for Llama 3 RoPE scaling, and the same rule for which tensors stay F32.
Only the architectures whose files llama.cpp has been seen to load with transformers' logits
(GGUF_MODEL_TYPES) export: others llama.cpp names need fixes of their own (Cohere's logit
scale, GPT-NeoX's fused rows, GPT-2's hyperparameters), which a file written without them lacks
silently. Tokenizers: byte-level BPE ("gpt2") and
SentencePiece-style BPE ("llama", its merge order written as scores).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import sys
import tempfile
from pathlib import Path
from typing import Any

import gguf
import torch
from gguf import GGMLQuantizationType, GGUFValueType, LlamaFileType, TokenType

from runner.errors import UserError
from runner.models.families import head_dim, rope, rope_type

# The types this writer makes itself -> the file type recorded in the header and the type of
# 2-D weights. f32 is the source that llama.cpp's quantizer reads for the other types.
QUANTIZATIONS = {
    "f32": (LlamaFileType.ALL_F32, GGMLQuantizationType.F32),
    "f16": (LlamaFileType.MOSTLY_F16, GGMLQuantizationType.F16),
    "q8_0": (LlamaFileType.MOSTLY_Q8_0, GGMLQuantizationType.Q8_0),
}
# gguf.quantization= types that llama.cpp's own quantizer (llama_model_quantize) makes, by its
# LLAMA_FTYPE_MOSTLY_* name. No importance matrix. K-quants need rows of 256; where a matrix's
# rows are shorter (a small model), llama.cpp falls back to a type whose blocks fit (q8_0 for
# q6_k, q4_0 or q5_0 for the 2-5 bit K-quants) and says so on stderr.
LLAMA_CPP_TYPES = {
    "bf16": "BF16",
    "q6_k": "Q6_K",
    "q5_k_m": "Q5_K_M",
    "q4_k_m": "Q4_K_M",
    "q4_0": "Q4_0",
    "q2_k": "Q2_K",
}


# llama.cpp's line for a matrix whose rows do not fit its type's blocks, stored in another type.
_FALLBACK = re.compile(
    r"(?P<tensor>\S+)\s+- ncols\s+(?P<ncols>\d+) not divisible by\s+(?P<block>\d+) \(required "
    r"for type\s+(?P<wanted>\w+)\) -> falling back to\s+(?P<got>\w+)"
)


def quantize_with_llama_cpp(source: Path, out: Path, quantization: str) -> None:
    """`source` (an f32 GGUF file) quantized to `quantization` at `out` by llama.cpp."""
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{LLAMA_CPP_TYPES[quantization]}")
    params.nthread = max(1, len(os.sched_getaffinity(0)))
    # llama.cpp writes a line per tensor to stderr: only its warnings (a matrix falling back to
    # another type) and errors are passed on.
    with tempfile.TemporaryFile() as captured:
        sys.stderr.flush()
        saved = os.dup(2)
        os.dup2(captured.fileno(), 2)
        try:
            code = llama_cpp.llama_model_quantize(str(source).encode(), str(out).encode(), params)
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        captured.seek(0)
        said = captured.read().decode(errors="replace").splitlines()
    fallbacks = [m for m in map(_FALLBACK.search, said) if m]
    for line in said:
        if (line.startswith("warning") or "error" in line.lower()) and not _FALLBACK.search(line):
            print(line, file=sys.stderr)
    if fallbacks:  # a line per matrix was 25 lines for model=tiny: one, with the count
        widths: dict[tuple[str, str, str], set[int]] = {}
        for m in fallbacks:
            widths.setdefault((m["block"], m["wanted"], m["got"]), set()).add(int(m["ncols"]))
        why = "; ".join(
            f"rows of {' or '.join(map(str, sorted(ncols)))}, not a multiple of {block}: "
            f"{wanted} -> {got}"
            for (block, wanted, got), ncols in sorted(widths.items())
        )
        named = ", ".join(m["tensor"] for m in fallbacks[:3]) + (", ..." if fallbacks[3:] else "")
        print(
            f"warning: llama.cpp stored {len(fallbacks)} matrices in another type ({why}): {named}",
            file=sys.stderr,
        )
    if code != 0:
        raise RuntimeError(f"llama.cpp's quantizer failed ({code}) on {source}")


def greedy_sample(path: Path, prompt: str = "Hello!", max_tokens: int = 16) -> str | None:
    """The file's greedy answer to one user turn, rendered with its own chat template by
    llama.cpp; None without llama-cpp-python."""
    try:
        import llama_cpp
    except ImportError:
        return None
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=256, n_threads=1, verbose=False)
    try:
        answer = llm.create_chat_completion(
            messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens, temperature=0
        )
    finally:
        llm.close()
    assert isinstance(answer, dict), type(answer)  # without stream=True: one response
    return answer["choices"][0]["message"]["content"]


def checked_sample(path: Path) -> str | None:
    """greedy_sample, run on each file export writes: a UserError where llama.cpp cannot load
    the file (a tokenizer or architecture it takes otherwise than runner writes them)."""
    try:
        return greedy_sample(path)
    except ValueError as err:  # llama.cpp's "Failed to load model from file"
        raise UserError(
            "format",
            "gguf",
            f"llama.cpp cannot load the file written ({err}): a tokenizer or architecture it "
            "does not take as runner writes them; nothing was written. Export format=merged and "
            "convert that with llama.cpp's convert_hf_to_gguf.py, or serve it with runner deploy",
        ) from None


# llama.cpp picks its pre-tokenizer (the regex split before BPE) by name. Its converter names it
# by hashing the token ids of this text (PRE_TOKENIZERS).
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


# config.json's model_types this writer exports (each checked in llama.cpp against transformers'
# logits by tests/test_export_gguf.py) -> llama.cpp's architecture.
GGUF_MODEL_TYPES = {
    "llama": "llama",
    "mistral": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "gemma": "gemma",
    "gemma2": "gemma2",
    "phi3": "phi3",
}
# SentencePiece's space.
SPACE = "\u2581"
# What in general.name makes llama.cpp take a model's special tokens as Phi-3's (llama-vocab.cpp
# looks up "</s>", "<unk>", "<s>" and "<|endoftext|>", and fails to load a vocabulary without
# them): in the name of a run of another model (a sweep's "phi3_vs_llama"), it reads "phi 3".
PHI3_NAME = re.compile(r"phi-?3", re.IGNORECASE)
# llama.cpp's graph rotates adjacent pairs for these and Hugging Face rotates halves: its
# converter permutes q and k rows (LlamaModel.permute).
PERMUTE_QK = {"llama"}
# Norms Hugging Face applies as (1 + weight), which llama.cpp stores with the 1 added.
NORM_PLUS_ONE = {"gemma", "gemma2", "gemma3"}
# Token ids llama.cpp's pre-tokenizer is named by (the hash of the check text's ids), for the
# byte-level BPE tokenizers of the checkpoints runner fine-tunes (Llama 3, Qwen2/Qwen3, SmolLM2).
PRE_TOKENIZERS = {
    "0ef9807a4087ebef797fc749390439009c3b9eda9ad1a097abbe738f486c01e5": "llama-bpe",
    "e636dc30a262dcc0d8c323492e32ae2b70728f4df7dfe9737d9f920a282b8aea": "qwen2",
    "d4540891389ea895b53b399da6ac824becc30f2fba0e9ddbb98f92e55ca0e97c": "qwen2",
    # SmolLM's tokenizer (HuggingFaceTB/SmolLM-135M), which SmolLM2 keeps.
    "855059429035d75a914d1eda9f10a876752e281a054a7a3d421ef0533e5b6249": "smollm",
}


def gguf_arch(config: dict[str, Any], checkpoint: Path | str) -> gguf.MODEL_ARCH:
    """llama.cpp's architecture of a config.json; a UserError where this writer has none."""
    model_type = config.get("model_type")
    name = GGUF_MODEL_TYPES.get(model_type) if isinstance(model_type, str) else None
    if name is None:
        raise UserError(
            "checkpoint",
            str(checkpoint),
            f"its config.json has model_type={model_type!r} ({config.get('architectures')}), "
            f"which the GGUF export does not write (it writes {', '.join(GGUF_MODEL_TYPES)}): "
            "export format=merged, and convert that with llama.cpp's convert_hf_to_gguf.py",
        )
    by_name = {arch_name: arch for arch, arch_name in gguf.MODEL_ARCH_NAMES.items()}
    return by_name[name]


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
    arch = gguf_arch(config, name)
    file_type, weight_type = QUANTIZATIONS[quantization]
    writer = _Writer(path, gguf.MODEL_ARCH_NAMES[arch])
    writer.add_name(name if arch == gguf.MODEL_ARCH.PHI3 else PHI3_NAME.sub("phi 3", name))
    writer.add_file_type(file_type)
    _add_hparams(writer, config, arch)
    _add_tokenizer(writer, tokenizer, vocab_size=config["vocab_size"])
    for gguf_name, tensor in _tensors(state_dict, config, arch):
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


def _add_hparams(writer: gguf.GGUFWriter, config: dict[str, Any], arch: gguf.MODEL_ARCH) -> None:
    """The hyperparameters llama.cpp's converter writes for every model, and per architecture."""
    heads = config["num_attention_heads"]
    dim = head_dim(config)
    settings = rope(config)
    writer.add_vocab_size(config["vocab_size"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(config.get("num_key_value_heads") or heads)
    writer.add_key_length(dim)
    writer.add_value_length(dim)
    # transformers 5 keeps partial_rotary_factor in rope_parameters, 4 at the top level.
    partial = settings.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
    writer.add_rope_dimension_count(int(dim * partial))
    writer.add_rope_freq_base(float(settings["rope_theta"]))
    if "rms_norm_eps" in config:
        writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    else:
        writer.add_layer_norm_eps(config["layer_norm_eps"])
    scaling = rope_type(settings)
    if scaling == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(settings["factor"])
    elif scaling not in ("default", "llama3") or (scaling == "llama3" and arch not in _LLAMA):
        # llama3 scaling travels as rope_freqs (_tensors)
        raise UserError(
            "format",
            "gguf",
            f"this checkpoint's RoPE scaling {scaling!r} is not supported by the GGUF export: "
            "export format=merged and convert it with llama.cpp's convert_hf_to_gguf.py",
        )
    if arch == gguf.MODEL_ARCH.GEMMA2:
        _add_gemma2(writer, config)
    elif arch == gguf.MODEL_ARCH.PHI3:
        writer.add_rope_scaling_orig_ctx_len(config["original_max_position_embeddings"])
        # llama.cpp reads 0 as no window (Phi-4).
        writer.add_sliding_window(config.get("sliding_window") or 0)
    elif config.get("sliding_window") and arch in (gguf.MODEL_ARCH.GEMMA3,):
        writer.add_sliding_window(config["sliding_window"])


_LLAMA = (gguf.MODEL_ARCH.LLAMA,)


def _add_gemma2(writer: gguf.GGUFWriter, config: dict[str, Any]) -> None:
    writer.add_attn_logit_softcapping(config["attn_logit_softcapping"])
    writer.add_final_logit_softcapping(config["final_logit_softcapping"])
    writer.add_sliding_window(config["sliding_window"])
    # llama.cpp scales Gemma 2's attention by 1/sqrt(head_dim), or for its 27B (46 layers) by
    # 1/sqrt(hidden_size / heads); it does not read query_pre_attn_scalar.
    scalar = config["query_pre_attn_scalar"]
    theirs = (
        config["hidden_size"] // config["num_attention_heads"]
        if config["num_hidden_layers"] == 46
        else head_dim(config)
    )
    if scalar != theirs:
        raise UserError(
            "format",
            "gguf",
            f"this Gemma 2 checkpoint's query_pre_attn_scalar={scalar} is not the attention "
            f"scale llama.cpp gives it (1/sqrt({theirs})): export format=merged instead",
        )


def _add_tokenizer(writer: gguf.GGUFWriter, tokenizer: Any, *, vocab_size: int) -> None:
    """The vocabulary (byte-level BPE or SentencePiece-style), special ids and chat template."""
    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    model = spec["model"]
    if model["type"] == "BPE" and "ByteLevel" in json.dumps(spec["decoder"]):
        _add_byte_level_bpe(writer, tokenizer, model, vocab_size)
    elif model["type"] == "BPE" and _sentencepiece_style(spec):
        _add_sentencepiece_bpe(writer, tokenizer, spec, vocab_size)
    else:
        raise UserError(
            "format",
            "gguf",
            f"the GGUF export handles byte-level and SentencePiece-style BPE tokenizers; this one "
            f"is {model['type']}: export format=merged and convert with llama.cpp's converter",
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


def _token_list(tokenizer: Any, vocab_size: int) -> tuple[list[str], list[TokenType]]:
    """Every id's token text and llama.cpp type; ids past the tokenizer's are padding."""
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
            is_byte = len(by_id[index]) == 6 and by_id[index].startswith("<0x")
            types.append(TokenType.BYTE if is_byte else TokenType.NORMAL)
    return tokens, types


def _add_byte_level_bpe(
    writer: gguf.GGUFWriter, tokenizer: Any, model: dict[str, Any], vocab_size: int
) -> None:
    """Byte-level BPE vocabulary and merges ("gpt2" in llama.cpp)."""
    tokens, types = _token_list(tokenizer, vocab_size)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(_pre_tokenizer(tokenizer, merges))
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_key_value(
        gguf.Keys.Tokenizer.MERGES, merges, GGUFValueType.ARRAY, sub_type=GGUFValueType.STRING
    )


def _add_sentencepiece_bpe(
    writer: gguf.GGUFWriter, tokenizer: Any, spec: dict[str, Any], vocab_size: int
) -> None:
    """A SentencePiece-style BPE (▁ for spaces) as llama.cpp's "llama" tokenizer.

    llama.cpp merges the adjacent pair whose merged token scores highest, leftmost first;
    Hugging Face's BPE merges the pair of lowest merge rank, leftmost first. A merged token's
    score is minus the rank of the merge that makes it, so the two merge in the same order.
    """
    tokens, types = _token_list(tokenizer, vocab_size)
    rank: dict[str, int] = {}
    for index, merge in enumerate(spec["model"]["merges"]):
        left, right = merge.split(" ", 1) if isinstance(merge, str) else merge
        rank.setdefault(left + right, index)
    scores = [-float(rank.get(token, 0)) for token in tokens]
    # A space before the text: Metaspace's prepend scheme, or a normalizer that prepends ▁
    # (transformers 5's LlamaTokenizer); Gemma's writes none.
    prepend = [
        node.get("prepend_scheme", "always" if node.get("add_prefix_space") else "never")
        for node in _nodes(spec.get("pre_tokenizer"))
        if node.get("type") == "Metaspace"
    ] + [
        "always"
        for node in _nodes(spec.get("normalizer"))
        if node.get("type") == "Prepend" and node.get("prepend") == SPACE
    ]
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_add_space_prefix(bool(prepend) and prepend[0] != "never")


def _sentencepiece_style(spec: dict[str, Any]) -> bool:
    """Whether a tokenizer.json writes spaces as ▁: a Metaspace pre-tokenizer and decoder, or
    (the pipeline transformers 5 builds for Gemma's tokenizer class, as its tokenizer.json
    holds it) a normalizer that replaces spaces with ▁ and a decoder that puts them back."""
    parts = [*_nodes(spec.get("pre_tokenizer")), *_nodes(spec.get("decoder"))]
    if any(node.get("type") == "Metaspace" for node in parts):
        return True
    return any(
        node.get("type") == "Replace" and node.get("pattern") == {"String": SPACE}
        for node in _nodes(spec.get("decoder"))
    )


def _nodes(node: dict[str, Any] | None) -> list[dict[str, Any]]:
    """A tokenizer.json component and those a Sequence of it holds."""
    if not node:
        return []
    inner = node.get("pretokenizers") or node.get("normalizers") or node.get("decoders") or []
    return [node, *(n for child in inner for n in _nodes(child))]


def _pre_tokenizer(tokenizer: Any, merges: list[str]) -> str:
    """llama.cpp's name for the tokenizer's pre-tokenizer, found as llama.cpp's converter does."""
    ids = tokenizer.backend_tokenizer.encode(_CHECK_TEXT).ids  # as tokenizer.encode, unbounded
    digest = hashlib.sha256(str(ids).encode()).hexdigest()
    if digest in PRE_TOKENIZERS:
        return PRE_TOKENIZERS[digest]
    if not merges:
        # Without merges every byte is its own token however the text is split first.
        return "llama-bpe"
    raise UserError(
        "format",
        "gguf",
        "this tokenizer's pre-tokenizer is not one the GGUF export knows (Llama 3, Qwen2, "
        "SmolLM2): "
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
    state_dict: dict[str, torch.Tensor], config: dict[str, Any], arch: gguf.MODEL_ARCH
) -> list[tuple[str, torch.Tensor]]:
    """GGUF names (gguf's TensorNameMap) and llama.cpp's layouts of the model's tensors."""
    names = gguf.get_tensor_name_map(arch, config["num_hidden_layers"])
    arch_name = gguf.MODEL_ARCH_NAMES[arch]
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
        # Weights and biases alike (a Llama with attention_bias), as its converter permutes them.
        if arch_name in PERMUTE_QK and hf_name.endswith(("q_proj.weight", "q_proj.bias")):
            tensor = _permute(tensor, config["num_attention_heads"])
        elif arch_name in PERMUTE_QK and hf_name.endswith(("k_proj.weight", "k_proj.bias")):
            tensor = _permute(tensor, config["num_key_value_heads"])
        elif arch_name in NORM_PLUS_ONE and hf_name.endswith("norm.weight"):
            tensor = tensor.to(torch.float32) + 1
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
