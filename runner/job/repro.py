"""`runner repro RUN_DIR`: re-run a recorded run and fail on drift (for CI).

Exit codes: 0 the re-run matches, 1 drift (numbers or record differ), 2 a user error.
"""

from __future__ import annotations

import math
import shutil
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from runner.config.method import move_recipe
from runner.config.schema import read_recipe, recipe_as_written, write_recipe
from runner.errors import UserError, diverged
from runner.job.launch import as_launcher, launch
from runner.job.lifecycle import check_recipe_whole
from runner.rundir import (
    ACTIVE_STATES,
    ADAPTER_CONFIG_FILE,
    RECIPE_FILE,
    STALLED,
    STATUS_FILE,
    STOPPING,
    RunDir,
    Status,
    is_run_dir,
    is_sweep_dir,
    its_jobs_instead,
)
from runner.rundir.manifest import (
    MANIFEST_FILE,
    build_manifest,
    config_differences,
    dotted,
    hashed_config,
    read_manifest,
    write_manifest,
)

MAX_ROWS = 20
# The relative tolerance of a re-run on another kernel path when none is given: the float noise
# of another reduction order starts near 1e-7 and grows over a run's steps; a changed recipe
# (learning rate, data, model) moves losses by far more within a few steps.
CROSS_PATH_TOLERANCE = 1e-2
# Metrics that measure the machine rather than the computation.
TIMING_METRICS = ("tokens_per_s",)


@dataclass(frozen=True)
class Drift:
    """One difference between the recorded run and its re-run."""

    what: str
    recorded: Any
    rerun: Any


def _diff(what: str, recorded: Any, rerun: Any) -> list[Drift]:
    a, b = dotted(recorded), dotted(rerun)
    keys = sorted(set(a) | set(b))
    return [
        Drift(f"{what}.{k}" if k else what, a.get(k), b.get(k))
        for k in keys
        if a.get(k) != b.get(k)
    ]


def compare_losses(
    recorded: dict[int, float], rerun: dict[int, float], tolerance: float = 0.0
) -> list[Drift]:
    """Per-step losses, equal (tolerance 0) or within `tolerance` at the steps both logged; a
    step that one side logged and the other did not is drift too (a golden file of other steps
    than the run's matched on the steps they shared)."""
    steps = sorted(set(recorded) & set(rerun))
    if not steps:
        return [Drift("losses", sorted(recorded)[:5], sorted(rerun)[:5])]
    drifts, _ = compare_metrics(
        [{"step": s, "loss": recorded[s]} for s in steps],
        [{"step": s, "loss": rerun[s]} for s in steps],
        tolerance,
    )
    one_side = sorted(set(recorded) ^ set(rerun))
    return drifts + [Drift(f"loss at step {s}", recorded.get(s), rerun.get(s)) for s in one_side]


def _differs(a: float, b: float, tolerance: float) -> bool:
    """Unequal (tolerance 0), or further apart than `tolerance` relative; NaN always differs."""
    if tolerance == 0:
        return a != b
    return not abs(a - b) <= tolerance * max(abs(a), abs(b))


def compare_metrics(
    recorded: list[dict[str, Any]],
    rerun: list[dict[str, Any]],
    tolerance: float,
    cut_at: int | None = None,
) -> tuple[list[Drift], dict[str, float]]:
    """Every metric of metrics.jsonl, within a relative `tolerance`; a value that one side
    logged and the other did not is drift too (a re-run that no longer evaluates, or logs a
    step), except at `cut_at`, the step a re-run was cut short at, which it logs as its last.

    Returns the drifts and the largest relative difference of each metric.
    """
    was, now = _by_step(recorded), _by_step(rerun)
    logged = {metric for _, metric in was}  # not a metric runner logs since it recorded the run
    drifts: list[Drift] = []
    largest: dict[str, float] = {}
    for step, metric in sorted(set(was) | {key for key in now if key[1] in logged}):
        a, b = was.get((step, metric)), now.get((step, metric))
        if a is None or b is None:
            if step != cut_at:
                drifts.append(Drift(f"{metric} at step {step}", a, b))
            continue
        relative = abs(a - b) / max(abs(a), abs(b), 1e-12)
        largest[metric] = max(largest.get(metric, 0.0), relative)
        if _differs(a, b, tolerance):
            drifts.append(Drift(f"{metric} at step {step}", a, b))
    return drifts, largest


