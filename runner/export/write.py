"""The body of `runner export`: check the request, then write adapter, merged or GGUF output.

Everything a user can get wrong is checked before anything is loaded or written; the output is
written under a temporary name beside its destination and renamed when whole.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypedDict

from runner.deploy.loading import require_safetensors
from runner.deploy.selection import choose_checkpoint
from runner.errors import UserError
from runner.paths import refuse_empty_path, user_path
from runner.rundir import (
    ADAPTER_CONFIG_FILE,
    ADAPTER_FILE,
    GENERATION_CONFIG,
    HF_CONFIG_FILE,
    TOKENIZER_FILES,
    check_safetensors,
    is_run_dir,
    json_problem,
    lora_base,
    own_base,
    readable_as_umask,
    weight_files,
)
from runner.rundir.io import no_room_cause, room_on, size_text, tree_size

log = logging.getLogger(__name__)

FORMATS = ("adapter", "merged", "gguf")
DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
# gguf.quantization: f16 and q8_0 written here; the others by llama.cpp's quantizer from an f32
# file (the llama_cpp extra).
QUANTIZATIONS = ("f16", "q8_0", "bf16", "q6_k", "q5_k_m", "q4_k_m", "q4_0", "q2_k")
# merged.quantization: null, or NF4 through bitsandbytes (transformers' BitsAndBytesConfig).
MERGED_QUANTIZATIONS = ("nf4",)
ADAPTER_FILES = (ADAPTER_CONFIG_FILE, ADAPTER_FILE)
# Copied beside the weights of every export, as a checkpoint has them.
MODEL_FILES = (*TOKENIZER_FILES, GENERATION_CONFIG)


class Selection(TypedDict):
    """Which checkpoint a run or sweep dir stands for (`select.`, as `runner deploy` chooses)."""

    checkpoint: str  # latest or best
    metric: str | None
    mode: str | None


@dataclass(frozen=True)
class ExportRequest:
    """A `runner export` request as the user gave it: conf/export.yaml's keys, unchecked."""

    checkpoint: str  # a checkpoint, run or sweep dir
    select: Selection
    format: str
    dtype: str  # merged.dtype
    quantization: str  # gguf.quantization
    merged_quantization: str | None  # merged.quantization: nf4, or None
    base: str | None  # the base model dir of a LoRA checkpoint (None: the adapter's own)
    out: str | None  # where to write (None: default_destination)


@dataclass(frozen=True)
class ExportPlan:
    """A checked request: the checkpoint chosen, the base it merges into, where to write."""

    checkpoint: Path
    base: Path | None  # the base model of a LoRA checkpoint when it gets merged
    destination: Path


def export(request: ExportRequest) -> Path:
    """Export one checkpoint; returns the path written (a directory, or a .gguf file)."""
    plan = check_request(request)
    made = not plan.destination.parent.exists()
    plan.destination.parent.mkdir(exist_ok=True)  # RUN/exports/ the first time
    try:
        sample = _write(request, plan)
    except BaseException:
        if made:  # an export that failed leaves no empty RUN/exports/ either
            with contextlib.suppress(OSError):
                plan.destination.parent.rmdir()
        raise
    size = tree_size(plan.destination)
    log.info(
        "exported %s as %s to %s (%.1f MB)",
        plan.checkpoint,
        request.format,
        plan.destination,
        size / 1e6,
    )
    if request.format == "gguf":
        if sample is None:
            log.info("(no sample: llama-cpp-python is not installed)")
        else:
            log.info("llama.cpp, greedy: 'Hello!' -> %r", sample)
    return plan.destination


def _write(request: ExportRequest, plan: ExportPlan) -> str | None:
    """The export written under a temporary name and renamed when whole; returns a GGUF
    file's greedy answer from llama.cpp (None: not GGUF, or llama-cpp-python not there)."""
    sample = None
    with staged(plan.destination) as tmp, _room_for(plan):
        if request.format == "adapter":
            write_adapter(plan.checkpoint, tmp)
        elif request.format == "merged":
            write_merged(
                plan.checkpoint,
                plan.base,
                tmp,
                dtype=request.dtype,
                quantization=request.merged_quantization,
            )
        else:
            write_gguf_file(plan.checkpoint, plan.base, tmp, quantization=request.quantization)
            from runner.export.gguf_file import checked_sample

            # Before the rename: a file llama.cpp cannot load is no export.
            sample = checked_sample(tmp)
    return sample


