"""The clients of bench_deploy.py: concurrent clients of /v1/completions, spread over processes.

A Python client is not free, and on a machine it shares with the server its CPU is the server's
loss. Two kinds (`client`); their CPU a request is what bench_deploy.py prints beside each
figure (the stand-in at 128 clients on a 2-core EPYC, `OMP_NUM_THREADS=1`, 3 and 5 repeats):
- "http" (the default): aiohttp posting the request's JSON and reading `usage` from the
  answer's, as vLLM's and SGLang's serving benchmarks do (vLLM:
  benchmarks/backend_request_func.py): 0.21-0.25 ms of CPU a request;
- "stream": the same, streamed (`"stream": true`, the usage in the last chunk), as chat
  interfaces read answers and as vLLM's serving benchmark measures by default: each request's
  time to its first token is kept too;
- "openai": OpenAI's SDK, as most users' code calls a server: 1.42-2.13 ms a request (it builds
  the request and parses the answer into its models). At 128 clients its one process sends a
  wave a request at a time for about a quarter of a second, while the server's batch runs
  part-empty: http/engine c=128 read 0.692 with it, 0.934 with aiohttp.

The clients run in processes (each `concurrency / processes` of them, over its share of the
prompts), started once for a whole benchmark (`Clients`). A measurement starts them together
once all are warm, and each reports the CPU it used, so that a figure bounded by its client
shows (`busy`: the busiest process's CPU seconds over the wall time).

    python scripts/serving/deploy_clients.py   # a client process (bench_deploy.py starts them): for
                                       # each job (a JSON line on stdin) it prints "ready",
                                       # waits for a line, runs, prints its result as JSON
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# The kinds of client (see above).
CLIENTS = ("http", "stream", "openai")

WORDS = "the model reads a prompt and writes an answer one token at a time".split()


def prompts(count: int) -> list[str]:
    """Prompts of varied lengths (8 to 40 words)."""
    return [
        " ".join(WORDS[(i + j) % len(WORDS)] for j in range(8 + (i * 7) % 33)) for i in range(count)
    ]


@dataclass
class Load:
    """What a set of clients measured: each request's latency, the tokens, the wall time, the
    busiest client process's CPU time over the wall time, the clients' CPU time a request, and
    each streamed request's time to its first token."""

    latencies_s: list[float]
    output_tokens: int
    wall_s: float
    busy: float
    cpu_per_request_s: float
    first_token_s: list[float]


