"""runner train beside the tools a user would pick instead: torchtune's `tune run`, the Hugging
Face Trainer and a bare PyTorch loop, each at its default and at its best, on the same
checkpoint, data and optimizer, in one run.

    python scripts/bench/bench_peers.py [--size default] [--lengths mixed] [--repeats 3]
                                        [--steps 12] [--vocab N] [--preload LIB]

At start it writes one LlamaForCausalLM checkpoint with transformers (random init, seed 0, the
tiny tokenizer's vocabulary, or --vocab tokens: an output layer as wide as a real model's) and
one instruct data file of the sample task's words: with --lengths mixed (the default) records
of many lengths, k words each with k log-normal (a long right tail, as real instruction data
has), so that a batch padded to its longest sample is mostly pad; with --lengths fixed all of
one length, so that nothing pads and only per-step overhead differs. Then each arm trains that
checkpoint for --steps optimizer steps in its own subprocess, taking turns --repeats times with
the order rotated (a neighbour on the machine hits all alike):

- runner: `runner train model=hf model.source=CKPT dataset=instruct ...` through its CLI, as
  its user gets it: dataset.padding_free packs each batch's samples into one row (positions
  restarting per sample, SDPA on each sample's span alone), fused AdamW. Step times from the
  step lines of RUN/train.log, losses from RUN/metrics.jsonl (logged every step);
- compiled: the same with `compile=true` (inductor compiles each decoder layer; its first steps
  are slow, and --warmup leaves them out);
- tune_default: `tune run full_finetune_single_device --config tune.yaml`, FullModelHFCheckpointer
  on CKPT, the llama3_2 builder with the checkpoint's dimensions, CEWithChunkedOutputLoss,
  instruct_dataset on the same file with its default packed: False (each batch padded to its
  longest sample), torch.optim.AdamW's default kernel; step times and losses from its
  DiskLogger file. Its tokenizer is runner's ChatTokenizer (torchtune 0.6.1 has no model
  tokenizer for a Hugging Face tokenizer.json), so both tokenize the same way, on the fly;
- tune_best: the same with `dataset.packed: True` (PackedDataset: packs of tokenizer.max_seq_len
  tokens, the longest sample rounded up to 128, which packing needs), as many packs a batch as
  hold a step's tokens, and AdamW(fused=True). Its packs are other batches than the others'
  (packed in file order, then shuffled), so its step-1 loss is not compared;
- hf_default: transformers' Trainer on LlamaForCausalLM.from_pretrained(CKPT), fed the samples
  tokenized once ahead of time, in the same order (a sequential sampler over runner's order),
  each batch padded to its longest sample, optim adamw_torch;
- hf_best: the same with DataCollatorWithFlattening (each batch one row, position_ids
  restarting per sample, which transformers' masking turns into a block-causal mask for SDPA,
  on the CPU too), attn_implementation="sdpa" and optim="adamw_torch_fused";
- bare: a hand-written loop over runner's own batches and attention (the same one row, SDPA
  per sample): torchtune's builder loaded from CKPT, AdamW, cross-entropy on the whole logits,
  clip, step. ours/bare is runner's overhead over the same arithmetic;
- capped (only when --arms names it): runner with `dataset.max_forward_tokens` at the
  positions of tune_best's step (its packs' width x packs a step): a batch with more tokens runs
  as several forward passes within its step, so that no forward holds more than tune_best's;
- padded (only when --arms names it): runner with `dataset.padding_free=false`, each batch
  padded to its longest sample: ours/padded is what padding-free batches buy.

All: AdamW (lr, betas, eps, weight decay alike), constant lr with no warmup, clip at 1.0, fp32,
one process, loss logged every step, runner's sample order (DistributedSampler, seed 0, epoch 0;
tune shuffles the same way). tokens/s is the same measure for all: the samples' own tokens (no
padding) of the steps after --warmup over the sum of those steps' times, per repeat; the table
gives its median and range over repeats. Peak RSS is the arm's process tree's (os.wait4), under
glibc's malloc unless --preload gives every arm another allocator.
Step-1 losses of the arms that train the same batches must agree within 1e-3, else they are not
training alike. The run ends with one line per ratio of runner's tokens/s to an arm's.

This file runs the arms and reports; each arm lives in a module of its own beside it (peers_runner,
peers_tune, peers_hf, peers_bare), on what they share (peers_setup: checkpoint, data, order).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from peers_bare import run_bare
from peers_hf import run_hf
from peers_runner import RUNNER_ARMS, read_runner, runner_arm_overrides, runner_command
from peers_setup import LENGTHS, REPO, SIZES, prepare
from peers_tune import read_tune, tune_command, tune_config

ARMS = (
    "runner",
    "compiled",
    "tune_default",
    "tune_best",
    "hf_default",
    "hf_best",
    "bare",
    "padded",
    "capped",
)
DEFAULT_ARMS = ARMS[:7]
# The peers' arms: (tool, at its best).
PEER_ARMS = {
    "tune_default": ("tune", False),
    "tune_best": ("tune", True),
    "hf_default": ("hf", False),
    "hf_best": ("hf", True),
}
# The ratio lines the run ends with: ours/<arm>, in this order.
RATIO_ARMS = ("tune_best", "hf_best", "tune_default", "hf_default", "bare", "padded")
LOSS_TOLERANCE = 1e-3
# A 1-minute load average above this before the run: say that the figures are noisy.
QUIET_LOAD = 0.5


# ---- running an arm and reading what it recorded ------------------------------------------
def run_child(command: list[str], log: Path, timeout_s: float) -> tuple[float, float]:
    """Runs `command` to its end (output to `log`); its start time and its tree's peak RSS (MiB).

    os.wait4 gives the child's own rusage, whose maxrss covers the processes it waited for.
    """
    start = time.time()
    with open(log, "w") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, cwd=REPO)
    deadline = time.monotonic() + timeout_s
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            break
        if time.monotonic() > deadline:
            proc.kill()
            pid, status, usage = os.wait4(proc.pid, 0)
            break
        time.sleep(0.05)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        tail = "".join(log.read_text().splitlines(keepends=True)[-30:])
        raise SystemExit(f"{shlex.join(command)} exited {proc.returncode}:\n{tail}")
    return start, usage.ru_maxrss / 1024


def run_arm(arm: str, workdir: Path, spec: dict, repeat: int, timeout_s: float) -> dict:
    """One run of one arm in its own subprocess: losses, step times, peak RSS."""
    out = workdir / f"{arm}-{repeat}"
    out.mkdir()
    log = out / "output.log"
    if arm in RUNNER_ARMS:
        run_dir = out / "run"
        start, rss = run_child(
            runner_command(spec, run_dir, runner_arm_overrides(arm, spec)), log, timeout_s
        )
        result = read_runner(run_dir, start)
    elif PEER_ARMS.get(arm, ("",))[0] == "tune":
        best = PEER_ARMS[arm][1]
        config = out / "tune.yaml"
        config.write_text(tune_config(spec, out / "tune", best))
        _, rss = run_child(tune_command(config), log, timeout_s)
        trained = spec["tune_packs"]["trained_per_step"] if best else spec["trained_per_step"]
        result = read_tune(out / "tune" / "logs" / "log.txt", trained)
    else:
        command = [
            sys.executable,
            __file__,
            "--arm",
            arm,
            "--workdir",
            str(workdir),
            "--out",
            str(out),
        ]
        _, rss = run_child(command, log, timeout_s)
        result = json.loads((out / "result.json").read_text())
    steps = spec["tune_packs"]["steps"] if arm == "tune_best" else spec["steps"]
    if len(result["losses"]) != steps or len(result["step_times"]) != steps:
        raise SystemExit(
            f"{arm} logged {len(result['losses'])} losses and "
            f"{len(result['step_times'])} step times, not {steps}; see {out}"
        )
    # The samples' own tokens (no padding) of each step: tune_best's packs hold other samples.
    tokens = (
        spec["tune_packs"]["tokens_per_step"] if arm == "tune_best" else spec["tokens_per_step"]
    )
    return {**result, "peak_rss_mib": rss, "tokens_per_step": tokens}


def tiny_first_step(workdir: Path, times: int = 3) -> float:
    """Median time from `runner train` on the embedded default (the tiny model, its sample
    data; on the CPU in fp32, as every arm here) to the end of its first optimizer step."""
    seconds = []
    for repeat in range(times):
        run_dir = workdir / f"tiny-{repeat}"
        command = [
            "runner",
            "train",
            "compute=cpu",
            "dtype=fp32",
            "max_steps=1",
            "eval.strategy=no",
            "runtime.progress_bar=false",
            f"hydra.run.dir={run_dir}",
        ]
        start, _ = run_child(command, workdir / f"tiny-{repeat}.log", 600)
        seconds.append(read_runner(run_dir, start)["first_step_s"])
    return statistics.median(seconds)


def cfg_job_latency(spec: dict, workdir: Path, times: int = 3) -> float:
    """Median wall time of `runner train --cfg job` with the benchmark's overrides."""
    command = runner_command(spec, workdir / "cfg-job-run")[:-1] + ["--cfg", "job"]
    seconds = []
    for _ in range(times):
        start = time.perf_counter()
        subprocess.run(command, cwd=REPO, check=True, capture_output=True)
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


