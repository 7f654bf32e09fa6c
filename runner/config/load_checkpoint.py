"""load_checkpoint: a checkpoint a new run starts from, given or mounted by the platform.

`load_checkpoint.path` is either a runner run directory, which the new run continues from its
latest whole checkpoint (weights, optimizer, data position and step, read there and written in
the new run directory: mode `resume`), or a model checkpoint (config.json and safetensors
weights, as a step_N of a run or a published model is), whose weights the new run trains from as
its model.source (mode `weights`). Its default is what the platform mounted: Baseten puts the
checkpoints a job asked to load under BT_LOAD_CHECKPOINT_DIR; with one there, the job starts
from it. A run that has checkpoints of its own (a restarted job) continues from those instead.
`runner train --cfg job --resolve` shows the path and the mode.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from runner.components import plain_dict
from runner.config.fields import override_key
from runner.errors import UserError
from runner.paths import user_path
from runner.rundir import (
    RECIPE_FILE,
    TRAINING_STATE_FILE,
    RunDir,
    checkpoint_problem,
    is_run_dir,
    is_sweep_dir,
    no_training_state,
)

MOUNT_VAR = "BT_LOAD_CHECKPOINT_DIR"
MODES = ("resume", "weights")

log = logging.getLogger(__name__)


def _mode(path: Path) -> str | None:
    """resume (a run directory), weights (a model checkpoint) or None (neither)."""
    if is_run_dir(path) and (path / RECIPE_FILE).is_file():
        return "resume"
    if (path / "config.json").is_file() and any(path.glob("*.safetensors")):
        return "weights"
    return None


def mounted() -> str | None:
    """load_checkpoint.path's default: the one checkpoint under BT_LOAD_CHECKPOINT_DIR (the
    mount itself or a directory up to two levels below it), or None where nothing is mounted."""
    mount = os.environ.get(MOUNT_VAR)
    if not mount or not Path(mount).is_dir():
        return None
    root = Path(mount)
    found: list[Path] = []
    level = [root]
    for _ in range(3):
        below = []
        for path in level:
            if _mode(path) is not None:
                found.append(path)
            elif path.is_dir():
                below.extend(sorted(p for p in path.iterdir() if p.is_dir()))
        level = below
    if len(found) > 1:
        raise UserError(
            "load_checkpoint.path",
            f"${{{MOUNT_VAR}}}={mount}",
            f"{len(found)} checkpoints are mounted there ({', '.join(map(str, found))}); "
            "name the one to start from: load_checkpoint.path=PATH",
        )
    return str(found[0]) if found else None


def mode(path: Any) -> str | None:
    """load_checkpoint.mode: what load_checkpoint.path is (None where it is null)."""
    if path is None:
        return None
    found = _mode(user_path(path))
    if found is None and is_sweep_dir(user_path(path)):
        raise UserError(
            "load_checkpoint.path",
            path,
            "a sweep dir: name the run of it to start from (SWEEP/N; its summary.md ranks them)",
        )
    if found is None:
        raise UserError(
            "load_checkpoint.path",
            path,
            "neither a runner run directory (with recipe.yaml and status.json) nor a model "
            "checkpoint (config.json and *.safetensors); give one of those, or null",
        )
    return found


def latest_whole_checkpoint(run: Path) -> tuple[int, Path]:
    """(step, path) of the newest whole checkpoint of a loaded run, read-only (a mount is not
    ours to tidy)."""
    for step, checkpoint in reversed(RunDir(run).checkpoints()):
        problem = checkpoint_problem(checkpoint)
        if not problem:
            return step, checkpoint
        log.warning("checkpoint %s is damaged, skipped: %s", checkpoint, problem)
    raise UserError(
        "load_checkpoint.path",
        str(run),
        "the run has no whole checkpoint to continue from; give a run that saved one, or null",
    )


def resolve_load_checkpoint(
    cfg: DictConfig, overrides: Sequence[str]
) -> tuple[str | None, str | None]:
    """(model.source, resume_from) that load_checkpoint makes: the weights to train from in place
    of the model option's source, or the checkpoint of another run to continue from."""
    section = cfg.load_checkpoint
    if section.path is None:
        return None, None
    path = user_path(section.path).resolve()
    found = mode(path)
    if section.mode not in MODES or (section.mode == "resume" and found != "resume"):
        raise UserError(
            "load_checkpoint.mode",
            section.mode,
            f"load_checkpoint.path={path} is a {'run' if found == 'resume' else 'model checkpoint'}"
            f"; give {' or '.join(MODES) if found == 'resume' else 'weights'} (or leave the "
            "default, which is what the path is)",
        )
    given = [o for o in overrides if override_key(o) == "model.source"]
    if given:
        raise UserError(
            "load_checkpoint.path",
            str(path),
            f"{given[0]} names the weights to start from too; set load_checkpoint.path=null "
            "to train from model.source, or drop model.source",
        )
    if section.mode == "weights":
        if found == "resume":  # the weights of the run's latest whole checkpoint
            _, path = _whole_weights(path)
        return str(path), None
    step, checkpoint = latest_whole_checkpoint(path)
    if not (checkpoint / TRAINING_STATE_FILE).is_file():
        raise no_training_state(checkpoint)
    loaded = OmegaConf.load(path / RECIPE_FILE)
    _check_continuable(path, step, checkpoint, cfg, loaded.method.name)
    # The model the loaded run trained: a LoRA adapter's base, DPO's reference (its own
    # RUN/base_model where it started from the seed), a full run's source.
    return loaded.method.base_model_dir or loaded.model.source, str(checkpoint)


