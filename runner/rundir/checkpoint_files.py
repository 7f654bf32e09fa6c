"""The files of a checkpoint directory (checkpoints/step_<N>/), and whether they are whole.

The names are Hugging Face's and PEFT's, so that transformers and peft load a checkpoint as it
is; the checks read headers and tails only, never the weights.
"""

from __future__ import annotations

import json
import os
import zipfile
from pathlib import Path
from typing import Any

from runner.errors import UserError
from runner.paths import pasteable

HF_CONFIG_FILE = "config.json"
MODEL_FILE = "model.safetensors"
# A hub repo's weights in several files, listed by this index.
SHARDED_INDEX = "model.safetensors.index.json"
ADAPTER_CONFIG_FILE = "adapter_config.json"
ADAPTER_FILE = "adapter_model.safetensors"
GENERATION_CONFIG = "generation_config.json"
TRAINING_STATE_FILE = "training_state.pt"
# Where transformers reads a chat template kept apart from tokenizer_config.json.
CHAT_TEMPLATE_FILE = "chat_template.jinja"
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    CHAT_TEMPLATE_FILE,
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
)
# The largest header the safetensors library reads; a larger length is not a header's.
_SAFETENSORS_MAX_HEADER = 100_000_000


def read_generation_config(directory: Path) -> dict[str, Any] | None:
    """The directory's generation_config.json as a mapping; None where it has none, it does not
    read, or it is no JSON object."""
    try:
        generation = json.loads((directory / GENERATION_CONFIG).read_text())
    except (OSError, ValueError):
        return None
    return generation if isinstance(generation, dict) else None


def eos_token_ids(value: Any) -> list[Any]:
    """A generation config's eos_token_id (one id, a list of them, or none) as a list."""
    return [] if value is None else value if isinstance(value, list) else [value]


def readable_as_umask(path: Path) -> None:
    """Gives `path` (a *.safetensors file, or each under a directory) the mode every other new
    file takes here: 0o666 less the umask. safetensors 0.8 writes its files 0600 (a temporary
    file renamed into place; safetensors issue 782), so a server or a container run as another
    user read a checkpoint's config.json and tokenizer but could not open its weights."""
    mask = os.umask(0)
    os.umask(mask)
    for file in path.rglob("*.safetensors") if path.is_dir() else [path]:
        file.chmod(0o666 & ~mask)


def is_checkpoint_dir(path: Path) -> bool:
    """Whether `path` is a checkpoint itself: a Hugging Face model or a PEFT adapter dir."""
    return (path / HF_CONFIG_FILE).is_file() or (path / ADAPTER_CONFIG_FILE).is_file()


def weight_files(checkpoint_dir: Path) -> list[Path]:
    """The safetensors files holding a checkpoint's weights (one, or the shards of an index)."""
    if (checkpoint_dir / SHARDED_INDEX).is_file():
        index = json.loads((checkpoint_dir / SHARDED_INDEX).read_text())
        return [checkpoint_dir / name for name in sorted(set(index["weight_map"].values()))]
    return [checkpoint_dir / MODEL_FILE]


def check_safetensors(path: Path, *, key: str) -> None:
    """A UserError naming `path` (under config key `key`) unless it is a whole safetensors file:
    one whose header parses and places every tensor's bytes within the file."""
    problem = _safetensors_problem(path)
    if problem:
        raise UserError(key, str(path), f"{problem}; download, copy or save it again")


def no_training_state(checkpoint_dir: Path) -> UserError:
    """A run cannot go on from a checkpoint whose training_state.pt is gone (deleted to save
    room: two thirds of a full checkpoint with AdamW); its weights still start a new run."""
    return UserError(
        "checkpoint",
        str(checkpoint_dir),
        f"has no {TRAINING_STATE_FILE} (the optimizer, schedule, data position and step a run "
        "goes on from): put it back, or start a new run from its weights: runner train "
        f"{pasteable('load_checkpoint.path', str(checkpoint_dir))}",
    )


