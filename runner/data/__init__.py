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

The rest of the runner imports these names from here.
"""

from __future__ import annotations

from runner.data.checks import DataError, said_at_launch
from runner.data.kinds import COLUMNS, CONVERSATION_STYLES, KINDS, SFT_KINDS
from runner.data.preference import PreferenceSplit, answer_log_probs, collate_preference
from runner.data.prompts import EvalPrompt, eval_prompts
from runner.data.sources import FORMATS, local_source, source_format
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
