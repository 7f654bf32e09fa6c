"""Preference records (dataset.kind=preference): a prompt, a chosen and a rejected answer.

Two layouts, as the hub's preference sets have them, mapped by dataset.column_map:

- prompt, chosen and rejected columns of text (Intel/orca_dpo_pairs' question/chosen/rejected):
  each answer becomes [system?, user (the prompt), assistant (the answer)];
- chosen and rejected columns of conversations (HuggingFaceH4/ultrafeedback_binarized): each a
  list of messages in dataset.conversation_style that ends in the assistant's answer. A prompt
  column, when mapped, is put before a conversation that holds no user message of its own.

Only the final assistant message of each conversation is scored (its tokens are the labels):
DPO compares the two answers, and what comes before them is the same on both sides.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import datasets
import torch
from torch.utils.data import Dataset

from runner.data.conversations import describe
from runner.data.kinds import CONVERSATION_STYLES, required_column
from runner.data.transforms import collate
from runner.models.torchtune_boundary import CROSS_ENTROPY_IGNORE_IDX, Message

if TYPE_CHECKING:
    from runner.models.tokenizer import ChatTokenizer

SIDES = ("chosen", "rejected")


class PreferenceToMessages:
    """One record -> {"chosen": messages, "rejected": messages}, the last message of each the
    answer that is scored (every other message masked)."""

    def __init__(
        self, column_map: Mapping[str, str | None], style: str, new_system_prompt: str | None
    ) -> None:
        self.column_map = dict(column_map)
        self.style = CONVERSATION_STYLES[style]
        self.style_name = style
        self.new_system_prompt = new_system_prompt

    def messages(self, sample: Mapping[str, Any], side: str) -> tuple[list[Message], str]:
        """The messages of one side of a record, and what is wrong with it ("" if nothing)."""
        prompt_column = self.column_map["prompt"]
        prompt = sample[prompt_column] if prompt_column is not None else None
        if prompt is not None and not isinstance(prompt, str):
            return [], f"the prompt is {describe(prompt)}, not text"
        answer = sample[required_column(self.column_map, side)]
        if isinstance(answer, str):
            if prompt is None:
                return [], (
                    "the answer is text but the record has no prompt; map the prompt column "
                    "with dataset.column_map.prompt=<column>"
                )
            turns = [("user", prompt), ("assistant", answer)]
        elif isinstance(answer, list):
            turns, problem = self._turns(answer)
            if problem:
                return [], problem
            if prompt is not None and not any(role == "user" for role, _ in turns):
                at = sum(1 for role, _ in turns if role == "system")
                turns.insert(at, ("user", prompt))
        else:
            return [], f"holds {describe(answer)}, not text or a list of messages"
        if self.new_system_prompt is not None:
            turns = [("system", self.new_system_prompt)] + [t for t in turns if t[0] != "system"]
        if turns[-1][0] != "assistant" or not any(role == "user" for role, _ in turns):
            return [], "does not end in an assistant message that answers a user message"
        last = len(turns) - 1
        return [
            Message(role=role, content=content, masked=index != last)
            for index, (role, content) in enumerate(turns)
        ], ""

    def _turns(self, conversation: list[Any]) -> tuple[list[tuple[str, str]], str]:
        style, turns = self.style, []
        for number, message in enumerate(conversation, 1):
            if not isinstance(message, dict) or message.get(style.role) not in style.roles:
                return [], (
                    f"message {number} is {describe(message)}, not a {{{style.role!r}, "
                    f"{style.content!r}}} message of the {self.style_name} style "
                    f"(roles {', '.join(style.roles)})"
                )
            content = message.get(style.content)
            if not isinstance(content, str):
                return [], f"message {number}'s {style.content!r} is {describe(content)}"
            turns.append((style.roles[message[style.role]], content))
        if not turns:
            return [], "is an empty conversation"
        return turns, ""

    def __call__(self, sample: Mapping[str, Any]) -> dict[str, list[Message]]:
        out = {}
        for side in SIDES:
            messages, problem = self.messages(sample, side)
            if problem:  # runner.data.checks refuses such records before training
                raise ValueError(f"{side}: {problem}")
            out[side] = messages
        return out


class PreferenceSplit(Dataset):
    """The records of one preference split, tokenized on access: each item holds the tokens
    and labels (the answer's tokens, else the ignore index) of the chosen and the rejected."""

    kind = "preference"

    def __init__(
        self, records: datasets.Dataset, data: Mapping[str, Any], tokenizer: ChatTokenizer
    ) -> None:
        tokenizer.require_chat_template()
        self.records, self.tokenizer = records, tokenizer
        # The rows of its source's files it holds (Records.parts), where checked_split read it.
        self.parts: list[tuple[list[str], int, int]] = []
        self.message_transform = PreferenceToMessages(
            data["column_map"], data["conversation_style"], data["new_system_prompt"]
        )

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, index: int) -> dict[str, list[int]]:
        item = {}
        for side, messages in self.message_transform(self.records[index]).items():
            tokens, mask = self.tokenizer.tokenize_messages(messages)
            item[f"{side}_tokens"] = tokens
            item[f"{side}_labels"] = [
                CROSS_ENTROPY_IGNORE_IDX if masked else token
                for token, masked in zip(tokens, mask, strict=True)
            ]
        return item


def collate_preference(samples: list[dict[str, Any]], *, padding_idx: int) -> dict[str, Any]:
    """One batch of 2 x len(samples) rows, the chosen answers first, then the rejected in the
    same order (one forward scores both, as torchtune's concatenated_forward does); labels are
    each position's next token."""
    rows = [
        {"tokens": sample[f"{side}_tokens"], "labels": sample[f"{side}_labels"]}
        for side in SIDES
        for sample in samples
    ]
    return collate(rows, packed=False, padding_idx=padding_idx)


def answer_log_probs(
    logits: torch.Tensor | list[torch.Tensor], labels: torch.Tensor, *, mean: bool = False
) -> torch.Tensor:
    """Sum over each row of the log-probability of its label tokens (ignored positions add 0);
    with `mean`, their mean over the row's label tokens (IPO's, as TRL's DPOTrainer takes it).

    `logits` may be the chunks over the sequence that a chunked-loss model returns.
    """
    chunks = logits if isinstance(logits, list) else [logits]
    label_chunks = labels.split([chunk.size(1) for chunk in chunks], dim=1)
    total = torch.zeros(labels.size(0), device=labels.device, dtype=torch.float32)
    for chunk, chunk_labels in zip(chunks, label_chunks, strict=True):
        scored = chunk_labels != CROSS_ENTROPY_IGNORE_IDX
        log_probs = torch.log_softmax(chunk.float(), dim=-1)
        picked = log_probs.gather(-1, chunk_labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
        total = total + (picked * scored).sum(dim=-1)
    if mean:
        return total / (labels != CROSS_ENTROPY_IGNORE_IDX).sum(dim=-1).clamp(min=1)
    return total
