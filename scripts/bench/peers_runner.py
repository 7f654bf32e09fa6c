"""bench_peers.py's runner arms: `runner train` through its CLI, as its user gets it, with the
benchmark's checkpoint, data and optimizer; step times from RUN/train.log, losses from
RUN/metrics.jsonl."""

from __future__ import annotations

import json
import re
from datetime import datetime
from pathlib import Path

from peers_setup import CLIP_GRAD_NORM, OPTIMIZER, SEED

# runner's arms besides its defaults: `compile=true` (inductor on each decoder layer; off by
# default: it costs seconds of start-up that only runs of hundreds of steps recoup), and
# `dataset.padding_free=false` (each batch padded to its longest sample, as before
# padding-free batches: what they buy), and dataset.max_forward_tokens (capped; these two are
# not run unless --arms names them).
RUNNER_ARMS = {
    "runner": [],
    "compiled": ["compile=true"],
    "padded": ["dataset.padding_free=false"],
    "capped": [],  # dataset.max_forward_tokens: runner_arm_overrides
}


def runner_overrides(spec: dict) -> list[str]:
    """runner train's overrides for the benchmark's checkpoint, data, batch and optimizer."""
    return [
        "model=hf",
        f"model.source={spec['checkpoint']}",
        "dataset=instruct",
        f"dataset.source={spec['data']}",
        "dataset.column_map.instruction=input",
        "dataset.column_map.input=null",
        "dataset.eval_samples=0",
        "compute=cpu",
        "dtype=fp32",
        "method=full",
        f"optimizer.lr={OPTIMIZER['lr']}",
        f"optimizer.betas=[{OPTIMIZER['betas'][0]},{OPTIMIZER['betas'][1]}]",
        f"optimizer.eps={OPTIMIZER['eps']}",
        f"optimizer.weight_decay={OPTIMIZER['weight_decay']}",
        "optimizer.warmup_steps=0",
        "optimizer.cosine_decay=false",
        "eval.strategy=no",
        "runtime.save_every_n_steps=null",
        "runtime.log_every_n_steps=1",
        "runtime.progress_bar=false",
        f"max_steps={spec['steps']}",
        "epochs=1",
        f"batch_size={spec['batch_size']}",
        f"clip_grad_norm={CLIP_GRAD_NORM}",
        f"seed={SEED}",
    ]


def runner_arm_overrides(arm: str, spec: dict) -> list[str]:
    """What a runner arm sets beyond the defaults; capped: forward passes of at most as many
    tokens as tune_best's step holds positions (its packs' width x packs a step)."""
    if arm == "capped":
        packs = spec["tune_packs"]
        return [f"dataset.max_forward_tokens={packs['max_seq_len'] * packs['batch_size']}"]
    return RUNNER_ARMS[arm]


def runner_command(spec: dict, run_dir: Path, extra: list[str] = ()) -> list[str]:
    return ["runner", "train", *runner_overrides(spec), *extra, f"hydra.run.dir={run_dir}"]


STEP_LINE = re.compile(r"^\[([\d-]+ [\d:]+,\d+)\]\[runner\.recipe\]\[INFO\] - step (\d+)/")


def read_runner(run_dir: Path, start: float) -> dict:
    """Losses from metrics.jsonl; step times between the step lines of train.log (each step's
    whole loop, its logging included); the first step's end from the start of the command."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if "loss" in r]
    ends = []
    for line in (run_dir / "train.log").read_text().splitlines():
        match = STEP_LINE.match(line)
        if match:
            ends.append(datetime.strptime(match[1], "%Y-%m-%d %H:%M:%S,%f").timestamp())
    times = [ends[0] - start] + [b - a for a, b in zip(ends, ends[1:], strict=False)]
    return {"losses": losses, "step_times": times, "first_step_s": ends[0] - start}
