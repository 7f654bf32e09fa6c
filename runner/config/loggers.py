"""`runtime.loggers`: the experiment trackers a run may name, checked before anything starts.

runner.trainer.trackers builds them in the training process.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Mapping

from runner.errors import UserError

# Each tracker name and the package (and extra of runner) it needs; None: always installed.
TRACKERS: dict[str, tuple[str, str] | None] = {
    "jsonl": None,
    "tensorboard": None,
    "wandb": ("wandb", "runner[wandb]"),
    "mlflow": ("mlflow", "runner[mlflow]"),
}


def check_loggers(
    loggers: list[str], *, key: str = "runtime.loggers", env: Mapping[str, str] | None = None
) -> None:
    """A UserError for an unknown or repeated tracker name, one whose package is missing, or an
    MLflow file store that MLflow refuses. `env`: the training processes' environment (this
    process's, runtime.env over it); None: this process's."""
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
    if "mlflow" in loggers:
        _check_mlflow_store(list(loggers), key, os.environ if env is None else env)


def _check_mlflow_store(loggers: list[str], key: str, env: Mapping[str, str]) -> None:
    """A UserError where MLflow's tracking URI is a file store (a `file:` URI or a plain path,
    its own ./mlruns included) and MLFLOW_ALLOW_FILE_STORE is not true: MLflow 3 refuses one
    when the tracker starts, in the training process, after the run directory is written."""
    import mlflow
    from mlflow import environment_variables
    from mlflow.utils.uri import get_uri_scheme

    if not hasattr(environment_variables, "MLFLOW_ALLOW_FILE_STORE"):
        return  # an MLflow before 3.x keeps its file store open
    allow = env.get("MLFLOW_ALLOW_FILE_STORE")
    if allow is not None and allow.lower() not in ("true", "false", "1", "0"):
        # MLflow raises a ValueError of its own on any other value, when the tracker starts.
        raise UserError("MLFLOW_ALLOW_FILE_STORE", allow, "give true or false (or 1 or 0)")
    if allow is not None and allow.lower() in ("true", "1"):
        return
    # Where unset, MLflow's default: ./mlruns where it holds runs, else sqlite:///mlflow.db.
    uri = env.get("MLFLOW_TRACKING_URI") or mlflow.get_tracking_uri()
    if get_uri_scheme(uri) not in ("", "file"):  # type: ignore[no-untyped-call]
        return
    raise UserError(
        key,
        loggers,
        f"MLflow's tracking URI {uri} is a file store, which MLflow {mlflow.__version__} refuses "
        "unless MLFLOW_ALLOW_FILE_STORE=true; set that, or give a database or server: "
        "MLFLOW_TRACKING_URI=sqlite:///mlflow.db or http://HOST:5000",
    )


def _names() -> str:
    return ", ".join(TRACKERS)