def checkpoint_problem(checkpoint: Path) -> str:
    """What is wrong with a checkpoint's files ("" if nothing): its configs (JSON), the weights
    they name (config.json's model, adapter_config.json's adapter: a full run's, a LoRA run's,
    both with merged weights), each safetensors file, and the training state it holds (none
    where it was not written by training: a published model)."""
    for name in _CONFIG_FILES:
        problem = json_problem(checkpoint / name)
        if problem:
            return f"{checkpoint / name} {problem}"
    named = set(checkpoint.glob("*.safetensors"))
    if (checkpoint / HF_CONFIG_FILE).is_file():
        named.update(weight_files(checkpoint))
    if (checkpoint / ADAPTER_CONFIG_FILE).is_file():
        named.add(checkpoint / ADAPTER_FILE)
    if not named:  # what a copy stopped before its files leaves
        return f"{checkpoint} holds no weights (no *.safetensors)"
    for path in sorted(named):
        problem = _safetensors_problem(path)
        if problem:
            return f"{path} {problem}"
    state = checkpoint / TRAINING_STATE_FILE
    problem = _training_state_problem(state)
    return f"{state} {problem}" if problem else ""


# A checkpoint's small JSON files, which its loaders parse whole.
_CONFIG_FILES = (HF_CONFIG_FILE, ADAPTER_CONFIG_FILE, SHARDED_INDEX, GENERATION_CONFIG)


def json_problem(path: Path) -> str:
    """What is wrong with a JSON file ("" if nothing, or if there is none)."""
    try:
        json.loads(path.read_bytes())
    except FileNotFoundError:
        return ""
    except OSError as err:
        return f"does not read ({err})"
    except ValueError as err:  # not JSON, or not UTF-8
        return f"is cut short or not JSON ({err})"
    return ""


def _safetensors_problem(path: Path) -> str:
    """What is wrong with a safetensors file ("" if nothing), read from its header alone: 8 bytes
    giving the header's length, the header (JSON), then the tensors' bytes it locates."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            header_size = int.from_bytes(f.read(8), "little") if size >= 8 else 0
            if not 2 <= header_size <= min(size - 8, _SAFETENSORS_MAX_HEADER):
                return f"is cut short or not safetensors: a header of {header_size} bytes in {size}"
            header = json.loads(f.read(header_size))
    except FileNotFoundError:
        return "is missing"
    except OSError as err:
        return f"does not read ({err})"
    except ValueError as err:  # not JSON, or not UTF-8
        return f"is not safetensors: its header is not JSON ({err})"
    if not isinstance(header, dict):
        return "is not safetensors: its header is not a JSON object"
    data_size = size - 8 - header_size
    for name, tensor in header.items():
        if name == "__metadata__":
            continue
        offsets = tensor.get("data_offsets") if isinstance(tensor, dict) else None
        if not (
            isinstance(offsets, list)
            and len(offsets) == 2
            and all(isinstance(offset, int) for offset in offsets)
            and 0 <= offsets[0] <= offsets[1]
        ):
            return f"is not safetensors: tensor {name!r} has no [begin, end] data_offsets"
        if offsets[1] > data_size:
            end = 8 + header_size + offsets[1]
            return f"is cut short: tensor {name!r} ends at byte {end}, the file at {size}"
    return ""


def _training_state_problem(path: Path) -> str:
    """What is wrong with a training_state.pt ("" if nothing, or if there is none).

    torch.save writes a zip archive whose central directory is the last thing in the file, so a
    file cut short has none: zipfile finds that from the file's tail, without reading the state.
    """
    if not path.exists():
        return ""
    try:
        with zipfile.ZipFile(path):
            return ""
    except (OSError, zipfile.BadZipFile) as err:
        return f"is cut short or not written by torch.save ({err})"