def check_request(request: ExportRequest) -> ExportPlan:
    """Every user error, before anything is loaded or written."""
    check_options(request)
    refuse_empty_path(
        "checkpoint", request.checkpoint, "give checkpoint=<checkpoint dir | run dir | sweep dir>"
    )
    refuse_empty_path(
        "out", request.out, "give out=PATH, or leave out= off for the default, RUN/exports/"
    )
    chosen = choose_checkpoint(user_path(request.checkpoint), **request.select)
    base = check_checkpoint(chosen, request.format, request.base)
    return ExportPlan(chosen, base, check_destination(request, chosen))


def check_options(request: ExportRequest) -> None:
    """The format and the options of that format, before any file is read."""
    if request.format not in FORMATS:
        raise UserError("format", request.format, f"choose one of: {', '.join(FORMATS)}")
    if request.format == "merged" and request.dtype not in DTYPES:
        raise UserError("merged.dtype", request.dtype, f"choose one of: {', '.join(DTYPES)}")
    if request.format == "merged" and request.merged_quantization is not None:
        check_merged_quantization(request.merged_quantization)
    if request.format == "gguf":
        check_gguf_quantization(request.quantization)


def check_checkpoint(checkpoint: Path, format: str, base: str | None) -> Path | None:
    """The chosen checkpoint's files, whole and fit for `format`; returns the base model dir a
    LoRA checkpoint merges into (None: nothing to merge)."""
    is_adapter = (checkpoint / ADAPTER_CONFIG_FILE).is_file()
    if format == "adapter" and not is_adapter:
        raise UserError(
            "format",
            format,
            f"{checkpoint} is a full checkpoint (config.json, no adapter_config.json), it has no "
            "adapter to export: use format=merged or format=gguf",
        )
    if is_adapter:
        missing = [name for name in ADAPTER_FILES if not (checkpoint / name).is_file()]
        if missing:
            raise UserError("checkpoint", str(checkpoint), f"LoRA checkpoint without {missing}")
        check_safetensors(checkpoint / ADAPTER_FILE, key="checkpoint")
    check_json_copied(checkpoint)
    merges = is_adapter and format != "adapter"
    if base is not None and not merges:
        # It was ignored unseen: a full checkpoint has no base, and an adapter export names
        # the base its adapter_config.json names.
        if is_adapter:
            why = "format=adapter copies the adapter and merges it into nothing"
        else:
            why = f"{checkpoint} is a full checkpoint (no adapter_config.json), with no adapter"
        raise UserError(
            "base",
            base,
            f"{why}, so no base is read; drop base= (it names the base a LoRA checkpoint "
            "merges into, with format=merged or format=gguf)",
        )
    base_dir = check_base(checkpoint, base) if merges else None
    model_dir = base_dir or checkpoint
    if format != "adapter":
        require_safetensors(model_dir, "export")
    if format == "gguf":
        from runner.export.gguf_file import gguf_arch

        gguf_arch(json.loads((model_dir / HF_CONFIG_FILE).read_text()), model_dir)
    return base_dir


def check_json_copied(checkpoint: Path) -> None:
    """The JSON files an export copies as they are (the tokenizer's, generation_config.json),
    each whole: a cut-short tokenizer.json made an export whose tokenizer does not load."""
    for name in MODEL_FILES:
        problem = json_problem(checkpoint / name) if name.endswith(".json") else ""
        if problem:
            raise UserError(
                "checkpoint",
                str(checkpoint / name),
                f"{problem}: an export copies it as it is; copy or save it again",
            )


def check_destination(request: ExportRequest, checkpoint: Path) -> Path:
    """Where the export goes (`out`, or default_destination), which must not exist yet."""
    # The dtype (merged) or quantization (gguf), and merged's nf4, name the default destination.
    variant = {"merged": request.dtype, "gguf": request.quantization}.get(request.format)
    quantization = request.merged_quantization if request.format == "merged" else None
    suffix = f"{variant}-{quantization}" if quantization else variant
    if request.out:
        destination = user_path(request.out)
    else:
        destination = default_destination(checkpoint, request.format, suffix)
    if destination.exists() or destination.is_symlink():
        raise UserError(
            "out", str(destination), "already exists: remove it, or name another out=PATH"
        )
    if request.out and not destination.parent.is_dir():
        raise UserError(
            "out", request.out, f"no such directory {destination.parent}: create it first"
        )
    # RUN/exports/, made by the first export: else the run's directory must take it.
    where = destination.parent if destination.parent.is_dir() else destination.parent.parent
    if not os.access(where, os.W_OK):
        raise UserError(
            "out",
            request.out or str(destination),
            f"this user cannot write in {where} (a read-only disk, or another user's "
            "directory); give out=PATH in a directory this user can write",
        )
    return destination


