"""Tokens/s and peak memory of the torchtune backend beside the transformers backend.

    python scripts/bench/bench_backends.py [--steps 6] [--batch-size 4] [--warmup 1] [--device cpu]

One Llama checkpoint (written by transformers, about 25M parameters, the test tokenizer) is
trained through `runner train model=hf model.source=DIR` with model.backend=torchtune (the llama3
family's builder) and model.backend=transformers (LlamaForCausalLM), on the same data, seed,
batches and optimizer, each in a fresh process (so that peak RSS is its own). tokens/s is the
median of the logged steps after `--warmup`; peak memory is the training process's maximum
resident set size (CUDA: its peak allocated memory is not read; RSS only). Step 1's loss is
printed too: the two backends compute the same model, so it agrees to float rounding.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BACKENDS = ("torchtune", "transformers")


def train(source: Path, backend: str, args: argparse.Namespace, out: Path) -> dict[str, float]:
    """One run; its median tokens/s, peak RSS (MiB) and step-1 loss."""
    run = out / backend
    command = [
        sys.executable,
        "-m",
        "runner",
        "train",
        "model=hf",
        f"model.source={source}",
        f"model.backend={backend}",
        f"compute={'gpu' if args.device == 'cuda' else 'cpu'}",
        "dtype=fp32",
        f"max_steps={args.steps}",
        f"batch_size={args.batch_size}",
        "loss=chunked_ce",
        "eval.strategy=no",
        "dataset.eval_samples=0",
        "runtime.save_every_n_steps=null",
        "runtime.log_every_n_steps=1",
        "runtime.progress_bar=false",
        "runtime.loggers=[]",
        f"hydra.run.dir={run}",
    ]
    log = out / f"{backend}.log"
    with log.open("w") as sink:
        proc = subprocess.Popen(command, cwd=out, stdout=sink, stderr=subprocess.STDOUT)
        # wait4: this child's own peak RSS (with the processes it waited for), not the largest
        # of all children so far.
        _, status, usage = os.wait4(proc.pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        sys.exit(f"the {backend} run failed:\n{log.read_text()[-3000:]}")
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "tokens_per_s" in r]
    timed = [r["tokens_per_s"] for r in steps if r["step"] > args.warmup]
    return {
        "tokens_per_s": statistics.median(timed),
        "peak_rss_mib": usage.ru_maxrss / 1024,
        "first_loss": steps[0]["loss"],
    }


def parameter_count(source: Path) -> int:
    from safetensors import safe_open

    with safe_open(str(source / "model.safetensors"), "pt") as weights:
        return sum(math.prod(weights.get_slice(k).get_shape()) for k in weights.keys())  # noqa: SIM118


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=1, help="steps left out of tokens/s")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    args = parser.parse_args()
    if args.steps <= args.warmup:
        parser.error(
            f"--steps {args.steps}: at least {args.warmup + 1}, "
            f"the first {args.warmup} (--warmup) are warm-up, not timed"
        )
    sys.path.insert(0, str(ROOT))
    from tests.hf_backend_fixtures import write_arch_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        source = write_arch_checkpoint("llama", Path(tmp) / "llama")
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(source)
        parameters = parameter_count(source)
        results = {backend: train(source, backend, args, Path(tmp)) for backend in BACKENDS}
    print(
        f"Llama checkpoint by transformers: {parameters / 1e6:.1f}M parameters, "
        f"{config.num_hidden_layers} layers, hidden "
        f"{config.hidden_size}; {args.steps} steps of batch {args.batch_size} on {args.device}, "
        f"fp32, chunked CE; tokens/s = median after {args.warmup} warmup steps"
    )
    print(f"{'backend':<14}{'tokens/s':>12}{'peak RSS MiB':>16}{'step-1 loss':>14}")
    for backend, found in results.items():
        print(
            f"{backend:<14}{found['tokens_per_s']:>12,.0f}{found['peak_rss_mib']:>16,.0f}"
            f"{found['first_loss']:>14.6f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
