"""DPO recipes: preference tuning of every parameter (method=dpo) or of LoRA adapters
(method=lora_dpo, qlora_dpo), in the torchtune style.

    python -m runner.recipes.dpo RUN_DIR/recipe.yaml

Direct Preference Optimization (Rafailov et al., 2023) on pairs of a chosen and a rejected answer
(dataset.kind=preference). Each micro-batch holds the chosen answers and then the rejected ones,
scored in one forward (torchtune's concatenated_forward); the reference scores the same batch
without gradients: for LoRA the same model with its adapters switched off (no second copy), for
full DPO a frozen copy of the starting weights (model.source's, else the seed's, which are
written to RUN/base_model once, as LoRA writes its base). An answer's log-probability is the sum
over its tokens; its implicit reward is beta * (log p_policy - log p_reference). The loss of a
pair (method.loss) is a function of its margin, the policy's log-ratio of chosen to rejected
minus the reference's: sigmoid -log sigmoid(beta * margin) (with method.label_smoothing, the
conservative DPO), ipo (margin - 1 / (2 beta))^2, hinge max(0, 1 - beta * margin). A step's loss
is the mean over all ranks' pairs.

Logged at each logged step and, with the `eval_` prefix, on the held-out pairs: loss,
rewards_chosen, rewards_rejected (means), rewards_accuracy (the share of pairs whose chosen
answer has the higher reward, a tie counting half) and rewards_margin (mean chosen minus
rejected). Everything else (the loop, FSDP2, checkpoints, resume, SIGTERM) is the full or LoRA
recipe's; checkpoints are in their format.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from runner.config.schema import read_recipe
from runner.data import answer_log_probs, collate_preference
from runner.models.backends import set_output_chunks
from runner.models.torchtune_boundary import disable_adapter
from runner.train import parallel, process

from .full_finetune import FullFinetuneRecipe
from .lora_finetune import LoraFinetuneRecipe

# The per-pair quantities summed over a step or an evaluation, in this order.
PAIR_SUMS = ("loss", "rewards_chosen", "rewards_rejected", "rewards_accuracy", "rewards_margin")


def preference_loss(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    reference_chosen: torch.Tensor,
    reference_rejected: torch.Tensor,
    *,
    loss: str,
    beta: float,
    label_smoothing: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, chosen reward, rejected reward) of each pair from the answers' log-probabilities.

    sigmoid is torchtune's DPOLoss, hinge its RSOLoss; ipo follows TRL's.
    """
    margin = (policy_chosen - policy_rejected) - (reference_chosen - reference_rejected)
    if loss == "sigmoid":
        losses = -F.logsigmoid(beta * margin) * (1 - label_smoothing)
        losses = losses - F.logsigmoid(-beta * margin) * label_smoothing
    elif loss == "ipo":
        losses = (margin - 1 / (2 * beta)) ** 2
    elif loss == "hinge":
        losses = torch.relu(1 - beta * margin)
    else:
        raise AssertionError(f"runner.config.resolve lets no loss {loss!r} through")
    chosen_rewards = beta * (policy_chosen - reference_chosen).detach()
    rejected_rewards = beta * (policy_rejected - reference_rejected).detach()
    return losses, chosen_rewards, rejected_rewards


def pair_sums(
    losses: torch.Tensor, chosen_rewards: torch.Tensor, rejected_rewards: torch.Tensor
) -> torch.Tensor:
    """The PAIR_SUMS of some pairs (a tie of rewards counts half a correct pair)."""
    correct = (chosen_rewards > rejected_rewards).float()
    correct = correct + 0.5 * (chosen_rewards == rejected_rewards).float()
    return torch.stack(
        [
            losses.detach().sum(),
            chosen_rewards.sum(),
            rejected_rewards.sum(),
            correct.sum(),
            (chosen_rewards - rejected_rewards).sum(),
        ]
    )


