"""What `transformers.compile=true` costs at start and gives per request, beside eager, on a
random model of a named shape.

    python scripts/serving/compile_start.py [--shape tiny|stand-in|MODEL] [--repeats 3]
        [--max-tokens 24] [--cold] [--padded]

Builds the model with random weights: bench_deploy.py's tiny model or its stand-in, or the
dimensions of a conf/model option with builder arguments (smollm2_135m: SmolLM2-135M's, 30
layers, 576 wide, 9 heads over 3 KV heads), as `runner train model=MODEL model.source=null`
builds it, with the tiny tokenizer. It starts an eager engine and a compiled one as `runner
deploy` does (the compiled one compiles as it starts: its start is the price), then times one
request and 8 concurrent ones on each, taking turns, --repeats times, greedy. Prints each
engine's start, the median and range of each timing, and whether the compiled engine's answers
equal the eager one's. --cold compiles into an empty inductor cache (a first start on a new
machine); otherwise inductor's cache from earlier runs is used, as a second start would.
--padded runs the CUDA path's step on the CPU: windows rounded up to buckets, and compiled, one
decoder layer for all (runner/deploy/decode_step.py) where the CPU's compiles the whole step.
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
from deploy_sides import STAND_IN, TINY_TOKENIZER_DIR, make_tiny_checkpoint
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from runner.api import compose
from runner.config.model import resolve_model
from runner.deploy.engine import TransformersEngine
from runner.deploy.generation import SamplingRequest
from runner.deploy.loading import load_checkpoint


def build(shape: str, path: Path) -> None:
    """The named shape with random weights, saved as training saves a checkpoint."""
    if shape in ("tiny", "stand-in"):
        make_tiny_checkpoint(path, *(STAND_IN if shape == "stand-in" else ()))
    else:  # the config.json that `runner train model=MODEL model.source=null` writes
        overrides = [f"model={shape}", "model.source=null", f"model.tokenizer={TINY_TOKENIZER_DIR}"]
        config = resolve_model(compose(overrides).model).hf_config
        tokenizer = AutoTokenizer.from_pretrained(TINY_TOKENIZER_DIR)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config))
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)


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
    parser.add_argument("--shape", default="tiny", help="tiny, stand-in or a conf/model name")
    parser.add_argument("--repeats", type=int, default=3, help="turns of each timing")
    parser.add_argument("--max-tokens", type=int, default=24, help="new tokens per request")
    parser.add_argument("--cold", action="store_true", help="an empty inductor cache")
    parser.add_argument("--padded", action="store_true", help="the CUDA path's step, on the CPU")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        if args.cold:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(Path(scratch) / "inductor")
        build(args.shape, Path(scratch) / "model")
        engines, starts = {}, {}
        for name, compiled in (("eager", False), ("compiled", True)):
            # A model each, loaded as `runner deploy` loads it: compiling compiles the model's
            # decoder layers, which an eager engine over the same model would run compiled.
            loaded = load_checkpoint(
                Path(scratch) / "model", device="cpu", dtype="fp32", max_model_len=None
            )
            began = time.perf_counter()
            engines[name] = TransformersEngine(
                loaded, max_batch_size=32, max_queue=64, padded=args.padded, compile=compiled
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
    path = "the CUDA path's step (padded, compiled by layer)" if args.padded else "CPU's step"
    print(f"{args.shape}, {args.max_tokens} new tokens a request, {args.repeats} repeats, {path}")
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
