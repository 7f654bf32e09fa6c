"""`runner export`: real tiny checkpoints (transformers, peft), real loads (transformers, peft,
llama.cpp through llama-cpp-python) of what it writes."""

from __future__ import annotations

import contextlib
import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from runner.errors import UserError
from runner.export.write import ExportRequest, export
from runner.models.families import FAMILIES, hf_config
from runner.paths import TINY_TOKENIZER_DIR
from tests.fixtures import write_tiny_checkpoint

# Token ids fed to both sides, so the comparison does not depend on either tokenizer; the texts
# also check that llama.cpp's tokenizer gives the ids transformers' gives. They are picked so that
# on every fixture model each greedy step wins by a margin (see `greedy`) well above the logit
# error of float16 weights (0.01-0.03 here): near-ties would make the parity check a coin toss.
TEXTS = [
    "Hello!",
    "one two three",
    "runner export",
    "<|start_header_id|>user<|end_header_id|>\n\nReverse the word.\nexport<|eot_id|>"
    "<|start_header_id|>assistant<|end_header_id|>\n\n",
]
MIN_MARGIN = 0.04
NEW_TOKENS = 8
SELECT = {"checkpoint": "latest", "metric": None, "mode": None}


def tiny_config() -> dict:
    """The config.json `runner train model=tiny` writes (Llama 3.2, llama3 RoPE), smaller."""
    tokenizer = AutoTokenizer.from_pretrained(TINY_TOKENIZER_DIR)
    builder = {
        "_component_": "torchtune.models.llama3_2.llama3_2",
        "vocab_size": 264,
        "num_layers": 2,
        "num_heads": 4,
        "num_kv_heads": 2,
        "embed_dim": 64,
        "intermediate_dim": 128,
        "max_seq_len": 8192,
        "norm_eps": 1e-5,
        "rope_base": 500000,
        "scale_factor": 32,
        "tie_word_embeddings": True,
    }
    # A wide init gives varied output with clear winners, so greedy decoding is well defined.
    return hf_config(
        FAMILIES["llama3"],
        builder,
        initializer_range=0.2,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )


def add_tokenizer_files(path: Path) -> None:
    for file in TINY_TOKENIZER_DIR.iterdir():
        shutil.copy(file, path / file.name)
    generation = {"bos_token_id": 256, "eos_token_id": [257, 260], "do_sample": False}
    (path / "generation_config.json").write_text(json.dumps(generation))
    torch.save({"step": 4}, path / "training_state.pt")


def make_run(run_dir: Path) -> Path:
    """A run dir whose checkpoints/step_4 is a full checkpoint in the training format."""
    checkpoint = run_dir / "checkpoints" / "step_4"
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**tiny_config())).save_pretrained(checkpoint)
    (checkpoint / "generation_config.json").unlink()
    add_tokenizer_files(checkpoint)
    (run_dir / "status.json").write_text(json.dumps({"state": "completed", "step": 4}))
    return checkpoint


def make_lora_checkpoint(path: Path, base_dir: Path) -> Path:
    """A LoRA checkpoint in the contract's PEFT format, its base a local model dir."""
    base = AutoModelForCausalLM.from_pretrained(base_dir.resolve(), dtype=torch.float32)
    torch.manual_seed(1)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    # init_lora_weights=False: B is random too, so the adapter really changes the model.
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False)
    get_peft_model(base, lora).save_pretrained(path)
    add_tokenizer_files(path)
    return path


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


def load(path: Path, dtype: torch.dtype = torch.float32):
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


def load_peft(checkpoint: Path):
    base_dir = json.loads((checkpoint / "adapter_config.json").read_text())
    base = load(Path(base_dir["base_model_name_or_path"]))
    return PeftModel.from_pretrained(base, checkpoint).eval()


def token_ids() -> list[list[int]]:
    tokenizer = AutoTokenizer.from_pretrained(TINY_TOKENIZER_DIR)
    return [tokenizer(text).input_ids for text in TEXTS]


@torch.no_grad()
def logits(model, ids: list[int]) -> torch.Tensor:
    return model(torch.tensor([ids])).logits[0].float()


