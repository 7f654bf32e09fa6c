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
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

REPO = Path(__file__).resolve().parents[2]
TOKENIZER_DIR = REPO / "runner" / "assets" / "tiny_tokenizer"
SAMPLE_DATA = REPO / "runner" / "assets" / "sample" / "train.jsonl"
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
# Llama shapes: hidden, layers, heads, kv heads, MLP width. default is ~25M parameters, so that
# compute, not per-step overhead, decides on 2 CPU cores.
SIZES = {
    "tiny": (64, 2, 4, 2, 256),
    "small": (256, 4, 8, 4, 1024),
    "default": (512, 8, 8, 4, 1536),
    "large": (768, 12, 12, 4, 2048),
}
OPTIMIZER = {"lr": 1e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.0}
CLIP_GRAD_NORM = 1.0
SEED = 0
# Records of the sample task's words. fixed: one shape (the same instruction and word length
# give the same token count: no arm pads). mixed: k words a record, k drawn from a log-normal
# (the long right tail of instruction data such as alpaca's, shorter, so that a 2-core run ends
# in minutes), clipped to [1, MAX_WORDS]: a batch padded to its longest sample is mostly pad.
INSTRUCTION, WORD_LENGTH = "Reverse:", 5
LENGTHS = ("mixed", "fixed")
MEDIAN_WORDS, SIGMA, MAX_WORDS = 3.5, 0.9, 30
LOSS_TOLERANCE = 1e-3
# torchtune's packs: as long as the longest sample rounded up to this many tokens (packing
# needs tokenizer.max_seq_len, and a sample longer than it is refused).
PACK_ROUNDING = 128
IGNORE_INDEX = -100
# A 1-minute load average above this before the run: say that the figures are noisy.
QUIET_LOAD = 0.5


