"""`runner train -m`: one run directory per job, a summary that matches them, every launcher."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from runner.job.sweep import write_summary
from tests.conftest import QUICK, ctrl_c_after_two_steps, losses

SAMPLE = Path(__file__).parents[1] / "runner" / "assets" / "sample" / "train.jsonl"
TINY_JOB = [*QUICK, "max_steps=4", "batch_size=4", "dataset.eval_samples=0"]


def summary_of(sweep: Path) -> dict:
    return json.loads((sweep / "summary.json").read_text())


def test_sweep_summary_matches_its_run_directories(runner_cli, tmp_path: Path) -> None:
    """On the parallel launcher (joblib's workers, one per core), whose jobs end and write the
    summary at once; the sequential launcher's summaries are the other tests' here."""
    sweep = tmp_path / "sweep"
    parallel = ["train", "-m", "hydra/launcher=parallel", *TINY_JOB]
    result = runner_cli(*parallel, "optimizer.lr=1e-3,3e-3", "seed=0,1", f"hydra.sweep.dir={sweep}")
    assert result.returncode == 0, result.stderr[-3000:]
    summary = summary_of(sweep)
    assert [r["job"] for r in summary["runs"]] == ["0", "1", "2", "3"]
    for row in summary["runs"]:
        run = Path(row["run_dir"])
        assert row["state"] == "completed" and row["step"] == 4
        assert row["final_loss"] == losses(run)[4]
        assert row["overrides"] == yaml.safe_load((run / ".hydra" / "overrides.yaml").read_text())
        # The objective (eval_loss by default) is each run's recorded best.
        assert row["metric"] == json.loads((run / "status.json").read_text())["best"]["value"]
    best = min(summary["runs"], key=lambda r: r["metric"])
    assert summary["best"]["job"] == best["job"]
    assert summary["best"]["metric_checkpoint"] == str(Path(best["run_dir"]) / "checkpoints/step_4")
    assert (sweep / "loss_curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"best by eval_loss (min): job {best['job']}" in result.stdout
    assert "| 0 | optimizer.lr=0.001 seed=0 | completed | 4/4 |" in result.stdout
    # Other values into it: its jobs found their directories trained and trained nothing, and
    # the summary named them by values they never trained with.
    written = {p: p.stat().st_mtime_ns for p in sweep.rglob("*") if p.is_file()}
    other = runner_cli(*parallel, "optimizer.lr=1e-3,8e-3", "seed=0,1", f"hydra.sweep.dir={sweep}")
    assert other.returncode == 2 and "Traceback" not in other.stderr, other.stderr[-3000:]
    assert other.stderr == (
        f"error: hydra.sweep.dir='{sweep}': holds a sweep that other overrides started: "
        "optimizer.lr=1e-3,8e-3 (recorded: optimizer.lr=1e-3,3e-3); go on with it by its own "
        "command (compute, batch_size and gradient_accumulation_steps may change), or give "
        "another hydra.sweep.dir\n"
    )
    assert {p: p.stat().st_mtime_ns for p in sweep.rglob("*") if p.is_file()} == written


def test_a_failing_job_is_recorded_and_the_others_run(runner_cli, tmp_path: Path) -> None:
    """A job whose data holds no record fails at its checks, which read the data (the values of
    a sweep are checked before it starts, its data files are not read: a blank line here; an
    empty file is refused before the sweep starts, as a missing one is)."""
    empty, good = tmp_path / "empty.jsonl", tmp_path / "good.jsonl"
    empty.write_text("\n")
    good.write_text("".join(SAMPLE.read_text().splitlines(keepends=True)[:40]))
    sweep = tmp_path / "sweep"
    sources = f"dataset.source={empty},{good},{empty}"
    data = ["dataset=instruct", sources, f"hydra.sweep.dir={sweep}"]
    result = runner_cli("train", "-m", *TINY_JOB, *data)
    assert result.returncode == 2  # the number of failed jobs
    states = {r["job"]: r["state"] for r in summary_of(sweep)["runs"]}
    assert states == {"0": "failed", "1": "completed", "2": "failed"}
    assert "has no records" in summary_of(sweep)["runs"][0]["error"]
    assert f"job 0 failed: dataset.source='{empty}': has no records" in result.stdout
    # Failed at its checks, a job recorded no recipe: a resume says there is nothing to go on.
    resumed = runner_cli("resume", str(sweep / "0"))
    assert resumed.returncode == 2, resumed.stderr
    assert (
        "the run failed before it recorded its recipe (recipe.yaml): nothing to go on from; fix "
        "what its status.json error says and train it again"
    ) in resumed.stderr
    (tmp_path / "zero.jsonl").write_text("")
    refused = tmp_path / "refused"
    zero = ["dataset=instruct", f"dataset.source={good},{tmp_path / 'zero.jsonl'}"]
    result = runner_cli("train", "-m", *TINY_JOB, *zero, f"hydra.sweep.dir={refused}")
    assert result.returncode == 2 and not refused.exists(), result.stderr[-3000:]
    assert "zero.jsonl': has no records" in result.stderr


@pytest.mark.long
def test_sigterm_stops_a_parallel_sweep_as_a_sequential_one(hermetic_env, tmp_path: Path) -> None:
    """Each running job saves and ends cancelled, the third never trains, the summary says so
    and the sweep exits 143; joblib alone left the jobs training on as orphans (SIGTERM) or
    killed them without a checkpoint (Ctrl-C)."""
    sweep = tmp_path / "sweep"
    args = [*QUICK, "compute=cpu", "max_steps=400", "runtime.log_every_n_steps=1"]
    args += ["eval.strategy=no", "hydra/launcher=parallel", "hydra.launcher.n_jobs=2"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "runner", "train", "-m", *args, "optimizer.lr=1e-3,2e-3,3e-3"]
        + [f"hydra.sweep.dir={sweep}"],
        env=hermetic_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    metrics = [sweep / job / "metrics.jsonl" for job in ("0", "1")]
    deadline = time.monotonic() + 600
    while not all(m.exists() and len(m.read_text().splitlines()) >= 2 for m in metrics):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 143, err[-3000:]
    assert "SIGTERM: stopping the sweep's running jobs, starting no other" in err
    rows = summary_of(sweep)["runs"]
    assert [r["job"] for r in rows] == ["0", "1"], rows
    for row in rows:
        assert row["state"] == "cancelled" and 2 <= row["step"] < 400, row
        assert (sweep / row["job"] / "checkpoints" / f"step_{row['step']}").is_dir()
    assert not (sweep / "2" / "status.json").exists() and not (sweep / ".stopping").exists()


def test_submitit_launcher_through_its_local_executor(runner_cli, tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    result = runner_cli(
        "train",
        "-m",
        "hydra/launcher=submitit_local",
        *TINY_JOB,
        "optimizer.lr=1e-3,3e-3",
        f"hydra.sweep.dir={sweep}",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert [r["state"] for r in summary_of(sweep)["runs"]] == ["completed", "completed"]
    assert list((sweep / ".submitit").iterdir())


def test_optuna_search_optimizes_the_objective(runner_cli, tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    result = runner_cli(
        "train",
        "-m",
        "hydra/sweeper=optuna",
        "hydra.sweeper.n_trials=3",
        "hydra.sweeper.direction=minimize",
        "hydra.sweeper.sampler.seed=0",
        "optimizer.lr=tag(log, interval(1e-4, 1e-2))",
        *TINY_JOB,
        f"hydra.sweep.dir={sweep}",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = summary_of(sweep)["runs"]
    assert len(rows) == 3
    found = yaml.safe_load((sweep / "optimization_results.yaml").read_text())
    assert found["best_value"] == min(r["metric"] for r in rows)
    # Run again into it, it drew new values, and its trials found their directories trained:
    # the best it reported was a value never trained.
    again = runner_cli(
        "train",
        "-m",
        "hydra/sweeper=optuna",
        "hydra.sweeper.n_trials=3",
        "hydra.sweeper.direction=minimize",
        "optimizer.lr=tag(log, interval(1e-4, 1e-2))",
        *TINY_JOB,
        f"hydra.sweep.dir={sweep}",
    )
    assert again.returncode == 2 and "holds the trials of a sweep before" in again.stderr


def test_a_bad_value_of_a_sweep_is_refused_before_any_job(runner_cli, tmp_path: Path) -> None:
    """It was found when its job came, after the jobs before it trained, and a sweep refused
    for a mistyped key left a directory holding Hydra's multirun.yaml alone."""
    sweep = tmp_path / "sweep"
    assert "RUNNER_TEST_UNSET_LR" not in os.environ
    for values, wanted in (
        ("optimizer.lr=1e-3,abc", "error: optimizer.lr='abc': give a number > 0"),
        ("batch_sise=2,4", "error: batch_sise='2': no such key; did you mean 'batch_size'?"),
        # glob() lists the group's options through Hydra's config loader, which the sweep's
        # checks and summary had not: each failed ('ConfigLoader is not set'), no summary.
        ("optimizer=glob(sg*) seed=-1,1", "error: seed=-1: give an integer from 0 to"),
        # Hydra's own sweeper raised its traceback for an interval, which Optuna draws from.
        ("optimizer.lr=interval(1e-4,1e-2)", "an interval is drawn from by the Optuna sweeper"),
        # -m that sweeps nothing: its one job's values were checked by none, and it failed
        # with OmegaConf's text in a sweep directory left behind.
        (
            "optimizer.lr=${oc.env:RUNNER_TEST_UNSET_LR}",
            "the environment variable RUNNER_TEST_UNSET_LR is not set",
        ),
    ):
        given = values.split()
        result = runner_cli("train", "-m", *TINY_JOB, *given, f"hydra.sweep.dir={sweep}")
        assert result.returncode == 2 and wanted in result.stderr, result.stderr[-3000:]
        assert "Traceback" not in result.stderr and not sweep.exists()


def holding(path: Path, lock: str) -> subprocess.Popen:
    """Another process that holds `lock` of `path` until killed: runner.rundir's
    hold_until_exit (a sweep's .sweep.lock) or run_lock (a run's .lock), as they hold them."""
    take = (
        f"hold_until_exit(Path({str(path)!r}))"
        if lock == "sweep"
        else f"held = run_lock(Path({str(path)!r}), key='hydra.run.dir'); held.__enter__()"
    )
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import time; from pathlib import Path; from runner.rundir import hold_until_exit, "
            f"run_lock; {take}; print(flush=True); time.sleep(120)",
        ],
        stdout=subprocess.PIPE,
    )
    assert holder.stdout is not None and holder.stdout.readline() == b"\n"
    return holder