def check_gguf_quantization(quantization: str) -> None:
    """A known type; llama.cpp's quantizer at hand for the types it makes."""
    import importlib.util

    from runner.export.gguf_file import LLAMA_CPP_TYPES

    if quantization not in QUANTIZATIONS:
        raise UserError(
            "gguf.quantization", quantization, f"choose one of: {', '.join(QUANTIZATIONS)}"
        )
    if quantization in LLAMA_CPP_TYPES and importlib.util.find_spec("llama_cpp") is None:
        raise UserError(
            "gguf.quantization",
            quantization,
            "is made by llama.cpp's quantizer: pip install 'runner[llama_cpp]' (builds "
            "llama.cpp, a few minutes), or use f16 or q8_0",
        )


def check_merged_quantization(quantization: str) -> None:
    """nf4 needs bitsandbytes (the `quant` extra)."""
    import importlib.util

    if quantization not in MERGED_QUANTIZATIONS:
        raise UserError(
            "merged.quantization",
            quantization,
            f"choose null or one of: {', '.join(MERGED_QUANTIZATIONS)}",
        )
    if importlib.util.find_spec("bitsandbytes") is None:
        raise UserError(
            "merged.quantization",
            quantization,
            "needs bitsandbytes: pip install 'runner[quant]' (or drop the key for 16/32-bit)",
        )


def check_base(checkpoint: Path, base: str | None) -> Path:
    """The base model dir a LoRA checkpoint merges into: `base=`, else its own
    (`runner.rundir.lora_base`: its run's base_model/, or the one its adapter names)."""
    path = user_path(base) if base else lora_base(checkpoint)
    if path is None or not (path / HF_CONFIG_FILE).is_file():
        raise UserError(
            "base",
            str(path) if path else None,
            f"the base model of LoRA checkpoint {checkpoint} is not a local Hugging Face model "
            "dir (config.json): pass base=<dir of the base model>",
        )
    return path


def default_destination(checkpoint: Path, format: str, variant: str | None) -> Path:
    """RUN/exports/step_<N>-<format>[-<variant>] for a run's checkpoint, else beside it."""
    suffix = f"-{format}" + (f"-{variant}" if variant else "")
    extension = ".gguf" if format == "gguf" else ""
    parent = checkpoint.parent
    if parent.name == "checkpoints" and is_run_dir(parent.parent):
        # Not inside checkpoints/: retention prunes old step dirs with whatever they hold.
        return parent.parent / "exports" / f"{checkpoint.name}{suffix}{extension}"
    return parent / f"{checkpoint.name}{suffix}{extension}"


@contextlib.contextmanager
def _room_for(plan: ExportPlan) -> Iterator[None]:
    """A write of the export that its disk refuses (full, or a file-size limit): one line
    naming out=, the room there and what the weights take, not a library's traceback (the
    part written goes with `staged`)."""
    try:
        yield
    except Exception as err:
        cause = no_room_cause(err)
        if cause is None:
            raise
        weights = 0
        for source in (plan.base, plan.checkpoint):
            files = [] if source is None else [*weight_files(source), source / ADAPTER_FILE]
            weights += sum(path.stat().st_size for path in files if path.is_file())
        raise UserError(
            "out",
            str(plan.destination),
            f"the export could not be written ({cause}); {room_on(plan.destination)}, and the "
            f"checkpoint's weights take {size_text(weights)}: make room, or give out=PATH on "
            "another disk",
        ) from err


@contextlib.contextmanager
def staged(destination: Path) -> Iterator[Path]:
    """A temporary path beside `destination`, renamed onto it when the block ends normally."""
    tmp = destination.parent / f".tmp-{destination.name}-{os.getpid()}"
    try:
        yield tmp
        if tmp.exists():
            readable_as_umask(tmp)  # save_pretrained writes safetensors 0600 too
        os.rename(tmp, destination)
    finally:
        if tmp.is_dir():
            shutil.rmtree(tmp)
        elif tmp.exists():
            tmp.unlink()


