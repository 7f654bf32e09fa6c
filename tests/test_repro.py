"""`runner repro` passes on a faithful re-run and names what changed when it drifts."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from runner.config.schema import read_recipe
from runner.errors import UserError
from runner.job.repro import (
    Drift,
    _rerun_dir,
    compare_ends,
    compare_losses,
    compare_metrics,
    compare_records,
    kernel_path,
    print_report,
    repro,
)
from runner.paths import SAMPLE_DATA_DIR
from runner.rundir import RunDir, Status
from runner.rundir.manifest import sha256_file, weights_sha256
from runner.trainer import determinism
from tests.cli_forks import Forked, ForkedCli
from tests.conftest import QUICK, load_script, losses
from tests.test_lifecycle import start_run, wait_for_checkpoint

GOLDEN = Path(__file__).resolve().parent / "golden" / "tiny_losses.json"

SHORT = [
    *QUICK,
    "max_steps=4",
    "batch_size=8",
    "runtime.log_every_n_steps=1",
    "runtime.save_every_n_steps=2",
    "runtime.deterministic=true",
    "dataset.eval_samples=0",
    "optimizer.lr=2e-3",
]


def train_on_own_data(
    runner_cli, tmp_path: Path, *extra: str, short: list[str] = SHORT, env: dict | None = None
) -> Path:
    """A short (by default deterministic) run on a private copy of the sample data."""
    data = tmp_path / "data"
    shutil.copytree(SAMPLE_DATA_DIR, data)
    run = tmp_path / "run"
    result = runner_cli(
        "train",
        *short,
        *extra,
        f"dataset.source={data / 'train.jsonl'}",
        f"dataset.validation.source={data / 'validation.jsonl'}",
        f"hydra.run.dir={run}",
        env=env,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return run


@pytest.fixture(scope="module")
def one_process_run(tmp_path_factory: pytest.TempPathFactory, forked_cli: ForkedCli) -> Path:
    """The deterministic one-process run, trained once for this module: the match test reads
    it; the drift test changes its files and puts each back."""
    root = tmp_path_factory.mktemp("one_process")

    def cli(*args: str, env: dict | None = None) -> Forked:
        assert env is None  # a fork inherits the server's environment
        return forked_cli(list(args), root, timeout_s=600)

    return train_on_own_data(cli, root, "compute=cpu", "compute.nproc_per_node=1")


@pytest.mark.parametrize("nproc", [1, 2])
def test_repro_of_a_fresh_run_matches(runner_cli, tmp_path: Path, nproc: int, request) -> None:
    if nproc == 1:
        run = request.getfixturevalue("one_process_run")
    else:
        run = train_on_own_data(runner_cli, tmp_path, "compute=cpu", "compute.nproc_per_node=2")
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["world_size"] == nproc and manifest["deterministic"] is True
    assert set(manifest["checkpoints"]) == {"2", "4"}
    assert manifest["packages"]["torch"] and manifest["data"]["source"]["sha256"]
    result = runner_cli("repro", str(run), "--out", str(tmp_path / "again"))
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert "repro: match (4 logged steps" in result.stdout
    if nproc == 2:  # not forked from the launcher: the pinned kernel path is set before torch
        fresh = "workers: fresh interpreters (a deterministic run pins its kernel path"
        assert fresh in (run / "train.log").read_text()


def test_drift_is_reported_with_its_reason(runner_cli, tmp_path: Path, one_process_run) -> None:
    run = one_process_run
    train_file = run.parent / "data" / "train.jsonl"  # train_on_own_data's copy
    recorded = (run / "recipe.yaml", run / "manifest.json", run / "metrics.jsonl")
    originals = {path: path.read_bytes() for path in recorded}
    originals[train_file] = train_file.read_bytes()
    try:
        reported_drifts(runner_cli, tmp_path, run, train_file)
    finally:  # the run is shared: as it was, whatever happened here
        for path, content in originals.items():
            path.write_bytes(content)


def reported_drifts(runner_cli, tmp_path: Path, run: Path, train_file: Path) -> None:
    """A changed config, package version and data file: each named as the reason."""
    # A changed learning rate in the recorded config.
    recipe = (run / "recipe.yaml").read_text()
    (run / "recipe.yaml").write_text(recipe.replace("lr: 0.002", "lr: 0.003"))
    # Warmup starts at lr 0, so the first step's update is empty and step 3 is the first to differ.
    result = runner_cli("repro", str(run), "--steps", "3", "--out", str(tmp_path / "lr"))
    assert result.returncode == 1, result.stderr[-3000:]
    assert "config.optimizer.lr" in result.stdout and "loss at step 3" in result.stdout
    (run / "recipe.yaml").write_text(recipe)

    # A different package version recorded than installed.
    written = (run / "manifest.json").read_text()
    manifest = json.loads(written)
    manifest["packages"]["transformers"] = "0.0.1"
    (run / "manifest.json").write_text(json.dumps(manifest))
    result = runner_cli("repro", str(run), "--steps", "2", "--out", str(tmp_path / "pkg"))
    assert result.returncode == 1
    assert "packages.transformers" in result.stdout and "0.0.1" in result.stdout
    assert "loss at step" not in result.stdout  # the numbers themselves still agree
    (run / "manifest.json").write_text(written)

    # A value the run logged and the re-run does not (a change that stopped evaluating), at
    # its last step too, which no --steps cut.
    metrics = (run / "metrics.jsonl").read_text()
    (run / "metrics.jsonl").write_text(metrics + json.dumps({"step": 4, "eval_loss": 5.3}) + "\n")
    result = runner_cli("repro", str(run), "--out", str(tmp_path / "eval"))
    assert result.returncode == 1, result.stdout + result.stderr[-3000:]
    assert "eval_loss at step 4" in result.stdout and "1 difference(s)" in result.stdout
    (run / "metrics.jsonl").write_text(metrics)

    # A tolerance given: weights within it may differ in their last bits, as GPU runs' do.
    result = runner_cli(
        "repro", str(run), "--steps", "2", "--tolerance", "1e-6", "--out", str(tmp_path / "tol")
    )
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert "within 1e-06; checkpoint hashes not compared; record agrees" in result.stdout

    # A changed data file at the recorded path.
    lines = train_file.read_text().splitlines()
    train_file.write_text("\n".join(reversed(lines)) + "\n")
    result = runner_cli("repro", str(run), "--steps", "2", "--out", str(tmp_path / "data2"))
    assert result.returncode == 1
    assert "data.source.sha256" in result.stdout

    # One the re-run cannot read: a failure where the run completed is drift, not bad input.
    train_file.write_text("not json\n")
    result = runner_cli("repro", str(run), "--steps", "2", "--out", str(tmp_path / "data3"))
    assert result.returncode == 1, result.stdout + result.stderr[-3000:]
    assert "repro: the re-run failed, at step 0: " in result.stdout
    assert "data.source.sha256" in result.stdout and "\nend " in result.stdout


def test_steps_that_log_no_step_are_refused_by_name(runner_cli, tmp_path: Path) -> None:
    """A run that logs every second step: `--steps 1` would compare no loss, so it is refused
    before anything is re-run, with the value that works."""
    run = train_on_own_data(
        runner_cli, tmp_path, "runtime.log_every_n_steps=2", "runtime.save_every_n_steps=4"
    )
    result = runner_cli("repro", str(run), "--steps", "1", "--out", str(tmp_path / "one"))
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert result.stderr.strip().splitlines()[-1] == (
        "error: --steps=1: the run logged its first loss at step 2 "
        "(runtime.log_every_n_steps=2), so 1 step(s) compare no loss; give --steps 2 or more"
    )
    assert not (tmp_path / "one").exists()
    result = runner_cli("repro", str(run), "--steps", "2", "--out", str(tmp_path / "two"))
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    # It saved step 4's checkpoint, the re-run step 2's: no hash compared, and it says so.
    assert "repro: match (1 logged steps; no checkpoint at a step both saved" in result.stdout


def test_repro_of_a_stopped_run_goes_as_far_as_it_went(
    runner_cli, hermetic_env, tmp_path: Path
) -> None:
    """A run stopped (`runner stop`) after its first checkpoint: the re-run stops at its step,
    not at max_steps, and compares the hashes of each checkpoint both saved."""
    run, again = tmp_path / "stopped", tmp_path / "again"
    proc = start_run(hermetic_env, run)
    wait_for_checkpoint(run, proc)
    assert runner_cli("stop", str(run)).returncode == 0
    assert proc.wait(timeout=300) == 143
    status = RunDir(run).status()
    assert status.state == "cancelled" and status.step is not None and status.step < 100
    saved = json.loads((run / "manifest.json").read_text())["checkpoints"]
    result = runner_cli("repro", str(run), "--out", str(again))
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    stopped = f"the run stopped at step {status.step} of 100 (cancelled): the re-run stops"
    assert stopped in result.stdout
    agree = f"hashes of {len(saved)} checkpoint(s) and record agree"
    assert f"repro: match ({status.step} logged steps; {agree})" in result.stdout
    assert RunDir(again).status().step == status.step
    assert sorted(json.loads((again / "manifest.json").read_text())["checkpoints"]) == sorted(saved)


def test_repro_of_something_else_is_a_user_error(runner_cli, tmp_path: Path) -> None:
    result = runner_cli("repro", str(tmp_path))
    assert result.returncode == 2
    assert "not a run directory" in result.stderr


def test_a_sweep_jobs_rerun_goes_beside_the_sweep(tmp_path: Path) -> None:
    """Inside the sweep directory, a re-run would be listed, and deployed, as one of its jobs."""
    sweep = tmp_path / "16-38-44"
    (sweep / "0").mkdir(parents=True)
    assert _rerun_dir(RunDir(sweep / "0"), None).path.name.startswith("0-repro-")
    (sweep / "multirun.yaml").write_text("{}\n")
    rerun = _rerun_dir(RunDir(sweep / "0"), None).path
    assert rerun.parent == tmp_path and rerun.name.startswith("16-38-44-0-repro-"), rerun


@pytest.mark.parametrize("tolerance", [math.nan, math.inf, -1.0])
def test_a_tolerance_that_is_no_finite_share_is_refused(one_process_run: Path, tolerance) -> None:
    """NaN compares false with everything (every value drifted), and inf times 0 is NaN."""
    with pytest.raises(UserError, match="give a finite relative tolerance >= 0"):
        repro(one_process_run, steps=None, tolerance=tolerance, out=None)


def test_a_run_whose_data_is_gone_is_refused_before_a_rerun_dir(
    one_process_run: Path, tmp_path: Path
) -> None:
    """Where it failed inside a new run directory, left failed (a moved model.source was named
    as model.tokenizer, with transformers' message about hub repo ids)."""
    source = Path(
        yaml.safe_load((one_process_run / "recipe.yaml").read_text())["dataset"]["source"]
    )
    moved = source.rename(source.with_name("moved.jsonl"))
    try:
        with pytest.raises(UserError) as refused:
            repro(one_process_run, steps=None, tolerance=None, out=tmp_path / "rerun")
    finally:
        moved.rename(source)
    assert str(refused.value) == (
        f"RUN_DIR='{one_process_run}': its dataset.source, {source}, is no longer there (moved "
        "or deleted); put it back where the run read it to re-run the run"
    )
    assert not (tmp_path / "rerun").exists()


def test_a_rerun_refused_by_the_machine_leaves_no_directory(
    one_process_run: Path, tmp_path: Path, monkeypatch
) -> None:
    """A deterministic run re-run where its kernel path cannot run is refused as it launches:
    its directory was left `created`, listed as failed, and an --out given again existed."""
    monkeypatch.setattr(determinism.platform, "machine", lambda: "aarch64")
    with pytest.raises(UserError, match="runtime.deterministic=false"):
        repro(one_process_run, steps=None, tolerance=None, out=tmp_path / "rerun")
    assert not (tmp_path / "rerun").exists()


def test_a_run_still_training_is_not_re_run(one_process_run: Path, tmp_path: Path) -> None:
    """It was re-run as far as its status said at that moment ("the run stopped at step 40 of
    300 (running)"), beside the run, on its cores."""
    import os
    import socket

    from runner.rundir import run_lock

    live = tmp_path / "live"
    shutil.copytree(one_process_run, live)
    me = {"pid": os.getpid(), "launcher_pid": os.getpid(), "host": socket.gethostname()}
    RunDir(live).write_status("running", **me)
    with run_lock(live, key="hydra.run.dir"), pytest.raises(UserError) as refused:
        repro(live, steps=None, tolerance=None, out=tmp_path / "rerun")
    assert str(refused.value) == (
        f"RUN_DIR='{live}': the run is running (process {os.getpid()}); re-run it once it has "
        f"ended: wait for it, or `runner stop {live}`"
    )
    assert not (tmp_path / "rerun").exists()


def test_an_out_that_cannot_be_made_is_one_message(one_process_run: Path, tmp_path: Path) -> None:
    """A path under a file was a traceback with exit 1, the code of drift; one inside the
    recorded run was taken."""
    (tmp_path / "file").write_text("")
    with pytest.raises(UserError) as refused:
        repro(one_process_run, steps=None, tolerance=None, out=tmp_path / "file" / "x")
    assert str(refused.value) == (
        f"--out='{tmp_path / 'file' / 'x'}': cannot make this directory (Not a directory); give "
        "one this user can write"
    )
    inside = one_process_run / "checkpoints" / "again"
    with pytest.raises(UserError, match="is inside the recorded run"):
        repro(one_process_run, steps=None, tolerance=None, out=inside)
    assert not inside.exists()


def test_a_run_that_diverged_is_reproduced_by_diverging_alike(runner_cli, tmp_path: Path) -> None:
    """Its re-run failed as it did and repro exited 2, bad input, with no verdict."""
    diverging = [o for o in SHORT if not o.startswith(("optimizer.lr", "runtime.deterministic"))]
    diverging += ["optimizer.lr=1e12", "optimizer.warmup_steps=1", "max_steps=6"]
    run = tmp_path / "diverged"
    failed = runner_cli("train", *diverging, f"hydra.run.dir={run}")
    assert failed.returncode == 2 and "the training loss is nan" in failed.stderr
    result = runner_cli("repro", str(run), "--out", str(tmp_path / "again"))
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    step = json.loads((run / "status.json").read_text())["step"]
    assert f"the re-run failed as the run did, at step {step}: optimizer.lr=" in result.stdout
    assert "the training loss is nan" in result.stdout.split("the re-run failed")[1]
    assert "repro: match (" in result.stdout


def test_one_ulp_is_drift() -> None:
    loss = 5.592266082763672
    assert compare_losses({1: loss}, {1: loss}) == []
    (drift,) = compare_losses({1: loss}, {1: math.nextafter(loss, math.inf)})
    assert drift.what == "loss at step 1"
    # A step one side logged and the other did not: a golden file of fewer or more steps than
    # the run's matched on the steps they shared.
    (fewer,) = compare_losses({1: loss}, {1: loss, 2: loss})
    (more,) = compare_losses({1: loss, 9: 1.0}, {1: loss})
    assert (fewer.what, fewer.recorded, fewer.rerun) == ("loss at step 2", None, loss)
    assert (more.what, more.recorded, more.rerun) == ("loss at step 9", 1.0, None)


def best_capability(hermetic_env: dict[str, str]) -> str:
    """The ATen kernel capability torch picks on this machine by itself (avx2, avx512, ...)."""
    env = {k: v for k, v in hermetic_env.items() if k != "ATEN_CPU_CAPABILITY"}
    probe = "import torch; print(torch.backends.cpu.get_cpu_capability())"
    proc = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True)
    return proc.stdout.strip().lower()


