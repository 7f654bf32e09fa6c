"""What a training process tells the world as it goes: status.json, metrics.jsonl, the log line,
the trackers and the console; and the losses it reads back from the device to do so.

Only rank 0 writes; the other ranks get the same objects, which do nothing there.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import os
import sys
import time
from collections.abc import Iterator, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any, TextIO

import torch
from omegaconf import DictConfig
from tqdm import tqdm

from runner.components import plain_dict
from runner.errors import Diverged
from runner.rundir import STATUS_FILE, RunDir
from runner.rundir.io import not_written
from runner.rundir.run import METRICS_FILE
from runner.trainer import trackers

log = logging.getLogger("runner.recipe")


class Reporter:
    """status.json, metrics.jsonl, the log and the trackers of one run (rank 0 only)."""

    def __init__(self, run: RunDir, *, is_rank_zero: bool) -> None:
        self.run = run
        self.is_rank_zero = is_rank_zero
        self.trackers: trackers.Trackers | None = None
        self.console: Console | None = None

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
            with self._writing(STATUS_FILE):
                self.run.write_status(state, **fields)

    @contextlib.contextmanager
    def _writing(self, name: str) -> Iterator[None]:
        """A write of the run directory's file `name` that its disk refuses (full, read-only)
        ends the run in one line, as a checkpoint's does, not in a traceback."""
        try:
            yield
        except OSError as err:
            raise not_written(self.run.path, f"its {name}", err) from err

    def start_console(
        self, *, step: int, total_steps: int, progress_bar: bool | str, breaks_every: Sequence[int]
    ) -> None:
        """The console of the steps from `step` on (runtime.progress_bar: true, false or auto);
        the loop breaks for an evaluation or a save every `breaks_every` steps, and after the
        last."""
        if self.is_rank_zero:
            shown = shows_bar(progress_bar, sys.stderr)
            self.console = Console(
                step=step, total_steps=total_steps, bar=shown, breaks_every=breaks_every
            )

    def advance(self) -> None:
        """One more step taken (the bar moves)."""
        if self.console is not None:
            self.console.advance()

    def paused(self) -> contextlib.AbstractContextManager[None]:
        """The block's time is left out of the ETA's mean step (Console.paused)."""
        return contextlib.nullcontext() if self.console is None else self.console.paused()

    def step(self, step: int, total_steps: int, values: dict[str, float]) -> None:
        """A logged training step: `values` (loss, tokens_per_s, ...) and the learning rate lr."""
        if not self.is_rank_zero:
            return
        record = {"step": step, **values}
        with self._writing(METRICS_FILE):
            self.run.append_metrics(record)
        line = (
            f"step {step}/{total_steps} loss {values['loss']:.4f} lr {values['lr']:.3g} "
            f"tokens/s {values['tokens_per_s']:.0f}"
        )
        if self.console is not None:
            line += f" eta {self.console.eta(step)}"
            self.console.logged(line, values)
        log.info(line)
        if self.trackers is not None:
            self.trackers.metrics("train", values, step)
        self.status("running", step=step, total_steps=total_steps, loss=values["loss"])

    def evaluation(self, step: int, total_steps: int, metrics: dict[str, float]) -> None:
        """An evaluation's metrics, at the step it followed."""
        if not self.is_rank_zero:
            return
        with self._writing(METRICS_FILE):
            self.run.append_metrics({"step": step, **metrics})
        line = f"eval at step {step}: " + " ".join(
            f"{name} {value:.4f}" for name, value in metrics.items()
        )
        if self.console is not None:
            self.console.logged(line, {})
        log.info(line)
        if self.trackers is not None:
            self.trackers.metrics("eval", metrics, step)
        self.status("running", step=step, total_steps=total_steps, eval={"step": step, **metrics})

    def close(self, best: dict[str, Any] | None) -> None:
        """Ends the console; tells the trackers the best checkpoint (when saved) and how the run
        ended."""
        if self.console is not None:
            self.console.close()
            self.console = None
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


@contextlib.contextmanager
def _add_time(owner: Any, *names: str) -> Iterator[None]:
    """The block's seconds added to each of `owner`'s attributes `names`: to a perf_counter
    reading that a rate or a mean is timed from, it leaves the block out of it; to a sum, it
    counts the block."""
    began = time.perf_counter()
    try:
        yield
    finally:
        spent = time.perf_counter() - began
        for name in names:
            setattr(owner, name, getattr(owner, name) + spent)


# The positions a step computed: a count on the host, or where several ranks summed theirs, on
# the device, unread.
Tokens = int | torch.Tensor