def _whole_weights(run: Path) -> tuple[int, Path]:
    """(step, path) of a loaded run's latest whole checkpoint, which holds the whole model's
    weights (a LoRA run's holds its adapter alone, unless method.save_merged)."""
    step, checkpoint = latest_whole_checkpoint(run)
    if _mode(checkpoint) != "weights":
        raise UserError(
            "load_checkpoint.mode",
            "weights",
            f"load_checkpoint.path={run} saved a LoRA adapter, not the whole model's weights: "
            f"export them merged (runner export checkpoint={run} format=merged) and give that "
            "as load_checkpoint.path, or continue the run by its method (load_checkpoint.mode="
            "resume)",
        )
    return step, checkpoint


# The adapter's arguments, as the method recipe names them, by the key a user gives each with:
# an adapter of another shape loads into no other (a traceback), and another alpha scales the
# trained adapter's output by another factor, a model that never trained. (Its dropout, which
# acts in training alone, may change.)
ADAPTER_KEYS = {
    "lora_rank": "method.rank",
    "lora_alpha": "method.alpha",
    "lora_attn_modules": "method.lora_attn_modules",
    "apply_lora_to_mlp": "method.apply_lora_to_mlp",
    "apply_lora_to_output": "method.apply_lora_to_output",
    "quantize_base": "method.quantize_base",
}


def check_continued(
    resume_from: str,
    cfg: DictConfig,
    compute: Any,
    builder: dict[str, Any],
    adapter: dict[str, Any] | None,
    optimizer: Any,
) -> None:
    """A continued run trains by the loaded run's global batch (check_same_global_batch), on
    a model of its shape (its checkpoint's weights load into no other), a LoRA run on an
    adapter of its arguments (ADAPTER_KEYS), and with its optimizer: the checkpoint's
    optimizer and schedule state go on, and a new optimizer.lr was recorded but never trained
    with."""
    run = Path(resume_from).parents[1]  # RUN/checkpoints/step_N
    recorded = OmegaConf.load(run / RECIPE_FILE)
    check_same_global_batch(f"load_checkpoint.path={run}", recorded, cfg, compute)
    key, was, now = _first_difference(recorded.model.builder, builder)
    if key is not None:
        raise UserError(
            "load_checkpoint.path",
            str(run),
            f"a run of model.builder.{key}={was}, where this run's model has {now}; continue "
            "it with its model as it recorded it, or train this model from its own start "
            "(load_checkpoint.path=null)",
        )
    fresh = (
        "load_checkpoint.mode=weights"
        if _mode(Path(resume_from)) == "weights"
        # An adapter alone: mode=weights refuses it (_whole_weights), as its fix says.
        else f"export it merged (runner export checkpoint={run} format=merged) and give "
        "that as load_checkpoint.path"
    )
    was_adapter = plain_dict(recorded.method.builder) if recorded.method.builder else {}
    for name, key in ADAPTER_KEYS.items():
        if (adapter or {}).get(name) != was_adapter.get(name):
            raise UserError(
                key,
                (adapter or {}).get(name),
                f"load_checkpoint.path={run} trained an adapter of {key}={was_adapter.get(name)}, "
                "which its checkpoint goes on with; leave it as it was, or start a new adapter "
                f"on its weights: {fresh}",
            )
    key, was, now = _first_difference(recorded.optimizer, optimizer)
    if key is not None:
        raise UserError(
            f"optimizer.{key}",
            now,
            f"load_checkpoint.path={run} trained with optimizer.{key}={was}, which its "
            "checkpoint's optimizer state goes on with; leave it as it was, or start from its "
            f"weights with a new optimizer: {fresh}",
        )