def test_deterministic_losses_do_not_depend_on_the_machines_kernels(
    runner_cli, tmp_path: Path, hermetic_env, capsys: pytest.CaptureFixture[str]
) -> None:
    """The golden config trained where ATen would pick two different kernel capabilities (its
    portable `default` build, and the machine's best: AVX2 or AVX-512) gives the same losses."""
    overrides = json.loads(GOLDEN.read_text())["overrides"]
    found = {}
    for capability in ("default", best_capability(hermetic_env)):
        run = tmp_path / capability
        env = {"ATEN_CPU_CAPABILITY": capability, "OMP_NUM_THREADS": "2"}
        result = runner_cli("train", *overrides, f"hydra.run.dir={run}", env=env)
        assert result.returncode == 0, result.stderr[-3000:]
        kernels = json.loads((run / "manifest.json").read_text())["kernels"]
        assert kernels["cpu_capability"] == "AVX2" and kernels["intra_op_threads"] == 1
        assert kernels["deterministic_algorithms"] is True
        found[capability] = losses(run)
    first, second = found.values()
    assert len(first) == 8 and first == second  # exact, step by step
    # scripts/checks/golden_loss.py (run by .ci/run) compares such losses with the stored file
    # exactly: they match it, and a stored loss one ulp off is drift, named by its step.
    golden_loss = load_script("checks/golden_loss")
    stored = json.loads(GOLDEN.read_text())
    assert golden_loss.OVERRIDES == overrides
    trained = {str(s): v for s, v in first.items()}
    assert golden_loss.check(trained, golden_loss.read_golden(GOLDEN), GOLDEN.name) == 0
    stored["losses"]["5"] = math.nextafter(stored["losses"]["5"], 0.0)
    (tmp_path / "golden.json").write_text(json.dumps(stored))
    off = golden_loss.read_golden(tmp_path / "golden.json")
    assert golden_loss.check(trained, off, "golden.json") == 1
    assert "loss at step 5" in capsys.readouterr().out
    # A file that is no stored losses is bad input (exit 2), not drift: named before training.
    (tmp_path / "golden.json").write_text(json.dumps({"losses": [1.0, 2.0]}))
    with pytest.raises(ValueError, match="not a stored losses file"):
        golden_loss.read_golden(tmp_path / "golden.json")


