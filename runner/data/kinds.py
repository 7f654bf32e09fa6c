"""The three kinds of record (dataset.kind), their columns and the two conversation styles.

- instruct: instruction (+ input) -> output, as [system?, user, assistant] chat messages;
- chat: a column of conversations, OpenAI style [{role, content}] or ShareGPT [{from, value}];
- text: plain text where every token trains (completion data; format=text reads a line a record).
"""

from __future__ import annotations

from dataclasses import dataclass

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
