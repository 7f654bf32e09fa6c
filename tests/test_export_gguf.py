"""`runner export format=gguf`: the files llama.cpp (llama-cpp-python) loads, against
transformers' logits and greedy tokens on real tiny checkpoints of each family."""

from __future__ import annotations

import contextlib
import json
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import (
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from runner.errors import UserError
from tests.fixtures import write_tiny_checkpoint
from tests.test_export import (
    NEW_TOKENS,
    TEXTS,
    add_tokenizer_files,
    greedy,
    load,
    load_peft,
    logits,
    make_lora_checkpoint,
    make_run,
    run_export,
    tiny_config,
    token_ids,
)


def make_qwen2_checkpoint(path: Path) -> Path:
    """A tiny Qwen2 (q/k/v biases, rotate-halves RoPE) with the tiny tokenizer."""
    config = Qwen2Config(
        vocab_size=264,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rope_theta=1000000.0,
        tie_word_embeddings=True,
        initializer_range=0.2,
        bos_token_id=256,
        eos_token_id=260,
    )
    torch.manual_seed(2)
    model = Qwen2ForCausalLM(config)
    with torch.no_grad():  # HF initializes biases to zero; make them count
        for name, parameter in model.named_parameters():
            if name.endswith("bias"):
                parameter.normal_(0, 0.2)
    model.save_pretrained(path)
    add_tokenizer_files(path)
    return path


@pytest.fixture(scope="module")
def full_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_run(tmp_path_factory.mktemp("run"))


@pytest.fixture(scope="module")
def lora_checkpoint(tmp_path_factory: pytest.TempPathFactory, full_checkpoint: Path) -> Path:
    return make_lora_checkpoint(tmp_path_factory.mktemp("lora") / "step_4", full_checkpoint)


@pytest.fixture(scope="module")
def qwen2_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_qwen2_checkpoint(tmp_path_factory.mktemp("qwen2") / "step_4")


@contextlib.contextmanager
def llama_cpp_model(path: Path) -> Iterator[Any]:
    """The GGUF file loaded by llama.cpp (llama-cpp-python, in the test extra; never skipped)."""
    import llama_cpp

    llm = llama_cpp.Llama(
        model_path=str(path), n_ctx=128, n_batch=128, n_threads=1, logits_all=True, verbose=False
    )
    try:
        yield llm
    finally:
        llm.close()


def llama_cpp_greedy(llm, ids: list[int], n: int = NEW_TOKENS) -> list[int]:
    llm.reset()
    out = []
    for token in llm.generate(ids, temp=0.0, top_k=1, reset=True):
        out.append(token)
        if len(out) == n:
            return out
    raise AssertionError("llama.cpp stopped early")


def llama_cpp_logits(llm, ids: list[int]) -> torch.Tensor:
    llm.reset()
    llm.eval(ids)
    return torch.from_numpy(llm.scores[len(ids) - 1].copy())


@pytest.mark.slow
@pytest.mark.parametrize("family", ["full_checkpoint", "qwen2_checkpoint"])
def test_gguf_f16_decodes_like_transformers(request, family: str, tmp_path: Path) -> None:
    checkpoint = request.getfixturevalue(family)  # Llama 3.2 (tiny), Qwen2
    out = run_export(checkpoint, "gguf", out=str(tmp_path / "tiny.gguf"))
    model = load(checkpoint)
    template = AutoTokenizer.from_pretrained(checkpoint).chat_template
    with llama_cpp_model(out) as llm:
        assert llm.n_vocab() == 264
        assert llm.metadata["tokenizer.chat_template"] == template
        for text, ids in zip(TEXTS, token_ids(), strict=True):
            assert llm.tokenize(text.encode(), add_bos=True, special=True) == ids
            expected = logits(model, ids)[-1]
            error = (llama_cpp_logits(llm, ids) - expected).abs().max()
            assert error < 0.02 * expected.abs().max()
            assert llama_cpp_greedy(llm, ids) == greedy(model, ids)


def make_family_checkpoint(family: str, path: Path) -> Path:
    """A tiny checkpoint of a fixture family (tests/fixtures.py, its published chat template),
    its matrices drawn wide (as tiny_config's are), so that greedy decoding has clear winners:
    seed 3 gives every step of SENTENCEPIECE_TEXTS a margin above 0.1."""
    write_tiny_checkpoint(family, path)
    model = load(path)
    torch.manual_seed(3)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.ndim == 2:
                parameter.normal_(0, 0.4)
    if family == "gemma2":
        # llama.cpp scales Gemma 2's attention by 1/sqrt(head_dim) (gguf_file._add_gemma2).
        model.config.query_pre_attn_scalar = model.config.head_dim
    model.save_pretrained(path)
    return path


# llama.cpp runs Mistral as its llama architecture.
ARCHITECTURES = {"mistral": "llama"}
# Texts in the SentencePiece-style fixture tokenizers' alphabet (printable ASCII, spaces).
SENTENCEPIECE_TEXTS = [
    "Reverse the word. hello",
    "The quick brown fox jumps over the lazy dog",
    "Uppercase the word. fox",
]


@pytest.mark.slow
@pytest.mark.parametrize("family", ["gemma", "gemma2", "phi3", "mistral"])
def test_gguf_of_sentencepiece_families_decodes_like_transformers(family: str, tmp_path: Path):
    """gguf's tables name the architecture and tensors; llama.cpp's layout fixes (Gemma's norms
    + 1, Gemma 2's soft-caps and sliding window, Phi-3's fused projections, Mistral's q/k rows
    as llama's) hold; the SentencePiece-style vocabulary tokenizes as transformers does."""
    checkpoint = make_family_checkpoint(family, tmp_path / family)
    out = run_export(checkpoint, "gguf", out=str(tmp_path / f"{family}.gguf"))
    model, tokenizer = load(checkpoint), AutoTokenizer.from_pretrained(checkpoint)
    with llama_cpp_model(out) as llm:
        assert llm.metadata["general.architecture"] == ARCHITECTURES.get(family, family)
        assert llm.metadata["tokenizer.chat_template"] == tokenizer.chat_template
        for text in SENTENCEPIECE_TEXTS:
            ids = tokenizer(text).input_ids
            assert llm.tokenize(text.encode(), add_bos=True, special=True) == ids, text
            expected = logits(model, ids)[-1]
            error = (llama_cpp_logits(llm, ids) - expected).abs().max()
            assert error < 0.02 * expected.abs().max(), text
            assert llama_cpp_greedy(llm, ids, n=4) == greedy(model, ids, n=4), text


@pytest.mark.slow
@pytest.mark.parametrize("architecture", ["qwen3", "llama_with_biases"])
def test_gguf_of_an_architecture_runner_has_no_family_for(architecture: str, tmp_path: Path):
    """Qwen3 (q/k norms, its own head_dim), and a Llama with attention biases (whose q and k
    biases take the weights' row order: they did not, and its logits were wrong): gguf's
    tables name them and their tensors, and llama.cpp gives transformers' logits."""
    checkpoint = tmp_path / architecture / "step_4"
    shape = {
        "vocab_size": 264,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
        "tie_word_embeddings": True,
        "initializer_range": 0.2,
        "bos_token_id": 256,
        "eos_token_id": 260,
    }
    torch.manual_seed(2)
    if architecture == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(**shape, head_dim=32, rope_theta=1000000.0))
    else:
        model = LlamaForCausalLM(LlamaConfig(**shape, attention_bias=True))
    with torch.no_grad():  # HF initializes norms to one and biases to zero: make them count
        for name, parameter in model.named_parameters():
            if name.endswith("norm.weight"):
                parameter.normal_(1, 0.2)
            elif name.endswith(".bias"):
                parameter.normal_(0, 1.0)
    model.save_pretrained(checkpoint)
    add_tokenizer_files(checkpoint)
    out = run_export(checkpoint, "gguf", out=str(tmp_path / f"{architecture}.gguf"))
    model = load(checkpoint)
    with llama_cpp_model(out) as llm:
        assert llm.metadata["general.architecture"] == architecture.split("_")[0]
        for ids in token_ids():
            expected = logits(model, ids)[-1]
            error = (llama_cpp_logits(llm, ids) - expected).abs().max()
            assert error < 0.02 * expected.abs().max()


