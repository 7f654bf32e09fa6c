"""Every GPU figure the project claims, in one command and one table, within a time budget.

    python scripts/gpu/gpu_report.py [--out outputs/gpu_report] [--budget-min 11]
        [--only train,deploy,pytest] [--checkpoint DIR]

On one CUDA GPU, with nothing but the project and its wheels (no network): the training benchmark on
a 1B Llama (conf/model/llama3_2_1b.yaml's dimensions, random init, the tiny tokenizer, generated
text packed into full rows, pure bf16) as `runner train` and as a bare loop of torchtune's own
builder (scripts/gpu/gpu_bare.py), each eager and compiled, tokens/s over the steps after the
warm-up and MFU; scripts/serving/bench_deploy.py on the runner arm's checkpoint at concurrency
1/8/32/128 (the default server, one admitting at every step, transformers.max_waiting_steps=0,
and one with the engine in its own process, transformers.process=true; the engine alone beside
them),
scripts/serving/profile_decode.py's decode step on it at 1 and 128 rows (its profile stays in the
stage's log) and scripts/serving/profile_engine.py's engine at 128 clients without the server
(tokens/s beside deploy's through HTTP, and where the engine's time goes); then `pytest -m gpu`.
Each stage runs in its own process under a time budget (its share of the total, plus what earlier
stages left unused): one that overruns is killed and reported so, and the table still prints. Each
stage's raw log stays under --out. Without CUDA it refuses, in one line, before doing anything.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from gpu_bare import builder_dims, profile_window
from gpu_table import MODES, Stage, param_count, peak_bf16, slug, table

ROOT = Path(__file__).resolve().parents[2]
MODEL = "llama3_2_1b"
# Shares of the budget, in the order the stages run, from their seconds on an H200 (2026-11-28:
# the train arms 54, 25, 63 and 27 s, runner's including its start-up and final checkpoint;
# the profiles 17 and 15 s, the decode profile's compiled steps estimated at 20 s more; pytest's
# four workers 188 s), with about a sixth more each. Deploy's is an estimate, since that run's
# overran (it now runs the engine alone in one process, `generate` by --repeat-seconds, and a
# third server): three servers' starts and warm-up, then 3 repeats of 2 s per side at each of 4
# concurrencies. The runner eager arm comes first: its checkpoint is
# what deploy serves and the profiles profile. The varlen arm (attention=varlen: FlashAttention's
# variable-length kernel where the default is flex attention, which decides the CUDA default) is
# estimated from the eager arm, less flex attention's compiling. Run as two calls of a lent GPU
# machine, `--only train,deploy --budget-min 8.5` and `--only pytest --budget-min 3.5` (docs:
# benchmarks).
SHARES = {
    "train runner eager": 0.09,
    "train bare eager": 0.05,
    "train runner compiled": 0.11,
    "train bare compiled": 0.05,
    "train runner eager varlen": 0.07,
    "deploy": 0.33,
    "profile decode": 0.07,
    "profile engine": 0.03,
    "pytest -m gpu": 0.31,
}
# The most one test of the pytest stage may take, where it sets no timeout of its own: well
# inside the stage's share, so that a stuck test is named rather than the stage stopped.
TEST_TIMEOUT_S = 150
# The most a runner arm's final checkpoint may run past its share (the 1B model's weights and
# AdamW state: about 14 GB to write).
CHECKPOINT_GRACE_S = 120
# The arm whose final checkpoint deploy serves and the profiles load.
SERVED_ARM = "train runner eager"
GROUPS = {
    "train": [s for s in SHARES if s.startswith("train")],
    "deploy": ["deploy", "profile decode", "profile engine"],
}
GROUPS["pytest"] = ["pytest -m gpu"]


def train_overrides(
    args: argparse.Namespace,
    text: Path,
    compile: bool,
    run: Path,
    *,
    where: tuple[str, str, str] = (MODEL, "gpu", "bf16"),
) -> list[str]:
    """`runner train` at 1B (`where`: model, compute, dtype), random init, the tiny tokenizer,
    packed generated text, pure bf16 on one GPU, logging (so reading its losses) once per
    warm-up-sized window, no evaluation, no checkpoint before the last step."""
    model, compute, dtype = where
    start, count = profile_window(args.warmup)
    return [
        f"model={model}",
        "model.source=null",
        "model.tokenizer='${runner_asset:tiny_tokenizer}'",
        "dataset=text",
        f"dataset.source={text}",
        "dataset.packing=true",
        f"dataset.max_seq_len={args.seq_len}",
        f"batch_size={args.batch_size}",
        f"compute={compute}",
        f"dtype={dtype}",
        f"compile={str(compile).lower()}",
        f"max_steps={args.warmup + args.steps}",
        f"runtime.log_every_n_steps={args.warmup}",
        # The steps the bare loop profiles too (--profile-out): outside the timed windows.
        "profile.enabled=true",
        f"profile.start_step={start}",
        f"profile.steps={count}",
        "runtime.save_every_n_steps=null",
        "runtime.progress_bar=false",
        "runtime.loggers=[]",
        "eval.strategy=no",
        "dataset.eval_samples=0",
        f"hydra.run.dir={run}",
    ]


def commands(args: argparse.Namespace, out: Path) -> dict[str, list[str]]:
    """Each stage's command line."""
    py, text = sys.executable, out / "text.txt"
    bare = [py, str(ROOT / "scripts" / "gpu" / "gpu_bare.py"), "--model", MODEL, "--device", "cuda"]
    bare += ["--dtype", "bf16", "--batch-size", str(args.batch_size), "--seq-len"]
    bare += [str(args.seq_len), "--warmup", str(args.warmup), "--steps", str(args.steps)]
    # Its last two warm-up steps profiled, as the runner arms profile theirs (train_overrides).
    profiles = {mode: out / slug(f"train bare {mode}") / "profile" for mode in MODES}
    train = [py, "-m", "runner", "train"]
    checkpoint = args.checkpoint or (
        out / slug(SERVED_ARM) / "checkpoints" / f"step_{args.warmup + args.steps}"
    )
    deploy = [
        py,
        str(ROOT / "scripts" / "serving" / "bench_deploy.py"),
        "--checkpoint",
        str(checkpoint),
    ]
    deploy += ["--device", "cuda", "--dtype", "bf16", "--concurrency", args.concurrency]
    deploy += ["--max-tokens", str(args.max_tokens), "--requests", str(args.requests)]
    # Repeats of about 2 s a side (the GPU's steps vary little; 4 s, the default, would not fit).
    deploy += ["--repeats", "3", "--repeat-seconds", "2", "--engines", "runner,engine"]
    # The GPU kit's wheels may lack aiohttp (docs: benchmarks): the SDK's clients then, as
    # bench_deploy's first line says, rather than a stage lost.
    deploy += ["--client", "http" if importlib.util.find_spec("aiohttp") else "openai"]
    # Beside the default: waiting sequences admitted at every step (the default until
    # 2026-11-29, when text-generation-inference's rule measured 1.75x its tokens/s at 32 clients
    # on the H200, one repeat, and 1.05-1.19x at 32 and 128 clients on two CPU cores:
    # docs/benchmarks.md), whose ratio confirms the default on the GPU; and the engine in a
    # process of its own, which decides PROCESS_BY_DEVICE["cuda"] (runner/deploy/engine_process.py).
    deploy += ["--variant", "transformers.max_waiting_steps=0"]
    deploy += ["--variant", "transformers.process=true"]
    profile = [
        py,
        str(ROOT / "scripts" / "serving" / "profile_decode.py"),
        "--checkpoint",
        str(checkpoint),
    ]
    profile += ["--device", "cuda", "--dtype", "bf16", "--rows", f"1,{max_concurrency(args)}"]
    # And compiled (transformers.compile, by layer on CUDA), which decides its default there.
    profile += ["--compile"]
    # One wave of requests per repeat, as deploy sends at its largest concurrency.
    engine = [
        py,
        str(ROOT / "scripts" / "serving" / "profile_engine.py"),
        "--checkpoint",
        str(checkpoint),
    ]
    engine += ["--device", "cuda", "--dtype", "bf16", "--concurrency", str(max_concurrency(args))]
    engine += ["--waves", "1", "--max-tokens", str(args.max_tokens), "--repeats", "3"]
    return {
        "train runner eager": train
        + train_overrides(args, text, False, out / slug("train runner eager")),
        "train bare eager": [*bare, "--profile-out", str(profiles["eager"])],
        "train runner compiled": train
        + train_overrides(args, text, True, out / slug("train runner compiled")),
        "train bare compiled": [*bare, "--compile", "--profile-out", str(profiles["compiled"])],
        "train runner eager varlen": train
        + train_overrides(args, text, False, out / slug("train runner eager varlen"))
        + ["attention=varlen"],
        "deploy": deploy,
        "profile decode": profile,
        "profile engine": engine,
        # Each test's outcome (-v) and seconds (--durations=0), which the table lists.
        "pytest -m gpu": [py, "-m", "pytest", "-o", "addopts=", "-ra", "-v"]
        + ["--durations=0", "-m", "gpu"]
        + pytest_workers()
        + gpu_test_files(),
    }