def test_repro_on_another_kernel_path_compares_within_a_tolerance(
    runner_cli, tmp_path: Path, hermetic_env
) -> None:
    """Recorded on the portable kernels with one thread, not deterministic; re-run on the
    machine's best kernels with two: repro names both differences and compares loosely."""
    short = [o for o in SHORT if not o.startswith("runtime.deterministic")]
    recorded_env = {"ATEN_CPU_CAPABILITY": "default", "OMP_NUM_THREADS": "1"}
    run = train_on_own_data(runner_cli, tmp_path, "compute=cpu", short=short, env=recorded_env)
    best = best_capability(hermetic_env)
    result = runner_cli(
        "repro",
        str(run),
        "--out",
        str(tmp_path / "again"),
        env={"ATEN_CPU_CAPABILITY": best, "OMP_NUM_THREADS": "2"},
    )
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert f"kernels.cpu_capability DEFAULT -> {best.upper()}" in result.stdout
    assert "kernels.intra_op_threads 1 -> 2" in result.stdout
    assert "largest relative difference of loss:" in result.stdout
    assert "repro: match (4 logged steps; within 0.01" in result.stdout


def test_a_value_one_side_logged_is_drift_but_at_the_step_a_rerun_was_cut_at() -> None:
    """A re-run that stopped evaluating or logging a step matched on the values both logged."""
    recorded = [{"step": 1, "loss": 2.0}, {"step": 2, "loss": 1.0}, {"step": 2, "eval_loss": 1.5}]
    rerun = [{"step": 1, "loss": 2.0}, {"step": 2, "loss": 1.0}]
    (drift,) = compare_metrics(recorded, rerun, tolerance=0.0)[0]
    assert (drift.what, drift.recorded, drift.rerun) == ("eval_loss at step 2", 1.5, None)
    (drift,) = compare_metrics(rerun[:1], rerun, tolerance=0.0)[0]
    assert (drift.what, drift.recorded, drift.rerun) == ("loss at step 2", None, 1.0)
    # Cut short by --steps, a re-run logs the step it stops at, which the run may not have.
    assert compare_metrics(recorded, rerun, tolerance=0.0, cut_at=2)[0] == []
    # A metric the run never logged (an older runner's: no grad_norm) is no drift.
    newer = [{**row, "grad_norm": 1.0} for row in recorded]
    assert compare_metrics(recorded, newer, tolerance=0.0)[0] == []


