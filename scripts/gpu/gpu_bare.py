"""The bare loop that scripts/gpu/gpu_report.py sets beside `runner train`: torchtune's own Llama
3.2 builder (not runner's) with a zoo model's dimensions, random init, AdamW, clipping, in a plain
loop.

    python scripts/gpu/gpu_bare.py [--model llama3_2_1b] [--device cuda] [--dtype bf16] [--compile]
        [--batch-size 4] [--seq-len 2048] [--warmup 10] [--steps 30] [--profile-out DIR]

Prints one JSON line: tokens/s over the steps after the warm-up, each window's tokens/s (the
host waits for the device once per window of --warmup steps, where `runner train` logs with
runtime.log_every_n_steps at the same value), the parameter count, the peak memory
(torch.cuda.max_memory_allocated on CUDA, peak RSS on the CPU) and torch._dynamo's count of
graph breaks. Random
tokens: the model's cost does not depend on their values. With --profile-out, the last two
warm-up steps are profiled as `runner train profile.enabled=true` profiles its steps, into the
same files (runner.trainer.profiling), so that the two read side by side. It runs on the CPU too
(tests/test_gpu_report.py trains the tiny model for 2 steps).
"""

from __future__ import annotations

import argparse
import json
import resource
import time
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

CONF_MODEL = Path(__file__).resolve().parents[2] / "conf" / "model"


def builder_dims(model: str) -> dict[str, Any]:
    """The builder arguments of conf/model/MODEL.yaml (the zoo's real dimensions)."""
    builder = OmegaConf.to_container(OmegaConf.load(CONF_MODEL / f"{model}.yaml").builder)
    assert isinstance(builder, dict)
    return {str(key): value for key, value in builder.items()}


def windows(warmup: int, steps: int) -> list[int]:
    """The timed steps cut into windows of `warmup` steps, the last one shorter if need be: the
    steps between two of `runner train`'s logged steps with runtime.log_every_n_steps=warmup."""
    return [warmup] * (steps // warmup) + ([steps % warmup] if steps % warmup else [])


def profile_window(warmup: int) -> tuple[int, int]:
    """The steps every training arm profiles (first, count): the last two of the warm-up, after
    the first steps' compiling and outside the timed windows."""
    return max(1, warmup - 1), min(2, warmup)


def overall_rate(sizes: list[int], rates: list[float]) -> float:
    """Tokens/s over all the windows, from each window's steps and tokens/s: every step carries
    the same tokens (fixed-shape or packed rows), so a window's time is its steps / its rate."""
    return sum(sizes) / sum(size / rate for size, rate in zip(sizes, rates, strict=True))


def build(dims: dict[str, Any], device: str, dtype: str, compile: bool) -> tuple[Any, Any]:
    """torchtune's Llama 3.2 builder on `device`, its weights in `dtype`, and the loss its recipes
    train it with (cross-entropy over 8 output chunks, each upcast to fp32 alone); with
    `compile`, both compiled as its recipes compile them (each layer; the loss's upcast and
    cross-entropy)."""
    import torch
    from torchtune import training
    from torchtune.models.llama3_2 import llama3_2
    from torchtune.modules.loss import CEWithChunkedOutputLoss

    torch.set_default_dtype(torch.bfloat16 if dtype == "bf16" else torch.float32)
    try:
        with torch.device(device):
            model = llama3_2(**dims)
    finally:
        torch.set_default_dtype(torch.float32)
    loss_fn = CEWithChunkedOutputLoss(num_output_chunks=8)
    model.set_num_output_chunks(loss_fn.num_output_chunks)
    if compile:
        training.compile_model(model, verbose=False)
        loss_fn = training.compile_loss(loss_fn, verbose=False)
    return model, loss_fn


def train(args: argparse.Namespace) -> dict[str, Any]:
    """Warm-up steps, then the timed windows: forward, chunked cross-entropy, backward, clip,
    fused AdamW (runner's defaults: betas 0.9/0.95, clipping at 1.0)."""
    import torch

    from runner.trainer.profiling import StepProfiler

    torch.manual_seed(0)
    dims = builder_dims(args.model)
    model, loss_fn = build(dims, args.device, args.dtype, args.compile)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), fused=True)
    shape = (args.batch_size, args.seq_len)
    tokens = torch.randint(0, dims["vocab_size"], shape, device=args.device)
    labels = torch.randint(0, dims["vocab_size"], shape, device=args.device)

    def step() -> torch.Tensor:
        loss = loss_fn(model(tokens), labels)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    start, count = profile_window(args.warmup)
    profiler = StepProfiler(
        enabled=args.profile_out is not None,
        start=start,
        steps=count,
        device=torch.device(args.device),
        out_dir=args.profile_out or Path("."),
    )
    profiler.check_window(first_step=1, total_steps=args.warmup)
    losses = []
    for number in range(1, args.warmup + 1):
        profiler.before_step(number)
        losses.append(step())
        profiler.after_step(number)
    profiler.stop(args.warmup)
    losses[-1].item()  # the host waits for the device: the timing starts from an idle queue
    sizes, rates = windows(args.warmup, args.steps), []
    for size in sizes:
        started = time.perf_counter()
        losses = [step() for _ in range(size)]
        torch.stack(losses).tolist()  # read as a logged step reads its window's losses
        rates.append(size * tokens.numel() / (time.perf_counter() - started))
    return {
        "arm": "bare",
        "compile": args.compile,
        "params": sum(p.numel() for p in model.parameters()),
        "tokens_per_s": overall_rate(sizes, rates),
        "window_tokens_per_s": rates,
        "peak_gib": _peak_gib(args.device),
        "graph_breaks": _graph_breaks(),
    }


def _graph_breaks() -> int:
    """torch._dynamo's count of graph breaks in this process (0 where nothing was compiled)."""
    from torch._dynamo.utils import counters

    return sum(counters["graph_break"].values())


def _peak_gib(device: str) -> float:
    import torch

    if device.startswith("cuda"):
        return torch.cuda.max_memory_allocated() / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def main() -> None:
    """Parses the arguments, trains, prints the JSON line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama3_2_1b", help="a conf/model/ name")
    parser.add_argument("--device", default="cuda", help="cuda (default), or cpu to try it")
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--profile-out", type=Path, help="profile the last 2 warm-up steps")
    args = parser.parse_args()
    import torch

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: no CUDA GPU is visible here; give --device cpu")
    if not (CONF_MODEL / f"{args.model}.yaml").is_file():
        parser.error(f"--model {args.model}: no conf/model/{args.model}.yaml")
    print(json.dumps(train(args)), flush=True)


if __name__ == "__main__":
    main()