def _first_difference(recorded: DictConfig, given: dict[str, Any]) -> tuple[str | None, Any, Any]:
    """The first key (sorted) whose value differs, with the recorded and the given value."""
    loaded = OmegaConf.to_container(recorded)
    assert isinstance(loaded, dict)
    for key in sorted(set(loaded) | set(given)):
        if loaded.get(key) != given.get(key):
            return key, loaded.get(key), given.get(key)
    return None, None, None


def _check_continuable(
    run: Path, step: int, checkpoint: Path, cfg: DictConfig, method: str
) -> None:
    """A run continued from another's checkpoint trains by its method and on past its step:
    another method's checkpoint holds other weights (an adapter, or none), and a max_steps at or
    below its step would train nothing and save no checkpoint."""
    if method != cfg.method.name:
        raise UserError(
            "method",
            cfg.method.name,
            f"load_checkpoint.path={run} is a method={method} run, continued only by method="
            f"{method}"
            + f"; or start a method={cfg.method.name} run from its weights: "
            + (
                "load_checkpoint.mode=weights"
                if _mode(checkpoint) == "weights"  # what load_checkpoint.mode=weights takes
                # An adapter alone: merged onto its base, it is a model to start from.
                else f"export them merged (runner export checkpoint={run} format=merged) and "
                "give that as load_checkpoint.path"
            ),
        )
    if cfg.max_steps is not None and cfg.max_steps <= step:
        raise UserError(
            "max_steps",
            cfg.max_steps,
            f"load_checkpoint.path={run} is already at step {step}: give max_steps above "
            f"{step} to train on from it"
            + (
                ", or load_checkpoint.mode=weights to start afresh from its weights"
                if _mode(checkpoint) == "weights"
                else ""
            ),
        )


def global_batch(batch: Any, compute: Any) -> tuple[int, int]:
    """(samples per optimizer step, processes) of `batch`'s batch_size and
    gradient_accumulation_steps on `compute`'s layout."""
    processes = compute.nproc_per_node * compute.nnodes
    return batch.batch_size * batch.gradient_accumulation_steps * processes, processes


def check_one_global_batch(recipe: DictConfig, records: int | None) -> None:
    """An epoch is whole global batches: a training split with fewer records than one trains
    nothing, which the trainer would find only after the run had started."""
    global_batch_size, processes = global_batch(recipe, recipe.compute)
    per_batch = recipe.gradient_accumulation_steps * processes
    if records is None or records >= global_batch_size:
        return
    largest = records // per_batch
    if largest:
        fix = f"give batch_size={largest} or less"
    elif recipe.gradient_accumulation_steps > 1:
        fix = "lower gradient_accumulation_steps"
    else:  # one sample a process is more than the split holds
        fix = "train on fewer processes (compute.nproc_per_node, compute.nnodes)"
    raise UserError(
        "batch_size",
        recipe.batch_size,
        f"the training split has {records} records, fewer than one global batch of "
        f"{global_batch_size} (batch_size x gradient_accumulation_steps="
        f"{recipe.gradient_accumulation_steps} x {processes} process(es)); {fix}, or add records",
    )


def check_same_global_batch(run: str, recorded: Any, given: Any, compute: Any) -> None:
    """A checkpoint goes on over any number of processes with the global batch it trained by
    (docs/nodes.md): another would change the steps' math under those trained, and its data
    position, counted in its own batches, may fall within one of the new (a ValueError).
    `run` names the run that trained, `given` holds batch_size and gradient_accumulation_steps,
    `compute` the new layout."""
    before, processes_before = global_batch(recorded, recorded.compute)
    now, processes = global_batch(given, compute)
    if recorded.dataset.streaming and processes != processes_before:
        # Each process read its own share of the stream: refused in every worker, with a
        # traceback each, after the run's record had been rewritten to the refused layout.
        raise UserError(
            "compute.nproc_per_node",
            compute.nproc_per_node,
            f"{run} streamed its data on {processes_before} process(es), each its own share of "
            f"the records; go on with it on as many (a stream resumes only so)",
        )
    if before == now:
        return
    per_process, accumulation = divmod(before, processes * given.gradient_accumulation_steps)
    if per_process and not accumulation:
        fix = f"give batch_size={per_process} on {processes} process(es)"
    elif before % processes == 0:
        fix = f"give batch_size x gradient_accumulation_steps = {before} / {processes} process(es)"
    else:
        fix = f"run it on a number of processes that divides {before}"
    raise UserError(
        "batch_size",
        given.batch_size,
        f"{run} trained with a global batch of {before} samples a step (batch_size="
        f"{recorded.batch_size} x gradient_accumulation_steps="
        f"{recorded.gradient_accumulation_steps} x {processes_before} process(es)); "
        f"this layout makes {now}, which would change the math of the steps left: {fix}",
    )