# ---- report ---------------------------------------------------------------------------------
def machine_facts() -> str:
    import torch
    import torchtune
    import transformers

    cpu = platform.processor() or "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    return (
        f"cpu: {cpu}; {usable} usable cores of {os.cpu_count()}; torch threads "
        f"{torch.get_num_threads()}; load average {load}\n"
        f"torch {torch.__version__}, torchtune {torchtune.__version__}, transformers "
        f"{transformers.__version__}, python {platform.python_version()}"
    )


def arm_rows(results: dict[str, list[dict]], warmup: int) -> dict[str, dict]:
    """Per arm: tokens/s (the samples' tokens, no padding, of the steps after warm-up over the
    sum of those steps' times; median and range over repeats), median s/step, peak RSS and
    step-1 loss."""
    rows = {}
    for arm, runs in results.items():
        rates = [
            sum(run["tokens_per_step"][warmup:]) / sum(run["step_times"][warmup:]) for run in runs
        ]
        rows[arm] = {
            "tokens_s": statistics.median(rates),
            "range": (min(rates), max(rates)),
            "s_step": statistics.median(
                statistics.median(run["step_times"][warmup:]) for run in runs
            ),
            "rss": max(run["peak_rss_mib"] for run in runs),
            "loss1": runs[0]["losses"][0],
        }
    return rows


