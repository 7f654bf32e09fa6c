"""The training loss alone, eager beside compiled as `compile=true` compiles it: torchtune's
chunked cross-entropy (8 chunks, each upcast to fp32), forward and backward over random logits.

    python scripts/bench/bench_loss.py [--tokens 2048] [--vocab 49152] [--repeats 10] [--device cpu]

Prints each side's median seconds per forward and backward with the range over the repeats
(interleaved, the first two of each dropped as warm-up), and eager/compiled. The logits come
from one generator seed, the same for both sides.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torchtune.modules.loss import CEWithChunkedOutputLoss
from torchtune.training import compile_loss  # what runner's recipe calls with compile=true

WARMUP = 2


def timed(loss_fn: CEWithChunkedOutputLoss, logits: torch.Tensor, labels: torch.Tensor) -> float:
    """Seconds for one forward and backward of `loss_fn` over `logits` in its chunks."""
    chunks = [c.detach().requires_grad_() for c in logits.chunk(loss_fn.num_output_chunks, 1)]
    if logits.is_cuda:
        torch.cuda.synchronize()
    began = time.perf_counter()
    loss_fn(chunks, labels).backward()
    if logits.is_cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - began


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048, help="positions in the batch")
    parser.add_argument("--vocab", type=int, default=49152, help="output classes")
    parser.add_argument("--repeats", type=int, default=10, help="timed repeats of each side")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    args = parser.parse_args()
    for name in ("tokens", "vocab"):
        if getattr(args, name) < 1:  # an empty batch gave a ratio of nothing, exit 0
            parser.error(f"--{name} {getattr(args, name)}: give 1 or more")
    if args.repeats < 1:
        parser.error(
            f"--repeats {args.repeats}: at least 1, "
            f"the {WARMUP} runs of each side before them are warm-up, not timed"
        )
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(1, args.tokens, args.vocab, generator=generator).to(args.device)
    labels = torch.randint(0, args.vocab, (1, args.tokens), generator=generator).to(args.device)
    sides = {
        "eager": CEWithChunkedOutputLoss(num_output_chunks=8),
        "compiled": compile_loss(CEWithChunkedOutputLoss(num_output_chunks=8), verbose=False),
    }
    times: dict[str, list[float]] = {name: [] for name in sides}
    for _ in range(WARMUP + args.repeats):
        for name, loss_fn in sides.items():
            times[name].append(timed(loss_fn, logits, labels))
    print(
        f"chunked cross-entropy, forward and backward: {args.tokens} tokens x {args.vocab} "
        f"classes on {args.device}, {torch.get_num_threads()} threads, {args.repeats} repeats"
    )
    medians = {}
    for name, measured in times.items():
        kept = measured[WARMUP:]
        medians[name] = statistics.median(kept)
        print(f"{name:9} median {medians[name]:.3f} s  range {min(kept):.3f}-{max(kept):.3f}")
    print(f"eager/compiled {medians['eager'] / medians['compiled']:.2f}")


if __name__ == "__main__":
    main()