def _by_step(rows: list[dict[str, Any]]) -> dict[tuple[int, str], float]:
    """metrics.jsonl's values by (step, metric), without those that measure the machine."""
    return {
        (row["step"], metric): value
        for row in rows
        for metric, value in row.items()
        if metric != "step" and metric not in TIMING_METRICS
    }


def kernel_path(manifest: dict[str, Any]) -> dict[str, Any]:
    """What decides the float arithmetic of a run: device, CPU kernels, intra-op threads."""
    kernels, hardware = manifest.get("kernels") or {}, manifest["hardware"]
    return {
        "hardware.device": hardware["device"],
        # Another GPU model runs other kernels (a CPU's are told by its capability).
        "hardware.name": hardware["name"] if hardware["device"] == "cuda" else None,
        "kernels.cpu_capability": kernels.get("cpu_capability"),
        "kernels.intra_op_threads": kernels.get("intra_op_threads"),
    }


def compare_records(
    recorded: dict[str, Any],
    rerun: dict[str, Any],
    same_path: bool = True,
    written: dict[str, Any] | None = None,
) -> list[Drift]:
    """What differs in the manifests: config, data, tokenizer, the weights it starts from,
    packages, build, world, device.

    The config's keys are those the run recorded and those of its recipe.yaml as `written`
    (an edit adds one), not one a later runner added at its default, nor a value redacted.
    With `same_path` false (a re-run on another kernel path, compared within a tolerance), the
    kernel path and the checkpoint hashes are expected to differ and are not drift.
    """
    keys = set(dotted(hashed_config(recorded["config"])))
    if written is not None:
        keys |= set(dotted(hashed_config(written)))
    drifts = [
        Drift(f"config.{key}", was, now)
        for key, was, now in config_differences(recorded["config"], rerun["config"], keys)
    ]
    for key in (
        "tokenizer_sha256",
        "packages",
        "python",
        "torch_build",
        "world_size",
        "deterministic",
    ):
        drifts += _diff(key, recorded[key], rerun[key])
    for key in ("weights_sha256", "load_checkpoint_sha256"):  # recorded since 2026-11-30
        if key in recorded:
            drifts += _diff(key, recorded[key], rerun[key])
    for split in sorted(set(recorded["data"]) | set(rerun["data"])):
        drifts += _diff(
            f"data.{split}.sha256",
            recorded["data"].get(split, {}).get("sha256"),
            rerun["data"].get(split, {}).get("sha256"),
        )
    if not same_path:
        return drifts
    drifts += _diff("hardware.device", recorded["hardware"]["device"], rerun["hardware"]["device"])
    for step in common_checkpoints(recorded, rerun):
        drifts += _diff(
            f"checkpoint {step}",
            _without_paths(recorded["checkpoints"][step]),
            _without_paths(rerun["checkpoints"][step]),
        )
    return drifts


def _without_paths(hashes: dict[str, str]) -> dict[str, str]:
    """A checkpoint's file hashes, but a LoRA adapter's config's, which names its base by the
    absolute path (the run's own base_model moves with it: move_recipe); its other fields are
    the config's, compared as such."""
    return {name: digest for name, digest in hashes.items() if name != ADAPTER_CONFIG_FILE}


def common_checkpoints(recorded: dict[str, Any], rerun: dict[str, Any]) -> list[str]:
    """The steps of the checkpoints that both manifests hold hashes of, in order."""
    return sorted(set(recorded["checkpoints"]) & set(rerun["checkpoints"]), key=int)


