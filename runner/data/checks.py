"""Checks on a split's records: columns, cell types, conversations (runner.data.conversations),
something left to train on.

Each problem is one UserError naming the file, the row (counting records from 1) and the column.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from runner.data.conversations import Roles, conversation_problem, describe, template_problem
from runner.data.files import open_data
from runner.data.kinds import COLUMNS, CONVERSATION_STYLES
from runner.data.preference import SIDES, PreferenceSplit, PreferenceToMessages
from runner.data.sources import Records, load_records
from runner.data.transforms import TokenizedSplit
from runner.errors import UserError
from runner.models.torchtune_boundary import CROSS_ENTROPY_IGNORE_IDX, Message

if TYPE_CHECKING:
    from runner.models.tokenizer import ChatTokenizer

log = logging.getLogger(__name__)
# The fix of a conversation the chat template refuses or renders without its system message.
_OTHER_TEMPLATE = "give model.chat_template=<a Jinja chat template file that takes it>"


class DataError(UserError):
    """Bad data in one cell: names the file, the row (from 1) and the column."""

    def __init__(
        self, key: str, value: object, *, file: str, row: int, column: str, problem: str, fix: str
    ) -> None:
        self.file, self.row, self.column = file, row, column
        where = "" if file == value else f"{file} "  # the file is the value already
        super().__init__(key, value, f"{where}row {row}, column {column!r}: {problem}; {fix}")


def _first_undecodable(values: pa.ChunkedArray) -> int:
    """The index of the first value holding a string that is not UTF-8; -1 if none does.

    Arrow's readers (JSON's among them) keep a string's bytes as the file has them; such a
    string fails only when Python decodes it, so every value is decoded here, once.
    """
    try:
        values.validate(full=True)
        return -1
    except pa.ArrowInvalid as err:
        invalid = err
    step = 1024  # decoded a block at a time; the block that fails, value by value
    for start in range(0, len(values), step):
        try:
            values.slice(start, step).to_pylist()
        except UnicodeDecodeError:
            for index in range(start, min(start + step, len(values))):
                try:
                    values.slice(index, 1).to_pylist()
                except UnicodeDecodeError:
                    return index
    raise AssertionError(f"Arrow finds the column invalid ({invalid}), Python decodes it all")


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
            return index, describe(value)
    return -1, ""


def _as_written(file: str, row: int, column: str, required: bool) -> tuple[str, int, str] | None:
    """Where a JSON-lines file's record at `row` holds text in `column` as written, though it
    was read as a number: the loader read a column of mixed kinds the way pandas does
    (datasets falls back to it), turning text that looks like a number ("5") into one. The
    first record that holds no text as written, and what it holds; None where `row` is as
    written, or the file is no JSON-lines file of this machine's."""
    try:
        with open_data(file, mode="r", encoding="utf-8") as f:  # a compressed one decompressed
            records = [json.loads(line) if line.strip() else {} for line in f]
        if isinstance(records[row - 1].get(column), str):
            for number, record in enumerate(records, 1):
                value = record.get(column) if isinstance(record, dict) else record
                if not isinstance(value, str) and (value is not None or required):
                    return file, number, describe(value)
    except (OSError, ValueError, IndexError, AttributeError):
        pass  # not JSON lines (a JSON array, parquet, CSV), or not a local file
    return None


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


def _kinds_of(columns: list[str]) -> list[str]:
    """The kinds whose required columns, under our names, a file's `columns` hold."""
    return [
        kind
        for kind, ours in COLUMNS.items()
        if all(name in columns for name, required in ours.items() if required)
    ]


