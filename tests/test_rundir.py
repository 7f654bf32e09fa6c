"""The run directory contract as its readers see it: status, metrics, checkpoints, best run."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import save_file

from runner.deploy.selection import choose_checkpoint
from runner.errors import UserError
from runner.job.sweep import exit_code, summarize, write_summary
from runner.rundir import (
    MODEL_FILE,
    STATUS_VERSION,
    TRAINING_STATE_FILE,
    RunDir,
    Status,
    best_run,
    sweep_runs,
)
from tests.conftest import sweep_lock_held

SELECT = {"checkpoint": "latest", "metric": "eval_loss", "mode": "min"}


def fake_run(run_dir: Path, *, state: str, steps: list[int], metrics: list[dict]) -> RunDir:
    run = RunDir(run_dir)
    for step in steps:
        run.checkpoint_path(step).mkdir(parents=True)
        (run.checkpoint_path(step) / "config.json").write_text("{}")
        save_file({"w": torch.zeros(1)}, run.checkpoint_path(step) / "model.safetensors")
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "status.json").write_text(json.dumps({"state": state, "step": max(steps or [0])}))
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    return run


def test_a_written_status_round_trips_with_its_version(tmp_path: Path) -> None:
    run = RunDir(tmp_path)
    run.write_status("created", step=0, total_steps=8)
    run.write_status("initializing")
    best = {"metric": "eval_loss", "mode": "min", "step": 4, "value": 0.5, "checkpoint": "c"}
    written = run.write_status("running", step=4, loss=1.25, eval={"step": 4}, best=best)
    on_disk = json.loads((tmp_path / "status.json").read_text())
    assert on_disk["version"] == STATUS_VERSION and "error" not in on_disk
    assert run.status() == written and run.read_status() == on_disk
    assert (written.state, written.step, written.total_steps) == ("running", 4, 8)
    assert written.best == best
    assert written.created_at and written.started_at and written.ended_at is None
    with pytest.raises(TypeError):
        run.write_status("running", stepp=5)  # a misspelled field is an error, not a new key


def test_a_run_started_again_counts_the_seconds_of_each_start(tmp_path: Path) -> None:
    """A sweep's seconds column read a resumed job's last start alone (its started_at is
    reset): 10 minutes trained, stopped, then 2 resumed read as 2. A start killed outright
    counts to its last heartbeat; the hours between a stop and a resume do not count."""
    stopped = {
        "state": "cancelled",
        "step": 40,
        "started_at": "2026-11-30T10:00:00+00:00",
        "ended_at": "2026-11-30T10:10:00+00:00",
    }
    (tmp_path / "status.json").write_text(json.dumps(stopped))
    run = RunDir(tmp_path)
    assert run.status().seconds() == 600.0
    run.write_status("initializing")
    assert run.status().earlier_s == 600.0 and run.status().seconds() is None
    assert 600.0 <= run.write_status("completed", step=80).seconds() < 660.0
    killed = {
        "state": "running",
        "started_at": "2026-11-30T10:00:00+00:00",
        "heartbeat_at": "2026-11-30T10:05:00+00:00",
        "earlier_s": 60.0,
    }
    (tmp_path / "status.json").write_text(json.dumps(killed))
    assert run.write_status("initializing").earlier_s == 360.0


@pytest.mark.parametrize(
    "text",
    ["", '{"state": "running", "st', "[1, 2]", "null"],
    ids=["empty", "half-written", "not-an-object", "null"],
)
def test_an_unreadable_status_reads_as_unknown(tmp_path: Path, text: str) -> None:
    (tmp_path / "status.json").write_text(text)
    assert RunDir(tmp_path).status() == Status()
    assert RunDir(tmp_path / "missing").status().state == "unknown"


def test_an_older_status_file_reads_what_it_has(tmp_path: Path) -> None:
    older = {"state": "completed", "step": 3, "pid": "12", "best": {"metric": "loss"}, "x": 1}
    (tmp_path / "status.json").write_text(json.dumps(older))
    status = RunDir(tmp_path).status()
    assert (status.state, status.step, status.version) == ("completed", 3, 0)
    assert status.pid is None and status.best is None  # wrong types read as unset


def test_a_state_or_time_no_runner_writes_reads_as_unset(tmp_path: Path) -> None:
    """A state another version or a hand wrote (`paused`) read as a live run, and `runner stop`
    signalled whatever process had its pid; a time that does not parse, or has no zone, made
    `runner runs` a traceback for the whole root."""
    odd = {"state": "paused", "updated_at": "yesterday", "created_at": "2026-11-30T10:00:00"}
    (tmp_path / "status.json").write_text(json.dumps({**odd, "step": 3, "pid": 1}))
    status = RunDir(tmp_path).status()
    assert (status.state, status.updated_at, status.created_at) == ("unknown", None, None)
    assert (status.step, status.pid) == (3, 1)


def test_records_read_from_the_end_are_the_files_records_last_first(tmp_path: Path) -> None:
    """Across blocks of the file, a line cut short at its end, and one not a record."""
    lines = [
        json.dumps({"step": s, "loss": s / 7, "pad": "x" * (s * 37 % 900)}) for s in range(1, 3000)
    ]
    lines.insert(5, "not json")
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + '\n{"step": 3000, "lo')
    run = RunDir(tmp_path)
    assert list(run.records_from_end()) == run.read_metrics()[::-1]
    assert len(run.read_metrics()) == 2999 and (tmp_path / "metrics.jsonl").stat().st_size > 1 << 17


def test_runs_lists_every_run_beside_one_with_odd_values(tmp_path: Path) -> None:
    """One run's `"loss": null`, `"loss": "nan"`, a reward in words or a time in the future made
    `runner runs` a traceback, listing none of the good runs beside it; it read each run's
    whole metrics.jsonl twice (22 s for 900 runs of 30,000 steps)."""
    from runner.job.lifecycle import find_runs, runs_table

    good = fake_run(
        tmp_path / "good", state="completed", steps=[2], metrics=[{"step": 2, "loss": 1.5}]
    )
    odd = {"null": {"loss": None}, "text": {"loss": "nan"}, "words": {"rewards_accuracy": "high"}}
    for name, record in odd.items():
        fake_run(tmp_path / name, state="completed", steps=[], metrics=[{"step": 1, **record}])
    later = json.loads((good.path / "status.json").read_text())
    (tmp_path / "future" / "status.json").parent.mkdir()
    (tmp_path / "future" / "status.json").write_text(
        json.dumps({**later, "updated_at": "2999-01-01T00:00:00+00:00"})
    )
    table = runs_table(find_runs([tmp_path]), tmp_path).splitlines()
    rows = {line.split()[0]: line.split()[1:] for line in table[1:]}
    assert sorted(rows) == ["future", "good", "null", "text", "words"]
    assert rows["good"][2] == "1.5000" and rows["null"][2] == rows["words"][4] == "-"
    assert rows["future"][-1] == "0s"


def test_a_run_removed_while_runs_lists_is_passed_over(tmp_path: Path) -> None:
    from runner.job.lifecycle import find_runs, runs_table

    runs = [fake_run(tmp_path / str(i), state="completed", steps=[], metrics=[]) for i in range(3)]
    shutil.rmtree(runs[1].path)
    listed = [line.split()[0] for line in runs_table(runs, tmp_path).splitlines()[1:]]
    assert listed == ["0", "2"] and len(find_runs([tmp_path])) == 2


def test_runs_are_listed_newest_first_by_their_status_not_their_directory(tmp_path) -> None:
    """An export into an old run's directory (RUN/exports/) listed it first, above runs its
    own age column showed newer."""
    from runner.job.lifecycle import find_runs

    old, new = (fake_run(tmp_path / n, state="completed", steps=[], metrics=[]) for n in "ab")
    os.utime(old.path / "status.json", (1e9, 1e9))  # written in 2001
    os.utime(new.path / "status.json", (1.1e9, 1.1e9))  # and in 2004
    os.utime(new.path, (9e8, 9e8))  # its directory untouched since 1998
    (old.path / "exports").mkdir()  # the old one's directory's time is now
    assert [run.path.name for run in find_runs([tmp_path])] == ["b", "a"]


def test_a_half_written_metrics_line_is_skipped(tmp_path: Path) -> None:
    run = fake_run(tmp_path, state="running", steps=[], metrics=[{"step": 1, "loss": 2.0}])
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('{"step": 2, "lo')
    assert run.read_metrics() == [{"step": 1, "loss": 2.0}]
    assert run.losses() == {1: 2.0}


def test_the_sweep_summary_and_deploy_pick_the_same_run(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    nan = float("nan")
    jobs = {
        "0": ("completed", [10], 0.9),
        "1": ("completed", [10], 0.4),
        "2": ("failed", [10], 0.1),  # failed: never the best
        "3": ("completed", [], 0.05),  # no whole checkpoint: never the best
        "4": ("completed", [10], nan),  # diverged: NaN never wins
        "10": ("completed", [10], 0.4),  # ties with job 1, which comes first
    }
    for job, (state, steps, value) in jobs.items():
        metrics = [{"step": 5, "eval_loss": 0.01}, {"step": 10, "eval_loss": value}]
        fake_run(sweep / job, state=state, steps=steps, metrics=metrics)
    assert [run.path.name for run in sweep_runs(sweep)] == ["0", "1", "2", "3", "4", "10"]
    best = best_run(sweep_runs(sweep), "eval_loss", "min")
    assert best is not None and best.path.name == "1"
    assert summarize(sweep, "eval_loss", "min")["best"]["job"] == "1"
    (sweep / "multirun.yaml").write_text("{}")  # what Hydra's sweeper writes as it starts
    chosen = choose_checkpoint(sweep, **SELECT)
    assert chosen == sweep / "1" / "checkpoints" / "step_10"


def test_a_sweep_exits_with_its_failed_job_count_from_disk(tmp_path: Path) -> None:
    for job, state in (("0", "failed"), ("1", "completed"), ("2", "failed")):
        fake_run(tmp_path / job, state=state, steps=[1], metrics=[{"step": 1, "loss": 1.0}])
    write_summary(tmp_path, "loss", "min")
    assert exit_code(tmp_path) == 2


def test_selection_imports_no_training_stack() -> None:
    code = "import sys, runner.deploy.selection; print(sorted(sys.modules))"
    modules = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    for heavy in ("'torchtune'", "'datasets'", "'pyarrow'"):
        assert heavy not in modules


def whole_checkpoint(run: RunDir, step: int) -> Path:
    """A checkpoint's weights and training state, written as the recipes write them."""
    path = run.checkpoint_path(step)
    path.mkdir(parents=True)
    (path / "config.json").write_text("{}")
    save_file({"w": torch.full((64,), float(step))}, str(path / MODEL_FILE))
    torch.save({"step": step}, path / TRAINING_STATE_FILE)
    return path


