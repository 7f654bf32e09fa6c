"""Datasets: data files -> records, checked whole -> tokenized samples (packed on request).

Three kinds of record (dataset.kind):

- instruct: instruction (+ input) -> output, as [system?, user, assistant] chat messages;
- chat: a column of conversations, OpenAI style [{role, content}] or ShareGPT [{from, value}];
- text: plain text where every token trains (completion data; format=text reads a line a record).

Every split is checked whole before training (`check_datasets`): a missing column, a value of the
wrong type, a split left empty, a sample with nothing to train on after truncation. Each is one
UserError naming the file, the row (counting records from 1) and the column.
"""

from __future__ import annotations

import csv
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch
from datasets.data_files import DataFilesDict, get_data_patterns
from datasets.exceptions import DatasetGenerationError
from torch.utils.data import Dataset

from runner.errors import UserError
from runner.tune import (
    CROSS_ENTROPY_IGNORE_IDX,
    Message,
    OpenAIToMessages,
    PackedDataset,
    SFTTransform,
    ShareGPTToMessages,
    create_block_causal_mask,
    padded_collate_packed,
    padded_collate_sft,
)

# dataset.format -> the file extensions it reads ("json" and "jsonl" are one reader).
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
KINDS = ("instruct", "chat", "text")
# Our column names per kind (dataset.column_map maps them to the file's); None: optional.
COLUMNS: dict[str, dict[str, bool]] = {
    "instruct": {"instruction": True, "input": False, "output": True},
    "chat": {"messages": True},
    "text": {"text": True},
}


@dataclass(frozen=True)
class ConversationStyle:
    """How a chat record spells a message: its two keys and its role names -> ours."""

    role: str
    content: str
    roles: dict[str, str]


CONVERSATION_STYLES = {
    "openai": ConversationStyle(
        "role", "content", {"system": "system", "user": "user", "assistant": "assistant"}
    ),
    "sharegpt": ConversationStyle(
        "from", "value", {"system": "system", "human": "user", "gpt": "assistant"}
    ),
}
SPLIT_PART = re.compile(r"^\s*([\w.-]+)\s*(\[[^\]]*\])?\s*$")


class DataError(UserError):
    """Bad data in one cell: names the file, the row (from 1) and the column."""

    def __init__(
        self, key: str, value: object, *, file: str, row: int, column: str, problem: str, fix: str
    ) -> None:
        self.file, self.row, self.column = file, row, column
        where = "" if file == value else f"{file} "  # the file is the value already
        super().__init__(key, value, f"{where}row {row}, column {column!r}: {problem}; {fix}")


# ---- record -> messages / tokens ------------------------------------------------------------
class InstructToMessages:
    """One record -> [system?, user (instruction, then input if any), assistant (output)]."""

    def __init__(
        self,
        column_map: Mapping[str, str | None],
        train_on_input: bool,
        new_system_prompt: str | None,
    ) -> None:
        self.column_map = dict(column_map)
        self.train_on_input = train_on_input
        self.new_system_prompt = new_system_prompt

    def user_text(self, sample: Mapping[str, Any]) -> str:
        instruction = sample[self.column_map["instruction"]]
        input_column = self.column_map["input"]
        extra = sample[input_column] if input_column is not None else None
        return f"{instruction}\n{extra}" if extra else instruction

    def prompt_messages(self, sample: Mapping[str, Any]) -> list[Message]:
        """The messages before the answer: what a user would send for this record."""
        messages = []
        if self.new_system_prompt:
            messages.append(Message(role="system", content=self.new_system_prompt, masked=True))
        user = Message(role="user", content=self.user_text(sample), masked=not self.train_on_input)
        return [*messages, user]

    def reference(self, sample: Mapping[str, Any]) -> str:
        return sample[self.column_map["output"]]

    def __call__(self, sample: Mapping[str, Any]) -> dict[str, Any]:
        answer = Message(role="assistant", content=self.reference(sample), masked=False)
        return {"messages": [*self.prompt_messages(sample), answer]}


