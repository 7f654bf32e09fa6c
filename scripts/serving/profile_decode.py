"""Where a decode step's time goes: `runner deploy`'s step at a few batch sizes, under
torch.profiler, without the server or the engine's thread around it.

    python scripts/serving/profile_decode.py [--checkpoint DIR] [--device auto] [--dtype auto]
        [--rows 1,128] [--prompt-tokens 128] [--steps 20] [--top 12] [--compile]

For each row count: that many prompts of --prompt-tokens tokens prefilled together into the
engine's batch (runner/deploy/kv_cache.py), then --steps decode steps timed (greedy, one host
copy of the tokens each, as the engine takes them), then as many again under the profiler.
Prints each row count's milliseconds per step and tokens/s, and the ops (with CUDA, the
kernels) that took the most time in the profiled steps. On CUDA the steps replay CUDA graphs
as the engine's do; the first steps of a window size capture them and are not timed. Without
--checkpoint it builds bench_deploy.py's tiny model. With --compile, each row count is timed
again with the step fused by torch.compile (deploy's transformers.compile=true), its first steps
compiling untimed, and a line `rows N compiled: ... (X the eager step)` follows the eager one.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
from deploy_sides import STAND_IN, make_tiny_checkpoint

from runner.deploy.decode_step import DecodeStep
from runner.deploy.kv_cache import BatchCache
from runner.deploy.loading import LoadedModel, load_checkpoint


def prefilled(step: DecodeStep, loaded: LoadedModel, rows: int, prompt_tokens: int) -> BatchCache:
    """A batch of `rows` prompts of `prompt_tokens` tokens each, prefilled by the engine's own
    prefill (in inference mode, as its thread runs), each row's last prompt token next."""
    ids = torch.randint(5, loaded.tokenizer.vocab_size, (rows, prompt_tokens)).tolist()
    with torch.inference_mode():
        prefill = step.prefill(ids)
        batch = BatchCache(prefill.cache, padded=step.graphs, compiled=step.compiled)
        batch.append_rows(prefill, [prompt[-1] for prompt in ids])
    return batch


def decode(step: DecodeStep, batch: BatchCache, steps: int) -> None:
    """`steps` decode steps of every row: the engine's step, greedy, one host copy each."""
    with torch.inference_mode():
        for _ in range(steps):
            logits = step(batch, batch.next_window())
            next_ids = logits[: batch.rows].argmax(dim=-1)
            batch.advance(next_ids)
            next_ids.tolist()


def model_parser(doc: str) -> argparse.ArgumentParser:
    """A profile's command line with the model it loads: --checkpoint, --device, --dtype."""
    parser = argparse.ArgumentParser(
        description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--checkpoint", type=Path, help="a checkpoint dir (default: a tiny model)")
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda[:N]")
    parser.add_argument("--dtype", default="auto", help="auto (fp32 on CPU, bf16 on GPU), ...")
    parser.add_argument(
        "--stand-in", action="store_true", help="without --checkpoint: bench_deploy's stand-in"
    )
    return parser


def load_model(args: argparse.Namespace) -> tuple[Path, LoadedModel]:
    """The checkpoint loaded as `runner deploy` loads it, or bench_deploy.py's tiny model (its
    stand-in with --stand-in)."""
    with tempfile.TemporaryDirectory() as scratch:
        shape = STAND_IN if args.stand_in else ()
        checkpoint = args.checkpoint or make_tiny_checkpoint(Path(scratch) / "tiny", *shape)
        loaded = load_checkpoint(
            checkpoint, device=args.device, dtype=args.dtype, max_model_len=None
        )
    return checkpoint, loaded


def main() -> None:
    parser = model_parser(__doc__)
    parser.add_argument("--rows", default="1,128", help="batch sizes, comma-separated")
    parser.add_argument("--prompt-tokens", type=int, default=128, help="tokens per prompt")
    parser.add_argument("--steps", type=int, default=20, help="decode steps timed, then profiled")
    parser.add_argument("--top", type=int, default=12, help="ops listed per batch size")
    parser.add_argument(
        "--compile", action="store_true", help="each row count again, the step compiled"
    )
    args = parser.parse_args()
    try:
        args.rows = [int(r) for r in args.rows.split(",")]
    except ValueError:
        parser.error(f"--rows {args.rows}: give batch sizes as integers, comma-separated")
    if min(args.rows) < 1:
        parser.error(f"--rows {args.rows}: give batch sizes of 1 or more")
    checkpoint, loaded = load_model(args)
    device = loaded.model.device
    cuda = device.type == "cuda"
    activities = [torch.profiler.ProfilerActivity.CPU]
    if cuda:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    if cuda:
        torch.cuda.set_device(device)  # graphs replay on the current device's stream (cuda:N)
    name = torch.cuda.get_device_name(device) if cuda else "CPU"
    print(
        f"{checkpoint} on {device} ({name}), {loaded.model.dtype}, prompts of "
        f"{args.prompt_tokens} tokens, {args.steps} steps timed, CUDA graphs: {cuda}"
    )
    counts = args.rows
    eager = {
        rows: profile(DecodeStep(loaded.model, graphs=cuda), loaded, rows, args, activities)
        for rows in counts
    }
    if args.compile:  # after every eager step: a compiled step compiles the model's layers
        step = DecodeStep(loaded.model, graphs=cuda, compiled=True, layers=cuda)
        for rows in counts:
            profile(step, loaded, rows, args, activities, eager=eager[rows])


def profile(
    step: DecodeStep,
    loaded: LoadedModel,
    rows: int,
    args: argparse.Namespace,
    activities: list[torch.profiler.ProfilerActivity],
    eager: float | None = None,
) -> float:
    """Seconds a decode step at `rows` rows, printed as a line (beside the `eager` step's when
    given: this one is compiled), then the ops that took the most time in as many steps again."""
    batch = prefilled(step, loaded, rows, args.prompt_tokens)
    # Captures (on CUDA), compiles (compiled) and warms up; then the window stays the same size
    # while timed, if the steps fit in its bucket: the widths below say whether they did.
    began = time.perf_counter()
    decode(step, batch, 3)
    warm = time.perf_counter() - began
    width = batch.window.width
    began = time.perf_counter()
    decode(step, batch, args.steps)
    seconds = (time.perf_counter() - began) / args.steps
    label, beside = ("", "") if eager is None else (" compiled", f", {eager / seconds:.2f}x eager")
    print(
        f"\nrows {rows}{label}: {seconds * 1e3:.2f} ms a step, {rows / seconds:,.0f} tokens/s "
        f"(window {width} -> {batch.window.width} columns, {step.captured} graphs{beside}; "
        f"the first 3 steps, compiling and capturing, {warm:.1f} s)",
        flush=True,
    )
    with torch.profiler.profile(activities=activities) as profiler:
        decode(step, batch, args.steps)
    sort = "self_cuda_time_total" if batch.device.type == "cuda" else "self_cpu_time_total"
    print(profiler.key_averages().table(sort_by=sort, row_limit=args.top), flush=True)
    return seconds


if __name__ == "__main__":
    main()