def test_a_job_of_a_sweep_killed_in_its_first_job_brings_a_summary(
    runner_cli, tmp_path: Path
) -> None:
    """A sequential sweep's process killed while its first job trained (api's Run.stop with
    save_checkpoint=False, kill -9) wrote no summary; the job resumed (or killed) after found
    none to bring up to date and wrote none, so api.Sweep.wait() returned None for good."""
    from runner.job.sweep import refresh_sweep_of

    sweep = tmp_path / "sweep"
    args = [*TINY_JOB, "objective.metric=loss", "seed=0", f"hydra.sweep.dir={sweep}"]
    result = runner_cli("train", "-m", *args)
    assert result.returncode == 0, result.stderr[-3000:]
    for written in ("summary.json", "summary.md", "loss_curves.png"):  # as the kill left it
        (sweep / written).unlink()
    refresh_sweep_of(sweep / "0")
    summary = summary_of(sweep)
    assert (summary["metric"], summary["mode"], summary["jobs"]) == ("loss", "min", 1)
    assert [(r["job"], r["state"]) for r in summary["runs"]] == [("0", "completed")]
    assert summary["best"]["job"] == "0" and (sweep / "summary.md").is_file()


def test_a_sweep_whose_jobs_all_failed_draws_no_empty_plot(runner_cli, tmp_path: Path) -> None:
    """No job logged a loss: the sweep drew an empty loss_curves.png, and matplotlib's
    "UserWarning: No artists with labels found to put in legend" came on its console."""
    empty, sweep = tmp_path / "empty.jsonl", tmp_path / "sweep"
    empty.write_text("\n")  # no record (an empty file is refused before the sweep starts)
    data = ["dataset=instruct", f"dataset.source={empty}", f"hydra.sweep.dir={sweep}"]
    result = runner_cli("train", "-m", *TINY_JOB, "seed=0,1", *data)
    assert result.returncode == 2, result.stderr[-3000:]  # the number of failed jobs
    assert "Warning" not in result.stderr, result.stderr[-3000:]
    assert "plot: none (no job logged a training loss)" in result.stdout
    assert not (sweep / "loss_curves.png").exists()


