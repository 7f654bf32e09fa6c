"""Composed Hydra config -> the ONE recipe config the training processes read.

Every check of user input happens before a process starts, each section's in its own module
(runner.config.runtime, .model, .dataset, .method, .optimizer, .loss, .compute, .evaluation):
each failure is a UserError naming the key, the value and the fix. Here the sections are put
together into the recipe (runner.config.schema.Recipe).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import fields
from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from runner.components import plain_dict
from runner.config.compute import ComputeRecipe, Dtype, resolve_compute, resolve_dtype
from runner.config.dataset import (
    DatasetRecipe,
    check_attention,
    check_packing,
    check_stream_steps,
    loader_workers,
    padding_free,
    resolve_dataset,
)
from runner.config.evaluation import resolve_eval, resolve_objective
from runner.config.fields import check_chosen, decode_hint
from runner.config.load_checkpoint import check_continued, resolve_load_checkpoint
from runner.config.loss import built_once, resolve_loss
from runner.config.method import check_method_keys, check_pairing, resolve_method
from runner.config.model import ModelRecipe, option_builder, resolve_model
from runner.config.optimizer import checked_option, resolve_optimizer, warn_long_warmup
from runner.config.runtime import check_env_set, resolve_runtime
from runner.config.schema import Recipe, Train, Training, typed
from runner.config.secrets import refuse_tokens
from runner.errors import UserError
from runner.hub.download import Hub, localize


def resolve_recipe(
    cfg: DictConfig,
    run_dir: Path,
    overrides: Sequence[str] = (),
    fetch: bool = True,
    gpus_here: bool = True,
) -> DictConfig:
    """The recipe (runner.config.schema.Recipe) of a composed `train` config.

    hf:// sources become local paths in the cache, downloaded if need be; `overrides` make the
    `runner download ...` command that an error about a missing source names. fetch=False (a
    dry run such as `runner estimate`) takes only what is cached and resolves a model whose
    source is not on this machine from its option's builder alone (tokenizer and config.json
    left unresolved: None). gpus_here=False (`runner estimate`, which prices a layout and runs
    nothing) takes a GPU layout as given, without holding it to the GPUs this machine shows.
    """
    with _decode_hints(cfg):
        return _recipe(cfg, run_dir, overrides, fetch, gpus_here)


def typed_train(cfg: DictConfig, overrides: Sequence[str] = ()) -> DictConfig:
    """The checks of resolve_recipe that read no file and import nothing heavy: every group
    chosen, every key one the method reads, every value of its type and in its bounds, the
    optimizer's own keys (lr, the schedule) as one process takes them. Returns `cfg` typed by
    the Train schema."""
    with _decode_hints(cfg):
        typed_cfg = _typed(cfg, overrides)
        checked_option(typed_cfg.optimizer, processes=1)
        return typed_cfg


@contextlib.contextmanager
def _decode_hints(cfg: DictConfig) -> Iterator[None]:
    """A value the user gave through ${oc.env:...}, which is text, refused by whichever check
    read it (a field's bound, a component's argument): the refusal says how to give it as a
    number."""
    try:
        yield
    except UserError as err:
        hint = "" if "oc.decode" in err.fix else decode_hint(cfg, err.key)
        if not hint:
            raise
        raise UserError(err.key, err.value, err.fix + hint) from err


def _typed(cfg: DictConfig, overrides: Sequence[str]) -> DictConfig:
    check_chosen(cfg, Train)
    check_method_keys(cfg.method, overrides)
    return typed(cfg)


def _recipe(
    cfg: DictConfig, run_dir: Path, overrides: Sequence[str], fetch: bool, gpus_here: bool
) -> DictConfig:
    cfg = _typed(cfg, overrides)
    loaded_weights, resume_from = resolve_load_checkpoint(cfg, overrides)
    if loaded_weights is not None:
        cfg.model.source = loaded_weights
    check_pairing(cfg.method.name, cfg.dataset)
    compute = resolve_compute(cfg.compute, overrides, gpus_here)
    optimizer = resolve_optimizer(cfg.optimizer, compute.nproc_per_node * compute.nnodes)
    warn_long_warmup(optimizer, cfg.max_steps)
    runtime = resolve_runtime(cfg.runtime)
    if HydraConfig.initialized():  # a Hydra app's: the environment Hydra would set the job
        check_env_set(HydraConfig.get().job.env_set)
    # Last among the checks: fetching a source is the slow part.
    hub = Hub.from_runtime(cfg.runtime, list(overrides))
    cfg, hub_sources = localize(cfg, hub, only_cached=not fetch)
    try:
        model = resolve_model(cfg.model, need_files=fetch)
    except UserError as err:
        if loaded_weights is None or err.key != "model.source":
            raise
        # The source is what load_checkpoint.path gave, which the user typed.
        raise UserError("load_checkpoint.path", cfg.load_checkpoint.path, err.fix) from None
    built_once(model.builder, "model.builder", reference=option_builder(model.name))
    loss = resolve_loss(cfg.loss)
    method = resolve_method(cfg.method, model, run_dir, compute)
    if resume_from is not None:
        check_continued(resume_from, cfg, compute, model.builder, method.builder, optimizer)
    dataset = _dataset(cfg.dataset, model, compute)
    dtype = resolve_dtype(cfg.dtype.name, compute.device)
    check_attention(cfg.attention, dataset, model, compute.device, dtype)
    evaluation = resolve_eval(cfg)
    check_stream_steps(dataset.streaming, cfg.max_steps, evaluation.strategy)
    resolved = Recipe(
        run_dir=str(run_dir.resolve()),
        seed=cfg.seed,
        model=model,
        hub_sources=dict(hub_sources),
        dataset=dataset,
        dtype=Dtype(name=dtype),
        loss=loss,
        compute=compute,
        method=method,
        optimizer=optimizer,
        runtime=runtime,
        eval=evaluation,
        objective=resolve_objective(cfg.objective, evaluation, cfg.dataset.eval_samples),
        resume_from=resume_from,
        # The training keys that belong to no group, as given (typed and bounded by Train).
        **{key.name: cfg[key.name] for key in fields(Training)},
    )
    typed_recipe: DictConfig = OmegaConf.structured(resolved)
    refuse_tokens(plain_dict(typed_recipe))  # before the recipe, written in clear, has one
    return typed_recipe


def _dataset(dataset: DictConfig, model: ModelRecipe, compute: ComputeRecipe) -> DatasetRecipe:
    """The dataset section, checked against the model (its length, its backend's batching) and
    the device (its loader workers); the tokenizer cuts samples at its max_seq_len."""
    resolved = resolve_dataset(dataset, model.builder["max_seq_len"])
    resolved.padding_free = padding_free(resolved, dataset.padding_free, model)
    check_packing(resolved.packing, model, compute.device)
    resolved.num_workers = loader_workers(dataset.num_workers, compute.device)
    if model.tokenizer is not None:
        # Samples are cut at dataset.max_seq_len (the model's when null).
        model.tokenizer["max_seq_len"] = resolved.max_seq_len
    return resolved