def cut_short(path: Path) -> None:
    os.truncate(path, path.stat().st_size // 2)


def test_the_latest_checkpoint_is_the_newest_whole_one(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    run = RunDir(tmp_path)
    for step in (2, 4, 6, 8):
        whole_checkpoint(run, step)
    cut_short(run.checkpoint_path(8) / MODEL_FILE)
    cut_short(run.checkpoint_path(6) / TRAINING_STATE_FILE)
    with caplog.at_level(logging.WARNING, logger="runner.rundir"):
        assert run.latest_checkpoint() == run.checkpoint_path(4)
    checkpoints = tmp_path / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == [
        ".damaged-step_6",
        ".damaged-step_8",
        "step_2",
        "step_4",
    ]
    assert [step for step, _ in run.checkpoints()] == [2, 4]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2
    assert f"{checkpoints / 'step_8' / MODEL_FILE} is cut short: tensor 'w' ends" in warnings[0]
    assert f"{checkpoints / 'step_6' / TRAINING_STATE_FILE} is cut short" in warnings[1]
    # Saved again and damaged again: the first damaged copy is kept beside the second.
    whole_checkpoint(run, 8)
    (run.checkpoint_path(8) / MODEL_FILE).write_bytes(b"")
    assert run.latest_checkpoint() == run.checkpoint_path(4)
    assert (checkpoints / ".damaged-step_8-2").is_dir()
    # A checkpoint's kind says which files it holds; one it lacks is not looked for.
    (run.checkpoint_path(4) / TRAINING_STATE_FILE).unlink()
    assert run.latest_checkpoint() == run.checkpoint_path(4)
    # Pruning after the next save counts whole checkpoints only.
    tmp = run.fresh_checkpoint_tmp(10)
    tmp.mkdir()
    run.commit_checkpoint(tmp, 10)
    run.prune_checkpoints(keep_last=2)
    assert [step for step, _ in run.checkpoints()] == [4, 10]


def test_a_checkpoint_linked_in_from_other_storage_is_pruned_by_its_link(tmp_path: Path) -> None:
    """Old checkpoints moved to a cheaper disk and linked back: pruning one removes the link and
    leaves where it leads (rmtree refused the link: the run failed at its next save, and every
    resume after it failed on the `.deleting-step_2` link left behind)."""
    run = RunDir(tmp_path / "run")
    cold = tmp_path / "cold"
    cold.mkdir()
    for step in (2, 4):
        whole_checkpoint(run, step)
        run.checkpoint_path(step).rename(cold / f"step_{step}")
        run.checkpoint_path(step).symlink_to(cold / f"step_{step}")
    whole_checkpoint(run, 6)
    run.prune_checkpoints(keep_last=2)
    assert [step for step, _ in run.checkpoints()] == [4, 6]
    assert (cold / "step_2" / MODEL_FILE).is_file()
    # A prune killed between its rename and its delete leaves a `.deleting-` link.
    (run.checkpoints_dir / ".deleting-step_4").symlink_to(cold / "step_4")
    assert run.remove_leftovers() == [run.checkpoints_dir / ".deleting-step_4"]
    assert not (run.checkpoints_dir / ".deleting-step_4").is_symlink()
    assert (cold / "step_4" / MODEL_FILE).is_file()


def test_a_checkpoint_with_a_config_cut_short_or_no_files_is_damaged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A config.json cut short (resume and export ended in JSONDecodeError tracebacks, deploy
    blamed remote code) and a step dir with nothing in it (a copy stopped before its files:
    resume ended in a FileNotFoundError traceback, deploy and export blamed .bin files) are set
    aside, as cut-short weights are, and the run goes on from the one before. A run's own
    resume from a checkpoint whose training state is gone is refused by name; a loaded run's
    damaged checkpoint, not ours to set aside, is named as it is skipped."""
    from runner.config.load_checkpoint import latest_whole_checkpoint
    from runner.models.checkpoint import read_training_state

    run = RunDir(tmp_path / "run")
    for step in (2, 4, 6):
        whole_checkpoint(run, step)
    (run.checkpoint_path(6) / "config.json").write_text('{"model_type": "lla')
    shutil.rmtree(run.checkpoint_path(4))
    run.checkpoint_path(4).mkdir()
    with caplog.at_level(logging.WARNING):
        assert latest_whole_checkpoint(run.path) == (2, run.checkpoint_path(2))
    skipped = [r.getMessage() for r in caplog.records]
    assert f"checkpoint {run.checkpoint_path(6)} is damaged, skipped: " in skipped[0]
    assert "config.json is cut short or not JSON" in skipped[0]
    assert f"{run.checkpoint_path(4)} holds no weights (no *.safetensors)" in skipped[1]
    assert run.latest_checkpoint() == run.checkpoint_path(2)
    aside = sorted(p.name for p in run.checkpoints_dir.iterdir())
    assert aside == [".damaged-step_4", ".damaged-step_6", "step_2"]
    (run.checkpoint_path(2) / TRAINING_STATE_FILE).unlink()
    with pytest.raises(UserError, match="has no training_state.pt") as refused:
        read_training_state(run.checkpoint_path(2))
    assert f"runner train load_checkpoint.path={run.checkpoint_path(2)}" in str(refused.value)


def test_a_new_best_is_recorded_before_the_old_best_is_pruned(tmp_path: Path) -> None:
    """status.json's best names a checkpoint on disk at every moment of a save: it was written
    after the prune, so a run killed between the two (its hashing of the new checkpoint, a
    minute at 7B) recorded a best that was gone."""
    from runner.trainer import checkpointing

    run = RunDir(tmp_path / "run")
    whole_checkpoint(run, 2)
    on_disk_when_saved = []

    def write(out_dir: Path) -> None:
        shutil.copytree(run.checkpoint_path(2), out_dir)

    def saved() -> None:
        on_disk_when_saved.extend(step for step, _ in run.checkpoints())

    checkpointing.commit(run, 4, write, keep_last_n=1, keep_step=4, evaluates=True, saved=saved)
    assert on_disk_when_saved == [2, 4]  # the old best (2) and the new one (4)
    assert [step for step, _ in run.checkpoints()] == [4]


@pytest.mark.parametrize(
    "key", ["hf_token", "HF_TOKEN", "token", "GITHUB_TOKEN", "api_key", "WANDB_API_KEY", "secret"]
)
def test_a_credential_is_redacted_from_the_manifest(key: str) -> None:
    from runner.rundir.manifest import REDACTED, redact

    assert redact({"runtime": {key: "s3cr3t"}}) == {"runtime": {key: REDACTED}}


@pytest.mark.parametrize(
    "key", ["eval_max_new_tokens", "eos_token_id", "bos_token", "TOKENIZERS_PARALLELISM"]
)
def test_a_count_or_special_token_is_kept_in_the_manifest_and_its_hash(key: str) -> None:
    """A key with 'token' in its name that holds no credential: its value is the run's, and
    two runs that differ in it hash apart (they hashed alike when every 'token' was hidden)."""
    from runner.rundir.manifest import config_hash, redact

    assert redact({"dataset": {key: 12}}) == {"dataset": {key: 12}}
    assert config_hash({"dataset": {key: 12}}) != config_hash({"dataset": {key: 99}})


def _write_status_often(path: str) -> None:
    from runner.rundir.io import write_json_atomic

    for i in range(300):
        write_json_atomic(Path(path), {"state": "running", "write": i})


def test_two_processes_write_one_status_file_without_taking_each_others(tmp_path: Path) -> None:
    """The nodes of a run write one status.json on shared storage at the same moments (a
    disagreement found at the rendezvous): under one temporary name, one's rename took the
    other's file (FileNotFoundError, a traceback where the one-line message belonged)."""
    import multiprocessing

    status = tmp_path / "status.json"
    context = multiprocessing.get_context("fork")
    writers = [context.Process(target=_write_status_often, args=(str(status),)) for _ in range(2)]
    for writer in writers:
        writer.start()
    for writer in writers:
        writer.join(timeout=120)
    assert [writer.exitcode for writer in writers] == [0, 0]
    assert json.loads(status.read_text())["write"] == 299
    assert [p.name for p in tmp_path.iterdir()] == ["status.json"]


def test_runs_shows_the_step_of_a_loss_the_run_is_past(tmp_path: Path) -> None:
    """A run at step 12 that logs every 5 steps: its last loss is step 10's, which `runner runs`
    showed beside 12/300 with nothing saying so."""
    from runner.job.lifecycle import runs_table

    run = RunDir(tmp_path / "run")
    run.path.mkdir()
    run.write_status("running", step=12, total_steps=300)
    (run.path / "metrics.jsonl").write_text(
        "".join(json.dumps({"step": s, "loss": 5.0 - s / 10}) + "\n" for s in (5, 10))
    )
    (line,) = runs_table([run], tmp_path).splitlines()[1:]
    assert line.split()[2:4] == ["12/300", "4.0000@10"], line
    run.write_status("running", step=10)
    assert runs_table([run], tmp_path).splitlines()[1].split()[2:4] == ["10/300", "4.0000"]


def test_a_refused_output_root_leaves_nothing_in_the_working_directory(
    runner_cli, tmp_path: Path
) -> None:
    """runtime.output_root=null was refused after a directory named None was made."""
    result = runner_cli("train", "compute=cpu", "runtime.output_root=null", cwd=tmp_path)
    assert result.returncode == 2 and "error: runtime.output_root: give the directory" in (
        result.stderr
    ), result.stderr
    assert list(tmp_path.iterdir()) == []


def test_runs_started_in_one_second_each_claim_a_directory(tmp_path: Path) -> None:
    """Two `runner train` started together took one outputs/<date>/<time>, and the second was
    refused for a hydra.run.dir it never gave: each claims its own, -1, -2 after the first."""
    from omegaconf import OmegaConf

    from runner.job.start import _unclaimed

    config = OmegaConf.create({"hydra": {"overrides": {"hydra": []}}, "runtime": {}})
    first = tmp_path / "outputs" / "2026-11-29" / "10-00-00"
    claimed = [_unclaimed(first, config) for _ in range(3)]
    assert [p.name for p in claimed] == ["10-00-00", "10-00-00-1", "10-00-00-2"]
    assert all(p.is_dir() for p in claimed)


@pytest.mark.parametrize("name", ["my runs", "é ü 日本", "a,b=[c]", "1e5"])
def test_the_summary_next_command_pastes_as_printed(tmp_path: Path, capsys, name: str) -> None:
    """`try next: runner deploy checkpoint=/a dir/...` was two words to the shell, and a path
    outside Hydra's unquoted grammar (a letter outside ASCII, a comma) one it refused."""
    import shlex

    from hydra.core.override_parser.overrides_parser import OverridesParser

    from runner.job.job import _print_summary

    run = RunDir(tmp_path / name / "r")
    whole_checkpoint(run, 2)
    run.write_status("completed", step=2)
    _print_summary(run)
    (line,) = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("try next:")]
    program, command, override = shlex.split(line.removeprefix("try next:"))
    assert (program, command) == ("runner", "deploy")
    parsed = OverridesParser.create().parse_override(override)
    assert (parsed.key_or_group, parsed.value()) == ("checkpoint", str(run.checkpoint_path(2)))


def test_data_changed_since_a_run_started_is_named(tmp_path: Path) -> None:
    """A resume over data with a record appended trained on other records than the
    uninterrupted run, unsaid; the manifest's sha256 of each file says so."""
    from runner.rundir.manifest import changed_data, sha256_data, write_manifest

    data = tmp_path / "train.jsonl"
    data.write_text('{"instruction": "a", "output": "b"}\n')
    run = RunDir(tmp_path / "run")
    run.path.mkdir()
    recorded = {"path": str(data), "sha256": sha256_data(data)}
    write_manifest(run, {"data": {"source": recorded}})
    assert changed_data(run) == []
    with data.open("a") as f:
        f.write('{"instruction": "c", "output": "d"}\n')
    (changed,) = changed_data(run)
    assert changed.startswith(f"dataset.source {data} (sha256 {recorded['sha256'][:12]} -> ")


def test_a_stop_of_a_sequential_sweeps_job_says_it_ends_the_sweep(tmp_path: Path) -> None:
    """`runner stop SWEEP/N` signals the job's launcher: in a sequential sweep, the sweep's own
    process, which then started no other job, while stop said only that the job was cancelled."""
    from runner.job.lifecycle import sweep_it_ends

    launchers = {
        "sequential": "hydra._internal.core_plugins.basic_launcher.BasicLauncher",
        "parallel": "hydra_plugins.hydra_joblib_launcher.joblib_launcher.JoblibLauncher",
    }
    for name, target in launchers.items():
        (tmp_path / name / "0").mkdir(parents=True)
        record = {"hydra": {"launcher": {"_target_": target}}, "model": {"name": "tiny"}}
        (tmp_path / name / "multirun.yaml").write_text(yaml.safe_dump(record))
    assert sweep_it_ends(RunDir(tmp_path / "sequential" / "0")) == tmp_path / "sequential"
    assert sweep_it_ends(RunDir(tmp_path / "parallel" / "0")) is None
    assert sweep_it_ends(RunDir(tmp_path / "alone")) is None  # no sweep's
    # Its sweep's process gone (its lock held by none), the job trains in a process of its
    # own (`runner resume SWEEP/0`): stop said the sweep stopped with it, and started no job.
    (tmp_path / "sequential" / ".sweep.lock").touch()
    assert sweep_it_ends(RunDir(tmp_path / "sequential" / "0")) is None
    with sweep_lock_held(tmp_path / "sequential"):
        assert sweep_it_ends(RunDir(tmp_path / "sequential" / "0")) == tmp_path / "sequential"