@pytest.mark.parametrize("model_type", ["cohere", "gpt_neox", "gpt2", "phi", "mamba"])
def test_gguf_of_an_architecture_it_does_not_write_is_refused_by_name(model_type: str) -> None:
    """llama.cpp knows these, with fixes of their own this writer lacks (Cohere's logit scale,
    GPT-NeoX's fused rows, GPT-2's hyperparameters): their files were written wrong, silently
    where llama-cpp-python is not installed, or ended in a KeyError."""
    from runner.export.gguf_file import gguf_arch

    with pytest.raises(UserError) as err:
        gguf_arch({"model_type": model_type, "architectures": ["X"]}, "ckpt")
    assert err.value.key == "checkpoint"
    assert f"model_type={model_type!r} (['X']), which the GGUF export does not write" in str(
        err.value
    )
    assert "convert_hf_to_gguf.py" in err.value.fix


@pytest.mark.slow
def test_a_gguf_file_llama_cpp_cannot_load_is_named(tmp_path: Path) -> None:
    """export's sample run of the file it wrote, before the rename: was a traceback after
    `exported`, the file left."""
    from runner.export.gguf_file import checked_sample

    written = tmp_path / "unloadable.gguf"
    written.write_bytes(b"GGUF" + bytes(64))
    with pytest.raises(UserError, match="llama.cpp cannot load the file written") as refused:
        checked_sample(written)
    assert refused.value.key == "format" and "nothing was written" in refused.value.fix