def gpu_test_files() -> list[str]:
    """The test files that hold tests marked gpu: test_gpu.py's runs through the CLI, and the
    other files' checks of one kernel or module on CUDA (varlen attention, the fused norm, the
    block mask). Those alone are collected: the GPU kit need not install what the other test
    files import (hypothesis, tensorboard), whose collection errors would stop the stage."""
    files = sorted((ROOT / "tests").glob("test_*.py"))
    return [str(file) for file in files if "pytest.mark.gpu" in file.read_text()]


def max_concurrency(args: argparse.Namespace) -> int:
    """The largest of --concurrency: the batch the decode step is profiled at beside 1."""
    return max(int(c) for c in args.concurrency.split(","))


def pytest_workers() -> list[str]:
    """Four pytest-xdist workers, test by test (tests of one xdist_group on one worker: those
    that share a run), where xdist is installed (the project's own options run whole files per
    worker, and test_gpu.py is most of them); else none. Each test trains or serves a tiny
    model, so four share one GPU with room to spare. Where pytest-timeout is installed, a test
    that sets no timeout of its own (test_gpu.py's do) fails by name past TEST_TIMEOUT_S."""
    workers = ["-n", "4", "--dist", "loadgroup"] if importlib.util.find_spec("xdist") else []
    has_timeout = importlib.util.find_spec("pytest_timeout")
    timeout = ["--timeout", str(TEST_TIMEOUT_S)] if has_timeout else []
    return workers + timeout


