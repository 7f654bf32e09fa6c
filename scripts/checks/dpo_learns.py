"""Does DPO on the shipped preference pairs learn? Held-out reward accuracy before and after.

    python scripts/checks/dpo_learns.py                               # dpo and lora_dpo, seeds 0-4
    python scripts/checks/dpo_learns.py --methods lora_dpo --steps 80 -- method.beta=0.2

Each seed is one `runner train method=M dataset=preference seed=S` through the real CLI (tiny
model, CPU, fp32), then scored on the run's held-out pairs (dataset=preference holds out 5%)
from the files it wrote: the reference is RUN/base_model, the policy the last checkpoint (loaded
by transformers, and peft for an adapter). Before training the policy is the reference, so every
implicit reward is 0 and reward accuracy is 0.5, a tie counting half: that is computed here
too, not assumed. Beside it, the policy's own preference: the share of held-out pairs whose
chosen answer it gives the higher log-probability, before (the base) and after. Prints each seed
and the median and range; exits 1 if any seed's reward accuracy after is not above 0.5.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from omegaconf import OmegaConf
from transformers import AutoModelForCausalLM

from runner.components import instantiate
from runner.data import answer_log_probs, collate_preference, training_splits

LEARNING_RATES = {"dpo": "1e-3", "lora_dpo": "1e-2", "qlora_dpo": "1e-2"}


def train(method: str, seed: int, steps: int, overrides: list[str], run: Path) -> None:
    command = [
        *(sys.executable, "-m", "runner", "train", f"method={method}", "dataset=preference"),
        *("compute=cpu", "dtype=fp32", f"seed={seed}", f"max_steps={steps}", "batch_size=8"),
        *(f"optimizer.lr={LEARNING_RATES[method]}", "optimizer.warmup_steps=1"),
        *(f"eval.steps={steps}", "runtime.progress_bar=false", *overrides),
        f"hydra.run.dir={run}",
    ]
    if method == "qlora_dpo":
        command.append("model.builder.num_kv_heads=8")
    proc = subprocess.run(command, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{method} seed {seed} failed:\n{proc.stderr[-3000:]}")


def answer_log_probs_of(model: torch.nn.Module, batches: list[dict]) -> torch.Tensor:
    """Each held-out pair's (chosen, rejected) log-probabilities under `model`: rows of 2."""
    rows = []
    with torch.no_grad():
        for batch in batches:
            logps = answer_log_probs(model(batch["tokens"]).logits, batch["labels"])
            rows.append(torch.stack(logps.chunk(2), dim=1))
    return torch.cat(rows)


def accuracy(chosen_minus_rejected: torch.Tensor) -> float:
    """Share of pairs with a positive difference, a tie counting half."""
    return float(((chosen_minus_rejected > 0) + 0.5 * (chosen_minus_rejected == 0)).float().mean())


def score(run: Path) -> dict[str, float]:
    """Reward accuracy and the policy's own preference, before and after, on held-out pairs."""
    recipe = OmegaConf.load(run / "recipe.yaml")
    tokenizer = instantiate(recipe.model.tokenizer)
    _, held_out = training_splits(recipe.dataset, tokenizer, validation=True)
    pairs = [held_out[i] for i in range(len(held_out))]
    batches = [
        collate_preference(pairs[i : i + 16], padding_idx=tokenizer.pad_id)
        for i in range(0, len(pairs), 16)
    ]
    checkpoint = max((run / "checkpoints").iterdir(), key=lambda p: int(p.name.split("_")[1]))
    base = AutoModelForCausalLM.from_pretrained(run / "base_model", dtype=torch.float32).eval()
    if (checkpoint / "adapter_config.json").is_file():
        from peft import PeftModel

        policy = AutoModelForCausalLM.from_pretrained(run / "base_model", dtype=torch.float32)
        policy = PeftModel.from_pretrained(policy, checkpoint).eval()
    else:
        policy = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    reference, trained = answer_log_probs_of(base, batches), answer_log_probs_of(policy, batches)

    def reward_margin(logps: torch.Tensor) -> torch.Tensor:
        rewards = logps - reference  # beta > 0 leaves the sign as it is
        return rewards[:, 0] - rewards[:, 1]

    return {
        "reward_before": accuracy(reward_margin(reference)),
        "reward_after": accuracy(reward_margin(trained)),
        "own_before": accuracy(reference[:, 0] - reference[:, 1]),
        "own_after": accuracy(trained[:, 0] - trained[:, 1]),
        "pairs": len(pairs),
    }


def summary(values: list[float]) -> str:
    return f"median {statistics.median(values):.3f}, range {min(values):.3f} - {max(values):.3f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", nargs="+", default=["dpo", "lora_dpo"])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("overrides", nargs="*", help="extra `runner train` overrides, after --")
    args = parser.parse_args()
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        for method in args.methods:
            rows = []
            for seed in args.seeds:
                run = Path(tmp) / f"{method}_{seed}"
                train(method, seed, args.steps, args.overrides, run)
                rows.append({"seed": seed, **score(run)})
            print(
                f"method={method} dataset=preference, {args.steps} steps of 8 pairs "
                f"(lr {LEARNING_RATES[method]}), {rows[0]['pairs']} held-out pairs "
                f"{' '.join(args.overrides)}"
            )
            print(
                f"{'seed':>4}  {'reward acc before':>17}  {'after':>6}  {'own pref before':>15}"
                f"  {'after':>6}"
            )
            for row in rows:
                print(
                    f"{row['seed']:>4}  {row['reward_before']:>17.3f}  {row['reward_after']:>6.3f}"
                    f"  {row['own_before']:>15.3f}  {row['own_after']:>6.3f}"
                )
            after = [r["reward_after"] for r in rows]
            print(f"reward accuracy after:  {summary(after)}")
            print(f"own preference before:  {summary([r['own_before'] for r in rows])}")
            print(f"own preference after:   {summary([r['own_after'] for r in rows])}\n")
            ok = ok and min(after) > 0.5
    print(f"every seed above chance (0.5): {'yes' if ok else 'NO'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
