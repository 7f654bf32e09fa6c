"""What every arm of bench_peers.py shares: the benchmark's checkpoint (a random Llama written by
transformers), its data (the sample task's words, of one length or of many), the order every arm
trains in, the samples tokenized as runner tokenizes them, torchtune's packs for tune_best, and a
step clock. bench_activations.py and bench_row_layout.py take their model and data from here too.
"""

from __future__ import annotations

import json
import math
import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

REPO = Path(__file__).resolve().parents[2]
TOKENIZER_DIR = REPO / "runner" / "assets" / "tiny_tokenizer"
SAMPLE_DATA = REPO / "runner" / "assets" / "sample" / "train.jsonl"
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
# torchtune's packs: as long as the longest sample rounded up to this many tokens (packing
# needs tokenizer.max_seq_len, and a sample longer than it is refused).
PACK_ROUNDING = 128
IGNORE_INDEX = -100


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


class StepClock:
    """Wall time at the end of each optimizer step, from the start of training."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.ends: list[float] = []

    def tick(self) -> None:
        self.ends.append(time.perf_counter())

    def step_times(self) -> list[float]:
        return [b - a for a, b in zip([self.start, *self.ends], self.ends, strict=False)]
