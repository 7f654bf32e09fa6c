"""A sweep's checks before its directory is made (runner train -m, runner.api's sweep): its
settings, a sweep directory that holds another sweep, and each value it sweeps resolved in a job
of its grid; then the directory, made (SweepSummary.on_multirun_start calls them)."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from runner.config.fields import as_typed, override_key, parsed_overrides
from runner.config.runtime import check_env_set, check_root, check_shell_threads
from runner.config.secrets import refuse_config_secrets
from runner.errors import UserError
from runner.paths import refuse_empty_path
from runner.rundir import SWEEP_LOCK_FILE, is_run_dir, lock_held, run_around
from runner.rundir.lock import LOCK_FILE
from runner.rundir.manifest import MANIFEST_FILE, changed_overrides

# objective.mode as Optuna's sweeper names the same direction.
OPTUNA_DIRECTIONS = {"min": "minimize", "max": "maximize"}
HIGHER_OR_LOWER = {"min": "lower", "max": "higher"}


def check_sweep(config: DictConfig) -> None:
    """What `runner train -m` checks before its sweep directory is made (runner.api's sweep
    waits for the sweep's process to pass them), `config` composed for a multirun: a UserError
    for the first problem found."""
    check_root(config.runtime.multirun_root, "runtime.multirun_root")
    check_shell_threads()
    refuse_empty_path(
        "hydra.sweep.dir",
        str(config.hydra.sweep.dir),
        "give the sweep's directory, or leave hydra.sweep.dir out for "
        f"{config.runtime.multirun_root}/<date>/<time>",
    )
    check_no_sweep_running(Path(config.hydra.sweep.dir), *sweep_dir_key(config, config.hydra))
    refuse_config_secrets(config)  # before Hydra writes it to multirun.yaml
    check_env_set(config.hydra.job.env_set)  # the jobs' checks see it, this one's not
    check_direction(config.hydra.sweeper, config.objective)
    if "joblib" in str(config.hydra.launcher.get("_target_", "")):
        _check_jobs(config.hydra.launcher.n_jobs)
    check_outside_runs(config)
    check_same_sweep(config)  # before the values: it reads a file, they resolve every job
    check_sweep_values(config)


def check_no_sweep_running(sweep_dir: Path, key: str, value: str) -> None:
    """A sweep directory whose sweep still runs (its process holds SWEEP/.sweep.lock), or
    one of whose jobs another process trains, is refused: a second sweep there took the jobs
    the first had not reached, and its refused attempt at the job that trained wrote `failed`
    into that job's status.json."""
    if lock_held(sweep_dir, SWEEP_LOCK_FILE):
        raise UserError(
            key,
            value,
            f"a sweep is running there (its process holds {sweep_dir / SWEEP_LOCK_FILE}); "
            "wait for it to end (runner.api's Sweep(path).wait()), or stop it "
            "(`runner stop` of its running job) and give its command again to go on with it",
        )
    # A job there that another process trains (a `runner resume SWEEP/N`) would be refused
    # when its turn came, after the jobs before it trained.
    for job in sorted(sweep_dir.glob(f"*/{LOCK_FILE}")):
        if lock_held(job.parent):
            raise UserError(
                key,
                value,
                f"its job {job.parent.name} is being trained by another process (it holds "
                f"{job}); wait for that run to end (`runner runs {sweep_dir}` shows it), then "
                "give the sweep's command again",
            )


def check_outside_runs(config: DictConfig) -> None:
    """A sweep directory is not a run's directory, nor inside one: its jobs were made beside
    the run's files, where `runner runs` does not look for them (it looks for no run inside
    another), and its summary.md beside the run's recipe."""
    sweep_dir = Path(config.hydra.sweep.dir)
    around = sweep_dir if is_run_dir(sweep_dir) else run_around(sweep_dir)
    if around is not None:
        where = "is the run directory" if around == sweep_dir else "is inside the run directory"
        raise UserError(
            *sweep_dir_key(config, config.hydra),
            f"{where} {around}, where `runner runs` does not look for the sweep's jobs; give "
            "a directory outside it",
        )


def make_sweep_dir(config: DictConfig) -> None:
    """The sweep directory, made once its values are checked: one that cannot be made (a
    read-only file system, a file on the path) was a traceback from Hydra's sweeper."""
    if str(config.hydra.sweep.dir).startswith("~"):  # as typed: no resolver reads it
        key, value = sweep_dir_key(config, config.hydra)
        raise UserError(
            key,
            value,
            "Hydra keeps ~ as a directory's name here: give the path from / (or $HOME/..., "
            "which the shell expands unquoted)",
        )
    try:
        Path(config.hydra.sweep.dir).mkdir(parents=True, exist_ok=True)
    except OSError as err:
        key, value = sweep_dir_key(config, config.hydra)
        raise UserError(
            key,
            value,
            f"cannot make the sweep directory {config.hydra.sweep.dir} ({err.strerror}); give "
            "a directory this user can write",
        ) from None


def check_direction(sweeper: DictConfig, objective: DictConfig) -> None:
    """An Optuna sweep (a sweeper with a direction) optimizes what each job returns, its
    objective.metric: in the direction of objective.mode, or it would seek the worst job."""
    if "direction" not in sweeper:
        return  # Hydra's basic sweeper: the summary ranks by objective.mode
    direction = sweeper.direction
    direction = getattr(direction, "name", direction)  # Optuna's Direction enum, or its name
    wanted = OPTUNA_DIRECTIONS[objective.mode]
    other = "max" if objective.mode == "min" else "min"
    if direction != wanted:
        raise UserError(
            "hydra.sweeper.direction",
            direction if isinstance(direction, str) else list(direction),
            f"the jobs return {objective.metric}, which objective.mode={objective.mode} says is "
            f"better {HIGHER_OR_LOWER[objective.mode]}; set hydra.sweeper.direction={wanted} "
            f"(or objective.mode={other}, if it is better {HIGHER_OR_LOWER[other]})",
        )


def check_sweep_values(config: DictConfig) -> None:
    """Every value a sweep gives a key, composed from the sweep's own config (--config-name's:
    train's left a user's base file unchecked) and resolved as `runner estimate` resolves it
    (every key checked, nothing read or downloaded) before any job starts or the sweep
    directory is made: a bad value (optimizer.lr=1e-3,abc) was found only when its job came,
    the jobs before it trained, and a refused sweep left a directory holding Hydra's
    multirun.yaml alone. One job a value, the grid's first that gives it: the other swept keys
    at their first values (at their defaults, a valid grid, num_heads=6,12 num_kv_heads=2,3,
    was refused for the default's 4 kv heads; every job would be the values' product); an
    Optuna sweep's values are drawn as it goes, from ranges Optuna checks. A sweep that sweeps
    nothing (-m with fixed values alone) is its one job, checked as a job of a grid is."""
    # torchao, imported with the checks, says that it found no Triton (runner.models.
    # torchtune_boundary demotes it to INFO), which the sweep process's console (Hydra's own
    # logging, INFO and up) would show above the sweep.
    logging.getLogger("torchao.kernel.intmm").setLevel(logging.ERROR)
    if "direction" in config.hydra.sweeper:
        return
    overrides = parsed_overrides(as_typed(config.hydra.overrides.task))
    fixed = [str(o.input_line) for o in overrides if not o.is_sweep_override()]
    for override in overrides:
        if override.is_interval_sweep():  # Hydra's own sweeper raised its traceback
            raise UserError(
                override.get_key_element(),
                override.input_line.partition("=")[2] if override.input_line else None,
                "an interval is drawn from by the Optuna sweeper: add hydra/sweeper=optuna "
                "(docs/sweeps.md), or give the values (a,b,c or range(START,STOP,STEP))",
            )
    swept = [
        (o.get_key_element(), list(o.sweep_string_iterator()))
        for o in overrides
        if o.is_sweep_override()
    ]
    jobs = dict.fromkeys(  # in order, each once
        tuple(f"{other}={value if other == key else values[0]}" for other, values in swept)
        for key, given in swept
        for value in given
    ) or {(): None}  # nothing swept: its one job, whose values were checked by none
    logging.disable(logging.WARNING)  # each job says its own warnings as it starts
    try:
        # Every job's options, keys and values first, which need neither torch nor a tokenizer:
        # a mistyped value in the grid's last job was found only after each job before it was
        # resolved, seconds of imports and tokenizer loads in a fresh interpreter.
        several = len(swept) > 1
        composed = [_composed(config, [*fixed, *job], job if several else ()) for job in jobs]
        for job_config, job_overrides, named in composed:
            _check_job(job_config, job_overrides, named)
    finally:
        logging.disable(logging.NOTSET)


def _composed(
    config: DictConfig, overrides: list[str], swept: tuple[str, ...]
) -> tuple[DictConfig, list[str], tuple[str, ...]]:
    """One job of the sweep (`overrides`) composed, its values typed and bounded (a job that
    resumes a run goes on with that run's recipe, checked by _check_job); a refusal names the
    `swept` values of the job it is of. Returns what _check_job takes."""
    from hydra import compose

    from runner.config.resolve import typed_train

    with _refused_in(swept):
        composed = compose(config_name=config.hydra.job.config_name, overrides=overrides)
        if composed.get("resume") is None:
            typed_train(composed, overrides)
    return composed, overrides, swept


def _check_job(composed: DictConfig, overrides: list[str], swept: tuple[str, ...]) -> None:
    """One job of the sweep, composed from `overrides`, resolved as `runner estimate` resolves
    it; a refusal names the `swept` values of the job it is of."""
    from runner.job.preflight import recipe_of

    with _refused_in(swept):
        recipe_of(composed, overrides, estimating=True)


@contextlib.contextmanager
def _refused_in(swept: tuple[str, ...]) -> Iterator[None]:
    """A refusal of one job of the sweep as the UserError `runner train` prints, naming the
    `swept` values of that job where the sweep varies several keys."""
    from runner.config.hydra_errors import as_user_error

    try:
        yield
    except Exception as err:
        user_error = as_user_error(err, "train")
        if user_error is None:
            raise
        if swept:
            job = " ".join(swept)
            user_error = UserError(
                user_error.key, user_error.value, f"{user_error.fix} (in the job {job})"
            )
        raise user_error from None


def check_same_sweep(config: DictConfig) -> None:
    """A sweep directory that holds jobs goes on by the overrides that started it (its command
    given again; compute, batch_size and gradient_accumulation_steps may change): other values
    gave its jobs' directories to other jobs, which found them trained and trained nothing, and
    the summary named them by values they never trained with. Refused by name before anything
    is written, as a run directory is (runner.job.start._check_same_command)."""
    sweep_dir = Path(config.hydra.sweep.dir)
    if not any(sweep_dir.glob(f"*/{MANIFEST_FILE}")):
        return  # no job of it started
    key, value = sweep_dir_key(config, config.hydra)
    where = "" if key == "hydra.sweep.dir" else f"its sweep directory {sweep_dir} "
    if "direction" in config.hydra.sweeper:  # Optuna's, which keeps no record of its trials
        raise UserError(
            key,
            value,
            f"{where}holds the trials of a sweep before: an Optuna sweep draws new values each "
            "time, which its trials' directories did not train with; give another hydra.sweep.dir",
        )
    started = sweep_dir / "multirun.yaml"  # Hydra's record of the sweep
    if not started.is_file():
        return
    recorded = as_typed(OmegaConf.load(started).hydra.overrides.task)
    changes = changed_overrides(recorded, as_typed(config.hydra.overrides.task))
    if changes:
        raise UserError(
            key,
            value,
            f"{where}holds a sweep that other overrides started: {', '.join(changes)}; go on "
            "with it by its own command (compute, batch_size and gradient_accumulation_steps may "
            "change), or give another hydra.sweep.dir",
        )


def sweep_dir_key(config: DictConfig, hydra: DictConfig) -> tuple[str, str]:
    """The key that named the sweep directory, as the user gave it, and its value (`hydra`: the
    composed config's, or a job's HydraConfig)."""
    given = any(override_key(o) == "hydra.sweep.dir" for o in as_typed(hydra.overrides.hydra))
    if given:
        return "hydra.sweep.dir", str(hydra.sweep.dir)
    return "runtime.multirun_root", str(config.runtime.multirun_root)


def _check_jobs(n_jobs: Any) -> None:
    """hydra.launcher.n_jobs of hydra/launcher=parallel: how many jobs run at once (joblib
    reads 0 as an error and -N as all the CPUs but N-1)."""
    if isinstance(n_jobs, bool) or not isinstance(n_jobs, int) or n_jobs < 1:
        raise UserError(
            "hydra.launcher.n_jobs",
            n_jobs,
            "give the jobs to run at once, an integer >= 1 (left out: one per GPU, else per core)",
        )
