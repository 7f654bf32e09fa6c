"""What a method's loss is made of: supervised cross-entropy on the answer tokens (full, lora,
qlora), or a preference loss on pairs against a reference model (dpo, lora_dpo, qlora_dpo).

An objective collates the samples into batches, takes one optimizer step over a step's
micro-batches, adds what it logs beside the loss, and computes its evaluation metrics. The
recipe (recipes/finetune.py) owns the loop around it; the model and what trains are the weights'
(runner.trainer.weights).

Direct Preference Optimization (Rafailov et al., 2023) trains on pairs of a chosen and a rejected
answer. Each micro-batch holds the chosen answers and then the rejected ones, scored in one
forward (torchtune's concatenated_forward); the reference scores the same batch without
gradients. An answer's log-probability is the sum over its tokens (for ipo, as TRL takes it,
the mean); its implicit reward is
beta * (log p_policy - log p_reference). The loss of a pair (method.loss) is a function of its
margin, the policy's log-ratio of chosen to rejected minus the reference's: sigmoid
-log sigmoid(beta * margin) (with method.label_smoothing, the conservative DPO), ipo
(margin - 1 / (2 beta))^2, hinge max(0, 1 - beta * margin). A step's loss is the mean over all
ranks' pairs. Logged beside it, and with the `eval_` prefix on the held-out pairs:
rewards_chosen, rewards_rejected (means), rewards_accuracy (the share of pairs whose chosen
answer has the higher reward, a tie counting half) and rewards_margin (mean chosen minus
rejected).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.nn.functional as F
from omegaconf import DictConfig
from torch import nn

from runner.data import (
    Split,
    answer_log_probs,
    collate,
    collate_preference,
    eval_prompts,
    forward_parts,
)
from runner.devices import to_device
from runner.models.attention import RowAttention
from runner.models.backends import set_output_chunks
from runner.models.torchtune_boundary import CROSS_ENTROPY_IGNORE_IDX
from runner.trainer import parallel
from runner.trainer.batches import Batch
from runner.trainer.evaluate import LOSS_METRICS, exact_match, loss_metrics, loss_sums
from runner.trainer.optimization import Optimization
from runner.trainer.parallel import Placement, all_ranks_sum
from runner.trainer.progress import Tokens

# The reference model's logits for some tokens (no gradients are taken through it).
Reference = Callable[[torch.Tensor], Any]
# This rank's share of the validation records, with how many of them count.
Shares = Iterator[tuple[list[Any], int]]
# The per-pair quantities summed over a step or an evaluation, in this order.
PAIR_SUMS = ("loss", "rewards_chosen", "rewards_rejected", "rewards_accuracy", "rewards_margin")


class Supervised:
    """Cross-entropy on the label tokens, a step's loss the mean over all ranks' tokens."""

    # Whether the weights build a reference model for it.
    wants_reference = False

    # Every objective takes the same arguments (runner.trainer.methods builds either); this one
    # reads the dataset section (packing, padding-free, exact-match samples), not the method's.
    def __init__(
        self, place: Placement, tokenizer: Any, *, dataset: DictConfig, method: DictConfig
    ) -> None:
        self.place, self.tokenizer, self.dataset = place, tokenizer, dataset
        self.model: nn.Module
        self.loss_fn: Any

    def attach(
        self, model: nn.Module, loss_fn: Any, reference: Reference | None, attention: str = "auto"
    ) -> None:
        """The model it trains, the loss it computes (cfg.loss) and how rows of several samples
        attend (cfg.attention), once the model is built."""
        self.model, self.loss_fn = model, loss_fn
        self.attention = RowAttention.of(model, self.place.device, attention)

    def collate(self, samples: list[dict[str, Any]]) -> Batch:
        """One training batch of SFT samples (packed and padding-free as the dataset says)."""
        return self._collate(samples, packed=self.dataset.packing)

    def _collate(self, samples: list[dict[str, Any]], *, packed: bool) -> Batch:
        # Padding-free rows no longer than one forward pass takes (rows without a limit are as
        # long as their longest sample already).
        row_limit, cap = self.attention.row_limit, self.dataset.max_forward_tokens
        if row_limit is not None and cap is not None:
            row_limit = min(row_limit, cap)
        return collate(
            samples,
            packed=packed,
            padding_free=self.dataset.padding_free,
            padding_idx=self.tokenizer.pad_id,
            row_limit=row_limit,
            min_rows=self.attention.min_rows,
        )

    def step(self, batches: list[Batch], optim: Optimization) -> tuple[torch.Tensor, Tokens]:
        """One optimizer step over micro-batches: its loss (normalized by all ranks' tokens, on
        the device, unread) and the positions all ranks computed (padding included: the work
        done; with several ranks a sum on the device, unread)."""
        device, world_size = self.place.device, self.place.world_size
        loss_sum = torch.zeros((), device=device)
        num_tokens = torch.zeros((), device=device)
        seen_tokens = 0
        parts = [p for b in batches for p in forward_parts(b, self.dataset.max_forward_tokens)]
        for _ in range(self._passes_behind(len(parts))):
            self._pass_training_nothing()
        for part in parts:
            tokens, labels = (to_device(part[key], device) for key in ("tokens", "labels"))
            batch_tokens = (labels != CROSS_ENTROPY_IGNORE_IDX).sum()
            packed = self.attention.inputs(part, device)
            with parallel.autocast(self.place):
                logits = self.model(tokens, **packed)
                # A part with no trained token (an answer cut off by max_seq_len, a forward pass
                # of prompts alone) adds nothing; its mean over no tokens is nan.
                weighted = self._loss(logits, labels) * batch_tokens
                loss = torch.where(batch_tokens > 0, weighted, weighted.new_zeros(()))
            # The logits' memory goes before backward makes the gradients beside it (as
            # torchtune's recipes `del logits`): the graph keeps what backward needs of them.
            # Held here, they were an extra copy at the step's peak, and through the next
            # micro-batch's forward (a whole fp32 copy with loss=ce).
            del logits, weighted
            loss.backward()  # type: ignore[no-untyped-call]  # torch leaves it untyped
            loss_sum += loss.detach()
            num_tokens += batch_tokens
            seen_tokens += tokens.numel()
        seen: Tokens = seen_tokens
        if world_size > 1:
            # Each rank's own count: padding-free rows hold different numbers of tokens.
            num_tokens, seen = all_ranks_sum(num_tokens, seen_tokens)
            dist.all_reduce(loss_sum)
        # FSDP averages gradients over ranks; scaling by world/tokens makes it a per-token mean.
        optim.step(self.model, world_size / num_tokens.clamp(min=1))
        return (loss_sum / num_tokens.clamp(min=1)).detach(), seen

    def _passes_behind(self, passes: int) -> int:
        """How many fewer forward passes this rank's step runs than the rank with the most.

        Under dataset.max_forward_tokens each rank splits its own batch, so the counts can
        differ; FSDP's collectives (in every forward and backward) need every rank in each
        pass. One vote per step (on one node over gloo: it waits for no kernel), only where the
        cap and several ranks meet."""
        if self.dataset.max_forward_tokens is None:
            return 0
        return parallel.largest_on_any_rank(passes, self.place) - passes

    def _pass_training_nothing(self) -> None:
        """A forward and backward pass whose gradients are all zero, over one padding token: it
        meets the other ranks' collectives and adds nothing to the step (the loss is not
        computed, so no mean over zero tokens enters it)."""
        tokens = self._nothing_to_train()["tokens"].to(self.place.device)
        with parallel.autocast(self.place):
            logits = self.model(tokens)
            chunks = logits if isinstance(logits, list) else [logits]
            nothing = sum(chunk.float().sum() for chunk in chunks) * 0.0
        nothing.backward()

    def _nothing_to_train(self) -> Batch:
        """A batch of one padding token whose label is ignored."""
        return {
            "tokens": torch.full((1, 1), self.tokenizer.pad_id, dtype=torch.long),
            "labels": torch.full((1, 1), CROSS_ENTROPY_IGNORE_IDX, dtype=torch.long),
        }

    def _loss(
        self, logits: torch.Tensor | list[torch.Tensor], labels: torch.Tensor
    ) -> torch.Tensor:
        if isinstance(logits, list):  # chunked output, for CEWithChunkedOutputLoss
            return cast(torch.Tensor, self.loss_fn(logits, labels))
        flat = logits.reshape(-1, logits.size(-1)).float()
        return cast(torch.Tensor, self.loss_fn(flat, labels.reshape(-1)))

    def logged(self) -> dict[str, float]:
        """What a logged step records beside its loss and throughput: nothing."""
        return {}

    def eval_metrics(
        self, shares: Shares, validation: Split, *, wanted: list[str]
    ) -> dict[str, float]:
        """The `wanted` validation loss metrics and exact match (every rank gets them)."""
        metrics: dict[str, float] = {}
        device = self.place.device
        if any(name in wanted for name in LOSS_METRICS):
            batches = self._validation_batches(shares)
            sums = loss_sums(
                self.model,
                batches,
                attention=self.attention,
                ignore_index=CROSS_ENTROPY_IGNORE_IDX,
                device=device,
            )
            if self.place.world_size > 1:
                dist.all_reduce(sums)
            metrics |= {k: v for k, v in loss_metrics(sums).items() if k in wanted}
        if "eval_exact_match" in wanted and self.dataset.eval_samples > 0:
            prompts = eval_prompts(validation, self.tokenizer, self.dataset.eval_samples)
            metrics["eval_exact_match"] = exact_match(
                self.model,
                self.tokenizer,
                prompts,
                max_new_tokens=self.dataset.eval_max_new_tokens,
                device=device,
            )
        return metrics

    def _validation_batches(self, shares: Shares) -> list[Batch]:
        """This rank's validation forward passes (its batches, split as training splits them
        under dataset.max_forward_tokens); a record that counts for nothing has every label
        ignored, which adds nothing to the sums. Where the split leaves this rank fewer passes
        than another, passes of one ignored token make up the count (FSDP's collectives)."""
        passes: list[Batch] = []
        for samples, counted in shares:
            # The validation split is never packed (padding-free, where training is).
            batch = self._collate(samples, packed=False)
            if counted == 0:
                batch["labels"].fill_(CROSS_ENTROPY_IGNORE_IDX)
            passes += forward_parts(batch, self.dataset.max_forward_tokens)
        behind = self._passes_behind(len(passes))
        return passes + [self._nothing_to_train() for _ in range(behind)]


class Preference:
    """A preference loss (method.loss) on pairs, against a reference model (the weights')."""

    wants_reference = True

    # Reads the method section (loss, beta, label smoothing); pairs are never packed.
    def __init__(
        self, place: Placement, tokenizer: Any, *, dataset: DictConfig, method: DictConfig
    ) -> None:
        self.place, self.tokenizer, self.method = place, tokenizer, method
        self.model: nn.Module
        self.reference: Reference
        # The reward means of the last optimizer step (on the device, read when it is logged).
        self.step_rewards: torch.Tensor | None = None

    def attach(
        self, model: nn.Module, loss_fn: Any, reference: Reference | None, attention: str = "auto"
    ) -> None:
        """The model it trains and its reference, once they are built (pairs are padded rows:
        `attention` does not apply)."""
        assert reference is not None, "the weights build a reference for a preference method"
        self.model, self.reference = model, reference
        if isinstance(reference, nn.Module):
            # A separate reference computes its logits in the same chunks as the policy, so that
            # the two agree to the bit while their weights do (at the start, every reward is 0).
            set_output_chunks(reference, getattr(loss_fn, "num_output_chunks", 0))

    def collate(self, samples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        """One batch of pairs: the chosen answers, then the rejected ones."""
        return collate_preference(samples, padding_idx=self.tokenizer.pad_id)

    def _pair_terms(
        self, batch: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(loss, chosen reward, rejected reward) of each pair of a batch."""
        tokens = to_device(batch["tokens"], self.place.device)
        labels = to_device(batch["labels"], self.place.device)
        # IPO's target margin 1/(2 beta) holds for answers of any length only over their
        # per-token means (TRL's rule): summed, a long answer's margin outgrew it.
        mean = self.method.loss == "ipo"
        policy = answer_log_probs(self.model(tokens), labels, mean=mean)
        with torch.no_grad():
            reference = answer_log_probs(self.reference(tokens), labels, mean=mean)
        pairs = tokens.size(0) // 2
        return preference_loss(
            policy[:pairs],
            policy[pairs:],
            reference[:pairs],
            reference[pairs:],
            loss=self.method.loss,
            beta=self.method.beta,
            label_smoothing=self.method.label_smoothing,
        )

    def step(
        self, batches: list[dict[str, torch.Tensor]], optim: Optimization
    ) -> tuple[torch.Tensor, Tokens]:
        """One optimizer step over micro-batches of pairs: its loss (the mean over all ranks'
        pairs, on the device, unread) and the positions all ranks computed (Supervised.step)."""
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
        seen: Tokens = seen_tokens
        if self.place.world_size > 1:
            dist.all_reduce(sums)
            num_pairs, seen = all_ranks_sum(num_pairs, seen_tokens)
        # FSDP averages gradients over ranks; scaling by world/pairs makes it a per-pair mean.
        optim.step(self.model, self.place.world_size / num_pairs)
        means = sums / num_pairs
        # No host sync here: the loop reads the loss when it logs or saves (and fails the run
        # on a non-finite one), `logged` the rewards.
        self.step_rewards = means[1:]
        return means[0], seen

    def logged(self) -> dict[str, float]:
        """The last step's reward means, which a logged step records beside its loss."""
        assert self.step_rewards is not None, "a step is logged after it is taken"
        return dict(zip(PAIR_SUMS[1:], self.step_rewards.tolist(), strict=True))

    def eval_metrics(
        self, shares: Shares, validation: Split, *, wanted: list[str]
    ) -> dict[str, float]:
        """The preference loss and the rewards over the held-out pairs (every rank gets them)."""
        sums = torch.zeros(len(PAIR_SUMS), device=self.place.device)
        num_pairs = torch.zeros((), device=self.place.device)
        was_training = self.model.training
        self.model.eval()
        with torch.no_grad():
            for samples, count in shares:
                losses, chosen, rejected = self._pair_terms(self.collate(samples))
                sums += pair_sums(losses[:count], chosen[:count], rejected[:count])
                num_pairs += count
        self.model.train(was_training)
        if self.place.world_size > 1:
            dist.all_reduce(sums)
            dist.all_reduce(num_pairs)
        means = (sums / num_pairs.clamp(min=1)).tolist()
        metrics = {f"eval_{name}": value for name, value in zip(PAIR_SUMS, means, strict=True)}
        return {name: value for name, value in metrics.items() if name in wanted}


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

    sigmoid is torchtune's DPOLoss, hinge its RSOLoss; ipo follows TRL's (over the answers'
    per-token mean log-probabilities, which the caller gives).
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
