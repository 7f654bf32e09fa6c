"""Instruction datasets: alpaca-format records -> chat messages -> torchtune's SFTDataset."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from datasets.exceptions import DatasetGenerationError

from runner.errors import UserError
from runner.tune import Message, SFTDataset

REQUIRED_COLUMNS = ("instruction", "output")
# dataset.format -> the `datasets` builder that reads it ("json" reads .json and .jsonl alike).
FORMATS = ("json", "csv", "parquet", "arrow")


class InstructToMessages:
    """One record -> [system?, user (instruction, then input if any), assistant (output)]."""

    def __init__(
        self, column_map: dict[str, str], train_on_input: bool, new_system_prompt: str | None
    ) -> None:
        self.column_map = column_map
        self.train_on_input = train_on_input
        self.new_system_prompt = new_system_prompt

    def user_text(self, sample: dict[str, Any]) -> str:
        instruction = sample[self.column_map["instruction"]]
        extra = sample.get(self.column_map.get("input", "input")) or ""
        return f"{instruction}\n{extra}" if extra else instruction

    def prompt_messages(self, sample: dict[str, Any]) -> list[Message]:
        """The messages before the answer: what a user would send for this record."""
        messages = []
        if self.new_system_prompt:
            messages.append(Message(role="system", content=self.new_system_prompt, masked=True))
        user = Message(role="user", content=self.user_text(sample), masked=not self.train_on_input)
        return [*messages, user]

    def __call__(self, sample: dict[str, Any]) -> dict[str, Any]:
        answer = Message(role="assistant", content=sample[self.column_map["output"]], masked=False)
        return {"messages": [*self.prompt_messages(sample), answer]}


@dataclass(frozen=True)
class EvalPrompt:
    """A held-out prompt and the answer the model should give."""

    tokens: list[int]
    reference: str


def check_data_file(key: str, path: str) -> None:
    """A UserError naming `key` unless `path` is a file."""
    if not Path(path).is_file():
        raise UserError(key, path, f"no such file; give the path of a data file ({FORMATS})")


def build_dataset(
    *,
    data_format: str,
    data_files: str,
    files_key: str,
    column_map: dict[str, str],
    train_on_input: bool,
    new_system_prompt: str | None,
    tokenizer: Any,
) -> SFTDataset:
    """Loads one split through torchtune's SFTDataset, checking files and columns first."""
    check_data_file(files_key, data_files)
    transform = InstructToMessages(column_map, train_on_input, new_system_prompt)
    try:
        dataset = SFTDataset(
            source=data_format,
            data_files=data_files,
            split="train",
            message_transform=transform,
            model_transform=tokenizer,
        )
    except DatasetGenerationError as err:
        cause = err.__cause__ or err
        raise UserError(
            files_key, data_files, f"could not be read as dataset.format={data_format} ({cause})"
        ) from err
    columns = dataset._data.column_names
    for ours in REQUIRED_COLUMNS:
        theirs = column_map[ours]
        if theirs not in columns:
            raise UserError(
                f"dataset.column_map.{ours}",
                theirs,
                f"{data_files} has no column {theirs!r}; its columns are {columns}; "
                f"map it with dataset.column_map.{ours}=<column>",
            )
    if len(dataset) == 0:
        raise UserError(files_key, data_files, "the file holds no records")
    return dataset


def eval_prompts(dataset: SFTDataset, tokenizer: Any, limit: int) -> list[EvalPrompt]:
    """The first `limit` records of a split as generation prompts with their references."""
    transform: InstructToMessages = dataset._message_transform
    prompts = []
    for sample in dataset._data.select(range(min(limit, len(dataset)))):
        tokens = tokenizer.generation_prompt(transform.prompt_messages(sample))
        prompts.append(EvalPrompt(tokens, sample[transform.column_map["output"]]))
    return prompts
