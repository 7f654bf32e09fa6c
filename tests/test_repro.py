"""`runner repro` passes on a faithful re-run and names what changed when it drifts."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from runner.config.schema import read_recipe
from runner.errors import UserError
from runner.job.repro import (
    repro,
)
from runner.paths import SAMPLE_DATA_DIR
from runner.rundir import RunDir
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
# SHORT on the machine's own kernels: a test that is not about the pinned kernel path trains and
# re-runs in the forked CLI (a deterministic run's worker is a fresh interpreter, ~5 s a run).
NOT_DETERMINISTIC = [o for o in SHORT if not o.startswith("runtime.deterministic")]


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


def forked_in(forked_cli: ForkedCli, root: Path):
    """runner_cli for a module fixture (runner_cli is per test): the forked CLI, run in `root`."""

    def cli(*args: str, env: dict | None = None) -> Forked:
        assert env is None  # a fork inherits the server's environment
        return forked_cli(list(args), root, timeout_s=600)

    return cli


@pytest.fixture(scope="module")
def one_process_run(tmp_path_factory: pytest.TempPathFactory, forked_cli: ForkedCli) -> Path:
    """The deterministic one-process run, trained once for this module: the match test re-runs
    it; the tests of what repro refuses read it, copy it, or move its data and put it back."""
    root = tmp_path_factory.mktemp("one_process")
    cli = forked_in(forked_cli, root)
    return train_on_own_data(cli, root, "compute=cpu", "compute.nproc_per_node=1")


@pytest.mark.parametrize("nproc", [1, pytest.param(2, marks=pytest.mark.long)])
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


def test_drift_is_reported_with_its_reason(runner_cli, tmp_path: Path) -> None:
    """A changed config, package version and data file: each named as the reason.

    The run is not deterministic: re-run on the kernels it ran on, it is compared exactly, with
    its hashes, as a deterministic run is, and each re-run is forked, not a fresh interpreter."""
    run = train_on_own_data(runner_cli, tmp_path, "compute=cpu", short=NOT_DETERMINISTIC)
    train_file = tmp_path / "data" / "train.jsonl"  # train_on_own_data's copy
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

    # A changed data file at the recorded path, named by its hash (compare_records hashes the
    # re-run's data before it trains), here one the re-run cannot read: a failure where the run
    # completed is drift, not bad input.
    train_file.write_text("not json\n")
    result = runner_cli("repro", str(run), "--steps", "2", "--out", str(tmp_path / "unreadable"))
    assert result.returncode == 1, result.stdout + result.stderr[-3000:]
    assert "repro: the re-run failed, at step 0: " in result.stdout
    assert "data.source.sha256" in result.stdout and "\nend " in result.stdout


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory: pytest.TempPathFactory, forked_cli: ForkedCli) -> Path:
    """A LoRA run on a base written from the seed (RUN/base_model) that logs every second step
    and saves at its last, step 4, alone; trained once for the two tests that re-run it (not
    deterministic: on the kernels it ran on, its re-runs in the forked CLI match exactly)."""
    root = tmp_path_factory.mktemp("lora")
    cli = forked_in(forked_cli, root)
    every_second = ["runtime.log_every_n_steps=2", "runtime.save_every_n_steps=4"]
    return train_on_own_data(cli, root, "method=lora", *every_second, short=NOT_DETERMINISTIC)


def test_steps_that_log_no_step_are_refused_by_name(
    runner_cli, lora_run: Path, tmp_path: Path
) -> None:
    """A run that logs every second step: `--steps 1` would compare no loss, so it is refused
    before anything is re-run, with the value that works."""
    run = lora_run
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


@pytest.mark.long  # stopped mid-run, trained twice
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
    # A sweep's directory names its jobs: it said "not a run directory" alone.
    (tmp_path / "0").mkdir()
    RunDir(tmp_path / "0").write_status("completed", step=4, total_steps=4)
    (tmp_path / "multirun.yaml").write_text("{}")  # as Hydra's sweeper writes it
    sweep = runner_cli("repro", str(tmp_path))
    assert sweep.returncode == 2 and sweep.stderr == (
        f"error: RUN_DIR='{tmp_path}': a sweep directory, not a run: give one of its jobs "
        f"({tmp_path / '0'}, ...; `runner runs {tmp_path}` lists them)\n"
    )


def test_repro_of_a_job_that_failed_before_its_recipe_says_so(runner_cli, tmp_path: Path) -> None:
    """A sweep's job failed at its checks keeps its directory, with no recipe.yaml: repro said
    it was no directory `runner train` made."""
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")  # no record (an empty file is refused before the sweep starts)
    sweep = tmp_path / "sweep"
    data = ["dataset=instruct", f"dataset.source={empty}", f"hydra.sweep.dir={sweep}"]
    trained = runner_cli("train", "-m", *QUICK, "max_steps=2", *data)
    assert trained.returncode == 1 and "job 0 failed" in trained.stdout, trained.stderr[-3000:]
    result = runner_cli("repro", str(sweep / "0"))
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert result.stderr == (
        f"error: RUN_DIR='{sweep / '0'}': the run failed before it recorded its recipe "
        "(recipe.yaml): nothing to re-run; fix what its status.json error says and train it "
        "again\n"
    )
    assert sorted(p.name for p in sweep.iterdir() if p.is_dir()) == ["0"]  # no re-run's dir


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


def test_a_manifest_cut_short_is_named_before_anything_is_written(
    one_process_run: Path, runner_cli, tmp_path: Path
) -> None:
    """A copy interrupted, or a power cut that kept a rename without its data: resume, repro
    and a run continued from it (load_checkpoint.path) each ended in a JSONDecodeError
    traceback, repro's after it had made its re-run's directory."""
    run = tmp_path / "run"
    shutil.copytree(one_process_run, run)
    status = json.loads((run / "status.json").read_text())
    (run / "status.json").write_text(json.dumps({**status, "state": "failed"}))  # killed
    manifest = run / "manifest.json"
    os.truncate(manifest, manifest.stat().st_size // 2)
    named = f"{manifest}: cannot be read (cut short, or not runner's: "

    with pytest.raises(UserError) as refused:
        repro(run, steps=None, tolerance=None, out=tmp_path / "rerun")
    assert str(refused.value).startswith(named)
    assert str(refused.value).endswith(
        f"put back a whole copy, or move it aside (mv {manifest} {manifest}.damaged) to go on "
        "without it: runner resume then trains by recipe.yaml unchecked against it, and runner "
        "repro cannot re-run the run"
    )
    assert not (tmp_path / "rerun").exists()

    result = runner_cli("resume", str(run))
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert f"error: {named}" in result.stderr

    recipe = yaml.safe_load((run / "recipe.yaml").read_text())
    continued = tmp_path / "continued"
    result = runner_cli(
        "train",
        *SHORT,
        "max_steps=6",
        f"dataset.source={recipe['dataset']['source']}",
        f"dataset.validation.source={recipe['dataset']['validation']['source']}",
        f"load_checkpoint.path={run}",
        f"hydra.run.dir={continued}",
    )
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert f"error: {named}" in result.stderr
    assert not continued.exists()


def test_a_recipe_cut_short_is_named_by_the_keys_it_lacks(
    one_process_run: Path, runner_cli, tmp_path: Path
) -> None:
    """A recipe.yaml cut after `format:` (a copy stopped midway): repro, `runner train
    resume=RUN` and a run trained again by its own command ended in omegaconf's traceback
    "Incompatible value 'None' for field of type 'str'"; runner resume alone named the keys."""
    run = tmp_path / "run"
    shutil.copytree(one_process_run, run)
    recipe = (run / "recipe.yaml").read_text()
    (run / "recipe.yaml").write_text(recipe[: recipe.index("\n  format:") + len("\n  format:")])
    lacks = f"{run / 'recipe.yaml'}: lacks "

    with pytest.raises(UserError, match=f"^{lacks}"):
        repro(run, steps=None, tolerance=None, out=tmp_path / "rerun")
    assert not (tmp_path / "rerun").exists()
    result = runner_cli("train", f"resume={run}")
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert f"error: {lacks}" in result.stderr
    # Where no manifest.json names what it lacks, the recipe itself says it does not read.
    with pytest.raises(UserError, match=r"does not read as a recipe \(dataset.format: "):
        read_recipe(run / "recipe.yaml")


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


def best_capability(hermetic_env: dict[str, str]) -> str:
    """The ATen kernel capability torch picks on this machine by itself (avx2, avx512, ...)."""
    if "ATEN_CPU_CAPABILITY" not in os.environ:  # this process's torch picked it by itself
        import torch

        return torch.backends.cpu.get_cpu_capability().lower()
    env = {k: v for k, v in hermetic_env.items() if k != "ATEN_CPU_CAPABILITY"}
    probe = "import torch; print(torch.backends.cpu.get_cpu_capability())"
    proc = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True)
    return proc.stdout.strip().lower()


@pytest.mark.long
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


@pytest.mark.long  # trained twice, on two kernel paths
def test_repro_on_another_kernel_path_compares_within_a_tolerance(
    runner_cli, tmp_path: Path, hermetic_env
) -> None:
    """Recorded on the machine's best kernels with one thread, not deterministic; re-run on the
    portable kernels with two: repro names both differences and compares loosely. (Recorded in
    the forked CLI, whose server imported torch on the best kernels: only the re-run needs an
    interpreter of its own, which ATEN_CPU_CAPABILITY, read as torch loads, asks for.)"""
    run = train_on_own_data(runner_cli, tmp_path, "compute=cpu", short=NOT_DETERMINISTIC)
    best = best_capability(hermetic_env)
    result = runner_cli(
        "repro",
        str(run),
        "--out",
        str(tmp_path / "again"),
        env={"ATEN_CPU_CAPABILITY": "default", "OMP_NUM_THREADS": "2"},
    )
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert f"kernels.cpu_capability {best.upper()} -> DEFAULT" in result.stdout
    assert "kernels.intra_op_threads 1 -> 2" in result.stdout
    assert "largest relative difference of loss:" in result.stdout
    assert "repro: match (4 logged steps; within 0.01" in result.stdout


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


def test_a_moved_lora_run_on_a_seeded_base_keeps_its_base_with_it(
    runner_cli, lora_run: Path, tmp_path: Path
) -> None:
    """The base a LoRA run writes from the seed (RUN/base_model) goes with the run: its re-run
    wrote it again at the moved run's old path, outside --out, and an exported adapter named
    that old path, where peft found nothing."""
    run = tmp_path / "moved"
    lora_run.rename(run)
    try:
        moved_lora_run_keeps_its_base(runner_cli, tmp_path, lora_run, run)
    finally:  # the run is shared: where it was, whatever happened here
        run.rename(lora_run)


def moved_lora_run_keeps_its_base(runner_cli, tmp_path: Path, trained: Path, run: Path) -> None:
    """`run`, moved from `trained`: re-run, and exported as an adapter."""
    again = tmp_path / "again"
    result = runner_cli("repro", str(run), "--out", str(again))
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    # Its steps 2 and 4 logged, its step-4 adapter saved: the re-run trained on the same base.
    assert "repro: match (2 logged steps; hashes of 1 checkpoint(s)" in result.stdout
    assert (again / "base_model" / "model.safetensors").is_file() and not trained.exists()

    out = tmp_path / "adapter"
    result = runner_cli("export", f"checkpoint={run}", "format=adapter", f"out={out}")
    assert result.returncode == 0, result.stderr[-3000:]
    named = json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"]
    assert named == str((run / "base_model").resolve())