def test_a_sweep_into_a_running_sweeps_directory_is_refused(runner_cli, tmp_path: Path) -> None:
    """A second `runner train -m` (or api.sweep, which returned at once, reading the running
    sweep's lock as its own) into a sweep's directory while it ran: its refused attempt at the
    job that trained wrote `failed` into that job's status.json, and it trained the jobs the
    first had not reached, which the first then found trained."""
    from runner import api
    from runner.errors import UserError

    sweep = tmp_path / "sweep"
    sweep.mkdir()
    holder = holding(sweep, "sweep")
    refused = (
        f"hydra.sweep.dir='{sweep}': a sweep is running there (its process holds "
        f"{sweep / '.sweep.lock'}); wait for it to end"
    )
    try:
        result = runner_cli("train", "-m", *TINY_JOB, "seed=0,1", f"hydra.sweep.dir={sweep}")
        assert result.returncode == 2 and result.stderr.startswith(f"error: {refused}")
        with pytest.raises(UserError, match=f"^{re.escape(refused)}"):
            api.sweep([*TINY_JOB, "seed=0,1", f"hydra.sweep.dir={sweep}"])
    finally:
        holder.kill()
        holder.wait()
    assert sorted(p.name for p in sweep.iterdir()) == [".sweep.lock"]


def test_a_job_another_process_trains_keeps_its_status(runner_cli, tmp_path: Path) -> None:
    """A sweep whose job another process trains (its .lock held: a `runner resume SWEEP/0`) is
    refused before it starts: the job was refused when its turn came and wrote `failed`, with
    its own refusal as the error, over the running run's status.json."""
    from runner.rundir import RunDir

    sweep = tmp_path / "sweep"
    job = RunDir(sweep / "0")
    job.path.mkdir(parents=True)
    job.write_status("running", step=3, total_steps=4)
    status = (job.path / "status.json").read_bytes()
    holder = holding(job.path, "run")
    try:
        result = runner_cli("train", "-m", *TINY_JOB, "seed=0", f"hydra.sweep.dir={sweep}")
    finally:
        holder.kill()
        holder.wait()
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr == (
        f"error: hydra.sweep.dir='{sweep}': its job 0 is being trained by another process (it "
        f"holds {job.path / '.lock'}); wait for that run to end (`runner runs {sweep}` shows "
        "it), then give the sweep's command again\n"
    )
    assert (job.path / "status.json").read_bytes() == status
    assert sorted(p.name for p in sweep.iterdir()) == ["0"]


