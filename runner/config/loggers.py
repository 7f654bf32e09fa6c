"""`runtime.loggers`: the experiment trackers a run may name, checked before anything starts.

runner.trainer.trackers builds them in the training process.
"""

from __future__ import annotations

import importlib.util
import os
import socket
from collections.abc import Mapping
from pathlib import Path
from urllib.parse import urlsplit

from runner.errors import UserError, redact_text

# Each tracker name and the package (and extra of runner) it needs; None: always installed.
TRACKERS: dict[str, tuple[str, str] | None] = {
    "jsonl": None,
    "tensorboard": None,
    "wandb": ("wandb", "runner[wandb]"),
    "mlflow": ("mlflow", "runner[mlflow]"),
}


# The characters W&B refuses in a project's name (wandb_settings.Settings.validate_project).
WANDB_REFUSES = "/\\#?%:"
# How long a tracking server has to take a connection.
REACH_S = 10.0


def check_loggers(
    loggers: list[str],
    *,
    key: str = "runtime.loggers",
    env: Mapping[str, str] | None = None,
    project: str | None = None,
) -> None:
    """A UserError for an unknown or repeated tracker name, one whose package is missing, an
    MLflow file store that MLflow refuses or a server out of reach, or a `project` (None: not
    checked) a tracker refuses. `env`: the training processes' environment (this process's,
    runtime.env over it); None: this process's."""
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
    if project is not None:
        _check_project(project, [name for name in loggers if name in ("wandb", "mlflow")])
    env = os.environ if env is None else env
    if "wandb" in loggers:
        _check_wandb_login(list(loggers), key, env)
    if "mlflow" in loggers:
        _check_mlflow_store(list(loggers), key, env)


def _check_wandb_login(loggers: list[str], key: str, env: Mapping[str, str]) -> None:
    """W&B online with no credentials (WANDB_API_KEY, wandb login's ~/.netrc): wandb.init failed
    in the training process, after the run directory was written, with a traceback of some 40
    lines ("No API key configured"). Where a settings file of W&B's own is there (`wandb
    offline` writes one), or W&B's code is another version's, W&B is left to decide."""
    if env.get("WANDB_MODE", "").lower() in ("offline", "disabled", "dryrun"):
        return
    config_dir = Path(env.get("WANDB_CONFIG_DIR") or Path.home() / ".config" / "wandb")
    if (Path(env.get("WANDB_DIR") or ".") / "wandb" / "settings").is_file() or (
        config_dir / "settings"
    ).is_file():
        return
    try:
        import wandb
        from wandb.sdk.lib.wbauth.authenticate import authenticate_session

        host = env.get("WANDB_BASE_URL") or wandb.Settings().base_url  # its default's W&B's
        found = authenticate_session(host=host, source="runner", prompt=False, update_session=False)
    except Exception:  # noqa: BLE001 - another version's API, or a key W&B reads as malformed
        return
    if found is None:
        raise UserError(
            key,
            loggers,
            f"W&B has no API key for {host} here (WANDB_API_KEY, or ~/.netrc from `wandb "
            "login`): log in with `wandb login`, or set WANDB_MODE=offline",
        )


def _check_project(project: str, trackers: list[str]) -> None:
    """runtime.project as the trackers take it: W&B refuses a name with any of / \\ # ? % : or
    over 128 characters, MLflow an empty one; each failed when the tracker started, after the
    run directory was written."""
    if trackers and not project.strip():
        raise UserError("runtime.project", project, "give the trackers a project name")
    if "wandb" in trackers:
        refused = sorted({c for c in project if c in WANDB_REFUSES})
        if refused or len(project) > 128:
            why = f"any of {' '.join(WANDB_REFUSES)}" if refused else "over 128 characters"
            raise UserError(
                "runtime.project", project, f"W&B refuses a project name with {why}; give another"
            )


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
    scheme = get_uri_scheme(uri)  # type: ignore[no-untyped-call]
    if scheme in ("http", "https"):
        _check_reachable(uri, loggers, key)
    if scheme not in ("", "file"):
        return
    raise UserError(
        key,
        loggers,
        f"MLflow's tracking URI {uri} is a file store, which MLflow {mlflow.__version__} refuses "
        "unless MLFLOW_ALLOW_FILE_STORE=true; set that, or give a database or server: "
        "MLFLOW_TRACKING_URI=sqlite:///mlflow.db or http://HOST:5000",
    )


def _check_reachable(uri: str, loggers: list[str], key: str) -> None:
    """A tracking server that does not take a connection, or answers that it has no MLflow API
    (a wrong port, a proxy's path left out): MLflow's client retried the first for some four
    minutes in the training process, then failed with a traceback of 166 lines; the second
    failed there at once, in some 90 lines."""
    parts = urlsplit(uri)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    shown = redact_text(uri)
    try:
        socket.create_connection((parts.hostname or "", port), timeout=REACH_S).close()
    except OSError as err:
        reason = err.strerror or str(err) or type(err).__name__
        raise UserError(
            key,
            loggers,
            f"MLflow's tracking server {shown} is out of reach ({reason}); start it, or give "
            "MLFLOW_TRACKING_URI one that answers",
        ) from None
    status = _not_mlflow(uri)
    if status is not None:
        raise UserError(
            key,
            loggers,
            f"{shown} is no MLflow tracking server: {MLFLOW_PROBE} answered HTTP {status} "
            "without MLflow's JSON; give MLFLOW_TRACKING_URI the server's address "
            "(http://HOST:5000, with any path its proxy puts before /api)",
        )


# What the training process's MLflow client asks a server first (MlflowClient's
# get_experiment_by_name); an MLflow server answers JSON, its errors included.
MLFLOW_PROBE = "/api/2.0/mlflow/experiments/get-by-name"


def _not_mlflow(uri: str) -> int | None:
    """The HTTP status of an answer that says no MLflow API is at `uri` (404 or 405, and no
    MLflow JSON); None for any other. Asked as MLflow's client asks (requests: its proxies and
    their exceptions), but without its credentials: an answer that wants them (401, 403, a
    redirect to a login), or any other that may not be the server's own (a proxy's 502, a TLS
    handshake MLflow's settings may allow), is left to MLflow."""
    import requests

    parts = urlsplit(uri)
    probe = parts._replace(path=parts.path.rstrip("/") + MLFLOW_PROBE, query="", fragment="")
    try:
        answer = requests.get(
            probe.geturl(),
            params={"experiment_name": "runner-check"},
            timeout=REACH_S,
            allow_redirects=False,
        )
    except requests.RequestException:
        return None
    if answer.status_code not in (404, 405):
        return None
    try:
        body = answer.json()
    except ValueError:
        body = None
    return None if isinstance(body, dict) and "error_code" in body else answer.status_code


def _names() -> str:
    return ", ".join(TRACKERS)