def write_adapter(checkpoint: Path, out_dir: Path) -> None:
    """The PEFT adapter and tokenizer files, without the training state. The base a run holds
    in its own directory is named where it lies now: a moved run's adapter names where it
    trained (`runner.rundir.lora_base`)."""
    out_dir.mkdir()
    for name in (*ADAPTER_FILES, *MODEL_FILES, "README.md"):
        if (checkpoint / name).is_file():
            shutil.copy2(checkpoint / name, out_dir / name)
    base = own_base(checkpoint)
    if base is not None:
        config = json.loads((out_dir / ADAPTER_CONFIG_FILE).read_text())
        config["base_model_name_or_path"] = str(base.resolve())
        (out_dir / ADAPTER_CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")


def write_merged(
    checkpoint: Path,
    base: Path | None,
    out_dir: Path,
    *,
    dtype: str,
    quantization: str | None = None,
) -> None:
    """A Hugging Face model dir (safetensors) in `dtype`, with the adapter merged if any; with
    quantization=nf4, its linear layers in 4 bits (bitsandbytes) computing in `dtype`."""
    import torch

    model = load_model(checkpoint, base).to(getattr(torch, DTYPES[dtype]))
    if quantization is None:
        model.save_pretrained(out_dir, safe_serialization=True)
    else:
        # The merged weights at full width first, beside the staged output, then quantized.
        with tempfile.TemporaryDirectory(prefix=".nf4-source-", dir=out_dir.parent) as full:
            model.save_pretrained(full, safe_serialization=True)
            del model
            quantize_nf4(Path(full), out_dir, compute_dtype=getattr(torch, DTYPES[dtype]))
    copy_tokenizer(checkpoint, out_dir)


def quantize_nf4(model_dir: Path, out_dir: Path, *, compute_dtype: Any) -> None:
    """The model at `model_dir` loaded by transformers with NF4 weights (bitsandbytes, on the
    CPU) and saved as such: its config records the quantization, so from_pretrained loads it
    4-bit again. Embeddings, norms and the output head stay in compute_dtype."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    config = BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=compute_dtype
    )
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, quantization_config=config, device_map="cpu", dtype=compute_dtype
    )
    model.save_pretrained(out_dir, safe_serialization=True)


def write_gguf_file(checkpoint: Path, base: Path | None, path: Path, *, quantization: str) -> None:
    """One GGUF file of the (merged) model and its tokenizer."""
    from runner.deploy.loading import load_tokenizer
    from runner.export.gguf_file import LLAMA_CPP_TYPES, quantize_with_llama_cpp, write_gguf

    model = load_model(checkpoint, base)
    by_llama_cpp = quantization in LLAMA_CPP_TYPES
    # llama.cpp's quantizer reads an f32 file, written beside the staged output.
    source = path.with_name(f".{path.name}.f32") if by_llama_cpp else path
    write_gguf(
        source,
        state_dict=model.state_dict(),
        config=model.config.to_dict(),
        tokenizer=load_tokenizer(checkpoint),
        quantization="f32" if by_llama_cpp else quantization,
        name=checkpoint.parent.parent.name
        if is_run_dir(checkpoint.parent.parent)
        else checkpoint.name,
    )
    if by_llama_cpp:
        del model
        try:
            quantize_with_llama_cpp(source, path, quantization)
        finally:
            source.unlink(missing_ok=True)


def load_model(checkpoint: Path, base: Path | None) -> Any:
    """The checkpoint's model in float32 on the CPU; a LoRA adapter merged into its base."""
    import torch

    from runner.deploy.loading import load_hf_model

    if base is None:
        return load_hf_model(checkpoint, adapter_dir=None, dtype=torch.float32)
    return load_hf_model(base, adapter_dir=checkpoint, dtype=torch.float32)


def copy_tokenizer(checkpoint: Path, out_dir: Path) -> None:
    """The checkpoint's tokenizer files and generation config, as they are."""
    for name in MODEL_FILES:
        if (checkpoint / name).is_file():
            shutil.copy2(checkpoint / name, out_dir / name)
