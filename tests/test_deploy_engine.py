"""The serving engine in this process (runner/deploy/engine.py), its forward passes
(decode_step.py) and its batch's buffers (kv_cache.py), on a tiny checkpoint on the CPU
(compute=cpu, fp32), against transformers' own generate."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest
import torch

from runner.deploy.decode_step import DecodeStep
from runner.deploy.engine import TransformersEngine
from runner.deploy.generation import EngineFailed, SamplingRequest
from runner.deploy.kv_cache import MIN_TOKENS, TRIM_SHARE, BatchCache
from runner.deploy.loading import load_checkpoint
from tests.serving import PROMPTS


# overlap: the host a step ahead of the device, as on CUDA (engine.py), its logic run on the CPU.
@pytest.mark.parametrize("overlap", [False, True], ids=["in-step", "overlap"])
def test_a_request_failing_inside_the_engine_fails_alone(
    tiny_checkpoint: Path, overlap: bool
) -> None:
    # Requests the server would refuse, handed to the engine directly: each fails its own
    # request while the others, running or prefilled beside it, finish as if alone.
    loaded = load_checkpoint(tiny_checkpoint, device="cpu", dtype="fp32", max_model_len=None)
    engine = TransformersEngine(loaded, max_batch_size=8, max_queue=8, overlap=overlap)

    def request(prompt_ids: list[int], temperature: float = 0.0) -> list[SamplingRequest]:
        return [SamplingRequest(prompt_ids, 30, temperature, 1.0, 0, [], 1, stream=True)]

    async def text_of(handle) -> str:
        return "".join([event.text async for event in handle.events()])

    async def together() -> list[str | BaseException]:
        events = engine.submit(request([5, 6, 7])).events()
        first = await anext(events)  # this one is decoding in the batch now
        failing = [
            engine.submit(request([5, 6], temperature=1e-50)),  # nan probabilities
            engine.submit(request([10**6])),  # no such token: its prefill fails
        ]
        beside = engine.submit(request([8, 9]))  # prefilled with the failing ones, or just after
        rest = "".join([event.text async for event in events])
        others = [text_of(beside), *(text_of(handle) for handle in failing)]
        return [first.text + rest, *await asyncio.gather(*others, return_exceptions=True)]

    async def alone() -> list[str]:
        return [await text_of(engine.submit(request(ids))) for ids in ([5, 6, 7], [8, 9])]

    try:
        running, beside, *failed = asyncio.run(together())
        assert [running, beside] == asyncio.run(alone())
    finally:
        engine.close()
    assert all(isinstance(error, EngineFailed) for error in failed), failed


# transformers renamed forward's past_key_values to cache (5.24 warns, 5.40 drops the old name):
# the engine passes the name the model takes, so the warning is an error here.
# The cases: exact, each of padded, compiled and overlap added alone, and the CUDA path's all
# three. Padded and compiled without overlap is no case of its own: its compiled layers are the
# CUDA path's, its step in time with the host is exact-compiled's, and it cost a compile.
@pytest.mark.filterwarnings("error:.*past_key_values.*:FutureWarning")
@pytest.mark.parametrize(
    ("padded", "compiled", "overlap"),
    [
        (False, False, False),
        (True, False, False),
        pytest.param(False, True, False, marks=pytest.mark.long),  # compiles
        (True, False, True),
        pytest.param(True, True, True, marks=pytest.mark.long),  # compiles
    ],
    ids=["exact", "padded", "exact-compiled", "padded-overlap", "cuda-path"],
)
def test_rows_joining_and_leaving_answer_as_generate_alone(
    tiny_checkpoint, generate_reference, padded, compiled, overlap, caplog
) -> None:
    # compute=cpu, dtype=fp32. padded=True is the CUDA path's step (the batch rounded up to
    # buckets of rows and tokens, which CUDA graphs replay) with the graphs off: the padding
    # rows and columns must change no answer; compiled, the step inductor fuses (the CPU's with
    # compile=true; padded, as a CUDA graph would capture it) must neither, and it compiles
    # as the engine starts, never after; overlap, the host a step ahead of the device (a
    # finished row computed once more), must neither. Prompts of several lengths arrive in two
    # waves, the second while the first decodes, and finish at different lengths.
    import torch._dynamo
    from torch._dynamo.utils import counters

    tokenizer, generate = generate_reference
    loaded = load_checkpoint(tiny_checkpoint, device="cpu", dtype="fp32", max_model_len=None)
    torch._dynamo.reset()  # compiled: no graph left by another test's engine
    counters.clear()
    engine = TransformersEngine(
        loaded,
        max_batch_size=4,
        max_queue=16,
        cuda_graphs=False,
        padded=padded,
        compile=compiled,
        overlap=overlap,
    )
    graphs = dict(counters["stats"])  # compiled: what the engine's warm-up compiled
    # Long prompts first, short ones after, at most 4 rows: the short ones take the buffers'
    # rows where long ones were, with what those left behind still there.
    texts = [PROMPTS[3] + " and" * i for i in range(4)] + [PROMPTS[i % 3] for i in range(6)]
    cases = [(tokenizer(text)["input_ids"], 4 + 5 * i) for i, text in enumerate(texts)]

    async def text_of(handle) -> str:
        return "".join([event.text async for event in handle.events()])

    async def waves() -> list[str]:
        def submit(ids: list[int], max_tokens: int):
            return engine.submit([SamplingRequest(ids, max_tokens, 0.0, 1.0, 0, [], 1, False)])

        first = [submit(*case) for case in cases[:4]]
        # The shortest has left the batch; the second wave takes its row and joins the rest.
        shortest = await text_of(first[0])
        texts = await asyncio.gather(*(text_of(submit(*case)) for case in cases[4:]))
        return [shortest, *await asyncio.gather(*map(text_of, first[1:])), *texts]

    try:
        texts = asyncio.run(waves())
    finally:
        engine.close()
    assert texts == [generate(*case)[0] for case in cases]
    # No sequence failed on the way (overlap: a finished one's extra token is dropped, not
    # recorded, which would fail it alone after its answer went out).
    assert not [record for record in caplog.records if record.levelno >= logging.ERROR]
    if compiled:  # compiled as the engine started, into graphs never broken, and never again
        assert not counters["graph_break"], dict(counters["graph_break"])
        assert graphs["unique_graphs"] == 3 and dict(counters["stats"]) == graphs, graphs


@pytest.mark.parametrize("overlap", [False, True], ids=["in-step", "overlap"])
def test_waiting_sequences_join_a_running_batch_together_and_answer_as_generate(
    tiny_checkpoint, generate_reference, overlap
) -> None:
    # compute=cpu, dtype=fp32. With waiting_served_ratio 2, one request running holds a second
    # back until a third waits too (max_waiting_steps far off): they join in one prefill, and
    # the delay changes no answer.
    tokenizer, generate = generate_reference
    loaded = load_checkpoint(tiny_checkpoint, device="cpu", dtype="fp32", max_model_len=None)
    engine = TransformersEngine(
        loaded,
        max_batch_size=4,
        max_queue=16,
        max_waiting_steps=10_000,
        waiting_served_ratio=2,
        overlap=overlap,
    )
    prefills = []
    prefill = engine.decode_step.prefill

    def counted(prompts: list[list[int]]):
        prefills.append(len(prompts))
        return prefill(prompts)

    engine.decode_step.prefill = counted  # type: ignore[method-assign]
    cases = [
        (tokenizer(PROMPTS[i])["input_ids"], tokens) for i, tokens in ((3, 200), (1, 8), (0, 8))
    ]
    answers = [generate(*case) for case in cases]
    assert answers[0][1] == 200  # no end of sequence: the first runs while the others arrive

    def submit(ids: list[int], max_tokens: int, stream: bool = False):
        return engine.submit([SamplingRequest(ids, max_tokens, 0.0, 1.0, 0, [], 1, stream)])

    async def text_of(handle) -> str:
        return "".join([event.text async for event in handle.events()])

    async def arrivals() -> list[str]:
        events = submit(*cases[0], stream=True).events()
        running = [(await anext(events)).text]
        second = submit(*cases[1])
        for _ in range(10):  # ten more tokens of the first: the second is still waiting
            running.append((await anext(events)).text)
        assert prefills == [1]
        third = submit(*cases[2])
        rest = [event.text async for event in events]
        return ["".join(running + rest), await text_of(second), await text_of(third)]

    try:
        texts = asyncio.run(arrivals())
    finally:
        engine.close()
    assert prefills == [1, 2]
    assert texts == [text for text, _ in answers]


def test_a_streamed_answer_comes_every_stream_interval_tokens(
    tiny_checkpoint, generate_reference
) -> None:
    # compute=cpu, dtype=fp32. With stream_interval 4, the chunks that stream_interval 1 sends
    # come together: the first at once, then every 4 tokens, then the end. The tiny model's
    # byte tokens often end inside a character, whose text waits for the token that completes
    # it, so interval 1 does not send at every token either; its stream is the reference.
    tokenizer, generate = generate_reference
    prompt = tokenizer(PROMPTS[3])["input_ids"]
    text, tokens = generate(prompt, 40)
    assert tokens == 40  # no end of sequence
    loaded = load_checkpoint(tiny_checkpoint, device="cpu", dtype="fp32", max_model_len=None)

    def stream(interval: int) -> list:
        engine = TransformersEngine(loaded, max_batch_size=1, max_queue=1, stream_interval=interval)

        async def events():
            request = SamplingRequest(prompt, 40, 0.0, 1.0, 0, [], 1, stream=True)
            return [event async for event in engine.submit([request]).events()]

        try:
            return asyncio.run(events())
        finally:
            engine.close()

    each, grouped = stream(1), stream(4)
    assert "".join(event.text for event in each) == "".join(e.text for e in grouped) == text
    assert grouped[0] == each[0]  # the first text at once
    assert grouped[-1].completion_tokens == 40 and grouped[-1].finish_reason == "length"
    sent = grouped[0].completion_tokens
    for chunk in grouped[1:-1]:
        assert chunk.completion_tokens % 4 == 0
        held = [e.text for e in each if sent < e.completion_tokens <= chunk.completion_tokens]
        assert chunk.text == "".join(held)
        sent = chunk.completion_tokens
    assert len(grouped) < len(each)


# The engine's batched, cached decode and one forward pass over the whole text sum in other
# orders: fp32 log probabilities agree to about 1e-6 on the tiny model; 1e-4 leaves room for
# other kernels (AVX2 or AVX-512) and still fails a value from the wrong position or row.
LOGPROB_TOLERANCE = 1e-4


@pytest.mark.parametrize(
    ("padded", "overlap"), [(False, False), (True, True)], ids=["exact", "padded-overlap"]
)
def test_each_token_comes_with_the_models_own_log_probabilities(
    tiny_checkpoint, padded: bool, overlap: bool
) -> None:
    # compute=cpu, dtype=fp32. Rows asking for none, for the sampled token's alone, and for it
    # with the top 3 or 5 decode in one batch (padded and a step ahead of the host, as on CUDA,
    # in the second case), greedy and sampled: each token's log probability, and its top, are
    # the model's log-softmax at that position (before temperature, as vLLM reports them).
    from transformers import LlamaForCausalLM

    loaded = load_checkpoint(tiny_checkpoint, device="cpu", dtype="fp32", max_model_len=None)
    engine = TransformersEngine(
        loaded, max_batch_size=8, max_queue=8, cuda_graphs=False, padded=padded, overlap=overlap
    )
    prompts = [loaded.tokenizer(text)["input_ids"] for text in PROMPTS]
    asked = [None, 0, 3, 5]

    def request(i: int) -> SamplingRequest:
        temperature = 0.0 if i % 2 else 1.0
        return SamplingRequest(prompts[i], 12, temperature, 1.0, i, [], 1, False, asked[i])

    async def answers() -> list[list]:
        handles = [engine.submit([request(i)]) for i in range(len(prompts))]
        return [[event async for event in handle.events()] for handle in handles]

    try:
        events = asyncio.run(answers())
    finally:
        engine.close()
    model = LlamaForCausalLM.from_pretrained(tiny_checkpoint).eval()
    for prompt, top, answer in zip(prompts, asked, events, strict=True):
        logprobs = [logprob for event in answer for logprob in event.logprobs]
        if top is None:
            assert logprobs == []
            continue
        assert len(logprobs) == answer[-1].completion_tokens  # one for each token counted
        generated = [logprob.token_id for logprob in logprobs]
        with torch.no_grad():
            logits = model(torch.tensor([prompt + generated])).logits[0, len(prompt) - 1 : -1]
        reference = logits.log_softmax(dim=-1)
        for position, logprob in enumerate(logprobs):
            expected = reference[position]
            assert abs(logprob.logprob - expected[logprob.token_id].item()) < LOGPROB_TOLERANCE
            assert len(logprob.top) == top
            values = [value for _, value in logprob.top]
            assert values == sorted(values, reverse=True)
            top_values = expected.topk(top).values.tolist() if top else []
            assert values == pytest.approx(top_values, abs=LOGPROB_TOLERANCE)
            for token_id, value in logprob.top:  # the top's tokens by id, whatever their order
                assert abs(value - expected[token_id].item()) < LOGPROB_TOLERANCE
        text = loaded.tokenizer.decode(generated, skip_special_tokens=True)
        assert text == "".join(event.text for event in answer)


def test_a_prompts_logprobs_are_the_models_own_for_each_choice(
    tiny_checkpoint, monkeypatch: pytest.MonkeyPatch
) -> None:
    # compute=cpu, dtype=fp32. A completion's echo with logprobs: each prompt token's log
    # probability given those before it (the first's None), and its top 2, taken 3 positions at
    # a time (so that the chunks' seams are crossed), on each choice's first event alone.
    from transformers import LlamaForCausalLM

    from runner.deploy import decode_step

    monkeypatch.setattr(decode_step, "PROMPT_LOGPROB_ROWS", 3)
    loaded = load_checkpoint(tiny_checkpoint, device="cpu", dtype="fp32", max_model_len=None)
    engine = TransformersEngine(loaded, max_batch_size=4, max_queue=4)
    prompt = loaded.tokenizer(PROMPTS[3])["input_ids"]
    request = SamplingRequest(prompt, 4, 1.0, 1.0, 0, [], 2, True, 2, prompt_logprobs=True)

    async def events() -> list:
        return [event async for event in engine.submit([request]).events()]

    try:
        answer = asyncio.run(events())
    finally:
        engine.close()
    firsts = []
    for index in (0, 1):  # on each choice's first event, and no other
        mine = [event for event in answer if event.index == index]
        assert not any(event.prompt_logprobs for event in mine[1:])
        firsts.append(mine[0].prompt_logprobs)
    assert firsts[0] == firsts[1]
    logprobs = firsts[0]
    assert [logprob.token_id for logprob in logprobs] == prompt
    assert logprobs[0].logprob is None and logprobs[0].top == ()
    model = LlamaForCausalLM.from_pretrained(tiny_checkpoint).eval()
    with torch.no_grad():
        reference = model(torch.tensor([prompt])).logits[0, :-1].log_softmax(dim=-1)
    for expected, logprob in zip(reference, logprobs[1:], strict=True):
        assert abs(logprob.logprob - expected[logprob.token_id].item()) < LOGPROB_TOLERANCE
        assert [value for _, value in logprob.top] == pytest.approx(
            expected.topk(2).values.tolist(), abs=LOGPROB_TOLERANCE
        )


def test_the_prefill_packs_prompts_into_shared_rows_each_with_its_own_cache(
    tiny_checkpoint,
) -> None:
    # compute=cpu dtype=fp32. Prompts of 2 to 11 tokens: their prefixes (all but the last
    # token) share rows of the longest's width under a block-diagonal mask, and each prefix's
    # keys equal those of its prompt run alone (to 1e-5: fp32 sums in another order).
    model = load_checkpoint(tiny_checkpoint, device="cpu", dtype="fp32", max_model_len=None).model
    prompts = [list(range(5, 5 + length)) for length in (11, 2, 4, 7, 3, 5)]
    with torch.inference_mode():
        prefilled = DecodeStep(model, graphs=False).prefill(prompts)
        assert prefilled.lengths == [len(prompt) - 1 for prompt in prompts]
        assert max(prefilled.rows) + 1 == 3  # rows of 10: 10 | 6 + 4 | 3 + 2 + 1
        for index, prompt in enumerate(prompts):
            alone = model(input_ids=torch.tensor([prompt[:-1]]), use_cache=True)
            row, start = prefilled.rows[index], prefilled.starts[index]
            for layer, own in zip(
                prefilled.cache.layers, alone.past_key_values.layers, strict=True
            ):
                keys = layer.keys[row, :, start : start + len(prompt) - 1]
                torch.testing.assert_close(keys, own.keys[0], atol=1e-5, rtol=1e-5)


def _batch_of(checkpoint: Path, sequences: list[list[int]], *, padded: bool):
    """The tiny checkpoint's model on the CPU (fp32), its DecodeStep, and a BatchCache holding
    `sequences` as the engine admits them, with copies of them to extend as rows decode."""
    model = load_checkpoint(checkpoint, device="cpu", dtype="fp32", max_model_len=None).model
    step = DecodeStep(model, graphs=False)
    with torch.inference_mode():
        prefilled = step.prefill(sequences)
        cache = BatchCache(prefilled.cache, padded=padded)
        cache.append_rows(prefilled, [sequence[-1] for sequence in sequences])
    return model, step, cache, [list(sequence) for sequence in sequences]


def _decode_as_alone(model, step, cache, rows: list[list[int]], steps: int) -> None:
    """`steps` greedy decode steps of the batch `cache`, whose rows hold the sequences `rows`
    (extended with each new token): each row's logits equal its sequence's run alone (to 1e-4:
    fp32 sums in another order and over padding)."""
    for _ in range(steps):
        logits = step(cache, cache.next_window())
        for row, sequence in enumerate(rows):
            alone = model(input_ids=torch.tensor([sequence])).logits[0, -1]
            torch.testing.assert_close(logits[row], alone, atol=1e-4, rtol=1e-4)
        next_ids = logits[: cache.rows].argmax(dim=-1)
        cache.advance(next_ids)
        for sequence, token in zip(rows, next_ids.tolist(), strict=True):
            sequence.append(token)


def test_rows_leaving_move_only_those_past_the_kept_count_and_trim_dead_columns(
    tiny_checkpoint,
) -> None:
    # compute=cpu dtype=fp32. Rows that leave the batch make room for the last rows (moved in
    # their places, the rest left where they are); columns that became padding in every row are
    # dropped where that narrows the window by TRIM_SHARE. Either way each row's next-token
    # logits equal its sequence's run alone (to 1e-4: fp32 sums in another order and over
    # padding).
    sequences = [list(range(5, 5 + length)) for length in (12, 3, 9, 4, 6, 2)]
    model, step, cache, rows = _batch_of(tiny_checkpoint, sequences, padded=False)
    with torch.inference_mode():
        _decode_as_alone(model, step, cache, rows, 3)
        # The two longest leave: the rest's 6 dead columns of 14 are dropped (a copy of all).
        end = cache.end
        order = cache.select_rows([1, 3, 4, 5])
        assert order == [4, 1, 5, 3]  # rows 4 and 5 take the places of 0 and 2
        assert (end - cache.end) / end >= TRIM_SHARE and cache.end == 5 + 3
        rows = [rows[old] for old in order]
        _decode_as_alone(model, step, cache, rows, 2)
        # The shortest leaves: no column is dead, the last row moves to its place, alone.
        order = cache.select_rows([0, 1, 3])
        assert order == [0, 1, 3] and cache.end == 10
        rows = [rows[old] for old in order]
        _decode_as_alone(model, step, cache, rows, 2)
        # A row as long as the first prompt joins and the oldest leaves: the one column dead in
        # every row is under TRIM_SHARE of 12 and stays; the new row moves to the oldest's place.
        joining = list(range(5, 17))
        prefilled = step.prefill([joining])
        cache.append_rows(prefilled, [joining[-1]])
        rows.append(joining)
        order = cache.select_rows([1, 2, 3])
        assert order == [3, 1, 2] and cache.end == 12
        rows = [rows[old] for old in order]
        _decode_as_alone(model, step, cache, rows, 2)


def test_padded_windows_drop_dead_columns_when_that_keeps_the_bucket(tiny_checkpoint) -> None:
    # compute=cpu dtype=fp32. Padded (the CUDA path's shapes, graphs off), a step reads its
    # whole power-of-two bucket of columns: dropping dead columns pays only where the bucket
    # shrinks or would otherwise double. The long row leaves 50 dead columns in a window of 64
    # (the smallest bucket): kept; two steps on, the window would double to 128: dropped first.
    sequences = [[5 + i % 200 for i in range(60)], list(range(5, 15))]
    model, step, cache, rows = _batch_of(tiny_checkpoint, sequences, padded=True)
    with torch.inference_mode():
        _decode_as_alone(model, step, cache, rows, 3)
        assert (cache.end, cache.window.width) == (62, MIN_TOKENS)
        assert cache.select_rows([1]) == [1] and cache.end == 62  # 50 dead columns stay
        rows = [rows[1]]
        _decode_as_alone(model, step, cache, rows, 2)
        assert cache.end == 64 and cache.window.width == MIN_TOKENS
        window = cache.next_window()  # column 64 would open a window of 128: the 50 go first
        assert (cache.end, window.width) == (14, MIN_TOKENS)
        logits = step(cache, window)
        alone = model(input_ids=torch.tensor([rows[0]])).logits[0, -1]
        torch.testing.assert_close(logits[0], alone, atol=1e-4, rtol=1e-4)


def test_eager_attention_prefills_left_padded_and_answers_as_generate(
    tiny_checkpoint, generate_reference
) -> None:
    # compute=cpu dtype=fp32. Eager attention adds the mask to the scores, so a packed (boolean,
    # block-diagonal) mask is not for it: prompts get a row each, left-padded.

    tokenizer, generate = generate_reference
    loaded = load_checkpoint(tiny_checkpoint, device="cpu", dtype="fp32", max_model_len=None)
    loaded.model.set_attn_implementation("eager")
    engine = TransformersEngine(loaded, max_batch_size=4, max_queue=16)
    cases = [(tokenizer(text)["input_ids"], 12) for text in PROMPTS]

    async def answers() -> list[str]:
        handles = [
            engine.submit([SamplingRequest(ids, tokens, 0.0, 1.0, 0, [], 1, False)])
            for ids, tokens in cases
        ]
        return ["".join([event.text async for event in handle.events()]) for handle in handles]

    try:
        prefilled = engine.decode_step.prefill([ids for ids, _ in cases])
        assert prefilled.rows == list(range(len(cases)))
        texts = asyncio.run(answers())
    finally:
        engine.close()
    assert texts == [generate(*case)[0] for case in cases]


def test_the_compiled_step_attends_grouped_keys_and_values_as_the_model_holds_them(
    tiny_checkpoint: Path,
) -> None:
    # compute=cpu, fp32. The tiny checkpoint has 2 query heads a key head. A compiled decode
    # step's attention (runner_grouped_sdpa) gives SDPA the keys and values as the cache holds
    # them, where transformers' own call under torch.compile copies them once per query head
    # (repeat_kv, the window's every key, each layer, each step); and it equals that call.
    import torch._dynamo
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from runner.deploy.decode_step import GROUPED_SDPA, grouped_sdpa

    loaded = load_checkpoint(tiny_checkpoint, device="cpu", dtype="fp32", max_model_len=None)
    DecodeStep(loaded.model, graphs=False, compiled=True)
    assert loaded.model.config._attn_implementation == GROUPED_SDPA
    attention = loaded.model.get_decoder().layers[0].self_attn
    groups = attention.num_key_value_groups
    assert groups == 2
    torch.manual_seed(0)
    rows, width, dim = 3, 9, attention.head_dim
    query = torch.randn(rows, 2 * groups, 1, dim)
    key, value = (torch.randn(rows, 2, width, dim) for _ in range(2))
    mask = torch.ones(rows, 1, 1, width, dtype=torch.bool)
    mask[0, ..., :4] = False  # a left-padded row

    def sdpa_key_heads(function):
        """Its output compiled, and the heads of the keys each SDPA call in its graph takes."""
        heads: list[int] = []

        def backend(graph: torch.fx.GraphModule, inputs: list) -> object:
            for node in graph.graph.nodes:
                if node.target is torch._C._nn.scaled_dot_product_attention:
                    heads.append(node.args[1].meta["example_value"].shape[1])
            return graph.forward

        torch._dynamo.reset()
        compiled = torch.compile(function, backend=backend, fullgraph=True)
        return compiled(attention, query, key, value, mask, scaling=attention.scaling)[0], heads

    expected, copied = sdpa_key_heads(sdpa_attention_forward)
    got, held = sdpa_key_heads(grouped_sdpa)
    assert copied == [2 * groups] and held == [2]
    # The same SDPA call on other shapes: float32 to 1e-6.
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-6)
