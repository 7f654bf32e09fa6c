"""engine=transformers: continuous batching over a Hugging Face model with a shared KV cache.

One background thread owns the model. Each iteration it admits waiting sequences (one prefill
of their prompts but the last tokens, packed without padding where the attention allows, whose
KV cache is merged into the running batch), decodes one token for every running sequence in a
single forward pass (for a new sequence: its prompt's last token, whose logits give its first
new token), and drops the finished ones. A request that
arrives while others are generating joins at the next step instead of waiting for them.

On CUDA the host runs a step ahead of the GPU (`overlap`), as vLLM's async scheduling and
SGLang's overlap scheduler do: each step's sampled tokens stay on the GPU as the next step's
inputs, the next step is queued, and only then does the host read the last step's tokens,
detokenize them, send them and drop the finished sequences, while the GPU runs the step it was
given. A sequence that finished is thus computed one step more, and that token is dropped.
Read at once, the GPU would wait for the host between every two steps (at one row on an H200
the step is 2.58 ms of GPU time, and the server delivered a token every 4 ms). On the CPU,
where the host is the device, a step's tokens are read as soon as it is computed.

A failure that belongs to one request (its prefill, its sampling, its text) fails that request
alone; only a failed decode step, which all running sequences share, fails them all.
"""

from __future__ import annotations

import collections
import concurrent.futures
import functools
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from runner.deploy.decode_step import DecodeStep, Prefilled
from runner.deploy.generation import (
    ChoiceEvent,
    EngineFailed,
    RequestHandle,
    RequestTooLarge,
    SamplingRequest,
    ShuttingDown,
    TokenLogprob,
    check_room,
    deliver,
)
from runner.deploy.kv_budget import GIB, Joining, KvBudget, default_budget
from runner.deploy.kv_cache import BatchCache, token_bytes
from runner.deploy.loading import LoadedModel
from runner.deploy.sampling import (
    NOT_A_DISTRIBUTION,
    SAMPLING_FAILED,
    next_tokens,
    token_logprobs,
)
from runner.deploy.text import TextStream, steps_decode

log = logging.getLogger(__name__)

_SEED_MASK = (1 << 64) - 1
# transformers.max_batch_size: null, by device type. CUDA: vLLM's max_num_seqs (256), the batch
# kept within the KV cache's memory (kv_budget.py); on the H200 the engine alone made 7,144
# tokens/s at 32 clients and 22,319 at 128 (docs: benchmarks). CPU: 32, as before.
MAX_BATCH_SIZE_BY_DEVICE = {"cuda": 256}
CPU_MAX_BATCH_SIZE = 32
# transformers.max_prefill_tokens: null, by device type (absent: no cap). CUDA: a prefill's
# activations grow with its tokens, and 256 rows of long prompts at once would take tens of GiB
# beyond the KV cache (vLLM's max_num_batched_tokens, text-generation-inference's
# max_batch_prefill_tokens cap them alike); 16,384 holds gpu_report's 128 prompts (14,495
# tokens) in one prefill.
MAX_PREFILL_TOKENS_BY_DEVICE = {"cuda": 16384}


def max_batch_size_by_default(device: torch.device) -> int:
    """transformers.max_batch_size: null on `device`."""
    return MAX_BATCH_SIZE_BY_DEVICE.get(device.type, CPU_MAX_BATCH_SIZE)


def max_prefill_tokens_by_default(device: torch.device) -> int | None:
    """transformers.max_prefill_tokens: null on `device` (None: no cap)."""
    return MAX_PREFILL_TOKENS_BY_DEVICE.get(device.type)


@dataclass
class _Sequence:
    """One choice of one request while it waits or generates."""

    handle: RequestHandle
    index: int
    request: SamplingRequest
    text: TextStream
    generator: torch.Generator | None  # a seeded request's own; None: the device's default
    finish_reason: str | None = None
    completion_tokens: int = 0
    events: list[ChoiceEvent] = field(default_factory=list)
    # Its request asked for logprobs: those of its tokens since its last event, and its
    # prompt's (echo) until its first event.
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: tuple[TokenLogprob, ...] = ()
    error: EngineFailed | None = None  # set when this sequence alone failed


