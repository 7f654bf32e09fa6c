"""`runner export`: real tiny checkpoints (transformers, peft), real loads (transformers, peft)
of what it writes; GGUF files, which llama.cpp loads, in test_export_gguf.py."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
)

from runner.errors import UserError
from runner.export.write import ExportRequest, export
from runner.models.families import FAMILIES, hf_config
from runner.paths import TINY_TOKENIZER_DIR
from runner.rundir.io import size_text
from tests.conftest import files_limited_to

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


@pytest.fixture(scope="module")
def full_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_run(tmp_path_factory.mktemp("run"))


@pytest.fixture(scope="module")
def lora_checkpoint(tmp_path_factory: pytest.TempPathFactory, full_checkpoint: Path) -> Path:
    return make_lora_checkpoint(tmp_path_factory.mktemp("lora") / "step_4", full_checkpoint)


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


def test_a_base_that_nothing_merges_into_is_refused(
    runner_cli, full_checkpoint: Path, lora_checkpoint: Path, tmp_path: Path
) -> None:
    """base= was ignored unseen where nothing merges: a full checkpoint, or format=adapter
    (whose adapter_config.json still named the base the run trained on), exit 0."""
    for checkpoint, format in [(full_checkpoint, "merged"), (lora_checkpoint, "adapter")]:
        out = tmp_path / f"out-{format}"
        given = (f"checkpoint={checkpoint}", f"format={format}", f"base={tmp_path}", f"out={out}")
        result = runner_cli("export", *given)
        assert result.returncode == 2, result.stdout[-2000:]
        line = result.stderr.strip().splitlines()[-1]
        assert line.startswith(f"error: base='{tmp_path}': "), line
        assert line.endswith(
            "so no base is read; drop base= (it names the base a LoRA checkpoint merges into, "
            "with format=merged or format=gguf)"
        ), line
        assert "Traceback" not in result.stderr and not out.exists()


@pytest.mark.parametrize("command", ["export", "deploy"])
def test_a_checkpoint_given_as_a_bare_word_names_its_key(
    runner_cli, full_checkpoint: Path, command: str
) -> None:
    """`runner export RUN` (as `runner resume RUN` takes its run) said "LexerNoViableAltException:
    RUN; overrides look like key=value ...", naming no key to give it by."""
    result = runner_cli(command, str(full_checkpoint))
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr == (
        f"error: override='{full_checkpoint}': a path is given as checkpoint=PATH: runner "
        f"{command} checkpoint={full_checkpoint}\n"
    )


def test_an_option_of_another_format_is_judged_by_the_last_format_given(
    runner_cli, full_checkpoint: Path, tmp_path: Path
) -> None:
    """Hydra exports the last format= given; the check of each format's options read the first:
    format=gguf format=merged merged.dtype=bf16 was refused with "give format=merged", which
    was given, and format=merged format=gguf merged.dtype=bf16 ignored the dtype unseen."""
    refused = runner_cli(
        "export",
        f"checkpoint={full_checkpoint}",
        "format=merged",
        "format=gguf",
        "merged.dtype=bf16",
    )
    assert refused.returncode == 2 and refused.stderr == (
        "error: merged.dtype='bf16': only format=merged reads it; drop it, or give format=merged\n"
    )
    out = tmp_path / "bf16"
    given = ("format=gguf", "format=merged", "merged.dtype=bf16", f"out={out}")
    done = runner_cli("export", f"checkpoint={full_checkpoint}", *given)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"


def test_a_checkpoint_and_out_given_with_a_tilde_are_in_the_home_directory(
    full_checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Quoted, checkpoint='~/run' was no such directory (load_checkpoint.path and resume took
    it as the home directory's)."""
    home = tmp_path / "home"
    shutil.copytree(full_checkpoint.parents[1], home / "run")
    monkeypatch.setenv("HOME", str(home))
    written = run_export(Path("~/run"), "merged", out="~/merged")
    assert written == home / "merged" and (written / "config.json").is_file()


def test_a_base_given_with_a_tilde_is_in_the_home_directory(
    lora_checkpoint: Path, full_checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Quoted, base='~/base' was "not a local Hugging Face model dir", where checkpoint= and
    out= take `~` as the home directory."""
    home = tmp_path / "home"
    shutil.copytree(full_checkpoint, home / "base")
    monkeypatch.setenv("HOME", str(home))
    written = run_export(lora_checkpoint, "merged", base="~/base", out=str(tmp_path / "merged"))
    assert (written / "model.safetensors").is_file()


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


@pytest.mark.parametrize("format", ["merged", "gguf"])
def test_an_export_the_disk_refuses_is_one_message_with_nothing_left(
    full_checkpoint: Path, tmp_path: Path, format: str
) -> None:
    """A full disk ended `runner export` in a traceback: merged in safetensors' "Error while
    serializing: I/O error: No space left on device (os error 28)", GGUF in numpy's "65536
    requested and 45936 written", which has no errno. A file-size limit (64 KiB, below the
    weights) fails the write as a full disk does (EFBIG for ENOSPC; Python ignores SIGXFSZ)."""

    out = tmp_path / "out" / ("model.gguf" if format == "gguf" else "model")
    out.parent.mkdir()
    with files_limited_to(64 * 1024):
        with pytest.raises(UserError) as raised:
            run_export(full_checkpoint, format, out=str(out))
    said = str(raised.value)
    cause = "File too large" if format == "merged" else "a file's write stopped short"
    assert said.startswith(f"out='{out}': the export could not be written ({cause}); its disk has ")
    weights = (full_checkpoint / "model.safetensors").stat().st_size
    assert "files are limited to 64.0 KiB here (ulimit -f), and the checkpoint's weights" in said
    assert said.endswith(
        f"take {size_text(weights)}: make room, or give out=PATH on another disk"
    ), said
    assert list(out.parent.iterdir()) == []  # nothing half-written
    # Into the run's own exports/, made for it: that goes too.
    run = shutil.copytree(
        full_checkpoint.parents[1], tmp_path / "run", ignore=lambda d, n: ["exports"]
    )
    with files_limited_to(64 * 1024):
        with pytest.raises(UserError, match="the export could not be written"):
            run_export(run, format)
    assert sorted(p.name for p in run.iterdir()) == ["checkpoints", "status.json"]


def test_a_tokenizer_file_cut_short_is_refused_by_name(full_checkpoint: Path, tmp_path: Path):
    """A cut-short tokenizer.json was copied into the export as it was: exit 0, "exported ...",
    and an export whose tokenizer does not load (a JSONDecodeError), which `runner push` would
    publish."""
    checkpoint = shutil.copytree(full_checkpoint, tmp_path / "step_4")
    os.truncate(checkpoint / "tokenizer.json", 1000)
    out = tmp_path / "out"
    with pytest.raises(UserError) as raised:
        run_export(checkpoint, "merged", out=str(out))
    said = str(raised.value)
    assert said.startswith(f"checkpoint='{checkpoint / 'tokenizer.json'}': is cut short or not ")
    assert "line 48 column 26" in said
    assert said.endswith(": an export copies it as it is; copy or save it again")
    assert not out.exists()