def summarize(results: dict[str, list[dict]], warmup: int) -> list[str]:
    """The table of arm_rows, agreement of the arms that train the same batches, and
    ours/<arm>."""
    rows, lines = arm_rows(results, warmup), []
    lines.append(
        f"{'arm':<14}{'tokens/s':>10}{'range':>13}{'s/step':>9}{'peak RSS MiB':>14}"
        f"{'step-1 loss':>13}"
    )
    for arm, row in rows.items():
        low, high = row["range"]
        # tune_best trains packs of other samples: its step-1 loss is not comparable.
        loss = f"{row['loss1']:>13.5f}" if arm != "tune_best" else f"{'(others)':>13}"
        lines.append(
            f"{arm:<14}{row['tokens_s']:>10.0f}{f'{low:.0f}-{high:.0f}':>13}"
            f"{row['s_step']:>9.3f}{row['rss']:>14.0f}{loss}"
        )
    first_losses = [
        run["losses"][0] for arm, runs in results.items() if arm != "tune_best" for run in runs
    ]
    gap = max(first_losses) - min(first_losses)
    verdict = "AGREE" if gap <= LOSS_TOLERANCE else "DISAGREE"
    lines.append(
        f"step-1 loss: {verdict} (largest difference {gap:.2e} over every run of the arms "
        f"training the same batches; tolerance {LOSS_TOLERANCE:g})"
    )
    if verdict == "DISAGREE":  # which runs: each arm's step-1 loss, repeat by repeat
        for arm, runs in results.items():
            if arm != "tune_best":
                losses = " ".join(f"{run['losses'][0]:.5f}" for run in runs)
                lines.append(f"  {arm}: {losses}")

    def ratios(ours: str) -> list[str]:
        return [
            f"ours/{arm} {rows[ours]['tokens_s'] / rows[arm]['tokens_s']:.2f}"
            for arm in RATIO_ARMS
            if arm in rows
        ]

    if "compiled" in rows:
        lines.append("compiled: " + "  ".join(ratios("compiled")))
    # Last, one line per ratio: runner as its user gets it.
    if "runner" in rows:
        lines.extend(ratios("runner"))
    return lines