def test_gguf_of_a_lora_checkpoint_is_the_merged_model(lora_checkpoint: Path, tmp_path: Path):
    out = run_export(lora_checkpoint, "gguf", out=str(tmp_path / "lora.gguf"))
    model = load_peft(lora_checkpoint)
    with llama_cpp_model(out) as llm:
        for ids in token_ids():
            assert llama_cpp_greedy(llm, ids) == greedy(model, ids)


@pytest.mark.slow
def test_gguf_q8_0_loads_and_generates(full_checkpoint: Path, tmp_path: Path) -> None:
    # The file is named by its run, here a sweep's of Phi-3 against Llama: in general.name,
    # "phi3" made llama.cpp look for Phi-3's special tokens, and this Llama's file not load.
    run = shutil.copytree(full_checkpoint.parent.parent, tmp_path / "lr_sweep_Phi3_vs_llama")
    f16 = run_export(run / "checkpoints" / "step_4", "gguf", out=str(tmp_path / "f16.gguf"))
    with llama_cpp_model(f16) as llm:
        assert llm.metadata["general.name"] == "lr_sweep_phi 3_vs_llama"
    q8 = run_export(full_checkpoint, "gguf", quantization="q8_0", out=str(tmp_path / "q8.gguf"))
    assert q8.stat().st_size < 0.75 * f16.stat().st_size  # 8.5 bits a weight instead of 16
    model = load(full_checkpoint)
    with llama_cpp_model(q8) as llm:
        for ids in token_ids():
            assert len(llama_cpp_greedy(llm, ids)) == NEW_TOKENS
            expected = logits(model, ids)[-1]
            error = (llama_cpp_logits(llm, ids) - expected).abs().max()
            assert error < 0.1 * expected.abs().max()  # 8-bit blocks: coarser than f16


# Every gguf.quantization, smallest file last: llama.cpp makes all but f16 and q8_0.
GGUF_TYPES = ("f16", "bf16", "q8_0", "q6_k", "q5_k_m", "q4_k_m", "q4_0", "q2_k")


@pytest.fixture(scope="module")
def wide_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A checkpoint whose matrices have rows of 256 and 512, which llama.cpp's K-quants need
    (on the tiny model's 64-wide rows it falls back to q8_0 and q4_0 blocks)."""
    run_dir = tmp_path_factory.mktemp("wide")
    checkpoint = run_dir / "checkpoints" / "step_4"
    wide = {"hidden_size": 256, "intermediate_size": 512, "head_dim": 64}
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**(tiny_config() | wide))).save_pretrained(checkpoint)
    add_tokenizer_files(checkpoint)
    (run_dir / "status.json").write_text(json.dumps({"state": "completed", "step": 4}))
    return checkpoint