@torch.no_grad()
def greedy(model, ids: list[int], n: int = NEW_TOKENS) -> list[int]:
    """Greedy continuation that does not stop at end-of-turn tokens (nor does llama.cpp's)."""
    ids = list(ids)
    for _ in range(n):
        top = logits(model, ids)[-1].topk(2)
        assert top.values[0] - top.values[1] > MIN_MARGIN, "a near-tie: pick another text"
        ids.append(int(top.indices[0]))
    return ids[-n:]


def run_export(checkpoint: Path, format: str, **options) -> Path:
    arguments = {
        "dtype": "fp32",
        "quantization": "f16",
        "merged_quantization": None,
        "base": None,
        "out": None,
    } | options
    return export(
        ExportRequest(checkpoint=str(checkpoint), select=SELECT, format=format, **arguments)
    )


# --- merged -------------------------------------------------------------------------------


def test_merged_fp32_of_a_run_has_the_checkpoints_logits(full_checkpoint: Path) -> None:
    run_dir = full_checkpoint.parent.parent
    out = run_export(run_dir, "merged")  # a run dir: its latest checkpoint
    assert out == run_dir / "exports" / "step_4-merged-fp32"
    assert {"model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json"} <= {
        p.name for p in out.iterdir()
    }
    assert not (out / "training_state.pt").exists()
    assert (out / "model.safetensors").stat().st_mode == (out / "config.json").stat().st_mode
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == [257, 260]
    assert AutoTokenizer.from_pretrained(out).chat_template  # the chat template travels along
    original, merged = load(full_checkpoint), load(out)
    for ids in token_ids():
        assert torch.equal(logits(original, ids), logits(merged, ids))


@pytest.mark.parametrize("dtype,torch_dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_merged_half_precision_loads_close(
    full_checkpoint: Path, tmp_path: Path, dtype: str, torch_dtype: torch.dtype
) -> None:
    out = run_export(full_checkpoint, "merged", dtype=dtype, out=str(tmp_path / "m"))
    model = AutoModelForCausalLM.from_pretrained(out)  # the dtype recorded in config.json
    assert {p.dtype for p in model.parameters()} == {torch_dtype}
    original = load(full_checkpoint)
    for ids in token_ids():
        expected = logits(original, ids)
        assert torch.allclose(logits(model, ids), expected, atol=0.1 * expected.abs().max())


def test_merged_lora_equals_the_peft_model(lora_checkpoint: Path, tmp_path: Path) -> None:
    out = run_export(lora_checkpoint, "merged", out=str(tmp_path / "merged"))
    assert not (out / "adapter_config.json").exists()
    peft_model, merged = load_peft(lora_checkpoint), load(out)
    base = load(
        Path(
            json.loads((lora_checkpoint / "adapter_config.json").read_text())[
                "base_model_name_or_path"
            ]
        )
    )
    for ids in token_ids():
        expected = logits(peft_model, ids)
        assert (logits(merged, ids) - expected).abs().max() <= 1e-4
        assert (logits(base, ids) - expected).abs().max() > 1e-2  # the adapter matters


# --- adapter ------------------------------------------------------------------------------


def test_adapter_export_loads_in_peft(lora_checkpoint: Path, tmp_path: Path) -> None:
    out = run_export(lora_checkpoint.parent / "step_4", "adapter", out=str(tmp_path / "adapter"))
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [
            "adapter_config.json",
            "adapter_model.safetensors",
            "generation_config.json",
            "tokenizer.json",
            "tokenizer_config.json",
            *(["README.md"] if (lora_checkpoint / "README.md").exists() else []),
        ]
    )
    original, exported = load_peft(lora_checkpoint), load_peft(out)
    for ids in token_ids():
        assert torch.equal(logits(original, ids), logits(exported, ids))