class ChatToMessages:
    """A conversation -> messages through torchtune's OpenAI or ShareGPT transform."""

    def __init__(
        self, column: str, style: str, train_on_input: bool, new_system_prompt: str | None
    ) -> None:
        if style == "openai":
            self._transform = OpenAIToMessages(
                train_on_input=train_on_input,
                column_map={"messages": column},
                new_system_prompt=new_system_prompt,
            )
        else:
            self._transform = ShareGPTToMessages(
                train_on_input=train_on_input,
                column_map={"conversations": column},
                new_system_prompt=new_system_prompt,
            )

    def prompt_and_answer(self, sample: Mapping[str, Any]) -> tuple[list[Message], Message]:
        """The conversation up to its last assistant message, and that message."""
        messages = self(sample)["messages"]
        last = max(i for i, m in enumerate(messages) if m.role == "assistant")
        return messages[:last], messages[last]

    def __call__(self, sample: Mapping[str, Any]) -> dict[str, Any]:
        return self._transform(sample)


class TextToTokens:
    """Plain text -> BOS, its tokens, EOS, cut at max_seq_len; every token but BOS trains.

    BOS is masked so that, packed after another sample, nothing learns to predict a new start.
    """

    def __init__(self, tokenizer: Any, column: str, max_seq_len: int) -> None:
        self.tokenizer, self.column, self.max_seq_len = tokenizer, column, max_seq_len

    def __call__(self, sample: Mapping[str, Any]) -> dict[str, Any]:
        tokens = self.tokenizer.encode(sample[self.column], add_bos=True, add_eos=True)
        tokens = tokens[: self.max_seq_len]
        return {"tokens": tokens, "mask": [True] + [False] * (len(tokens) - 1)}


class TokenizedSplit(Dataset):
    """The records of one split, tokenized on access the way torchtune's SFTDataset does.

    Each item has tokens, mask and labels (the token where it trains, else the ignore index).
    """

    def __init__(self, records: datasets.Dataset, data: Mapping[str, Any], tokenizer: Any) -> None:
        self.records = records
        self.kind = data["kind"]
        column_map = data["column_map"]
        if self.kind == "instruct":
            self.message_transform: Any = InstructToMessages(
                column_map, data["train_on_input"], data["new_system_prompt"]
            )
            self._prepare = SFTTransform(self.message_transform, tokenizer)
        elif self.kind == "chat":
            self.message_transform = ChatToMessages(
                column_map["messages"],
                data["conversation_style"],
                data["train_on_input"],
                data["new_system_prompt"],
            )
            self._prepare = SFTTransform(self.message_transform, tokenizer)
        else:
            self.message_transform = None
            self._prepare = SFTTransform(
                None, TextToTokens(tokenizer, column_map["text"], data["max_seq_len"])
            )

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return self._prepare(self.records[index])


# ---- sources, files and splits --------------------------------------------------------------
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


# ---- checks ---------------------------------------------------------------------------------
def _describe(value: Any) -> str:
    if value is None:
        return "null"
    names = {bool: "a boolean", int: "a number", float: "a number", str: "text", list: "a list"}
    return f"{names.get(type(value), 'an object')} ({str(value)[:40]!r})"


def _first_bad_text(table: datasets.Dataset, column: str, required: bool) -> tuple[int, str]:
    """(index, what it holds) of the first value that is not text (or null, if `required`)."""
    values = table.data.column(column)
    if pa.types.is_string(values.type) or pa.types.is_large_string(values.type):
        if not required or values.null_count == 0:
            return -1, ""
        nulls = np.flatnonzero(values.is_null().to_numpy(zero_copy_only=False))
        return int(nulls[0]), "null"
    for index, value in enumerate(table[column]):
        if not isinstance(value, str) and (value is not None or required):
            return index, _describe(value)
    return -1, ""


