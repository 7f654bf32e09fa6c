"""Data sources -> records: a file or a directory, its format, its splits, a split spec's rows.

A source is a local path, or (a training split streamed from the hub) the hub's URL of a file or
directory at a commit, hf://datasets/org/repo@<commit>/path, which runner.hub.download makes: its
files are listed and read through huggingface_hub's HfFileSystem, never downloaded whole.
"""

from __future__ import annotations

import contextlib
import csv
import logging
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import pyarrow as pa
import yaml
from datasets.data_files import DataFilesDict, get_data_patterns, sanitize_patterns
from datasets.exceptions import DatasetGenerationError

from runner.data.files import (
    FORMATS,
    data_extensions,
    data_suffix,
    hub_files,
    is_empty,
    is_remote,
    no_records,
    open_data,
    read_error,
    xml_rows,
)
from runner.errors import UserError
from runner.paths import UNWRITABLE, unwritable_fix

# dataset.format -> the `datasets` builder that reads it (xml: runner.data.files parses it;
# datasets' own xml builder yields each file as one string).
BUILDERS = {
    "json": "json",
    "jsonl": "json",
    "csv": "csv",
    "parquet": "parquet",
    "arrow": "arrow",
    "text": "text",
}
# Records read from a streamed file at a time.
STREAM_CHUNK = 1000
# A split's name, its slice, and the slice's rounding (datasets': train[:10%](closest)).
SPLIT_PART = re.compile(
    r"^\s*([\w.-]+)\s*(\[[^\]]*\])?\s*(\((?:closest|pct1_dropremainder)\))?\s*$"
)


def _format_of(path: Path) -> str | None:
    return next((f for f, exts in FORMATS.items() if data_suffix(path) in exts), None)


def source_format(
    key: str, source: str, data_format: str | None, token: str | bool | None = None
) -> str:
    """dataset.format, or, when it is null, the format the source's file extensions name."""
    if data_format is not None:
        if data_format not in FORMATS:
            raise UserError("dataset.format", data_format, f"choose one of: {', '.join(FORMATS)}")
        named = _format_of(Path(source)) if Path(source).is_file() else None
        if named not in (None, "text") and data_suffix(Path(source)) not in FORMATS[data_format]:
            # dataset=sample sets json for both sources: a .csv validation file read as JSON
            # was "not valid JSON ...; fix the JSON there".
            raise UserError(
                key,
                source,
                f"a .{named} file, read as dataset.format={data_format} (one format for every "
                "source of the dataset option); give dataset.format=null to read each by its "
                f"extension, or dataset.format={named}",
            )
        return data_format
    if is_remote(source):
        hub = hub_files(token)
        files = [Path(source)] if hub.isfile(source) else [Path(f) for f in hub.find(source)]
    else:
        path = Path(source)
        files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    found = {found for p in files if (found := _format_of(p)) is not None}
    if len(found) != 1:
        what = (
            f"holds files of several formats {sorted(found)}"
            if found
            else (f"has no known data file extension ({data_extensions()})")
        )
        raise UserError(
            "dataset.format",
            None,
            f"{source} {what}; set dataset.format to one of: {', '.join(FORMATS)}",
        )
    return found.pop()


