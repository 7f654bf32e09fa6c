"""Where `runner deploy`'s engine spends a run, without the server or HTTP around it.

    python scripts/serving/profile_engine.py [--checkpoint DIR] [--device auto] [--dtype auto]
        [--concurrency 128] [--waves 4] [--max-tokens 64] [--repeats 3]
        [--max-waiting-steps 20] [--waiting-served-ratio 0.3] [--compile] [--temperature 0]
        [--logprobs K [--echo]] [--stand-in] [--serve [--stream]]

`--concurrency` clients in this process submit token ids straight to the engine
(runner/deploy/engine.py), each awaiting its answer before sending the next, until
`--waves` x `--concurrency` prompts (bench_deploy.py's) are answered, greedy (or sampled at
`--temperature`, top_p 1, without a seed, as clients send them by default; with `--logprobs K`,
each asking for its tokens' log probabilities and their top K, and with `--echo` its prompt's
too, as lm-evaluation-harness asks). Per repeat it
prints output tokens/s, and the time and count of the engine's prefills (and within them the
model's forward pass), the merging of prefilled rows into the batch (join), decode steps (and
within them the log probabilities where asked), recording each row's new token (advance),
CUDA-graph captures, and publishing of events (and within it the moving of rows as finished ones
leave the batch: leave), each timed to the device's completion (which adds a synchronization to
each: on CUDA the host then no longer runs a step ahead of the GPU, so these repeats' tokens/s
are below what the engine makes serving), how many rows the decode steps ran, and the size of
the batch's KV buffers. The first repeat includes the captures and the buffers' allocation; a
warm-up wave before them is not counted.
With --serve it times nothing inside the engine: it reads `CONCURRENCY COUNT` lines on stdin
and answers each with one JSON line, the output tokens, wall time and latencies of COUNT prompts
sent by CONCURRENCY clients (after one uncounted wave at a concurrency it has not served yet;
with --stream, streamed, and each answer's time to its first text too): bench_deploy.py's
`engine alone`, one process for its whole run, as its servers are.
Beside bench_deploy.py's `runner deploy` at the same concurrency, the difference is what the
server and HTTP cost. Without --checkpoint it builds bench_deploy.py's tiny model.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import json
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from deploy_clients import prompts
from profile_decode import load_model, model_parser

from runner.deploy.engine import TransformersEngine
from runner.deploy.generation import SamplingRequest
from runner.deploy.kv_cache import BatchCache


class Timings:
    """Seconds and calls per part of the engine, and the decode steps' row counts."""

    def __init__(self, device: torch.device) -> None:
        self.seconds: collections.Counter[str] = collections.Counter()
        self.calls: collections.Counter[str] = collections.Counter()
        self.rows: collections.Counter[int] = collections.Counter()
        self._synchronize = torch.cuda.synchronize if device.type == "cuda" else lambda: None

    def wrap(self, owner: Any, name: str, part: str) -> None:
        """Time every call of owner.name (an instance's method, or a class's, for every
        instance) as `part`."""
        method: Callable[..., Any] = getattr(owner, name)

        @functools.wraps(method)
        def timed(*args: Any, **kwargs: Any) -> Any:
            self._synchronize()
            began = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                self._synchronize()
                self.seconds[part] += time.perf_counter() - began
                self.calls[part] += 1

        setattr(owner, name, timed)

    def clear(self) -> None:
        self.seconds.clear()
        self.calls.clear()
        self.rows.clear()