def _conversation_problem(
    conversation: Any, style: ConversationStyle, name: str, data: Mapping[str, Any]
) -> tuple[str, int, int]:
    """What is wrong with one conversation ("" if nothing), and the UTF-8 bytes and the number
    of the messages before its first trained one (its prompt)."""
    shape = f"a list of {{{style.role!r}, {style.content!r}}} messages ({name} style)"
    if not isinstance(conversation, list):
        return f"holds {_describe(conversation)}, not {shape}", 0, 0
    system, train_on_input = data["new_system_prompt"], data["train_on_input"]
    roles = ["system"] if system is not None else []
    # torchtune's chat transforms train every message under train_on_input, the system's too.
    trained = bool(roles) and train_on_input
    prompt_bytes = len(system.encode()) if roles and not trained else 0
    prompt_messages = len(roles)
    for number, message in enumerate(conversation, 1):
        if not isinstance(message, dict) or message.get(style.role) is None:
            return f"message {number} is {_describe(message)}, not {shape}", 0, 0
        role, content = message[style.role], message.get(style.content)
        if role not in style.roles:
            known = ", ".join(style.roles)
            return f"message {number} has {style.role}={role!r}; {name} roles are {known}", 0, 0
        if not isinstance(content, str):
            problem = f"message {number}'s {style.content!r} is {_describe(content)}, not text"
            return problem, 0, 0
        ours = style.roles[role]
        if ours == "system" and system is not None:
            continue  # replaced by the new system prompt
        if ours == "system" and roles:
            return f"message {number} is a system message after the first", 0, 0
        if ours == "assistant" and (not roles or roles[-1] != "user"):
            return f"message {number} is an assistant message that answers no user message", 0, 0
        if ours == "user" and roles and roles[-1] == "user":
            return f"messages {number - 1} and {number} are both user messages", 0, 0
        roles.append(ours)
        trained = trained or ours == "assistant" or train_on_input
        if not trained:
            prompt_bytes += len(content.encode())
            prompt_messages += 1
    if not trained:
        return "has no assistant message, so nothing to train on", 0, 0
    return "", prompt_bytes, prompt_messages


def _instruct_prompts(records: Records, data: Mapping[str, Any]) -> tuple[np.ndarray, int]:
    """The UTF-8 bytes and the number of the messages before the answer (those not trained)."""
    system = data["new_system_prompt"]
    sizes = np.full(len(records.table), len(system.encode()) if system else 0, dtype=np.int64)
    messages = 1 if system else 0
    if not data["train_on_input"]:
        messages += 1
        for ours in ("instruction", "input"):
            column = data["column_map"][ours]
            if column is None:
                continue
            values = records.table.data.column(column).cast(pa.large_string())
            sizes += pc.fill_null(pc.binary_length(values), 0).to_numpy(zero_copy_only=False) + 1
    return sizes, messages


def check_records(records: Records, data: Mapping[str, Any], *, key: str) -> None:
    """Columns present, and every cell of the right type; `key` is the source's config key."""
    table, kind, column_map = records.table, data["kind"], data["column_map"]
    for ours, required in COLUMNS[kind].items():
        theirs = column_map[ours]
        if theirs is None and not required:
            continue
        if theirs not in table.column_names:
            fix = f"map it with dataset.column_map.{ours}=<column>"
            if not required:
                fix += f" (or dataset.column_map.{ours}=null if there is none)"
            raise UserError(
                f"dataset.column_map.{ours}",
                theirs,
                f"{records.parts[0][0][0]} has no column {theirs!r}; its columns are "
                f"{table.column_names}; {fix}",
            )
        if kind == "chat":
            continue
        index, found = _first_bad_text(table, theirs, required)
        if index >= 0:
            file, row = records.where(index)
            optional = "" if required else " or null"
            raise DataError(
                key,
                records.source,
                file=file,
                row=row,
                column=theirs,
                problem=f"holds {found} where text is required",
                fix=f"give text{optional} in every row of {theirs!r}, or drop the row",
            )


def _check_conversations(
    records: Records, data: Mapping[str, Any], *, key: str
) -> tuple[np.ndarray, np.ndarray]:
    """Checks every conversation; returns the bytes and messages of each one's prompt."""
    name = data["conversation_style"]
    style, column = CONVERSATION_STYLES[name], data["column_map"]["messages"]
    sizes = np.zeros(len(records.table), dtype=np.int64)
    messages = np.zeros(len(records.table), dtype=np.int64)
    values = records.table.data.column(column)
    # Plain nested Arrow reads fastest as Python lists; mixed JSON needs datasets' decoding.
    plain = pa.types.is_list(values.type) or pa.types.is_large_list(values.type)
    for index, conversation in enumerate(values.to_pylist() if plain else records.table[column]):
        problem, sizes[index], messages[index] = _conversation_problem(
            conversation, style, name, data
        )
        if problem:
            file, row = records.where(index)
            raise DataError(
                key,
                records.source,
                file=file,
                row=row,
                column=column,
                problem=problem,
                fix="fix or drop the row (dataset.conversation_style names the message format)",
            )
    return sizes, messages