class Clients:
    """Client processes kept for a whole benchmark, so that starting them (and their imports)
    is paid once; each measurement uses as many of them as it asks for."""

    def __init__(self, processes: int, client: str = "http") -> None:
        """`processes` client processes, each running clients of the kind `client` (CLIENTS)."""
        if client not in CLIENTS:
            raise ValueError(f"client {client!r}: use one of {', '.join(CLIENTS)}")
        self._client = client
        self._children = [
            subprocess.Popen(
                [sys.executable, str(Path(__file__).resolve())],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            for _ in range(max(1, processes))
        ]

    def __enter__(self) -> Clients:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """End the processes: their input closes, and they exit."""
        for child in self._children:
            if child.poll() is None:
                assert child.stdin is not None
                child.stdin.close()
        for child in self._children:
            try:
                child.wait(timeout=30)
            except subprocess.TimeoutExpired:
                child.kill()

    def run(
        self,
        url: str,
        texts: list[str],
        max_tokens: int,
        concurrency: int,
        processes: int,
        *,
        model: str = "bench",
        api_key: str = "unused",
        temperature: float = 0.0,
    ) -> Load:
        """`concurrency` clients in `processes` of the processes send `texts` (`max_tokens`
        each, greedy or sampled at `temperature`, without a seed) to `model` on the server at
        `url` until none are left; the clock runs from the first start to the last end."""
        used = self._children[: max(1, min(processes, concurrency, len(self._children)))]
        for index, child in enumerate(used):
            job = {
                "client": self._client,
                "url": url,
                "model": model,
                "api_key": api_key,
                "texts": texts[index :: len(used)],
                "max_tokens": max_tokens,
                "temperature": temperature,
                "concurrency": concurrency // len(used) + (index < concurrency % len(used)),
            }
            _send(child, json.dumps(job))
        for child in used:  # each has its client and has sent a warm-up request
            if _receive(child) != "ready":
                raise SystemExit("a client process failed before its run (its error is above)")
        for child in used:
            _send(child, "go")
        results = [json.loads(_receive(child) or "null") for child in used]
        if None in results:
            raise SystemExit("a client process failed in its run (its error is above)")
        wall = max(r["end"] for r in results) - min(r["start"] for r in results)
        return Load(
            latencies_s=[latency for r in results for latency in r["latencies_s"]],
            output_tokens=sum(r["output_tokens"] for r in results),
            wall_s=wall,
            busy=max(r["cpu_s"] for r in results) / wall,
            cpu_per_request_s=sum(r["cpu_s"] for r in results) / len(texts),
            first_token_s=[first for r in results for first in r["first_token_s"]],
        )


def _send(child: subprocess.Popen, line: str) -> None:
    assert child.stdin is not None
    child.stdin.write(line + "\n")
    child.stdin.flush()


def _receive(child: subprocess.Popen) -> str:
    """The child's next line ('' once it has exited)."""
    assert child.stdout is not None
    return child.stdout.readline().strip()


# A prompt's completion: its output tokens, and the seconds to its first (None: not streamed).
Complete = Callable[[str], Awaitable[tuple[int, float | None]]]


@contextlib.asynccontextmanager
async def _sdk(job: dict) -> AsyncIterator[Complete]:
    """Completions through OpenAI's SDK."""
    import openai

    client = openai.AsyncOpenAI(base_url=f"{job['url']}/v1", api_key=job["api_key"], max_retries=0)

    async def complete(text: str) -> tuple[int, float | None]:
        response = await client.completions.create(
            model=job["model"],
            prompt=text,
            max_tokens=job["max_tokens"],
            temperature=job["temperature"],
        )
        assert response.usage is not None, "the server reports usage"
        return response.usage.completion_tokens, None

    async with client:
        yield complete


@contextlib.asynccontextmanager
async def _http(job: dict) -> AsyncIterator[Complete]:
    """Completions posted as JSON with aiohttp, a connection per client (no limit on them);
    streamed where the job's client is "stream"."""
    import aiohttp

    stream = job["client"] == "stream"

    headers = {"Authorization": f"Bearer {job['api_key']}"}
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=None)  # a long run's answer is as slow as it is
    async with aiohttp.ClientSession(
        job["url"], headers=headers, connector=connector, timeout=timeout
    ) as session:

        async def complete(text: str) -> tuple[int, float | None]:
            body = {"model": job["model"], "prompt": text, "max_tokens": job["max_tokens"]}
            body["temperature"] = job["temperature"]
            if stream:
                body["stream"], body["stream_options"] = True, {"include_usage": True}
            began = time.perf_counter()
            async with session.post("/v1/completions", json=body) as answer:
                answer.raise_for_status()
                if not stream:
                    return (await answer.json())["usage"]["completion_tokens"], None
                return await _read_stream(answer.content, began)

        yield complete


async def _read_stream(content: Any, began: float) -> tuple[int, float | None]:
    """A streamed answer's output tokens (its last chunk's usage) and the seconds from `began`
    to its first chunk with text."""
    first, tokens = None, 0
    async for line in content:
        if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
            continue
        chunk = json.loads(line[6:])
        if first is None and any(choice["text"] for choice in chunk["choices"]):
            first = time.perf_counter() - began
        if chunk.get("usage"):
            tokens = chunk["usage"]["completion_tokens"]
    return tokens, first


async def _clients(job: dict) -> dict | None:
    """This process's clients: warm up, say ready, wait for the word, then send every text."""
    pending = list(reversed(job["texts"]))
    latencies: list[float] = []
    first_tokens: list[float] = []
    tokens = 0

    async with (_sdk if job["client"] == "openai" else _http)(job) as complete:

        async def worker() -> None:
            nonlocal tokens
            while pending:
                text = pending.pop()
                began = time.perf_counter()
                completion_tokens, first = await complete(text)
                latencies.append(time.perf_counter() - began)
                tokens += completion_tokens
                if first is not None:
                    first_tokens.append(first)

        await complete("warm up")
        print("ready", flush=True)
        if not await asyncio.to_thread(sys.stdin.readline):
            return None  # its input closed before the word: the benchmark has ended
        # CLOCK_MONOTONIC is one clock for every process of the machine.
        start, cpu = time.monotonic(), time.process_time()
        await asyncio.gather(*(worker() for _ in range(job["concurrency"])))
        end, cpu = time.monotonic(), time.process_time() - cpu
    return {
        "latencies_s": latencies,
        "first_token_s": first_tokens,
        "output_tokens": tokens,
        "start": start,
        "end": end,
        "cpu_s": cpu,
    }


def main() -> None:
    """One job per line on stdin, until it closes."""
    for line in sys.stdin:
        result = asyncio.run(_clients(json.loads(line)))
        if result is None:
            return
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
