"""Tokens/s and peak memory of our recipe (method=full, lora, qlora) beside a bare PyTorch loop.

    python scripts/bench/bench_train.py [--steps 200] [--batch-size 32] [--device cpu] [--repeats 3]

All train the tiny model (same builder, init, batches, AdamW settings, clipping) for the same
number of steps, each in a fresh subprocess so that peak memory is its own, taking turns
`--repeats` times and reporting medians (a neighbour on the machine hits all alike). The bare
loop is what a person writes by hand: no logging, no status file, no checkpoint; it trains every
parameter, like method=full. Every row uses tiny with 8 kv heads, so that each base projection
holds whole NF4 blocks of default size for qlora (runner.models.nf4).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WARMUP_STEPS = 10
METHODS = ("full", "lora", "qlora")
MODEL = ["model.builder.num_kv_heads=8"]


def peak_memory_mb(device: str) -> float:
    import torch

    if device == "cuda":
        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def recipe_config(steps: int, batch_size: int, device: str, run_dir: Path, method: str = "full"):
    from hydra import compose, initialize_config_dir

    from runner.config import interpolations
    from runner.config.resolve import resolve_recipe
    from runner.paths import CONF_DIR

    overrides = [
        f"max_steps={steps}",
        f"batch_size={batch_size}",
        "runtime.progress_bar=false",
        "runtime.save_every_n_steps=null",
        "dataset.eval_samples=0",
        # The bare loop does not evaluate; the timer would count our evaluation at the end.
        "eval.strategy=no",
        f"compute={'gpu' if device == 'cuda' else 'cpu'}",
        f"method={method}",
        *MODEL,
    ]
    interpolations.register()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return resolve_recipe(compose("train", overrides=overrides), run_dir)


class StepTimer:
    """Wall time of steps after WARMUP_STEPS, and the samples' own tokens they trained (no
    padding: ours computes none, the bare loop pads each batch to its longest sample)."""

    def __init__(self, device: str) -> None:
        self.device, self.tokens, self.steps, self.start = device, 0, 0, None

    def step(self, tokens: int) -> None:
        import torch

        if self.device == "cuda":
            torch.cuda.synchronize()
        self.steps += 1
        if self.steps == WARMUP_STEPS:
            self.start = time.perf_counter()
        elif self.steps > WARMUP_STEPS:
            self.tokens += tokens

    def tokens_per_s(self) -> float:
        return self.tokens / (time.perf_counter() - self.start)


def run_ours(steps: int, batch_size: int, device: str, method: str) -> dict[str, float]:
    from runner.recipes.finetune import FinetuneRecipe

    with tempfile.TemporaryDirectory() as tmp:
        recipe = FinetuneRecipe(recipe_config(steps, batch_size, device, Path(tmp), method))
        recipe.setup()
        timer = StepTimer(device)
        step = recipe._optimizer_step

        def timed(batches):
            loss, tokens = step(batches)
            timer.step(tokens)
            return loss, tokens

        recipe._optimizer_step = timed
        recipe.train()
        recipe.cleanup()
    return {"tokens_per_s": timer.tokens_per_s(), "peak_mb": peak_memory_mb(device)}


def run_bare(steps: int, batch_size: int, device: str) -> dict[str, float]:
    """The hand-written loop: model, AdamW, cross-entropy, clip, step."""
    import torch
    from torch.utils.data import DataLoader

    from runner.components import instantiate
    from runner.data import train_dataset
    from runner.models.torchtune_boundary import init_like_hf, padded_collate_sft

    with tempfile.TemporaryDirectory() as tmp:
        cfg = recipe_config(steps, batch_size, device, Path(tmp))
    torch.manual_seed(cfg.seed)
    tokenizer = instantiate(cfg.model.tokenizer)
    data = cfg.dataset
    dataset = train_dataset(data, tokenizer)
    with torch.device(device):
        model = instantiate(cfg.model.builder)
        init_like_hf(model, cfg.model.initializer_range)
    optimizer = torch.optim.AdamW(
        model.parameters(),
        lr=cfg.optimizer.lr,
        betas=tuple(cfg.optimizer.betas),
        weight_decay=cfg.optimizer.weight_decay,
    )

    def collate(samples: list[dict]) -> dict:
        # The samples' own tokens, as ours counts them (its padding-free row of a batch holds no
        # padding); counted with the padding, the bare loop read 8% above its work.
        own = sum(len(sample["tokens"]) for sample in samples)
        return {**padded_collate_sft(samples, padding_idx=tokenizer.pad_id), "own": own}

    loader = DataLoader(dataset, batch_size=batch_size, shuffle=True, collate_fn=collate)
    timer = StepTimer(device)
    batches = iter(loader)
    for _ in range(steps):
        batch = next(batches)
        tokens, labels = batch["tokens"].to(device), batch["labels"].to(device)
        logits = model(tokens)
        loss = torch.nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, logits.size(-1)).float(), labels[:, 1:].reshape(-1)
        )
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        timer.step(batch["own"])
    return {"tokens_per_s": timer.tokens_per_s(), "peak_mb": peak_memory_mb(device)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--which", choices=["bare", *METHODS], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.steps <= WARMUP_STEPS:
        parser.error(
            f"--steps {args.steps}: at least {WARMUP_STEPS + 1}, "
            f"the first {WARMUP_STEPS} are warm-up, not timed"
        )
    if args.which == "bare":
        print(json.dumps(run_bare(args.steps, args.batch_size, args.device)))
        return
    if args.which:
        print(json.dumps(run_ours(args.steps, args.batch_size, args.device, args.which)))
        return
    runs: dict[str, list[dict[str, float]]] = {"bare": [], **{m: [] for m in METHODS}}
    for _ in range(args.repeats):
        for which in runs:
            out = subprocess.run(
                [
                    sys.executable,
                    __file__,
                    "--which",
                    which,
                    "--steps",
                    str(args.steps),
                    "--batch-size",
                    str(args.batch_size),
                    "--device",
                    args.device,
                ],
                check=True,
                capture_output=True,
                text=True,
            ).stdout
            runs[which].append(json.loads(out.strip().splitlines()[-1]))
    results = {
        which: {key: statistics.median(r[key] for r in rs) for key in rs[0]}
        for which, rs in runs.items()
    }
    print(
        f"tiny model ({' '.join(MODEL)}), {args.steps} steps of batch {args.batch_size} on "
        f"{args.device} (first {WARMUP_STEPS} steps not timed), median of {args.repeats} runs "
        "taking turns"
    )
    memory = "peak MB (GPU)" if args.device == "cuda" else "peak RSS MB"
    print(f"{'':16}{'tokens/s':>12}{'range':>16}{memory:>16}")
    for which, r in results.items():
        label = "bare loop" if which == "bare" else f"ours {which}"
        rates = [run["tokens_per_s"] for run in runs[which]]
        spread = f"{min(rates):,.0f}-{max(rates):,.0f}"
        print(f"{label:16}{r['tokens_per_s']:>12,.0f}{spread:>16}{r['peak_mb']:>16,.0f}")
    ratio = results["full"]["tokens_per_s"] / results["bare"]["tokens_per_s"]
    print(f"ours full/bare tokens/s: {ratio:.3f} (target >= 0.9)")


if __name__ == "__main__":
    main()