def test_how_the_runs_ended_is_compared_where_either_failed() -> None:
    nan = "optimizer.lr=1.0: the training loss is nan at step 2; lower the learning rate"
    failed = Status(state="failed", step=2, error=nan)
    assert compare_ends(failed, Status(state="failed", step=2, error=nan)) == []
    assert compare_ends(Status(state="cancelled", step=3), Status(state="completed", step=3)) == []
    (fixed,) = compare_ends(failed, Status(state="completed", step=2))
    assert (fixed.what, fixed.recorded, fixed.rerun) == (
        "end",
        f"failed at step 2: {nan}",
        "completed",
    )
    (later,) = compare_ends(failed, Status(state="failed", step=3, error=nan))
    assert later.rerun == f"failed at step 3: {nan}"
    # Ended by its machine, not its computation: a re-run that goes as far matches.
    killed = "training failed ...: rank 1 failed: killed by SIGKILL (the kernel's out-of-memory"
    completed = Status(state="completed", step=5)
    assert compare_ends(Status(state="failed", step=5, error=killed), completed) == []
    (failing,) = compare_ends(completed, failed)
    assert failing.recorded == "completed"
    # An older runner's record of the same divergence ("Diverged: " before it) is alike.
    older = Status(state="failed", step=2, error=f"Diverged: {nan}")
    assert compare_ends(older, failed) == []