def test_a_sweep_inside_a_runs_directory_is_refused(runner_cli, tmp_path: Path) -> None:
    """hydra.sweep.dir naming a run's directory, or a folder in it: its jobs trained beside
    the run's files (RUN/0, RUN/checkpoints/1), where `runner runs` never listed them (it looks
    for no run inside another), and its summary.md was written beside the run's recipe."""
    from runner.rundir import RunDir

    run = RunDir(tmp_path / "run")
    run.path.mkdir()
    run.write_status("completed", step=4, total_steps=4)
    for sweep, where in ((run.path, "is the run"), (run.checkpoints_dir, "is inside the run")):
        result = runner_cli("train", "-m", *TINY_JOB, "seed=0,1", f"hydra.sweep.dir={sweep}")
        assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
        assert result.stderr == (
            f"error: hydra.sweep.dir='{sweep}': {where} directory {run.path}, where `runner "
            "runs` does not look for the sweep's jobs; give a directory outside it\n"
        )
    assert sorted(p.name for p in run.path.iterdir()) == ["status.json"]


def test_a_sweep_is_checked_on_the_jobs_its_grid_holds(runner_cli, tmp_path: Path) -> None:
    """Each swept value was checked against the other swept keys' defaults: a grid of heads and
    kv heads whose every job is valid was refused for the tiny model's 4 kv heads, in none of
    them. A grid that holds a job its model refuses is refused naming that job."""
    sweep = tmp_path / "sweep"
    heads = [*TINY_JOB, "max_steps=1", "eval.strategy=no", "model.builder.embed_dim=96"]
    result = runner_cli(
        "train",
        "-m",
        *heads,
        "model.builder.num_heads=6,12",
        "model.builder.num_kv_heads=2,3",
        f"hydra.sweep.dir={sweep}",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert [r["state"] for r in summary_of(sweep)["runs"]] == ["completed"] * 4
    refused = tmp_path / "refused"
    result = runner_cli(
        "train",
        "-m",
        *heads,
        "model.builder.num_heads=12,6",
        "model.builder.num_kv_heads=4,3",
        f"hydra.sweep.dir={refused}",
    )
    assert result.returncode == 2 and not refused.exists(), result.stderr[-3000:]
    assert result.stderr.startswith("error: model.builder.num_heads=6: "), result.stderr
    assert result.stderr.endswith(
        " (in the job model.builder.num_heads=6 model.builder.num_kv_heads=4)\n"
    ), result.stderr


@pytest.mark.parametrize("sweeper", ["basic", "optuna"])
def test_a_secret_in_a_sweeps_config_file_is_refused_before_anything_is_written(
    runner_cli, tmp_path: Path, sweeper: str
) -> None:
    """A token typed into the sweep's own config (--config-name) was refused in each job, after
    Hydra had written it in clear to multirun.yaml and to every failed job's .hydra/."""
    token = "hf_abcdefghijklmnopqrstuvwxyz123456"
    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / "mine.yaml").write_text(
        f"defaults:\n  - train\n  - _self_\nruntime:\n  hf_token: {token}\n"
    )
    sweep = tmp_path / "sweep"
    swept = ["seed=0,1"]
    if sweeper == "optuna":
        swept = ["hydra/sweeper=optuna", "hydra.sweeper.n_trials=2", "seed=range(0,2)"]
    result = runner_cli(
        "train",
        "-m",
        *["--config-dir", str(tmp_path / "conf"), "--config-name", "mine"],
        *TINY_JOB,
        *swept,
        f"hydra.sweep.dir={sweep}",
    )
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.startswith(
        "error: runtime.hf_token='<hidden>': give a reference to the token, env:NAME or file:PATH"
    ), result.stderr[-3000:]
    assert token not in result.stdout + result.stderr and not sweep.exists()


