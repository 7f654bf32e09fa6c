"""The training side of a checkpoint: full (unsharded) states gathered from the ranks, each
rank's random state, and the write-then-rename commit that rank 0 makes into the run directory
(runner.models.checkpoint writes the files, runner.rundir names and prunes them)."""

from __future__ import annotations

import logging
import random
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
    saved: Callable[[], None],
) -> None:
    """Writes step `step`'s checkpoint under a temporary name (`write(dir)`), renames it into
    place, calls `saved()`, records its hashes and prunes to the last `keep_last_n` (and
    `keep_step`).

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
    short = room_short(
        free=free_space(run.path),
        size=tree_size(final),
        held_now=len(run.checkpoints()),
        held_at_most=_held_at_most(run, keep_last_n, keep_step),
    )
    if short:
        log.warning(
            "%s: %s; make room now, or keep fewer (runtime.keep_last_n_checkpoints=%d)",
            run.path,
            short,
            keep_last_n,
        )


def room_short(*, free: int, size: int, held_now: int, held_at_most: int) -> str | None:
    """What the disk lacks for the checkpoints still to come, each of `size` bytes: the run
    holds `held_now` and at most `held_at_most` at once (while one is written, before the
    oldest is pruned), so the next saves need `size` each until it holds that many; None
    where they fit. Told at a save, hours before the save that would fail."""
    to_come = max(held_at_most - held_now, 1)
    if free >= size * to_come:
        return None
    fit = free // size
    return (
        f"its disk has {size_text(free)} free and a checkpoint takes {size_text(size)}; the "
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
    held = _held_at_most(run, keep_last_n, keep_step)
    return (
        f"a checkpoint takes {size_text(size)}, and with runtime.keep_last_n_checkpoints="
        f"{keep_last_n} the disk holds {held} at once while one is written"
    )


def _held_at_most(run: RunDir, keep_last_n: int, keep_step: int | None) -> int:
    """The checkpoints the run's disk holds at once while one is written: the last
    `keep_last_n`, the best besides where it is older, and the one being written."""
    kept = [saved_step for saved_step, _ in run.checkpoints()][-keep_last_n:]
    return keep_last_n + 1 + (keep_step is not None and keep_step not in kept)


def barrier(place: Placement) -> None:
    """Every rank waits here for the others (none to wait for in one process)."""
    if place.world_size > 1:
        dist.barrier()
