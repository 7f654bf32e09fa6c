"""`runner repro`'s comparisons of a record and its re-run, on records made here: losses to the
last bit, metrics within a tolerance, how the runs ended, the config and the hashes (an older
runner's too), the kernel path a re-run ran on, and where a sweep job's re-run goes."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from runner.job.repro import (
    Drift,
    _rerun_dir,
    compare_ends,
    compare_losses,
    compare_metrics,
    compare_records,
    kernel_path,
    print_report,
)
from runner.rundir import RunDir, Status
from runner.rundir.manifest import sha256_file, weights_sha256


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


def test_a_sweep_jobs_rerun_goes_beside_the_sweep(tmp_path: Path) -> None:
    """Inside the sweep directory, a re-run would be listed, and deployed, as one of its jobs."""
    sweep = tmp_path / "16-38-44"
    (sweep / "0").mkdir(parents=True)
    assert _rerun_dir(RunDir(sweep / "0"), None).path.name.startswith("0-repro-")
    (sweep / "multirun.yaml").write_text("{}\n")
    rerun = _rerun_dir(RunDir(sweep / "0"), None).path
    assert rerun.parent == tmp_path and rerun.name.startswith("16-38-44-0-repro-"), rerun