def print_report(drifts: list[Drift], compared: str) -> None:
    """One line on a match; on drift, a table of what differs, recorded beside re-run."""
    if not drifts:
        print(f"repro: match ({compared})")
        return
    width = max(len(d.what) for d in drifts[:MAX_ROWS])
    print(f"repro: DRIFT, {len(drifts)} difference(s)")
    print(f"{'what':<{width}}  {'recorded':>24}  {'re-run':>24}")
    for d in drifts[:MAX_ROWS]:
        print(f"{d.what:<{width}}  {str(d.recorded):>24.24}  {str(d.rerun):>24.24}")
    if len(drifts) > MAX_ROWS:
        print(f"... and {len(drifts) - MAX_ROWS} more")
    for d in drifts[:MAX_ROWS]:  # in full, where the table cut a value short
        if max(len(str(d.recorded)), len(str(d.rerun))) > 24:
            print(f"{d.what}: recorded {d.recorded}; re-run {d.rerun}")


def repro(run_dir: Path, *, steps: int | None, tolerance: float | None, out: Path | None) -> int:
    """Re-runs the recorded recipe of `run_dir` into a new run directory and compares.

    A deterministic run, or a re-run on the recorded kernel path, must match exactly (or within
    `tolerance` if one is given). A run that was not deterministic, re-run where the device,
    CPU kernels or thread count differ, is compared within `tolerance` (default
    CROSS_PATH_TOLERANCE), and repro says what differs.
    """
    recorded = RunDir(run_dir)
    failed = is_run_dir(recorded.path) and recorded.effective_state()[0] == "failed"
    if failed and not recorded.recipe_path.is_file():  # a sweep's job, failed at its checks
        raise UserError(
            "RUN_DIR",
            str(run_dir),
            f"the run failed before it recorded its recipe ({RECIPE_FILE}): nothing to re-run; "
            f"fix what its {STATUS_FILE} error says and train it again",
        )
    sweeps = its_jobs_instead(recorded.path) if not recorded.recipe_path.is_file() else None
    if sweeps:  # said only "not a run directory"
        raise UserError("RUN_DIR", str(run_dir), sweeps)
    if not (recorded.recipe_path.is_file() and (recorded.path / MANIFEST_FILE).is_file()):
        raise UserError(
            "RUN_DIR",
            str(run_dir),
            "not a run directory with recipe.yaml and "
            f"{MANIFEST_FILE}; give a directory `runner train` made",
        )
    read_manifest(recorded)  # one cut short is refused before the re-run's directory is made
    if steps is not None and steps < 1:
        raise UserError("--steps", steps, "give a number of steps >= 1")
    if tolerance is not None and not 0 <= tolerance < math.inf:  # nan fails both
        raise UserError("--tolerance", tolerance, "give a finite relative tolerance >= 0")
    state, _ = recorded.effective_state()
    if state in ACTIVE_STATES or state in (STALLED, STOPPING):
        # It was re-run as far as the status said at that moment, beside the run, on its cores.
        raise UserError(
            "RUN_DIR",
            str(run_dir),
            f"the run is {state} (process {recorded.status().pid}); re-run it once it has ended: "
            f"wait for it, or `runner stop {run_dir}`",
        )
    rerun = _rerun_dir(recorded, out)  # named, not made yet
    check_recipe_whole(recorded)  # cut short, it read with the keys it lacks at their defaults
    recipe = read_recipe(recorded.recipe_path)
    nodes = recipe.compute.nnodes
    if nodes > 1:
        # Re-run here alone, it waited out the rendezvous for the other nodes (15 minutes).
        raise UserError(
            "RUN_DIR",
            str(run_dir),
            f"{nodes} nodes trained it, and repro re-runs on this machine alone; re-run it on "
            f"{nodes} nodes, each `runner train` with the overrides its manifest.json records "
            "and a new hydra.run.dir, and compare the two runs' metrics.jsonl",
        )
    _check_inputs_there(recorded, recipe)
    reached = recorded.status().step
    # Where --steps cuts the re-run short of the run, it logs that step as its last.
    cut_at = steps if steps is not None and reached is not None and steps < reached else None
    steps = _stop_step(recorded, steps)
    _check_logged(recorded, steps, log_every=recipe.runtime.log_every_n_steps)
    try:
        _rerun(recorded, recipe, steps, rerun)
    except (UserError, SystemExit):
        again = rerun.status()
        if again.state == "created":  # refused before it trained: nothing to keep
            shutil.rmtree(rerun.path, ignore_errors=True)
        if again.state != "failed":  # that, or stopped
            raise
        # A failure in training is compared as a result: reproduced where the run failed so
        # too (its loss diverged at the same step), drift where it did not (compare_ends).
        alike = not compare_ends(recorded.status(), again)
        print(
            f"repro: the re-run failed{' as the run did' if alike else ''}, at step "
            f"{again.step}: {again.error}"
        )
    print(f"re-run directory: {rerun.path}")
    return _compare(recorded, rerun, steps, tolerance, cut_at)


