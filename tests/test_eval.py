"""Evaluation during training: metrics on the validation split, and the best checkpoint.

Two short real runs through the CLI, alike but for evaluation, serve most tests: one evaluates
every 3 steps and keeps its best checkpoint by exact match, the other never evaluates.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from transformers import AutoModelForCausalLM, AutoTokenizer

from runner.config.resolve import resolve_recipe
from runner.deploy.selection import choose_checkpoint
from runner.errors import UserError
from runner.job.lifecycle import runs_table
from runner.job.sweep import summarize
from runner.paths import ASSETS_DIR, CONF_DIR
from runner.rundir import RunDir
from tests.cli_forks import Forked, ForkedCli
from tests.conftest import losses

STEPS = 12
EVAL_STEPS = 3
VALIDATION_SAMPLES = 24
JOB = [
    "compute=cpu",
    "dtype=fp32",
    "runtime.progress_bar=false",
    f"max_steps={STEPS}",
    "batch_size=8",
    "runtime.log_every_n_steps=1",
    "runtime.save_every_n_steps=4",
    "runtime.keep_last_n_checkpoints=1",
    f"eval.max_samples={VALIDATION_SAMPLES}",
    "dataset.eval_samples=4",
]
# Exact match stays flat this early, and a tie is no improvement: the best is an old step,
# older than the one checkpoint that retention keeps.
EVAL_ON = [
    "eval.strategy=steps",
    f"eval.steps={EVAL_STEPS}",
    "objective.metric=eval_exact_match",
    "objective.mode=max",
]
EVAL_OFF = ["eval.strategy=no"]
METRICS = ("eval_loss", "eval_perplexity", "eval_token_accuracy", "eval_exact_match")


def train(cli: ForkedCli, run_dir: Path, *overrides: str) -> Forked:
    """`runner train` forked from the suite's warm CLI server; it must succeed."""
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    argv = ["train", *overrides, f"hydra.run.dir={run_dir}"]
    proc = cli(argv, run_dir.parent, timeout_s=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, forked_cli: ForkedCli) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("eval_runs")
    proc = train(forked_cli, root / "on", *JOB, *EVAL_ON)
    (root / "on" / "stdout.txt").write_text(proc.stdout)
    train(forked_cli, root / "off", *JOB, *EVAL_OFF)
    return {"on": root / "on", "off": root / "off"}


def eval_lines(run_dir: Path) -> list[dict]:
    return [r for r in RunDir(run_dir).read_metrics() if "eval_loss" in r]


def test_each_eval_step_is_recorded_in_metrics_tensorboard_and_status(runs) -> None:
    lines = eval_lines(runs["on"])
    assert [r["step"] for r in lines] == list(range(EVAL_STEPS, STEPS + 1, EVAL_STEPS))
    for line in lines:
        assert set(line) == {"step", *METRICS}
        assert line["eval_perplexity"] == pytest.approx(math.exp(line["eval_loss"]), rel=1e-12)
        assert 0 <= line["eval_token_accuracy"] <= 1 and 0 <= line["eval_exact_match"] <= 1
    # The model learns: the held-out loss falls.
    assert lines[-1]["eval_loss"] < lines[0]["eval_loss"]
    status = json.loads((runs["on"] / "status.json").read_text())
    assert status["eval"] == lines[-1]
    (events,) = (runs["on"] / "tensorboard").glob("events.out.tfevents.*")
    board = EventAccumulator(str(events))
    board.Reload()
    for name in METRICS:
        scalars = board.Scalars(f"eval/{name.removeprefix('eval_')}")
        assert [s.step for s in scalars] == [r["step"] for r in lines]
        assert [s.value for s in scalars] == pytest.approx([r[name] for r in lines], rel=1e-6)
    assert not eval_lines(runs["off"]) and "eval" not in json.loads(
        (runs["off"] / "status.json").read_text()
    )


def test_training_losses_are_the_same_with_and_without_evaluation(runs) -> None:
    on, off = losses(runs["on"]), losses(runs["off"])
    assert sorted(on) == list(range(1, STEPS + 1))
    assert on == off  # exactly: evaluation leaves the model, data order and RNG untouched


