"""A conversation as the checkpoint's chat template renders it: the one rendering that training
(runner.models.tokenizer), evaluation and `runner deploy` share.

Kept apart from runner.models.tokenizer, which loads torchtune, so that the server renders chats
with the same function without importing it.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def template_message(role: str, content: str, **fields: str | None) -> dict[str, str]:
    """A message as chat templates take it, in training and in `runner deploy` alike: its role,
    its text, and each of `fields` (name, tool_call_id) that it has; one it lacks (None or
    empty) is left out, so that a template's `message.name is defined` holds only where there
    is a name."""
    return {"role": role, "content": content, **{k: v for k, v in fields.items() if v}}


def render_chat(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[dict[str, Any]],
    *,
    add_generation_prompt: bool = False,
    continue_final_message: bool = False,
    chat_template: str | None = None,
    **template_kwargs: Any,
) -> str:
    """A conversation as text, rendered by transformers' apply_chat_template; encoded without
    added special tokens it gives the model's ids."""
    text = tokenizer.apply_chat_template(
        list(messages),
        chat_template=chat_template,
        add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message,
        tokenize=False,
        **template_kwargs,
    )
    assert isinstance(text, str), "apply_chat_template(tokenize=False) renders text"
    return text


# What with_system_prompt puts before a template: its first and last statements.
_SYSTEM_PROMPT_FIRST = '{%- if not messages or messages[0]["role"] != "system" %}'
_SYSTEM_PROMPT_END = "{%- endif %}"
_CONTENT = '"content": '


def with_system_prompt(template: str, system_prompt: str) -> str:
    """`template`, rendering a chat that has no system message as if `system_prompt` were its
    first: what a checkpoint of a run trained with dataset.new_system_prompt carries, so that
    it is served the prompt it trained and was evaluated on (the template's own default
    system message, or none, otherwise)."""
    # A JSON string is a Jinja string literal: quotes, backslashes and newlines escaped.
    prompt = json.dumps(system_prompt, ensure_ascii=False)
    return (
        _SYSTEM_PROMPT_FIRST
        + f'{{%- set messages = [{{"role": "system", {_CONTENT}{prompt}}}] + messages %}}'
        + _SYSTEM_PROMPT_END
        + template
    )


@functools.cache  # asked of every chat a server renders, of a few templates
def names_role(template: str, role: str) -> bool:
    """Whether the template's code names `role` (quoted, as a comparison of a message's role
    does), with_system_prompt's prompt aside: a word of the prompt's text is no role."""
    if template.startswith(_SYSTEM_PROMPT_FIRST):
        prompt = template.index(_CONTENT) + len(_CONTENT)
        _, end = json.JSONDecoder().raw_decode(template, prompt)  # the prompt's JSON string
        template = template[end:].split(_SYSTEM_PROMPT_END, 1)[1]
    return re.search(rf"""['"]{re.escape(role)}['"]""", template) is not None