def compare_ends(recorded: Status, rerun: Status) -> list[Drift]:
    """How the runs ended, where either failed: a re-run fails at the same step with the same
    error as the run did, or neither fails. A run ended from outside (a process killed, a node
    lost, memory run out) is matched by a re-run that goes as far: its steps are compared."""
    from runner.trainer.process import ended_from_outside

    def end(status: Status) -> str | None:
        failed = status.state == "failed"
        return f"failed at step {status.step}: {status.error}" if failed else None

    def alike(status: Status) -> str | None:
        # A loss gone nan or inf at a step is the run's own computation's, however its error
        # was worded when it was recorded (an older runner put "Diverged: " before it).
        return f"diverged at step {status.step}" if diverged(status.error or "") else end(status)

    ran, again = end(recorded), end(rerun)
    if alike(recorded) == alike(rerun) or (ran and again is None and ended_from_outside(ran)):
        return []
    return [Drift("end", ran or recorded.state, again or rerun.state)]


def _stop_step(recorded: RunDir, steps: int | None) -> int | None:
    """Where the re-run stops: after `steps` (None: the whole recipe), and never past the step
    that the recorded run reached (one stopped or failed early went no further)."""
    status = recorded.status()
    reached = status.step
    if reached is None or (steps is not None and steps <= reached):
        return steps
    if status.total_steps is not None and reached < status.total_steps:
        print(
            f"repro: the run stopped at step {reached} of {status.total_steps} "
            f"({status.state}): the re-run stops there too"
        )
    return reached


def _check_logged(recorded: RunDir, steps: int | None, *, log_every: int) -> None:
    """Refuses a re-run that ends before the recorded run's first logged loss: it would log no
    step to compare (a run logs every `log_every` steps, and its last)."""
    logged = sorted(recorded.losses())
    if logged and (steps is None or logged[0] <= steps):
        return
    if not logged:
        raise UserError(
            "RUN_DIR",
            str(recorded.path),
            f"the run logged no loss (runtime.log_every_n_steps={log_every}), so a re-run "
            "compares none; repro a run that logged a step",
        )
    raise UserError(
        "--steps",
        steps,
        f"the run logged its first loss at step {logged[0]} (runtime.log_every_n_steps="
        f"{log_every}), so {steps} step(s) compare no loss; give --steps {logged[0]} or more",
    )


def _check_inputs_there(recorded: RunDir, recipe: DictConfig) -> None:
    """The local files the run read (weights, tokenizer, data, a checkpoint it went on from)
    are where it read them: refused before the re-run's directory is made, where the re-run
    failed inside it, on a key the user never typed (model.tokenizer, for a moved source)."""
    from runner.data.files import is_remote

    inputs = {
        "model.source": recipe.model.source,
        "model.tokenizer": recipe.model.tokenizer.path,
        "dataset.source": recipe.dataset.source,
        "dataset.validation.source": recipe.dataset.validation.source,
        "load_checkpoint.path": recipe.resume_from,
    }
    for key, path in inputs.items():
        if path is not None and not is_remote(str(path)) and not Path(path).exists():
            raise UserError(
                "RUN_DIR",
                str(recorded.path),
                f"its {key}, {path}, is no longer there (moved or deleted); put it back where "
                "the run read it to re-run the run",
            )


