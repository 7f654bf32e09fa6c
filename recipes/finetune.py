"""The fine-tune recipe of every method: setup -> train loop -> checkpoint, in the torchtune style.

    python -m runner.recipes.finetune RUN_DIR/recipe.yaml

It reads only the resolved recipe config. The method (`method.name`, runner.trainer.methods) is a
pair of strategies: what trains and how it is built, saved and loaded (every parameter, or LoRA
adapters on a frozen base: runner.trainer.weights), and what the loss is made of (supervised
cross-entropy, or a preference loss against a reference: runner.trainer.objectives).

One process, or several under torch.distributed.run (gloo on CPU, nccl on GPU) with the model
sharded by FSDP2's fully_shard. When the run directory already holds a whole checkpoint (a
restart, or `runner train resume=RUN`), it continues from it.
SIGTERM (a preemption, `runner stop`) or Ctrl-C makes every rank save at the next step boundary;
the run ends `cancelled` and `runner train` exits 143 (130 for Ctrl-C).

The pieces around the loop live in runner/trainer by what they do: parallel (rank, device,
precision, sharding), batches (the data in optimizer steps), optimizer (optimizer and schedule),
progress (status, metrics, trackers, the console), evaluate, checkpointing, profiling.
"""

from __future__ import annotations

import logging
import random
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig

from runner.components import instantiate, plain_dict
from runner.config.optimizer import split_option, state_per_weight, warn_long_warmup
from runner.data import Split, said_at_launch, training_splits, validation_split
from runner.data.stream import StreamSplit
from runner.errors import UserError
from runner.hub.download import TokenRef
from runner.models.backends import backend_for, set_output_chunks
from runner.models.checkpoint import read_training_state
from runner.models.torchtune_boundary import compile_loss
from runner.rundir import RunDir
from runner.trainer import checkpointing, parallel, process
from runner.trainer.batches import Batch, EpochBatches, StreamBatches
from runner.trainer.evaluate import eval_due, new_best, validation_shares
from runner.trainer.methods import METHODS
from runner.trainer.optimization import Optimization
from runner.trainer.profiling import StepProfiler
from runner.trainer.progress import Reporter, StepLosses, Throughput, Tokens, breaks_after
from runner.trainer.weights import model_files

log = logging.getLogger("runner.recipe")


