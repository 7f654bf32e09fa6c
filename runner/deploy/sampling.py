"""How the engine picks each running row's next token, on the device, all rows at once: greedy
at temperature 0, else a draw from the row's distribution over the temperature, cut to its
top_k most likely tokens where top_k is set, then to its top_p nucleus where top_p is below 1
(vLLM's order).

A draw is the one torch.multinomial makes for one sample (the argmax of p / q, q ~ Exp(1)): a
seeded request's rows draw q from generators of their own, so the same seed gives the same
tokens whatever runs beside them; the other rows draw theirs from the device's generator, in one
draw. torch.multinomial also reads each row's probabilities back to check them, two waits for a
GPU a row and step, which would undo the engine running a step ahead of it (engine.py): here a
row whose probabilities are not a distribution gets SAMPLING_FAILED, and fails alone when the
host reads the step's tokens.
"""

from __future__ import annotations

import torch

from runner.devices import to_device

# The token a row gets when its probabilities are not a distribution; the row fails alone.
SAMPLING_FAILED = -1
NOT_A_DISTRIBUTION = (
    "the probabilities of its next token are not a distribution (nan or inf: a temperature "
    "too small for the model's logits?)"
)


def next_tokens(
    logits: torch.Tensor,
    *,
    temperatures: list[float],
    top_ps: list[float],
    generators: list[torch.Generator | None],
    top_ks: list[int] | None = None,
) -> torch.Tensor:
    """Each row's next token from its logits [rows, vocab], on their device (SAMPLING_FAILED
    where the row's probabilities are not a distribution); `generators`: each row's own, or
    None to draw from the device's; `top_ks`: each row's top_k (0: every token; None: all 0)."""
    rows = [row for row, temperature in enumerate(temperatures) if temperature > 0]
    if not rows:
        return logits.argmax(dim=-1)
    device = logits.device
    # Few operations a step, each a launch on a GPU: every row sampled (as clients ask by
    # default) needs no greedy tokens and no indexing, one temperature no tensor of them.
    # Indices and values reach the device from pinned memory: a Python list as an index,
    # copied from pageable memory, would wait for every kernel queued.
    every = len(rows) == logits.shape[0]
    index = None if every else to_device(torch.tensor(rows), device)
    scaled = (logits if index is None else logits[index]).float()
    if len({temperatures[row] for row in rows}) == 1:
        scaled = scaled / temperatures[rows[0]]
    else:
        temperature = torch.tensor([temperatures[row] for row in rows])
        scaled = scaled / to_device(temperature, device)[:, None]
    vocabulary = logits.shape[-1]
    top_k = [top_ks[row] for row in rows] if top_ks else []
    if any(0 < k < vocabulary for k in top_k):  # a top_k past the vocabulary keeps every token
        cut = [position for position, k in enumerate(top_k) if 0 < k < vocabulary]
        at = to_device(torch.tensor(cut), device)
        scaled[at] = top_k_logits(scaled[at], [top_k[i] for i in cut])
    top_p = [top_ps[row] for row in rows]
    probs = scaled.softmax(dim=-1)
    if any(p < 1 for p in top_p):  # top_p 1 keeps every token: only the others are sorted
        nucleus = [position for position, p in enumerate(top_p) if p < 1]
        at = to_device(torch.tensor(nucleus), device)
        probs[at] = nucleus_probabilities(scaled[at], [top_p[i] for i in nucleus])
    q = torch.empty_like(probs).exponential_()
    for position, row in enumerate(rows):
        generator = generators[row]
        if generator is not None:
            q[position].exponential_(generator=generator)
    drawn = (probs / q).argmax(dim=-1)
    # A softmax is never negative and sums to 1, unless an infinite logit made it nan.
    drawn = torch.where(probs.sum(dim=-1).isfinite(), drawn, SAMPLING_FAILED)
    if index is None:
        return drawn
    next_ids = logits.argmax(dim=-1)
    next_ids[index] = drawn
    return next_ids


def top_k_logits(scaled: torch.Tensor, top_k: list[int]) -> torch.Tensor:
    """Each row's logits with all but its `top_k` most likely tokens masked out (-inf); tokens
    tied with the k-th stay, as vLLM and transformers' TopKLogitsWarper keep them."""
    most_likely = scaled.topk(max(top_k), dim=-1).values
    kth = most_likely.gather(1, to_device(torch.tensor(top_k) - 1, scaled.device)[:, None])
    return scaled.masked_fill(scaled < kth, float("-inf"))


def nucleus_probabilities(scaled: torch.Tensor, top_p: list[float]) -> torch.Tensor:
    """The probabilities of each row's smallest set of most likely tokens that covers its top_p
    (the most likely always in it), from its logits over the temperature."""
    sorted_logits, order = scaled.sort(dim=-1, descending=True)
    sorted_probs = sorted_logits.softmax(dim=-1)
    cover = to_device(torch.tensor(top_p), scaled.device)[:, None]
    # Drop a token when the more likely ones already cover top_p (reach it, as transformers'
    # TopPLogitsWarper and vLLM count: 0.5 and 0.5 at top_p 0.5 keep one).
    drop = sorted_probs.cumsum(dim=-1) - sorted_probs >= cover
    drop[:, 0] = False  # a top_p that rounds to 0 in float32 (1e-50) keeps the most likely
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(scaled).scatter_(1, order, sorted_logits.softmax(dim=-1))


def token_logprobs(
    logits: torch.Tensor, tokens: torch.Tensor, rows: list[int], top: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For `rows` of `logits` [rows, vocab]: the log probability of each row's token in
    `tokens`, and the `top` most likely tokens' log probabilities and ids, most likely first;
    the model's own distribution (no temperature, no top_p), as vLLM reports it by default."""
    index = to_device(torch.tensor(rows), logits.device)
    log_probs = logits[index].float().log_softmax(dim=-1)
    # A row that failed to sample (SAMPLING_FAILED) fails alone; its figures are not read.
    chosen = log_probs.gather(1, tokens[index].clamp(min=0)[:, None])[:, 0]
    values, ids = log_probs.topk(min(top, log_probs.shape[-1]), dim=-1)
    return chosen, values, ids