def direct_metrics(checkpoint: Path) -> tuple[float, float]:
    """Loss and token accuracy of the answers of the validation split, computed with
    transformers alone from the saved checkpoint and the raw records."""
    model = AutoModelForCausalLM.from_pretrained(checkpoint).eval()
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    records = (ASSETS_DIR / "sample" / "validation.jsonl").read_text().splitlines()
    loss_sum, correct, count = 0.0, 0, 0
    for raw in records[:VALIDATION_SAMPLES]:
        record = json.loads(raw)
        user = (
            f"{record['instruction']}\n{record['input']}"
            if record["input"]
            else record["instruction"]
        )
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": user}],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
        answer = tokenizer.encode(record["output"], add_special_tokens=False)
        answer.append(tokenizer.eos_token_id)
        ids = torch.tensor([list(prompt) + answer])
        with torch.no_grad():
            logits = model(ids).logits[0, len(prompt) - 1 : -1]
        target = torch.tensor(answer)
        loss_sum += torch.nn.functional.cross_entropy(logits, target, reduction="sum").item()
        correct += int((logits.argmax(-1) == target).sum())
        count += len(answer)
    return loss_sum / count, correct / count


def test_eval_metrics_equal_a_direct_computation(runs) -> None:
    by_step = {r["step"]: r for r in eval_lines(runs["on"])}
    kept = RunDir(runs["on"]).checkpoints()
    assert len(kept) == 2
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny forwards: more threads only wait on each other
    try:
        for step, checkpoint in kept:
            loss, accuracy = direct_metrics(checkpoint)
            assert by_step[step]["eval_loss"] == pytest.approx(loss, abs=1e-4)
            assert by_step[step]["eval_token_accuracy"] == pytest.approx(accuracy, abs=1e-4)
    finally:
        torch.set_num_threads(threads)


def test_the_best_checkpoint_is_recorded_and_outlives_retention(runs) -> None:
    run = runs["on"]
    scores = {r["step"]: r["eval_exact_match"] for r in eval_lines(run)}
    best_step = next(step for step, value in scores.items() if value == max(scores.values()))
    assert best_step < STEPS  # an old step: retention alone would have deleted it
    checkpoint = run / "checkpoints" / f"step_{best_step}"
    best = json.loads((run / "status.json").read_text())["best"]
    assert best == {
        "metric": "eval_exact_match",
        "mode": "max",
        "step": best_step,
        "value": scores[best_step],
        "checkpoint": str(checkpoint),
    }
    # keep_last_n_checkpoints=1 keeps the newest, and the best besides it.
    assert [step for step, _ in RunDir(run).checkpoints()] == [best_step, STEPS]
    assert (checkpoint / "model.safetensors").is_file()
    stdout = (run / "stdout.txt").read_text()
    assert "held-out exact match:" in stdout
    assert f"best:          eval_exact_match={scores[best_step]:.4g} at step {best_step}" in stdout
    # Deploy, `runner runs` and sweeps read the recorded best.
    picked = choose_checkpoint(run, checkpoint="best", metric=None, mode=None)
    assert picked == checkpoint
    assert f"exact_match={scores[best_step]:.4g}@{best_step}" in runs_table([RunDir(run)], run)
    assert "eval_loss" not in json.dumps(RunDir(runs["off"]).read_status())
    with pytest.raises(UserError, match="recorded no best"):
        choose_checkpoint(runs["off"], checkpoint="best", metric=None, mode=None)


