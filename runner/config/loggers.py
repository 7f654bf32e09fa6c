"""`runtime.loggers`: the experiment trackers a run may name, checked before anything starts.

runner.trainer.trackers builds them in the training process.
"""

from __future__ import annotations

import importlib.util

from runner.errors import UserError

# Each tracker name and the package (and extra of runner) it needs; None: always installed.
TRACKERS: dict[str, tuple[str, str] | None] = {
    "jsonl": None,
    "tensorboard": None,
    "wandb": ("wandb", "runner[wandb]"),
    "mlflow": ("mlflow", "runner[mlflow]"),
}


def check_loggers(loggers: list[str], *, key: str = "runtime.loggers") -> None:
    """A UserError for an unknown or repeated tracker name, or one whose package is missing."""
    for name in loggers:
        if name not in TRACKERS:
            raise UserError(key, list(loggers), f"{name!r} is no tracker; use any of {_names()}")
        if list(loggers).count(name) > 1:
            raise UserError(key, list(loggers), f"{name!r} is listed twice; list it once")
        needs = TRACKERS[name]
        if needs is not None and importlib.util.find_spec(needs[0]) is None:
            raise UserError(
                key,
                list(loggers),
                f"{name} needs the {needs[0]} package: pip install '{needs[1]}'",
            )


def _names() -> str:
    return ", ".join(TRACKERS)
