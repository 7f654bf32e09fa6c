"""How the engine picks each row's next token (runner/deploy/sampling.py), all rows at once, on
the CPU: the draws against torch.multinomial's."""

from __future__ import annotations

import torch

from runner.deploy.sampling import (
    SAMPLING_FAILED,
    next_tokens,
    nucleus_probabilities,
    top_k_logits,
)


def test_rows_sampled_together_draw_as_torch_multinomial_from_their_own_generators() -> None:
    # Each seeded row draws what torch.multinomial draws from its probabilities with its own
    # generator (the same exponential race, without multinomial's reads of the probabilities,
    # which on a GPU wait for it twice a row): over the whole distribution at top_p 1, over the
    # nucleus below it. A greedy row takes the argmax; a row whose probabilities are nan (a
    # temperature too small for its logits) gets SAMPLING_FAILED, and the rows beside it draw
    # as alone. A row without a generator draws from the device's.
    settings = [(0.7, 1.0), (1.0, 0.9), (0.0, 1.0), (1.3, 0.5), (1e-50, 1.0), (1.0, 1.0)]
    torch.manual_seed(0)
    logits = torch.randn(len(settings), 264) * 3
    expected = []
    for seed, (temperature, top_p) in enumerate(settings):
        if temperature == 0:
            expected.append(int(logits[seed].argmax()))
        elif temperature < 1e-30:
            expected.append(SAMPLING_FAILED)
        else:
            scaled = logits[seed : seed + 1] / temperature
            probs = nucleus_probabilities(scaled, [top_p]) if top_p < 1 else scaled.softmax(-1)
            generator = torch.Generator().manual_seed(seed)
            expected.append(int(torch.multinomial(probs[0], 1, generator=generator)))
    generators: list[torch.Generator | None] = [
        torch.Generator().manual_seed(seed) for seed in range(len(settings))
    ]
    *seeded, unseeded = next_tokens(
        torch.cat([logits, logits[:1]]),
        temperatures=[t for t, _ in settings] + [1.0],
        top_ps=[p for _, p in settings] + [1.0],
        generators=[*generators, None],
    ).tolist()
    assert seeded == expected
    assert len(set(expected)) > 3  # the draws differ: the seeds and settings matter
    assert 0 <= unseeded < logits.shape[1]


def test_the_nucleus_is_the_fewest_most_likely_tokens_that_cover_top_p() -> None:
    # Probabilities 0.5, 0.3, 0.15, 0.05: top_p 0.7 keeps the first two (0.5 alone does not
    # cover it), renormalized; top_p 0.45 keeps the first alone; 0.96 keeps all four.
    probs = torch.tensor([[0.15, 0.5, 0.05, 0.3]])
    scaled = probs.log().repeat(3, 1)
    kept = nucleus_probabilities(scaled, [0.7, 0.45, 0.96])
    torch.testing.assert_close(kept[0], torch.tensor([0.0, 0.625, 0.0, 0.375]))
    torch.testing.assert_close(kept[1], torch.tensor([0.0, 1.0, 0.0, 0.0]))
    torch.testing.assert_close(kept[2], probs[0])
    # More likely tokens that reach top_p exactly cover it: four of 0.25 at 0.5 keep two, two
    # of 0.5 keep one (each kept a token too many).
    # A top_p that rounds to 0 in float32 keeps the most likely alone (it dropped every token,
    # and the step failed on a softmax of nothing).
    alone = nucleus_probabilities(probs.log(), [1e-50])
    torch.testing.assert_close(alone[0], torch.tensor([0.0, 1.0, 0.0, 0.0]))
    for width, keeps in ((4, 2), (2, 1)):
        kept = nucleus_probabilities(torch.full((1, width), 1 / width).log(), [0.5])
        assert int((kept > 0).sum()) == keeps and float(kept.max()) == 1 / keeps


def test_a_step_whose_rows_all_sample_at_one_temperature_draws_the_same() -> None:
    # The engine's common step (every client samples, at OpenAI's default temperature): no greedy
    # tokens, no indexing, one temperature; each row still draws as torch.multinomial.
    torch.manual_seed(1)
    logits = torch.randn(4, 264) * 3
    expected = [
        int(torch.multinomial(row.softmax(-1), 1, generator=torch.Generator().manual_seed(seed)))
        for seed, row in enumerate(logits / 0.8)
    ]
    drawn = next_tokens(
        logits,
        temperatures=[0.8] * 4,
        top_ps=[1.0] * 4,
        generators=[torch.Generator().manual_seed(seed) for seed in range(4)],
    )
    assert drawn.tolist() == expected


def test_top_k_keeps_the_k_most_likely_then_top_p_takes_its_nucleus() -> None:
    # vLLM's order: the top_k cut first, then top_p's nucleus of what is left. Each seeded row
    # draws as torch.multinomial over that; top_k 1 is the argmax at any temperature, and a
    # top_k of 0 or past the vocabulary keeps every token.
    settings = [(1.5, 1, 1.0), (1.0, 3, 1.0), (1.2, 5, 0.6), (1.0, 0, 1.0), (0.9, 999, 1.0)]
    torch.manual_seed(2)
    logits = torch.randn(len(settings), 264) * 3
    expected = []
    for seed, (temperature, top_k, top_p) in enumerate(settings):
        scaled = logits[seed : seed + 1] / temperature
        if 0 < top_k < 264:
            kth = scaled.topk(top_k).values[:, -1:]
            scaled = scaled.masked_fill(scaled < kth, float("-inf"))
        probs = nucleus_probabilities(scaled, [top_p]) if top_p < 1 else scaled.softmax(-1)
        generator = torch.Generator().manual_seed(seed)
        expected.append(int(torch.multinomial(probs[0], 1, generator=generator)))
    drawn = next_tokens(
        logits,
        temperatures=[t for t, _, _ in settings],
        top_ps=[p for _, _, p in settings],
        generators=[torch.Generator().manual_seed(seed) for seed in range(len(settings))],
        top_ks=[k for _, k, _ in settings],
    ).tolist()
    assert drawn == expected
    assert drawn[0] == int(logits[0].argmax())
    top = [set(logits[row].topk(k).indices.tolist()) for row, k in ((1, 3), (2, 5))]
    assert drawn[1] in top[0] and drawn[2] in top[1]
    # Ties with the k-th value stay: of four tokens at one logit, top_k 2 keeps them all.
    tied = top_k_logits(torch.tensor([[1.0, 1.0, 1.0, 1.0, 0.0]]), [2])
    assert tied.isfinite().tolist() == [[True, True, True, True, False]]
