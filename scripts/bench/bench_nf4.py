"""QLoRA's base for a model whose projections are not whole torchao NF4 blocks (SmolLM2-135M:
576 x 576): torchao's NF4 with the largest scaler block that divides (runner.models.nf4, what
method=qlora does with torchtune's backend) beside bitsandbytes' NF4 (blocks of 64, its scalers
double-quantized in blocks of 256), per projection shape: reconstruction error, bytes a weight,
and the time of a forward and backward of the quantized linear (the QLoRA step's base part).

    python scripts/bench/bench_nf4.py [--device cpu] [--repeats 20]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

# SmolLM2-135M's projections: q/o, k/v (3 kv heads of 64), gate/up, down.
SHAPES = ((576, 576), (192, 576), (1536, 576), (576, 1536))


def torchao_nf4(weight: torch.Tensor) -> tuple[torch.Tensor, float, object]:
    from torchao.dtypes.nf4tensor import linear_nf4

    from runner.models.nf4 import NF4_BLOCK, scaler_block
    from runner.models.torchtune_boundary import to_nf4

    block = scaler_block(weight.numel(), 1)
    assert block is not None
    nf4 = to_nf4(weight, NF4_BLOCK, block)
    size = nf4.quantized_data.numel() + nf4.quantized_scalers.numel()
    size += 4 * (nf4.quantization_factor.numel() + nf4.scaler_mean.numel())
    return nf4.get_original_weight(), size / weight.numel(), lambda x: linear_nf4(x, nf4)


def bitsandbytes_nf4(weight: torch.Tensor) -> tuple[torch.Tensor, float, object]:
    import bitsandbytes as bnb

    linear = bnb.nn.Linear4bit(
        weight.shape[1], weight.shape[0], bias=False, compute_dtype=weight.dtype, quant_type="nf4"
    )
    linear.weight = bnb.nn.Params4bit(weight.clone(), requires_grad=False, quant_type="nf4")
    linear = linear.to(weight.device)
    state = linear.weight.quant_state
    size = linear.weight.numel() + state.absmax.numel()  # uint8 data, uint8 absmax
    size += 4 * (state.state2.absmax.numel() + 1)
    restored = bnb.functional.dequantize_4bit(linear.weight.data, state)
    return restored, size / weight.numel(), linear


def timed(forward: object, x: torch.Tensor, repeats: int) -> float:
    times = []
    for _ in range(repeats + 2):
        started = time.perf_counter()
        out = forward(x.requires_grad_())  # type: ignore[operator]
        out.sum().backward()
        times.append(time.perf_counter() - started)
    return statistics.median(times[2:]) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error(
            f"--repeats {args.repeats}: at least 1, "
            "the 2 runs of each before them are warm-up, not timed"
        )
    torch.manual_seed(0)
    print(f"{'shape':<11} {'quantizer':<34} {'rel. error':>10} {'bytes/w':>8} {'fwd+bwd ms':>10}")
    for rows, columns in SHAPES:
        weight = (0.02 * torch.randn(rows, columns)).to(args.device)
        x = torch.randn(512, columns, device=args.device)
        for name, quantize in (
            ("bitsandbytes NF4 (baseline)", bitsandbytes_nf4),
            ("torchao NF4, runner's scaler block", torchao_nf4),
        ):
            restored, per_weight, forward = quantize(weight)
            error = ((restored.float() - weight).norm() / weight.norm()).item()
            ms = timed(forward, x.clone(), args.repeats)
            print(f"{rows}x{columns:<7} {name:<34} {error:>10.4f} {per_weight:>8.3f} {ms:>10.2f}")


if __name__ == "__main__":
    main()
