"""Validation records as generation prompts, with the answers they should get."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from runner.data.transforms import TokenizedSplit


@dataclass(frozen=True)
class EvalPrompt:
    """A held-out prompt and the answer the model should give."""

    tokens: list[int]
    reference: str


def eval_prompts(dataset: TokenizedSplit, tokenizer: Any, limit: int) -> list[EvalPrompt]:
    """The first `limit` records of a split as generation prompts with their references.

    Plain text has no answer to compare, nor a preference pair a single reference: no prompts.
    """
    transform = dataset.message_transform
    prompts = []
    if dataset.kind not in ("instruct", "chat"):
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