class FinetuneRecipe:
    """Trains a decoder by its method: what trains, and on what loss (runner.trainer.methods)."""

    def __init__(self, cfg: DictConfig) -> None:
        self.cfg = cfg
        self.run = RunDir(cfg.run_dir)
        # Rank, device, the dtype group's parameter and compute dtypes, the group ranks vote over.
        self.place = parallel.placement(
            cfg.compute.device, cfg.dtype.name, cfg.compute.collective_timeout_s
        )
        self.is_rank_zero = self.place.is_rank_zero
        # How the model is built, sharded and saved: torchtune's or transformers' (model.backend).
        self.backend = backend_for(cfg.model)
        self.method = METHODS[cfg.method.name]
        self.reporter = Reporter(self.run, is_rank_zero=self.is_rank_zero)
        self.step = 0
        self.total_steps = 0
        # Whether the run continues from a checkpoint of its own: its first attempt recorded the
        # run's first loss, which a resume keeps.
        self.resumed = False
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
        self.reporter.status("initializing")
        torch.manual_seed(cfg.seed)
        random.seed(cfg.seed)
        self.tokenizer = instantiate(cfg.model.tokenizer)
        files = model_files(cfg.model, self.tokenizer, cfg.dataset.new_system_prompt)
        self.weights = self.method.weights(
            self.backend, self.place, files, method=cfg.method, seed=cfg.seed
        )
        self.objective = self.method.objective(
            self.place, self.tokenizer, dataset=cfg.dataset, method=cfg.method
        )
        self.data = self._batches()
        self.total_steps = self.data.steps_per_epoch * cfg.epochs
        if cfg.max_steps is None or self.total_steps < cfg.max_steps:
            # Its epochs end it first: the launcher's check saw only max_steps.
            epochs = f"the {{}} steps of its epochs={cfg.epochs}"
            if self.place.rank == 0:
                warn_long_warmup(plain_dict(cfg.optimizer), self.total_steps, epochs)
        else:
            self.total_steps = cfg.max_steps
        self.model, reference = self.weights.build(
            self._prepare_model, reference=self.objective.wants_reference
        )
        # Every rank built the same initial weights; randomness from here on is per rank.
        torch.manual_seed(cfg.seed + self.place.rank)
        self.optim = Optimization(
            cfg.optimizer,
            [p for p in self.model.parameters() if p.requires_grad],
            total_steps=self.total_steps,
            clip_grad_norm=cfg.clip_grad_norm,
        )
        loss_fn = instantiate(cfg.loss)
        if cfg.compile:
            # As torchtune's recipes compile it: for chunked cross-entropy, each chunk's upcast
            # and cross-entropy fused (the chunking stays eager); any other loss whole.
            loss_fn = compile_loss(loss_fn, verbose=False)
            log.info("compiled: each decoder layer, and the loss")
        if hasattr(loss_fn, "num_output_chunks"):
            set_output_chunks(self.model, loss_fn.num_output_chunks)
        self.objective.attach(self.model, loss_fn, reference, attention=cfg.attention)
        self._resume()
        if self.is_rank_zero:
            checkpointing.warn_before_training(
                self.run,
                self.model,
                moments=state_per_weight(split_option(plain_dict(cfg.optimizer))[0]),
                whole_model=self.weights.saves_whole_model(),
                keep_last_n=cfg.runtime.keep_last_n_checkpoints,
                keep_step=self.best["step"] if self.best else None,
                evaluates=cfg.eval.strategy != "no",
                # At most: a save each cadence step, each evaluation's new best, and the last.
                saves_left=breaks_after(self.step, self.total_steps, self._breaks_every()),
            )
        self.reporter.start_trackers(cfg)

    def _batches(self) -> EpochBatches | StreamBatches:
        """The training batches, of the split read whole or as a stream; sets self.validation
        (resolve.py made sure that a run that evaluates has a validation split)."""
        cfg, tokenizer = self.cfg, self.tokenizer
        evaluates = cfg.eval.strategy != "no"
        common = {"batch_size": cfg.batch_size, "accumulation": cfg.gradient_accumulation_steps}
        if cfg.dataset.streaming:
            with said_at_launch():
                self.validation = validation_split(cfg.dataset, tokenizer) if evaluates else None

            # Read here, in the training process, from its reference: never in the recipe.
            token = TokenRef.parse(cfg.runtime.hf_token).read()

            def reader(index: int, readers: int) -> StreamSplit:
                return StreamSplit(
                    cfg.dataset,
                    tokenizer,
                    reader=index,
                    readers=readers,
                    seed=cfg.seed,
                    token=token,
                )

            return StreamBatches(
                reader,
                self.objective.collate,
                self.place,
                **common,
                max_steps=cfg.max_steps,
                num_workers=cfg.dataset.num_workers,
            )
        with said_at_launch():
            dataset, self.validation = training_splits(cfg.dataset, tokenizer, validation=evaluates)
        return EpochBatches(
            dataset,
            self.objective.collate,
            self.place,
            **common,
            epochs=cfg.epochs,
            seed=cfg.seed,
            num_workers=cfg.dataset.num_workers,
        )

    def _prepare_model(self, model: torch.nn.Module) -> torch.nn.Module:
        return parallel.prepare_model(
            model,
            self.backend,
            self.place,
            activation_checkpointing=self.cfg.activation_checkpointing,
            compile=self.cfg.compile,
        )

    def _resume(self) -> None:
        """Continues from the run's latest whole checkpoint, else from the checkpoint of another
        run that load_checkpoint names, if any; clears what an interrupted save or an earlier
        attempt left behind."""
        latest = self.run.latest_checkpoint()
        self.resumed = latest is not None
        if self.is_rank_zero:
            for leftover in self.run.remove_leftovers():
                log.info("removed %s, left by an interrupted save", leftover)
            if latest is None:
                # From the first step: metrics.jsonl is there from now on, empty until a step is
                # logged (restarted with no checkpoint, the steps are logged again from the first).
                trained = max(self.run.losses(), default=0)
                if trained and self.cfg.resume_from is None:
                    log.warning(
                        "no checkpoint to go on from (the run had logged step %d, and saved none "
                        "or its checkpoints are gone): it trains again from step 0",
                        trained,
                    )
                self.run.truncate_metrics(0)
        if latest is None and self.cfg.resume_from is not None:
            # load_checkpoint: another run's checkpoint, read where it is (a mount, read-only).
            latest = Path(self.cfg.resume_from)
        if latest is not None:
            self._load_training_state(latest)

    # ---- train loop ---------------------------------------------------------------------
    def train(self) -> dict[str, Any]:
        """Runs optimizer steps until total_steps, checkpointing on the configured cadence."""
        left = self.data.steps_left() if isinstance(self.data, EpochBatches) else None
        if left is not None and self.step + left < self.total_steps:
            # A position saved on other data (a file grown since its checkpoint) is later in
            # the epochs than its step: the run ends where its data does, as a last step (its
            # loss logged, evaluated, saved), its schedule the one it started with.
            log.warning(
                "the data ends at step %d of %d: the checkpoint's data position was saved on "
                "other data",
                self.step + left,
                self.total_steps,
            )
            self.total_steps = self.step + left
        if self.step >= self.total_steps and not self.resumed and self.cfg.resume_from:
            # load_checkpoint at or past this run's length (max_steps is checked at launch; the
            # steps that epochs make are known only here): it would end with no checkpoint.
            raise UserError(
                "epochs",
                self.cfg.epochs,
                f"load_checkpoint.path's checkpoint is at step {self.step}, and this run ends at "
                f"step {self.total_steps}: give more epochs (or max_steps above {self.step})",
            )
        if self.step >= self.total_steps:
            # Resumed from the final checkpoint (killed before the run was marked completed):
            # nothing is left to train, and that checkpoint is kept as it is.
            log.info("step %d of %d: nothing left to train", self.step, self.total_steps)
            return {"first_loss": None, "last_loss": None}
        self._status_running(**self._best_field())
        save_every = self.cfg.runtime.save_every_n_steps
        self.reporter.start_console(
            step=self.step,
            total_steps=self.total_steps,
            progress_bar=self.cfg.runtime.progress_bar,
            breaks_every=self._breaks_every(),
        )
        losses, throughput = StepLosses(self.cfg.optimizer.lr), Throughput()
        profiler = self._profiler()
        started = self.step
        for batches in self.data:
            profiler.before_step(self.step + 1)
            loss, tokens = self._optimizer_step(batches)
            self.step += 1
            with throughput.paused():  # writing the window's files is no step's time
                profiler.after_step(self.step)
            throughput.add(tokens)
            losses.add(loss)
            if losses.first is None and not self.resumed:
                # The summary that `runner train` prints reads the run's first loss from here.
                self.reporter.status("running", step=self.step, first_loss=losses.read(self.step))
            if self.step % self.cfg.runtime.log_every_n_steps == 0 or self._last_step():
                values = {"loss": losses.read(self.step), "tokens_per_s": throughput.read()}
                self._log(values)
            if self._last_step():
                self._log_totals()
            self.reporter.advance()
            with throughput.paused(), self.reporter.paused(), profiler.paused():
                # A new best is saved at its step, whatever the checkpoint cadence.
                improved = self._eval_due() and self.evaluate()
                stop = self._stop_due()
                if stop or improved or (save_every and self.step % save_every == 0):
                    losses.read(self.step)
                    self.save_checkpoint()
            if stop:
                break
        else:
            # The data ended before the steps did, unforeseen (steps_left): what trained is kept.
            log.warning("the data ended at step %d of %d", self.step, self.total_steps)
            if self.step > started:
                losses.read(self.step)
                self.save_checkpoint()
        profiler.stop(self.step)  # a window the run stopped in
        return {"first_loss": losses.first, "last_loss": losses.last}

    def _profiler(self) -> StepProfiler:
        """torch.profiler over the steps that `profile` names, on rank 0."""
        settings = self.cfg.profile
        profiler = StepProfiler(
            enabled=settings.enabled and self.is_rank_zero,
            start=settings.start_step,
            steps=settings.steps,
            device=self.place.device,
            out_dir=self.run.profile_dir,
        )
        profiler.check_window(first_step=self.step + 1, total_steps=self.total_steps)
        return profiler

    def _log_totals(self) -> None:
        """At the last step, before its checkpoint: what compiling cost in graphs (torch._dynamo's
        counts), and the device's peak memory (scripts/gpu/gpu_report.py reads both)."""
        if self.cfg.compile:
            log.info("compiled: %s", parallel.compile_counts())
        peak = parallel.peak_memory(self.place)
        if peak is not None:
            log.info("peak device memory: %s (torch.cuda.max_memory_allocated)", peak)

    def _last_step(self) -> bool:
        return self.step == self.total_steps

    def _stop_due(self) -> bool:
        """Whether the loop ends after this step: the last, stop_at_step, or a SIGTERM that
        any rank got (every rank joins, so all stop at the same step)."""
        if self.step >= self.total_steps or self.step == self.cfg.stop_at_step:
            return True
        if parallel.any_rank(process.STOP.is_set(), self.place):
            self.stopped_by = f"stopped by {process.STOP.signal.name} at step {self.step}"
            return True
        return False

    def _optimizer_step(self, batches: list[Batch]) -> tuple[torch.Tensor, Tokens]:
        """One optimizer step over a step's micro-batches: its loss (on the device, unread)
        and the positions every rank computed (the objective's)."""
        return self.objective.step(batches, self.optim)

    def _log(self, values: dict[str, float]) -> None:
        """A logged step: its loss and throughput (and what the objective adds), and the lr
        it trained with."""
        logged = {**values, **self.objective.logged(), "lr": self.optim.stepped_lr}
        if self.optim.grad_norm is not None:  # clip_grad_norm set: its norm, before clipping
            logged["grad_norm"] = float(self.optim.grad_norm)
        self.reporter.step(self.step, self.total_steps, logged)

    def _status_running(self, **fields: Any) -> None:
        self.reporter.status("running", step=self.step, total_steps=self.total_steps, **fields)

    # ---- checkpoint ---------------------------------------------------------------------
    def save_checkpoint(self) -> None:
        """Gathers full weights and optimizer state (every rank joins), rank 0 writes them."""
        self.reporter.status("checkpointing", step=self.step, total_steps=self.total_steps)
        model_state = self.weights.gather(self.model)
        optimizer_state = self.optim.state(self.model)
        rng_per_rank = checkpointing.rng_per_rank(self.place)
        position = self.data.position()
        if self.is_rank_zero:
            training_state = {
                "step": self.step,
                **position,
                **optimizer_state,
                "rng_per_rank": rng_per_rank,
                "world_size": self.place.world_size,
                "best": self.best,
            }
            checkpointing.commit(
                self.run,
                self.step,
                lambda out_dir: self.weights.write(out_dir, model_state, training_state),
                keep_last_n=self.cfg.runtime.keep_last_n_checkpoints,
                keep_step=self.best["step"] if self.best else None,
                evaluates=self.cfg.eval.strategy != "no",
                saved=lambda: self.reporter.status(
                    "checkpointing",
                    step=self.step,
                    total_steps=self.total_steps,
                    **self._best_field(),
                ),
            )
        checkpointing.barrier(self.place)
        self._status_running(**self._best_field())

    def _load_training_state(self, checkpoint: Path) -> None:
        state = read_training_state(checkpoint)
        self.weights.load(self.model, checkpoint)
        self.optim.restore(self.model, state)
        self.step = state["step"]
        # A training state written without evaluation has no best.
        self.best = state.get("best")
        loaded = RunDir(checkpoint.parents[1].resolve())  # RUN/checkpoints/step_N
        if self.best and loaded.path != self.run.path.resolve():
            # Continued from another run's checkpoint (load_checkpoint): its best is there.
            self.best.setdefault("checkpoint", str(loaded.checkpoint_path(self.best["step"])))
        self.data.restore(state, checkpoint)
        checkpointing.restore_rng(state, self.place)
        if self.is_rank_zero:
            self.run.truncate_metrics(self.step)
            process.tell(f"resuming from {checkpoint} at step {self.step}")

    # ---- evaluation ---------------------------------------------------------------------
    def _breaks_every(self) -> list[int]:
        """The steps between the loop's breaks (0: none but after the last step): a save each
        runtime.save_every_n_steps, an evaluation as _eval_due asks for one."""
        strategy = self.cfg.eval.strategy
        if strategy == "no":
            evals = 0
        else:
            evals = self.cfg.eval.steps if strategy == "steps" else self.data.steps_per_epoch
        return [self.cfg.runtime.save_every_n_steps or 0, evals]

    def _eval_due(self) -> bool:
        return eval_due(
            self.cfg.eval.strategy,
            every=self.cfg.eval.steps,
            step=self.step,
            total_steps=self.total_steps,
            steps_per_epoch=self.data.steps_per_epoch,
        )

    def evaluate(self) -> bool:
        """Evaluates on the validation split, records it; whether it is a new best.

        Every rank joins (each forward of a sharded model is a collective) and gets the same
        metrics; rank 0 writes them. The model goes back to training mode unchanged.
        """
        with parallel.autocast(self.place):
            metrics = self.objective.eval_metrics(
                self._validation_shares(), self._validation_split(), wanted=self.cfg.eval.metrics
            )
        self.last_eval = metrics
        objective = self.cfg.objective
        best = new_best(
            self.best, metrics, metric=objective.metric, mode=objective.mode, step=self.step
        )
        if best is not None:
            self.best = best
        self.reporter.evaluation(self.step, self.total_steps, metrics)
        return best is not None

    def _validation_split(self) -> Split:
        assert self.validation is not None, "runner.config.resolve: evaluation needs a split"
        return self.validation

    def _validation_shares(self) -> Iterator[tuple[list[Any], int]]:
        """This rank's share of the validation records (runner.trainer.evaluate)."""
        return validation_shares(
            self._validation_split(),
            max_samples=self.cfg.eval.max_samples,
            batch_size=self.cfg.batch_size,
            place=self.place,
        )

    # ---- end ----------------------------------------------------------------------------
    def best_checkpoint(self) -> dict[str, Any] | None:
        """status.json's `best`: the best evaluation and its checkpoint (once saved), or None."""
        if self.best is None:
            return None
        own = str(self.run.checkpoint_path(self.best["step"]))
        return {**self.best, "checkpoint": self.best.get("checkpoint", own)}

    def _best_field(self) -> dict[str, Any]:
        best = self.best_checkpoint()
        return {} if best is None else {"best": best}

    def cleanup(self) -> None:
        """Tells the trackers the best checkpoint (when saved) and how the run ended."""
        self.reporter.close(self.best_checkpoint())


def run(recipe_path: str | Path) -> dict[str, Any]:
    """Runs the recipe at `recipe_path` in this process (one of several under torchrun)."""
    return process.run(recipe_path, FinetuneRecipe)


if __name__ == "__main__":
    # Under torchrun (or runner's launcher with fresh interpreters) each process is its own
    # entry point: a user error is one line, as runner's CLI prints it.
    try:
        run(sys.argv[1])
    except Exception as err:  # noqa: BLE001 - a user error is one line, any other its traceback
        ended = process.user_error_exit(err)
        if ended is None:
            raise
        raise ended from None