def check_records(records: Records, data: Mapping[str, Any], *, key: str) -> None:
    """Columns present, every cell UTF-8 text where it holds text, and of the right type; `key`
    is the source's config key."""
    table, kind, column_map = records.table, data["kind"], data["column_map"]
    for ours, required in COLUMNS[kind].items():
        theirs = column_map[ours]
        if theirs is None and not required:
            continue
        if theirs not in table.column_names:
            fix = f"map it with dataset.column_map.{ours}=<column>"
            if not required:
                fix += f" (or dataset.column_map.{ours}=null if there is none)"
            # A chat file given as the default dataset (instruct's): mapping cannot help.
            other = next((k for k in _kinds_of(table.column_names) if k != kind), None)
            if other is not None:
                fix = f"they are those of dataset={other}: give dataset={other}, or {fix}"
            raise UserError(
                f"dataset.column_map.{ours}",
                theirs,
                f"{records.parts[0][0][0]} has no column {theirs!r}; its columns are "
                f"{table.column_names}; {fix}",
            )
        index = _first_undecodable(table.data.column(theirs))
        if index >= 0:
            file, row = records.where(index)
            raise DataError(
                key,
                records.source,
                file=file,
                row=row,
                column=theirs,
                problem="holds bytes that are not UTF-8 text",
                fix="save the file as UTF-8, or fix or drop the row",
            )
        if kind == "chat" or (kind == "preference" and ours in SIDES):
            continue  # conversations (or text): checked record by record
        index, found = _first_bad_text(table, theirs, required)
        if index >= 0:
            file, row = records.where(index)
            file, row, found = _as_written(file, row, theirs, required) or (file, row, found)
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
) -> tuple[np.ndarray, np.ndarray, list[int]]:
    """Checks every conversation; returns the bytes and messages of each one's prompt, and the
    index of the first conversation of each sequence of roles."""
    name = data["conversation_style"]
    style, column = CONVERSATION_STYLES[name], data["column_map"]["messages"]
    sizes = np.zeros(len(records.table), dtype=np.int64)
    messages = np.zeros(len(records.table), dtype=np.int64)
    values = records.table.data.column(column)
    # Plain nested Arrow reads fastest as Python lists; mixed JSON needs datasets' decoding,
    # a column of it inside a list too (a number among texts: Arrow holds '5' as JSON text, and
    # read as a list it passed for text).
    listed = pa.types.is_list(values.type) or pa.types.is_large_list(values.type)
    plain = listed and "Json(" not in repr(records.table.features[column])
    first: dict[Roles, int] = {}
    for index, conversation in enumerate(values.to_pylist() if plain else records.table[column]):
        problem, sizes[index], messages[index], roles = conversation_problem(
            conversation, style, name, data
        )
        first.setdefault(roles, index)
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
    return sizes, messages, list(first.values())


def _check_template(
    split: TokenizedSplit,
    records: Records,
    indices: list[int],
    data: Mapping[str, Any],
    tokenizer: ChatTokenizer,
    *,
    key: str,
) -> None:
    """The chat template renders the records at `indices` (one of each sequence of roles: few
    in practice) with their system message in them. Checked here, as otherwise a template's
    refusal is met when training draws such a record, ending the run there naming no row, and
    a system message it leaves out (Mistral's template writes it into the last user turn only,
    where a reply is asked for) trains no token though every served prompt holds it."""
    assert split.message_transform is not None, "instruct and chat records have messages"
    column = _prompt_columns(data["column_map"])
    for index in indices:
        messages = split.message_transform(split.records[index])["messages"]
        problem = template_problem(messages, tokenizer)
        if not problem:
            continue
        system = data["new_system_prompt"] is not None
        fix = "set dataset.new_system_prompt=null" if system else "drop such rows' system message"
        if not any(m.role == "system" for m in messages):
            fix = "fix or drop the row"
        raise DataError(
            key,
            records.source,
            **_cell(records, index, column),
            problem=problem,
            fix=f"{fix}, or {_OTHER_TEMPLATE}",
        )


def _prompt_columns(column_map: Mapping[str, str | None]) -> str:
    """The columns a sample's conversation is made of, as a DataError names them."""
    ours = ("instruction", "input", "messages")
    return ", ".join(theirs for c in ours if (theirs := column_map.get(c)))