class PreferenceMixin(FullFinetuneRecipe):
    """What DPO changes in a recipe: pairs as batches, the step's loss, the reward metrics."""

    # The reward means of the last optimizer step (on the device, read when it is logged).
    step_rewards: torch.Tensor | None = None

    def _collate(self, samples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        return collate_preference(samples, padding_idx=self.tokenizer.pad_id)

    def _reference_forward(self, tokens: torch.Tensor) -> Any:
        """The reference model's logits for `tokens` (no gradients)."""
        raise NotImplementedError

    def _pair_terms(
        self, batch: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(loss, chosen reward, rejected reward) of each pair of a batch."""
        tokens = batch["tokens"].to(self.place.device)
        labels = batch["labels"].to(self.place.device)
        policy = answer_log_probs(self.model(tokens), labels)
        with torch.no_grad():
            reference = answer_log_probs(self._reference_forward(tokens), labels)
        pairs = tokens.size(0) // 2
        method = self.cfg.method
        return preference_loss(
            policy[:pairs],
            policy[pairs:],
            reference[:pairs],
            reference[pairs:],
            loss=method.loss,
            beta=method.beta,
            label_smoothing=method.label_smoothing,
        )

    def _optimizer_step(self, batches: list[dict[str, torch.Tensor]]) -> tuple[torch.Tensor, int]:
        """One optimizer step over micro-batches of pairs: its loss (the mean over all ranks'
        pairs, on the device, unread) and the tokens it saw."""
        sums = torch.zeros(len(PAIR_SUMS), device=self.place.device)
        num_pairs = torch.zeros((), device=self.place.device)
        seen_tokens = 0
        for batch in batches:
            with parallel.autocast(self.place):
                losses, chosen, rejected = self._pair_terms(batch)
            losses.sum().backward()  # type: ignore[no-untyped-call]  # torch leaves it untyped
            sums += pair_sums(losses, chosen, rejected)
            num_pairs += losses.numel()
            seen_tokens += batch["tokens"].numel()
        if self.place.world_size > 1:
            dist.all_reduce(sums)
            dist.all_reduce(num_pairs)
        # FSDP averages gradients over ranks; scaling by world/pairs makes it a per-pair mean.
        self.optim.step(self.model, self.place.world_size / num_pairs)
        means = sums / num_pairs
        # No host sync here: the loop reads the loss when it logs or saves (and fails the run
        # on a non-finite one), _log the rewards.
        self.step_rewards = means[1:]
        return means[0], seen_tokens * self.place.world_size

    def _log(self, values: dict[str, float]) -> None:
        assert self.step_rewards is not None, "a step is logged after it is taken"
        rewards = dict(zip(PAIR_SUMS[1:], self.step_rewards.tolist(), strict=True))
        super()._log({**values, **rewards})

    # ---- evaluation ---------------------------------------------------------------------
    def _eval_metrics(self) -> dict[str, float]:
        """The DPO loss and the rewards over the held-out pairs (every rank gets them)."""
        sums = torch.zeros(len(PAIR_SUMS), device=self.place.device)
        num_pairs = torch.zeros((), device=self.place.device)
        was_training = self.model.training
        self.model.eval()
        with torch.no_grad():
            for batch, count in self._validation_pairs():
                losses, chosen, rejected = self._pair_terms(batch)
                sums += pair_sums(losses[:count], chosen[:count], rejected[:count])
                num_pairs += count
        self.model.train(was_training)
        if self.place.world_size > 1:
            dist.all_reduce(sums)
            dist.all_reduce(num_pairs)
        means = (sums / num_pairs.clamp(min=1)).tolist()
        metrics = {f"eval_{name}": value for name, value in zip(PAIR_SUMS, means, strict=True)}
        return {name: value for name, value in metrics.items() if name in self.cfg.eval.metrics}

    def _validation_pairs(self) -> Iterator[tuple[dict[str, torch.Tensor], int]]:
        """This rank's share of the held-out pairs, collated, with the number that count (the
        full recipe's split: _validation_shares)."""
        for samples, counted in self._validation_shares():
            yield self._collate(samples), counted


class DPORecipe(PreferenceMixin, FullFinetuneRecipe):
    """DPO of every parameter against a frozen copy of the starting weights."""

    def setup(self) -> None:
        super().setup()
        # The reference computes its logits in the same chunks as the policy, so that the two
        # agree to the bit while their weights do (at the start, every reward is exactly 0).
        set_output_chunks(self.reference, getattr(self.loss_fn, "num_output_chunks", 0))

    def _build_model(self) -> torch.nn.Module:
        base = None if self.cfg.model.source is not None else self._base_model_state()
        policy = self.backend.build(self.place.device, self.place.dtype)
        reference = self.backend.build(self.place.device, self.place.dtype)
        if base is not None:
            base = {k: v.to(self.place.dtype) for k, v in base.items()}
            policy.load_state_dict(base)
            reference.load_state_dict(base)
        reference.requires_grad_(False)
        # Sharded as the policy is: each rank holds its share, and gathers it for a forward.
        self.reference = self._prepare_model(reference).eval()
        return self._prepare_model(policy)

    def _reference_forward(self, tokens: torch.Tensor) -> Any:
        return self.reference(tokens)


class LoraDPORecipe(PreferenceMixin, LoraFinetuneRecipe):
    """DPO of LoRA adapters; the reference is the base, the same model with adapters off."""

    def _reference_forward(self, tokens: torch.Tensor) -> Any:
        was_training = self.model.training
        # The reference is deterministic (no dropout), as a separate frozen model would be.
        self.model.eval()
        try:
            with self._adapters_off():
                return self.model(tokens)
        finally:
            self.model.train(was_training)

    def _adapters_off(self) -> contextlib.AbstractContextManager[None]:
        peft_model = getattr(self.model, "hf", None)  # the transformers backend's peft model
        adapters_off: contextlib.AbstractContextManager[None]
        if peft_model is not None and hasattr(peft_model, "disable_adapter"):
            adapters_off = peft_model.disable_adapter()
        else:
            adapters_off = disable_adapter(self.model)
        return adapters_off


def run(recipe_path: str | Path) -> dict[str, Any]:
    """Runs the DPO recipe at `recipe_path` in this process (one of several under torchrun):
    LoRA's when the method has an adapter builder (lora_dpo, qlora_dpo), else the full one."""
    lora = read_recipe(Path(recipe_path)).method.builder is not None
    return process.run(recipe_path, LoraDPORecipe if lora else DPORecipe)


if __name__ == "__main__":
    run(sys.argv[1])
