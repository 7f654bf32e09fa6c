"""The run directory as `runner train` starts: placed, claimed, checked and locked before Hydra
writes into it (RunDirLock, the callback conf/train.yaml names), and removed again where a new
run ends before it holds a run.

runner.job.job trains in it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, read_write

from runner.config.fields import as_typed, override_key
from runner.config.runtime import check_root
from runner.config.schema import read_recipe
from runner.errors import UserError, user_errors_pass_hydra
from runner.job.lifecycle import check_recipe_whole, wait_for_orphans
from runner.paths import pasteable, refuse_empty_path, shell_path, user_path
from runner.rundir import RunDir, held_here, is_run_dir, run_around, run_lock
from runner.rundir.io import free_space, size_text
from runner.rundir.manifest import MANIFEST_FILE, changed_overrides, read_manifest
from runner.trainer.parent import stop_signals_to

# The least free space a run starts on: its records (.hydra/, recipe.yaml, manifest.json,
# status.json, train.log) take tens of KiB, and the smallest checkpoint, the tiny default's,
# 12 MiB. On a disk with less, Hydra's first write failed in a traceback and left the
# directory half made.
START_ROOM = 2**20
MAKE_ROOM = "make room, or give a directory on another disk"


class RunDirLock(Callback):
    """Hydra callback of `runner train` (not of -m): takes the run directory's lock before Hydra
    writes into it (.hydra/, train.log), so that a hydra.run.dir or resume= naming a run that
    another process trains is refused with that run untouched, as is a hydra.run.dir naming a
    run that other overrides started. The job then finds the lock held. A new run stopped before
    it records its status leaves no directory (_stopped_leaves_nothing)."""

    def __init__(self) -> None:
        self._lock = contextlib.ExitStack()

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        # Hydra turns an Exception of a callback into a warning; a UserErrorExit ends the run.
        with user_errors_pass_hydra():
            check_root(config.runtime.output_root, "runtime.output_root")  # before any mkdir
            given = str(config.hydra.run.dir)  # as Hydra resolves it: ${now:} is cached
            refuse_empty_path(
                "hydra.run.dir",
                given,
                "give the run's directory, or leave hydra.run.dir out "
                f"for {config.runtime.output_root}/<date>/<time>",
            )
            path = user_path(given)  # hydra.run.dir='~/...'
            if config.resume is None:
                _check_outside_runs(config, path)
            _check_room(config, path)
            if _fresh_by_time(config, path):
                path = _unclaimed(path, config)
            if str(path) != given:
                with read_write(config.hydra):  # where Hydra's run_job writes, from here on
                    config.hydra.run.dir = str(path)
            run = RunDir(path)
            try:
                self._lock.enter_context(trainer_lock(config, run))
            except OSError as err:  # a read-only file system, a file on the path
                raise _unwritable(config, run.path, err) from None
            if config.resume is None and not run.recipe_path.exists() and not run.checkpoints():
                output_root = Path(str(config.runtime.output_root))
                self._lock.enter_context(_stopped_leaves_nothing(run, output_root))
            if config.resume is None:
                _check_same_command(run, as_typed(config.hydra.overrides.task))
                if run.latest_checkpoint() is not None:
                    # Trained again in its directory (a requeue): as a resumed run does (its
                    # resolver's), it keeps the .hydra/ record of the composition that started
                    # it, which a config file edited since (refused by _check_same_recipe)
                    # overwrote.
                    with read_write(config.hydra):
                        config.hydra.output_subdir = None

    def on_run_end(self, config: DictConfig, **kwargs: Any) -> None:
        self._lock.close()


@contextlib.contextmanager
def _stopped_leaves_nothing(run: RunDir, output_root: Path) -> Iterator[None]:
    """Ctrl-C or SIGTERM in the seconds before a new run records its status (importing torch,
    resolving the recipe, checking the data) removes its directory, which holds no run yet
    (.hydra/, .lock, train.log: no command would list, resume or clean it), and ends the process
    at once, 128 + the signal. From its first status the run's own handlers take the signals
    (stops.stops_before_workers, process.stop_signals); past them, these do as the ones before.
    No exception is raised in the window: one raised inside an import leaves that module half
    made (tried: a SystemExit raised in torch's import failed a later import of numpy)."""

    def on_signal(signum: int, frame: Any) -> None:
        if is_run_dir(run.path):
            signal.signal(signum, previous[signal.Signals(signum)])
            signal.raise_signal(signum)
            return
        discard(run.path, output_root)
        name = signal.Signals(signum).name
        print("interrupted" if signum == signal.SIGINT else f"stopped by {name}", file=sys.stderr)
        sys.stderr.flush()
        os._exit(128 + signum)

    with stop_signals_to(on_signal) as previous:
        yield


def _run_dir_given(hydra: DictConfig) -> bool:
    """Whether the user named the run directory (hydra.run.dir=...), not its time."""
    return any(override_key(o) == "hydra.run.dir" for o in as_typed(hydra.overrides.hydra))


def _fresh_by_time(config: DictConfig, path: Path) -> bool:
    """Whether `path` is the one-node run directory named by the time the run started
    (runtime.output_root/<date>/<time>), not one given, resumed or named by a platform's job."""
    if (
        _run_dir_given(config.hydra)
        or config.resume is not None
        or str(config.compute.nnodes) != "1"
    ):
        return False
    return path.parent.parent == user_path(config.runtime.output_root)


def _unclaimed(path: Path, config: DictConfig) -> Path:
    """`path`, or `path`-1, -2, ...: the first that no other run started in the same second
    has claimed (mkdir claims it, atomically). Two `runner train` started together took one
    directory, and the second was refused for a hydra.run.dir it never gave."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        for n in range(1000):
            candidate = path.with_name(f"{path.name}-{n}") if n else path
            with contextlib.suppress(FileExistsError):
                candidate.mkdir()
                return candidate
    except OSError as err:
        raise _unwritable(config, path, err) from None
    raise UserError("hydra.run.dir", str(path), "1000 runs started in this second; give one")


def run_dir_key(config: DictConfig, hydra: DictConfig, path: Path) -> tuple[str, str]:
    """The key that placed the run directory `path`, and its value, as the user gave it
    (`hydra`: the composed config's, or the job's HydraConfig)."""
    if config.resume is not None:
        return "resume", str(config.resume)
    if _run_dir_given(hydra):
        return "hydra.run.dir", str(path)
    return "runtime.output_root", str(config.runtime.output_root)


def _unwritable(config: DictConfig, path: Path, err: OSError) -> UserError:
    """A run directory that cannot be made or written, under the key that placed it."""
    key, value = run_dir_key(config, config.hydra, path)
    if config.resume is not None:
        return UserError(
            key,
            value,
            f"cannot write in the run directory {path} ({err.strerror}): a run goes on where "
            "it lies; copy it where this user can write, and resume the copy",
        )
    return UserError(
        key,
        value,
        f"cannot make the run directory {path} ({err.strerror}); give a directory this user "
        "can write",
    )


def _check_outside_runs(config: DictConfig, path: Path) -> None:
    """A new run is not made inside another run's directory (RUN/sub, RUN/checkpoints/x):
    `runner runs` lists no run inside another, and a clean-up of that run would take it."""
    around = run_around(path)
    if around is not None:
        raise UserError(
            *run_dir_key(config, config.hydra, path),
            f"is inside the run directory {around}, where `runner runs` does not look for "
            "runs; give a directory outside it",
        )


def _check_room(config: DictConfig, path: Path) -> None:
    """A run starts on a disk with START_ROOM free at least, before anything is written."""
    free = free_space(path)
    if free < START_ROOM:
        raise UserError(
            *run_dir_key(config, config.hydra, path),
            f"the disk of {path} has {size_text(free)} free, less than the "
            f"{size_text(START_ROOM)} a run starts on (its checkpoints take more): {MAKE_ROOM}",
        )


def trainer_lock(cfg: DictConfig, run: RunDir) -> contextlib.AbstractContextManager[None]:
    """The run directory's lock (runner.rundir.run_lock) for the time this process trains it;
    the workers it starts hold it too, until they exit.

    Only a single-node run takes it: every node's launcher of a multi-node run trains the same
    shared directory, and the c10d rendezvous, not a rank known here, tells the nodes apart.
    """
    resumed = cfg.resume is not None and run.recipe_path.is_file()
    if resumed:
        check_recipe_whole(run)  # cut short, it read with the keys it lacks at their defaults
    nnodes = read_recipe(run.recipe_path).compute.nnodes if resumed else cfg.compute.nnodes
    if str(nnodes) != "1":
        return contextlib.nullcontext()
    if resumed and not held_here(run.path):
        wait_for_orphans(run)  # typed right after a kill -9 of the launcher: its workers save
    return run_lock(run.path, key="hydra.run.dir" if cfg.resume is None else "resume")


def _check_same_command(run: RunDir, overrides: list[str]) -> None:
    """A directory that holds a run is trained again by the command that started it (a requeue,
    a node started again) or by that command on another layout: it goes on from its last
    checkpoint. Other overrides would change its recipe under the steps it trained. Refused
    before Hydra writes there. A run with no whole checkpoint has nothing to go on from: it
    starts again from its first step, as it would by its own command, on the overrides given
    (nodes that disagreed, or a run that failed before its first save, are started corrected).
    A run whose manifest.json is gone (a partial copy, a clean-up) cannot be compared: refused,
    since its checkpoint's optimizer state would train the values it started with, and its new
    record would say the given ones; runner resume goes on with the recipe.yaml it recorded."""
    checkpoint = run.latest_checkpoint()
    if checkpoint is None:
        return  # killed before it saved anything: nothing trained to keep
    resume = f"runner resume {shell_path(run.path)}"
    if not (run.path / MANIFEST_FILE).is_file():
        raise UserError(
            "hydra.run.dir",
            str(run.path),
            f"holds a run (checkpoints up to {checkpoint.name}) whose {MANIFEST_FILE}, the "
            "record of the overrides that started it, is missing, so these cannot be checked "
            f"against them; go on with it by its recorded recipe ({resume}), or give another "
            "hydra.run.dir",
        )
    changes = changed_overrides(read_manifest(run)["overrides"], overrides)
    if not changes:
        return
    if run.status().state == "completed":  # runner resume refuses it: nothing left to train
        way_on = (
            "it is completed: train on from it in a new run (runner train "
            f"{pasteable('load_checkpoint.path', str(run.path))} hydra.run.dir=NEW ...)"
        )
    else:
        way_on = (
            f"go on with it by its own ({resume}), on another layout if need be (compute, "
            "batch_size and gradient_accumulation_steps may change)"
        )
    raise UserError(
        "hydra.run.dir",
        str(run.path),
        f"holds a run that other overrides started: {', '.join(changes)}; {way_on}, or give "
        "another hydra.run.dir",
    )


def discard(run_dir: Path, output_root: Path) -> None:
    """A new run directory that holds no run, with its day's folder where it was alone in it."""
    shutil.rmtree(run_dir, ignore_errors=True)
    _remove_empty_day(run_dir, output_root)


def _remove_empty_day(run_dir: Path, output_root: Path) -> None:
    """The day's folder of the default layout (output_root/<date>/<time>) that the removed
    run was the only one in, and output_root if nothing else is in it (a first command with a
    typo leaves nothing behind): made with the run, they go with it."""
    day = run_dir.absolute().parent
    if day.parent == output_root.absolute():
        with contextlib.suppress(OSError):  # not empty: other runs, other days
            day.rmdir()
            day.parent.rmdir()