def test_a_bad_value_in_a_sweeps_config_file_is_refused_before_any_job(
    runner_cli, tmp_path: Path
) -> None:
    """The values were checked against train's config, not the sweep's own (--config-name)."""
    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / "mine.yaml").write_text(
        "defaults:\n  - train\n  - _self_\noptimizer:\n  lr: -1.0\n"
    )
    sweep = tmp_path / "sweep"
    config = ["--config-dir", str(tmp_path / "conf"), "--config-name", "mine"]
    result = runner_cli("train", "-m", *config, *TINY_JOB, "seed=0,1", f"hydra.sweep.dir={sweep}")
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.startswith("error: optimizer.lr=-1.0: give a number > 0"), result.stderr
    assert not sweep.exists()


def test_an_optuna_direction_against_the_objective_is_refused_before_any_job(
    runner_cli, tmp_path: Path
) -> None:
    """Optuna minimizes by default: a sweep ranked by objective.mode=max would seek the worst."""
    sweep = tmp_path / "sweep"
    result = runner_cli(
        "train",
        "-m",
        "hydra/sweeper=optuna",
        "hydra.sweeper.n_trials=2",
        "objective.metric=eval_exact_match",
        "objective.mode=max",
        "optimizer.lr=tag(log, interval(1e-4, 1e-2))",
        *TINY_JOB,
        f"hydra.sweep.dir={sweep}",
    )
    assert result.returncode == 2, result.stderr[-3000:]
    assert (
        "error: hydra.sweeper.direction='minimize': the jobs return eval_exact_match, which "
        "objective.mode=max says is better higher; set hydra.sweeper.direction=maximize (or "
        "objective.mode=min, if it is better lower)"
    ) in result.stderr
    assert "Traceback" not in result.stderr and not sweep.exists()


