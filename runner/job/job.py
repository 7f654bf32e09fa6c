"""A training job: the composed config resolved into one recipe in its run directory, launched.

`runner train` (runner.cli.train) calls `train` for one run and `sweep_job` for each job of a
multirun.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import shutil
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, read_write

from runner.components import plain_dict
from runner.config.fields import as_typed, override_key
from runner.config.hydra_errors import as_user_error
from runner.config.interpolations import check_resume
from runner.config.load_checkpoint import check_same_global_batch, global_batch
from runner.config.method import move_recipe
from runner.config.runtime import check_root
from runner.config.schema import read_recipe, write_recipe
from runner.errors import Diverged, UserError, error_line, user_errors_pass_hydra
from runner.job.launch import (
    as_launcher,
    in_process,
    launch,
    node_rank_of,
    stops_before_workers,
)
from runner.job.lifecycle import check_recipe_as_recorded, last_logged, wait_for_orphans
from runner.job.sweep import in_sweep_process, refresh_sweep_of, stopping, write_summary
from runner.paths import pasteable, user_path
from runner.rundir import (
    FINAL_STATES,
    STATES,
    RunDir,
    RunLocked,
    held_here,
    is_run_dir,
    run_lock,
)
from runner.rundir.io import file_size_limit, free_space, no_room_cause, room_on, size_text
from runner.rundir.manifest import (
    MANIFEST_FILE,
    build_manifest,
    changed_data,
    changed_overrides,
    changed_recipe,
    read_manifest,
    unlike_loaded,
    write_manifest,
)
from runner.trainer.parent import stop_signals_to

log = logging.getLogger(__name__)

# The least free space a run starts on: its records (.hydra/, recipe.yaml, manifest.json,
# status.json, train.log) take tens of KiB, and the smallest checkpoint, the tiny default's,
# 12 MiB. On a disk with less, Hydra's first write failed in a traceback and left the
# directory half made.
START_ROOM = 2**20
_MAKE_ROOM = "make room, or give a directory on another disk"


def train(
    cfg: DictConfig, run_dir: Path, overrides: list[str], keep_failed: bool = False
) -> dict[str, Any] | None:
    """Resolves `cfg` into run_dir/recipe.yaml and trains; resume=RUN continues RUN's recipe.

    A new run that fails on bad input before its first step leaves no run directory behind,
    unless `keep_failed` (a sweep's job, which the sweep summary reports as failed); one that
    trained (a stream's bad record, met as it is read), or that W&B or MLflow holds a run for,
    keeps its record, failed. A directory
    that held a run before this call (a requeue, another node of a shared run) is never
    removed. (One stopped before it records its status: RunDirLock.)
    """
    run = RunDir(run_dir)
    new_here = not run.recipe_path.exists() and not run.checkpoints()
    try:
        as_launcher()
        with _trainer_lock(cfg, run):
            return _train(cfg, run, overrides)
    except Exception as err:
        # Bad input, ours or met in an interpolation (a ${runner_*:} of the config).
        user_error = as_user_error(err)
        if user_error is None or isinstance(user_error, (RunLocked, Diverged)):
            raise  # a bug; or the directory is another trainer's, or a run's that trained
        # A tracker's run (W&B's, MLflow's) names the directory: removed, it left that run
        # pointing at nothing (W&B's last line said to sync files that were gone).
        kept = (run.status().step or 0) > 0 or run.checkpoints() or run.has_tracker_runs()
        if new_here and cfg.resume is None and not keep_failed and not kept:
            _discard(run_dir, Path(cfg.runtime.output_root))
        raise


def _discard(run_dir: Path, output_root: Path) -> None:
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


def sweep_job(cfg: DictConfig, run_dir: Path, overrides: list[str]) -> float:
    """One job of a multirun: a failure is recorded in its run directory, the others go on.

    Returns the job's objective (its best cfg.objective.metric, or the last value of `loss`),
    which the Optuna sweeper optimizes; NaN for a failed job.
    """
    run = RunDir(run_dir)
    sweep_dir = Path(HydraConfig.get().sweep.dir)
    if stopping(sweep_dir):
        return math.nan  # a parallel sweep told to stop starts no other job
    try:
        train(cfg, run_dir, overrides, keep_failed=True)
    except Exception as err:  # noqa: BLE001 - recorded in the run directory, reported below
        if run.status().state != "failed":
            run.write_status("failed", error=error_line(err))
        print(f"error: job {run_dir.name} ({' '.join(overrides)}): {err}", file=sys.stderr)
        return math.nan
    except BaseException:  # Ctrl-C or SIGTERM: the job saved and ended cancelled
        write_summary(sweep_dir, cfg.objective.metric, cfg.objective.mode)
        if not in_sweep_process():
            return math.nan  # a parallel worker: the sweep's own process says how it ends
        raise  # the sweep ends with this job, which Hydra's on_job_end will not see
    scored = run.objective_value(cfg.objective.metric)
    return float(scored[0]) if scored else math.nan


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
            path = user_path(given)  # hydra.run.dir='~/...'
            _check_room(config, path)
            if _fresh_by_time(config, path):
                path = _unclaimed(path, config)
            if str(path) != given:
                with read_write(config.hydra):  # where Hydra's run_job writes, from here on
                    config.hydra.run.dir = str(path)
            run = RunDir(path)
            try:
                self._lock.enter_context(_trainer_lock(config, run))
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
    (launch.stops_before_workers, process.stop_signals); past them, these do as the ones before.
    No exception is raised in the window: one raised inside an import leaves that module half
    made (tried: a SystemExit raised in torch's import failed a later import of numpy)."""

    def on_signal(signum: int, frame: Any) -> None:
        if is_run_dir(run.path):
            signal.signal(signum, previous[signal.Signals(signum)])
            signal.raise_signal(signum)
            return
        _discard(run.path, output_root)
        name = signal.Signals(signum).name
        print("interrupted" if signum == signal.SIGINT else f"stopped by {name}", file=sys.stderr)
        sys.stderr.flush()
        os._exit(128 + signum)

    with stop_signals_to(on_signal) as previous:
        yield


def _run_dir_given(config: DictConfig) -> bool:
    """Whether the user named the run directory (hydra.run.dir=...), not its time."""
    return any(override_key(o) == "hydra.run.dir" for o in as_typed(config.hydra.overrides.hydra))


def _fresh_by_time(config: DictConfig, path: Path) -> bool:
    """Whether `path` is the one-node run directory named by the time the run started
    (runtime.output_root/<date>/<time>), not one given, resumed or named by a platform's job."""
    if _run_dir_given(config) or config.resume is not None or str(config.compute.nnodes) != "1":
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


def _run_dir_key(config: DictConfig, path: Path) -> tuple[str, str]:
    """The key that placed the run directory `path`, and its value, as the user gave it."""
    if config.resume is not None:
        return "resume", str(config.resume)
    if _run_dir_given(config):
        return "hydra.run.dir", str(path)
    return "runtime.output_root", str(config.runtime.output_root)


def _unwritable(config: DictConfig, path: Path, err: OSError) -> UserError:
    """A run directory that cannot be made or written, under the key that placed it."""
    key, value = _run_dir_key(config, path)
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


def _check_room(config: DictConfig, path: Path) -> None:
    """A run starts on a disk with START_ROOM free at least, before anything is written."""
    free = free_space(path)
    if free < START_ROOM:
        raise UserError(
            *_run_dir_key(config, path),
            f"the disk of {path} has {size_text(free)} free, less than the "
            f"{size_text(START_ROOM)} a run starts on (its checkpoints take more): {_MAKE_ROOM}",
        )


def _trainer_lock(cfg: DictConfig, run: RunDir) -> contextlib.AbstractContextManager[None]:
    """The run directory's lock (runner.rundir.run_lock) for the time this process trains it;
    the workers it starts hold it too, until they exit.

    Only a single-node run takes it: every node's launcher of a multi-node run trains the same
    shared directory, and the c10d rendezvous, not a rank known here, tells the nodes apart.
    """
    resumed = cfg.resume is not None and run.recipe_path.is_file()
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
    if not (run.path / MANIFEST_FILE).is_file():
        raise UserError(
            "hydra.run.dir",
            str(run.path),
            f"holds a run (checkpoints up to {checkpoint.name}) whose {MANIFEST_FILE}, the "
            "record of the overrides that started it, is missing, so these cannot be checked "
            f"against them; go on with it by its recorded recipe (runner resume {run.path}), "
            "or give another hydra.run.dir",
        )
    changes = changed_overrides(read_manifest(run)["overrides"], overrides)
    if changes:
        raise UserError(
            "hydra.run.dir",
            str(run.path),
            f"holds a run that other overrides started: {', '.join(changes)}; go on with it by "
            f"its own (runner resume {run.path}), on another layout if need be (compute, "
            "batch_size and gradient_accumulation_steps may change), or give another hydra.run.dir",
        )


def _check_same_recipe(run: RunDir, recorded: DictConfig, recipe: DictConfig) -> None:
    """A run trained again by its own command goes on with the recipe it recorded: a config
    file that command composes, edited since (a new lr, another model shape), changes it as
    another override would, though the overrides are the same (_check_same_command). Refused
    before its record is rewritten: its checkpoint's optimizer state would train on with the
    old lr under a record of the new, and weights of one shape load into no model of another."""
    changes = changed_recipe(plain_dict(recorded), plain_dict(recipe))
    if changes:
        shown = ", ".join(changes[:6]) + (f" and {len(changes) - 6} more" if changes[6:] else "")
        raise UserError(
            "hydra.run.dir",
            str(run.path),
            f"holds a run whose recipe these configs change (a config file edited since it "
            f"started?): {shown}; go on with it by its recorded recipe (runner resume "
            f"{run.path}), put the configs back, or give another hydra.run.dir",
        )


def _warn_changed_data(run: RunDir, now: dict[str, Any] | None = None) -> None:
    """Said as a run goes on from its checkpoint: its data changed since it was recorded
    (`now`: the data as the run's new manifest records it)."""
    for changed in changed_data(run, now):
        log.warning(
            "%s changed since the run started: the steps from here read other records than "
            "its uninterrupted run would",
            changed,
        )


def _train(cfg: DictConfig, run: RunDir, overrides: list[str]) -> dict[str, Any] | None:
    if cfg.resume is not None:
        check_resume(cfg.resume, overrides)
        if _finished(run):
            return None
        recipe = read_recipe(run.recipe_path)
        check_recipe_as_recorded(run)
        _warn_changed_data(run)
        if Path(recipe.run_dir).resolve() != run.path.resolve():
            # Moved or copied since it started: it goes on where it lies, and says so from now.
            log.info("%s was moved from %s: it trains where it lies", run.path, recipe.run_dir)
            move_recipe(recipe, run.path)
            write_recipe(run.recipe_path, recipe)
    else:
        # torch, transformers and datasets load here, not at import: `runner train --help` and
        # `--cfg job` (Hydra prints and exits before calling main) stay fast.
        from runner.config.resolve import resolve_recipe

        recipe = resolve_recipe(cfg, run.path, overrides)
        continued = run.latest_checkpoint() is not None
        if continued:
            # Trained again (a requeue, another layout): it goes on from its checkpoint.
            try:
                recorded = read_recipe(run.recipe_path)
            except UserError:
                recorded = None  # another runner's record: its checkpoint's checks speak
            if recorded is not None:
                check_same_global_batch(str(run.path), recorded, recipe, recipe.compute)
                _check_same_recipe(run, recorded, recipe)
                recipe.resume_from = recorded.resume_from  # where it started, as it recorded
            if _finished(run):
                return None  # its record stays the one it was trained by
        _check_data(recipe)
        manifest = build_manifest(recipe, overrides, Path.cwd())
        if continued:
            _warn_changed_data(run, manifest["data"])  # before the new manifest replaces it
        elif recipe.resume_from is not None:
            loaded = RunDir(Path(recipe.resume_from).parents[1])  # RUN/checkpoints/step_N
            for unlike in unlike_loaded(loaded, manifest):
                log.warning(
                    "%s: the steps from %s's data position read other records than its "
                    "uninterrupted run would",
                    unlike,
                    loaded.path,
                )
        try:
            write_recipe(run.recipe_path, recipe)
            write_manifest(run, manifest)
        except OSError as err:
            cause = no_room_cause(err)
            if cause is None:
                raise
            # The disk filled after the run's start was checked (_check_room).
            raise UserError(
                "hydra.run.dir" if cfg.resume is None else "resume",
                str(run.path),
                f"the run's records could not be written ({cause}); {room_on(run.path)}: "
                + ("raise the file-size limit (ulimit -f), " if file_size_limit() else "")
                + _MAKE_ROOM,
            ) from err
    node_rank = node_rank_of(cfg.compute, recipe)
    from runner.trainer import process

    process.STOP.clear()  # a parallel sweep's earlier job here, stopped alone
    stops = process.stop_signals() if in_process(recipe) else stops_before_workers(run)
    with stops:
        return _launch(cfg, run, recipe, node_rank)


def _launch(
    cfg: DictConfig, run: RunDir, recipe: DictConfig, node_rank: int | None
) -> dict[str, Any] | None:
    """The run's status names this process, which `runner stop` signals; then it trains."""
    # On several nodes the status is node 0's (then global rank 0's): another node, or one that
    # rejoins a running group, leaves it be.
    if node_rank == 0 or not is_run_dir(run.path):
        # `runner stop` signals this process: the run's launcher, whatever its world size,
        # named in the run's first status (a stop waits for it). A run killed before its first
        # status was written starts as `created`.
        if cfg.resume is None:
            run.write_status(
                "created", step=0, total_steps=recipe.max_steps, launcher_pid=os.getpid()
            )
        else:
            # A resume of a run that ended (cancelled, failed) is under way from here: left as
            # it was, it read as over (Run.status, the job service's poll), and a `runner stop`
            # in its first seconds was refused as "already cancelled" while it went on to train.
            state = run.status().state
            going_on = state if state in STATES and state not in FINAL_STATES else "created"
            run.write_status(going_on, launcher_pid=os.getpid(), error=None)
    try:
        result = launch(recipe, run.recipe_path, node_rank)
    finally:  # stopped again too
        if cfg.resume is not None:
            refresh_sweep_of(run.path)
    _print_summary(run)
    return result


def _finished(run: RunDir) -> bool:
    """Whether the run completed with its final checkpoint there (were it deleted, the run
    would train it again): then it says so, with its summary, and nothing is written."""
    status = run.status()
    if status.state != "completed" or status.step is None:
        return False
    if run.latest_checkpoint() != run.checkpoint_path(status.step):
        return False
    print(f"{run.path} completed at step {status.step}: nothing to train", flush=True)
    _print_summary(run)
    return True


def _check_one_global_batch(recipe: DictConfig, records: int | None) -> None:
    """An epoch is whole global batches: a training split with fewer records than one trains
    nothing, which the trainer would find only after the run had started."""
    global_batch_size, processes = global_batch(recipe, recipe.compute)
    per_batch = recipe.gradient_accumulation_steps * processes
    if records is None or records >= global_batch_size:
        return
    largest = records // per_batch
    if largest:
        fix = f"give batch_size={largest} or less"
    elif recipe.gradient_accumulation_steps > 1:
        fix = "lower gradient_accumulation_steps"
    else:  # one sample a process is more than the split holds
        fix = "train on fewer processes (compute.nproc_per_node, compute.nnodes)"
    raise UserError(
        "batch_size",
        recipe.batch_size,
        f"the training split has {records} records, fewer than one global batch of "
        f"{global_batch_size} (batch_size x gradient_accumulation_steps="
        f"{recipe.gradient_accumulation_steps} x {processes} process(es)); {fix}, or add records",
    )


def _check_data(recipe: DictConfig) -> None:
    """Reads and checks every record of every split before anything starts."""
    from runner.components import instantiate
    from runner.data import check_datasets

    started = time.perf_counter()
    evaluates = recipe.eval.strategy != "no"
    found = check_datasets(recipe.dataset, instantiate(recipe.model.tokenizer), evaluates=evaluates)
    records = ", ".join(f"{n} {split}" for split, n in found.items()) or "no"
    log.info("data: %s records checked in %.1f s", records, time.perf_counter() - started)
    _check_one_global_batch(recipe, found.get("train"))
    if recipe.dataset.streaming:
        log.warning(
            "dataset.streaming: the training split is checked window by window as it is read "
            "(%d records of each reader at a time); a bad record stops the run there",
            recipe.dataset.shuffle_buffer,
        )


def _print_summary(run: RunDir) -> None:
    """The run's outcome, read from its directory (whichever processes trained it)."""
    status = run.status()
    checkpoint = run.latest_checkpoint()
    lines = [f"run directory: {run.path}", f"checkpoint:    {checkpoint}"]
    if status.first_loss is not None and status.loss is not None:
        lines.insert(0, f"train loss:    {status.first_loss:.4f} -> {status.loss:.4f}")
    evaluation = status.eval or {}
    if "eval_exact_match" in evaluation:
        lines.insert(1, f"held-out exact match: {evaluation['eval_exact_match']:.1%}")
    _, rewards = last_logged(run)  # a preference run's; empty for a supervised one
    for split, label in (("eval", "held-out"), ("train", "train")):
        if f"{split}_accuracy" in rewards:
            lines.insert(
                1,
                f"{label} reward accuracy: {rewards[f'{split}_accuracy']:.1%}, "
                f"reward margin: {rewards[f'{split}_margin']:.4f}",
            )
    if "eval_loss" in evaluation:
        lines.insert(1, f"eval loss:     {evaluation['eval_loss']:.4f}")
    best = status.best
    if best is not None:
        # Found among the run's own checkpoints: the path recorded is where the run was
        # trained, which a copied run's is not.
        kept = run.best_checkpoint() or "its checkpoint is not kept"
        lines.append(
            f"best:          {best['metric']}={best['value']:.4g} at step {best['step']}, {kept}"
        )
    if (run.profile_dir / "trace.json").is_file():
        lines.append(f"profile:       {run.profile_dir} (trace.json opens in ui.perfetto.dev)")
    lines.append(f"status:        {status.state} at step {status.step}")
    # Pasteable as it prints: a path with a space is one word to the shell only quoted.
    lines.append(f"try next:      runner deploy {pasteable('checkpoint', str(checkpoint))}")
    print("\n".join(lines), flush=True)
