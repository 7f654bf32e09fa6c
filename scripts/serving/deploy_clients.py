"""The clients of bench_deploy.py: concurrent OpenAI-SDK clients over HTTP, spread over processes.

A Python client is not free: the OpenAI SDK spends about 2 ms of CPU on each request (building
it, parsing the answer into its models) on a 2-core EPYC. One process driving 128 clients then
needs a quarter of a second only to send a wave, which a server answering 10,000 tokens/s does
not have to spare; the figure would be the client's. So the clients run in processes (each
`concurrency / processes` of them, over its share of the prompts), started once for a whole
benchmark (`Clients`). A measurement starts them together once all are warm, and each reports
the CPU it used, so that a figure bounded by its client shows (`busy`: the busiest process's CPU
seconds over the wall time).

    python scripts/serving/deploy_clients.py   # a client process (bench_deploy.py starts them): for
                                       # each job (a JSON line on stdin) it prints "ready",
                                       # waits for a line, runs, prints its result as JSON
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

WORDS = "the model reads a prompt and writes an answer one token at a time".split()


def prompts(count: int) -> list[str]:
    """Prompts of varied lengths (8 to 40 words)."""
    return [
        " ".join(WORDS[(i + j) % len(WORDS)] for j in range(8 + (i * 7) % 33)) for i in range(count)
    ]


@dataclass
class Load:
    """What a set of clients measured: each request's latency, the tokens, the wall time, and
    the busiest client process's CPU time over the wall time."""

    latencies_s: list[float]
    output_tokens: int
    wall_s: float
    busy: float


class Clients:
    """Client processes kept for a whole benchmark, so that starting them (and importing the SDK)
    is paid once; each measurement uses as many of them as it asks for."""

    def __init__(self, processes: int) -> None:
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
    ) -> Load:
        """`concurrency` clients in `processes` of the processes send `texts` (greedy,
        `max_tokens` each) to `model` on the server at `url` until none are left; the clock runs
        from the first start to the last end."""
        used = self._children[: max(1, min(processes, concurrency, len(self._children)))]
        for index, child in enumerate(used):
            job = {
                "url": url,
                "model": model,
                "api_key": api_key,
                "texts": texts[index :: len(used)],
                "max_tokens": max_tokens,
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
        )


def _send(child: subprocess.Popen, line: str) -> None:
    assert child.stdin is not None
    child.stdin.write(line + "\n")
    child.stdin.flush()


def _receive(child: subprocess.Popen) -> str:
    """The child's next line ('' once it has exited)."""
    assert child.stdout is not None
    return child.stdout.readline().strip()


async def _clients(job: dict) -> dict | None:
    """This process's clients: warm up, say ready, wait for the word, then send every text."""
    import openai

    url, model, max_tokens = job["url"], job["model"], job["max_tokens"]
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=job["api_key"], max_retries=0)
    pending = list(reversed(job["texts"]))
    latencies: list[float] = []
    tokens = 0

    async def worker() -> None:
        nonlocal tokens
        while pending:
            text = pending.pop()
            began = time.perf_counter()
            response = await client.completions.create(
                model=model, prompt=text, max_tokens=max_tokens, temperature=0
            )
            latencies.append(time.perf_counter() - began)
            assert response.usage is not None, "the server reports usage"
            tokens += response.usage.completion_tokens

    async with client:
        await client.completions.create(model=model, prompt="warm up", max_tokens=4)
        print("ready", flush=True)
        if not await asyncio.to_thread(sys.stdin.readline):
            return None  # its input closed before the word: the benchmark has ended
        # CLOCK_MONOTONIC is one clock for every process of the machine.
        start, cpu = time.monotonic(), time.process_time()
        await asyncio.gather(*(worker() for _ in range(job["concurrency"])))
        end, cpu = time.monotonic(), time.process_time() - cpu
    return {
        "latencies_s": latencies,
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