def test_every_gguf_type_loads_in_llama_cpp_and_shrinks_in_order(
    wide_checkpoint: Path, tmp_path: Path
) -> None:
    model = load(wide_checkpoint)
    template = AutoTokenizer.from_pretrained(wide_checkpoint).chat_template
    sizes, errors = {}, {}
    for quantization in GGUF_TYPES:
        out = run_export(
            wide_checkpoint, "gguf", quantization=quantization, out=str(tmp_path / quantization)
        )
        sizes[quantization] = out.stat().st_size
        with llama_cpp_model(out) as llm:
            assert llm.metadata["tokenizer.chat_template"] == template
            relative = []
            for text, ids in zip(TEXTS, token_ids(), strict=True):
                assert llm.tokenize(text.encode(), add_bos=True, special=True) == ids
                assert len(llama_cpp_greedy(llm, ids)) == NEW_TOKENS
                expected = logits(model, ids)[-1]
                error = (llama_cpp_logits(llm, ids) - expected).abs().max()
                relative.append(float(error / expected.abs().max()))
        errors[quantization] = sum(relative) / len(relative)
    assert abs(sizes["bf16"] - sizes["f16"]) < 0.01 * sizes["f16"]  # both 16 bits a weight
    shrinking = [sizes[q] for q in GGUF_TYPES[1:]]
    assert shrinking == sorted(shrinking, reverse=True) and len(set(shrinking)) == len(shrinking)
    # The logits move further from the fp32 model's as the bits go: f16 and bf16 round each
    # weight, q8_0 keeps 8 bits a block, the 4-6 bit types (whose order among themselves these
    # random weights do not fix) move more, 2 bits the most.
    middle = [errors[q] for q in ("q6_k", "q5_k_m", "q4_k_m", "q4_0")]
    assert errors["f16"] < errors["bf16"] < errors["q8_0"] < min(middle)
    assert max(middle) < errors["q2_k"]


def test_cli_exports_and_reports_user_errors(runner_cli, full_checkpoint: Path, tmp_path: Path):
    out = tmp_path / "tiny.gguf"
    done = runner_cli("export", f"checkpoint={full_checkpoint}", "format=gguf", f"out={out}")
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == str(out) and out.read_bytes()[:4] == b"GGUF"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]
    # The size, and the file's greedy answer to one user turn, from llama.cpp.
    size = out.stat().st_size / 1e6
    assert f"as gguf to {out} ({size:.1f} MB)" in done.stdout
    with llama_cpp_model(out) as llm:
        turn = [{"role": "user", "content": "Hello!"}]
        expected = llm.create_chat_completion(messages=turn, max_tokens=16, temperature=0)
    assert f"llama.cpp, greedy: 'Hello!' -> {expected['choices'][0]['message']['content']!r}" in (
        done.stdout
    )

    # An architecture gguf's tables do not know (OPT): one error naming the checkpoint.
    opt = tmp_path / "opt"
    shutil.copytree(full_checkpoint, opt)
    config = json.loads((opt / "config.json").read_text())
    config |= {"model_type": "opt", "architectures": ["OPTForCausalLM"]}
    (opt / "config.json").write_text(json.dumps(config))
    refused = runner_cli("export", f"checkpoint={opt}", "format=gguf")
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert f"checkpoint='{opt}'" in refused.stderr and "model_type='opt'" in refused.stderr
    assert not (tmp_path / "opt-gguf-f16.gguf").exists()

    bare = runner_cli("export", f"checkpoint={full_checkpoint}", "dtype=bf16")
    assert bare.returncode == 2 and "write merged.dtype=bf16" in bare.stderr
    # Another format's option would be ignored unseen: an fp32 adapter for merged.dtype=bf16.
    other = runner_cli(
        "export", f"checkpoint={full_checkpoint}", "format=gguf", "merged.dtype=bf16"
    )
    assert other.returncode == 2 and other.stderr == (
        "error: merged.dtype='bf16': only format=merged reads it; drop it, or give format=merged\n"
    )
    assert runner_cli("export", "--help").stdout.startswith("runner export:")


def test_matrices_stored_in_another_type_are_one_warning(
    runner_cli, full_checkpoint: Path, tmp_path: Path
) -> None:
    """A k-quant's blocks are 256 wide: llama.cpp stores a narrower matrix as q8_0 and said so
    in a line per matrix (25 lines for model=tiny)."""
    out = tmp_path / "q6.gguf"
    done = runner_cli(
        "export",
        f"checkpoint={full_checkpoint}",
        "format=gguf",
        "gguf.quantization=q6_k",
        f"out={out}",
    )
    assert done.returncode == 0, done.stderr[-3000:]
    warned = [line for line in done.stderr.splitlines() if "warning" in line]
    assert len(warned) == 1, warned
    assert re.fullmatch(
        r"warning: llama\.cpp stored \d+ matrices in another type \(rows of 64 or 128, not a "
        r"multiple of 256: q6_K -> q8_0\): \S+\.weight, .*",
        warned[0],
    ), warned
