"""The training side of a checkpoint: full (unsharded) states gathered from the ranks, each
rank's random state, and the write-then-rename commit that rank 0 makes into the run directory
(runner.models.checkpoint writes the files, runner.rundir names and prunes them)."""

from __future__ import annotations

import logging
import random
import shlex
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors import SafetensorError
from torch.distributed.checkpoint.state_dict import StateDictOptions

from runner.rundir import RunDir
from runner.rundir.io import free_space, not_written, size_text, tree_size
from runner.rundir.manifest import record_checkpoint
from runner.rundir.run import sync_tree
from runner.trainer.parallel import Placement

log = logging.getLogger("runner.recipe")

# Whole tensors on the CPU of every rank: a checkpoint holds the unsharded state.
FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


def rng_per_rank(place: Placement) -> list[dict[str, Any]]:
    """Every rank's torch and Python random states, its GPU's too (dropout draws there), every
    rank joining."""
    rng = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if place.device.type == "cuda":
        rng["cuda"] = torch.cuda.get_rng_state(place.device)
    if place.world_size == 1:
        return [rng]
    gathered: list[dict[str, Any] | None] = [None] * place.world_size
    dist.all_gather_object(gathered, rng)
    return [state for state in gathered if state is not None]


def restore_rng(state: dict[str, Any], place: Placement) -> None:
    """This rank's random state as it was saved; a checkpoint of another world size starts
    every rank from where the seed put it."""
    if state["world_size"] == place.world_size:
        rng = state["rng_per_rank"][place.rank]
        torch.set_rng_state(rng["torch"])
        random.setstate(rng["python"])
        if place.device.type == "cuda" and "cuda" in rng:  # saved on a GPU
            torch.cuda.set_rng_state(rng["cuda"], place.device)


def commit(
    run: RunDir,
    step: int,
    write: Callable[[Path], None],
    *,
    keep_last_n: int,
    keep_step: int | None,
    evaluates: bool,
    saved: Callable[[], None],
) -> None:
    """Writes step `step`'s checkpoint under a temporary name (`write(dir)`), renames it into
    place, calls `saved()`, records its hashes and prunes to the last `keep_last_n` (and
    `keep_step`). `evaluates`: whether the run evaluates, so that a best may yet be kept.

    `saved` records the run's best in status.json while both the old best's checkpoint and the
    new one are there: a run killed at any moment has its recorded best on disk.
    """
    tmp = run.fresh_checkpoint_tmp(step)
    try:
        write(tmp)
        sync_tree(tmp)  # a full disk or a quota may be reported only here
    except (OSError, RuntimeError, SafetensorError) as err:
        # A disk that is full or read-only, or a file-size limit: torch.save says only
        # "[enforce fail at inline_container.cc] unexpected pos", after a traceback of 60 lines.
        # Another RuntimeError is a bug, whose traceback is the report.
        if isinstance(err, RuntimeError) and "inline_container" not in str(err):
            raise
        shutil.rmtree(tmp, ignore_errors=True)  # the part written, which holds the room taken
        needs = _room_taken(run, keep_last_n, keep_step)
        raise not_written(run.path, f"the checkpoint of step {step}", err, needs) from err
    final = run.commit_checkpoint(tmp, step)
    saved()
    record_checkpoint(run, step, final)
    run.prune_checkpoints(keep_last_n, keep_step=keep_step)
    warn_if_room_short(
        run,
        size=tree_size(final),
        keep_last_n=keep_last_n,
        keep_step=keep_step,
        evaluates=evaluates,
    )


def warn_if_room_short(
    run: RunDir,
    *,
    size: int,
    keep_last_n: int,
    keep_step: int | None,
    evaluates: bool,
    saves_left: int | None = None,
    takes: str = "takes",
) -> None:
    """Warns where the checkpoints still to come, `size` bytes each, will not fit the run's
    disk (room_short), hours before the save that would fail: told at each save by the one
    written, and before the first step by the one expected (expected_size)."""
    short = room_short(
        free=free_space(run.path),
        size=size,
        held_now=len(run.checkpoints()),
        held_at_most=_held_at_most(run, keep_last_n, keep_step, evaluates=evaluates),
        saves_left=saves_left,
        takes=takes,
    )
    if short:
        log.warning(
            "%s: %s; make room now, or keep fewer (runtime.keep_last_n_checkpoints=%d)",
            run.path,
            short,
            keep_last_n,
        )