def _check_trainable(
    split: TokenizedSplit,
    records: Records,
    prompt_bytes: np.ndarray,
    prompt_messages: np.ndarray | int,
    data: Mapping[str, Any],
    tokenizer: Any,
) -> None:
    """No sample is left with nothing to train on after truncation to dataset.max_seq_len.

    That needs a prompt of about max_seq_len tokens, and a token is at least one byte of text:
    only records whose prompt bytes plus the chat template's tokens per message come near
    max_seq_len are tokenized.
    """
    max_seq_len = data["max_seq_len"]
    empty = [Message(role=r, content="") for r in ("system", "user", "assistant")]
    template, _ = tokenizer.tokenize_messages(empty)
    bound = 1 + prompt_bytes + (prompt_messages + 1) * (len(template) + 2)
    for index in np.flatnonzero(bound >= max_seq_len - 2):
        sample = split[int(index)]
        if any(label != CROSS_ENTROPY_IGNORE_IDX for label in sample["labels"]):
            continue
        file, row = records.where(int(index))
        column_map = data["column_map"]
        prompt = [column_map[c] for c in ("instruction", "input", "messages") if column_map.get(c)]
        raise DataError(
            "dataset.max_seq_len",
            max_seq_len,
            file=file,
            row=row,
            column=", ".join(prompt),
            problem=f"no token is left to train on after truncation to {max_seq_len} tokens "
            "(the prompt fills them)",
            fix="raise dataset.max_seq_len, shorten the prompt, or drop the row",
        )


def _checked_split(
    data: Mapping[str, Any],
    tokenizer: Any,
    *,
    source_key: str,
    source: str,
    split_key: str,
    split: str,
) -> tuple[Records, TokenizedSplit]:
    records = load_records(
        source_key=source_key,
        source=source,
        data_format=data["format"],
        split_key=split_key,
        split=split,
    )
    if len(records.table) == 0:
        raise UserError(
            split_key, split, f"{source} has no records in this split; give a split that holds some"
        )
    check_records(records, data, key=source_key)
    kind, column_map = data["kind"], data["column_map"]
    if kind == "text":
        text = records.table.data.column(column_map["text"])
        blank = pc.equal(pc.utf8_trim_whitespace(text), "").to_numpy(zero_copy_only=False)
        records.kept = np.flatnonzero(~blank)
        records.table = records.table.select(records.kept)
        if len(records.table) == 0:
            raise UserError(
                split_key,
                split,
                f"{source} has only blank lines in this split; give a split that holds some text",
            )
    records.table = records.table.select_columns([c for c in column_map.values() if c])
    tokenized = TokenizedSplit(records.table, data, tokenizer)
    if kind == "chat":
        sizes, messages = _check_conversations(records, data, key=source_key)
        _check_trainable(tokenized, records, sizes, messages, data, tokenizer)
    elif kind == "instruct":
        sizes, count = _instruct_prompts(records, data)
        _check_trainable(tokenized, records, sizes, count, data, tokenizer)
    return records, tokenized


def _held_out(
    tokenized: TokenizedSplit,
    fraction: float,
    seed: int,
    data: Mapping[str, Any],
    tokenizer: Any,
) -> tuple[TokenizedSplit, TokenizedSplit]:
    """(train, validation): `fraction` of the records, drawn with `seed`, kept in file order."""
    total = len(tokenized)
    count = round(total * fraction)
    if count == 0 or count == total:
        raise UserError(
            "dataset.validation.held_out",
            f"{fraction:.4g}",
            f"holds out {count} of the split's {total} records; give a share that leaves "
            "records on both sides",
        )
    order = np.random.default_rng(seed).permutation(total)
    chosen = np.zeros(total, dtype=bool)
    chosen[order[:count]] = True
    records = tokenized.records
    return (
        TokenizedSplit(records.select(np.flatnonzero(~chosen)), data, tokenizer),
        TokenizedSplit(records.select(np.flatnonzero(chosen)), data, tokenizer),
    )