@dataclass
class _StepLogprobs:
    """A step's log probabilities for the rows whose requests asked (sampling.token_logprobs),
    on the host once the step is `ready`."""

    rows: list[int]
    chosen: torch.Tensor
    top_values: torch.Tensor
    top_ids: torch.Tensor

    def by_row(self, sequences: list[_Sequence], token_ids: list[int]) -> dict[int, TokenLogprob]:
        """Each asking row's token and the top log probabilities its request asked for."""
        chosen, values, ids = self.chosen.tolist(), self.top_values.tolist(), self.top_ids.tolist()
        by_row = {}
        for i, row in enumerate(self.rows):
            top = sequences[row].request.logprobs or 0
            most_likely = tuple(zip(ids[i][:top], values[i][:top], strict=True))
            by_row[row] = TokenLogprob(token_ids[row], chosen[i], most_likely)
        return by_row


@dataclass
class _Step:
    """A decode step given to the device: its rows' sequences, and their sampled tokens on the
    host once `ready` (a CUDA event; None: already there)."""

    sequences: list[_Sequence]
    tokens: torch.Tensor
    ready: torch.cuda.Event | None
    logprobs: _StepLogprobs | None = None  # None: no row's request asked for them


class TransformersEngine:
    """Serves one loaded model to many concurrent requests from one generation thread."""

    failure: str | None = None  # a step's error fails its requests, not the engine

    def __init__(
        self,
        loaded: LoadedModel,
        *,
        max_batch_size: int,
        max_queue: int,
        max_prefill_tokens: int | None = None,
        max_waiting_steps: int = 20,
        waiting_served_ratio: float = 0.3,
        cuda_graphs: bool | None = None,
        padded: bool | None = None,
        compile: bool = False,
        overlap: bool | None = None,
        kv_cache_gib: float | None = None,
        stream_interval: int = 1,
        engines: int = 1,
        deliver: Callable[[list[tuple[RequestHandle, ChoiceEvent | Exception]]], None] = deliver,
    ) -> None:
        """`max_prefill_tokens`: the most prompt tokens one admission prefills (None: no cap;
        a longer prompt is prefilled alone); `max_waiting_steps`, `waiting_served_ratio`: when
        waiting sequences join a running batch (conf/deploy.yaml); `cuda_graphs`: replay each
        decode step from a CUDA graph (None: on CUDA devices); `padded`: round each step's
        batch up to a bucket, as graphs need (None: with graphs); `compile`: fuse the decode
        step with torch.compile (conf/deploy.yaml); `overlap`: queue each step before reading
        the last one's tokens (None: on CUDA devices; see the module's docstring);
        `kv_cache_gib`: the memory the batch's KV cache may take (runner.deploy.kv_budget;
        None: its default on the device, shared among `engines` serving there);
        `stream_interval`: a streamed sequence's text is sent every that many tokens (its first
        text and its end at once); `deliver`:
        where each step's events go (the handles' event loops; runner.deploy.engine_process
        sends them to the server's process)."""
        self._deliver = deliver
        self._tokenizer = loaded.tokenizer
        self._step_decoding = steps_decode(loaded.tokenizer)  # text.py
        self._eos_ids = loaded.eos_token_ids
        self._device = loaded.model.device
        self._max_batch_size = max_batch_size
        self._max_prefill_tokens = max_prefill_tokens
        self._max_queue = max_queue
        self._max_waiting_steps = max_waiting_steps
        self._stream_interval = stream_interval
        self._waiting_served_ratio = waiting_served_ratio
        self._steps_waited = 0  # decode steps the waiting sequences have waited
        self._waiting: collections.deque[_Sequence] = collections.deque()
        self._wake = threading.Condition()
        self._closed = False
        self._running: list[_Sequence] = []
        graphs = self._device.type == "cuda" if cuda_graphs is None else cuda_graphs
        self._overlap = self._device.type == "cuda" if overlap is None else overlap
        self._padded = graphs if padded is None else padded
        # Compiled on the CUDA path (padded), one decoder layer for all (decode_step.py).
        self.decode_step = DecodeStep(
            loaded.model, graphs=graphs, compiled=compile, layers=self._padded
        )
        self._cache: BatchCache | None = None  # the running batch, kept while the engine idles
        self._kv_cache_gib, self._engines = kv_cache_gib, engines
        # Set on the engine's thread: the token's size as it starts, the limit as it first
        # admits (by then every engine on the device has its model loaded).
        self._budget: KvBudget | None = None
        self._token_bytes = 0
        warm_up = functools.partial(
            self.decode_step.warm_up,
            padded=self._padded,
            context=loaded.max_model_len,
            rows=max_batch_size,
        )
        started: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._thread = threading.Thread(
            target=self._loop, args=(warm_up, started), name="deploy-engine", daemon=True
        )
        self._thread.start()
        started.result()  # the step compiled (compile=true), or why it could not be

    def submit(
        self, requests: list[SamplingRequest], handle: RequestHandle | None = None
    ) -> RequestHandle:
        """Queue the prompts' sequences (under `handle`, else a new one on the running event
        loop); raises as check_room does when they do not fit beside those running or
        waiting."""
        handle = handle or RequestHandle(n=sum(request.n for request in requests))
        sequences: list[_Sequence] = []
        for request in requests:
            for choice in range(request.n):
                generator = None
                if request.seed is not None:  # its draws are its own, whatever runs beside it
                    generator = torch.Generator(device=self._device)
                    generator.manual_seed((request.seed + choice) & _SEED_MASK)
                text = TextStream(
                    self._tokenizer,
                    request.stop,
                    incremental=request.stream,
                    step_decoding=self._step_decoding,
                )
                sequences.append(_Sequence(handle, len(sequences), request, text, generator))
        with self._wake:
            if self._closed:
                raise ShuttingDown()
            # A cancelled sequence waits to be dropped at its turn: it holds no room.
            waiting = sum(not sequence.handle.cancelled for sequence in self._waiting)
            in_flight = waiting + len(self._running)
            check_room(in_flight, len(sequences), self._max_batch_size + self._max_queue)
            self._waiting.extend(sequences)
            self._wake.notify()
        return handle

    def close(self) -> None:
        """Stop the generation thread and fail whatever it had not finished."""
        with self._wake:
            self._closed = True
            self._wake.notify()
        self._thread.join()

    def _loop(self, warm_up: Callable[[], None], started: concurrent.futures.Future) -> None:
        # The step compiles on the thread that runs it: compiled on another thread, the CPU's
        # compiled step ran about 5 times slower here (0.64 against 3.0 ms at 4 rows).
        try:
            if self._device.type == "cuda":
                # This thread's current device, which graph replays, streams and events take:
                # left at cuda:0, a model on cuda:1 captured empty graphs that replayed nothing.
                torch.cuda.set_device(self._device)
            warm_up()
            if self._kv_cache_gib is not None or self._device.type == "cuda":  # a bound applies
                self._token_bytes = token_bytes(self.decode_step.prefill([[0, 0]]).cache)
        except BaseException as error:
            started.set_exception(error)
            return
        started.set_result(None)
        with torch.inference_mode():
            ahead: _Step | None = None  # overlap: the step queued whose tokens are unread
            while (admitted := self._next_admissions()) is not None:
                try:
                    if admitted:
                        self._admit(admitted)
                    step = self._decode() if self._running else None
                    if self._overlap:
                        step, ahead = ahead, step
                    if step is not None:
                        self._finish(step)
                    if not self._running:  # all it computed belongs to finished sequences
                        ahead = None
                except Exception as error:  # a shared step: fail every request in it
                    log.exception("generation step failed")
                    self._fail([*self._running, *admitted], EngineFailed(str(error)))
                    self._running = []
                    self._cache = None  # its buffers may be half-written: start afresh
                    ahead = None
        self._fail([*self._running, *self._waiting], ShuttingDown())

    def _next_admissions(self) -> list[_Sequence] | None:
        """Waiting sequences that fit in the batch now, in order; blocks while idle, None once
        closed. One that could not fit in the KV cache's budget even alone fails."""
        admitted: list[_Sequence] = []
        refused: list[_Sequence] = []
        with self._wake:
            while not self._closed and not self._running and not self._waiting:
                self._wake.wait()
            if self._closed:
                return None
            if not self._admission_due():
                self._steps_waited += 1
                return []
            self._steps_waited = 0
            prefill_tokens = 0
            while self._waiting and len(self._running) + len(admitted) < self._max_batch_size:
                sequence = self._waiting[0]
                tokens = len(sequence.request.prompt_ids) - 1  # the prefill's: all but the last
                if sequence.handle.cancelled:
                    self._waiting.popleft()
                elif admitted and not self._prefill_takes(prefill_tokens + tokens):
                    break  # the next admission prefills it
                elif self._fits([*admitted, sequence]):
                    admitted.append(self._waiting.popleft())
                    prefill_tokens += tokens
                elif self._running or admitted:
                    break  # it waits, and those behind it, for running sequences to finish
                else:  # it could not fit even alone
                    refused.append(self._waiting.popleft())
        for sequence in refused:
            self._fail([sequence], RequestTooLarge(self._refusal(sequence)))
        return admitted

    def _prefill_takes(self, tokens: int) -> bool:
        """Whether one prefill may take `tokens` prompt tokens (transformers.max_prefill_tokens)."""
        return self._max_prefill_tokens is None or tokens <= self._max_prefill_tokens

    def _fits(self, joining: list[_Sequence]) -> bool:
        """Whether `joining` can join the running batch within the KV cache's budget
        (runner.deploy.kv_budget). An idle engine lets go of buffers that an earlier batch grew
        larger than the one it starts needs."""
        budget = self._kv_budget()
        if budget is None:
            return True
        need = self._joining(joining)
        if budget.peak(need, self._cache, len(joining)) <= budget.limit:
            return True
        if self._running or self._cache is None:
            return False
        if budget.peak(need, None, len(joining)) > budget.limit:
            return False
        self._cache = None  # the batch starts in buffers of its own size
        return True

    def _joining(self, joining: list[_Sequence]) -> Joining:
        return Joining(
            rows=len(self._running) + len(joining),
            prefix=max(len(sequence.request.prompt_ids) - 1 for sequence in joining),
            steps=max(
                sequence.request.max_tokens - sequence.completion_tokens
                for sequence in [*self._running, *joining]
            ),
        )

    def _refusal(self, sequence: _Sequence) -> str:
        budget = self._kv_budget()
        assert budget is not None, "only a bounded cache refuses"
        peak = budget.peak(self._joining([sequence]), None, 1)
        return budget.refusal(sequence.request.prompt_ids, sequence.request.max_tokens, peak)

    def _kv_budget(self) -> KvBudget | None:
        """The KV cache's budget (None: no bound, the CPU's default), its limit set as the
        engine first admits."""
        if self._budget is None and self._token_bytes:
            if self._kv_cache_gib is not None:
                limit = self._kv_cache_gib * GIB
            else:
                limit = default_budget(self._device, self._engines)
            log.info("the KV cache may take %.2f GiB (transformers.kv_cache_gib)", limit / GIB)
            self._budget = KvBudget(
                limit,
                self._token_bytes,
                padded=self._padded,
                compiled=self.decode_step.compiled,
                overlap=self._overlap,
            )
        return self._budget

    def _admission_due(self) -> bool:
        """Whether waiting sequences join now: always into an idle engine; into a running batch
        once they are waiting_served_ratio x its rows, or have waited max_waiting_steps steps."""
        if not self._running or not self._waiting:
            return True
        if self._steps_waited >= self._max_waiting_steps:
            return True
        return len(self._waiting) >= self._waiting_served_ratio * len(self._running)

    def _admit(self, admitted: list[_Sequence]) -> None:
        """Prefill the admitted sequences into the batch; a failed prefill fails its own requests.

        When several requests were prefilled together, each is tried again alone, so a bad one
        fails without taking the others with it.
        """
        try:
            prefilled = self._prefill(admitted)
        except Exception as error:
            requests: dict[int, list[_Sequence]] = {}
            for sequence in admitted:
                requests.setdefault(id(sequence.handle), []).append(sequence)
            if len(requests) > 1:
                for sequences in requests.values():
                    self._admit(sequences)
                return
            log.exception("prefill failed")
            self._fail(admitted, EngineFailed(str(error)))
            return
        self._join(admitted, prefilled)

    def _prefill(self, admitted: list[_Sequence]) -> Prefilled:
        """Run the new prompts' prefixes together (their last tokens go to the next decode
        step), and take the prompt logprobs of those whose requests asked. Changes nothing in
        the running batch, so a failure here is the admitted sequences' own."""
        prefilled = self.decode_step.prefill([sequence.request.prompt_ids for sequence in admitted])
        by_request: dict[int, tuple[TokenLogprob, ...]] = {}  # a request's choices share them
        for sequence in admitted:
            request = sequence.request
            if request.prompt_logprobs and id(request) not in by_request:
                top = request.logprobs or 0
                by_request[id(request)] = self.decode_step.prompt_logprobs(request.prompt_ids, top)
            sequence.prompt_logprobs = by_request.get(id(request), ())
        return prefilled

    def _join(self, admitted: list[_Sequence], prefilled: Prefilled) -> None:
        """Merge prefilled sequences into the running batch; the next decode step gives their
        first tokens."""
        if self._cache is None:
            compiled = self.decode_step.compiled
            self._cache = BatchCache(prefilled.cache, padded=self._padded, compiled=compiled)
        last_ids = [sequence.request.prompt_ids[-1] for sequence in admitted]
        self._cache.append_rows(prefilled, last_ids)
        self._running.extend(admitted)

    def _decode(self) -> _Step:
        """One token for every running sequence, in one forward pass (or graph replay), given
        to the device: the tokens become the next step's inputs there, and a copy of them
        comes to the host without the host waiting for it."""
        assert self._cache is not None, "running sequences have a cache"
        logits = self.decode_step(self._cache, self._cache.next_window())
        requests = [sequence.request for sequence in self._running]
        next_ids = next_tokens(
            logits[: len(requests)],
            temperatures=[request.temperature for request in requests],
            top_ps=[request.top_p for request in requests],
            top_ks=[request.top_k for request in requests],
            generators=[sequence.generator for sequence in self._running],
        )
        # A row that failed to sample reads a token in the vocabulary; it leaves at the publish.
        self._cache.advance(next_ids.clamp(min=0))
        logprobs = self._logprobs(logits, next_ids)
        if self._device.type != "cuda":
            return _Step(list(self._running), next_ids, None, logprobs)
        # Into pinned memory: the step's one copy (and its logprobs' where a request asked).
        tokens = next_ids.to("cpu", non_blocking=True)
        if logprobs is not None:
            logprobs = _StepLogprobs(
                logprobs.rows,
                *(
                    t.to("cpu", non_blocking=True)
                    for t in (logprobs.chosen, logprobs.top_values, logprobs.top_ids)
                ),
            )
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(self._device))
        return _Step(list(self._running), tokens, ready, logprobs)

    def _logprobs(self, logits: torch.Tensor, next_ids: torch.Tensor) -> _StepLogprobs | None:
        """The step's log probabilities for the running rows whose requests asked; None (no
        work on the device) where none did."""
        asked = [s.request.logprobs for s in self._running]
        rows = [row for row, top in enumerate(asked) if top is not None]
        if not rows:
            return None
        top = max(asked[row] or 0 for row in rows)
        return _StepLogprobs(rows, *token_logprobs(logits, next_ids, rows, top))

    def _finish(self, step: _Step) -> None:
        """Read a step's tokens (waiting for its copy alone), record them in its sequences and
        send what they made; drop the finished sequences from the batch."""
        if step.ready is not None:
            step.ready.synchronize()
        token_ids = step.tokens.tolist()
        logprobs = {} if step.logprobs is None else step.logprobs.by_row(step.sequences, token_ids)
        self._advance(step.sequences, token_ids, logprobs)
        self._publish()

    def _advance(
        self, sequences: list[_Sequence], token_ids: list[int], logprobs: dict[int, TokenLogprob]
    ) -> None:
        """Record each sequence's new token (and its logprobs, by row, where its request asked)
        and decide whether it has finished; a sequence already finished (overlap: the step was
        queued before its last token was read) or failed takes none."""
        for row, (sequence, token_id) in enumerate(zip(sequences, token_ids, strict=True)):
            if sequence.error is not None or sequence.finish_reason is not None:
                continue
            if token_id == SAMPLING_FAILED:
                _fail_alone(sequence, ValueError(NOT_A_DISTRIBUTION))
                continue
            try:
                self._advance_one(sequence, token_id, logprobs.get(row))
            except Exception as error:  # its detokenizing or stop sequences: its own failure
                _fail_alone(sequence, error)

    def _advance_one(
        self, sequence: _Sequence, token_id: int, logprob: TokenLogprob | None
    ) -> None:
        assert sequence.finish_reason is None, "a finished sequence left the batch"
        sequence.completion_tokens += 1  # the end-of-sequence token counts, as in OpenAI's usage
        if logprob is not None:  # the end-of-sequence token's too, one for each token counted
            sequence.logprobs.append(logprob)
        text = sequence.text
        if token_id in self._eos_ids:
            sequence.finish_reason = "stop"
        else:
            text.push(token_id)
            if text.stopped:
                sequence.finish_reason = "stop"
            elif sequence.completion_tokens >= sequence.request.max_tokens:
                sequence.finish_reason = "length"
        if sequence.finish_reason is not None:
            delta = text.finish()
            if text.stop_found:  # in the trailing bytes finish() flushed, at the length limit
                sequence.finish_reason = "stop"
        elif sequence.request.stream and (
            not text.started or sequence.completion_tokens % self._stream_interval == 0
        ):
            delta = text.ready()
        else:
            delta = ""
        if delta or sequence.finish_reason is not None:
            event = ChoiceEvent(
                sequence.index,
                delta,
                sequence.finish_reason,
                sequence.completion_tokens,
                tuple(sequence.logprobs),
                sequence.prompt_logprobs,
            )
            sequence.logprobs.clear()
            sequence.prompt_logprobs = ()
            sequence.events.append(event)

    def _publish(self) -> None:
        """Send this step's events and remove finished or abandoned sequences from the batch."""
        outgoing: list[tuple[RequestHandle, ChoiceEvent | Exception]] = []
        keep = []
        for row, sequence in enumerate(self._running):
            outgoing.extend((sequence.handle, event) for event in sequence.events)
            sequence.events.clear()
            if sequence.error is not None:
                outgoing.append((sequence.handle, sequence.error))
            elif sequence.finish_reason is None and not sequence.handle.cancelled:
                keep.append(row)
        self._deliver(outgoing)
        if len(keep) == len(self._running):
            return
        if not keep:
            self._reset_batch()
            return
        assert self._cache is not None, "running sequences have a cache"
        order = self._cache.select_rows(keep)
        self._running = [self._running[row] for row in order]

    def _fail(self, sequences: list[_Sequence], error: Exception) -> None:
        self._deliver([(sequence.handle, error) for sequence in sequences])

    def _reset_batch(self) -> None:
        self._running = []
        if self._cache is not None:
            self._cache.clear()


def _fail_alone(sequence: _Sequence, error: Exception) -> None:
    """Mark one sequence failed; the next publish tells its request and drops it from the batch."""
    log.error("sequence %d of a request failed", sequence.index, exc_info=error)
    sequence.error = EngineFailed(str(error))