# ---- setup: checkpoint, data, the order every arm trains in --------------------------------
def write_checkpoint(directory: Path, size: str, vocab: int | None = None) -> int:
    """A random LlamaForCausalLM (seed 0) and the tiny tokenizer in `directory`; its size.
    `vocab`: an output layer of that many tokens (the tokenizer's own ids are the first)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from runner.models.tokenizer import ChatTokenizer

    hidden, layers, heads, kv_heads, mlp = SIZES[size]
    tokenizer = ChatTokenizer(str(TOKENIZER_DIR))
    config = LlamaConfig(
        vocab_size=max(vocab or 0, tokenizer.vocab_size),
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        intermediate_size=mlp,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_id,
        eos_token_id=tokenizer.eos_id,
        pad_token_id=tokenizer.pad_id,
        torch_dtype="float32",
    )
    torch.manual_seed(SEED)
    model = LlamaForCausalLM(config)
    model.save_pretrained(directory, safe_serialization=True)
    for file in TOKENIZER_DIR.iterdir():
        shutil.copy(file, directory / file.name)
    return sum(p.numel() for p in model.parameters())


def write_data(path: Path, count: int, lengths: str) -> None:
    """`count` instruct records of the sample task, as {input, output} lines: all one shape
    (fixed), or of k words each with k drawn from a seeded log-normal (mixed)."""
    rows = [json.loads(line) for line in SAMPLE_DATA.read_text().splitlines()]
    if lengths == "fixed":
        rows = [r for r in rows if r["instruction"] == INSTRUCTION]
        rows = [r for r in rows if len(r["input"]) == WORD_LENGTH][:count]
        if len(rows) < count:
            raise SystemExit(f"{SAMPLE_DATA} has only {len(rows)} records of one shape")
        records = [
            {"input": f"{r['instruction']}\n{r['input']}", "output": r["output"]} for r in rows
        ]
    else:
        draw = random.Random(SEED)
        words = [r["input"] for r in rows]
        records = []
        for _ in range(count):
            k = min(MAX_WORDS, max(1, round(draw.lognormvariate(math.log(MEDIAN_WORDS), SIGMA))))
            chosen = draw.sample(words, k)
            answer = " ".join(word[::-1] for word in reversed(chosen))
            records.append({"input": f"{INSTRUCTION}\n{' '.join(chosen)}", "output": answer})
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def runner_order(count: int) -> list[int]:
    """The sample order of runner's first epoch in one process (and of tune's, shuffled)."""
    from torch.utils.data import DistributedSampler

    sampler = DistributedSampler(range(count), num_replicas=1, rank=0, shuffle=True, seed=SEED)
    sampler.set_epoch(0)
    return list(sampler)


def tokenize(checkpoint: Path, data: Path) -> list[dict[str, list[int]]]:
    """Each record as runner tokenizes it: tokens and labels (-100 on the prompt), unshifted."""
    from runner.data.transforms import InstructToMessages
    from runner.models.tokenizer import ChatTokenizer
    from runner.models.torchtune_boundary import SFTTransform

    transform = SFTTransform(
        InstructToMessages(
            {"instruction": "input", "input": None, "output": "output"}, False, None
        ),
        ChatTokenizer(str(checkpoint)),
    )
    samples = []
    for line in data.read_text().splitlines():
        sample = transform(json.loads(line))
        samples.append({"tokens": sample["tokens"], "labels": [int(x) for x in sample["labels"]]})
    return samples


def tokenized_samples(size: str, count: int, lengths: str) -> list[dict[str, list[int]]]:
    """`count` records of the benchmark's data, tokenized as runner does, with the checkpoint
    of `size` written to a temporary directory (for the one-process benchmarks beside this)."""
    with tempfile.TemporaryDirectory() as work:
        checkpoint, data = Path(work, "checkpoint"), Path(work, "train.jsonl")
        checkpoint.mkdir()
        write_checkpoint(checkpoint, size)
        write_data(data, count, lengths)
        return tokenize(checkpoint, data)


def random_model(size: str) -> torch.nn.Module:
    """torchtune's llama3_2 builder at `size`, random init (seed 0), the tiny tokenizer's
    vocabulary (for the one-process benchmarks beside this)."""
    import torch

    from runner.models.torchtune_boundary import llama3_2_builders

    hidden, layers, heads, kv_heads, mlp = SIZES[size]
    torch.manual_seed(SEED)
    return llama3_2_builders.llama3_2(
        vocab_size=264, num_layers=layers, num_heads=heads, num_kv_heads=kv_heads,
        embed_dim=hidden, intermediate_dim=mlp, max_seq_len=2048, tie_word_embeddings=False,
    )  # fmt: skip


def prepare(
    workdir: Path, size: str, steps: int, batch_size: int, lengths: str, vocab: int | None = None
) -> dict:
    """Writes checkpoint, data and the ordered pre-tokenized samples; the facts arms share."""
    from runner.models.tokenizer import ChatTokenizer

    checkpoint, data = workdir / "checkpoint", workdir / "train.jsonl"
    checkpoint.mkdir()
    parameters = write_checkpoint(checkpoint, size, vocab)
    count = steps * batch_size
    write_data(data, count, lengths)
    samples = tokenize(checkpoint, data)
    ordered = [samples[i] for i in runner_order(count)]
    if lengths == "fixed":
        assert len({len(s["tokens"]) for s in samples}) == 1
    (workdir / "ordered_samples.json").write_text(json.dumps(ordered))
    batches = [ordered[i * batch_size : (i + 1) * batch_size] for i in range(steps)]
    hidden, layers, heads, kv_heads, mlp = SIZES[size]
    spec = {
        "checkpoint": str(checkpoint),
        "data": str(data),
        "samples": str(workdir / "ordered_samples.json"),
        "steps": steps,
        "batch_size": batch_size,
        "lengths": lengths,
        "parameters": parameters,
        "pad_id": ChatTokenizer(str(checkpoint)).pad_id,
        "sample_tokens": sorted(len(s["tokens"]) for s in samples),
        # Each step's samples' tokens (no padding), the trained (label) ones, and the tokens of
        # the batch padded to its longest sample.
        "tokens_per_step": [sum(len(s["tokens"]) for s in b) for b in batches],
        "trained_per_step": [
            sum(label != IGNORE_INDEX for s in b for label in s["labels"]) for b in batches
        ],
        "padded_per_step": [len(b) * max(len(s["tokens"]) for s in b) for b in batches],
        "shape": {
            "hidden": hidden,
            "layers": layers,
            "heads": heads,
            "kv_heads": kv_heads,
            "mlp": mlp,
            "vocab": json.loads((checkpoint / "config.json").read_text())["vocab_size"],
        },
    }
    spec["tune_packs"] = tune_packs(samples, spec)
    (workdir / "spec.json").write_text(json.dumps(spec))
    return spec


def pack_width(samples: list[dict[str, list[int]]]) -> int:
    """tune_best's packs' length (its max_seq_len): the longest sample rounded up to
    PACK_ROUNDING tokens."""
    longest = max(len(s["tokens"]) for s in samples)
    return -(-longest // PACK_ROUNDING) * PACK_ROUNDING


def tune_packs(samples: list[dict[str, list[int]]], spec: dict) -> dict:
    """What torchtune's recipe trains with `dataset.packed: True`: PackedDataset's packs of the
    samples in file order (it packs before it shuffles), max_seq_len the longest sample rounded
    up to PACK_ROUNDING, batches of as many packs as hold about a step's tokens of the other
    arms, in its sampler's order; each step's sample tokens and trained tokens. Its steps are
    as many as those packs make (at most --steps)."""
    from torchtune.datasets import PackedDataset

    pad = spec["pad_id"]
    assert all(pad not in s["tokens"] for s in samples), "a sample holds the pad token"
    max_seq_len = pack_width(samples)
    packs = PackedDataset(samples, max_seq_len=max_seq_len, padding_idx=pad)
    rows = max(1, round(statistics.mean(spec["tokens_per_step"]) / max_seq_len))
    order = runner_order(len(packs))
    steps = min(spec["steps"], len(packs) // rows)
    tokens, trained = [], []
    for step in range(steps):
        batch = [packs[i] for i in order[step * rows : (step + 1) * rows]]
        tokens.append(sum(int((p["tokens"] != pad).sum()) for p in batch))
        trained.append(sum(int((p["labels"] != IGNORE_INDEX).sum()) for p in batch))
    return {
        "max_seq_len": max_seq_len,
        "batch_size": rows,
        "steps": steps,
        "tokens_per_step": tokens,
        "trained_per_step": trained,
    }


# ---- the arms -------------------------------------------------------------------------------
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


def tune_config(spec: dict, out: Path, best: bool) -> str:
    """torchtune's full_finetune_single_device config for the same model, data and optimizer:
    as its user gets it (its instruct_dataset unpacked, each batch padded to its longest
    sample; torch.optim.AdamW's default, for-each kernel), or `best`: `dataset.packed: True`
    (PackedDataset's packs, with tokenizer.max_seq_len, which packing needs) and AdamW's fused
    kernel."""
    shape = spec["shape"]
    packs = spec["tune_packs"]
    config = {
        "output_dir": str(out),
        "model": {
            "_component_": "torchtune.models.llama3_2.llama3_2",
            "vocab_size": shape["vocab"],
            "num_layers": shape["layers"],
            "num_heads": shape["heads"],
            "num_kv_heads": shape["kv_heads"],
            "embed_dim": shape["hidden"],
            "intermediate_dim": shape["mlp"],
            "max_seq_len": 2048,
            "rope_base": 500000,
            "norm_eps": 1e-5,
            # The checkpoint's config.json has no rope scaling.
            "scale_factor": 1,
            "tie_word_embeddings": False,
        },
        "tokenizer": {
            "_component_": "runner.models.tokenizer.ChatTokenizer",
            "path": spec["checkpoint"],
            "max_seq_len": packs["max_seq_len"] if best else None,
        },
        "dataset": {
            "_component_": "torchtune.datasets.instruct_dataset",
            "source": "json",
            "data_files": spec["data"],
            "split": "train",
            "column_map": {"input": "input", "output": "output"},
            "train_on_input": False,
            "packed": best,
        },
        "seed": SEED,
        "shuffle": True,
        "checkpointer": {
            "_component_": "torchtune.training.FullModelHFCheckpointer",
            "checkpoint_dir": spec["checkpoint"],
            "checkpoint_files": ["model.safetensors"],
            "recipe_checkpoint": None,
            "output_dir": str(out),
            "model_type": "LLAMA3",
        },
        "resume_from_checkpoint": False,
        "batch_size": packs["batch_size"] if best else spec["batch_size"],
        "epochs": 1,
        "max_steps_per_epoch": packs["steps"] if best else spec["steps"],
        "gradient_accumulation_steps": 1,
        "optimizer": {
            "_component_": "torch.optim.AdamW",
            **OPTIMIZER,
            "betas": list(OPTIMIZER["betas"]),
            **({"fused": True} if best else {}),
        },
        "optimizer_in_bwd": False,
        "loss": {"_component_": "torchtune.modules.loss.CEWithChunkedOutputLoss"},
        "clip_grad_norm": CLIP_GRAD_NORM,
        "compile": False,
        "device": "cpu",
        "dtype": "fp32",
        "enable_activation_checkpointing": False,
        "enable_activation_offloading": False,
        "metric_logger": {
            "_component_": "torchtune.training.metric_logging.DiskLogger",
            "log_dir": str(out / "logs"),
            "filename": "log.txt",
        },
        "log_every_n_steps": 1,
        "log_peak_memory_stats": False,
        "profiler": {"_component_": "torchtune.training.setup_torch_profiler", "enabled": False},
    }
    return json.dumps(config, indent=2)  # JSON is YAML


def tune_command(config: Path) -> list[str]:
    # `tune run`, through this interpreter (its console script may not be on PATH).
    return [
        sys.executable,
        "-m",
        "torchtune._cli.tune",
        "run",
        "full_finetune_single_device",
        "--config",
        str(config),
    ]


class StepClock:
    """Wall time at the end of each optimizer step, from the start of training."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.ends: list[float] = []

    def tick(self) -> None:
        self.ends.append(time.perf_counter())

    def step_times(self) -> list[float]:
        return [b - a for a, b in zip([self.start, *self.ends], self.ends, strict=False)]


def run_hf(spec: dict, out: Path, best: bool) -> dict:
    """transformers' Trainer on the checkpoint, fed the ordered pre-tokenized samples: as its
    user gets it (batches padded to the longest sample, optim adamw_torch), or `best`:
    DataCollatorWithFlattening (each batch one row, position_ids restarting per sample, which
    transformers turns into a block-causal mask for SDPA), attn_implementation="sdpa" and
    optim="adamw_torch_fused"."""
    import torch
    from torch.utils.data import SequentialSampler
    from transformers import (
        DataCollatorWithFlattening,
        LlamaForCausalLM,
        Trainer,
        TrainerCallback,
        TrainingArguments,
    )

    samples = json.loads(Path(spec["samples"]).read_text())
    dataset = [{"input_ids": s["tokens"], "labels": s["labels"]} for s in samples]
    clock = StepClock()

    class Clock(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            clock.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            clock.tick()

    losses = []

    class InOrder(Trainer):
        # Trainer shuffles with its own sampler; the arms train in one order.
        def _get_train_sampler(self, *args, **kwargs):
            return SequentialSampler(self.train_dataset)

        # Its log rounds the loss to 4 digits; the step's own loss, unrounded.
        def compute_loss(self, *args, **kwargs):
            loss = super().compute_loss(*args, **kwargs)
            losses.append(loss.detach())
            return loss

    def collate(batch: list[dict]) -> dict:
        """Padded on the right to the longest sample, as DataCollatorForSeq2Seq pads; no
        attention mask: under the causal mask no real token sees the pad after it."""
        width = max(len(s["input_ids"]) for s in batch)
        pads = [width - len(s["input_ids"]) for s in batch]
        return {
            "input_ids": torch.tensor(
                [s["input_ids"] + [spec["pad_id"]] * n for s, n in zip(batch, pads, strict=True)]
            ),
            "labels": torch.tensor(
                [s["labels"] + [IGNORE_INDEX] * n for s, n in zip(batch, pads, strict=True)]
            ),
        }

    # Flattened, a sample's first label becomes -100 (runner's samples' first label, BOS's,
    # already is): the same trained tokens.
    collator = DataCollatorWithFlattening() if best else collate
    attention = {"attn_implementation": "sdpa"} if best else {}
    model = LlamaForCausalLM.from_pretrained(spec["checkpoint"], dtype=torch.float32, **attention)
    args = TrainingArguments(
        output_dir=str(out),
        per_device_train_batch_size=spec["batch_size"],
        max_steps=spec["steps"],
        learning_rate=OPTIMIZER["lr"],
        adam_beta1=OPTIMIZER["betas"][0],
        adam_beta2=OPTIMIZER["betas"][1],
        adam_epsilon=OPTIMIZER["eps"],
        weight_decay=OPTIMIZER["weight_decay"],
        optim="adamw_torch_fused" if best else "adamw_torch",
        lr_scheduler_type="constant",
        warmup_steps=0,
        max_grad_norm=CLIP_GRAD_NORM,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        seed=SEED,
        dataloader_num_workers=0,
        dataloader_drop_last=True,
        remove_unused_columns=False,
        disable_tqdm=True,
    )
    trainer = InOrder(
        model=model, args=args, train_dataset=dataset, data_collator=collator, callbacks=[Clock()]
    )
    trainer.train()
    return {"losses": [loss.item() for loss in losses], "step_times": clock.step_times()}


def run_bare(spec: dict, out: Path) -> dict:
    """The hand-written loop: torchtune's builder loaded from the checkpoint, AdamW, CE, clip."""
    import torch
    from safetensors.torch import load_file
    from torchtune.models import convert_weights
    from torchtune.models.llama3_2 import llama3_2

    from runner.data.transforms import collate
    from runner.models.attention import RowAttention

    torch.manual_seed(SEED)
    shape = spec["shape"]
    model = llama3_2(
        vocab_size=shape["vocab"],
        num_layers=shape["layers"],
        num_heads=shape["heads"],
        num_kv_heads=shape["kv_heads"],
        embed_dim=shape["hidden"],
        intermediate_dim=shape["mlp"],
        max_seq_len=2048,
        rope_base=500000,
        norm_eps=1e-5,
        scale_factor=1,
        tie_word_embeddings=False,
    )
    hf_state = load_file(Path(spec["checkpoint"]) / "model.safetensors")
    model.load_state_dict(
        convert_weights.hf_to_tune(
            hf_state,
            num_heads=shape["heads"],
            num_kv_heads=shape["kv_heads"],
            dim=shape["hidden"],
        )
    )
    optimizer = torch.optim.AdamW(model.parameters(), **OPTIMIZER)
    samples = json.loads(Path(spec["samples"]).read_text())
    size = spec["batch_size"]
    # runner's attention within rows: SDPA per sample, in rows as long as the model takes.
    attention = RowAttention.of(model, torch.device("cpu"))
    losses, clock = [], StepClock()
    for step in range(spec["steps"]):
        # runner's batches: padding-free rows (padded where no two samples share a row), labels
        # shifted to each position's next token.
        batch = collate(
            samples[step * size : (step + 1) * size],
            packed=False,
            padding_free=True,
            padding_idx=spec["pad_id"],
            row_limit=attention.row_limit,
        )
        logits = model(batch["tokens"], **attention.inputs(batch, torch.device("cpu")))
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.size(-1)),
            batch["labels"].reshape(-1),
            ignore_index=IGNORE_INDEX,
        )
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP_GRAD_NORM)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        clock.tick()
    return {"losses": losses, "step_times": clock.step_times()}


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