# The keys of a manifest that compare_records reads, but the config.
RECORD = {
    "tokenizer_sha256": {},
    "packages": {},
    "python": "3.11",
    "torch_build": {},
    "world_size": 1,
    "deterministic": True,
    "data": {},
    "hardware": {"device": "cpu"},
    "checkpoints": {},
}


def test_what_an_older_runner_could_not_record_is_no_drift(capsys) -> None:
    """A key it did not write, a value it redacted (every key with "token" in its name), each
    called drift in a re-run that matched; a value the table cuts short is printed in full."""
    recorded = {"dataset": {"eval_max_new_tokens": "<redacted>"}, "optimizer": {"lr": 1.0}}
    rerun = {"dataset": {"eval_max_new_tokens": 12, "validation": {"format": "json"}}}
    rerun["optimizer"] = {"lr": 2.0}
    manifest = RECORD
    (drift,) = compare_records({**manifest, "config": recorded}, {**manifest, "config": rerun})
    assert (drift.what, drift.recorded, drift.rerun) == ("config.optimizer.lr", 1.0, 2.0)
    # But a key that recipe.yaml gained by an edit, which the record lacks, is compared.
    edited = {"optimizer": {"lr": 1.0, "amsgrad": True}}
    (added,) = compare_records(
        {**manifest, "config": recorded}, {**manifest, "config": edited}, written=edited
    )
    assert (added.what, added.recorded, added.rerun) == ("config.optimizer.amsgrad", None, True)
    long = "failed at step 3: optimizer.lr=1e+12: the training loss is nan at step 3"
    print_report([Drift("end", long, "completed")], "unused")
    assert f"end: recorded {long}; re-run completed" in capsys.readouterr().out


