"""What crosses from the HTTP layer to an engine and back: one request, its events, its handle."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol


class QueueFull(Exception):
    """The engine's waiting queue is full; the client should retry later."""


class EngineFailed(Exception):
    """The engine could not finish a request (it is the server's fault, not the client's)."""


class ShuttingDown(EngineFailed):
    """The server is stopping: what the engine had not finished ends here, answered 503."""

    def __init__(self, message: str = "the server is shutting down") -> None:
        super().__init__(message)  # as pickle gives it back, from the engine's process


class RequestTooLarge(EngineFailed):
    """The request needs more than the engine may hold (its KV cache's budget): the client's to
    change (fewer tokens), answered 400."""


def check_room(in_flight: int, count: int, capacity: int) -> None:
    """Whether `count` more sequences fit beside the `in_flight` ones (running or waiting) of
    an engine that holds `capacity` at once (its batch, and max_queue waiting beyond it):
    QueueFull when not now, RequestTooLarge when never."""
    if count > capacity:
        raise RequestTooLarge(
            f"the request asks for {count} sequences (its prompts times n); this server holds "
            f"{capacity} at once (its batch and max_queue): ask for fewer"
        )
    if in_flight + count > capacity:
        raise QueueFull(f"{in_flight} sequences are running or waiting")


@dataclass(frozen=True)
class SamplingRequest:
    """One prompt, already tokenized and validated, and how to sample `n` continuations of it."""

    prompt_ids: list[int]
    max_tokens: int
    temperature: float
    top_p: float
    seed: int | None
    stop: list[str]
    n: int
    stream: bool
    # The log probabilities to return with each generated token: None for none; k for the
    # sampled token's and the k most likely (0 to MAX_LOGPROBS).
    logprobs: int | None = None
    # Return the prompt's tokens' too (a completion's echo with logprobs), as many most likely.
    prompt_logprobs: bool = False
    # Draw from the top_k most likely tokens (0: every token).
    top_k: int = 0


# The most top log probabilities a request may ask for a token (vLLM's default max_logprobs).
MAX_LOGPROBS = 20


class TokenLogprob(NamedTuple):
    """One token's log probability under the model's own distribution (its logits' log-softmax,
    before temperature and top_p, as vLLM reports them by default), and the most likely tokens'
    (id, log probability) at its place, most likely first, as many as the request asked. None
    (and no top) for a prompt's first token, which nothing before it predicts."""

    token_id: int
    logprob: float | None
    top: tuple[tuple[int, float], ...]


@dataclass(frozen=True)
class ChoiceEvent:
    """New text of one choice; `finish_reason` is set on the choice's last event. `logprobs`:
    those of the tokens generated since the choice's last event, where its request asked;
    `prompt_logprobs`: its prompt's, on its first event, where its request asked."""

    index: int
    text: str
    finish_reason: str | None
    completion_tokens: int
    logprobs: tuple[TokenLogprob, ...] = ()
    prompt_logprobs: tuple[TokenLogprob, ...] = ()


@dataclass
class RequestHandle:
    """The caller's side of submitted prompts: their events, in order, and a way to cancel them."""

    n: int
    # None: the handle of an engine in a process of its own, whose events go back to the
    # server's process (runner.deploy.engine_process) and are never awaited here.
    loop: asyncio.AbstractEventLoop | None = field(default_factory=asyncio.get_running_loop)
    # Called once, on the first cancel: tells an engine in another process.
    on_cancel: Callable[[], None] | None = None
    # The server's number for the request, in an engine's process (engine_process).
    request_id: int = -1
    _queue: asyncio.Queue[ChoiceEvent | Exception] = field(default_factory=asyncio.Queue)
    _cancelled: threading.Event = field(default_factory=threading.Event)

    @property
    def cancelled(self) -> bool:
        """Whether the caller has gone away (read from the engine's thread)."""
        return self._cancelled.is_set()

    def cancel(self) -> None:
        """Stop generating for this request; safe to call more than once."""
        if self._cancelled.is_set():
            return
        self._cancelled.set()
        if self.on_cancel is not None:
            self.on_cancel()

    def put(self, event: ChoiceEvent | Exception) -> None:
        """Deliver an event; call on the handle's event loop."""
        self._queue.put_nowait(event)

    async def events(self) -> AsyncIterator[ChoiceEvent]:
        """Every event until all `n` choices have finished; raises EngineFailed on failure."""
        async for batch in self.batches():
            for event in batch:
                yield event

    async def batches(self) -> AsyncIterator[list[ChoiceEvent]]:
        """The events as `events` gives them, in lists: each waits for one event and takes every
        other that has arrived by then (a stream that falls behind the engine catches up in one
        write instead of one per token)."""
        unfinished = self.n
        while unfinished:
            arrived = [await self._queue.get()]
            while not self._queue.empty():
                arrived.append(self._queue.get_nowait())
            batch: list[ChoiceEvent] = []
            for event in arrived:
                if isinstance(event, Exception):
                    if batch:
                        yield batch
                    raise event
                unfinished -= event.finish_reason is not None
                batch.append(event)
                if not unfinished:
                    break
            yield batch


class Engine(Protocol):
    """Generates for many requests at once; `submit` is called on the server's event loop."""

    # Why it can no longer generate (its process ended), which /health reports; None while it
    # can.
    failure: str | None

    def submit(self, requests: list[SamplingRequest]) -> RequestHandle:
        """Queue prompts whose choices are numbered in order (prompt i, choice j: i * n + j).

        Raises QueueFull when the waiting queue has no room for all of them.
        """
        ...

    def close(self) -> None:
        """Fail what is still queued or running and release the engine's resources."""
        ...


def deliver(events: list[tuple[RequestHandle, ChoiceEvent | Exception]]) -> None:
    """Hand events from an engine thread to their handles, one loop callback per event loop."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[RequestHandle, ChoiceEvent | Exception]]]
    by_loop = {}
    for handle, event in events:
        assert handle.loop is not None, "an engine in this process made the handle"
        by_loop.setdefault(handle.loop, []).append((handle, event))
    for loop, batch in by_loop.items():
        try:
            loop.call_soon_threadsafe(_put_all, batch)
        except RuntimeError:  # the loop has closed: nobody is listening any more
            pass


def _put_all(batch: list[tuple[RequestHandle, ChoiceEvent | Exception]]) -> None:
    for handle, event in batch:
        handle.put(event)
