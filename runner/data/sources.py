"""Data sources -> records: a file or a directory, its format, its splits, a split spec's rows."""

from __future__ import annotations

import csv
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import pyarrow as pa
from datasets.data_files import DataFilesDict, get_data_patterns
from datasets.exceptions import DatasetGenerationError

from runner.errors import UserError

FORMATS: dict[str, tuple[str, ...]] = {
    "json": (".json", ".jsonl"),
    "jsonl": (".json", ".jsonl"),
    "csv": (".csv",),
    "parquet": (".parquet",),
    "arrow": (".arrow",),
    "text": (".txt",),
}
# dataset.format -> the `datasets` builder that reads it.
BUILDERS = {
    "json": "json",
    "jsonl": "json",
    "csv": "csv",
    "parquet": "parquet",
    "arrow": "arrow",
    "text": "text",
}
SPLIT_PART = re.compile(r"^\s*([\w.-]+)\s*(\[[^\]]*\])?\s*$")


def local_source(key: str, source: str) -> str:
    """The absolute local path of a dataset source: a data file or a directory of them.

    runner.hub has already turned hf:// sources into paths in the cache, except for a dry run
    that downloads nothing (`runner estimate`).
    """
    if source.startswith("hf://"):
        raise UserError(
            key,
            source,
            "is not in the cache and this command downloads nothing; fetch it with "
            "`runner download` and the same overrides",
        )
    path = Path(source).expanduser()
    if not path.exists():
        raise UserError(
            key,
            source,
            f"no such file or directory; give a data file ({_extensions()}) or a directory of them",
        )
    # Not resolve(): a file in the hub cache is a symlink to a blob without its name.
    return os.path.abspath(path)


def _extensions(formats: tuple[str, ...] = tuple(FORMATS)) -> str:
    return ", ".join(sorted({ext for f in formats for ext in FORMATS[f]}))


def _format_of(path: Path) -> str | None:
    suffix = path.suffix.lower()
    return next((f for f, exts in FORMATS.items() if suffix in exts), None)


def source_format(key: str, source: str, data_format: str | None) -> str:
    """dataset.format, or, when it is null, the format the source's file extensions name."""
    if data_format is not None:
        if data_format not in FORMATS:
            raise UserError("dataset.format", data_format, f"choose one of: {', '.join(FORMATS)}")
        return data_format
    path = Path(source)
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    found = {_format_of(p) for p in files} - {None}
    if len(found) != 1:
        what = (
            f"holds files of several formats {sorted(found)}"
            if found
            else (f"has no known data file extension ({_extensions()})")
        )
        raise UserError(
            "dataset.format",
            None,
            f"{source} {what}; set dataset.format to one of: {', '.join(FORMATS)}",
        )
    return found.pop()


def split_files(key: str, source: str, data_format: str) -> dict[str, list[str]]:
    """{split name: data files}: a file is the split `train`; a directory's files are named
    by split the way the Hugging Face hub names them (train-*.parquet, data/validation.json...)."""
    path = Path(source)
    if path.is_file():
        return {"train": [str(path)]}
    extensions = list(FORMATS[data_format])
    try:
        found = DataFilesDict.from_patterns(
            get_data_patterns(str(path)), base_path=str(path), allowed_extensions=extensions
        )
    except FileNotFoundError:
        found = {}
    splits = {str(name): sorted(files) for name, files in found.items() if files}
    if not splits:
        raise UserError(
            key,
            source,
            f"holds no {data_format} files ({', '.join(extensions)}); "
            "give a file or directory of them, or set dataset.format",
        )
    return splits


def _read(key: str, source: str, data_format: str, files: list[str]) -> datasets.Dataset:
    builder = BUILDERS[data_format]
    options: dict[str, Any] = {}
    if builder == "csv":
        # A CSV cell has no type: read every column as text (an empty cell is null).
        with open(files[0], newline="") as f:
            header = next(csv.reader(f), [])
        options["features"] = datasets.Features({c: datasets.Value("string") for c in header})
    try:
        return datasets.load_dataset(builder, data_files=files, split="train", **options)
    except (DatasetGenerationError, ValueError, pa.ArrowInvalid) as err:
        cause = err.__cause__ or err
        raise UserError(
            key, source, f"could not be read as dataset.format={data_format} ({cause})"
        ) from err


@dataclass
class Records:
    """The records of a split spec, and where each came from (to name its file and row)."""

    table: datasets.Dataset
    source: str
    data_format: str
    # (files of the split, first row taken, rows taken), in the order they were concatenated.
    parts: list[tuple[list[str], int, int]]
    # After filtering: the index before filtering of each row kept; None: nothing filtered.
    kept: np.ndarray | None = None

    def where(self, index: int) -> tuple[str, int]:
        """(file, row from 1) of record `index`."""
        if self.kept is not None:
            index = int(self.kept[index])
        part = 0
        while index >= self.parts[part][2]:
            index -= self.parts[part][2]
            part += 1
        files, start, _ = self.parts[part]
        row = start + index
        if len(files) == 1:
            return files[0], row + 1
        for file in files:
            rows = len(_read("dataset.source", self.source, self.data_format, [file]))
            if row < rows:
                return file, row + 1
            row -= rows
        raise AssertionError("row past the end of its split")


def load_records(
    *, source_key: str, source: str, data_format: str, split_key: str, split: str
) -> Records:
    """The records of `split` (a split name, a slice like train[:95%], or parts joined by +)."""
    files_by_split = split_files(source_key, source, data_format)
    names = []
    for part in split.split("+"):
        match = SPLIT_PART.match(part)
        if match is None:
            raise UserError(
                split_key,
                split,
                "give a split such as train, validation, train[:95%] or train[1000:2000]",
            )
        names.append(match.group(1))
    for name in names:
        if name not in files_by_split:
            raise UserError(
                split_key,
                split,
                f"{source} has the split(s) {sorted(files_by_split)} (a single "
                "file holds only `train`); name one of them",
            )
    whole = {
        name: _read(source_key, source, data_format, files_by_split[name]) for name in set(names)
    }
    try:
        instructions = datasets.ReadInstruction.from_spec(split).to_absolute(
            {name: len(table) for name, table in whole.items()}
        )
    except (ValueError, AssertionError) as err:
        raise UserError(split_key, split, f"not a split slice datasets can read ({err})") from err
    tables, parts = [], []
    for instruction in instructions:
        table = whole[instruction.splitname]
        start, stop = instruction.from_, instruction.to
        if stop > start:
            tables.append(table.select(range(start, stop)))
            parts.append((files_by_split[instruction.splitname], start, stop - start))
    if not tables:  # an empty slice: reported by the caller
        return Records(whole[names[0]].select([]), source, data_format, [])
    table = tables[0] if len(tables) == 1 else datasets.concatenate_datasets(tables)
    return Records(table, source, data_format, parts)