def _rerun_dir(recorded: RunDir, out: Path | None) -> RunDir:
    """Where the re-run trains: `out`, or a new directory beside the run (beside its sweep, for
    a sweep's job: inside, it would read as one more job); not one that exists."""
    stamp = datetime.now().strftime("%Y-%m-%d_%H-%M-%S")
    beside, name = recorded.path, recorded.path.name
    if is_sweep_dir(beside.parent):
        beside, name = beside.parent, f"{beside.parent.name}-{name}"
    rerun = RunDir(out or beside.with_name(f"{name}-repro-{stamp}"))
    if rerun.path.exists():
        raise UserError("--out", str(rerun.path), "already exists; give a new directory")
    if rerun.path.resolve().is_relative_to(recorded.path.resolve()):
        raise UserError(
            "--out", str(rerun.path), "is inside the recorded run; give a directory outside it"
        )
    return rerun


def _rerun(recorded: RunDir, recipe: DictConfig, steps: int | None, rerun: RunDir) -> None:
    """Trains the recorded recipe again, into `rerun` (_rerun_dir)."""
    as_launcher()
    try:
        rerun.path.mkdir(parents=True)
    except OSError as err:  # a file on the path, a read-only file system: a traceback, exit 1
        raise UserError(
            "--out",
            str(rerun.path),
            f"cannot make this directory ({err.strerror}); give one this user can write",
        ) from None
    # A base the run wrote from the seed (RUN/base_model) is written again, into the re-run.
    move_recipe(recipe, rerun.path)
    recipe.stop_at_step = steps
    write_recipe(rerun.recipe_path, recipe)
    overrides = read_manifest(recorded)["overrides"]
    write_manifest(rerun, build_manifest(recipe, overrides, Path.cwd()))
    rerun.write_status("created", step=0, total_steps=recipe.max_steps)
    launch(recipe, rerun.recipe_path)


def _compare(
    recorded: RunDir, rerun: RunDir, steps: int | None, tolerance: float | None, cut_at: int | None
) -> int:
    """Prints what differs between the recorded run and its re-run; 1 on drift, else 0."""
    recorded_manifest, rerun_manifest = read_manifest(recorded), read_manifest(rerun)
    recorded_path, rerun_path = kernel_path(recorded_manifest), kernel_path(rerun_manifest)
    moved = [k for k in recorded_path if recorded_path[k] != rerun_path[k]]
    same_path = recorded_manifest["deterministic"] or not moved
    if not same_path:
        tolerance = CROSS_PATH_TOLERANCE if tolerance is None else tolerance
        changes = ", ".join(f"{k} {recorded_path[k]} -> {rerun_path[k]}" for k in moved)
        print(
            f"repro: the recorded run was not deterministic and the re-run computes on another "
            f"path ({changes}); comparing metrics within a relative tolerance of {tolerance:g} "
            "(--tolerance), checkpoint hashes not compared"
        )
    tolerance = tolerance or 0.0
    # Weights whose metrics may differ within a tolerance may differ in their last bits too.
    hashes = same_path and not tolerance

    recorded_metrics = [r for r in recorded.read_metrics() if steps is None or r["step"] <= steps]
    recorded_losses = {s: v for s, v in recorded.losses().items() if steps is None or s <= steps}
    rerun_losses = rerun.losses()
    steps_compared = len(set(recorded_losses) & set(rerun_losses))
    drifts, largest = compare_metrics(
        recorded_metrics, rerun.read_metrics(), tolerance, cut_at=cut_at
    )
    if steps_compared == 0:  # no step to compare: compare_losses names what each logged
        drifts = compare_losses(recorded_losses, rerun_losses) + drifts
    drifts += compare_ends(recorded.status(), rerun.status())
    written = recipe_as_written(recorded.recipe_path)  # an edit's keys too
    drifts += compare_records(recorded_manifest, rerun_manifest, hashes, written)
    if tolerance:
        for metric, relative in sorted(largest.items()):
            print(f"largest relative difference of {metric}: {relative:.3g}")
    checkpoints = len(common_checkpoints(recorded_manifest, rerun_manifest))
    if not hashes:
        agreed = f"within {tolerance:g}; checkpoint hashes not compared; record agrees"
    elif checkpoints:
        agreed = f"hashes of {checkpoints} checkpoint(s) and record agree"
    else:
        agreed = "no checkpoint at a step both saved, no hashes compared; record agrees"
    print_report(drifts, f"{steps_compared} logged steps; {agreed}")
    return 1 if drifts else 0