def warn_before_training(
    run: RunDir,
    model: torch.nn.Module,
    *,
    moments: int,
    whole_model: bool,
    keep_last_n: int,
    keep_step: int | None,
    evaluates: bool,
    saves_left: int,
) -> None:
    """Before the first step: a warning where the `saves_left` checkpoints to come will not fit
    the run's disk, by the size of its latest (a run that goes on) or else of the one expected:
    a disk too small for even one was found at the first save, hours in."""
    latest = run.latest_checkpoint()
    if latest is not None:
        size, takes = tree_size(latest), "takes"
    else:
        size, takes = expected_size(model, moments, whole_model=whole_model), "will take about"
    warn_if_room_short(
        run,
        size=size,
        keep_last_n=keep_last_n,
        keep_step=keep_step,
        evaluates=evaluates,
        saves_left=saves_left,
        takes=takes,
    )


def expected_size(model: torch.nn.Module, moments: int, *, whole_model: bool) -> int:
    """The bytes of a checkpoint before one is written: the weights it holds in fp32, as they
    are written whatever the run computes in (every weight where it holds the `whole_model`; a
    LoRA run's adapters alone, else), and `moments` tensors of the optimizer's state for each
    trained weight, in its dtype (AdamW: 2). The config and tokenizer files, a few MiB at most,
    are left out. (Priced by the weights in their dtype, a LoRA run's checkpoint of adapters
    read as its whole base, 20x too large, and a bf16 run's as 3/4 of what it writes.)"""
    written = sum(p.numel() for p in model.parameters() if whole_model or p.requires_grad)
    trained = sum(p.numel() * p.dtype.itemsize for p in model.parameters() if p.requires_grad)
    return written * torch.float32.itemsize + moments * trained


def room_short(
    *,
    free: int,
    size: int,
    held_now: int,
    held_at_most: int,
    saves_left: int | None = None,
    takes: str = "takes",
) -> str | None:
    """What the disk lacks for the checkpoints still to come, each of `size` bytes: the run
    holds `held_now` and at most `held_at_most` at once (while one is written, before the
    oldest is pruned), so the next saves need `size` each until it holds that many, or until
    its `saves_left` (where known) are made; None where they fit."""
    to_come = max(held_at_most - held_now, 1)
    if saves_left is not None:
        to_come = min(to_come, saves_left)
    if to_come <= 0 or free >= size * to_come:
        return None
    fit = free // size
    return (
        f"its disk has {size_text(free)} free and a checkpoint {takes} {size_text(size)}; the "
        f"run holds up to {held_at_most} at once ({held_now} now), so "
        + (
            "the next checkpoint will not fit"
            if fit == 0
            else f"the next {to_come} need {size_text(size * to_come)} and {fit} of them fit"
        )
    )


def _room_taken(run: RunDir, keep_last_n: int, keep_step: int | None) -> str:
    """What the run's checkpoints take of its disk, by the newest one written (none: nothing
    to say): it holds keep_last_n of them, the best besides, and the one being written, as
    pruning follows the write."""
    saved = run.checkpoints()
    if not saved:
        return ""
    size = tree_size(saved[-1][1])
    held = _held_at_most(run, keep_last_n, keep_step, evaluates=False)  # as it is written now
    taken = (
        f"a checkpoint takes {size_text(size)}, and with runtime.keep_last_n_checkpoints="
        f"{keep_last_n} the disk holds {held} at once while one is written"
    )
    # The run goes on from its latest and keeps its best; a resume takes no other
    # keep_last_n_checkpoints (its recipe is the one it started with), so these are its room.
    spare = [path for step, path in saved[:-1] if step != keep_step]
    if not spare:
        return taken
    freed = size_text(sum(tree_size(path) for path in spare))
    return (
        f"{taken}; the run goes on from its latest checkpoint alone, and "
        f"`{shlex.join(['rm', '-r', *map(str, spare)])}` frees {freed}"
    )


def _held_at_most(run: RunDir, keep_last_n: int, keep_step: int | None, *, evaluates: bool) -> int:
    """The checkpoints the run's disk holds at once while one is written: the last
    `keep_last_n`, the best besides where it is older than they are, and the one being written
    (which may be the best: counted once). A run that `evaluates` may yet make a best that
    falls behind the last `keep_last_n` and is kept besides them (keep_last_n=1, a save every 2
    steps, an evaluation every 3: steps 3 and 4 are held while step 6 is written)."""
    kept = [saved_step for saved_step, _ in run.checkpoints()][-keep_last_n:]
    older_best = keep_step is not None and keep_step not in kept and keep_step < max(kept or [0])
    return keep_last_n + 1 + (older_best or evaluates)


def barrier(place: Placement) -> None:
    """Every rank waits here for the others (none to wait for in one process)."""
    if place.world_size > 1:
        dist.barrier()