def run_stage(
    name: str, command: list[str], log: Path, budget_s: float, run: Path | None = None
) -> Stage:
    """`command` with its output in `log`, killed (its whole process group) past `budget_s`;
    a `runner train` arm (its run directory `run`) found writing its final checkpoint then has
    CHECKPOINT_GRACE_S more: its timed steps are done, and the write is no part of its figures
    (the time comes out of the later stages' shares)."""
    started = time.perf_counter()
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"}
    with log.open("w") as sink:
        sink.write(" ".join(command) + "\n")
        sink.flush()
        process = subprocess.Popen(
            command,
            stdout=sink,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=ROOT,
            start_new_session=True,
        )
        code = _wait(process, max(budget_s, 1))
        if code is None and run is not None and _checkpointing(run):
            code = _wait(process, CHECKPOINT_GRACE_S)
        if code is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            status = f"overran its {budget_s:.0f} s"
        else:
            status = "ok" if code == 0 else f"failed (exit {code})"
    return Stage(name, status, time.perf_counter() - started, log)


def _wait(process: subprocess.Popen[bytes], seconds: float) -> int | None:
    """The process's exit code, or None if it still runs after `seconds`."""
    try:
        return process.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        return None


def _checkpointing(run: Path) -> bool:
    """Whether the run's status.json says it is writing a checkpoint (runner.rundir's state)."""
    try:
        return json.loads((run / "status.json").read_text()).get("state") == "checkpointing"
    except (OSError, ValueError, AttributeError):
        return False


def skip_reason(command: list[str]) -> str | None:
    """Why a stage cannot start (deploy's checkpoint missing: the runner eager arm failed or
    overran before saving it), or None."""
    if "--checkpoint" in command:
        checkpoint = Path(command[command.index("--checkpoint") + 1])
        if not checkpoint.is_dir():
            return f"no checkpoint at {checkpoint} to serve"
    return None


def skipped(name: str, reason: str, log: Path) -> Stage:
    """A stage not run, its reason in its log (where the table reads it)."""
    log.write_text(reason + "\n")
    return Stage(name, "skipped", 0.0, log)


def heading(args: argparse.Namespace, device_name: str, params: int) -> str:
    """What was measured, where, and the peak that MFU divides by (or why MFU is blank)."""
    found = peak_bf16(device_name)
    peak = (
        f"{found[0]}, {found[1] / 1e12:,.0f} TFLOP/s dense bf16"
        if found
        else "MFU left blank: this GPU is not in gpu_table.py's PEAK_BF16 table"
    )
    return (
        f"GPU report on {device_name} ({peak})\n"
        f"1B Llama ({MODEL}'s dimensions, {params:,} parameters, random init), batch "
        f"{args.batch_size} x {args.seq_len} tokens, pure bf16: {args.steps} steps timed after "
        f"{args.warmup} of warm-up; MFU = 6 x parameters x tokens/s / peak"
    )


def budgets(names: list[str], total_s: float) -> list[float]:
    """Each stage's end, in seconds from the start: the selected stages' shares of the total,
    cumulated, so that time a stage leaves unused goes to the next."""
    whole = sum(SHARES[name] for name in names)
    ends, reached = [], 0.0
    for name in names:
        reached += SHARES[name] / whole * total_s
        ends.append(reached)
    return ends


