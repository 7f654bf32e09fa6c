"""transformers.kv_cache_gib and max_prefill_tokens: the running batch kept within its KV
cache's memory (runner.deploy.kv_budget), and each admission's prefill within its tokens. A
tiny checkpoint served on the CPU (compute=cpu, fp32), where a bound applies only when set; the
real BatchCache runs, its reallocations watched."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from runner.deploy.engine import TransformersEngine
from runner.deploy.generation import EngineFailed, SamplingRequest
from runner.deploy.kv_budget import GIB, Joining, KvBudget
from runner.deploy.kv_cache import BatchCache, token_bytes
from runner.deploy.loading import load_checkpoint
from runner.deploy.serve import prepare
from runner.errors import UserError
from tests.serving import (
    PROMPTS,
    deploy_config,
    raw_request,
    serving,
)


class Watched:
    """The batch's buffers as the engine grows them: each allocation's capacity and bytes (the
    new buffers and, until the copy is done, the old ones beside them), and the rows of each
    decode step."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.capacities: list[tuple[int, int]] = []
        self.peaks: list[int] = []
        self.rows: list[int] = []
        allocate, next_window = BatchCache._allocate, BatchCache.next_window

        def watched_allocate(cache: BatchCache, row_capacity: int, token_capacity: int) -> None:
            old = cache.nbytes if hasattr(cache, "key_stack") else 0
            allocate(cache, row_capacity, token_capacity)
            self.capacities.append((row_capacity, token_capacity))
            self.peaks.append(old + cache.nbytes)

        def watched_window(cache: BatchCache):
            self.rows.append(cache.rows)
            return next_window(cache)

        monkeypatch.setattr(BatchCache, "_allocate", watched_allocate)
        monkeypatch.setattr(BatchCache, "next_window", watched_window)


def _token_bytes(checkpoint: Path) -> int:
    loaded = load_checkpoint(checkpoint, device="cpu", dtype="fp32", max_model_len=None)
    engine = TransformersEngine(loaded, max_batch_size=1, max_queue=1)
    try:
        return token_bytes(engine.decode_step.prefill([[0, 0]]).cache)
    finally:
        engine.close()


def _answers(engine: TransformersEngine, cases: list[tuple[list[int], int]]) -> list:
    """Each case (prompt ids, max_tokens) sent together, greedy: its text, or its error."""

    async def one(ids: list[int], max_tokens: int) -> str:
        request = SamplingRequest(ids, max_tokens, 0.0, 1.0, 0, [], 1, stream=False)
        return "".join([event.text async for event in engine.submit([request]).events()])

    async def together() -> list:
        return await asyncio.gather(*(one(*case) for case in cases), return_exceptions=True)

    return asyncio.run(together())


# padded and overlap: the CUDA path's buffers (buckets of rows and tokens) and its host a step
# ahead of the device, run on the CPU.
@pytest.mark.parametrize(
    ("padded", "overlap"),
    [(False, False), (False, True), (True, True)],
    ids=["in-step", "overlap", "cuda-path"],
)
def test_sequences_wait_for_room_in_the_kv_cache_and_answer_as_generate(
    tiny_checkpoint, generate_reference, monkeypatch, padded, overlap
) -> None:
    # Eight prompts sent together, with room for four rows of them: the rest wait for running
    # ones to finish rather than grow the buffers past the budget, and every answer is
    # generate's. Five rows would need buffers of 8 rows, twice the four rows' bytes.
    tokenizer, generate = generate_reference
    cases = [(tokenizer(PROMPTS[i % 4])["input_ids"], 20 + 5 * i) for i in range(8)]
    longest = max(len(ids) for ids, _ in cases) - 1
    steps = max(tokens for _, tokens in cases)
    budget = KvBudget(
        1.0, _token_bytes(tiny_checkpoint), padded=padded, compiled=False, overlap=overlap
    )
    limit = budget.peak(Joining(rows=4, prefix=longest, steps=steps), None, prefill_rows=4)
    watched = Watched(monkeypatch)
    loaded = load_checkpoint(tiny_checkpoint, device="cpu", dtype="fp32", max_model_len=None)
    engine = TransformersEngine(
        loaded,
        max_batch_size=8,
        max_queue=8,
        kv_cache_gib=limit / GIB,
        cuda_graphs=False,
        padded=padded,
        overlap=overlap,
    )
    try:
        answers = _answers(engine, cases)
    finally:
        engine.close()
    assert answers == [generate(*case)[0] for case in cases]
    assert max(watched.rows) == 4, watched.rows  # batched, and no more than fit
    assert max(watched.peaks) <= limit, (watched.peaks, limit)


def test_a_sequence_that_could_not_fit_alone_fails_naming_the_key(
    tiny_checkpoint, generate_reference
) -> None:
    # Room for one row of 20 tokens: a request for 200 fails at once, saying what it needs and
    # which key bounds it, while one sent beside it is answered.
    tokenizer, generate = generate_reference
    ids = tokenizer(PROMPTS[0])["input_ids"]
    budget = KvBudget(
        1.0, _token_bytes(tiny_checkpoint), padded=False, compiled=False, overlap=False
    )
    limit = budget.peak(Joining(rows=1, prefix=len(ids) - 1, steps=20), None, prefill_rows=1)
    loaded = load_checkpoint(tiny_checkpoint, device="cpu", dtype="fp32", max_model_len=None)
    engine = TransformersEngine(loaded, max_batch_size=4, max_queue=4, kv_cache_gib=limit / GIB)
    try:
        refused, answered = _answers(engine, [(ids, 200), (ids, 20)])
    finally:
        engine.close()
    assert isinstance(refused, EngineFailed)
    assert "max_tokens=200" in str(refused) and "transformers.kv_cache_gib" in str(refused)
    # In MiB, as a small cache is: it read "need 0.00 GiB ..., more than this engine's 0.00 GiB".
    need, room = re.findall(r"([\d.]+) MiB", str(refused))
    assert float(need) > float(room) == round(limit / 2**20, 2)
    assert answered == generate(ids, 20)[0]


