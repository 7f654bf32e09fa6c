"""Full fine-tune recipe: setup -> train loop -> checkpoint, in the torchtune style.

    python -m runner.recipes.full_finetune RUN_DIR/recipe.yaml

It reads only the resolved recipe config. One process, or several under torch.distributed.run
(gloo on CPU, nccl on GPU) with the model sharded by FSDP2's fully_shard. When the run directory
already holds a whole checkpoint (a restart, or `runner train resume=RUN`), it continues from it.
SIGTERM (a preemption, `runner stop`) or Ctrl-C makes every rank save at the next step boundary;
the run ends `cancelled` and `runner train` exits 143 (130 for Ctrl-C).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import random
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.utils.data import DataLoader, DistributedSampler
from tqdm import tqdm

from runner.components import instantiate
from runner.config.optimizer import split_option
from runner.data import collate, eval_prompts, training_splits
from runner.errors import Diverged
from runner.models.backends import backend_for
from runner.models.checkpoint import read_training_state, write_checkpoint
from runner.models.torchtune_boundary import (
    CROSS_ENTROPY_IGNORE_IDX,
    get_cosine_schedule_with_warmup,
    set_activation_checkpointing,
)
from runner.rundir import RunDir
from runner.rundir.manifest import record_checkpoint
from runner.train import process, trackers
from runner.train.evaluate import LOSS_METRICS, exact_match, loss_metrics, loss_sums

log = logging.getLogger("runner.recipe")
# The dtype group: (dtype of the trained parameters, gradients and optimizer state; compute dtype).
# bf16_mixed keeps fp32 master weights, which small AdamW updates do not round away.
PRECISIONS = {
    "fp32": (torch.float32, torch.float32),
    "bf16": (torch.bfloat16, torch.bfloat16),
    "bf16_mixed": (torch.float32, torch.bfloat16),
}
FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


class FullFinetuneRecipe:
    """Trains every parameter of a decoder on an instruction dataset."""

    def __init__(self, cfg: DictConfig) -> None:
        self.cfg = cfg
        self.run = RunDir(cfg.run_dir)
        self.world_size = dist.get_world_size() if dist.is_initialized() else 1
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.is_rank_zero = self.rank == 0
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        self.device = torch.device(f"cuda:{local_rank}" if cfg.compute.device == "cuda" else "cpu")
        if cfg.compute.device == "cuda":
            torch.cuda.set_device(self.device)
        self.dtype, self.compute_dtype = PRECISIONS[cfg.dtype.name]
        # How the model is built, sharded and saved: torchtune's or transformers' (model.backend).
        self.backend = backend_for(cfg.model)
        # The optimizer's component and arguments, and its schedule (runner.config.optimizer).
        optimizer, self.schedule = split_option(OmegaConf.to_container(cfg.optimizer))
        self.optimizer_node = OmegaConf.create(optimizer)
        self.step = 0
        self.epoch = 0
        self.batches_done_in_epoch = 0
        self.logger = None
        # Why the loop stopped before total_steps (SIGTERM), or None.
        self.stopped_by: str | None = None
        # The best evaluation so far by cfg.objective (metric, mode, step, value), kept in
        # every checkpoint's training state; and the metrics of the last evaluation.
        self.best: dict[str, Any] | None = None
        self.last_eval: dict[str, float] | None = None

    # ---- setup --------------------------------------------------------------------------
    def setup(self) -> None:
        """Builds tokenizer, data, model, optimizer and schedule; loads the latest checkpoint."""
        cfg = self.cfg
        self._status("initializing")
        torch.manual_seed(cfg.seed)
        random.seed(cfg.seed)
        self.tokenizer = instantiate(cfg.model.tokenizer)
        # resolve.py made sure that a run that evaluates has a validation split.
        self.dataset, self.validation = training_splits(
            cfg.dataset, self.tokenizer, validation=cfg.eval.strategy != "no"
        )
        self.sampler = DistributedSampler(
            self.dataset, num_replicas=self.world_size, rank=self.rank, shuffle=True, seed=cfg.seed
        )
        accumulation = self.cfg.gradient_accumulation_steps
        self.steps_per_epoch = len(self.dataset) // (
            self.cfg.batch_size * self.world_size * accumulation
        )
        if self.steps_per_epoch == 0:
            raise ValueError("the dataset is smaller than one global batch")
        self.total_steps = self.steps_per_epoch * self.cfg.epochs
        if self.cfg.max_steps is not None:
            self.total_steps = min(self.total_steps, self.cfg.max_steps)
        self.model = self._build_model()
        # Every rank built the same initial weights; randomness from here on is per rank.
        torch.manual_seed(cfg.seed + self.rank)
        trainable = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = instantiate(self.optimizer_node, trainable)
        self.lr_scheduler = self._build_lr_scheduler()
        self.loss_fn = instantiate(cfg.loss)
        if hasattr(self.loss_fn, "num_output_chunks"):
            self.model.set_num_output_chunks(self.loss_fn.num_output_chunks)
        latest = self.run.latest_checkpoint()
        if self.is_rank_zero:
            for leftover in self.run.remove_leftovers():
                log.info("removed %s, left by an interrupted save", leftover)
            if latest is None and self.run.read_metrics():
                # Restarted with no checkpoint: the steps are logged again from the first.
                self.run.truncate_metrics(0)
        if latest is not None:
            self._load_training_state(latest)
        self.logger = self._build_logger()

    def _build_model(self) -> torch.nn.Module:
        return self._prepare_model(self.backend.build(self.device, self.dtype))

    def _prepare_model(self, model: torch.nn.Module) -> torch.nn.Module:
        """Activation checkpointing, FSDP2 sharding over the ranks and compilation, as set."""
        if self.cfg.activation_checkpointing:
            set_activation_checkpointing(model, auto_wrap_policy=self.backend.layer_classes(model))
        if self.world_size > 1:
            policy = MixedPrecisionPolicy(
                param_dtype=self.compute_dtype, reduce_dtype=torch.float32
            )
            # fully_shard's default mesh is CUDA whenever CUDA is visible, which would move a
            # compute=cpu run's weights onto the GPU: the mesh is on the run's device.
            mesh = init_device_mesh(self.device.type, (self.world_size,))
            for layer in self.backend.layers(model):
                fully_shard(layer, mesh=mesh, mp_policy=policy)
            fully_shard(model, mesh=mesh, mp_policy=policy)
        if self.cfg.compile:
            for layer in self.backend.layers(model):
                layer.compile()
        return model

    def _autocast(self) -> contextlib.AbstractContextManager:
        """Mixed precision in one process: bf16 compute over the fp32 parameters (sharded over
        several processes, FSDP2's policy casts them instead)."""
        if self.compute_dtype == self.dtype or self.world_size > 1:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.compute_dtype)

    def _build_lr_scheduler(self) -> torch.optim.lr_scheduler.LRScheduler:
        schedule = self.schedule
        if schedule["cosine_decay"]:
            return get_cosine_schedule_with_warmup(
                self.optimizer, schedule["warmup_steps"], self.total_steps
            )
        warmup = max(schedule["warmup_steps"], 1)
        return torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda step: min(1.0, (step + 1) / warmup)
        )

    def _build_logger(self) -> Any:
        """The trackers of runtime.loggers (rank 0 only; metrics.jsonl is written apart)."""
        if not self.is_rank_zero:
            return None
        return trackers.build(
            list(self.cfg.runtime.loggers),
            run_dir=self.run.path,
            config=OmegaConf.to_container(self.cfg, resolve=True),
            project=self.cfg.runtime.project,
        )

    # ---- train loop ---------------------------------------------------------------------
    def train(self) -> dict[str, Any]:
        """Runs optimizer steps until total_steps, checkpointing on the configured cadence."""
        if self.step >= self.total_steps:
            # Resumed from the final checkpoint (killed before the run was marked completed):
            # nothing is left to train, and that checkpoint is kept as it is.
            log.info("step %d of %d: nothing left to train", self.step, self.total_steps)
            return {"first_loss": None, "last_loss": None}
        self._status("running", step=self.step, total_steps=self.total_steps, **self._best_field())
        log_every = self.cfg.runtime.log_every_n_steps
        save_every = self.cfg.runtime.save_every_n_steps
        bar = tqdm(
            total=self.total_steps,
            initial=self.step,
            disable=not (self.is_rank_zero and self.cfg.runtime.progress_bar),
            dynamic_ncols=True,
        )
        first_loss = last_loss = None
        # Each step's loss stays on the device until it is read (the first step, a logged one,
        # before a save): no host sync in the other steps.
        unread: list[torch.Tensor] = []
        window_tokens, window_start = 0, time.perf_counter()
        for batches in self._epoch_batches():
            loss, tokens = self._optimizer_step(batches)
            self.step += 1
            window_tokens += tokens
            unread.append(loss)
            if first_loss is None:
                first_loss = last_loss = self._read_losses(unread)
                # The summary that `runner train` prints reads the run's first loss from here.
                self._status("running", step=self.step, first_loss=first_loss)
            if self.step % log_every == 0 or self.step == self.total_steps:
                last_loss = self._read_losses(unread) if unread else last_loss
                tokens_per_s = window_tokens / (time.perf_counter() - window_start)
                self._log({"loss": last_loss, "tokens_per_s": tokens_per_s})
                bar.set_postfix(loss=f"{last_loss:.4f}", tok_s=f"{tokens_per_s:,.0f}")
                window_tokens, window_start = 0, time.perf_counter()
            bar.update(1)
            # A new best is saved at its step, whatever the checkpoint cadence.
            improved = self._eval_due() and self.evaluate()
            stop = self.step >= self.total_steps or self.step == self.cfg.stop_at_step
            if not stop and self._stop_agreed():
                stop, self.stopped_by = (
                    True,
                    f"stopped by {process.STOP.signal.name} at step {self.step}",
                )
            if stop or improved or (save_every and self.step % save_every == 0):
                last_loss = self._read_losses(unread) if unread else last_loss
                self.save_checkpoint()
            if stop:
                break
        bar.close()
        return {"first_loss": first_loss, "last_loss": last_loss}

    def _stop_agreed(self) -> bool:
        """Whether any rank got SIGTERM; every rank joins, so all stop at the same step."""
        if self.world_size == 1:  # no collective, and no device round trip in each step
            return process.STOP.is_set()
        flag = torch.tensor(float(process.STOP.is_set()), device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def _epoch_batches(self) -> Any:
        """Yields lists of micro-batches (one list per optimizer step) from the saved position."""
        accumulation = self.cfg.gradient_accumulation_steps
        while self.epoch < self.cfg.epochs:
            self.sampler.set_epoch(self.epoch)
            per_rank = self.steps_per_epoch * accumulation * self.cfg.batch_size
            indices = list(self.sampler)[:per_rank]
            start = self.batches_done_in_epoch * self.cfg.batch_size
            loader = DataLoader(
                self.dataset,
                batch_size=self.cfg.batch_size,
                sampler=indices[start:],
                collate_fn=self._collate,
                # Its own generator: a new iterator draws a seed from it, and drawing from the
                # global RNG would shift dropout after a resume (which restores that RNG).
                generator=torch.Generator(),
            )
            group = []
            for batch in loader:
                group.append(batch)
                if len(group) == accumulation:
                    self.batches_done_in_epoch += accumulation
                    yield group
                    group = []
            self.epoch += 1
            self.batches_done_in_epoch = 0

    def _collate(self, samples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        return collate(
            samples,
            packed=self.cfg.dataset.packing,
            padding_free=self.cfg.dataset.padding_free,
            padding_idx=self.tokenizer.pad_id,
            on_cuda=self.device.type == "cuda",
        )

    def _optimizer_step(self, batches: list[dict[str, torch.Tensor]]) -> tuple[torch.Tensor, int]:
        """One optimizer step over micro-batches: its loss (normalized by all ranks' tokens, on
        the device, unread) and the tokens it saw."""
        loss_sum = torch.zeros((), device=self.device)
        num_tokens = torch.zeros((), device=self.device)
        seen_tokens = 0
        for batch in batches:
            tokens = batch["tokens"].to(self.device)
            labels = batch["labels"].to(self.device)
            batch_tokens = (labels != CROSS_ENTROPY_IGNORE_IDX).sum()
            packed = {k: batch[k].to(self.device) for k in ("mask", "input_pos") if k in batch}
            with self._autocast():
                logits = self.model(tokens, **packed)
                loss = self._loss(logits, labels) * batch_tokens
            loss.backward()
            loss_sum += loss.detach()
            num_tokens += batch_tokens
            seen_tokens += tokens.numel()
        if self.world_size > 1:
            dist.all_reduce(num_tokens)
            dist.all_reduce(loss_sum)
        # FSDP averages gradients over ranks; scaling by world/tokens makes it a per-token mean.
        scale = self.world_size / num_tokens.clamp(min=1)
        self._apply_gradients(scale)
        return (loss_sum / num_tokens.clamp(min=1)).detach(), seen_tokens * self.world_size

    def _apply_gradients(self, scale: torch.Tensor) -> None:
        """Scales the accumulated gradients, clips them, steps optimizer and schedule."""
        for param in self.model.parameters():
            if param.grad is not None:
                param.grad.mul_(scale.to(param.grad.dtype))
        if self.cfg.clip_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.clip_grad_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.lr_scheduler.step()

    def _read_losses(self, unread: list[torch.Tensor]) -> float:
        """The steps' losses read from the device at once (and forgotten); the last of them.
        A non-finite one fails the run, naming its step, before anything is saved."""
        values = torch.stack([torch.as_tensor(loss, dtype=torch.float32) for loss in unread])
        values = values.cpu().tolist()
        first_step = self.step - len(values) + 1
        unread.clear()
        for step, value in enumerate(values, first_step):
            if not math.isfinite(value):
                raise Diverged(self.cfg.optimizer.lr, value, step)
        return values[-1]

    def _loss(self, logits: Any, labels: torch.Tensor) -> torch.Tensor:
        if isinstance(logits, list):  # chunked output, for CEWithChunkedOutputLoss
            return self.loss_fn(logits, labels)
        return self.loss_fn(logits.reshape(-1, logits.size(-1)).float(), labels.reshape(-1))

    def _log(self, values: dict[str, float]) -> None:
        if not self.is_rank_zero:
            return
        record = {"step": self.step, **values, "lr": self.optimizer.param_groups[0]["lr"]}
        self.run.append_metrics(record)
        log.info(
            "step %d/%d loss %.4f lr %.3g tokens/s %.0f",
            self.step,
            self.total_steps,
            values["loss"],
            record["lr"],
            values["tokens_per_s"],
        )
        if self.logger is not None:
            scalars = {k: v for k, v in record.items() if k != "step"}
            self.logger.metrics("train", scalars, self.step)
        self._status("running", step=self.step, total_steps=self.total_steps, loss=values["loss"])

    # ---- checkpoint ---------------------------------------------------------------------
    def save_checkpoint(self) -> None:
        """Gathers full weights and optimizer state (every rank joins), rank 0 writes them."""
        self._status("checkpointing", step=self.step, total_steps=self.total_steps)
        model_state = self._gather_model_state()
        optimizer_state = get_optimizer_state_dict(self.model, self.optimizer, options=FULL)
        rng = {"torch": torch.get_rng_state(), "python": random.getstate()}
        rng_per_rank = [None] * self.world_size
        if self.world_size > 1:
            dist.all_gather_object(rng_per_rank, rng)
        else:
            rng_per_rank = [rng]
        if self.is_rank_zero:
            training_state = {
                "step": self.step,
                "epoch": self.epoch,
                "batches_done_in_epoch": self.batches_done_in_epoch,
                # The data position in samples of the global order, whatever the world size.
                "samples_done_in_epoch": self.batches_done_in_epoch
                * self.cfg.batch_size
                * self.world_size,
                "optimizer": optimizer_state,
                "lr_scheduler": self.lr_scheduler.state_dict(),
                "rng_per_rank": rng_per_rank,
                "world_size": self.world_size,
                "best": self.best,
            }
            tmp = self.run.fresh_checkpoint_tmp(self.step)
            self._write_checkpoint(tmp, model_state, training_state)
            final = self.run.commit_checkpoint(
                tmp,
                self.step,
                self.cfg.runtime.keep_last_n_checkpoints,
                keep_step=self.best["step"] if self.best else None,
            )
            record_checkpoint(self.run, self.step, final)
        if self.world_size > 1:
            dist.barrier()
        self._status("running", step=self.step, total_steps=self.total_steps, **self._best_field())

    def _gather_model_state(self) -> dict[str, Any]:
        """Full weights on the CPU of every rank (every rank joins)."""
        return get_model_state_dict(self.model, options=FULL)

    def _write_checkpoint(
        self, out_dir: Path, model_state: dict[str, Any], training_state: dict[str, Any]
    ) -> None:
        write_checkpoint(
            out_dir,
            model_state=self.backend.to_hf(
                {k: v.to(torch.float32) for k, v in model_state.items()}
            ),
            hf_config=OmegaConf.to_container(self.cfg.model.hf_config),
            tokenizer_dir=Path(self.cfg.model.tokenizer.path),
            chat_template=self._chat_template(),
            training_state=training_state,
            stop_token_ids=self.tokenizer.stop_tokens,
            source_dir=Path(self.cfg.model.source) if self.cfg.model.source else None,
        )

    def _chat_template(self) -> Path | None:
        """model.chat_template's file, which every checkpoint keeps (None: the tokenizer's)."""
        template = self.cfg.model.tokenizer.chat_template
        return None if template is None else Path(template)

    def _load_model_weights(self, checkpoint: Path) -> None:
        model_state = {
            k: v.to(self.dtype) for k, v in self.backend.read_weights(checkpoint).items()
        }
        set_model_state_dict(self.model, model_state, options=FULL)

    def _load_training_state(self, checkpoint: Path) -> None:
        state = read_training_state(checkpoint)
        self._load_model_weights(checkpoint)
        set_optimizer_state_dict(self.model, self.optimizer, state["optimizer"], options=FULL)
        self.lr_scheduler.load_state_dict(state["lr_scheduler"])
        self.step = state["step"]
        # A training state written without evaluation has no best.
        self.best = state.get("best")
        self.epoch = state["epoch"]
        # Micro-batches of this rank: checkpoints move between world sizes at one global batch.
        per_micro_batch = self.cfg.batch_size * self.world_size
        if state["samples_done_in_epoch"] % per_micro_batch:
            raise ValueError(
                f"{checkpoint} stopped {state['samples_done_in_epoch']} samples into an epoch, "
                f"not a multiple of batch_size x world size = {per_micro_batch}; resume with "
                "the global batch it was written with"
            )
        self.batches_done_in_epoch = state["samples_done_in_epoch"] // per_micro_batch
        if state["world_size"] == self.world_size:
            rng = state["rng_per_rank"][self.rank]
            torch.set_rng_state(rng["torch"])
            random.setstate(rng["python"])
        if self.is_rank_zero:
            self.run.truncate_metrics(self.step)
            print(f"resuming from {checkpoint} at step {self.step}", file=sys.stderr)

    # ---- evaluation ---------------------------------------------------------------------
    def _eval_due(self) -> bool:
        """Whether eval.strategy asks for an evaluation after this step (always at the last)."""
        strategy = self.cfg.eval.strategy
        if strategy == "no":
            return False
        if self.step == self.total_steps:
            return True
        if strategy == "steps":
            return self.step % self.cfg.eval.steps == 0
        return self.step % self.steps_per_epoch == 0

    def evaluate(self) -> bool:
        """Evaluates on the validation split, records it; whether it is a new best.

        Every rank joins (each forward of a sharded model is a collective) and gets the same
        metrics; rank 0 writes them. The model goes back to training mode unchanged.
        """
        with self._autocast():
            metrics = self._eval_metrics()
        self.last_eval = metrics
        improved = self._update_best(metrics)
        if self.is_rank_zero:
            self._record_eval(metrics)
        return improved

    def _eval_metrics(self) -> dict[str, float]:
        wanted = self.cfg.eval.metrics
        metrics: dict[str, float] = {}
        if any(name in wanted for name in LOSS_METRICS):
            sums = loss_sums(
                self.model,
                self._validation_batches(),
                ignore_index=CROSS_ENTROPY_IGNORE_IDX,
                device=self.device,
            )
            if self.world_size > 1:
                dist.all_reduce(sums)
            metrics |= {k: v for k, v in loss_metrics(sums).items() if k in wanted}
        if "eval_exact_match" in wanted and self.cfg.dataset.eval_samples > 0:
            prompts = eval_prompts(self.validation, self.tokenizer, self.cfg.dataset.eval_samples)
            metrics["eval_exact_match"] = exact_match(
                self.model,
                self.tokenizer,
                prompts,
                max_new_tokens=self.cfg.dataset.eval_max_new_tokens,
                device=self.device,
            )
        return metrics

    def _validation_shares(self) -> Iterator[tuple[list[Any], int]]:
        """This rank's share of the validation records, in batches of batch_size, with how
        many of each batch count.

        Batch b of rank r holds records [(b * world + r) * batch_size, ...) of the first
        eval.max_samples. Every rank runs the same number of forwards (each is a collective
        under FSDP): a rank left without records gets one record that counts for nothing.
        """
        count = len(self.validation)
        if self.cfg.eval.max_samples is not None:
            count = min(count, self.cfg.eval.max_samples)
        size = self.cfg.batch_size
        for batch in range(math.ceil(count / (size * self.world_size))):
            start = (batch * self.world_size + self.rank) * size
            indices = range(start, min(start + size, count))
            yield [self.validation[i] for i in indices] or [self.validation[0]], len(indices)

    def _validation_batches(self) -> Any:
        """This rank's validation batches (_validation_shares); a record that counts for
        nothing has every label ignored, which adds nothing to the sums."""
        for samples, counted in self._validation_shares():
            # The validation split is never packed (padding-free, where training is).
            batch = collate(
                samples,
                packed=False,
                padding_free=self.cfg.dataset.padding_free,
                padding_idx=self.tokenizer.pad_id,
                on_cuda=self.device.type == "cuda",
            )
            if counted == 0:
                batch["labels"].fill_(CROSS_ENTROPY_IGNORE_IDX)
            yield batch

    def _update_best(self, metrics: dict[str, float]) -> bool:
        """Keeps the best value of cfg.objective's metric; whether this evaluation beat it."""
        metric, mode = self.cfg.objective.metric, self.cfg.objective.mode
        value = metrics.get(metric)
        if value is None or math.isnan(value):
            return False
        if self.best is not None:
            better = value < self.best["value"] if mode == "min" else value > self.best["value"]
            if not better:
                return False
        self.best = {"metric": metric, "mode": mode, "step": self.step, "value": value}
        return True

    def _best_field(self) -> dict[str, Any]:
        """status.json's `best`: the best evaluation and its checkpoint (once saved)."""
        if self.best is None:
            return {}
        checkpoint = self.run.checkpoint_path(self.best["step"])
        return {"best": {**self.best, "checkpoint": str(checkpoint)}}

    def _record_eval(self, metrics: dict[str, float]) -> None:
        self.run.append_metrics({"step": self.step, **metrics})
        log.info(
            "eval at step %d: %s",
            self.step,
            " ".join(f"{name} {value:.4f}" for name, value in metrics.items()),
        )
        if self.logger is not None:
            self.logger.metrics("eval", metrics, self.step)
        self._status(
            "running",
            step=self.step,
            total_steps=self.total_steps,
            eval={"step": self.step, **metrics},
        )

    # ---- end ----------------------------------------------------------------------------
    def cleanup(self) -> None:
        """Tells the trackers the best checkpoint (when saved) and how the run ended."""
        if self.logger is None:
            return
        best = self._best_field().get("best")
        if best is not None and Path(best["checkpoint"]).is_dir():
            self.logger.best_checkpoint(best)
        self.logger.close(self.run.status().state)

    def _status(self, state: str, **fields: Any) -> None:
        if self.is_rank_zero:
            self.run.write_status(state, **fields)


def run(recipe_path: str | Path) -> dict[str, Any]:
    """Runs the full fine-tune at `recipe_path` in this process (one of several under torchrun)."""
    return process.run(recipe_path, FullFinetuneRecipe)


if __name__ == "__main__":
    run(sys.argv[1])