# --- GGUF through llama.cpp ----------------------------------------------------------------


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
def test_gguf_of_an_architecture_runner_has_no_family_for(tmp_path: Path) -> None:
    """Qwen3 (q/k norms, its own head_dim): gguf's tables name it and its tensors, and
    llama.cpp gives transformers' logits."""
    checkpoint = tmp_path / "qwen3" / "step_4"
    config = Qwen3Config(
        vocab_size=264,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=512,
        rope_theta=1000000.0,
        tie_word_embeddings=True,
        initializer_range=0.2,
        bos_token_id=256,
        eos_token_id=260,
    )
    torch.manual_seed(2)
    model = Qwen3ForCausalLM(config)
    with torch.no_grad():  # HF initializes norms to one; make the q/k norms count
        for name, parameter in model.named_parameters():
            if name.endswith("norm.weight"):
                parameter.normal_(1, 0.2)
    model.save_pretrained(checkpoint)
    add_tokenizer_files(checkpoint)
    out = run_export(checkpoint, "gguf", out=str(tmp_path / "qwen3.gguf"))
    model = load(checkpoint)
    with llama_cpp_model(out) as llm:
        assert llm.metadata["general.architecture"] == "qwen3"
        for ids in token_ids():
            expected = logits(model, ids)[-1]
            error = (llama_cpp_logits(llm, ids) - expected).abs().max()
            assert error < 0.02 * expected.abs().max()


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
    f16 = run_export(full_checkpoint, "gguf", out=str(tmp_path / "f16.gguf"))
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


# --- user errors --------------------------------------------------------------------------


def listing(root: Path) -> set[Path]:
    return set(root.rglob("*"))


@pytest.mark.parametrize(
    "format,options,key",
    [
        ("adapter", {}, "format"),  # a full checkpoint has no adapter
        ("onnx", {}, "format"),
        ("merged", {"dtype": "int4"}, "merged.dtype"),
        ("gguf", {"quantization": "q4_k"}, "gguf.quantization"),
    ],
)
def test_bad_requests_of_a_full_checkpoint(
    full_checkpoint: Path, format: str, options: dict, key: str
) -> None:
    before = listing(full_checkpoint.parent.parent)
    with pytest.raises(UserError) as caught:
        run_export(full_checkpoint, format, **options)
    assert caught.value.key == key
    assert listing(full_checkpoint.parent.parent) == before


def test_missing_base_and_existing_destination(lora_checkpoint: Path, tmp_path: Path) -> None:
    moved = tmp_path / "moved"
    shutil.copytree(lora_checkpoint, moved)
    config = json.loads((moved / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = str(tmp_path / "gone")
    (moved / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(UserError, match="pass base=") as caught:
        run_export(moved, "merged")
    assert caught.value.key == "base"
    assert not (tmp_path / "moved-merged-fp32").exists()
    (tmp_path / "taken").mkdir()
    with pytest.raises(UserError, match="already exists") as caught:
        run_export(lora_checkpoint, "adapter", out=str(tmp_path / "taken"))
    assert caught.value.key == "out"


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


def test_weights_cut_short_or_missing_are_named_before_anything_is_written(
    runner_cli, full_checkpoint: Path, lora_checkpoint: Path, tmp_path: Path
) -> None:
    cut = tmp_path / "cut"
    shutil.copytree(full_checkpoint, cut)
    weights = cut / "model.safetensors"
    with open(weights, "r+b") as f:
        f.truncate(weights.stat().st_size - 100)
    for format in ("merged", "gguf"):
        result = runner_cli("export", f"checkpoint={cut}", f"format={format}")
        assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
        assert f"error: checkpoint='{weights}': is cut short: tensor " in result.stderr
    # Weights under another name are not the model's: transformers would not find them.
    weights.rename(cut / "other.safetensors")
    with pytest.raises(UserError, match="is missing; download, copy or save it again") as caught:
        run_export(cut, "merged")
    assert caught.value.value == str(weights)
    adapter = tmp_path / "adapter"
    shutil.copytree(lora_checkpoint, adapter)
    (adapter / "adapter_model.safetensors").write_bytes(b"\0" * 4)
    for format in ("adapter", "merged"):
        with pytest.raises(UserError, match="is cut short or not safetensors"):
            run_export(adapter, format)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter", "cut"]
