"""The optimizer step alone, runner's beside torchtune's recipe's: the gradients scaled by the
step's tokens, clipped to norm 1.0, fused AdamW, zeroed.

    python scripts/bench/bench_optimizer_step.py [--model llama3_2_1b] [--layers 2] [--dtype bf16]
        [--device cpu] [--repeats 15]

runner: `Optimization.step`, which reads the gradients once for their norm and writes them once,
by the scale and the clipping coefficient together. torchtune's full_finetune recipe:
`training.scale_grads` (a multiply for each parameter), then `clip_grad_norm_` (the norm, then a
multiply), then the same AdamW. The parameters are conf/model/MODEL.yaml's, cut to --layers
decoder layers (so that a 1B model's shapes fit a small host), with random gradients from one
seed, set afresh before each step (outside the timing). Prints each side's median milliseconds
with the range over the repeats (interleaved, the first two of each dropped as warm-up) and
torchtune/runner.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from omegaconf import OmegaConf
from torchtune import training
from torchtune.models.llama3_2 import llama3_2

from runner.trainer.optimization import Optimization

CONF = Path(__file__).resolve().parents[2] / "conf"
WARMUP = 2
MAX_NORM = 1.0


def build(model: str, layers: int, dtype: torch.dtype, device: str) -> torch.nn.Module:
    """The zoo model's shapes with `layers` decoder layers, in `dtype` on `device`."""
    dims = OmegaConf.to_container(OmegaConf.load(CONF / "model" / f"{model}.yaml").builder)
    assert isinstance(dims, dict)
    dims["num_layers"] = layers
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            return llama3_2(**dims)
    finally:
        torch.set_default_dtype(torch.float32)


def optimizer_settings() -> dict:
    """runner's default AdamW (conf/optimizer/adamw.yaml), fused (its `null`), constant lr."""
    settings = OmegaConf.to_container(OmegaConf.load(CONF / "optimizer" / "adamw.yaml"))
    assert isinstance(settings, dict)
    return settings | {"fused": True, "warmup_steps": 0, "cosine_decay": False}


def timed(step, model: torch.nn.Module, grads: list[torch.Tensor]) -> float:
    """Seconds of one `step` over fresh copies of `grads`."""
    for param, grad in zip(model.parameters(), grads, strict=True):
        param.grad = grad.clone()
    if grads[0].is_cuda:
        torch.cuda.synchronize()
    began = time.perf_counter()
    step()
    if grads[0].is_cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - began


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama3_2_1b", help="a conf/model/ name")
    parser.add_argument("--layers", type=int, default=2, help="decoder layers kept")
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=15, help="timed repeats of each side")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error(
            f"--repeats {args.repeats}: at least 1, "
            f"the {WARMUP} runs of each side before them are warm-up, not timed"
        )
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    scale = torch.tensor(1 / 8192, device=args.device)
    models, steps = {}, {}
    for side in ("runner", "torchtune"):
        torch.manual_seed(0)
        models[side] = build(args.model, args.layers, dtype, args.device)
    settings = optimizer_settings()
    runner = Optimization(
        OmegaConf.create(settings),
        models["runner"].parameters(),
        total_steps=10**6,
        clip_grad_norm=MAX_NORM,
    )
    steps["runner"] = lambda: runner.step(models["runner"], scale)
    arguments = {k: v for k, v in settings.items() if k not in ("_component_", "warmup_steps")}
    arguments.pop("cosine_decay")
    tune_optimizer = torch.optim.AdamW(models["torchtune"].parameters(), **arguments)

    def tune_step() -> None:
        training.scale_grads(models["torchtune"], scale)
        torch.nn.utils.clip_grad_norm_(models["torchtune"].parameters(), MAX_NORM)
        tune_optimizer.step()
        tune_optimizer.zero_grad(set_to_none=True)

    steps["torchtune"] = tune_step
    generator = torch.Generator(device=args.device).manual_seed(0)
    grads = [
        torch.randn(p.shape, generator=generator, device=args.device, dtype=dtype)
        for p in models["runner"].parameters()
    ]
    count = sum(g.numel() for g in grads)
    times: dict[str, list[float]] = {"runner": [], "torchtune": []}
    for _ in range(WARMUP + args.repeats):
        for side in times:
            times[side].append(timed(steps[side], models[side], grads))
    print(
        f"{args.model} cut to {args.layers} layers: {count:,} parameters in {len(grads)} "
        f"tensors, {args.dtype}, {args.device}; median of {args.repeats} (range)",
        file=sys.stderr,
    )
    medians = {}
    for side, measured in times.items():
        kept = [t * 1000 for t in measured[WARMUP:]]
        medians[side] = statistics.median(kept)
        print(f"{side:10} {medians[side]:8.2f} ms  ({min(kept):.2f}-{max(kept):.2f})")
    print(f"torchtune/runner {medians['torchtune'] / medians['runner']:.2f}")


if __name__ == "__main__":
    main()
