"""How a request's events travel: coalesced into a stream's chunks, and across the engine's pipe.

No model here: the engine's side is played by putting events on a real RequestHandle (or a
real pipe), as an engine's deliver does.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing

import openai
import pytest

from runner.deploy.engine_process import _EngineSide
from runner.deploy.generation import ChoiceEvent, EngineFailed, RequestHandle, TokenLogprob
from runner.deploy.routes import _Answer


def _data(sent: str) -> list[dict]:
    """The JSON payloads of one write of server-sent events."""
    lines = [line for line in sent.split("\n\n") if line]
    assert all(line.startswith("data: ") for line in lines), sent
    return [json.loads(line[len("data: ") :]) for line in lines if line != "data: [DONE]"]


async def _stream(chat: bool, before: list[ChoiceEvent], after: list[ChoiceEvent]) -> list[str]:
    """The writes of a stream of two choices, `before` queued before it starts, `after` once
    it has written what arrived before."""
    handle = RequestHandle(n=2)
    for event in before:
        handle.put(event)
    writes: list[str] = []
    async for sent in _Answer("id-1", "tiny", 0, chat).stream(handle, 3, include_usage=True):
        writes.append(sent)
        if len(writes) == (2 if chat else 1):  # the role chunk first, in a chat
            for event in after:
                handle.put(event)
    return writes


@pytest.mark.parametrize("chat", [False, True], ids=["completion", "chat"])
def test_a_stream_that_fell_behind_writes_what_arrived_as_one_chunk_per_choice(chat) -> None:
    before = [
        ChoiceEvent(0, "a", None, 1),
        ChoiceEvent(1, "x", None, 1),
        ChoiceEvent(0, "b", None, 2),
        ChoiceEvent(1, "y", "stop", 2),
        ChoiceEvent(0, "c", None, 3),
    ]
    writes = asyncio.run(_stream(chat, before, [ChoiceEvent(0, "d", "length", 4)]))
    writes = writes[1:] if chat else writes
    chunks = [_data(sent) for sent in writes]
    if chat:  # as OpenAI's client reads them (its Completion type refuses finish_reason null)
        for payload in (p for write in chunks for p in write):
            openai.types.chat.ChatCompletionChunk.model_validate(payload)
    # Five events that had arrived: one write, one chunk per choice, texts joined in order.
    assert [len(write) for write in chunks] == [2, 1, 1, 0]  # then usage, then [DONE]

    def said(chunk: dict) -> tuple[int, str, str | None]:
        (choice,) = chunk["choices"]
        text = choice["delta"].get("content", "") if chat else choice["text"]
        return choice["index"], text, choice["finish_reason"]

    assert [said(chunk) for chunk in chunks[0]] == [(0, "abc", None), (1, "xy", "stop")]
    assert said(chunks[1][0]) == (0, "d", "length")
    assert chunks[2][0]["usage"]["completion_tokens"] == 4 + 2
    assert writes[-1] == "data: [DONE]\n\n"


@pytest.mark.parametrize("chat", [False, True], ids=["completion", "chat"])
def test_a_streams_logprobs_follow_its_text_into_each_chunk(chat: bool) -> None:
    """Events that arrived together are one chunk with their tokens' logprobs joined; a text
    completion's offsets count on from the text sent before; minus infinity (a token the model
    rules out) is written as OpenAI writes it, -9999.0, where JSON has no infinity."""

    def event(text: str, finish: str | None, tokens: int, *ids: int) -> ChoiceEvent:
        logprobs = tuple(TokenLogprob(i, -float(i), ((1, -1.0), (i, -float(i)))) for i in ids)
        return ChoiceEvent(0, text, finish, tokens, logprobs)

    async def run() -> list[str]:
        handle = RequestHandle(n=1)
        for queued in (event("ab", None, 2, 1, 2), event("c", None, 3, 3)):
            handle.put(queued)
        answer = _Answer("id-1", "tiny", 0, chat, token_text=lambda i: "abcd"[i - 1])
        writes = []
        async for sent in answer.stream(handle, 3, include_usage=False):
            writes.append(sent)
            if len(writes) == (2 if chat else 1):
                inf = ChoiceEvent(0, "d", "length", 4, (TokenLogprob(4, -float("inf"), ()),))
                handle.put(inf)
        return writes

    writes = asyncio.run(run())
    chunks = [chunk for sent in writes[1 if chat else 0 :] for chunk in _data(sent)]
    logprobs = [chunk["choices"][0]["logprobs"] for chunk in chunks]
    if chat:
        for chunk in chunks:
            openai.types.chat.ChatCompletionChunk.model_validate(chunk)
        assert [[t["token"] for t in lp["content"]] for lp in logprobs] == [["a", "b", "c"], ["d"]]
        assert [t["logprob"] for t in logprobs[0]["content"]] == [-1.0, -2.0, -3.0]
        assert logprobs[0]["content"][1]["top_logprobs"] == [
            {"token": "a", "logprob": -1.0, "bytes": [97]},
            {"token": "b", "logprob": -2.0, "bytes": [98]},
        ]
        assert logprobs[1]["content"] == [
            {"token": "d", "logprob": -9999.0, "bytes": [100], "top_logprobs": []}
        ]
    else:
        assert logprobs[0] == {
            "tokens": ["a", "b", "c"],
            "token_logprobs": [-1.0, -2.0, -3.0],
            "top_logprobs": [{"a": -1.0}, {"a": -1.0, "b": -2.0}, {"a": -1.0, "c": -3.0}],
            "text_offset": [0, 1, 2],
        }
        # The sampled token is always among the top, as OpenAI writes it: here alone.
        assert logprobs[1] == {
            "tokens": ["d"],
            "token_logprobs": [-9999.0],
            "top_logprobs": [{"d": -9999.0}],
            "text_offset": [3],
        }
    assert writes[-1] == "data: [DONE]\n\n"


def test_a_failure_after_queued_events_sends_them_then_the_error() -> None:
    async def run() -> list[str]:
        handle = RequestHandle(n=1)
        handle.put(ChoiceEvent(0, "a", None, 1))
        handle.put(ChoiceEvent(0, "b", None, 2))
        handle.put(EngineFailed("the step failed"))
        answer = _Answer("id-1", "tiny", 0, False)
        return [sent async for sent in answer.stream(handle, 3, include_usage=False)]

    writes = asyncio.run(run())
    assert _data(writes[0])[0]["choices"][0]["text"] == "ab"
    assert _data(writes[1])[0]["error"]["message"] == "generation failed: the step failed"
    assert writes[2:] == ["data: [DONE]\n\n"]


def test_the_engines_process_sends_no_message_for_a_step_without_events() -> None:
    server, engine = multiprocessing.Pipe()
    side = _EngineSide(engine)
    handle = RequestHandle(n=1, loop=None, request_id=7)
    side.send([])  # a step of non-streamed choices that have not finished
    assert not server.poll(0.2)
    done = ChoiceEvent(0, "hi", "stop", 1)
    side.send([(handle, done)])
    assert server.recv() == ("events", [(7, done)])