def test_an_older_recipe_reads_its_validation_file_in_the_datasets_format(
    one_process_run: Path, tmp_path: Path
) -> None:
    """Recorded before validation.format was: repro and resume read the file with no format
    (a KeyError traceback, and a half-made re-run directory)."""
    recipe = yaml.safe_load((one_process_run / "recipe.yaml").read_text())
    assert recipe["dataset"]["validation"]["source"] and recipe["dataset"]["format"] == "json"
    del recipe["dataset"]["validation"]["format"]
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    assert read_recipe(tmp_path / "recipe.yaml").dataset.validation.format == "json"


def test_another_gpu_model_is_another_kernel_path() -> None:
    """A CUDA run re-run on another GPU model ran other kernels: compared within a tolerance,
    as on another CPU kernel path; a CPU's model is told by its kernel capability."""
    kernels = {"cpu_capability": "AVX2", "intra_op_threads": 1}
    a100 = {"hardware": {"device": "cuda", "name": "NVIDIA A100"}, "kernels": kernels}
    h100 = {"hardware": {"device": "cuda", "name": "NVIDIA H100"}, "kernels": kernels}
    assert kernel_path(a100)["hardware.name"] != kernel_path(h100)["hardware.name"]
    epyc = {"hardware": {"device": "cpu", "name": "AMD EPYC"}, "kernels": kernels}
    xeon = {"hardware": {"device": "cpu", "name": "Intel Xeon"}, "kernels": kernels}
    assert kernel_path(epyc) == kernel_path(xeon)


def test_metrics_compare_within_a_relative_tolerance() -> None:
    recorded = [{"step": 1, "loss": 2.0, "tokens_per_s": 100.0}, {"step": 2, "eval_loss": 1.0}]
    rerun = [{"step": 1, "loss": 2.01, "tokens_per_s": 50.0}, {"step": 2, "eval_loss": 1.0}]
    drifts, largest = compare_metrics(recorded, rerun, tolerance=1e-2)
    assert drifts == [] and largest == {"loss": pytest.approx(0.01 / 2.01), "eval_loss": 0.0}
    (drift,) = compare_metrics(recorded, rerun, tolerance=1e-3)[0]
    assert drift.what == "loss at step 1" and (drift.recorded, drift.rerun) == (2.0, 2.01)