def _check_preferences(
    records: Records, data: Mapping[str, Any], tokenizer: ChatTokenizer, *, key: str
) -> None:
    """Every record gives a chosen and a rejected conversation that end in an answer to one
    prompt, and truncation to dataset.max_seq_len leaves a token of each answer (tokenized only
    where the bytes before the answer could come near it, as _check_trainable does)."""
    max_seq_len, per_message = data["max_seq_len"], _template_tokens(tokenizer) + 2
    transform = PreferenceToMessages(
        data["column_map"], data["conversation_style"], data["new_system_prompt"]
    )
    columns = _as_python(records.table, data["column_map"])
    same = 0  # pairs whose two answers are one text: no gradient, no signal
    rendered: set[tuple[str, ...]] = set()  # the sequences of roles the template has rendered
    for index in range(len(records.table)):
        pair, problem, side = _pair(transform, {n: v[index] for n, v in columns.items()})
        if problem:
            raise DataError(
                key,
                records.source,
                **_cell(records, index, data["column_map"][side]),
                problem=problem,
                fix="fix or drop the row (dataset.column_map names the prompt, chosen and "
                "rejected columns; dataset.conversation_style the message format)",
            )
        for side, messages in pair.items():
            roles = tuple(m.role for m in messages)
            if roles in rendered:
                continue
            rendered.add(roles)
            problem = template_problem(messages, tokenizer)
            if problem:
                raise DataError(
                    key,
                    records.source,
                    **_cell(records, index, data["column_map"][side]),
                    problem=problem,
                    fix=f"drop such rows' system message, or {_OTHER_TEMPLATE}",
                )
        for side, messages in pair.items():
            before = sum(len(m.text_content.encode()) for m in messages[:-1])
            if 1 + before + len(messages) * per_message < max_seq_len - 2:
                continue
            if all(tokenizer.tokenize_messages(messages)[1]):
                raise DataError(
                    "dataset.max_seq_len",
                    max_seq_len,
                    **_cell(records, index, data["column_map"][side]),
                    problem=f"no token of the answer is left after truncation to {max_seq_len} "
                    "tokens (what comes before it fills them)",
                    fix="raise dataset.max_seq_len, shorten the prompt, or drop the row",
                )
        same += pair["chosen"][-1].text_content == pair["rejected"][-1].text_content
    if same:
        log.warning(
            "%s: %d of %d pairs have one answer as both chosen and rejected, which train "
            "nothing (their DPO gradient is zero)",
            records.source,
            same,
            len(records.table),
        )


@contextlib.contextmanager
def said_at_launch() -> Iterator[None]:
    """The data read again in a training process, once the launcher's check of it said what it
    found (runner.job.job._check_data): its warnings are not said a second time (a preference
    file's pair with one answer as both was warned of twice, 0.3 s apart)."""
    previous = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(previous)


def _cell(records: Records, index: int, column: str) -> dict[str, Any]:
    """Where record `index`'s `column` is, as DataError names it (looked up for an error)."""
    file, row = records.where(index)
    return {"file": file, "row": row, "column": column}


def _as_python(table: datasets.Dataset, column_map: Mapping[str, str | None]) -> dict[str, Any]:
    """The mapped columns, list and string ones as Python lists (read once: a row at a time
    from the table costs a conversion each); others as the table's own column."""
    columns = {}
    for name in {c for c in column_map.values() if c}:
        values = table.data.column(name)
        plain = pa.types.is_list(values.type) or pa.types.is_large_list(values.type)
        plain = plain or pa.types.is_string(values.type) or pa.types.is_large_string(values.type)
        # A Json column (mixed values) holds them as JSON text: read decoded, through the table.
        plain = plain and "Json(" not in repr(table.features[name])
        columns[name] = values.to_pylist() if plain else table[name]
    return columns


def _pair(
    transform: PreferenceToMessages, sample: Mapping[str, Any]
) -> tuple[dict[str, list[Message]], str, str]:
    """A record's chosen and rejected conversations, and the first problem with them ("" when
    there is none) with the side it is on."""
    pair: dict[str, list[Message]] = {}
    for side in SIDES:
        messages, problem = transform.messages(sample, side)
        pair[side] = messages
        if not problem and side == "rejected" and _prompt(messages) != _prompt(pair["chosen"]):
            problem = (
                "its conversation before the answer differs from the chosen one's; a pair holds "
                "two answers to one prompt"
            )
        if problem:
            return pair, problem, side
    return pair, "", SIDES[0]


def _prompt(messages: list[Message]) -> list[tuple[str, str]]:
    """A conversation before its answer, as the roles and texts that make it."""
    return [(m.role, m.text_content) for m in messages[:-1]]


