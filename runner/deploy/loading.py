"""Loading a checkpoint to serve: weights from safetensors only, never remote code.

`load_hf_model` is the one Hugging Face model loader; `runner export` loads through it too.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from runner.errors import UserError
from runner.notices import keep_notices_off_the_console
from runner.rundir import (
    ADAPTER_CONFIG_FILE,
    ADAPTER_FILE,
    HF_CONFIG_FILE,
    check_safetensors,
    eos_token_ids,
    lora_base,
    read_generation_config,
    weight_files,
)

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

# The options of the `dtype` config group (conf/dtype/, shared with `runner train`) as served,
# besides auto: bf16_mixed computes in bf16, and serving keeps no master weights, so it serves
# as bf16.
_DTYPES = {"bf16": "bfloat16", "bf16_mixed": "bfloat16", "fp32": "float32"}

log = logging.getLogger(__name__)
keep_notices_off_the_console(drop=True)  # before transformers and peft are imported


@dataclass
class LoadedModel:
    """A model ready to generate, with what the server needs to know about it."""

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    eos_token_ids: frozenset[int]
    max_model_len: int


def load_tokenizer(checkpoint_dir: Path) -> PreTrainedTokenizerBase:
    """The checkpoint's own tokenizer (and chat template), from local files only."""
    from transformers import AutoTokenizer
    from transformers.tokenization_utils_base import VERY_LARGE_INTEGER

    try:
        tokenizer = AutoTokenizer.from_pretrained(
            checkpoint_dir, local_files_only=True, trust_remote_code=False
        )
    except (OSError, ValueError) as error:
        raise UserError(
            "checkpoint",
            str(checkpoint_dir),
            f"its tokenizer does not load ({error}); a checkpoint holds tokenizer.json and "
            "tokenizer_config.json beside the weights",
        ) from error
    # Prompts are measured against max_model_len and one too long is refused before it runs;
    # the tokenizer's own check logged "Running this sequence through the model will result in
    # indexing errors" for each such prompt, of a run that never happens.
    tokenizer.model_max_length = VERY_LARGE_INTEGER
    return tokenizer


def lora_base_dir(checkpoint_dir: Path) -> Path | None:
    """The base model directory of a LoRA checkpoint (`runner.rundir.lora_base`), else None."""
    if not (checkpoint_dir / ADAPTER_CONFIG_FILE).is_file():
        return None
    base = lora_base(checkpoint_dir)
    if base is None or not (base / HF_CONFIG_FILE).is_file():
        raise UserError(
            "checkpoint",
            str(checkpoint_dir),
            f"its LoRA adapter names the base model {str(base) if base else None!r}, which is "
            "not a local directory with config.json; restore that directory (RUN/base_model/ "
            f"for a random-init base) or set base_model_name_or_path in {ADAPTER_CONFIG_FILE}",
        )
    return base


def model_context_length(checkpoint_dir: Path, max_model_len: int | None) -> int:
    """Tokens of context to allow: the model's own, or less when `max_model_len` says so."""
    from transformers import AutoConfig

    config_dir = lora_base_dir(checkpoint_dir) or checkpoint_dir
    try:
        config = AutoConfig.from_pretrained(
            config_dir, local_files_only=True, trust_remote_code=False
        )
    except (OSError, ValueError) as error:
        raise UserError(
            "checkpoint",
            str(checkpoint_dir),
            f"its config.json does not load without remote code ({error}); serve a model "
            "architecture that transformers ships",
        ) from error
    own = config.get_text_config(decoder=True).max_position_embeddings
    if max_model_len is None:
        return own
    # The shortest request a server answers is a prompt of one token and one new token: with
    # max_model_len=1 it served, and refused every request as too long.
    if not 2 <= max_model_len <= own:
        raise UserError(
            "max_model_len",
            max_model_len,
            f"use null or a value from 2 (a prompt's token and one new) to {own}",
        )
    return max_model_len


def load_checkpoint(
    checkpoint_dir: Path, *, device: str, dtype: str, max_model_len: int | None
) -> LoadedModel:
    """Load a checkpoint for the transformers engine; the one place that knows checkpoint kinds."""
    check_servable(checkpoint_dir)
    context = model_context_length(checkpoint_dir, max_model_len)
    tokenizer = load_tokenizer(checkpoint_dir)
    torch_device = resolve_device(device)
    base_dir = lora_base_dir(checkpoint_dir)
    model = load_hf_model(
        base_dir or checkpoint_dir,
        adapter_dir=checkpoint_dir if base_dir is not None else None,
        dtype=resolve_dtype(dtype, torch_device),
    )
    # transformers declares PreTrainedModel.to as functools.wraps(nn.Module.to), which mypy reads
    # as the unbound function: it expects the model where the device goes.
    model.to(torch_device).eval()  # type: ignore[arg-type]
    eos_ids = set(_token_ids(model.generation_config.eos_token_id)) | checkpoint_stops(
        checkpoint_dir
    )
    if tokenizer.eos_token_id is not None:
        eos_ids.add(tokenizer.eos_token_id)
    return LoadedModel(model, tokenizer, frozenset(eos_ids), context)