@pytest.mark.long
def test_ctrl_c_stops_the_sweep_with_its_summary_so_far(hermetic_env, tmp_path: Path) -> None:
    """The job stopped saves as any run does; the jobs after it never start; the summary says
    so, as Hydra's end-of-job callback, which Ctrl-C skips, would have."""
    sweep = tmp_path / "sweep"
    args = [*QUICK, "compute=cpu", "max_steps=400", "runtime.log_every_n_steps=1"]
    ctrl_c_after_two_steps(
        ["train", "-m", *args, "optimizer.lr=1e-3,2e-3", "eval.strategy=no"]
        + [f"hydra.sweep.dir={sweep}"],
        hermetic_env,
        sweep / "0" / "metrics.jsonl",
    )
    (row,) = summary_of(sweep)["runs"]
    assert row["state"] == "cancelled" and 2 <= row["step"] < 400, row
    # Its one row names what the sweep varied, not every override its command fixed.
    assert "| 0 | optimizer.lr=0.001 | cancelled |" in (sweep / "summary.md").read_text()
    assert not (sweep / "1").exists()
    # It read as a finished sweep, its best chosen among the jobs that happened to run; with
    # no evaluation there is no best, and the stopped job goes on from its checkpoint.
    assert summary_of(sweep)["jobs"] == 2
    hint = (
        f"1 of 2 jobs not started; a sweep stopped before them goes on by its own command with "
        f"hydra.sweep.dir={sweep}, job 0 "
    )
    summary_md = (sweep / "summary.md").read_text()
    assert f"{hint}from its checkpoint of step {row['step']}\n" in summary_md
    # Resumed on its own and stopped again, the job is where the sweep's summary says it is.
    ctrl_c_after_two_steps(
        ["resume", str(sweep / "0")], hermetic_env, sweep / "0" / "metrics.jsonl"
    )
    (resumed,) = summary_of(sweep)["runs"]
    assert resumed["state"] == "cancelled" and row["step"] + 2 <= resumed["step"] < 400, resumed
    summary_md = (sweep / "summary.md").read_text()
    assert f"| cancelled | {resumed['step']}/400 |" in summary_md
    assert f"{hint}from its checkpoint of step {resumed['step']}\n" in summary_md
    # A job whose checkpoints are gone goes on from step 0, and the summary says so.
    shutil.rmtree(sweep / "0" / "checkpoints")
    write_summary(sweep, summary_of(sweep)["metric"], summary_of(sweep)["mode"])
    assert f"{hint}from step 0 (no checkpoint)\n" in (sweep / "summary.md").read_text()


@pytest.mark.long  # two trainings, in the sweep's process, then in fresh workers
def test_a_job_after_one_trained_in_the_sweeps_process_starts_fresh_workers(
    forked_cli, tmp_path: Path
) -> None:
    """The first job trains in the sweep's own process on two OpenMP threads, which makes its
    thread pool; workers forked from it after that would hang in their first parallel region
    (GNU OpenMP does not survive a fork), so the second job's workers start fresh, and the
    workers of a run's own launcher, which computes on one thread, fork from it."""
    sweep = tmp_path / "sweep"
    args = [*TINY_JOB, "+runtime.env.OMP_NUM_THREADS=2", "compute.nproc_per_node=1,2"]
    result = forked_cli(["train", "-m", *args, f"hydra.sweep.dir={sweep}"], tmp_path, timeout_s=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert [r["state"] for r in summary_of(sweep)["runs"]] == ["completed", "completed"]
    log = (sweep / "1" / "train.log").read_text()
    assert "workers: fresh interpreters (this process has computed on several threads" in log
    alone = tmp_path / "alone"
    result = forked_cli(
        ["train", *args[:-1], "compute.nproc_per_node=2", f"hydra.run.dir={alone}"],
        tmp_path,
        timeout_s=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "workers: forked" in (alone / "train.log").read_text()
    assert losses(alone) == losses(sweep / "1")  # the same training, however it started