async def clients(
    engine: TransformersEngine,
    prompt_ids: list[list[int]],
    concurrency: int,
    max_tokens: int,
    latencies: list[float],
    temperature: float = 0.0,
    first_tokens: list[float] | None = None,
    logprobs: int | None = None,
    echo: bool = False,
) -> int:
    """Every prompt answered by `concurrency` clients (sampled at `temperature`, unseeded,
    asking for `logprobs` as a request's field does, and with `echo` its prompt's); the output
    tokens (and each request's latency appended to `latencies`). With `first_tokens`, the
    answers are streamed, and each one's time to its first text is appended there."""
    pending = list(reversed(prompt_ids))
    tokens = 0
    stream = first_tokens is not None

    async def client() -> None:
        nonlocal tokens
        while pending:
            ids = pending.pop()
            request = SamplingRequest(
                ids, max_tokens, temperature, 1.0, None, [], 1, stream, logprobs, echo
            )
            began, first = time.perf_counter(), None
            async for event in engine.submit([request]).events():
                if first is None and event.text:
                    first = time.perf_counter() - began
                if event.finish_reason is not None:
                    tokens += event.completion_tokens
            latencies.append(time.perf_counter() - began)
            if first_tokens is not None and first is not None:
                first_tokens.append(first)

    await asyncio.gather(*(client() for _ in range(concurrency)))
    return tokens


def serve(
    engine: TransformersEngine, tokenizer: Any, max_tokens: int, temperature: float, stream: bool
) -> None:
    """Answer each `CONCURRENCY COUNT` line on stdin with one JSON line: the output tokens,
    wall time and latencies of the first COUNT prompts sent by CONCURRENCY clients (`stream`:
    streamed, with each one's time to its first text), after one wave not counted at a
    concurrency not served before (buffers, captures)."""
    served: set[int] = set()
    encoded: list[list[int]] = []  # the prompts tokenized so far, each once
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        concurrency, count = map(int, line.split())
        encoded += (
            tokenizer.encode(text, add_special_tokens=True)
            for text in prompts(count)[len(encoded) :]
        )
        prompt_ids = encoded[:count]
        if concurrency not in served:
            asyncio.run(
                clients(engine, prompt_ids[:concurrency], concurrency, max_tokens, [], temperature)
            )
            served.add(concurrency)
        latencies: list[float] = []
        firsts: list[float] | None = [] if stream else None
        began = time.perf_counter()
        tokens = asyncio.run(
            clients(engine, prompt_ids, concurrency, max_tokens, latencies, temperature, firsts)
        )
        wall = time.perf_counter() - began
        answer = {"tokens": tokens, "wall_s": wall, "latencies_s": latencies}
        print(json.dumps({**answer, "first_token_s": firsts or []}), flush=True)


def watch(engine: TransformersEngine, timings: Timings) -> None:
    """Time the engine's parts into `timings`, and count the rows of its decode steps."""
    parts = [("_prefill", "prefill"), ("_join", "join"), ("_decode", "decode")]
    for method, part in [*parts, ("_publish", "publish")]:
        timings.wrap(engine, method, part)
    timings.wrap(engine.decode_step, "_capture", "capture")
    # The cache is made with the first batch: its class's method, for every instance.
    timings.wrap(BatchCache, "select_rows", "leave")
    # Within the prefill: the model's forward pass alone (the rest is building the batch on the
    # host and sampling its first tokens).
    timings.wrap(engine.decode_step, "prefill", "prefill forward")
    # Within the decode step: the log probabilities of the rows whose requests ask (--logprobs),
    # and, after it, each row's token and logprobs recorded (advance).
    timings.wrap(engine, "_logprobs", "logprobs")
    timings.wrap(engine, "_advance", "advance")
    decode = engine._decode

    def decode_counting_rows() -> Any:
        timings.rows[len(engine._running)] += 1
        return decode()  # the step given to the device, which the engine finishes

    engine._decode = decode_counting_rows  # type: ignore[method-assign]


def kv_buffers(cache: BatchCache | None) -> str:
    """The batch's KV buffers as the repeat left them: their capacity and bytes."""
    if cache is None:
        return "KV buffers: none"
    rows, tokens = cache.capacity
    return f"KV buffers: {rows} rows x {tokens} tokens, {cache.nbytes / 2**20:,.1f} MiB"


