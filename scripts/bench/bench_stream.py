"""A streamed corpus beside the same corpus read whole: tokens/s, peak RSS and time to the first
step, at growing corpus sizes, with 2 training processes.

    python scripts/bench/bench_stream.py [--sizes-gb 0.5 1 2] [--steps 30] [--repeats 3]

It writes a text corpus of random words (letters and spaces, 1500 bytes a record) as
uncompressed parquet shards of 128 MB (row groups of 8192 records), as large as the largest of
--sizes-gb, and points each size at the first shards that hold it. Each arm is `runner train
dataset=text` on the tiny model with 2 processes (compute.nproc_per_node=2, one thread each),
batch 8 of samples cut at 256 tokens, --steps steps, no evaluation, no checkpoint:

- stream: dataset.streaming=true (shuffle windows of 10000 records of each process's share);
- map: the default, which reads and checks the whole split before the first step (datasets
  writes it to its Arrow cache, a fresh scratch directory for each run) and memory-maps it in
  each process.

The arms take turns --repeats times per size. tokens/s is the median of a run's logged per-step
figures after its first 5 steps; peak RSS is the largest single process of the run's tree (the
launcher or a training process: os.wait4); first step is the seconds from the command's start to
its first logged step. Each figure: median [min-max] over repeats. A flat stream RSS across
sizes is the claim; the map arm's first step grows with the corpus.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

RECORD_BYTES = 1500
SHARD_BYTES = 128 * 2**20
WARMUP = 5
# Records per parquet row group (12 MB), the unit a reader loads at a time.
ROW_GROUP = 8192


def write_corpus(folder: Path, total_bytes: int) -> list[tuple[Path, int]]:
    """Shards of random words under `folder`: [(path, text bytes)], 128 MB each."""
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    records = SHARD_BYTES // RECORD_BYTES
    shards = []
    for n in range(-(-total_bytes // SHARD_BYTES)):
        letters = rng.integers(0, 32, size=records * RECORD_BYTES, dtype=np.uint8)
        # 26 letters; the other values are spaces (a word of ~5 letters on average).
        text = np.where(letters < 26, letters + ord("a"), ord(" ")).astype(np.uint8)
        offsets = np.arange(0, records * RECORD_BYTES + 1, RECORD_BYTES, dtype=np.int32)
        column = pa.StringArray.from_buffers(records, pa.py_buffer(offsets), pa.py_buffer(text))
        path = folder / f"shard-{n:05d}.parquet"
        pq.write_table(pa.table({"text": column}), path, compression="none", use_dictionary=False)
        shards.append((path, records * RECORD_BYTES))
    return shards


def corpus_of(shards: list[tuple[Path, int]], size: int, root: Path) -> Path:
    """A directory of links to the first shards that hold `size` bytes of text."""
    folder = root / f"corpus-{size}"
    folder.mkdir()
    held = 0
    for path, text_bytes in shards:
        (folder / f"train-{path.name}").symlink_to(path)
        held += text_bytes
        if held >= size:
            break
    return folder


def run_arm(arm: str, corpus: Path, args: argparse.Namespace, scratch: Path) -> dict[str, float]:
    run = Path(tempfile.mkdtemp(dir=scratch)) / "run"
    command = [sys.executable, "-m", "runner", "train", "compute=cpu", "dtype=fp32"]
    command += ["compute.nproc_per_node=2", "dataset=text", f"dataset.source={corpus}"]
    command += ["dataset.format=parquet", "dataset.max_seq_len=256", "batch_size=8"]
    command += [f"max_steps={args.steps}", "runtime.log_every_n_steps=1"]
    command += ["runtime.progress_bar=false", "runtime.save_every_n_steps=null"]
    command += ["eval.strategy=no", "dataset.eval_samples=0", f"hydra.run.dir={run}"]
    if arm == "stream":
        command += ["dataset.streaming=true"]
    # A fresh datasets cache for each run: the map arm reads its corpus whole every time.
    shutil.rmtree(scratch / "hf", ignore_errors=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_DATASETS_CACHE": str(scratch / "hf")}
    started = time.monotonic()
    proc = subprocess.Popen(
        command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    first_step = None
    metrics = run / "metrics.jsonl"
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            break
        if first_step is None and metrics.is_file() and metrics.stat().st_size:
            first_step = time.monotonic() - started
        time.sleep(0.2)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode:
        raise SystemExit(f"{arm} failed:\n{proc.stderr.read()[-3000:]}")
    lines = [json.loads(line) for line in metrics.read_text().splitlines()]
    rate = statistics.median(line["tokens_per_s"] for line in lines if line["step"] > WARMUP)
    shutil.rmtree(run.parent)
    first = first_step or float("nan")
    return {"tokens_per_s": rate, "rss_mb": usage.ru_maxrss / 1024, "first_step_s": first}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes-gb", type=float, nargs="+", default=[0.5, 1.0, 2.0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--arms", nargs="+", choices=["stream", "map"], default=["stream", "map"])
    args = parser.parse_args()
    if args.steps <= WARMUP:
        parser.error(
            f"--steps {args.steps}: at least {WARMUP + 1}, "
            f"the first {WARMUP} are warm-up, not timed"
        )
    sizes = [int(gb * 2**30) for gb in args.sizes_gb]
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_TMP")) as tmp:
        scratch = Path(tmp)
        shards = write_corpus(scratch / "shards", max(sizes))
        results: dict[tuple[str, int], list[dict[str, float]]] = {}
        for size in sizes:
            corpus = corpus_of(shards, size, scratch)
            for repeat in range(args.repeats):
                arms = args.arms if repeat % 2 == 0 else list(reversed(args.arms))
                for arm in arms:
                    results.setdefault((arm, size), []).append(run_arm(arm, corpus, args, scratch))
    print(
        f"2 processes x 1 thread, tiny model, batch 8 x 256 tokens, {args.steps} steps, "
        f"{args.repeats} repeats: median [min-max]"
    )
    print(f"{'corpus':>8} {'arm':>7} {'tokens/s':>20} {'peak RSS MB':>20} {'first step s':>20}")
    for (arm, size), runs in sorted(results.items(), key=lambda item: (item[0][1], item[0][0])):
        cells = []
        for key, digits in (("tokens_per_s", 0), ("rss_mb", 0), ("first_step_s", 1)):
            values = [run[key] for run in runs]
            median = statistics.median(values)
            cells.append(f"{median:.{digits}f} [{min(values):.{digits}f}-{max(values):.{digits}f}]")
        print(f"{size / 2**30:>6.1f}GB {arm:>7} {cells[0]:>20} {cells[1]:>20} {cells[2]:>20}")


if __name__ == "__main__":
    main()
