"""The splits a run uses: training, and validation (a named split, another source or held out).

Each is read and checked whole once per call, so a process that calls once reads each once.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import sys
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
from torch.utils.data import Dataset

from runner.data.checks import checked_split
from runner.data.files import is_remote
from runner.data.preference import PreferenceSplit
from runner.data.sources import rows_by_file, stream_files
from runner.data.transforms import TokenizedSplit
from runner.errors import UserError
from runner.models.torchtune_boundary import PackedDataset

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from runner.models.tokenizer import ChatTokenizer

# A split of records, tokenized on access: supervised (instruct, chat, text) or preference.
Split = TokenizedSplit | PreferenceSplit


def held_out_fraction(held_out: Any) -> float:
    """dataset.validation.held_out as typed, a percentage (5%) or a fraction (0.05): the
    fraction."""
    text = str(held_out).strip()
    try:
        fraction = float(text[:-1]) / 100 if text.endswith("%") else float(text)
    except ValueError:
        fraction = -1.0
    if isinstance(held_out, bool) or not 0 < fraction < 1:
        raise UserError(
            "dataset.validation.held_out",
            held_out,
            "give a percentage such as 5% (or 0.05), or null",
        )
    return fraction


def _held_out(
    tokenized: Split,
    held_out: str,
    seed: int,
    data: Mapping[str, Any],
    tokenizer: ChatTokenizer,
) -> tuple[Split, Split]:
    """(train, validation): the `held_out` share of the records (as typed: 5% or 0.05), drawn
    with `seed`, kept in file order."""
    total = len(tokenized)
    count = round(total * held_out_fraction(held_out))
    if count == 0 or count == total:
        raise UserError(
            "dataset.validation.held_out",
            held_out,
            f"holds out {count} of the split's {total} records; give a share that leaves "
            "records on both sides",
        )
    order = np.random.default_rng(seed).permutation(total)
    chosen = np.zeros(total, dtype=bool)
    chosen[order[:count]] = True
    records, split = tokenized.records, type(tokenized)
    return (
        split(records.select(np.flatnonzero(~chosen)), data, tokenizer),
        split(records.select(np.flatnonzero(chosen)), data, tokenizer),
    )


def _splits(
    data: Mapping[str, Any], tokenizer: ChatTokenizer, *, validation: bool
) -> tuple[Split, Split | None]:
    """(train, validation or None), unpacked; without `validation` only the training split."""
    held = data["validation"]
    train = checked_split(
        data,
        tokenizer,
        source_key="dataset.source",
        source=data["source"],
        split_key="dataset.split",
        split=data["split"],
        data_format=data["format"],
    )
    if held["held_out"] is not None:
        train, held_out = _held_out(train, held["held_out"], held["seed"], data, tokenizer)
        return train, held_out if validation else None
    return train, validation_split(data, tokenizer) if validation else None


def _check_disjoint(
    train: list[tuple[list[str], int, int]],
    validation: list[tuple[list[str], int, int]],
    data: Mapping[str, Any],
) -> None:
    """The validation records are none of the training records: a validation split that
    overlaps the training split (dataset=alpaca dataset.split=train keeps the preset's
    validation.split=train[95%:]) scored records the run trains on, and picked its best
    checkpoint by them, without a word. A file and a link to it are the same records; one shard
    of a sharded split, named as a source, is that split's too. Parts of the same files compare
    by their rows; files are read (to count each one's rows) only where parts of different
    files share one, or to name an overlap's file and rows."""
    held = data["validation"]
    held_format = held["format"] if held["source"] is not None else data["format"]
    xml_record = data["xml"]["record"]
    for part in train:
        files = [os.path.realpath(f) for f in part[0]]
        for other in validation:
            other_files = [os.path.realpath(f) for f in other[0]]
            if not set(files) & set(other_files):
                continue
            if files == other_files:  # the same files read as one: their rows are comparable
                first = max(part[1], other[1])
                if first >= min(part[1] + part[2], other[1] + other[2]):
                    continue
            held_rows = [
                (os.path.realpath(file), file, start, rows)
                for file, start, rows in rows_by_file(other, held_format, xml_record)
            ]
            for file, start, rows in rows_by_file(part, data["format"], xml_record):
                same = os.path.realpath(file)
                for other_same, other_file, other_start, other_rows in held_rows:
                    first = max(start, other_start)
                    end = min(start + rows, other_start + other_rows)
                    if same == other_same and first < end:
                        _overlap(data, first, end, other_file)


def _overlap(data: Mapping[str, Any], first: int, end: int, file: str) -> None:
    held = data["validation"]
    named_by = "source" if held["source"] is not None else "split"
    rows = f"records {first + 1} to {end}" if end < sys.maxsize else f"records from {first + 1}"
    raise UserError(
        f"dataset.validation.{named_by}",
        held[named_by],
        f"holds {rows} of {file}, which dataset.split={data['split']!r} trains on: evaluation "
        "would score training records; give slices that do not meet "
        "(dataset.split='train[:95%]' beside validation.split='train[95%:]'), or "
        "validation.held_out=5% to draw them from the training split",
    )


def validation_split(data: Mapping[str, Any], tokenizer: ChatTokenizer) -> Split | None:
    """The validation split named by a split or a separate source, read and checked whole; None
    where there is none (a held-out share is drawn from the training split: _splits)."""
    held = data["validation"]
    if held["source"] is None and held["split"] is None:
        return None
    # A separate source, or a named split of the training source.
    if held["source"] is not None:
        source_key, source, data_format = (
            "dataset.validation.source",
            held["source"],
            held["format"],
        )
    else:
        source_key, source, data_format = "dataset.source", data["source"], data["format"]
    return checked_split(
        data,
        tokenizer,
        source_key=source_key,
        source=source,
        split_key="dataset.validation.split",
        split=held["split"],
        data_format=data_format,
    )


# ---- what the recipe, the checks and eval read ----------------------------------------------
def training_splits(
    data: Mapping[str, Any], tokenizer: ChatTokenizer, *, validation: bool
) -> tuple[Dataset, Split | None]:
    """The training split, packed when dataset.packing, and the validation split (never packed),
    or None without `validation` or when the dataset has none. Reads each split once."""
    train, held = _splits(data, tokenizer, validation=validation)
    if data["packing"]:
        started, samples = time.perf_counter(), len(train)
        # torchtune's "Packing dataset" bar takes no switch: hundreds of its states filled the
        # console and any captured log. The line after says what it did, as the data check's.
        with contextlib.redirect_stderr(io.StringIO()):
            train = PackedDataset(
                train,
                max_seq_len=data["max_seq_len"],
                padding_idx=tokenizer.pad_id,
                split_across_pack=False,
            )
        log.info(
            "data: %d samples packed into %d rows of %d tokens in %.1f s",
            samples,
            len(train),
            data["max_seq_len"],
            time.perf_counter() - started,
        )
    return train, held


def train_dataset(data: Mapping[str, Any], tokenizer: ChatTokenizer) -> Dataset:
    """The training split alone (the recipe's `dataset` section), packed when dataset.packing."""
    train, _ = training_splits(data, tokenizer, validation=False)
    return train


def check_datasets(
    data: Mapping[str, Any], tokenizer: ChatTokenizer, *, evaluates: bool = True
) -> dict[str, int]:
    """Reads and checks every split whole; records per split. Raises one UserError if not.
    A streamed training split is checked as it is read (runner.data.stream): only validation.
    A run that `evaluates` may not evaluate on records it trains on."""
    if data["streaming"]:
        streamed = None
        if not is_remote(data["source"]):  # a hub's files are listed as the stream starts
            # Its files, listed (nothing read): a slice, or a split the source has not, passed
            # validate and was refused by train.
            streamed = stream_files(
                "dataset.source", data["source"], data["format"], "dataset.split", data["split"]
            )
        held = validation_split(data, tokenizer)
        if held is None:
            return {}
        if evaluates and streamed is not None:  # every row of each file: a stream takes all
            _check_disjoint([(streamed, 0, sys.maxsize)], held.parts, data)
        return {"validation": len(held)}
    train, validation = _splits(data, tokenizer, validation=True)
    if evaluates and validation is not None:
        _check_disjoint(train.parts, validation.parts, data)
    found = {"train": len(train)}
    if validation is not None:
        found["validation"] = len(validation)
    return found