def checkpoint_stops(checkpoint_dir: Path) -> frozenset[int]:
    """The eos_token_id of the checkpoint's own generation_config.json: runner joins a run's
    stop tokens (the template's end of a turn) to its source's there. A LoRA adapter's model is
    its base's, whose generation config holds the base's eos alone: a chat fine-tune of a base
    model was served to max_tokens past each answer."""
    generation = read_generation_config(checkpoint_dir) or {}
    return frozenset(_token_ids(generation.get("eos_token_id")))


def _token_ids(value: Any) -> list[int]:
    """A generation config's eos_token_id as the ids in it."""
    return [i for i in eos_token_ids(value) if isinstance(i, int) and not isinstance(i, bool)]


def load_hf_model(
    model_dir: Path, *, adapter_dir: Path | None, dtype: torch.dtype
) -> PreTrainedModel:
    """A causal LM from a local Hugging Face model dir, in `dtype`, on the CPU: safetensors
    weights only, each checked whole first, no remote code, no hub access; with `adapter_dir`,
    its PEFT adapter merged in (the rank from its adapter_config.json)."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()  # its "Loading weights" bar, a line per model
    for path in weight_files(model_dir):
        check_safetensors(path, key="checkpoint")
    if adapter_dir is not None:
        check_safetensors(adapter_dir / ADAPTER_FILE, key="checkpoint")
    model = AutoModelForCausalLM.from_pretrained(
        model_dir,
        dtype=dtype,
        use_safetensors=True,
        trust_remote_code=False,
        local_files_only=True,
    )
    if adapter_dir is None:
        return model
    from peft import LoraConfig, PeftModel

    adapted = PeftModel.from_pretrained(model, adapter_dir, is_trainable=False)
    config = adapted.peft_config["default"]
    assert isinstance(config, LoraConfig), "runner writes LoRA adapters only"
    log.info("merging the LoRA adapter of %s (rank %d) into its base", adapter_dir, config.r)
    return adapted.merge_and_unload()


def check_servable(checkpoint_dir: Path) -> None:
    """Refuse what no engine may load: pickled weights, weights cut short, and adapters without
    their weights or their base's (checked here, before the server starts: in the engine's
    process the same check came as two tracebacks after "serving")."""
    if (checkpoint_dir / ADAPTER_CONFIG_FILE).is_file():
        if not (checkpoint_dir / ADAPTER_FILE).is_file():
            raise UserError(
                "checkpoint",
                str(checkpoint_dir),
                f"a LoRA checkpoint without {ADAPTER_FILE}; serve a whole checkpoint",
            )
        check_safetensors(checkpoint_dir / ADAPTER_FILE, key="checkpoint")
        base = lora_base_dir(checkpoint_dir)
        assert base is not None, "an adapter's base is a directory or a UserError"
        require_safetensors(base, "deploy")
        return
    require_safetensors(checkpoint_dir, "deploy")


def require_safetensors(model_dir: Path, command: str) -> None:
    """Deploy and export load safetensors weights only, never pickled .bin files, and only
    whole ones: each weight file there and not cut short."""
    if not any(model_dir.glob("*.safetensors")):
        raise UserError(
            "checkpoint",
            str(model_dir),
            f"no *.safetensors weights here; {command} loads safetensors only (never pickled "
            ".bin files): re-save it as safetensors, "
            "AutoModelForCausalLM.from_pretrained(DIR).save_pretrained(NEW_DIR)",
        )
    for path in weight_files(model_dir):
        check_safetensors(path, key="checkpoint")


def resolve_device(device: str) -> torch.device:
    """`auto` is the GPU when there is one, else the CPU."""
    import torch

    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        torch_device = torch.device(device)
    except RuntimeError as error:
        raise UserError("device", device, "use auto, cpu, cuda or cuda:<index>") from error
    if torch_device.type == "cuda" and not torch.cuda.is_available():
        raise UserError("device", device, "no CUDA GPU is visible here: use device=cpu")
    return torch_device


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """The torch dtype for a dtype option: auto is fp32 on the CPU, bf16 on a GPU."""
    import torch

    if dtype == "auto":
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    if dtype not in _DTYPES:
        raise UserError("dtype", dtype, f"use auto or one of {', '.join(_DTYPES)}")
    return getattr(torch, _DTYPES[dtype])


def vllm_dtype(dtype: str) -> str:
    """vLLM's name for `dtype=auto|bf16|fp32` (its auto follows the checkpoint)."""
    if dtype == "auto":
        return "auto"
    if dtype not in _DTYPES:
        raise UserError("dtype", dtype, f"use auto or one of {', '.join(_DTYPES)}")
    return _DTYPES[dtype]
