"""What `transformers.compile=true` costs at start and gives per request, beside eager, on a
random model of a named shape.

    python scripts/serving/compile_start.py [--shape tiny|stand-in|smollm2_135m] [--repeats 3]
        [--max-tokens 24] [--cold]

Builds the model (random weights; smollm2_135m is SmolLM2-135M's shape: 30 layers, 576 wide,
9 heads over 3 KV heads, 49,152 tokens), starts an eager engine and a compiled one as `runner
deploy` does (the compiled one compiles as it starts: its start is the price), then times one
request and 8 concurrent ones on each, taking turns, --repeats times, greedy. Prints each
engine's start, the median and range of each timing, and whether the compiled engine's answers
equal the eager one's. --cold compiles into an empty inductor cache (a first start on a new
machine); otherwise inductor's cache from earlier runs is used, as a second start would.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
from bench_deploy import STAND_IN, TINY_TOKENIZER_DIR, make_tiny_checkpoint
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from runner.deploy.engine import TransformersEngine
from runner.deploy.generation import SamplingRequest
from runner.deploy.loading import LoadedModel, load_checkpoint

SMOLLM2_135M = LlamaConfig(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    max_position_embeddings=2048,
    tie_word_embeddings=True,
)


def build(shape: str, path: Path) -> LoadedModel:
    """The named shape with random weights, saved and loaded as `runner deploy` loads it."""
    if shape == "smollm2_135m":
        torch.manual_seed(0)
        LlamaForCausalLM(SMOLLM2_135M).save_pretrained(path)
        AutoTokenizer.from_pretrained(TINY_TOKENIZER_DIR).save_pretrained(path)
    else:
        make_tiny_checkpoint(path, *(STAND_IN if shape == "stand-in" else ()))
    return load_checkpoint(path, device="cpu", dtype="fp32", max_model_len=None)


def answers(engine: TransformersEngine, prompts: list[list[int]], max_tokens: int) -> list[str]:
    """The engine's greedy answers to prompts sent together."""

    async def one(ids: list[int]) -> str:
        request = SamplingRequest(ids, max_tokens, 0.0, 1.0, 0, [], 1, stream=False)
        return "".join([event.text async for event in engine.submit([request]).events()])

    async def together() -> list[str]:
        return list(await asyncio.gather(*map(one, prompts)))

    return asyncio.run(together())


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shape", default="tiny", choices=["tiny", "stand-in", "smollm2_135m"])
    parser.add_argument("--repeats", type=int, default=3, help="turns of each timing")
    parser.add_argument("--max-tokens", type=int, default=24, help="new tokens per request")
    parser.add_argument("--cold", action="store_true", help="an empty inductor cache")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        if args.cold:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(Path(scratch) / "inductor")
        loaded = build(args.shape, Path(scratch) / "model")
        engines, starts = {}, {}
        for name, compiled in (("eager", False), ("compiled", True)):
            began = time.perf_counter()
            engines[name] = TransformersEngine(
                loaded, max_batch_size=32, max_queue=64, compile=compiled
            )
            starts[name] = time.perf_counter() - began
        prompts = [[5 + i] * (8 + 3 * i) for i in range(8)]
        said = {name: answers(engine, prompts, args.max_tokens) for name, engine in engines.items()}
        seconds: dict[tuple[str, int], list[float]] = {}
        for _ in range(args.repeats):
            for count in (1, 8):
                for name, engine in engines.items():
                    began = time.perf_counter()
                    answers(engine, prompts[:count], args.max_tokens)
                    seconds.setdefault((name, count), []).append(time.perf_counter() - began)
        for engine in engines.values():
            engine.close()
    print(f"{args.shape}, {args.max_tokens} new tokens a request, {args.repeats} repeats, CPU")
    for name in engines:
        line = f"{name:9} start {starts[name]:6.1f} s"
        for count in (1, 8):
            times = sorted(seconds[(name, count)])
            line += (
                f", {count} request{'s' if count > 1 else ''} "
                f"{statistics.median(times):.3f} s ({times[0]:.3f}-{times[-1]:.3f})"
            )
        print(line)
    print(f"greedy answers equal: {said['eager'] == said['compiled']}")


if __name__ == "__main__":
    main()