TUNE_VALUE = r"{}:(?:tensor\()?([-+\d.eE]+)"


def read_tune(log_file: Path, trained_per_step: list[int]) -> dict:
    """Losses and step times from the DiskLogger file: a step's time is its trained (label)
    tokens over the tokens_per_second_per_gpu that the recipe logs for it."""
    losses, rates = [], []
    for line in log_file.read_text().splitlines():
        loss = re.search(TUNE_VALUE.format("loss"), line)
        rate = re.search(TUNE_VALUE.format("tokens_per_second_per_gpu"), line)
        if loss and rate:
            losses.append(float(loss[1]))
            rates.append(float(rate[1]))
    times = [tokens / rate for tokens, rate in zip(trained_per_step, rates, strict=False)]
    return {"losses": losses, "step_times": times}


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


def summarize(results: dict[str, list[dict]], warmup: int) -> list[str]:
    """The table: per arm tokens/s (the samples' tokens, no padding, of the steps after warm-up
    over the sum of those steps' times; median and range over repeats), median s/step, peak
    RSS and step-1 loss; agreement of the arms that train the same batches, and ours/<arm>."""
    rows, lines = {}, []
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
        f"longest sample, {pad:.0%} of a batch is pad"
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
    finally:
        if args.keep:
            print(f"work directory kept: {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main(sys.argv[1:])
