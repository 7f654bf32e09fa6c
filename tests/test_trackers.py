"""runtime.loggers: wandb (offline) and MLflow (a local file store) get what metrics.jsonl gets,
the best checkpoint's path and a redacted config; a missing package is a user error up front."""

from __future__ import annotations

import http.server
import json
import os
import struct
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from runner.rundir import RunDir
from runner.rundir.manifest import REDACTED
from runner.trainer import trackers
from tests.cli_forks import ForkedCli
from tests.conftest import QUICK

SENTINEL = "sentinel-7d1e-not-for-trackers"
TRACKED = ["runtime.loggers=[tensorboard,wandb,mlflow]"]


def tracker_env(tmp_path: Path) -> dict[str, str]:
    return {
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
        "MLFLOW_TRACKING_URI": f"file:{tmp_path / 'mlruns'}",
        # MLflow 3 keeps its file store (all that mlflow-skinny needs) behind this switch.
        "MLFLOW_ALLOW_FILE_STORE": "true",
    }


def wandb_records(run_dir: Path) -> list[Any]:
    """The records of the run's offline wandb file: a LevelDB-style log of protobufs (32 KiB
    blocks of chunks, each with a 7-byte header: CRC, length, type) after a 7-byte file header."""
    from wandb.proto import wandb_internal_pb2

    (path,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    data, position, block, chunks, records = path.read_bytes(), 7, 32768, b"", []
    assert data.startswith(b":W&B")
    while position + 7 <= len(data):
        if block - position % block < 7:  # the block's tail is padding
            position += block - position % block
            continue
        _, length, kind = struct.unpack("<IHB", data[position : position + 7])
        if kind == 0:
            break
        chunk = data[position + 7 : position + 7 + length]
        position += 7 + length
        chunks = chunk if kind in (1, 2) else chunks + chunk  # full, first | middle, last
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunks)
            records.append(record)
    return records


def key(item: Any) -> str:
    """A wandb history or summary item's name (wandb writes most as a one-part nested key)."""
    return item.key or "/".join(item.nested_key)


def series(records: list[dict[str, Any]], names: set[str]) -> dict[str, list[tuple[int, float]]]:
    found: dict[str, list[tuple[int, float]]] = {}
    for record in records:
        for name in names & set(record):
            found.setdefault(name, []).append((record["step"], record[name]))
    return found


@pytest.fixture(scope="module")
def tracker_cli(
    tmp_path_factory: pytest.TempPathFactory, hermetic_env: dict[str, str]
) -> Iterator[tuple[ForkedCli, Path]]:
    """The CLI forked from a server of its own in tracker_env (read by wandb and MLflow in the
    training process), with a secret the run can read (runtime.hf_token=env:HF_TOKEN) that no
    tracker may receive; and the folder whose mlruns/ is its MLflow store. The two runs below
    fork from it, sparing each a fresh interpreter's imports."""
    root = tmp_path_factory.mktemp("tracked")
    cli = ForkedCli({**hermetic_env, **tracker_env(root), "HF_TOKEN": SENTINEL})
    yield cli, root
    cli.close()


@pytest.fixture(scope="module")
def tracked_run(tracker_cli: tuple[ForkedCli, Path]) -> Path:
    cli, tmp = tracker_cli
    run = tmp / "run"
    args = [*QUICK, *TRACKED, "compute=cpu", "dtype=fp32", "max_steps=12"]
    args += ["runtime.log_every_n_steps=3", "eval.steps=6", "eval.max_samples=16"]
    result = cli(["train", *args, f"hydra.run.dir={run}"], tmp, timeout_s=900)
    assert result.returncode == 0, result.stderr[-3000:]
    return run


