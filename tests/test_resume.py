"""A run resumed from its checkpoint at step N gives the same per-step losses as a straight run."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from runner import api
from runner.errors import UserError
from runner.job.lifecycle import check_resumable
from runner.paths import CONF_DIR
from runner.rundir import RunDir
from tests.conftest import QUICK, ctrl_c_after_two_steps, losses

N = 6


def straight_then_resumed(runner_cli, tmp_path: Path, *extra: str, n: int = N) -> tuple[dict, dict]:
    """Losses of 2n steps straight, and of the same run cut at its step-n checkpoint, resumed."""
    straight = tmp_path / "straight"
    result = runner_cli(
        "train",
        *QUICK,
        *extra,
        f"max_steps={2 * n}",
        f"runtime.save_every_n_steps={n}",
        "runtime.log_every_n_steps=1",
        "dataset.eval_samples=0",
        "gradient_accumulation_steps=2",
        "batch_size=8",
        f"hydra.run.dir={straight}",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    # The same run killed right after its step-N checkpoint: drop what came later. A copy, whose
    # recipe.yaml names the run it was copied from: it trains where it lies, and records that.
    interrupted = tmp_path / "interrupted"
    shutil.copytree(straight, interrupted)
    shutil.rmtree(interrupted / "checkpoints" / f"step_{2 * n}")
    result = runner_cli("train", f"resume={interrupted}")
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"resuming from {interrupted / 'checkpoints' / f'step_{n}'}" in result.stderr
    assert f"run_dir: {interrupted}\n" in (interrupted / "recipe.yaml").read_text()
    return losses(straight), losses(interrupted)


@pytest.mark.long  # trained twice over
def test_resume_gives_bit_identical_losses(runner_cli, hermetic_env, tmp_path: Path) -> None:
    """One process; two resume the same way in test_precision (full-2proc) and test_stream."""
    straight, resumed = straight_then_resumed(runner_cli, tmp_path, "compute=cpu")
    assert sorted(resumed) == list(range(1, 2 * N + 1))
    assert resumed == straight  # exact float equality, step by step
    # The run's first loss (the summary's `train loss: FIRST -> LAST`) stays its first step's,
    # not the first step after the resume.
    first_loss = json.loads((tmp_path / "interrupted" / "status.json").read_text())["first_loss"]
    assert first_loss == resumed[1]
    # The final training state too, byte for byte: runner repro compares checkpoints by hash.
    final = Path("checkpoints") / f"step_{2 * N}" / "training_state.pt"
    assert (tmp_path / "interrupted" / final).read_bytes() == (
        tmp_path / "straight" / final
    ).read_bytes()
    # `torchrun ... -m runner.recipes.finetune RUN/recipe.yaml` (docs/nodes.md) of a copy, whose
    # run_dir names the run it came from, would train that one: one line names both.
    original, copy = tmp_path / "straight", tmp_path / "copy"
    shutil.copytree(original, copy)
    metrics = (original / "metrics.jsonl").read_text()
    result = subprocess.run(
        [sys.executable, "-m", "runner.recipes.finetune", str(copy / "recipe.yaml")],
        env=hermetic_env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert result.stderr.startswith(
        f"error: run_dir='{original}': {copy / 'recipe.yaml'} lies in the run directory {copy}, "
        f"copied or moved from {original}; `runner resume {copy}` goes on with the run where"
    ), result.stderr
    assert (original / "metrics.jsonl").read_text() == metrics


def test_resume_refuses_other_overrides(runner_cli, tmp_path: Path) -> None:
    result = runner_cli("train", f"resume={tmp_path}", "max_steps=5")
    assert result.returncode == 2
    assert "drop the other overrides ['max_steps=5']" in result.stderr


def test_resume_of_a_non_run_directory_is_a_user_error(runner_cli, tmp_path: Path) -> None:
    result = runner_cli("train", f"resume={tmp_path}")
    assert result.returncode == 2
    assert "not a run directory" in result.stderr


def test_resume_of_a_missing_or_foreign_dir_writes_nothing(runner_cli, tmp_path: Path) -> None:
    foreign, missing = tmp_path / "foreign", tmp_path / "missing"
    foreign.mkdir()
    for path in (foreign, missing):
        result = runner_cli("train", f"resume={path}", cwd=tmp_path)
        assert result.returncode == 2, result.stderr[-2000:]
        assert f"error: resume='{path}': not a run directory" in result.stderr
        assert "Traceback" not in result.stderr
    assert not missing.exists() and list(foreign.iterdir()) == []


def test_resuming_a_finished_run_trains_nothing_and_keeps_its_weights(
    runner_cli, tmp_path: Path
) -> None:
    """Completed, or killed after its final checkpoint but before it was marked completed."""
    run = tmp_path / "run"
    args = [*QUICK, "compute=cpu", "max_steps=4", "runtime.save_every_n_steps=2"]
    result = runner_cli("train", *args, "eval.strategy=no", f"hydra.run.dir={run}")
    assert result.returncode == 0, result.stderr[-3000:]
    final = run / "checkpoints" / "step_4" / "model.safetensors"
    weights, metrics = final.read_bytes(), (run / "metrics.jsonl").read_text()

    result = runner_cli("train", f"resume={run}")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "completed at step 4: nothing to train" in result.stdout
    # validate checks the recipe a resume goes on with, where it checked a fresh default.
    checked = runner_cli("validate", f"resume={run}")
    assert checked.returncode == 0 and "\nmax_steps: 4\n" in checked.stdout, checked.stderr
    missing = runner_cli("validate", f"resume={tmp_path / 'nothing'}")
    assert missing.returncode == 2 and "not a run directory" in missing.stderr

    status = json.loads((run / "status.json").read_text())
    (run / "status.json").write_text(json.dumps({**status, "state": "running"}))
    result = runner_cli("train", f"resume={run}")
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads((run / "status.json").read_text())["state"] == "completed"
    assert final.read_bytes() == weights
    assert (run / "metrics.jsonl").read_text() == metrics
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_2", "step_4"]

    # A recipe edited since the run started (its optimizer state would override the new lr,
    # recorded as trained) is refused by the keys that differ.
    (run / "status.json").write_text(json.dumps({**status, "state": "cancelled"}))
    recipe = (run / "recipe.yaml").read_text()
    assert "\n  lr: 0.001\n" in recipe
    (run / "recipe.yaml").write_text(recipe.replace("\n  lr: 0.001\n", "\n  lr: 0.005\n"))
    result = runner_cli("train", f"resume={run}")
    assert result.returncode == 2, result.stderr[-3000:]
    assert "optimizer.lr=0.005 (recorded: 0.001)" in result.stderr
    assert final.read_bytes() == weights
    # The Python API's resume says so as it is called (its process's refusal went unseen).
    with pytest.raises(UserError, match=r"edited since the run started \(optimizer.lr=0.005"):
        api.Run(run).resume()
    # One cut short (a copy stopped midway) read as edited, naming every key it lacked as
    # "=None": it is named so, by the keys it lacks.
    lines = recipe.splitlines(keepends=True)
    (run / "recipe.yaml").write_text("".join(lines[: len(lines) // 2]))
    with pytest.raises(UserError) as cut_short:
        check_resumable(RunDir(run))
    said = str(cut_short.value)
    assert f"{run / 'recipe.yaml'}: lacks " in said and "edited" not in said, said
    assert " of the keys the run started with (" in said and ": cut short (" in said, said
    # A value manifest.json redacted (an older runner redacted every key with "token" in its
    # name: eval_max_new_tokens) is no edit.
    (run / "recipe.yaml").write_text(recipe)
    manifest = json.loads((run / "manifest.json").read_text())
    manifest["config"]["dataset"]["eval_max_new_tokens"] = "<redacted>"
    (run / "manifest.json").write_text(json.dumps(manifest))
    check_resumable(RunDir(run))


def test_a_resume_after_a_kill_counts_the_killed_start_to_its_last_heartbeat(
    runner_cli, tmp_path: Path
) -> None:
    """status.json's earlier_s (the sweep summary's seconds) counted a start killed outright
    to the resume's own first write, which stamps a new heartbeat: an hour between the kill and
    the resume read as an hour trained."""
    run = tmp_path / "run"
    args = [*QUICK, "max_steps=1", "eval.strategy=no", f"hydra.run.dir={run}"]
    assert runner_cli("train", *args).returncode == 0
    # As a kill -9 of the launcher an hour ago leaves it: running, its last heartbeat 5 s
    # after its start, no end, no process.
    status = json.loads((run / "status.json").read_text())
    del status["ended_at"]
    status.update(
        state="running",
        started_at="2026-11-30T10:00:00+00:00",
        heartbeat_at="2026-11-30T10:00:05+00:00",
        updated_at="2026-11-30T10:00:05+00:00",
    )
    (run / "status.json").write_text(json.dumps(status))
    result = runner_cli("resume", str(run))
    assert result.returncode == 0, result.stderr[-3000:]
    again = RunDir(run).status()
    assert again.state == "completed" and again.earlier_s == 5.0
    assert again.started_at and again.started_at > "2026-11-30T10:00:05"


def written(run: Path) -> dict[Path, bytes]:
    """Every file of a run but its lock, which names the last process that took it."""
    return {p: p.read_bytes() for p in run.rglob("*") if p.is_file() and p.name != ".lock"}


def test_a_run_directory_is_trained_again_only_by_the_command_that_started_it(
    runner_cli, tmp_path: Path
) -> None:
    """The same line again (a requeue) goes on with the run; other overrides into its directory
    are refused by name before anything there is written, and resume= is the way on."""
    run = tmp_path / "run"
    args = [*QUICK, "compute=cpu", "max_steps=4", "runtime.save_every_n_steps=2"]
    result = runner_cli("train", *args, "eval.strategy=no", f"hydra.run.dir={run}")
    assert result.returncode == 0, result.stderr[-3000:]
    files = written(run)

    other = [*args, "eval.strategy=no", "optimizer.lr=5e-3", "max_steps=6", f"hydra.run.dir={run}"]
    result = runner_cli("train", *other)
    assert result.returncode == 2, result.stderr[-3000:]
    # Completed, it has nothing to resume: `runner resume`, named here, refused it in turn.
    changed = "max_steps=6 (recorded: max_steps=4), optimizer.lr=5e-3 (recorded: not given)"
    assert (
        f"error: hydra.run.dir='{run}': holds a run that other overrides started: {changed}; "
        f"it is completed: train on from it in a new run (runner train load_checkpoint.path="
        f"{run} hydra.run.dir=NEW ...), or give another hydra.run.dir"
    ) in result.stderr
    assert "Traceback" not in result.stderr
    assert written(run) == files
    completed = (run / "status.json").read_bytes()
    status = json.loads(completed)
    (run / "status.json").write_text(json.dumps({**status, "state": "cancelled"}))
    cancelled = written(run)
    result = runner_cli("train", *other)
    assert result.returncode == 2, result.stderr[-3000:]
    assert (
        f"error: hydra.run.dir='{run}': holds a run that other overrides started: {changed}; go "
        f"on with it by its own (runner resume {run}), on another layout if need be (compute, "
        "batch_size and gradient_accumulation_steps may change), or give another hydra.run.dir"
    ) in result.stderr  # the layout may change (docs/nodes.md; test_distributed resumes so)
    assert written(run) == cancelled
    (run / "status.json").write_bytes(completed)

    # Its manifest.json gone (a partial copy): the overrides that started it cannot be compared,
    # and were trained again by others, unsaid (the checkpoint's optimizer state training the
    # old lr under a record of the new). Refused, whatever is given, and runner resume named.
    copy = tmp_path / "copy"
    shutil.copytree(run, copy)
    (copy / "manifest.json").unlink()
    status = json.loads((copy / "status.json").read_text())
    (copy / "status.json").write_text(json.dumps({**status, "state": "failed"}))  # killed
    copied = written(copy)
    other = ["eval.strategy=no", "optimizer.lr=5e-3", "max_steps=6", f"hydra.run.dir={copy}"]
    result = runner_cli("train", *args, *other)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert (
        f"error: hydra.run.dir='{copy}': holds a run (checkpoints up to step_4) whose "
        "manifest.json, the record of the overrides that started it, is missing, so these "
        f"cannot be checked against them; go on with it by its recorded recipe (runner resume "
        f"{copy}), or give another hydra.run.dir"
    ) in result.stderr
    assert written(copy) == copied

    result = runner_cli("train", *args, "eval.strategy=no", f"hydra.run.dir={run}")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "completed at step 4: nothing to train" in result.stdout
    record = {
        p: files[p] for p in (run / "recipe.yaml", run / "manifest.json", run / "status.json")
    }
    assert {p: p.read_bytes() for p in record} == record  # trained nothing: rewrote nothing

    # Another layout goes on from a checkpoint only with the global batch it trained by.
    batch_size = yaml.safe_load((run / "recipe.yaml").read_text())["batch_size"]
    result = runner_cli(
        "train", *args, "eval.strategy=no", f"batch_size={batch_size // 2}", f"hydra.run.dir={run}"
    )
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert (
        f"error: batch_size={batch_size // 2}: {run} trained with a global batch of {batch_size} "
        f"samples a step (batch_size={batch_size} x gradient_accumulation_steps=1 x 1 "
        f"process(es)); this layout makes {batch_size // 2}, which would change the math of the "
        f"steps left: give batch_size={batch_size} on 1 process(es)"
    ) in result.stderr
    assert {p: p.read_bytes() for p in record} == record


class ConfiguredRun:
    """A run trained by a command that composes the user's own files (--config-dir: a base
    config and a model option), stopped after its step-2 checkpoint (a preemption, to be
    requeued by the same command)."""

    BASE = "defaults:\n  - train\n  - _self_\nmax_steps: 4\noptimizer:\n  lr: 1.0e-3\n"
    MODEL = (CONF_DIR / "model" / "tiny.yaml").read_text().replace("name: tiny", "name: mine")

    def __init__(self, runner_cli, tmp_path: Path) -> None:
        self.cli, self.path = runner_cli, tmp_path / "run"
        conf = tmp_path / "conf"
        self.base_file, self.model_file = conf / "mine.yaml", conf / "model" / "mine.yaml"
        self.model_file.parent.mkdir(parents=True)
        self.base_file.write_text(self.BASE)
        self.model_file.write_text(self.MODEL.replace("num_layers: 4", "num_layers: 2"))
        self.command = ["train", "--config-dir", str(conf), "--config-name", "mine", "model=mine"]
        self.command += [*QUICK, "runtime.save_every_n_steps=2", "eval.strategy=no"]
        self.command.append(f"hydra.run.dir={self.path}")
        result = runner_cli(*self.command)
        assert result.returncode == 0, result.stderr[-3000:]
        shutil.rmtree(self.path / "checkpoints" / "step_4")
        status = json.loads((self.path / "status.json").read_text())
        stopped = {**status, "state": "cancelled", "step": 2}
        (self.path / "status.json").write_text(json.dumps(stopped))

    def record(self) -> dict[Path, bytes]:
        """Its recipe, manifest, status, checkpoints and .hydra/ (the composition that started
        it); not train.log, which logs each attempt."""
        return {p: b for p, b in written(self.path).items() if p.name != "train.log"}

    def refused(self, changes: str) -> None:
        """The same command again is refused by the recipe keys that differ, writing nothing."""
        record = self.record()
        result = self.cli(*self.command)
        assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
        assert (
            f"error: hydra.run.dir='{self.path}': holds a run whose recipe these configs change "
            f"(a config file edited since it started?): {changes}; go on with it by its recorded "
            f"recipe (runner resume {self.path}), put the configs back, or give another "
            "hydra.run.dir"
        ) in result.stderr
        assert self.record() == record

    def goes_on(self, *command: str) -> None:
        """It goes on from its step-2 checkpoint and completes at step 4."""
        result = self.cli(*(command or self.command))
        assert result.returncode == 0, result.stderr[-3000:]
        assert f"resuming from {self.path / 'checkpoints' / 'step_2'}" in result.stderr
        assert "status:        completed at step 4" in result.stdout


def test_a_config_file_edited_under_a_run_is_refused_before_anything_is_written(
    runner_cli, tmp_path: Path
) -> None:
    """The same command again (a requeue) after a file of its --config-dir changed: the recipe
    resolved from it, not only the overrides, is held to the one the run recorded. A new lr
    and max_steps were taken unsaid, recipe.yaml and manifest.json rewritten to them, while the
    checkpoint's optimizer state trained on with the old lr (runner repro then re-ran every
    step at the new one, and drifted). Refused by the keys that differ, with the run's record,
    .hydra/ too, as it was; the file put back, the same command goes on."""
    run = ConfiguredRun(runner_cli, tmp_path)
    edited = run.BASE.replace("max_steps: 4", "max_steps: 6").replace("1.0e-3", "5.0e-3")
    run.base_file.write_text(edited)
    run.refused("max_steps=6 (recorded: 4), optimizer.lr=0.005 (recorded: 0.001)")
    run.base_file.write_text(run.BASE)
    run.goes_on()


def test_a_model_file_edited_under_a_run_is_refused_and_the_run_resumes_as_recorded(
    runner_cli, tmp_path: Path
) -> None:
    """The same command again after the user's model option got another shape: its weights
    load into no such model. It failed in a torch traceback after recipe.yaml had been rewritten
    to that model and status.json to failed at step 0, and runner resume read the new shape
    from then on. Refused in one line naming the key, the record as it was: runner resume goes
    on with the recorded model, the file left as edited."""
    run = ConfiguredRun(runner_cli, tmp_path)
    run.model_file.write_text(run.MODEL.replace("num_layers: 4", "num_layers: 3"))
    run.refused(
        "model.builder.num_layers=3 (recorded: 2), model.hf_config.num_hidden_layers=3 "
        "(recorded: 2)"
    )
    status = json.loads((run.path / "status.json").read_text())
    assert (status["state"], status["step"]) == ("cancelled", 2)
    run.goes_on("resume", str(run.path))


def test_ctrl_c_saves_a_checkpoint_and_exits_130(hermetic_env, tmp_path: Path) -> None:
    """Ctrl-C does what SIGTERM does: a checkpoint at the stop step, `cancelled`, no traceback."""
    run = tmp_path / "interrupted"
    args = [*QUICK, "compute=cpu", "max_steps=400", "runtime.save_every_n_steps=null"]
    err = ctrl_c_after_two_steps(
        ["train", *args, "runtime.log_every_n_steps=1", "eval.strategy=no", f"hydra.run.dir={run}"],
        hermetic_env,
        run / "metrics.jsonl",
    )
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    status = json.loads((run / "status.json").read_text())
    assert status["state"] == "cancelled" and "SIGINT" in status["error"], status
    checkpoint = run / "checkpoints" / f"step_{status['step']}"
    assert (checkpoint / "model.safetensors").is_file() and 2 <= status["step"] < 400


def test_resume_after_a_kill_at_an_odd_moment(runner_cli, tmp_path: Path) -> None:
    """Killed before status.json was written, mid-save (.tmp-) or mid-prune (.deleting-), or
    restarted after checkpoints/ was deleted: resume works, cleans up, logs each step once."""
    run = tmp_path / "run"
    args = [*QUICK, "compute=cpu", "max_steps=4", "runtime.save_every_n_steps=2"]
    args += ["runtime.log_every_n_steps=1", "eval.strategy=no", f"hydra.run.dir={run}"]
    result = runner_cli("train", *args)
    assert result.returncode == 0, result.stderr[-3000:]
    shutil.rmtree(run / "checkpoints" / "step_4")
    (run / "status.json").unlink()
    for leftover in (".tmp-step_3", ".deleting-step_1"):
        (run / "checkpoints" / leftover).mkdir()
    result = runner_cli("train", f"resume={run}")
    assert result.returncode == 0, result.stderr[-3000:]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_2", "step_4"]
    assert json.loads((run / "status.json").read_text())["state"] == "completed"
    assert "no checkpoint to go on from" not in (run / "train.log").read_text()

    shutil.rmtree(run / "checkpoints")
    (run / "status.json").write_text(json.dumps({"state": "failed"}))
    result = runner_cli("train", f"resume={run}")
    assert result.returncode == 0, result.stderr[-3000:]
    # Said where the user reads, not only done: the steps trained before are trained again.
    said = "no checkpoint to go on from (the run had logged step 4, and saved none or its "
    assert said in result.stdout + result.stderr and said in (run / "train.log").read_text()
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4]


def test_runs_of_a_missing_directory_is_a_user_error(runner_cli, tmp_path: Path) -> None:
    result = runner_cli("runs", str(tmp_path / "nowhere"))
    assert result.returncode == 2
    assert "error: DIR=" in result.stderr and "no such directory" in result.stderr