def test_an_idle_engine_starts_a_long_sequence_in_buffers_of_its_own(
    tiny_checkpoint, generate_reference, monkeypatch
) -> None:
    # Four short sequences leave buffers of four rows behind; one long sequence fits the budget
    # in a row of its own, not in four rows as long: the idle engine lets the old buffers go.
    tokenizer, generate = generate_reference
    short = [(tokenizer(PROMPTS[i])["input_ids"], 8) for i in range(4)]
    long = (tokenizer(PROMPTS[2])["input_ids"], 200)
    budget = KvBudget(
        1.0, _token_bytes(tiny_checkpoint), padded=False, compiled=False, overlap=False
    )
    alone = budget.peak(Joining(rows=1, prefix=len(long[0]) - 1, steps=200), None, 1)
    watched = Watched(monkeypatch)
    loaded = load_checkpoint(tiny_checkpoint, device="cpu", dtype="fp32", max_model_len=None)
    engine = TransformersEngine(loaded, max_batch_size=4, max_queue=4, kv_cache_gib=alone / GIB)
    try:
        first = _answers(engine, short)
        assert max(watched.rows) == 4 and watched.capacities[-1][0] == 4
        second = _answers(engine, [long])
    finally:
        engine.close()
    assert first == [generate(*case)[0] for case in short]
    assert second == [generate(*long)[0]]
    assert watched.capacities[-1][0] == 1  # fresh buffers, one row wide
    assert max(watched.peaks) <= alone


def test_a_burst_of_prompts_is_prefilled_in_admissions_of_at_most_max_prefill_tokens(
    tiny_checkpoint, generate_reference
) -> None:
    # Eight prompts sent together into an idle engine, with room for all of them in the batch:
    # each admission prefills at most 40 prompt tokens (a prompt longer than that alone), and
    # every answer is generate's.
    tokenizer, generate = generate_reference
    cases = [(tokenizer(PROMPTS[i % 4] + " x" * i)["input_ids"], 12) for i in range(8)]
    loaded = load_checkpoint(tiny_checkpoint, device="cpu", dtype="fp32", max_model_len=None)
    engine = TransformersEngine(loaded, max_batch_size=8, max_queue=8, max_prefill_tokens=40)
    prefills: list[list[int]] = []
    prefill = engine.decode_step.prefill

    def counted(prompts: list[list[int]]):
        prefills.append([len(prompt) - 1 for prompt in prompts])
        return prefill(prompts)

    engine.decode_step.prefill = counted  # type: ignore[method-assign]
    try:
        answers = _answers(engine, cases)
    finally:
        engine.close()
    assert answers == [generate(*case)[0] for case in cases]
    assert len(prefills) > 1 and sum(map(len, prefills)) == 8, prefills
    assert all(sum(tokens) <= 40 or len(tokens) == 1 for tokens in prefills), prefills


@pytest.mark.parametrize("process", [False, True], ids=["in-process", "own-process"])
def test_the_server_answers_a_request_too_large_for_the_kv_cache_with_a_400(
    tiny_checkpoint, process
) -> None:
    # `runner deploy transformers.kv_cache_gib=...` with room for one row of 20 new tokens: 200
    # is a 400 naming the key and max_tokens, whole or streamed (the engine in the server's
    # process or in its own, across the pipe), and 8 are answered.
    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoint)
    ids = tokenizer("hi")["input_ids"]
    budget = KvBudget(
        1.0, _token_bytes(tiny_checkpoint), padded=False, compiled=False, overlap=False
    )
    limit = budget.peak(Joining(rows=1, prefix=len(ids) - 1, steps=20), None, prefill_rows=1)
    cfg = deploy_config(
        f"checkpoint={tiny_checkpoint}",
        "served_model_name=tiny",
        "port=0",
        f"transformers.kv_cache_gib={limit / GIB}",
        f"transformers.process={str(process).lower()}",
    )
    body = {"model": "tiny", "prompt": "hi", "temperature": 0}
    with serving(cfg) as url:
        status, _, payload = raw_request(
            url, "POST", "/v1/completions", json.dumps({**body, "max_tokens": 200}).encode()
        )
        _, _, streamed = raw_request(
            url,
            "POST",
            "/v1/completions",
            json.dumps({**body, "max_tokens": 200, "stream": True}).encode(),
        )
        answered, _, _ = raw_request(
            url, "POST", "/v1/completions", json.dumps({**body, "max_tokens": 8}).encode()
        )
    error = json.loads(payload)["error"]
    assert status == 400 and error["param"] == "max_tokens", (status, error)
    assert "max_tokens=200" in error["message"] and "transformers.kv_cache_gib" in error["message"]
    assert b'"param": "max_tokens"' in streamed and b"transformers.kv_cache_gib" in streamed
    assert answered == 200


@pytest.mark.parametrize("key", ["transformers.kv_cache_gib", "transformers.max_prefill_tokens"])
def test_the_memory_bounds_must_be_positive(key: str) -> None:
    with pytest.raises(UserError, match=key):
        prepare(deploy_config("checkpoint=unused", f"{key}=0"))