def write_text(path: Path, lines: int) -> None:
    """Generated plain text (20 words, about 125 tokens, a line; a fixed vocabulary and seed)
    to pack: a line never splits across rows, so short lines leave little padding at a row's
    end (both arms count every position of a row, as its compute does)."""
    import random

    chooser = random.Random(0)
    words = "alpha beta gamma delta runner token model train config sweep deploy layer".split()
    path.write_text("".join(" ".join(chooser.choices(words, k=20)) + "\n" for _ in range(lines)))


def arguments(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, checked: an error names the flag and exits 2 before anything runs."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", type=Path, default=Path("outputs/gpu_report"), help="logs and report"
    )
    parser.add_argument("--budget-min", type=float, default=11.0, help="all stages together")
    parser.add_argument("--only", default="train,deploy,pytest", help="of train,deploy,pytest")
    parser.add_argument("--batch-size", type=int, default=4, help="rows per training step")
    parser.add_argument("--seq-len", type=int, default=2048, help="tokens per row")
    parser.add_argument("--warmup", type=int, default=5, help="steps not timed")
    parser.add_argument("--steps", type=int, default=20, help="steps timed after the warm-up")
    parser.add_argument("--concurrency", default="1,8,32,128", help="deploy's, comma-separated")
    parser.add_argument("--max-tokens", type=int, default=64, help="deploy: new tokens each")
    parser.add_argument(
        "--requests", type=int, default=16, help="deploy: per concurrency (at least c)"
    )
    parser.add_argument(
        "--checkpoint", type=Path, help="deploy: a checkpoint (default: the runner eager arm's)"
    )
    args = parser.parse_args(argv)
    for flag in ("budget_min", "batch_size", "seq_len", "warmup", "steps", "max_tokens"):
        if getattr(args, flag) <= 0:
            parser.error(f"--{flag.replace('_', '-')} {getattr(args, flag)}: give a number > 0")
    if args.requests <= 0:
        parser.error(f"--requests {args.requests}: give a number > 0")
    if not re.fullmatch(r"[1-9]\d*(,[1-9]\d*)*", args.concurrency):
        parser.error(f"--concurrency {args.concurrency!r}: give positive integers, e.g. 1,8,32")
    groups = args.only.split(",")
    if not groups or any(group not in GROUPS for group in groups):
        parser.error(f"--only {args.only!r}: give some of {','.join(GROUPS)}, comma-separated")
    args.stages = [name for name in SHARES if any(name in GROUPS[g] for g in groups)]
    if "deploy" in groups and "train" not in groups and args.checkpoint is None:
        parser.error("--only without train serves no checkpoint: give --checkpoint DIR")
    return args


def cuda_device_name() -> str | None:
    """The first CUDA device's name, or None where torch sees no CUDA device."""
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None


def main(argv: list[str] | None = None) -> int:
    """Checks the machine, runs the stages within their budgets, prints and saves the table."""
    started = time.perf_counter()
    args = arguments(argv)
    device_name = cuda_device_name()
    if device_name is None:
        print(
            "gpu_report: no CUDA GPU visible (torch.cuda.is_available() is False); it measures "
            "the GPU, so run it on a machine with one",
            file=sys.stderr,
        )
        return 2
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    # Lines of about 125 tokens: a quarter more than every step of a training arm packs.
    write_text(
        out / "text.txt", args.batch_size * args.seq_len * (args.warmup + args.steps) // 100 + 8
    )
    params = param_count(builder_dims(MODEL))
    found = peak_bf16(device_name)
    print(heading(args, device_name, params), flush=True)
    lines, stages = commands(args, out), []
    for name, end in zip(args.stages, budgets(args.stages, args.budget_min * 60), strict=True):
        left = end - (time.perf_counter() - started)
        log = out / f"{slug(name)}.log"
        reason = skip_reason(lines[name])
        run = out / slug(name) if name.startswith("train runner") else None
        stages.append(
            skipped(name, reason, log) if reason else run_stage(name, lines[name], log, left, run)
        )
        if run is not None and name != SERVED_ARM:
            # Only the served arm's checkpoint is read: the others' (the 1B's weights and AdamW
            # state, about 14 GB each) would fill most of the lent machine's 64 GiB disk.
            shutil.rmtree(run / "checkpoints", ignore_errors=True)
        print(f"{name}: {stages[-1].status} in {stages[-1].seconds:.0f} s ({log})", flush=True)
    report = (
        heading(args, device_name, params)
        + "\n"
        + table(stages, out, args.warmup, params, found[1] if found else None)
    )
    (out / "report.txt").write_text(report + "\n")
    print(report)
    return 0 if all(stage.status == "ok" for stage in stages) else 1


if __name__ == "__main__":
    sys.exit(main())
