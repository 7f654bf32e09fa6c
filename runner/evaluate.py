"""Greedy generation on held-out prompts and the exact-match score of the answers."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch

from runner.data import EvalPrompt


@torch.no_grad()
def greedy_answers(
    model: torch.nn.Module,
    tokenizer: Any,
    prompts: list[list[int]],
    *,
    max_new_tokens: int,
    device: torch.device,
) -> list[str]:
    """Greedy continuations of `prompts`, cut at the first stop token.

    Prompts of equal length go through the model together, so no padding or mask is needed.
    Every rank of a sharded model must call this with the same prompts: each forward is a
    collective.
    """
    by_length: dict[int, list[int]] = defaultdict(list)
    for index, prompt in enumerate(prompts):
        by_length[len(prompt)].append(index)
    stop = torch.tensor(tokenizer.stop_tokens, device=device)
    answers: list[str] = [""] * len(prompts)
    was_training = model.training
    model.eval()
    for length in sorted(by_length):
        indices = by_length[length]
        tokens = torch.tensor([prompts[i] for i in indices], device=device)
        done = torch.zeros(len(indices), dtype=torch.bool, device=device)
        for _ in range(max_new_tokens):
            logits = model(tokens)
            last = (logits[-1] if isinstance(logits, list) else logits)[:, -1]
            next_token = last.argmax(dim=-1)
            done |= torch.isin(next_token, stop)
            tokens = torch.cat([tokens, next_token[:, None]], dim=1)
            if bool(done.all()):
                break
        for row, index in enumerate(indices):
            generated = tokens[row, length:].tolist()
            cut = next((i for i, t in enumerate(generated) if t in tokenizer.stop_tokens), None)
            answers[index] = tokenizer.decode(generated[:cut])
    model.train(was_training)
    return answers


def exact_match(
    model: torch.nn.Module,
    tokenizer: Any,
    prompts: list[EvalPrompt],
    *,
    max_new_tokens: int,
    device: torch.device,
) -> float:
    """Fraction of prompts whose greedy answer equals the reference exactly."""
    answers = greedy_answers(
        model, tokenizer, [p.tokens for p in prompts], max_new_tokens=max_new_tokens, device=device
    )
    return sum(a == p.reference for a, p in zip(answers, prompts, strict=True)) / len(prompts)