def split_files(
    key: str, source: str, data_format: str, token: str | bool | None = None
) -> dict[str, list[str]]:
    """{split name: data files}: a file is the split `train`; a directory's files are named
    by split the way the Hugging Face hub names them (train-*.parquet, data/validation.json...).
    A hub directory is listed on the hub (`token`: its token), its files left there."""
    remote = is_remote(source)
    if hub_files(token).isfile(source) if remote else Path(source).is_file():
        return {"train": [source]}
    extensions = list(FORMATS[data_format])
    # datasets lists an hf:// directory through HfFileSystem, with this token.
    listing = {"download_config": datasets.DownloadConfig(token=token)} if remote else {}
    card = _card_config(key, source, token) or {}
    # A config's data_dir is where its data_files (or, without them, the split files) lie.
    base = f"{source.rstrip('/')}/{card['data_dir']}" if card.get("data_dir") else source
    if "data_files" in card:
        patterns = dict(sanitize_patterns(card["data_files"]))
    else:
        patterns = get_data_patterns(base, **listing)
    try:
        found = DataFilesDict.from_patterns(
            patterns,
            base_path=base,
            allowed_extensions=extensions,
            **listing,
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


def _card_config(key: str, source: str, token: str | bool | None) -> dict[str, Any] | None:
    """The default config of the dataset card (README.md's `configs:`: its data_files, its
    data_dir), as `datasets` reads a repository's; None where the card names none. Split by
    file name, a repository whose card names its validation file otherwise trained on it."""
    from datasets.utils.metadata import MetadataConfigs
    from huggingface_hub import DatasetCard

    readme = f"{source.rstrip('/')}/README.md"
    if is_remote(source):
        files = hub_files(token)
        text = files.read_text(readme, encoding="utf-8") if files.isfile(readme) else None
    else:
        text = Path(readme).read_text(encoding="utf-8") if Path(readme).is_file() else None
    if text is None or not text.lstrip("\ufeff \t\r\n").startswith("---"):  # a plain README
        return None
    try:
        configs = MetadataConfigs.from_dataset_card_data(DatasetCard(text).data)
        name = configs.get_default_config_name() if configs else None
    except (ValueError, yaml.YAMLError) as err:  # two defaults, data_files of another shape
        raise UserError(key, source, f"its README.md's configs do not read ({err})") from err
    if not configs:
        return None
    if name is None:
        raise UserError(
            key,
            source,
            f"its README.md names the configs {sorted(configs)} and no default; give the "
            "files of one as the source (a file, or a directory of them)",
        )
    return dict(configs[name])


def stream_files(
    key: str,
    source: str,
    data_format: str,
    split_key: str,
    split: str,
    token: str | bool | None = None,
) -> list[str]:
    """The files of a split (or of splits joined by +) to read as a stream, which takes no slice."""
    files_by_split = split_files(key, source, data_format, token)
    names = [part.strip() for part in split.split("+")]
    for name in names:
        match = SPLIT_PART.match(name)
        if match is None or match.group(2) or name not in files_by_split:
            raise UserError(
                split_key,
                split,
                f"a stream reads whole splits, and {source} has the split(s) "
                f"{sorted(files_by_split)}: name one of them (no slice)",
            )
    return [file for name in names for file in files_by_split[name]]


def _options(builder: str, file: str, token: str | bool | None = None) -> dict[str, Any]:
    """The `datasets` builder's options for `file`: a CSV cell has no type, so every column of a
    CSV file is read as text, an empty cell alone as null (pandas' own list of null words made
    an answer "NA", Namibia's code, or "None" null: refused, or left out of a prompt)."""
    if builder == "text":
        # A byte-order mark (Notepad's) began the first record, as the json and csv readers
        # strip it.
        return {"encoding": "utf-8-sig"}
    if builder != "csv":
        return {}
    # utf-8-sig: a file saved with a byte-order mark (Excel's "CSV UTF-8") named its first
    # column "\ufeffinstruction" here, where the reader strips it: the file was refused.
    with open_data(file, token, "r", newline="", encoding="utf-8-sig") as f:
        header = next(csv.reader(f), [])
    features = datasets.Features({c: datasets.Value("string") for c in header})
    return {"features": features, "keep_default_na": False, "na_values": [""]}


def stream_records(
    key: str, source: str, data_format: str, file: str, token: str | bool | None = None
) -> Iterator[dict[str, Any]]:
    """The records of one data file in order, read as a stream (datasets' IterableDataset): only
    a chunk of the file is in memory at a time (of a hub file, read in ranges from the hub). A
    file that does not read is a UserError naming it (and the line and column, for a text
    format)."""
    if is_empty(file, token):
        return
    builder = BUILDERS[data_format]
    try:
        stream = datasets.load_dataset(
            builder,
            data_files=[file],
            split="train",
            streaming=True,
            token=token,
            **_options(builder, file, token),
        )
        # In batches: `iter` reads the whole file also in a DataLoader worker, where iterating
        # the stream itself would give each worker only some of the files.
        for batch in stream.iter(batch_size=STREAM_CHUNK):
            columns = list(batch)
            for row in range(len(batch[columns[0]]) if columns else 0):
                yield {column: batch[column][row] for column in columns}
    except (DatasetGenerationError, ValueError, pa.ArrowInvalid) as err:
        raise read_error(key, source, data_format, [file], err, token) from err


def _read(
    key: str, source: str, data_format: str, files: list[str], xml_record: str | None
) -> datasets.Dataset:
    table = _read_if_any(key, source, data_format, files, xml_record)
    if table is None:
        raise no_records(key, source, files)
    return table


def _read_if_any(
    key: str, source: str, data_format: str, files: list[str], xml_record: str | None = None
) -> datasets.Dataset | None:
    """The records of `files`, None if they hold none; a file that does not read is a UserError
    naming it (and the line and column, for a text format)."""
    if all(is_empty(file) for file in files):
        return None  # `datasets` would stop at its first file, with a StopIteration
    if data_format == "xml":
        return _read_xml(key, source, files, xml_record)
    builder = BUILDERS[data_format]
    try:
        options = _options(builder, files[0])
        reader = datasets.load_dataset_builder(builder, data_files=files, **options)
        with _quietly():
            reader.download_and_prepare()
    except (DatasetGenerationError, ValueError, pa.ArrowInvalid, OSError) as err:
        unwritable = _cache_error(key, source, err if isinstance(err, OSError) else err.__cause__)
        if unwritable is not None:
            raise unwritable from None
        if isinstance(err, OSError):
            raise
        raise read_error(key, source, data_format, files, err) from err
    if not reader.info.splits["train"].num_examples:
        return None
    return reader.as_dataset(split="train")


def _cache_error(key: str, source: str, err: BaseException | None) -> UserError | None:
    """`datasets`' cache (a read-only or full home, as on clusters and in containers) that
    cannot take what it prepares of a file: one line naming it and the fix. None for another
    error (a data file's own)."""
    if not isinstance(err, OSError) or err.errno not in UNWRITABLE:
        return None
    cache = Path(datasets.config.HF_DATASETS_CACHE)
    at = Path(err.filename) if err.filename else cache  # a directory made for it, or in it
    if not (at in (cache, *cache.parents) or cache in at.parents):
        return None
    fix = unwritable_fix(err, "HF_DATASETS_CACHE (or HF_HOME)")
    return UserError(key, source, f"datasets could not write its cache {cache} {fix}")


@contextlib.contextmanager
def _quietly() -> Iterator[None]:
    """Without datasets' own output as it reads: its "Generating train split" bars (noise on the
    console of every first read of a file, carriage returns in a log file: the job logs the
    records it read and how long the check took), and the line it logs for a file it cannot
    read (`Failed to load JSON from file ...`, above the one error that names the file, line
    and column)."""
    shown, library = not datasets.are_progress_bars_disabled(), logging.getLogger("datasets")
    level = library.level
    datasets.disable_progress_bars()
    library.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        library.setLevel(level)
        if shown:
            datasets.enable_progress_bars()


def _read_xml(
    key: str, source: str, files: list[str], record: str | None
) -> datasets.Dataset | None:
    """The records of XML files: each `record` element (None: each child of the root element),
    its fields its attributes and the text of its child elements, every value a string (a field
    a record lacks is null), as a CSV cell is. Python's expat refuses entity expansion bombs
    and fetches no external entity."""
    rows = [row for file in files for row in xml_rows(key, source, file, record)]
    if not rows:
        return None
    columns = list(dict.fromkeys(name for row in rows for name in row))
    return datasets.Dataset.from_dict(
        {name: [row.get(name) for row in rows] for name in columns},
        features=datasets.Features({name: datasets.Value("string") for name in columns}),
    )


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

    # dataset.xml.record: the element of one record (None: each child of the root).
    xml_record: str | None = None

    def where(self, index: int) -> tuple[str, int]:
        """(file, row from 1) of record `index`."""
        if self.kept is not None:
            index = int(self.kept[index])
        part = 0
        while index >= self.parts[part][2]:
            index -= self.parts[part][2]
            part += 1
        files, start, _ = self.parts[part]
        for file, row, _ in rows_by_file(
            (files, start + index, 1), self.data_format, self.xml_record
        ):
            return file, row + 1
        raise AssertionError("row past the end of its split")


def rows_by_file(
    part: tuple[list[str], int, int], data_format: str, xml_record: str | None = None
) -> Iterator[tuple[str, int, int]]:
    """(file, first row, rows) of each file whose rows a part of a split (Records.parts: its
    files, first row, rows, over the files read as one) takes, in order, each file read as it
    comes; a part of sys.maxsize rows (a stream's) takes every row of each file, none read."""
    files, start, rows = part
    if len(files) == 1 or rows == sys.maxsize:
        yield from ((file, start if len(files) == 1 else 0, rows) for file in files)
        return
    offset = 0
    for file in files:
        if offset >= start + rows:
            return
        table = _read_if_any("dataset.source", file, data_format, [file], xml_record)
        count = 0 if table is None else len(table)
        first, end = max(start, offset), min(start + rows, offset + count)
        if end > first:
            yield file, first - offset, end - first
        offset += count


def load_records(
    *,
    source_key: str,
    source: str,
    data_format: str,
    split_key: str,
    split: str,
    xml_record: str | None = None,
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
        name: _read(source_key, source, data_format, files_by_split[name], xml_record)
        for name in set(names)
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
        return Records(whole[names[0]].select([]), source, data_format, [], None, xml_record)
    table = tables[0] if len(tables) == 1 else datasets.concatenate_datasets(tables)
    return Records(table, source, data_format, parts, None, xml_record)
