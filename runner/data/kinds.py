"""The kinds of record (dataset.kind), their columns and the two conversation styles.

- instruct: instruction (+ input) -> output, as [system?, user, assistant] chat messages;
- chat: a column of conversations, OpenAI style [{role, content}] or ShareGPT [{from, value}];
- text: plain text where every token trains (completion data; format=text reads a line a record);
- preference: a prompt and two answers to it, the chosen and the rejected (method=dpo); each
  answer is text, or a conversation that ends in it (runner.data.preference).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

KINDS = ("instruct", "chat", "text", "preference")
# Our column names per kind (dataset.column_map maps them to the file's): whether required.
COLUMNS: dict[str, dict[str, bool]] = {
    "instruct": {"instruction": True, "input": False, "output": True},
    "chat": {"messages": True},
    "text": {"text": True},
    "preference": {"prompt": False, "chosen": True, "rejected": True},
}
# The kinds that supervised methods (full, lora, qlora) train on; preference methods (dpo,
# lora_dpo, qlora_dpo) take only kind=preference.
SFT_KINDS = ("instruct", "chat", "text")


def required_column(column_map: Mapping[str, str | None], ours: str) -> str:
    """The file's column for one of ours that the kind requires (never null: the checks of
    runner.data.checks refuse a split that leaves it unmapped before anything reads it)."""
    theirs = column_map[ours]
    assert theirs is not None, f"dataset.column_map.{ours} is required"
    return theirs


@dataclass(frozen=True)
class ConversationStyle:
    """How a chat record spells a message: its two keys and its role names -> ours.

    parts: whether content may be a list of {"type": "text", "text": ...} parts (OpenAI's).
    speaker: the key of a message that names its speaker (OpenAI's `name`), which reaches the
    chat template; None where the style has none.
    tool_roles, tool_keys: the roles and keys of a message that spell tool calls and their
    results, valid in the format but not trained (refused as unsupported, not as malformed).
    """

    role: str
    content: str
    roles: dict[str, str]
    parts: bool
    speaker: str | None
    tool_roles: tuple[str, ...]
    tool_keys: tuple[str, ...]


CONVERSATION_STYLES = {
    "openai": ConversationStyle(
        "role",
        "content",
        {"system": "system", "user": "user", "assistant": "assistant"},
        parts=True,
        speaker="name",
        tool_roles=("tool", "function"),
        tool_keys=("tool_calls", "function_call"),
    ),
    "sharegpt": ConversationStyle(
        "from",
        "value",
        {"system": "system", "human": "user", "gpt": "assistant"},
        parts=False,
        speaker=None,
        tool_roles=("function_call", "observation"),
        tool_keys=(),
    ),
}
