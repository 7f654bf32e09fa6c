"""What a conversation must be to train: its messages' shape, roles, order, content, names
and weights, and how the chat template renders it; each problem as text, which runner.data.checks
names by file and row."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from jinja2 import TemplateSyntaxError

from runner.data.kinds import ConversationStyle
from runner.errors import UserError

if TYPE_CHECKING:
    from runner.models.tokenizer import ChatTokenizer
    from runner.models.torchtune_boundary import Message


def describe(value: Any) -> str:
    """A cell's value as an error names it: its kind and its first 40 characters."""
    if value is None:
        return "null"
    names = {bool: "a boolean", int: "a number", float: "a number", str: "text", list: "a list"}
    return f"{names.get(type(value), 'an object')} ({str(value)[:40]!r})"


def _message_text(content: Any, number: int, style: ConversationStyle) -> tuple[str, str]:
    """A message's content as the text that trains, and what is wrong with it ("" if nothing).

    OpenAI's list of text parts trains as its texts joined with nothing between them, as
    `runner deploy` joins them (runner.deploy.protocol.ChatMessage) and torchtune's
    Message.text_content does: train and serve see the same text.
    """
    where = f"message {number}'s {style.content!r}"
    if isinstance(content, str):
        return content, ""
    if not (style.parts and isinstance(content, list)):
        return "", f"{where} is {describe(content)}, not text"
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text":
            found = f"a part of type {kind!r}" if kind else f"the part {describe(part)}"
            return "", (
                f"{where} holds {found}; only text parts ({{'type': 'text', 'text': ...}}) are "
                "supported"
            )
        if not isinstance(part.get("text"), str):
            return "", f"{where} holds a text part whose 'text' is {describe(part.get('text'))}"
    return "".join(part["text"] for part in content), ""


# What the chat template's checks of a conversation depend on: its messages' roles, where its
# first trained answer is (answers of weight 0 before it), and which messages are named (a
# template may write a speaker's name, or refuse one), a few of them in a data file. Its weights
# whole would key almost every row of a weighted file apart (5,605 of 100k).
Roles = tuple[tuple[str, ...], int, tuple[int, ...]]


def _refused(problem: str) -> tuple[str, int, int, Roles]:
    """conversation_problem's answer for a conversation refused for `problem`."""
    return problem, 0, 0, ((), -1, ())


def conversation_problem(
    conversation: Any, style: ConversationStyle, name: str, data: Mapping[str, Any]
) -> tuple[str, int, int, Roles]:
    """What is wrong with one conversation ("" if nothing), the UTF-8 bytes and the number of
    the messages before its first trained one (its prompt), and its roles."""
    shape = f"a list of {{{style.role!r}, {style.content!r}}} messages ({name} style)"
    if not isinstance(conversation, list):
        return _refused(f"holds {describe(conversation)}, not {shape}")
    system, train_on_input = data["new_system_prompt"], data["train_on_input"]
    roles = ["system"] if system is not None else []
    first_answer, named = -1, []
    # torchtune's chat transforms train every message under train_on_input, the system's too.
    trained = bool(roles) and train_on_input
    prompt_bytes = len(system.encode()) if roles and not trained else 0
    prompt_messages, answers = len(roles), 0
    for number, message in enumerate(conversation, 1):
        if not isinstance(message, dict) or message.get(style.role) is None:
            return _refused(f"message {number} is {describe(message)}, not {shape}")
        role = message[style.role]
        tool_key = next((key for key in style.tool_keys if message.get(key)), None)
        if role in style.tool_roles or tool_key:
            spelt = f"its {tool_key!r}" if tool_key else f"{style.role}={role!r}"
            problem = f"message {number} is a tool call or its result ({spelt})"
            return _refused(f"{problem}; tool calls are not supported in training")
        if role not in style.roles:
            known = ", ".join(style.roles)
            return _refused(f"message {number} has {style.role}={role!r}; {name} roles are {known}")
        content, problem = _message_text(message.get(style.content), number, style)
        if problem:
            return _refused(problem)
        speaker = message.get(style.speaker) if style.speaker else None
        if speaker is not None and not isinstance(speaker, str):
            return _refused(
                f"message {number}'s {style.speaker!r} is {describe(speaker)}; give the "
                "speaker's name as text, or none"
            )
        ours = style.roles[role]
        if ours == "system" and system is not None:
            continue  # replaced by the new system prompt
        if ours == "system" and roles:
            return _refused(f"message {number} is a system message after the first")
        if ours == "assistant" and (not roles or roles[-1] != "user"):
            return _refused(
                f"message {number} is an assistant message that answers no user message"
            )
        if ours == "user" and roles and roles[-1] == "user":
            return _refused(f"messages {number - 1} and {number} are both user messages")
        weight = message.get("weight")
        problem = _weight_problem(weight, number, ours)
        if problem:
            return _refused(problem)
        roles.append(ours)
        if speaker:
            named.append(len(roles) - 1)
        if first_answer < 0 and ours == "assistant" and weight != 0:
            first_answer = len(roles) - 1
        answers += ours == "assistant"
        trained = trained or (ours == "assistant" and weight != 0) or train_on_input
        if not trained:
            prompt_bytes += len(content.encode())
            prompt_messages += 1
    if not trained and answers:
        return _refused("has only assistant messages of weight 0, so nothing to train on")
    if not trained:
        return _refused("has no assistant message, so nothing to train on")
    return "", prompt_bytes, prompt_messages, (tuple(roles), first_answer, tuple(named))


def _weight_problem(weight: Any, number: int, ours: str) -> str:
    """What is wrong with message `number`'s weight ("" if nothing): OpenAI's fine-tuning
    format gives an assistant message 0 (not trained) or 1, read as 0.0 or 1.0 where the file's
    other weights make its column a float one. null is no weight: the reader gives every
    message of a file the keys any of them has."""
    if weight is None:
        return ""
    if ours != "assistant":
        return (
            f"message {number} is a {ours} message with a 'weight' ({weight!r}); only an "
            "assistant message has one"
        )
    if isinstance(weight, int | float) and not isinstance(weight, bool) and weight in (0, 1):
        return ""
    return f"message {number}'s 'weight' is {describe(weight)}; give 0 (not trained) or 1"


def template_problem(messages: list[Message], tokenizer: ChatTokenizer) -> str:
    """What the chat template does wrong with a conversation ("" if nothing)."""
    roles = [m.role for m in messages]
    try:
        tokenizer.tokenize_messages(messages)
    except UserError as err:
        # A refusal of the template itself (it rewrites history; it does not compile) is no
        # row's: it stays model.chat_template's.
        if err.__cause__ is None or isinstance(err.__cause__, TemplateSyntaxError):
            raise
        cause = f"{type(err.__cause__).__name__}: {err.__cause__}"
        return f"{tokenizer.template_name} refuses a conversation of roles {roles} ({cause})"
    system = next((i for i, m in enumerate(messages) if m.role == "system"), None)
    # Up to its first trained answer: Mistral's template writes the system message into a last
    # user turn, after every answer, where no trained token sees it.
    answers = [i for i, m in enumerate(messages) if m.role == "assistant" and not m.masked]
    seen = messages[: answers[0] + 1] if answers else messages
    if system is not None and not tokenizer.renders_content(seen, system):
        return (
            f"{tokenizer.template_name} leaves the system message out of a conversation of roles "
            f"{roles}, so it would train without it (and be served with it)"
        )
    return ""