def test_wandb_and_mlflow_receive_the_series_of_metrics_jsonl(
    tracked_run: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from mlflow.tracking import MlflowClient

    for name, value in tracker_env(tracked_run.parent).items():
        monkeypatch.setenv(name, value)

    metrics = RunDir(tracked_run).read_metrics()
    names = {name for record in metrics for name in record} - {"step"}
    assert {"loss", "lr", "tokens_per_s", "eval_loss", "eval_token_accuracy"} <= names
    expected = series(metrics, names)
    assert [step for step, _ in expected["eval_loss"]] == [6, 12]

    history = []
    for record in wandb_records(tracked_run):
        if record.WhichOneof("record_type") == "history":
            row = {key(item): json.loads(item.value_json) for item in record.history.item}
            history.append({**row, "step": row["_step"]})
    assert series(history, names) == expected

    run_id = json.loads((tracked_run / trackers.TRACKERS_FILE).read_text())["mlflow_run_id"]
    client = MlflowClient()
    logged = {
        name: [(m.step, m.value) for m in client.get_metric_history(run_id, name)] for name in names
    }
    assert {name: sorted(points) for name, points in logged.items()} == expected

    best = RunDir(tracked_run).status().best
    mlflow_run = client.get_run(run_id)
    assert mlflow_run.data.tags["best_checkpoint"] == best["checkpoint"]
    assert mlflow_run.info.status == "FINISHED" and mlflow_run.data.params["seed"] == "0"
    summaries = [r.summary for r in wandb_records(tracked_run) if r.HasField("summary")]
    wandb_best = {key(u): json.loads(u.value_json) for s in summaries for u in s.update}
    assert wandb_best["best_checkpoint"] == best["checkpoint"]
    assert wandb_best["best_step"] == best["step"]


def test_no_secret_reaches_a_tracker(tracked_run: Path) -> None:
    """Neither the environment's secret (HF_TOKEN) nor anything else with it is written."""
    leaked = [
        p
        for p in tracked_run.parent.rglob("*")
        if p.is_file() and SENTINEL.encode() in p.read_bytes()
    ]
    assert leaked == []


def test_the_config_is_redacted_before_a_tracker_sees_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from mlflow.tracking import MlflowClient

    for key, value in tracker_env(tmp_path).items():
        monkeypatch.setenv(key, value)
    config = {"seed": 0, "hub": {"token": SENTINEL}, "deploy": {"api_key": SENTINEL}}
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    sent = trackers.build(
        ["tensorboard", "wandb", "mlflow"], run_dir=run_dir, config=config, project="redaction"
    )
    sent.metrics("train", {"loss": 1.5}, 1)
    sent.close("completed")
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert files and not [p for p in files if SENTINEL.encode() in p.read_bytes()]
    run_id = json.loads((run_dir / trackers.TRACKERS_FILE).read_text())["mlflow_run_id"]
    params = MlflowClient().get_run(run_id).data.params
    assert params["hub.token"] == REDACTED and params["deploy.api_key"] == REDACTED


def test_a_missing_tracker_package_is_a_user_error_before_anything_is_written(
    runner_cli, tmp_path: Path
) -> None:
    # Python's own way to make a package unimportable: a None in sys.modules, set at start-up.
    hide = tmp_path / "hide"
    hide.mkdir()
    (hide / "sitecustomize.py").write_text("import sys\nsys.modules['mlflow'] = None\n")
    out = tmp_path / "out"
    result = runner_cli(
        "train",
        "runtime.loggers=[mlflow]",
        f"runtime.output_root={out}",
        env={"PYTHONPATH": str(hide)},
    )
    assert result.returncode == 2, result.stderr[-3000:]
    assert "runtime.loggers=['mlflow']" in result.stderr
    assert "pip install 'runner[mlflow]'" in result.stderr and "Traceback" not in result.stderr
    assert not [p for p in out.rglob("*") if p.is_file()]  # Hydra's empty date folder at most
    result = runner_cli("validate", "runtime.loggers=[wandb,wandb]")
    assert result.returncode == 2 and "listed twice" in result.stderr


@pytest.mark.parametrize(
    ("env", "refused"),
    [
        # MLflow 3 refuses a file store (a file: URI, a plain path) when the tracker starts.
        ({"MLFLOW_TRACKING_URI": "file:///shared/mlruns"}, "runtime.loggers"),
        ({"MLFLOW_TRACKING_URI": "/shared/mlruns"}, "runtime.loggers"),
        (
            {"MLFLOW_TRACKING_URI": "/x", "MLFLOW_ALLOW_FILE_STORE": "maybe"},
            "MLFLOW_ALLOW_FILE_STORE",
        ),
        ({"MLFLOW_TRACKING_URI": "file:///shared/mlruns", "MLFLOW_ALLOW_FILE_STORE": "True"}, None),
        ({"MLFLOW_TRACKING_URI": "/shared/mlruns", "MLFLOW_ALLOW_FILE_STORE": "1"}, None),
        ({"MLFLOW_TRACKING_URI": "sqlite:///mlflow.db"}, None),
    ],
)
def test_an_mlflow_file_store_without_its_opt_in_is_refused_up_front(
    env: dict[str, str], refused: str | None
) -> None:
    from runner.config.loggers import check_loggers
    from runner.errors import UserError

    if refused is None:
        check_loggers(["jsonl", "mlflow"], env=env)
        return
    with pytest.raises(UserError) as err:
        check_loggers(["jsonl", "mlflow"], env=env)
    assert err.value.key == refused
    if refused == "runtime.loggers":
        assert env["MLFLOW_TRACKING_URI"] in err.value.fix
        assert "MLFLOW_ALLOW_FILE_STORE=true" in err.value.fix and "sqlite:///" in err.value.fix


def test_runtime_env_reaches_the_mlflow_check(monkeypatch: pytest.MonkeyPatch) -> None:
    """runtime.env is the training processes' environment: its opt-in counts."""
    from omegaconf import OmegaConf

    from runner.config.runtime import Runtime, resolve_runtime
    from runner.errors import UserError

    monkeypatch.setenv("MLFLOW_TRACKING_URI", "file:///shared/mlruns")
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    runtime = OmegaConf.merge(OmegaConf.structured(Runtime(cache_dir="c")), {"loggers": ["mlflow"]})
    with pytest.raises(UserError):
        resolve_runtime(runtime)
    runtime.env = {"MLFLOW_ALLOW_FILE_STORE": "true"}
    assert resolve_runtime(runtime).loggers == ["mlflow"]


def test_runtime_tensorboard_is_refused_with_its_replacement(runner_cli) -> None:
    result = runner_cli("validate", "runtime.tensorboard=false")
    assert result.returncode == 2
    # The value as typed: YAML's false, not Python's False.
    assert result.stderr.startswith(
        "error: runtime.tensorboard=false: replaced by runtime.loggers: write runtime.loggers=[]"
    ), result.stderr


def test_wandb_with_no_api_key_is_refused_up_front(tmp_path, monkeypatch) -> None:
    """wandb.init failed in the training process, after the run directory was written, with a
    traceback of some 40 lines ("No API key configured"). Offline, or logged in (wandb login's
    ~/.netrc), it starts."""
    import wandb

    from runner.config.loggers import check_loggers
    from runner.errors import UserError

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    for name in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_CONFIG_DIR", "WANDB_DIR", "NETRC"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(UserError) as err:
        check_loggers(["jsonl", "wandb"], env=dict(os.environ))
    assert err.value.key == "runtime.loggers"
    assert "W&B has no API key for" in err.value.fix and "WANDB_MODE=offline" in err.value.fix
    check_loggers(["wandb"], env={**os.environ, "WANDB_MODE": "offline"})
    host = urlsplit(wandb.Settings().base_url).hostname
    (tmp_path / ".netrc").write_text(f"machine {host}\n  login user\n  password {'k' * 40}\n")
    (tmp_path / ".netrc").chmod(0o600)
    check_loggers(["wandb"], env=dict(os.environ))


def test_an_mlflow_server_out_of_reach_or_no_mlflow_is_refused_up_front() -> None:
    """MLflow's client retried a server that was down for about four minutes, in the training
    process, then failed with a traceback of 166 lines that showed the URI's password; a server
    that answers as no MLflow does (a wrong port, a proxy's path left out) failed there in some
    90 lines. The answers are a stand-in's: mlflow-skinny has no server. Its answers as
    MLflow's (JSON, an error included), and those that ask for credentials, pass."""
    from runner.config.loggers import check_loggers
    from runner.errors import UserError

    class Answers(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            if self.path.startswith("/mlflow/api/2.0/mlflow/experiments/get-by-name?"):
                self.answer(404, b'{"error_code": "RESOURCE_DOES_NOT_EXIST", "message": "no"}')
            elif self.path.startswith("/locked/"):
                self.answer(401, b"<html>log in</html>")
            elif self.path.startswith("/sso/"):  # a proxy that sends strangers to its login
                self.send_response(302)
                self.send_header("Location", "/login")
                self.send_header("Content-Length", "0")
                self.end_headers()
            else:
                self.answer(404, b"<html>Not Found</html>")

        def answer(self, status: int, body: bytes) -> None:
            self.send_response(status)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Answers)
    port = server.server_address[1]
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        for path in ("/mlflow", "/mlflow/", "/locked", "/sso"):
            check_loggers(["mlflow"], env={"MLFLOW_TRACKING_URI": f"http://127.0.0.1:{port}{path}"})
        for uri in (f"http://127.0.0.1:{port}", f"http://me:Pa55@127.0.0.1:{port}/other"):
            with pytest.raises(UserError) as err:
                check_loggers(["mlflow"], env={"MLFLOW_TRACKING_URI": uri})
            assert err.value.key == "runtime.loggers"
            assert "is no MLflow tracking server: /api/2.0/mlflow/experiments/get-by-name " in (
                err.value.fix
            )
            assert "answered HTTP 404 without MLflow's JSON" in err.value.fix
            assert "Pa55" not in str(err.value)
    finally:
        server.shutdown()
        server.server_close()
    with pytest.raises(UserError) as err:  # closed now
        check_loggers(["mlflow"], env={"MLFLOW_TRACKING_URI": f"http://me:Pa55@127.0.0.1:{port}"})
    assert f"http://me:<hidden>@127.0.0.1:{port} is out of reach" in err.value.fix
    assert "Pa55" not in str(err.value)


@pytest.mark.parametrize(
    ("loggers", "project", "refused"),
    [
        (["wandb"], "a/b", "W&B refuses a project name with any of"),
        (["wandb"], "x" * 129, "over 128 characters"),
        (["mlflow"], "", "give the trackers a project name"),
        (["wandb", "mlflow"], " ", "give the trackers a project name"),
        (["mlflow"], "a/b", None),  # an MLflow experiment may be named so
        (["tensorboard"], "", None),  # no tracker that reads it
    ],
)
def test_a_project_name_a_tracker_refuses_is_refused_up_front(
    loggers: list[str], project: str, refused: str | None
) -> None:
    """W&B raised its UsageError (80 lines) and MLflow its own on an empty name, each as the
    tracker started, after the run directory was written."""
    from runner.config.loggers import check_loggers
    from runner.errors import UserError

    env = {"MLFLOW_TRACKING_URI": "sqlite:///mlflow.db"}
    if refused is None:
        check_loggers(loggers, env=env, project=project)
        return
    with pytest.raises(UserError, match=refused) as err:
        check_loggers(loggers, env=env, project=project)
    assert err.value.key == "runtime.project"


def test_a_url_with_a_password_is_refused_under_any_key(runner_cli) -> None:
    """runtime.env's check read only the names of its keys: the URI and its password were
    written to recipe.yaml, manifest.json and .hydra/."""
    uri = "http://me:Pa55word@mlflow.example:5000"
    result = runner_cli("validate", f"+runtime.env.MLFLOW_TRACKING_URI={uri}")
    assert result.returncode == 2 and "Pa55word" not in result.stderr + result.stdout
    assert "runtime.env.MLFLOW_TRACKING_URI='<hidden>': holds a password in its URL" in (
        result.stderr
    )


def test_a_new_run_that_fails_before_its_first_step_is_kept_for_its_tracker_run(
    tracker_cli: tuple[ForkedCli, Path], tmp_path: Path
) -> None:
    """A stream's bad record met in its first window: the new run's directory was removed, as a
    refused run's is, while MLflow kept a failed run named after it (and W&B said to sync files
    that were gone)."""
    records = [json.dumps({"instruction": f"add {i}", "output": f"{i + 1}"}) for i in range(40)]
    data = tmp_path / "bad.jsonl"
    data.write_text("\n".join([*records[:20], "{not json", *records[20:]]) + "\n")
    run = tmp_path / "run"
    args = [*QUICK, "runtime.loggers=[mlflow]", "max_steps=4", "batch_size=4"]
    args += ["eval.strategy=no", "dataset.eval_samples=0", f"dataset.source={data}"]
    args += ["dataset.streaming=true", "dataset.shuffle_buffer=16", f"hydra.run.dir={run}"]
    cli, _ = tracker_cli
    result = cli(["train", *args], tmp_path, timeout_s=600)
    assert result.returncode == 2 and "not valid JSON" in result.stderr, result.stderr[-3000:]
    status = json.loads((run / "status.json").read_text())
    assert status["state"] == "failed" and status["step"] == 0
    assert (run / "trackers.json").is_file()  # the MLflow run's id, which names this directory