def write_json(path: Path, argv: list[str], setup: str, rows: dict[str, dict]) -> None:
    """The run's figures for scripts/docs/figures.py's picture: the command, the machine, the
    setup, and each arm's tokens/s (median and range)."""
    record = {
        "command": "python " + shlex.join([os.path.relpath(__file__, REPO), *argv]),
        "date": time.strftime("%Y-%m-%d"),
        "machine": machine_facts(),
        "setup": setup,
        "arms": {
            arm: {"tokens_s": row["tokens_s"], "low": row["range"][0], "high": row["range"][1]}
            for arm, row in rows.items()
        },
    }
    path.write_text(json.dumps(record, indent=1) + "\n")
    print(f"figures written to {path}")


def describe(spec: dict, args: argparse.Namespace) -> str:
    """Model, data lengths, padding share, steps and repeats, in two lines."""
    lengths = spec["sample_tokens"]
    pad = 1 - sum(spec["tokens_per_step"]) / sum(spec["padded_per_step"])
    return (
        f"model: Llama, {spec['parameters'] / 1e6:.1f}M parameters ({args.size}: "
        f"{spec['shape']}); {args.steps} steps of {args.batch_size} samples, tokens/s over "
        f"steps {args.warmup + 1}-{args.steps} (their tokens over their summed time), "
        f"{args.repeats} repeats\n"
        f"data ({args.lengths}): sample tokens min {lengths[0]}, median "
        f"{statistics.median(lengths):.0f}, max {lengths[-1]}; "
        f"{statistics.mean(spec['tokens_per_step']):.0f} tokens a step, "
        f"{statistics.mean(spec['trained_per_step']):.0f} trained; padded to each batch's "
        f"longest sample, {pad:.0%} of a batch is pad\n"
        f"{gathered_attention(spec, args.batch_size)}"
    )