def test_a_sweep_ranks_runs_by_their_recorded_best(runs, tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    (sweep / "0").symlink_to(runs["on"])
    (sweep / "1").symlink_to(runs["off"])
    best = RunDir(runs["on"]).best()
    summary = summarize(sweep, "eval_exact_match", "max")
    assert summary["best"]["job"] == "0"
    assert summary["best"]["metric"] == best["value"]
    assert summary["best"]["metric_checkpoint"] == str(
        sweep / "0" / "checkpoints" / f"step_{best['step']}"
    )
    assert summary["runs"][1]["metric"] is None


def test_resume_keeps_the_best(runs, forked_cli: ForkedCli, tmp_path: Path) -> None:
    # The run as if it had died after its best checkpoint: only that one is left. The same
    # command on its directory continues from there.
    run = tmp_path / "resumed"
    shutil.copytree(runs["on"], run, symlinks=True)
    best = RunDir(run).best()
    shutil.rmtree(run / "checkpoints" / f"step_{STEPS}")
    proc = train(forked_cli, run, *JOB, *EVAL_ON)
    checkpoint = str(run / "checkpoints" / f"step_{best['step']}")
    assert f"resuming from {checkpoint} at step {best['step']}" in proc.stderr
    # A fresh best would be the first evaluation after the resume; the restored one is kept.
    assert RunDir(run).best() == {**best, "checkpoint": checkpoint}
    assert losses(run) == losses(runs["on"])
    assert eval_lines(run) == eval_lines(runs["on"])


def test_epoch_strategy_evaluates_at_each_epoch_end(forked_cli: ForkedCli, tmp_path: Path) -> None:
    # 32 records at batch 8: 4 steps an epoch.
    records = (ASSETS_DIR / "sample" / "train.jsonl").read_text().splitlines()[:32]
    data = tmp_path / "train.jsonl"
    data.write_text("\n".join(records) + "\n")
    run = tmp_path / "run"
    train(
        forked_cli,
        run,
        "runtime.progress_bar=false",
        "runtime.loggers=[]",
        f"dataset.source={data}",
        f"dataset.validation.source={ASSETS_DIR / 'sample' / 'validation.jsonl'}",
        "batch_size=8",
        "epochs=2",
        "max_steps=null",
        "eval.strategy=epoch",
        "eval.max_samples=8",
        "dataset.eval_samples=0",
    )
    lines = eval_lines(run)
    assert [r["step"] for r in lines] == [4, 8]
    assert "eval_exact_match" not in lines[0]  # dataset.eval_samples=0
    best = RunDir(run).best()
    scores = {r["step"]: r["eval_loss"] for r in lines}
    assert best["metric"] == "eval_loss" and best["value"] == min(scores.values())


def compose_train(overrides: list[str]):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose("train", overrides=overrides)


BAD = [
    # (overrides, key, text of the fix)
    (["eval.strategy=sometimes"], "eval.strategy", "choose one of: no, steps, epoch"),
    (["eval.steps=null"], "eval.steps", "eval.strategy=steps needs an interval"),
    (["eval.steps=0"], "eval.steps", "integer >= 1"),
    (["eval.metrics=[eval_loss,eval_bleu]"], "eval.metrics", "no such metric"),
    (["eval.metrics=[]"], "eval.metrics", "at least one metric"),
    (["eval.max_samples=0"], "eval.max_samples", "integer >= 1 or null"),
    (
        ["dataset.validation.source=null", "objective.metric=eval_loss"],
        "objective.metric",
        "no validation split",
    ),
    (["objective.metric=accuracy"], "objective.metric", "choose one of: loss, eval_loss"),
    (["objective.mode=max"], "objective.mode", "eval_loss is better lower"),
    (["eval.strategy=no", "objective.metric=eval_loss"], "objective.metric", "does not evaluate"),
    (
        ["eval.metrics=[eval_loss]", "objective.metric=eval_exact_match", "objective.mode=max"],
        "objective.metric",
        "add it to eval.metrics",
    ),
    (
        ["dataset.eval_samples=0", "objective.metric=eval_exact_match", "objective.mode=max"],
        "objective.metric",
        "dataset.eval_samples=0",
    ),
]


@pytest.mark.parametrize(("overrides", "key", "fix"), BAD, ids=[" ".join(b[0]) for b in BAD])
def test_bad_eval_keys_name_the_key_and_the_fix(overrides, key, fix, tmp_path: Path) -> None:
    with pytest.raises(UserError) as err:
        resolve_recipe(compose_train(overrides), tmp_path)
    assert err.value.key == key and fix in err.value.fix, str(err.value)


def test_the_objective_follows_whether_the_run_evaluates(tmp_path: Path) -> None:
    recipe = resolve_recipe(compose_train([]), tmp_path)
    assert recipe["eval"]["strategy"] == "steps"
    assert recipe["objective"] == {"metric": "eval_loss", "mode": "min"}
    recipe = resolve_recipe(
        compose_train(["eval.strategy=no", "dataset.validation.source=null"]), tmp_path
    )
    assert recipe["eval"]["strategy"] == "no"
    assert recipe["objective"] == {"metric": "loss", "mode": "min"}
    # No validation split: no evaluation (a warning says so), whatever eval.strategy says.
    recipe = resolve_recipe(compose_train(["dataset.validation.source=null"]), tmp_path)
    assert recipe["eval"]["strategy"] == "no"
    assert recipe["objective"] == {"metric": "loss", "mode": "min"}


def test_a_bad_eval_key_is_one_line_through_the_cli(runner_cli, tmp_path: Path) -> None:
    result = runner_cli("train", "eval.strategy=sometimes", f"runtime.output_root={tmp_path}/o")
    assert result.returncode == 2
    (line,) = [ln for ln in result.stderr.splitlines() if ln.startswith("error: ")]
    assert "eval.strategy='sometimes'" in line and "choose one of: no, steps, epoch" in line
    assert "Traceback" not in result.stderr
