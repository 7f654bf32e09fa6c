"""Experiment trackers (`runtime.loggers`): TensorBoard, Weights & Biases, MLflow.

metrics.jsonl is always written: it is the run directory's contract, which sweeps, `runner
runs` and runner.api read. `jsonl` is the name of that stream, so `runtime.loggers=[jsonl]` (or
`[]`) means "no tracker beside it". Every other tracker receives the same records: the recipe
(redacted by runner.rundir.manifest.redact, so no secret-looking value is sent), each training
metrics line (train/*), each evaluation (eval/*) and, at the end, the best checkpoint's path.

Rank 0 of a run talks to the trackers; the others build none. A run resumed from a checkpoint
logs to the same tracker run (wandb: an id derived from the run directory; MLflow: the run id
kept in the run directory's trackers.json), and logs the steps since its last checkpoint again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from runner.rundir import TRACKERS_FILE
from runner.rundir.manifest import dotted, redact

log = logging.getLogger(__name__)


class Tracker(Protocol):
    def metrics(self, kind: str, values: dict[str, float], step: int) -> None: ...

    def best_checkpoint(self, best: dict[str, Any]) -> None: ...

    def close(self, state: str) -> None: ...


class Trackers:
    """The run's trackers, each sent every record; an empty set does nothing.

    metrics(kind, values, step): kind is `train` or `eval`, values are named as in metrics.jsonl
    (loss, lr, tokens_per_s; eval_loss, ...). best_checkpoint(best) takes status.json's `best`.
    close(state) ends each tracker's run as the run ended (completed, cancelled, failed).
    """

    def __init__(self, trackers: list[Tracker]) -> None:
        self.trackers = trackers

    def metrics(self, kind: str, values: dict[str, float], step: int) -> None:
        for tracker in self.trackers:
            tracker.metrics(kind, values, step)

    def best_checkpoint(self, best: dict[str, Any]) -> None:
        for tracker in self.trackers:
            tracker.best_checkpoint(best)

    def close(self, state: str) -> None:
        for tracker in self.trackers:
            tracker.close(state)


def build(loggers: list[str], *, run_dir: Path, config: dict[str, Any], project: str) -> Trackers:
    """The trackers `loggers` names for the run in `run_dir`, each sent the redacted `config`;
    `loggers` were checked as the recipe was resolved (runner.config.runtime)."""
    config = redact(config)
    builders: dict[str, Callable[[Path, dict[str, Any], str], Tracker]] = {
        "tensorboard": TensorBoard,
        "wandb": Wandb,
        "mlflow": MLflow,
    }
    return Trackers(
        [builders[name](run_dir, config, project) for name in loggers if name in builders]
    )


class TensorBoard:
    """Event files in run_dir/tensorboard: train/* and eval/* scalars, the config as text."""

    def __init__(self, run_dir: Path, config: dict[str, Any], project: str) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"))
        self.writer.add_text("config", "```\n" + json.dumps(config, indent=2) + "\n```", 0)

    def metrics(self, kind: str, values: dict[str, float], step: int) -> None:
        for name, value in values.items():
            self.writer.add_scalar(f"{kind}/{name.removeprefix('eval_')}", value, step)

    def best_checkpoint(self, best: dict[str, Any]) -> None:
        self.writer.add_text("best_checkpoint", _best_text(best), best["step"])

    def close(self, state: str) -> None:
        self.writer.close()


class Wandb:
    """A wandb run named after the run directory (WANDB_MODE=offline: files only, no account)."""

    def __init__(self, run_dir: Path, config: dict[str, Any], project: str) -> None:
        import wandb

        # The same id for every attempt of this run directory: a resumed run continues it.
        run_id = hashlib.sha256(str(run_dir.resolve()).encode()).hexdigest()[:16]
        self.run = wandb.init(
            project=project,
            name=str(run_dir),
            id=run_id,
            resume="allow",
            dir=str(run_dir),
            config=config,
            # Neither the code, the environment nor the console output leaves this machine.
            save_code=False,
            settings=wandb.Settings(console="off", disable_git=True, x_disable_meta=True),
        )

    def metrics(self, kind: str, values: dict[str, float], step: int) -> None:
        self.run.log(values, step=step)

    def best_checkpoint(self, best: dict[str, Any]) -> None:
        self.run.summary.update({f"best_{key}": value for key, value in best.items()})

    def close(self, state: str) -> None:
        self.run.finish(exit_code=0 if state == "completed" else 1)


class MLflow:
    """An MLflow run in the experiment `project`, at MLflow's tracking URI (MLFLOW_TRACKING_URI;
    a local `file:` store needs only mlflow-skinny)."""

    def __init__(self, run_dir: Path, config: dict[str, Any], project: str) -> None:
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient()
        ids_file = run_dir / TRACKERS_FILE
        ids = json.loads(ids_file.read_text()) if ids_file.is_file() else {}
        run_id: str | None = ids.get("mlflow_run_id")
        if run_id is None:
            experiment = self.client.get_experiment_by_name(project)
            experiment_id = (
                experiment.experiment_id
                if experiment is not None
                else self.client.create_experiment(project)
            )
            run = self.client.create_run(experiment_id, run_name=str(run_dir))
            run_id = run.info.run_id
            ids_file.write_text(json.dumps({**ids, "mlflow_run_id": run_id}) + "\n")
            self.client.log_dict(run_id, config, "config.json")
            params = [Param(name, str(value)) for name, value in dotted(config).items()]
            for start in range(0, len(params), 100):  # MLflow takes 100 params a batch
                self.client.log_batch(run_id, params=params[start : start + 100])
        else:
            self.client.update_run(run_id, status="RUNNING")
        self.run_id: str = run_id

    def metrics(self, kind: str, values: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        stamp = int(time.time() * 1000)
        batch = [Metric(name, float(v), stamp, step) for name, v in values.items()]
        self.client.log_batch(self.run_id, metrics=batch)

    def best_checkpoint(self, best: dict[str, Any]) -> None:
        for key, value in best.items():
            self.client.set_tag(self.run_id, f"best_{key}", str(value))

    def close(self, state: str) -> None:
        ended = {"completed": "FINISHED", "cancelled": "KILLED"}.get(state, "FAILED")
        self.client.set_terminated(self.run_id, status=ended)


def _best_text(best: dict[str, Any]) -> str:
    return f"{best['checkpoint']} ({best['metric']}={best['value']:.6g} at step {best['step']})"
