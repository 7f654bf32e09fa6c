"""A training job: the composed config resolved into one recipe in its run directory, launched.

`runner train` (runner.cli.train) calls `train` for one run and `sweep_job` for each job of a
multirun.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from runner.components import plain_dict
from runner.config.dataset import check_data_found
from runner.config.hydra_errors import as_user_error
from runner.config.interpolations import check_resume
from runner.config.load_checkpoint import check_one_global_batch, check_same_global_batch
from runner.config.method import move_recipe
from runner.config.runtime import check_shell_threads
from runner.config.schema import read_recipe, write_recipe
from runner.errors import Diverged, UserError, error_line
from runner.job.launch import as_launcher, environment, in_process, launch, node_rank_of
from runner.job.lifecycle import check_recipe_as_recorded, last_logged
from runner.job.start import MAKE_ROOM, discard, run_dir_key, trainer_lock
from runner.job.stops import stops_before_workers
from runner.job.sweep import in_sweep_process, refresh_sweep_of, stopping, write_summary
from runner.job.sweep_start import sweep_dir_key
from runner.paths import pasteable, shell_path
from runner.rundir import (
    FINAL_STATES,
    STATES,
    RunDir,
    RunLocked,
    is_run_dir,
)
from runner.rundir.io import RUN_KEY_ENV, no_room_cause, not_written, room_fix, room_on
from runner.rundir.manifest import (
    build_manifest,
    changed_data,
    changed_recipe,
    unlike_loaded,
    write_manifest,
)

log = logging.getLogger(__name__)


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
        with trainer_lock(cfg, run):
            check_shell_threads()
            if cfg.resume is None:
                # Before torch loads: a mistyped path or value is said in a second, not five.
                from runner.config.resolve import typed_train

                check_data_found(cfg.dataset)
                typed_train(cfg, overrides)  # checked again as the recipe resolves, not kept
            as_launcher()
            # A full disk's error names what placed the run, in this process and its trainers.
            with environment({RUN_KEY_ENV: "=".join(_run_key(cfg, run))}):
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
            discard(run_dir, Path(cfg.runtime.output_root))
        raise


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
        # A directory another process trains (RunLocked) is that process's to record in.
        if run.status().state != "failed" and not isinstance(err, RunLocked):
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
            f"{shell_path(run.path)}), put the configs back, or give another hydra.run.dir",
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
            with _records_written(cfg, run):
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
        with _records_written(cfg, run):
            write_recipe(run.recipe_path, recipe)
            write_manifest(run, manifest)
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
        _write_first_status(cfg, run, recipe)
    try:
        result = launch(recipe, run.recipe_path, node_rank)
    finally:  # stopped again too
        if cfg.resume is not None:
            refresh_sweep_of(run.path)
    _print_summary(run)
    return result


def _write_first_status(cfg: DictConfig, run: RunDir, recipe: DictConfig) -> None:
    """`runner stop` signals this process: the run's launcher, whatever its world size, named in
    the run's first status (a stop waits for it). A run killed before its first status was
    written starts as `created`."""
    with _records_written(cfg, run):
        if cfg.resume is None:
            run.write_status(
                "created",
                new_start=True,  # a run trained again by its command (a requeue)
                step=0,
                total_steps=recipe.max_steps,
                launcher_pid=os.getpid(),
            )
            return
        # A resume of a run that ended (cancelled, failed) is under way from here: left as it
        # was, it read as over (Run.status, the job service's poll), and a `runner stop` in its
        # first seconds was refused as "already cancelled" while it went on to train.
        state = run.status().state
        going_on = state if state in STATES and state not in FINAL_STATES else "created"
        run.write_status(going_on, new_start=True, launcher_pid=os.getpid(), error=None)


@contextlib.contextmanager
def _records_written(cfg: DictConfig, run: RunDir) -> Iterator[None]:
    """The run's records (recipe.yaml, manifest.json, its first status) written before it
    trains: a disk that filled after the run's start was checked (start._check_room) is one
    message naming the key that placed the run, not a traceback. A new run's directory is then
    removed (train); a resumed run's records are as they were (written whole or not at all),
    and it resumes once there is room."""
    try:
        yield
    except OSError as err:
        if no_room_cause(err) is None:
            raise
        if cfg.resume is not None:
            raise not_written(run.path, "its records", err) from err
        raise UserError(
            *_run_key(cfg, run),
            f"the run's records could not be written ({no_room_cause(err)}); "
            f"{room_on(run.path)}: " + room_fix(MAKE_ROOM),
        ) from err


def _run_key(cfg: DictConfig, run: RunDir) -> tuple[str, str]:
    """The key that placed the run, and its value as the user gave it: resume=RUN (`runner
    resume RUN`), hydra.run.dir, else runtime.output_root; a sweep's job, hydra.sweep.dir, else
    runtime.multirun_root."""
    hydra = cast(DictConfig, HydraConfig.get())  # typed as Hydra's dataclass, which it mirrors
    if cfg.resume is None and hydra.mode == RunMode.MULTIRUN:
        return sweep_dir_key(cfg, hydra)
    return run_dir_key(cfg, hydra, run.path)


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


def _check_data(recipe: DictConfig) -> None:
    """Reads and checks every record of every split before anything starts."""
    from runner.components import instantiate
    from runner.data import check_datasets

    started = time.perf_counter()
    evaluates = recipe.eval.strategy != "no"
    found = check_datasets(recipe.dataset, instantiate(recipe.model.tokenizer), evaluates=evaluates)
    records = ", ".join(f"{n} {split}" for split, n in found.items()) or "no"
    log.info("data: %s records checked in %.1f s", records, time.perf_counter() - started)
    check_one_global_batch(recipe, found.get("train"))
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
