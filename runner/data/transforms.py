"""Records -> tokenized samples (instruct and chat through messages, text directly) -> batches."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import datasets
import torch
from torch.utils.data import Dataset

from runner.data.kinds import CONVERSATION_STYLES, required_column
from runner.models.torchtune_boundary import (
    CROSS_ENTROPY_IGNORE_IDX,
    Message,
    OpenAIToMessages,
    SFTTransform,
    ShareGPTToMessages,
    padded_collate_sft,
)

if TYPE_CHECKING:
    from runner.models.tokenizer import ChatTokenizer


class InstructToMessages:
    """One record -> [system?, user (instruction, then input if any), assistant (output)]."""

    def __init__(
        self,
        column_map: Mapping[str, str | None],
        train_on_input: bool,
        new_system_prompt: str | None,
    ) -> None:
        self.instruction_column = required_column(column_map, "instruction")
        self.input_column = column_map["input"]
        self.output_column = required_column(column_map, "output")
        self.train_on_input = train_on_input
        self.new_system_prompt = new_system_prompt

    def user_text(self, sample: Mapping[str, Any]) -> str:
        """The user's message: the instruction, then the input on a line of its own if any."""
        instruction = sample[self.instruction_column]
        extra = sample[self.input_column] if self.input_column is not None else None
        return f"{instruction}\n{extra}" if extra else instruction

    def prompt_messages(self, sample: Mapping[str, Any]) -> list[Message]:
        """The messages before the answer: what a user would send for this record."""
        messages = []
        if self.new_system_prompt:
            messages.append(Message(role="system", content=self.new_system_prompt, masked=True))
        user = Message(role="user", content=self.user_text(sample), masked=not self.train_on_input)
        return [*messages, user]

    def reference(self, sample: Mapping[str, Any]) -> str:
        """The answer the record gives (its output column)."""
        return sample[self.output_column]

    def __call__(self, sample: Mapping[str, Any]) -> dict[str, Any]:
        answer = Message(role="assistant", content=self.reference(sample), masked=False)
        return {"messages": [*self.prompt_messages(sample), answer]}


class ChatToMessages:
    """A conversation -> messages through torchtune's OpenAI or ShareGPT transform; an
    assistant message of `weight` 0 (OpenAI's fine-tuning format) is masked: it stays in the
    conversation and does not train. A message's speaker (OpenAI's `name`) is kept for the
    chat template, which torchtune's transforms drop."""

    def __init__(
        self, column: str, style: str, train_on_input: bool, new_system_prompt: str | None
    ) -> None:
        self.column, self.style = column, CONVERSATION_STYLES[style]
        self.new_system_prompt = new_system_prompt
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
        """The conversation up to its last trained assistant message (its last assistant
        message, where none trains), and that message."""
        messages = self(sample)["messages"]
        answers = [i for i, m in enumerate(messages) if m.role == "assistant"]
        last = max([i for i in answers if not messages[i].masked] or answers)
        return messages[:last], messages[last]

    def __call__(self, sample: Mapping[str, Any]) -> dict[str, Any]:
        transformed = self._transform(sample)
        given = sample[self.column]
        if self.new_system_prompt is not None:  # its system messages dropped, one put first
            roles = self.style.roles
            given = [None] + [m for m in given if roles[m[self.style.role]] != "system"]
        speaker = self.style.speaker
        messages = []
        for message, source in zip(transformed["messages"], given, strict=True):
            if source is not None and source.get("weight") == 0:
                message.masked = True
            name = source.get(speaker) if source is not None and speaker else None
            messages.append(Message.named(message, name))
        transformed["messages"] = messages
        return transformed


class TextToTokens:
    """Plain text -> BOS, its tokens, EOS, cut at max_seq_len; every token but BOS trains.

    BOS is masked so that, packed after another sample, nothing learns to predict a new start.
    """

    def __init__(self, tokenizer: ChatTokenizer, column: str, max_seq_len: int) -> None:
        self.tokenizer, self.column, self.max_seq_len = tokenizer, column, max_seq_len

    def __call__(self, sample: Mapping[str, Any]) -> dict[str, Any]:
        tokens = self.tokenizer.encode(sample[self.column], add_bos=True, add_eos=True)
        tokens = tokens[: self.max_seq_len]
        return {"tokens": tokens, "mask": [True] + [False] * (len(tokens) - 1)}