def gathered_attention(spec: dict, batch_size: int) -> str:
    """What compile=true's attention on the CPU computes (runner.models.attention.Gathered):
    each step's samples padded to their bucket's longest, over their own attention (sum of
    length squared), against one bucket (each padded to the batch's longest)."""
    from runner.models.attention import BUCKETS, buckets

    samples = json.loads(Path(spec["samples"]).read_text())
    lengths = [len(sample["tokens"]) for sample in samples]

    def padded(batch: list[int], groups: list[list[int]]) -> float:
        cost = sum(len(g) * max(batch[i] for i in g) ** 2 for g in groups)
        return cost / sum(length**2 for length in batch)

    steps = [lengths[i : i + batch_size] for i in range(0, len(lengths), batch_size)]
    one = [padded(b, [list(range(len(b)))]) for b in steps]
    some = [padded(b, buckets(b)) for b in steps]

    def spread(values: list[float]) -> str:
        return f"{statistics.median(values):.2f}x ({min(values):.2f}-{max(values):.2f})"

    return (
        f"compiled attention (Gathered, {BUCKETS} buckets of like length): {spread(some)} the "
        f"samples' own, median (range) over steps; one bucket would be {spread(one)}"
    )


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=SIZES, default="default")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument(
        "--warmup",
        type=int,
        default=3,
        help="first steps left out of tokens/s and s/step (at least 1)",
    )
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument(
        "--vocab",
        type=int,
        help="the checkpoint's vocabulary (default: the tiny tokenizer's 264); a real model's "
        "(32000 and up) makes the output layer a real share of the arithmetic",
    )
    parser.add_argument(
        "--lengths",
        choices=LENGTHS,
        default="mixed",
        help="mixed: samples of many lengths, as real data (padding costs the padded arms); "
        "fixed: all one length (no arm pads: the per-step overhead alone)",
    )
    parser.add_argument(
        "--arms",
        default=",".join(DEFAULT_ARMS),
        help=f"comma-separated subset of {','.join(ARMS)} (default: all but padded)",
    )
    parser.add_argument(
        "--preload",
        type=Path,
        help="a shared library that every arm's processes preload (LD_PRELOAD): another "
        "allocator (tcmalloc, jemalloc) for all arms alike",
    )
    parser.add_argument("--timeout", type=float, default=600, help="seconds per arm run")
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    parser.add_argument(
        "--json",
        type=Path,
        help="also write each arm's tokens/s to this file (docs/data/bench_peers.json is what "
        "scripts/docs/figures.py draws)",
    )
    # An arm's own process (hf, bare): reads WORKDIR/spec.json, writes OUT/result.json.
    parser.add_argument("--arm", choices=("hf_default", "hf_best", "bare"), help=argparse.SUPPRESS)
    parser.add_argument("--workdir", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.arms = [a for a in args.arms.split(",") if a]
    unknown = set(args.arms) - set(ARMS)
    if unknown:
        parser.error(f"--arms: unknown {sorted(unknown)}; choose from {','.join(ARMS)}")
    if args.preload and not args.preload.is_file():
        parser.error(f"--preload {args.preload}: no such file; give the library's path")
    if not 1 <= args.warmup < args.steps:
        parser.error(f"--warmup {args.warmup}: give 1 <= warmup < --steps ({args.steps})")
    return args


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    if args.arm:
        spec = json.loads((Path(args.workdir) / "spec.json").read_text())
        out = Path(args.out)
        if args.arm == "bare":
            result = run_bare(spec, out)
        else:
            result = run_hf(spec, out, best=PEER_ARMS[args.arm][1])
        Path(args.out, "result.json").write_text(json.dumps(result))
        return
    print("$ python " + shlex.join([os.path.relpath(__file__), *argv]))
    print(machine_facts(), flush=True)
    if args.preload:
        # Inherited by every arm's subprocess (this process keeps the allocator it started with).
        os.environ["LD_PRELOAD"] = str(args.preload.resolve())
        print(f"every arm preloads {os.environ['LD_PRELOAD']}")
    if os.getloadavg()[0] > QUIET_LOAD:
        print(
            f"WARNING: load average {os.getloadavg()[0]:.2f} > {QUIET_LOAD}: the machine is "
            "not quiet; neighbours make step times noisy (compare ratios, not figures)"
        )
    workdir = Path(tempfile.mkdtemp(prefix="bench_peers-"))
    try:
        spec = prepare(workdir, args.size, args.steps, args.batch_size, args.lengths, args.vocab)
        print(describe(spec, args), flush=True)
        results: dict[str, list[dict]] = {arm: [] for arm in args.arms}
        for repeat in range(args.repeats):
            order = args.arms[repeat % len(args.arms) :] + args.arms[: repeat % len(args.arms)]
            for arm in order:
                start = time.perf_counter()
                results[arm].append(run_arm(arm, workdir, spec, repeat, args.timeout))
                print(
                    f"  repeat {repeat + 1} {arm}: {time.perf_counter() - start:.1f}s wall",
                    flush=True,
                )
        if "runner" in results:
            first = statistics.median(run["first_step_s"] for run in results["runner"])
            print(
                f"start-up: runner train -> end of its first optimizer step {first:.2f}s here "
                f"(median of {args.repeats}), {tiny_first_step(workdir):.2f}s on the embedded "
                f"default (median of 3); runner train --cfg job "
                f"{cfg_job_latency(spec, workdir):.2f}s (median of 3)"
            )
        print(f"load average at the end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
        print("\n".join(summarize(results, args.warmup)))
        if args.json:
            write_json(args.json, argv, describe(spec, args), arm_rows(results, args.warmup))
    finally:
        if args.keep:
            print(f"work directory kept: {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main(sys.argv[1:])