def _splits(
    data: Mapping[str, Any], tokenizer: Any, *, validation: bool = True
) -> tuple[TokenizedSplit, TokenizedSplit | None]:
    held = data["validation"]
    _, train = _checked_split(
        data,
        tokenizer,
        source_key="dataset.source",
        source=data["source"],
        split_key="dataset.split",
        split=data["split"],
    )
    if held["held_out"] is not None:
        return _held_out(train, held["held_out"], held["seed"], data, tokenizer)
    if not validation or (held["source"] is None and held["split"] is None):
        return train, None
    # A separate source, or a named split of the training source.
    if held["source"] is not None:
        source_key, source = "dataset.validation.source", held["source"]
    else:
        source_key, source = "dataset.source", data["source"]
    _, checked = _checked_split(
        data,
        tokenizer,
        source_key=source_key,
        source=source,
        split_key="dataset.validation.split",
        split=held["split"],
    )
    return train, checked


# ---- what the recipe, the checks and eval read ----------------------------------------------
def train_dataset(data: Mapping[str, Any], tokenizer: Any) -> Dataset:
    """The training split (the recipe's `dataset` section), packed when dataset.packing."""
    train, _ = _splits(data, tokenizer, validation=False)
    if not data["packing"]:
        return train
    return PackedDataset(
        train,
        max_seq_len=data["max_seq_len"],
        padding_idx=tokenizer.pad_id,
        split_across_pack=False,
    )


def validation_dataset(data: Mapping[str, Any], tokenizer: Any) -> TokenizedSplit | None:
    """The validation split (never packed), or None when the dataset has none."""
    _, validation = _splits(data, tokenizer)
    return validation


def check_datasets(data: Mapping[str, Any], tokenizer: Any) -> dict[str, int]:
    """Reads and checks every split whole; records per split. Raises one UserError if not."""
    train, validation = _splits(data, tokenizer)
    found = {"train": len(train)}
    if validation is not None:
        found["validation"] = len(validation)
    return found


def collate(
    samples: list[dict[str, Any]], *, packed: bool, padding_idx: int, on_cuda: bool = False
) -> dict[str, Any]:
    """A batch whose labels are each position's next token (packs add mask and input_pos).

    Every sample starts with a masked token (BOS), so a pack's shifted labels never cross from
    one sample into the next. A pack's block-causal mask is a flex-attention BlockMask for a
    model on a (recent) GPU, else a dense mask for SDPA, which the CPU runs.
    """
    if packed:
        batch = padded_collate_packed(samples)
        if not on_cuda:
            batch["mask"] = create_block_causal_mask([s["seq_lens"] for s in samples])
    else:
        batch = padded_collate_sft(
            samples, padding_idx=padding_idx, ignore_idx=CROSS_ENTROPY_IGNORE_IDX
        )
    labels = batch["labels"]
    ignore = torch.full((labels.shape[0], 1), CROSS_ENTROPY_IGNORE_IDX, dtype=labels.dtype)
    batch["labels"] = torch.hstack((labels[:, 1:], ignore))
    return batch


@dataclass(frozen=True)
class EvalPrompt:
    """A held-out prompt and the answer the model should give."""

    tokens: list[int]
    reference: str


def eval_prompts(dataset: TokenizedSplit, tokenizer: Any, limit: int) -> list[EvalPrompt]:
    """The first `limit` records of a split as generation prompts with their references.

    Plain text has no answer to compare: no prompts.
    """
    transform = dataset.message_transform
    prompts = []
    if dataset.kind == "text":
        return prompts
    for index in range(min(limit, len(dataset))):
        sample = dataset.records[index]
        if dataset.kind == "instruct":
            prompt, reference = transform.prompt_messages(sample), transform.reference(sample)
        else:
            messages, answer = transform.prompt_and_answer(sample)
            prompt, reference = messages, answer.text_content
        prompts.append(EvalPrompt(tokenizer.generation_prompt(prompt), reference))
    return prompts