def _template_tokens(tokenizer: ChatTokenizer) -> int:
    """The most tokens the chat template gives an empty conversation: an empty user and
    assistant turn (where a template writes its default system prompt: Qwen's, SmolLM2's), or
    with an empty system message before them (unless the template refuses one: Gemma's)."""
    counts = []
    for roles in (("user", "assistant"), ("system", "user", "assistant")):
        with contextlib.suppress(UserError):
            empty = [Message(role=role, content="") for role in roles]
            counts.append(len(tokenizer.tokenize_messages(empty)[0]))
    return max(counts, default=0)  # a template that takes neither refuses the data later


def _check_trainable(
    split: TokenizedSplit,
    records: Records,
    prompt_bytes: np.ndarray,
    prompt_messages: np.ndarray | int,
    data: Mapping[str, Any],
    tokenizer: ChatTokenizer,
) -> None:
    """No sample is left with nothing to train on after truncation to dataset.max_seq_len.

    That needs a prompt of about max_seq_len tokens, and a token is at least one byte of text:
    only records whose prompt bytes plus the chat template's tokens per message come near
    max_seq_len are tokenized.
    """
    max_seq_len = data["max_seq_len"]
    bound = 1 + prompt_bytes + (prompt_messages + 1) * (_template_tokens(tokenizer) + 2)
    for index in np.flatnonzero(bound >= max_seq_len - 2):
        sample = split[int(index)]
        if any(label != CROSS_ENTROPY_IGNORE_IDX for label in sample["labels"]):
            continue
        file, row = records.where(int(index))
        raise DataError(
            "dataset.max_seq_len",
            max_seq_len,
            file=file,
            row=row,
            column=_prompt_columns(data["column_map"]),
            problem=f"no token is left to train on after truncation to {max_seq_len} tokens "
            "(the prompt fills them)",
            fix="raise dataset.max_seq_len, shorten the prompt, or drop the row",
        )


def checked_split(
    data: Mapping[str, Any],
    tokenizer: ChatTokenizer,
    *,
    source_key: str,
    source: str,
    split_key: str,
    split: str,
    data_format: str,
) -> TokenizedSplit | PreferenceSplit:
    """The records of one split spec, read and checked whole, ready to tokenize on access."""
    records = load_records(
        source_key=source_key,
        source=source,
        data_format=data_format,
        split_key=split_key,
        split=split,
        xml_record=data["xml"]["record"],
    )
    if len(records.table) == 0:
        raise UserError(
            split_key, split, f"{source} has no records in this split; give a split that holds some"
        )
    checked = checked_records(records, data, tokenizer, key=source_key)
    if checked is None:
        raise UserError(
            split_key,
            split,
            f"{source} has only blank lines in this split; give a split that holds some text",
        )
    checked.parts = records.parts
    return checked


def checked_records(
    records: Records, data: Mapping[str, Any], tokenizer: ChatTokenizer, *, key: str
) -> TokenizedSplit | PreferenceSplit | None:
    """`records` checked, ready to tokenize on access; None where only blank text is left.
    `key` is the source's config key, for the messages."""
    check_records(records, data, key=key)
    kind, column_map = data["kind"], data["column_map"]
    if kind == "text":
        text = records.table.data.column(column_map["text"])
        blank = pc.equal(pc.utf8_trim_whitespace(text), "").to_numpy(zero_copy_only=False)
        records.kept = np.flatnonzero(~blank)
        records.table = records.table.select(records.kept)
        if len(records.table) == 0:
            return None
    records.table = records.table.select_columns([c for c in column_map.values() if c])
    if kind == "preference":
        _check_preferences(records, data, tokenizer, key=key)
        return PreferenceSplit(records.table, data, tokenizer)
    tokenized = TokenizedSplit(records.table, data, tokenizer)
    if kind == "chat":
        sizes, messages, firsts = _check_conversations(records, data, key=key)
        _check_template(tokenized, records, firsts, data, tokenizer, key=key)
        _check_trainable(tokenized, records, sizes, messages, data, tokenizer)
    elif kind == "instruct":
        _check_template(tokenized, records, [0], data, tokenizer, key=key)
        sizes, count = _instruct_prompts(records, data)
        _check_trainable(tokenized, records, sizes, count, data, tokenizer)
    return tokenized