@pytest.mark.parametrize(
    "machine,flags,why",
    [("aarch64", None, "this machine is aarch64"), ("x86_64", {"sse2", "avx"}, "lacks avx2, fma")],
)
def test_deterministic_mode_refuses_a_machine_off_the_pinned_path(
    monkeypatch, machine: str, flags: set[str] | None, why: str
) -> None:
    monkeypatch.setattr(determinism.platform, "machine", lambda: machine)
    monkeypatch.setattr(determinism, "_cpu_flags", lambda: flags)
    with pytest.raises(UserError) as err:
        determinism.check_machine()
    assert err.value.key == "runtime.deterministic" and why in err.value.fix
    assert "runtime.deterministic=false" in err.value.fix


def test_the_weights_a_run_starts_from_are_hashed_and_compared(tmp_path: Path) -> None:
    """A run continued from a checkpoint that changed since re-ran from other weights, and the
    drift named no cause. A file of the hub's cache is named by its blob (sha256, for LFS)."""
    blob = "a" * 64
    (tmp_path / "blobs").mkdir()
    (tmp_path / "blobs" / blob).write_bytes(b"weights")
    (tmp_path / "blobs" / "0123abcd").write_text("{}")  # a small file: git's sha1, not sha256
    snapshot = tmp_path / "snapshots" / "rev"
    snapshot.mkdir(parents=True)
    (snapshot / "model.safetensors").symlink_to(tmp_path / "blobs" / blob)
    (snapshot / "config.json").symlink_to(tmp_path / "blobs" / "0123abcd")
    found = weights_sha256(str(snapshot))
    assert found == {
        "config.json": sha256_file(snapshot / "config.json"),
        "model.safetensors": blob,
    }
    assert weights_sha256(None) == {}  # random weights (model=tiny)

    recorded = {**RECORD, "config": {}, "weights_sha256": found}
    rerun = {**recorded, "weights_sha256": {**found, "model.safetensors": "b" * 64}}
    (drift,) = compare_records(recorded, rerun)
    assert drift.what == "weights_sha256.model.safetensors"
    older = {k: v for k, v in recorded.items() if k != "weights_sha256"}
    assert compare_records(older, rerun) == []  # a manifest from before it recorded them
    # The checkpoint a run went on from (load_checkpoint.path, to resume), beside model.source.
    recorded["load_checkpoint_sha256"] = {"model.safetensors": "c" * 64}
    rerun = {**recorded, "load_checkpoint_sha256": {"model.safetensors": "d" * 64}}
    (drift,) = compare_records(recorded, rerun)
    assert drift.what == "load_checkpoint_sha256.model.safetensors"


def test_a_run_of_several_nodes_is_refused_with_the_way_on(
    one_process_run: Path, tmp_path: Path
) -> None:
    """Re-run on one machine, it waited out the rendezvous for the others (15 minutes)."""
    run = tmp_path / "two_nodes"
    shutil.copytree(one_process_run, run)
    recipe = yaml.safe_load((run / "recipe.yaml").read_text())
    recipe["compute"]["nnodes"] = 2
    recipe["run_dir"] = str(run)
    (run / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    with pytest.raises(UserError, match="2 nodes trained it, and repro re-runs on this machine"):
        repro(run, steps=None, tolerance=None, out=None)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["two_nodes"]  # no re-run directory


def test_a_moved_lora_run_on_a_seeded_base_keeps_its_base_with_it(runner_cli, tmp_path) -> None:
    """The base a LoRA run writes from the seed (RUN/base_model) goes with the run: its re-run
    wrote it again at the moved run's old path, outside --out, and an exported adapter named
    that old path, where peft found nothing."""
    trained = train_on_own_data(runner_cli, tmp_path, "method=lora")
    run = tmp_path / "moved"
    trained.rename(run)
    again = tmp_path / "again"
    result = runner_cli("repro", str(run), "--steps", "2", "--out", str(again))
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert "repro: match (2 logged steps; hashes of 1 checkpoint(s)" in result.stdout
    assert (again / "base_model" / "model.safetensors").is_file() and not trained.exists()

    out = tmp_path / "adapter"
    result = runner_cli("export", f"checkpoint={run}", "format=adapter", f"out={out}")
    assert result.returncode == 0, result.stderr[-3000:]
    named = json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"]
    assert named == str((run / "base_model").resolve())