class Throughput:
    """Tokens per second over the steps since the last reading: the positions the model
    computed on every rank (padding included: the work done, which MFU counts too)."""

    def __init__(self) -> None:
        self.tokens: Tokens = 0
        self.start = time.perf_counter()

    def add(self, tokens: Tokens) -> None:
        """The tokens of one more step (a count on the device is read at the next reading)."""
        self.tokens += tokens

    def paused(self) -> contextlib.AbstractContextManager[None]:
        """The block's time (an evaluation, a checkpoint's save) is left out of the rate: the
        step logged after one read 10-100x below the others."""
        return _add_time(self, "start")

    def read(self) -> float:
        """Tokens per second since the last reading; the window starts again."""
        rate = float(self.tokens) / (time.perf_counter() - self.start)
        self.tokens, self.start = 0, time.perf_counter()
        return rate


def breaks_after(step: int, total_steps: int, every: Sequence[int]) -> int:
    """The steps after `step`, to `total_steps`, at which training breaks for an evaluation or a
    save: each multiple of one of `every` (eval.steps, an epoch's steps, save_every_n_steps),
    and the last step."""
    periods = sorted({n for n in every if n > 0})
    count = 0
    for size in range(1, len(periods) + 1):  # inclusion-exclusion over the periods
        for chosen in itertools.combinations(periods, size):
            common = math.lcm(*chosen)
            count += (-1) ** (size + 1) * (total_steps // common - step // common)
    last_counted = any(total_steps % n == 0 for n in periods)
    return count + (step < total_steps and not last_counted)


def shows_bar(progress_bar: bool | str, stream: TextIO) -> bool:
    """Whether the console gets a progress bar: runtime.progress_bar true or false, or auto (the
    convention): a bar only when `stream`, where it is drawn, is a terminal; a log file, a pipe,
    nohup or a batch job's output gets plain lines instead of carriage returns."""
    if progress_bar == "auto":
        # A terminal nobody sized (0 columns: `script`, some CI ptys) draws tqdm's bar as
        # nothing at all, and no step line came either.
        return stream.isatty() and _columns(stream) != 0
    return bool(progress_bar)


def _columns(stream: TextIO) -> int | None:
    """The width of the terminal `stream` writes to; None where it cannot say."""
    try:
        return os.get_terminal_size(stream.fileno()).columns
    except (OSError, ValueError):
        return None


class Console:
    """What rank 0 shows on stderr as the steps go: tqdm's bar, its postfix the last logged
    loss and throughput, each evaluation's line above it; or, with no bar, each logged step's
    and evaluation's line (train.log's) as it comes."""

    def __init__(
        self, *, step: int, total_steps: int, bar: bool, breaks_every: Sequence[int] = ()
    ) -> None:
        self.total_steps, self.breaks_every = total_steps, tuple(breaks_every)
        self.bar = tqdm(total=total_steps, initial=step, dynamic_ncols=True) if bar else None
        # The ETA is the mean time of the steps taken since the console started, and of the
        # breaks (evaluations, saves) taken: the final evaluation and save took 20-40 s more
        # after an "eta 0:00:00".
        self.first_step, self.started = step, time.perf_counter()
        self.break_s = 0.0

    def advance(self) -> None:
        """One more step taken."""
        if self.bar is not None:
            self.bar.update(1)

    def paused(self) -> contextlib.AbstractContextManager[None]:
        """The block's time (an evaluation, a save) is left out of the steps' mean time, and
        counted as the breaks'."""
        return _add_time(self, "started", "break_s")

    def eta(self, step: int) -> str:
        """The time left to total_steps at the pace so far, with the breaks still to come after
        `step` (its own, which follows its log line, too) at the breaks' mean so far (H:MM:SS).
        Before any break is timed, the steps' time alone, marked "+": at least that long."""
        taken = step - self.first_step
        if taken <= 0:
            return "?"
        left = (time.perf_counter() - self.started) / taken * (self.total_steps - step)
        to_come = breaks_after(step - 1, self.total_steps, self.breaks_every)
        breaks_taken = breaks_after(self.first_step, self.total_steps, self.breaks_every) - to_come
        if breaks_taken > 0:
            left += self.break_s / breaks_taken * to_come
        # A step's time prices no evaluation or save (a 7B model's save takes minutes), and
        # "0:00:00" at the last step hid the final evaluation and save still to come.
        untimed = to_come > 0 and breaks_taken == 0
        return str(timedelta(seconds=round(left))) + ("+" if untimed else "")

    def logged(self, line: str, values: dict[str, float]) -> None:
        """A logged step or evaluation: its line (no bar); with the bar, a step's loss and
        throughput (`values`) in its postfix, an evaluation's line above it."""
        if self.bar is None:
            print(line, file=sys.stderr, flush=True)
        elif "loss" in values:
            self.bar.set_postfix(
                loss=f"{values['loss']:.4f}", tok_s=f"{values['tokens_per_s']:,.0f}"
            )
        else:
            self.bar.write(line, file=sys.stderr)

    def close(self) -> None:
        """The bar's last state stays on the terminal."""
        if self.bar is not None:
            self.bar.close()