def main() -> None:
    parser = model_parser(__doc__)
    parser.add_argument("--concurrency", type=int, default=128, help="clients, and batch rows")
    parser.add_argument("--waves", type=int, default=4, help="prompts per client")
    parser.add_argument("--max-tokens", type=int, default=64, help="new tokens per request")
    parser.add_argument("--repeats", type=int, default=3, help="runs over the same prompts")
    parser.add_argument(
        "--serve", action="store_true", help="answer `CONCURRENCY COUNT` lines on stdin in JSON"
    )
    parser.add_argument(
        "--max-waiting-steps",
        type=int,
        default=20,
        help="deploy's transformers.max_waiting_steps",
    )
    parser.add_argument(
        "--waiting-served-ratio",
        type=float,
        default=0.3,
        help="deploy's transformers.waiting_served_ratio",
    )
    parser.add_argument("--compile", action="store_true", help="deploy's transformers.compile=true")
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    parser.add_argument(
        "--logprobs", type=int, default=None, help="each request's logprobs (default: none)"
    )
    parser.add_argument(
        "--echo", action="store_true", help="with --logprobs: the prompt's logprobs too"
    )
    parser.add_argument(
        "--stream", action="store_true", help="with --serve: streamed answers (text each token)"
    )
    args = parser.parse_args()
    checkpoint, loaded = load_model(args)
    device = loaded.model.device
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    engine = TransformersEngine(
        loaded,
        max_batch_size=args.concurrency,
        max_queue=1 << 16,
        max_waiting_steps=args.max_waiting_steps,
        waiting_served_ratio=args.waiting_served_ratio,
        compile=args.compile,
    )
    timings = Timings(device)
    if args.serve:
        serve(engine, loaded.tokenizer, args.max_tokens, args.temperature, args.stream)
        engine.close()
        return
    watch(engine, timings)
    count = args.waves * args.concurrency
    tokenizer = loaded.tokenizer
    prompt_ids = [tokenizer.encode(text, add_special_tokens=True) for text in prompts(count)]
    # A warm-up wave, not counted: the first steps allocate the batch's buffers (and capture).
    asyncio.run(
        clients(
            engine,
            prompt_ids[: args.concurrency],
            args.concurrency,
            args.max_tokens,
            [],
            args.temperature,
            logprobs=args.logprobs,
            echo=args.echo,
        )
    )
    print(
        f"{checkpoint} on {device} ({name}), {loaded.model.dtype}: {args.concurrency} clients, "
        f"{count} prompts, {args.max_tokens} new tokens each, "
        f"{f'temperature {args.temperature}' if args.temperature else 'greedy'}, max_waiting_steps "
        f"{args.max_waiting_steps}, waiting_served_ratio {args.waiting_served_ratio}, "
        f"compiled {args.compile}, logprobs {args.logprobs}, echo {args.echo}"
    )
    try:
        for repeat in range(args.repeats):
            timings.clear()
            began = time.perf_counter()
            tokens = asyncio.run(
                clients(
                    engine,
                    prompt_ids,
                    args.concurrency,
                    args.max_tokens,
                    [],
                    args.temperature,
                    logprobs=args.logprobs,
                    echo=args.echo,
                )
            )
            wall = time.perf_counter() - began
            print(f"\nrepeat {repeat + 1}: {tokens / wall:,.0f} tokens/s ({wall:.3f} s)")
            for part in sorted(timings.seconds):
                seconds, calls = timings.seconds[part], timings.calls[part]
                print(
                    f"  {part:15} {calls:6d} calls {seconds * 1e3:10.1f} ms "
                    f"({seconds * 1e3 / calls:.2f} ms each, {seconds / wall:.0%} of the run)"
                )
            steps = sorted(timings.rows.items())
            print("  decode steps by rows:", ", ".join(f"{rows}: {n}" for rows, n in steps))
            print(f"  {kv_buffers(engine._cache)}")
    finally:
        engine.close()


if __name__ == "__main__":
    main()
