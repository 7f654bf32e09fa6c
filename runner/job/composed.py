"""Checks of the composed config that come before Hydra acts on it (CheckComposed, the first
callback conf/train.yaml names): a Hydra setting runner cannot run under, a key runner reads
removed with ~KEY, a config group of the user's own that runner does not read."""

from __future__ import annotations

from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from runner.config.fields import as_typed, check_groups_read, check_removed
from runner.config.method import check_method_name
from runner.config.runtime import check_chdir
from runner.config.schema import Train
from runner.errors import user_errors_pass_hydra


class CheckComposed(Callback):
    """Hydra callback of `runner train` (and -m, and the commands that only look): checks the
    composed config before Hydra makes, enters or writes any directory of the run, or resolves
    its run directory (which interpolates runtime.output_root)."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        _check(config)

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        _check(config)


def _check(config: DictConfig) -> None:
    # Hydra turns an Exception of a callback into a warning; a UserErrorExit ends the run.
    with user_errors_pass_hydra():
        check_chdir(config.hydra.job.chdir)
        overrides = as_typed(config.hydra.overrides.task)
        check_method_name(overrides)  # ~method.name: the option to choose, not a value to give
        check_removed(config, overrides, Train)
        check_groups_read(config, config.hydra.runtime.choices, Train)
