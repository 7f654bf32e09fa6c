"""Validation records as generation prompts, with the answers they should get."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from runner.data.preference import PreferenceSplit
from runner.data.transforms import InstructToMessages, TokenizedSplit

if TYPE_CHECKING:
    from runner.models.tokenizer import ChatTokenizer


@dataclass(frozen=True)
class EvalPrompt:
    """A held-out prompt and the answer the model should give."""

    tokens: list[int]
    reference: str


def eval_prompts(
    dataset: TokenizedSplit | PreferenceSplit, tokenizer: ChatTokenizer, limit: int
) -> list[EvalPrompt]:
    """The first `limit` records of a split as generation prompts with their references.

    Plain text has no answer to compare, nor a preference pair a single reference: no prompts.
    """
    if not isinstance(dataset, TokenizedSplit) or dataset.message_transform is None:
        return []
    transform = dataset.message_transform
    prompts = []
    for index in range(min(limit, len(dataset))):
        sample = dataset.records[index]
        if isinstance(transform, InstructToMessages):
            prompt, reference = transform.prompt_messages(sample), transform.reference(sample)
        else:
            prompt, answer = transform.prompt_and_answer(sample)
            reference = answer.text_content
        prompts.append(EvalPrompt(tokenizer.generation_prompt(prompt), reference))
    return prompts