class TokenizedSplit(Dataset):
    """The records of one split, tokenized on access the way torchtune's SFTDataset does.

    Each item has tokens, mask and labels (the token where it trains, else the ignore index).
    """

    # Records -> messages, for instruct and chat; None for text, which is tokenized directly.
    message_transform: InstructToMessages | ChatToMessages | None

    def __init__(
        self, records: datasets.Dataset, data: Mapping[str, Any], tokenizer: ChatTokenizer
    ) -> None:
        self.records = records
        # The rows of its source's files it holds (Records.parts), where checked_split read it.
        self.parts: list[tuple[list[str], int, int]] = []
        self.kind = data["kind"]
        column_map = data["column_map"]
        if self.kind != "text":
            # Instruct records are rendered as a one-turn chat: both need the chat template.
            tokenizer.require_chat_template()
        if self.kind == "instruct":
            self.message_transform = InstructToMessages(
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


PACK_KEYS = ("tokens", "labels", "input_pos")


def collate(
    samples: list[dict[str, Any]],
    *,
    packed: bool,
    padding_idx: int,
    padding_free: bool = False,
    row_limit: int | None = None,
    min_rows: int = 1,
) -> dict[str, Any]:
    """A batch whose labels are each position's next token (packs add input_pos).

    `packed`: the samples are PackedDataset's packs. `padding_free`: the samples are packed
    here, into as few rows as hold them (pack_rows): one row of all of them where `row_limit`
    (the longest row the model takes) allows, else rows as long as the longest sample. A
    sample's first token is never a target: in a row, the position before it is another
    sample's last token, which must not learn to predict it (padded, it has no position before
    it and is never trained either), whatever its label (a template whose trained content starts
    at position 0). The rows' attention mask is made from input_pos in the training step
    (runner.models.attention.RowAttention), in the form the model takes on its device. Where no
    two samples share a row, the batch is padded as usual: the same rows, and attention needs
    no mask.
    """
    packs = (
        pack_rows(samples, padding_idx, row_limit, min_rows)
        if padding_free and not packed
        else None
    )
    if packs is not None and len(packs) < len(samples):
        batch = {key: torch.stack([p[key] for p in packs]) for key in PACK_KEYS}
    elif packed:
        batch = {key: torch.stack([s[key] for s in samples]) for key in PACK_KEYS}
    else:
        batch = padded_collate_sft(
            samples, padding_idx=padding_idx, ignore_idx=CROSS_ENTROPY_IGNORE_IDX
        )
    labels = batch["labels"]
    if "input_pos" in batch:
        # Each sample's positions start at 0 (PackedDataset's and pack_rows' alike).
        labels = labels.masked_fill(batch["input_pos"] == 0, CROSS_ENTROPY_IGNORE_IDX)
    ignore = torch.full((labels.shape[0], 1), CROSS_ENTROPY_IGNORE_IDX, dtype=labels.dtype)
    batch["labels"] = torch.hstack((labels[:, 1:], ignore))
    return batch


def forward_parts(
    batch: dict[str, torch.Tensor], max_tokens: int | None
) -> list[dict[str, torch.Tensor]]:
    """The batch as the forward passes it runs in: runs of its rows of at most `max_tokens`
    tokens (padding included) each, at least one row each; the whole batch without a cap."""
    rows, width = batch["tokens"].shape
    if max_tokens is None or rows * width <= max_tokens:
        return [batch]
    per_part = max(1, max_tokens // width)
    return [
        {key: value[start : start + per_part] for key, value in batch.items()}
        for start in range(0, rows, per_part)
    ]


def pack_rows(
    samples: list[dict[str, Any]],
    padding_idx: int,
    row_limit: int | None = None,
    min_rows: int = 1,
) -> list[dict[str, torch.Tensor]]:
    """The samples of one batch as packs: with `row_limit` (the longest row allowed), in the
    fewest rows of at most that many tokens, and at least `min_rows` (as many as there are
    samples, where fewer), as short as first-fit decreasing packs them into (one row,
    unpadded, where all of them fit and one is asked for); without, first-fit decreasing into
    rows as long as the longest sample. Each row is padded to the fullest one's length (the
    padding one more sequence, as PackedDataset pads).

    The batch trains the same tokens as padded to its longest sample, with the same loss, in at
    most as many rows: the pad positions that padding adds are not computed.
    """
    lengths = [len(s["tokens"]) for s in samples]
    if row_limit is None:
        rows = _first_fit(lengths, max(lengths))
    else:
        rows = _fewest_rows(lengths, max(row_limit, *lengths), min(min_rows, len(lengths)))
    fills = [sum(lengths[i] for i in members) for members in rows]
    width = max(fills)
    room = [width - fill for fill in fills]
    packs = []
    for members, free in zip(rows, room, strict=True):
        seq_lens = [lengths[i] for i in members] + ([free] if free else [])
        packs.append(
            {
                "tokens": torch.tensor(
                    [t for i in members for t in samples[i]["tokens"]] + [padding_idx] * free
                ),
                "labels": torch.tensor(
                    [t for i in members for t in samples[i]["labels"]]
                    + [CROSS_ENTROPY_IGNORE_IDX] * free
                ),
                "input_pos": torch.cat([torch.arange(n) for n in seq_lens]),
                "seq_lens": torch.tensor(seq_lens),
            }
        )
    return packs


def _first_fit(lengths: list[int], capacity: int) -> list[list[int]]:
    """First-fit decreasing: the indices of `lengths` in rows of `capacity` (each length fits)."""
    rows: list[list[int]] = []
    room: list[int] = []
    for index in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        row = next((r for r, free in enumerate(room) if free >= lengths[index]), None)
        if row is None:
            rows.append([])
            room.append(capacity)
            row = len(rows) - 1
        rows[row].append(index)
        room[row] -= lengths[index]
    return rows


def _fewest_rows(lengths: list[int], limit: int, least: int = 1) -> list[list[int]]:
    """First-fit decreasing into the fewest rows of at most `limit` it manages, `least` at the
    least, at the smallest capacity (searched by bisection) that still packs into that many: a
    batch a little over the limit becomes two half rows, not a full one and a mostly padded
    one."""
    total = sum(lengths)
    count = max(least, -(-total // limit))
    while len(_first_fit(lengths, limit)) > count:
        count += 1
    low, high = max(max(lengths), -(-total // count)), limit
    while low < high:
        middle = (low + high) // 2
        if len(_first_fit(lengths, middle)) <= count:
            high = middle
        else:
            low = middle + 1
    return _first_fit(lengths, high)
