"""What runner.api answers in the caller's process: the options this installation offers, conf/
composed as the CLI composes it, and `runner validate | estimate` on it; the checks of the
arguments every call takes (overrides, env)."""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omegaconf import DictConfig

from runner.config import interpolations
from runner.errors import UserError
from runner.paths import CONF_DIR, user_path
from runner.rundir import STALLED, STATES, STOPPING

if TYPE_CHECKING:
    from runner.job.preflight import Estimate

_HYDRA = threading.Lock()  # Hydra's compose API keeps global state
_CONFIG_GROUPS = ("model", "dataset", "method", "dtype", "compute", "optimizer", "loss")


@dataclass(frozen=True)
class Capabilities:
    """What this installation of runner offers: the options of each config group (conf/), the
    deploy engines, the trackers and the lifecycle states a run goes through."""

    models: tuple[str, ...]
    datasets: tuple[str, ...]
    methods: tuple[str, ...]
    dtypes: tuple[str, ...]
    compute: tuple[str, ...]
    optimizers: tuple[str, ...]
    losses: tuple[str, ...]
    engines: tuple[str, ...]
    loggers: tuple[str, ...]
    states: tuple[str, ...]


def capabilities() -> Capabilities:
    """The options this installation offers, read from conf/ and the code that serves them."""
    from runner.config.loggers import TRACKERS
    from runner.deploy.serve import ENGINES

    def options(group: str) -> tuple[str, ...]:
        """The options of a config group: its YAML files' names."""
        return tuple(sorted(path.stem for path in (CONF_DIR / group).glob("*.yaml")))

    groups = dict(zip(_CONFIG_GROUPS, map(options, _CONFIG_GROUPS), strict=True))
    return Capabilities(
        models=groups["model"],
        datasets=groups["dataset"],
        methods=groups["method"],
        dtypes=groups["dtype"],
        compute=groups["compute"],
        optimizers=groups["optimizer"],
        losses=groups["loss"],
        engines=tuple(ENGINES),
        loggers=tuple(TRACKERS),
        states=(*STATES, STOPPING, STALLED),
    )


def compose(overrides: Sequence[str], config_name: str = "train") -> DictConfig:
    """conf/`config_name` composed with `overrides`, as `runner train` composes it; a bad
    override or option raises the UserError the CLI would print."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from runner.config.hydra_errors import as_user_error

    interpolations.register()
    with _HYDRA, initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        try:
            return hydra_compose(config_name, overrides=listed(overrides))
        except Exception as err:  # noqa: BLE001 - recast as the CLI does, re-raised otherwise
            user_error = as_user_error(err, config_name)
            if user_error is None:
                raise
            raise user_error from None


def compose_sweep(overrides: Sequence[str]) -> DictConfig:
    """conf/train composed for `runner train -m OVERRIDES`, its swept values as given (Hydra's
    sweeper applies them job by job), hydra's own keys included; a bad override or option
    raises the UserError the CLI would print."""
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.types import RunMode

    from runner.config.hydra_errors import as_user_error

    interpolations.register()
    with _HYDRA, initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        hydra = GlobalHydra.instance().hydra
        assert hydra is not None  # initialized just above
        try:
            return hydra.compose_config("train", listed(overrides), run_mode=RunMode.MULTIRUN)
        except Exception as err:  # noqa: BLE001 - recast as the CLI does, re-raised otherwise
            user_error = as_user_error(err, "train")
            if user_error is None:
                raise
            raise user_error from None


def listed(overrides: Sequence[str]) -> list[str]:
    """`overrides` as a list of strings; one string given for the list was read a character at
    a time ("override='m': Error parsing override"), and None (an optional request body left
    out) raised a bare TypeError, from validate too, which returns its problems."""
    if (
        isinstance(overrides, str | bytes)
        or not isinstance(overrides, Sequence)
        or not all(isinstance(o, str) for o in overrides)
    ):
        raise UserError("overrides", overrides, "give a list of strings, e.g. ['max_steps=4']")
    return list(overrides)


def environment(env: Any) -> dict[str, str] | None:
    """`env` (the process's environment, None for this one's) as a dict of strings, checked
    before a directory is made (a bad one raised a bare TypeError from Popen, after it). Its
    values are never shown: they may hold a secret."""
    if env is None:
        return None
    if not isinstance(env, Mapping):
        raise UserError(
            "env",
            None,
            f"a {type(env).__name__}; give a mapping of names to strings, e.g. "
            "{**os.environ, 'A': '1'}",
        )
    for name, value in env.items():
        if not isinstance(name, str) or not isinstance(value, str):
            raise UserError(
                f"env[{name!r}]",
                None,
                f"a {type(value).__name__}; give names and values as strings",
            )
    return dict(env)


def working_dir(cwd: str | os.PathLike[str] | None) -> Path:
    """Where a process started here runs: `cwd` (this process's own when None), which must be a
    directory. A mistyped one was made, with the run under it, and the relative paths of the
    overrides were read from that empty directory; one that could not be made was a traceback."""
    if cwd is None:
        return Path.cwd()
    path = user_path(cwd)
    if not path.is_dir():
        found = "a file" if path.exists() else "no such directory"
        raise UserError(
            "cwd", str(cwd), f"{found}; give the directory the command runs in (or None: this one)"
        )
    return path.resolve()


def validate(overrides: Sequence[str]) -> list[UserError]:
    """The problems `runner validate` would report for `overrides` (config, weights, tokenizer,
    every data record), as UserErrors, not raised: [] when it would train. The checks build on
    one another, so the list holds the first problem found."""
    from runner.job.preflight import check

    try:
        check(compose(overrides), list(overrides))
    except UserError as err:
        return [err]
    return []


def estimate(overrides: Sequence[str]) -> Estimate:
    """`runner estimate`: parameters, memory per device and tokens per epoch (raises a
    UserError for a bad config)."""
    from runner.job.preflight import estimated

    return estimated(compose(overrides), list(overrides))[1]
