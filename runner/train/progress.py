"""What a training process tells the world as it goes: status.json, metrics.jsonl, the log line,
the trackers and the progress bar; and the losses it reads back from the device to do so.

Only rank 0 writes; the other ranks get the same objects, which do nothing there.
"""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig
from tqdm import tqdm

from runner.components import plain_dict
from runner.errors import Diverged
from runner.rundir import RunDir
from runner.train import trackers

log = logging.getLogger("runner.recipe")


class Reporter:
    """status.json, metrics.jsonl, the log and the trackers of one run (rank 0 only)."""

    def __init__(self, run: RunDir, *, is_rank_zero: bool) -> None:
        self.run = run
        self.is_rank_zero = is_rank_zero
        self.trackers: trackers.Trackers | None = None

    def start_trackers(self, cfg: DictConfig) -> None:
        """The trackers of runtime.loggers, each sent the whole recipe (metrics.jsonl is written
        apart)."""
        if not self.is_rank_zero:
            return
        self.trackers = trackers.build(
            list(cfg.runtime.loggers),
            run_dir=self.run.path,
            config=plain_dict(cfg, resolve=True),
            project=cfg.runtime.project,
        )

    def status(self, state: str, **fields: Any) -> None:
        """Moves the run to `state` with `fields` (runner.rundir.Status)."""
        if self.is_rank_zero:
            self.run.write_status(state, **fields)

    def step(self, step: int, total_steps: int, values: dict[str, float]) -> None:
        """A logged training step: `values` (loss, tokens_per_s, ...) and the learning rate lr."""
        if not self.is_rank_zero:
            return
        record = {"step": step, **values}
        self.run.append_metrics(record)
        log.info(
            "step %d/%d loss %.4f lr %.3g tokens/s %.0f",
            step,
            total_steps,
            values["loss"],
            values["lr"],
            values["tokens_per_s"],
        )
        if self.trackers is not None:
            self.trackers.metrics("train", values, step)
        self.status("running", step=step, total_steps=total_steps, loss=values["loss"])

    def evaluation(self, step: int, total_steps: int, metrics: dict[str, float]) -> None:
        """An evaluation's metrics, at the step it followed."""
        if not self.is_rank_zero:
            return
        self.run.append_metrics({"step": step, **metrics})
        log.info(
            "eval at step %d: %s",
            step,
            " ".join(f"{name} {value:.4f}" for name, value in metrics.items()),
        )
        if self.trackers is not None:
            self.trackers.metrics("eval", metrics, step)
        self.status("running", step=step, total_steps=total_steps, eval={"step": step, **metrics})

    def close(self, best: dict[str, Any] | None) -> None:
        """Tells the trackers the best checkpoint (when saved) and how the run ended."""
        if self.trackers is None:
            return
        if best is not None and Path(best["checkpoint"]).is_dir():
            self.trackers.best_checkpoint(best)
        self.trackers.close(self.run.status().state)


class StepLosses:
    """Each step's loss stays on the device until it is read (the first step, a logged one,
    before a save): no host sync in the other steps."""

    def __init__(self, lr: float) -> None:
        # The learning rate that a non-finite loss blames (optimizer.lr).
        self.lr = lr
        self.unread: list[torch.Tensor] = []
        self.first: float | None = None
        self.last: float | None = None

    def add(self, loss: torch.Tensor) -> None:
        """The loss of the step just taken, unread."""
        self.unread.append(loss)

    def read(self, step: int) -> float:
        """The losses not yet read, read from the device at once; the last step's (`step`).
        A non-finite one fails the run, naming its step, before anything is saved."""
        if self.unread:
            stacked = torch.stack([torch.as_tensor(v, dtype=torch.float32) for v in self.unread])
            values: list[float] = stacked.cpu().tolist()
            self.unread.clear()
            for at, value in enumerate(values, step - len(values) + 1):
                if not math.isfinite(value):
                    raise Diverged(self.lr, value, at)
            self.last = values[-1]
            if self.first is None:
                self.first = self.last
        assert self.last is not None, "read before any step"
        return self.last


class Throughput:
    """Tokens per second over the steps since the last reading."""

    def __init__(self) -> None:
        self.tokens = 0
        self.start = time.perf_counter()

    def add(self, tokens: int) -> None:
        """The tokens of one more step."""
        self.tokens += tokens

    def read(self) -> float:
        """Tokens per second since the last reading; the window starts again."""
        rate = self.tokens / (time.perf_counter() - self.start)
        self.tokens, self.start = 0, time.perf_counter()
        return rate


def progress_bar(*, step: int, total_steps: int, shown: bool) -> tqdm[Any]:
    """The progress bar of the steps (runtime.progress_bar, rank 0 only)."""
    return tqdm(total=total_steps, initial=step, disable=not shown, dynamic_ncols=True)
