"""The `${runner_*:...}` interpolations the configs in conf/ use.

Registered by one explicit call, `register()`, from the entry points (the `runner` command,
and whatever composes conf/ itself: the tests, scripts/bench/bench_train.py); importing a module of
ours registers nothing. No resolver writes the environment.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from omegaconf import DictConfig, OmegaConf

from runner.config.fields import as_typed
from runner.errors import UserError
from runner.paths import ASSETS_DIR, SAMPLE_DATA_DIR, refuse_empty_path, user_path


def has_validation(validation: Any) -> bool:
    """Whether dataset.validation names a split to evaluate on."""
    return any(validation[key] is not None for key in ("held_out", "split", "source"))


def evaluates(strategy: Any, validation: Any) -> bool:
    """Whether a run evaluates: eval.strategy is not `no` and the dataset has a validation split."""
    return strategy not in ("no", False) and has_validation(validation)


def objective_metric(strategy: Any, validation: Any) -> str:
    """objective.metric's default: the eval loss when the run evaluates, else the training loss."""
    return "eval_loss" if evaluates(strategy, validation) else "loss"


def parallel_jobs() -> int:
    """Jobs to run at once on this machine (hydra/launcher=parallel): one per GPU, else per core.

    Each job's training processes take an equal share of the cores (runner.job.job).
    """
    import torch

    return torch.cuda.device_count() or os.cpu_count() or 1


def check_resume(resume: Any, overrides: list[str]) -> None:
    """resume=RUN continues RUN's recorded recipe: no other overrides, and RUN must be a run."""
    from runner.rundir import RECIPE_FILE, STATUS_FILE

    refuse_empty_path("resume", resume, "give the run to go on with: runner resume RUN")
    extra = [o for o in overrides if not o.startswith("resume=")]
    if extra:
        raise UserError(
            "resume",
            resume,
            f"a resumed run continues its recorded recipe; drop the other overrides {extra}",
        )
    if (user_path(resume) / RECIPE_FILE).is_file():
        return
    if (user_path(resume) / STATUS_FILE).is_file():  # a sweep's job, failed at its checks
        raise UserError(
            "resume",
            resume,
            f"the run failed before it recorded its recipe ({RECIPE_FILE}): nothing to go on "
            f"from; fix what its {STATUS_FILE} error says and train it again",
        )
    raise UserError("resume", resume, f"not a run directory (it has no {RECIPE_FILE})")


def run_dir(resume: Any, fresh: str, *, _root_: DictConfig) -> str:
    """hydra.run.dir: the resumed run, else a fresh one that every node of the job agrees on.

    A resume= with other overrides, or of no run directory, fails here: before Hydra writes
    its log file into it.
    """
    from runner.config import platforms

    if resume is not None:
        check_resume(resume, as_typed(_root_.hydra.overrides.task))
    return str(user_path(platforms.run_dir(resume, fresh, _root_=_root_)))


def platform_value(platform: str, key: str, default: Any) -> Any:
    """`${runner_platform:PLATFORM,KEY,DEFAULT}`: the platform's value for compute.KEY."""
    from runner.config import platforms

    return platforms.platform_value(platform, key, default)


def hub_cache() -> str:
    """runtime.cache_dir's default: where hf:// sources are downloaded."""
    from runner.hub.download import default_cache_dir

    return default_cache_dir()


def mounted_checkpoint() -> str | None:
    """load_checkpoint.path's default: the checkpoint the platform mounted, if any."""
    from runner.config import load_checkpoint

    return load_checkpoint.mounted()


def load_mode(path: Any) -> str | None:
    """load_checkpoint.mode's default: what load_checkpoint.path is."""
    from runner.config import load_checkpoint

    return load_checkpoint.mode(path)


def sample_validation(source: Any) -> str | None:
    """dataset=sample's validation.source: the sample's held-out words while it trains on the
    sample's own records, none once dataset.source is another's. `runner train
    dataset.source=mine.jsonl` (the default dataset, sample, with the user's file) evaluated on
    the sample's words, and refused a held_out of the user's as a second validation set."""
    own = SAMPLE_DATA_DIR / "train.jsonl"
    return str(SAMPLE_DATA_DIR / "validation.jsonl") if str(source) == str(own) else None


RESOLVERS: dict[str, Callable[..., Any]] = {
    "runner_asset": lambda name: str(ASSETS_DIR / name),
    "runner_sample_validation": sample_validation,
    "runner_run_dir": run_dir,
    "runner_user_path": lambda path: str(user_path(path)),  # runtime.multirun_root='~/sweeps'
    # A resumed run keeps the .hydra/ record of the run that created it.
    "runner_hydra_subdir": lambda resume: None if resume else ".hydra",
    "runner_objective": objective_metric,
    "runner_parallel_jobs": parallel_jobs,
    "runner_platform": platform_value,
    "runner_hub_cache": hub_cache,
    "runner_mounted_checkpoint": mounted_checkpoint,
    "runner_load_mode": load_mode,
}


def register() -> None:
    """Registers every runner_* resolver with OmegaConf (again: a no-op)."""
    for name, resolver in RESOLVERS.items():
        OmegaConf.register_new_resolver(name, resolver, replace=True)
