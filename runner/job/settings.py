"""Hydra's own settings that runner cannot run under, refused before Hydra acts on any of them
(HydraSettings, the first callback conf/train.yaml names)."""

from __future__ import annotations

from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from runner.config.runtime import check_chdir
from runner.errors import user_errors_pass_hydra


class HydraSettings(Callback):
    """Hydra callback of `runner train` (and -m, and the commands that only look): checks the
    composed hydra section before Hydra makes, enters or writes any directory of the run."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        _check(config)

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        _check(config)


def _check(config: DictConfig) -> None:
    # Hydra turns an Exception of a callback into a warning; a UserErrorExit ends the run.
    with user_errors_pass_hydra():
        check_chdir(config.hydra.job.chdir)
