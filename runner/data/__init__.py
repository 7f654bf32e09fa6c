"""Datasets: data files -> records, checked whole -> tokenized samples (packed on request).

- kinds: the kinds of record (dataset.kind), their columns, the conversation styles;
- sources: a source's format, its splits and the records of a split spec;
- checks: every split checked whole (a missing column, a value of the wrong type, a split left
  empty, a sample with nothing to train on after truncation), each one UserError naming the
  file, the row (counting records from 1) and the column;
- transforms: records -> tokenized samples, and samples -> batches;
- splits: the training and validation splits of a run, each read and checked once;
- stream: a training split read as a stream, window by window (dataset.streaming);
- prompts: validation records as generation prompts for eval;
- preference: preference records (prompt, chosen, rejected) -> tokenized pairs -> batches.

The rest of the runner imports these names from here; each module is imported when one of its
names is first read.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from runner.data.checks import DataError, said_at_launch
    from runner.data.files import FORMATS, local_source
    from runner.data.kinds import COLUMNS, CONVERSATION_STYLES, KINDS, SFT_KINDS
    from runner.data.preference import PreferenceSplit, answer_log_probs, collate_preference
    from runner.data.prompts import EvalPrompt, eval_prompts
    from runner.data.sources import source_format
    from runner.data.splits import (
        Split,
        check_datasets,
        held_out_fraction,
        train_dataset,
        training_splits,
        validation_split,
    )
    from runner.data.transforms import (
        CROSS_ENTROPY_IGNORE_IDX,
        TokenizedSplit,
        collate,
        forward_parts,
    )

# Each name's module, imported when the name is first read (PEP 562): the config's checks read
# the kinds and the sources alone, and a refused value was answered after torch's, torchtune's
# and datasets' imports (2.3 s of runner.data's 2.3 s), which the tokenizing modules need.
_MODULES = {
    "DataError": "checks",
    "said_at_launch": "checks",
    "COLUMNS": "kinds",
    "CONVERSATION_STYLES": "kinds",
    "KINDS": "kinds",
    "SFT_KINDS": "kinds",
    "PreferenceSplit": "preference",
    "answer_log_probs": "preference",
    "collate_preference": "preference",
    "EvalPrompt": "prompts",
    "eval_prompts": "prompts",
    "FORMATS": "files",
    "local_source": "files",
    "source_format": "sources",
    "Split": "splits",
    "check_datasets": "splits",
    "held_out_fraction": "splits",
    "train_dataset": "splits",
    "training_splits": "splits",
    "validation_split": "splits",
    "CROSS_ENTROPY_IGNORE_IDX": "transforms",
    "TokenizedSplit": "transforms",
    "collate": "transforms",
    "forward_parts": "transforms",
}


def __getattr__(name: str) -> Any:
    module = _MODULES.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"runner.data.{module}"), name)
    globals()[name] = value
    return value


__all__ = [
    "COLUMNS",
    "CONVERSATION_STYLES",
    "CROSS_ENTROPY_IGNORE_IDX",
    "FORMATS",
    "KINDS",
    "SFT_KINDS",
    "PreferenceSplit",
    "Split",
    "answer_log_probs",
    "collate_preference",
    "DataError",
    "EvalPrompt",
    "TokenizedSplit",
    "check_datasets",
    "said_at_launch",
    "held_out_fraction",
    "collate",
    "forward_parts",
    "eval_prompts",
    "local_source",
    "source_format",
    "train_dataset",
    "training_splits",
    "validation_split",
]
