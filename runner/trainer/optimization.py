"""The optimizer section made real: the optimizer over the trained parameters, its learning-rate
schedule, and one optimizer step from accumulated gradients."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from torch.distributed.checkpoint.state_dict import (
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

from runner.components import instantiate, plain_dict
from runner.config.optimizer import split_option
from runner.models.torchtune_boundary import get_cosine_schedule_with_warmup
from runner.trainer.checkpointing import FULL


class Optimization:
    """The optimizer (runner.config.optimizer's component) and its schedule."""

    def __init__(
        self,
        optimizer: DictConfig,
        parameters: Iterable[torch.nn.Parameter],
        *,
        total_steps: int,
        clip_grad_norm: float | None,
    ) -> None:
        settings, schedule = split_option(plain_dict(optimizer))
        self.optimizer: torch.optim.Optimizer = instantiate(OmegaConf.create(settings), parameters)
        self.lr_scheduler = _lr_scheduler(self.optimizer, schedule, total_steps)
        self.clip_grad_norm = clip_grad_norm
        # The learning rate the last step trained with, which is what a step's log reports
        # (torchtune's and the HF Trainer's logs read the schedule after stepping it: the next).
        self.stepped_lr = self.lr
        # With clip_grad_norm: the last step's gradient norm before clipping, on the device and
        # unread until the step is logged (`grad_norm`, as torchtune's recipes and the HF
        # Trainer log it).
        self.grad_norm: torch.Tensor | None = None

    @property
    def lr(self) -> float:
        """The learning rate of the next step (the schedule's value once a step has stepped it;
        what a step trained with is `stepped_lr`)."""
        return float(self.optimizer.param_groups[0]["lr"])

    def step(self, model: torch.nn.Module, scale: torch.Tensor) -> None:
        """Scales the accumulated gradients and clips them in one pass, steps optimizer and
        schedule."""
        # One multi-tensor multiply per dtype, by the scale and the clipping coefficient
        # together: the gradients' norm is read before they are scaled (the scaled norm is
        # scale times it), so they are read once for the norm and written once, as a bare
        # loop clipping a mean loss's gradients does (a multiply for each of the 1B's 146
        # parameters, then clip_grad_norm_'s norm and multiply, wrote them twice).
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for param in model.parameters():
            if param.grad is not None:
                by_dtype.setdefault(param.grad.dtype, []).append(param.grad)
        factor = scale
        if self.clip_grad_norm is not None:
            factor = scale * self._clip_coefficient(by_dtype, scale)
        for dtype, grads in by_dtype.items():
            torch._foreach_mul_(grads, factor.to(dtype))
        self.stepped_lr = self.lr
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.lr_scheduler.step()

    def _clip_coefficient(
        self, by_dtype: dict[torch.dtype, list[torch.Tensor]], scale: torch.Tensor
    ) -> torch.Tensor:
        """clip_grad_norm_'s coefficient (max_norm / (norm + 1e-6), at most 1) for the
        gradients once scaled by `scale`; the norm over every rank's shards (FSDP's DTensors)."""
        assert self.clip_grad_norm is not None
        grads = [grad for group in by_dtype.values() for grad in group]
        norm = torch.nn.utils.get_total_norm(grads)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        scaled = norm.float() * scale.float()  # in fp32, where the norm of bf16 gradients is bf16
        self.grad_norm = scaled
        return (self.clip_grad_norm / (scaled + 1e-6)).clamp(max=1.0)

    def state(self, model: torch.nn.Module) -> dict[str, Any]:
        """The training state's optimizer (whole, gathered: every rank joins) and schedule."""
        return {
            "optimizer": get_optimizer_state_dict(model, self.optimizer, options=FULL),
            "lr_scheduler": self.lr_scheduler.state_dict(),
        }

    def restore(self, model: torch.nn.Module, state: dict[str, Any]) -> None:
        """The optimizer and schedule of a training state (written at any world size)."""
        tuples = [
            {key for key, value in group.items() if isinstance(value, tuple)}
            for group in self.optimizer.param_groups
        ]
        set_optimizer_state_dict(model, self.optimizer, state["optimizer"], options=FULL)
        # It gives tuple hyperparameters (AdamW's betas) back as lists: a resumed run's training
        # state then pickled to other bytes than the straight run's, and runner repro's hashes
        # called a run that reproduced a drift.
        for group, keys in zip(self.optimizer.param_groups, tuples, strict=True):
            for key in keys:
                group[key] = tuple(group[key])
        scheduler = self.lr_scheduler
        scheduler.load_state_dict(state["lr_scheduler"])
        # The next step's lr from this run's schedule at the restored step, as torchtune's
        # recipes rebuild theirs (last_epoch=step-1): the state's own is its run's, and a run
        # continued with more steps (load_checkpoint.path, max_steps=<more>) trained its first
        # step at the old schedule's end, 0. The same value where the schedule is the same.
        assert isinstance(scheduler, torch.optim.lr_scheduler.LambdaLR)  # _lr_scheduler's
        for group, base_lr, factor in zip(
            self.optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas, strict=True
        ):
            group["lr"] = base_lr * factor(scheduler.last_epoch)
        scheduler._last_lr = [group["lr"] for group in self.optimizer.param_groups]


def _lr_scheduler(
    optimizer: torch.optim.Optimizer, schedule: dict[str, Any], total_steps: int
) -> torch.optim.lr_scheduler.LRScheduler:
    if schedule["cosine_decay"]:
        cosine: torch.optim.lr_scheduler.LRScheduler = get_cosine_schedule_with_warmup(
            optimizer, schedule["warmup_steps"], total_steps
        )
        return cosine
    # The cosine schedule's warmup (from 0 at the first step, full at warmup_steps), then
    # constant: it began at lr/warmup_steps and peaked a step earlier than the cosine's.
    warmup = schedule["warmup_steps"]
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: 1.0 if step >= warmup else step / warmup
    )
