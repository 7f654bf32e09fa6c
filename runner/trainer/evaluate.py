"""Metrics on the validation split: loss, perplexity and token accuracy of the answer tokens,
and the exact-match score of greedy answers to held-out prompts.

The model is either backend's (runner.models.backends): torchtune's decoder or transformers'
model in runner.models.backends.transformers.CausalLM, both called as `model(tokens)` -> logits,
or a list of logits chunks along the sequence under chunked cross-entropy."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.nn.functional as F

from runner.data import EvalPrompt, Split
from runner.devices import to_device
from runner.models.attention import RowAttention

# Which way each metric is better lives in runner.rundir.metrics (no torch); re-exported here.
from runner.rundir.metrics import METRIC_MODES as METRIC_MODES
from runner.rundir.metrics import TRAINING_METRIC_MODES as TRAINING_METRIC_MODES
from runner.trainer.parallel import Placement

# The metrics of the loss pass (the rest come from generation).
LOSS_METRICS = ("eval_loss", "eval_perplexity", "eval_token_accuracy")


@torch.no_grad()
def loss_sums(
    model: torch.nn.Module,
    batches: Iterable[dict[str, torch.Tensor]],
    *,
    attention: RowAttention,
    ignore_index: int,
    device: torch.device,
) -> torch.Tensor:
    """[summed cross-entropy, correct argmax tokens, counted tokens] over `batches`, whose rows
    of several samples were laid out for `attention` (the training objective's).

    Labels are the next tokens already (shifted by the collate), with `ignore_index` where
    training ignores them too. Sums, not means, so that ranks and batches add up; float64 so
    that many batches add up without drift.
    """
    sums = torch.zeros(3, dtype=torch.float64, device=device)
    was_training = model.training
    model.eval()
    for part in batches:
        tokens, labels = (to_device(part[key], device) for key in ("tokens", "labels"))
        # Rows of several samples get their positions and the mask the model takes.
        packed = attention.inputs(part, device)
        logits = model(tokens, **packed)
        # A chunked output (for CEWithChunkedOutputLoss) is split along the sequence.
        chunks = logits if isinstance(logits, list) else [logits]
        label_chunks = labels.chunk(len(chunks), dim=1)
        for chunk, target in zip(chunks, label_chunks, strict=True):
            chunk = chunk.float()
            counted = target != ignore_index
            loss = F.cross_entropy(
                chunk.reshape(-1, chunk.size(-1)),
                target.reshape(-1),
                ignore_index=ignore_index,
                reduction="sum",
            )
            correct = ((chunk.argmax(dim=-1) == target) & counted).sum()
            sums += torch.stack([loss.double(), correct.double(), counted.sum().double()])
    model.train(was_training)
    return sums


def loss_metrics(sums: torch.Tensor) -> dict[str, float]:
    """eval_loss, eval_perplexity and eval_token_accuracy from `loss_sums` (of every rank)."""
    loss_sum, correct, tokens = sums.tolist()
    if tokens == 0:
        raise ValueError("the validation split has no answer tokens to evaluate")
    loss = loss_sum / tokens
    return {
        "eval_loss": loss,
        "eval_perplexity": math.exp(loss),
        "eval_token_accuracy": correct / tokens,
    }


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


def eval_due(
    strategy: str, *, every: int, step: int, total_steps: int, steps_per_epoch: int
) -> bool:
    """Whether eval.strategy (`no`, `steps` every `every` steps, `epoch`) asks for an
    evaluation after `step` (always after the last)."""
    if strategy == "no":
        return False
    if step == total_steps:
        return True
    if strategy == "steps":
        return step % every == 0
    return step % steps_per_epoch == 0


def validation_shares(
    validation: Split, *, max_samples: int | None, batch_size: int, place: Placement
) -> Iterator[tuple[list[Any], int]]:
    """This rank's share of the validation records, in batches of batch_size, with how many
    of each batch count.

    Batch b of rank r holds records [(b * world + r) * batch_size, ...) of the first
    eval.max_samples. Every rank runs the same number of forwards (each is a collective under
    FSDP): a rank left without records gets one record that counts for nothing.
    """
    count = len(validation)
    if max_samples is not None:
        count = min(count, max_samples)
    world = place.world_size
    for batch in range(math.ceil(count / (batch_size * world))):
        start = (batch * world + place.rank) * batch_size
        indices = range(start, min(start + batch_size, count))
        yield [validation[i] for i in indices] or [validation[0]], len(indices)


def new_best(
    best: dict[str, Any] | None, metrics: dict[str, float], *, metric: str, mode: str, step: int
) -> dict[str, Any] | None:
    """The objective's new best (metric, mode, step, value) when `metrics` of `step` beat
    `best` (mode `min` or `max`), else None."""
    value = metrics.get(metric)
    if value is None or math.isnan(value):
        return None
    if best is not None:
        better = value < best["value"] if mode == "min" else value > best["value"]
        if not better:
            return None
    return {"metric": metric, "mode": mode, "step": step, "value": value}
