"""The runtime group: where runs go, how they log and checkpoint, their environment.

The recipe's runtime section is what the training processes need of it (RuntimeRecipe); the
group as the user types it adds where runs are written and how hf:// sources are fetched.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from omegaconf import MISSING, DictConfig

from runner.config.fields import flag, integer
from runner.config.loggers import check_loggers
from runner.config.secrets import env_secret_error, refuse_secret
from runner.errors import SECRET_KEY, UserError
from runner.paths import refuse_empty_path

# typing's Optional/Dict/List: the forms OmegaConf 2.3 reads in structured-config annotations.
# ruff: noqa: UP006, UP035, UP045


@dataclass
class RuntimeRecipe:
    """The recipe's runtime section: checkpoint cadence, logging, environment."""

    save_every_n_steps: Optional[int] = integer(200, 1)
    keep_last_n_checkpoints: int = integer(2, 1)
    log_every_n_steps: int = integer(10, 1)
    # Checked by runner.config.loggers.check_loggers (names, installed packages).
    loggers: List[str] = field(default_factory=list)
    project: str = "runner"
    # true, false or auto (a bar only where the console is a terminal); auto stays auto in the
    # recipe, as the console is the training process's, not the run's (runner.trainer.progress).
    progress_bar: Any = "auto"
    deterministic: bool = flag(False)
    env: Dict[str, str] = field(default_factory=dict)
    # Where the hub token is (env:NAME, file:PATH; null: huggingface_hub's login), never the
    # token: a training split streamed from the hub reads its files with it.
    hf_token: Optional[str] = None


@dataclass
class Runtime(RuntimeRecipe):
    """The runtime group: the recipe's keys, and where runs go and sources come from."""

    output_root: str = "outputs"
    multirun_root: str = "multirun"
    # Replaced by `loggers`; set, it is refused with the migration (resolve_runtime).
    tensorboard: Optional[bool] = None
    cache_dir: str = MISSING
    hub_model_ignore_patterns: List[str] = field(default_factory=list)


def check_root(root: Any, key: str) -> None:
    """runtime.output_root (multirun_root): a directory's path; '' made runs at the file
    system's root (/<date>/<time>), and null a directory named None before it was refused."""
    default = Runtime.__dataclass_fields__[key.removeprefix("runtime.")].default
    fix = f"give the directory to write runs under ({default}, the default)"
    refuse_empty_path(key, root, fix, means="runs at the file system's root")
    if not isinstance(root, str):
        raise UserError(key, root, fix)


def check_threads(value: str | None, key: str, fix: str) -> None:
    """OMP_NUM_THREADS, the threads each training process computes on (runner.trainer.process):
    a count >= 1, or OpenMP's list of them (4,2); 0 failed the run in a traceback, in
    torch.set_num_threads, and text was passed over without a word. `fix`: how to do without."""
    if value is not None and not re.fullmatch(r"[1-9]\d*(,[1-9]\d*)*", value.strip()):
        raise UserError(
            key, value, f"give the threads each training process computes on, >= 1, or {fix}"
        )


def check_shell_threads() -> None:
    """The shell's OMP_NUM_THREADS, which a run's processes inherit (checked as a run or a sweep
    starts, a resumed run too: runtime.env's is checked as the recipe resolves)."""
    threads = os.environ.get("OMP_NUM_THREADS")
    check_threads(threads, "OMP_NUM_THREADS", "unset it for a share of the cores")


def resolve_runtime(runtime: DictConfig) -> RuntimeRecipe:
    """The recipe's runtime section: trackers checked, runtime.env free of secrets."""
    if runtime.tensorboard is not None:
        fix = "[tensorboard]" if runtime.tensorboard else "[]"
        raise UserError(
            "runtime.tensorboard",
            runtime.tensorboard,
            f"replaced by runtime.loggers: write runtime.loggers={fix}",
        )
    check_root(runtime.output_root, "runtime.output_root")
    check_root(runtime.multirun_root, "runtime.multirun_root")
    env = _plain_env(runtime.env)
    check_threads(
        env.get("OMP_NUM_THREADS"),
        "runtime.env.OMP_NUM_THREADS",
        "leave it out for a share of the cores",
    )
    # runtime.env reaches the training processes (runner.job.launch), where the trackers start.
    check_loggers(list(runtime.loggers), env={**os.environ, **env}, project=runtime.project)
    if not (isinstance(runtime.progress_bar, bool) or runtime.progress_bar == "auto"):
        raise UserError("runtime.progress_bar", runtime.progress_bar, "give true, false or auto")
    return RuntimeRecipe(
        save_every_n_steps=runtime.save_every_n_steps,
        keep_last_n_checkpoints=runtime.keep_last_n_checkpoints,
        log_every_n_steps=runtime.log_every_n_steps,
        loggers=list(runtime.loggers),
        project=runtime.project,
        progress_bar=runtime.progress_bar,
        deterministic=runtime.deterministic,
        env=env,
        hf_token=runtime.hf_token,
    )


def check_env_set(env_set: Mapping[str, Any]) -> None:
    """hydra.job.env_set, Hydra's environment of the job: runner records runtime.env, which
    resume and repro set again, and not this, which they ran without."""
    for name, value in env_set.items():
        refuse_secret(f"hydra.job.env_set.{name}", str(value))  # never echoed in the fix
        given = f"{name}={value}"
        raise UserError(
            f"hydra.job.env_set.{name}",
            str(value),
            "the run would not record it, and runner resume and repro would run without it; "
            f"give +runtime.env.{given} (recorded, and set again by both)",
        )


def check_chdir(chdir: Any) -> None:
    """hydra.job.chdir: the job stays in the directory the command was run in, where every
    path the user gives is read from (Hydra would move it into its run directory)."""
    if chdir:
        raise UserError(
            "hydra.job.chdir",
            chdir,
            "runner reads the paths you give (dataset.source, load_checkpoint.path, "
            "runtime.output_root, ...) from the directory you run it in; leave hydra.job.chdir "
            "false, and give absolute paths for files elsewhere",
        )


def _plain_env(env: DictConfig) -> dict[str, str]:
    """runtime.env is recorded in the run directory, so it may not carry secrets."""
    plain = {str(key): str(value) for key, value in env.items()}
    for name in plain:
        if SECRET_KEY.search(name):
            raise env_secret_error(name)
    return plain
