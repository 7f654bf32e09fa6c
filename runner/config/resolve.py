"""Composed Hydra config -> the ONE recipe config the training processes read.

Every check of user input happens here, before a process starts: each failure is a UserError
naming the key, the value and the fix.
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from runner.components import resolve_component
from runner.config.interpolations import evaluates
from runner.config.loggers import check_loggers
from runner.config.model import resolve_model
from runner.config.optimizer import SCHEDULE_KEYS, split_option, state_per_weight
from runner.config.platforms import checked_int, resolve_launch
from runner.config.schema import OptimizerKeys, recipe, typed
from runner.data import (
    COLUMNS,
    CONVERSATION_STYLES,
    KINDS,
    SFT_KINDS,
    local_source,
    source_format,
)
from runner.errors import UserError
from runner.hub.download import Hub, localize
from runner.rundir.manifest import SECRET_KEY
from runner.rundir.metrics import (
    METRIC_MODES,
    PREFERENCE_METRICS,
    SFT_METRICS,
    TRAINING_METRIC_MODES,
)

log = logging.getLogger(__name__)


def resolve_device(compute: DictConfig) -> tuple[str, int]:
    """(device, processes per node) for the compute group, checked against this machine."""
    has_cuda = torch.cuda.is_available()
    device = compute.device
    if device == "auto":
        device = "cuda" if has_cuda else "cpu"
    if device not in ("cpu", "cuda"):
        raise UserError("compute.device", device, "give cpu, cuda or auto")
    if device == "cuda" and not has_cuda:
        raise UserError(
            "compute",
            "gpu",
            "no CUDA GPU is visible on this machine; use compute=cpu "
            "(or leave compute unset to pick what is here)",
        )
    nproc = compute.nproc_per_node
    if nproc == "auto":
        nproc = torch.cuda.device_count() if device == "cuda" else 1
    if isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 1:
        raise UserError("compute.nproc_per_node", nproc, "give an integer >= 1 or auto")
    if device == "cuda" and nproc > torch.cuda.device_count():
        raise UserError(
            "compute.nproc_per_node",
            nproc,
            f"only {torch.cuda.device_count()} GPU(s) are visible; give at most that many",
        )
    return device, nproc


DTYPES = ("fp32", "bf16_mixed", "bf16")


def resolve_dtype(name: str, device: str) -> str:
    """auto: mixed bf16 (fp32 master weights) on a GPU with bf16, else fp32."""
    if name == "auto":
        return "bf16_mixed" if device == "cuda" and torch.cuda.is_bf16_supported() else "fp32"
    if name not in DTYPES:
        raise UserError("dtype", name, f"choose one of: {', '.join(DTYPES)}")
    return name


# The recipe module that trains each method.
RECIPES = {
    "full": "runner.recipes.full_finetune",
    "lora": "runner.recipes.lora_finetune",
    "qlora": "runner.recipes.lora_finetune",
    "dpo": "runner.recipes.dpo",
    "lora_dpo": "runner.recipes.dpo",
    "qlora_dpo": "runner.recipes.dpo",
}
# The methods that train on preference pairs (dataset.kind=preference), and their losses.
PREFERENCE_METHODS = ("dpo", "lora_dpo", "qlora_dpo")
PREFERENCE_LOSSES = ("sigmoid", "ipo", "hinge")
LORA_ATTN_MODULES = ("q_proj", "k_proj", "v_proj", "output_proj")
# torchao's NF4: blocks of 64 weights, their scalers quantized again in blocks of 256.
NF4_WEIGHTS_PER_BLOCK = 64 * 256


def resolve_method(
    method: DictConfig,
    model_name: str,
    model: dict[str, Any],
    run_dir: Path,
    world_size: int,
    device: str,
) -> dict[str, Any]:
    """The method section of the recipe: its recipe module; for LoRA, the adapter builder and
    its arguments and the base's home; for DPO, its loss and the reference's home."""
    if method.name not in RECIPES:
        raise UserError("method.name", method.name, f"choose one of: {', '.join(RECIPES)}")
    preference = _preference(method) if method.name in PREFERENCE_METHODS else {}
    source = model["source"]
    base_model_dir = run_dir / "base_model" if source is None else Path(source)
    if method.name == "full":
        return {"name": "full", "recipe": RECIPES["full"]}
    if method.name == "dpo":
        # The frozen reference: the weights training starts from.
        return {
            "name": "dpo",
            "recipe": RECIPES["dpo"],
            "base_model_dir": str(base_model_dir.resolve()),
            **preference,
        }
    # The family names the LoRA twin of every builder it offers (runner.models.families).
    builder, lora_builder = model["builder"], model["lora_builder"]
    modules = _lora_modules(method.lora_attn_modules)
    apply_to_mlp = method.apply_lora_to_mlp
    if not modules and not apply_to_mlp:
        raise UserError(
            "method.lora_attn_modules",
            [],
            "name at least one projection, or set method.apply_lora_to_mlp=true",
        )
    apply_to_output = method.apply_lora_to_output
    if apply_to_output and builder.get("tie_word_embeddings"):
        raise UserError(
            "method.apply_lora_to_output",
            True,
            f"model={model_name} ties its output projection to the embeddings, which LoRA cannot "
            "adapt; leave it false",
        )
    quantize_base = method.quantize_base
    if quantize_base and model["backend"] == "transformers":
        _check_bitsandbytes(model, device, world_size)
    elif quantize_base:
        _check_nf4_shapes(builder, world_size)
    dropout = method.dropout
    if dropout >= 1:
        raise UserError("method.dropout", dropout, "give a probability in [0, 1)")
    return {
        "name": method.name,
        "recipe": RECIPES[method.name],
        "builder": {
            # The torchtune backend's LoRA builder; the transformers backend's adapters are peft's.
            **({"_component_": lora_builder} if lora_builder else {}),
            "lora_attn_modules": modules,
            "apply_lora_to_mlp": apply_to_mlp,
            "apply_lora_to_output": apply_to_output,
            "lora_rank": method.rank,
            "lora_alpha": method.alpha,
            "lora_dropout": dropout,
            "quantize_base": quantize_base,
        },
        # The Hugging Face base the adapter loads onto (adapter_config.json names it).
        "base_model_dir": str(base_model_dir.resolve()),
        "save_merged": method.save_merged,
        **preference,
    }


def _preference(method: DictConfig) -> dict[str, Any]:
    """The DPO loss keys, checked (beta > 0 is the schema's bound)."""
    if method.loss not in PREFERENCE_LOSSES:
        raise UserError(
            "method.loss", method.loss, f"choose one of: {', '.join(PREFERENCE_LOSSES)}"
        )
    smoothing = method.label_smoothing
    if not 0 <= smoothing < 0.5:
        raise UserError(
            "method.label_smoothing",
            smoothing,
            "give the assumed share of mislabelled pairs, in [0, 0.5)",
        )
    if smoothing and method.loss != "sigmoid":
        raise UserError(
            "method.label_smoothing",
            smoothing,
            f"only method.loss=sigmoid smooths labels; set it to 0.0 with loss={method.loss}",
        )
    return {"loss": method.loss, "beta": method.beta, "label_smoothing": smoothing}


def _check_pairing(method: str, dataset: DictConfig) -> None:
    """Preference methods train on preference pairs, supervised methods on anything else."""
    if method in PREFERENCE_METHODS and dataset.kind != "preference":
        raise UserError(
            "dataset",
            dataset.name,
            f"method={method} trains on preference pairs (a prompt, a chosen and a rejected "
            f"answer) and dataset={dataset.name} is kind={dataset.kind}: give a preference "
            "dataset (dataset=preference [dataset.source=PATH], ultrafeedback or orca_dpo)",
        )
    if method not in PREFERENCE_METHODS and dataset.kind not in SFT_KINDS:
        raise UserError(
            "method",
            method,
            f"dataset={dataset.name} holds preference pairs, which only the preference methods "
            f"train on: use method=dpo, lora_dpo or qlora_dpo (or a dataset of kind "
            f"{', '.join(SFT_KINDS)} for method={method})",
        )


def _check_bitsandbytes(model: dict[str, Any], device: str, world_size: int) -> None:
    """QLoRA of a transformers model quantizes its base with bitsandbytes, which needs CUDA (and
    one process: its 4-bit weights do not shard with FSDP2)."""
    why = None
    if device != "cuda":
        why = "bitsandbytes' 4-bit base needs a CUDA GPU, and this run is on the CPU"
    elif world_size > 1:
        why = f"bitsandbytes' 4-bit base does not shard over {world_size} processes"
    elif importlib.util.find_spec("bitsandbytes") is None:
        why = "bitsandbytes is not installed (pip install bitsandbytes)"
    if why is not None:
        raise UserError(
            "method",
            "qlora",
            f"model.source={model['source']} trains through transformers ({model['backend_reason']}"
            f"), whose QLoRA base is bitsandbytes': {why}; use method=lora",
        )


def _lora_modules(modules: Any) -> list[str]:
    """method.lora_attn_modules: distinct attention projections."""
    if not OmegaConf.is_list(modules) or len(set(modules)) != len(modules):
        raise UserError(
            "method.lora_attn_modules",
            modules,
            f"give a list of distinct names among {LORA_ATTN_MODULES}",
        )
    for name in modules:
        if name not in LORA_ATTN_MODULES:
            raise UserError(
                "method.lora_attn_modules",
                list(modules),
                f"{name!r} is not an attention projection; choose among "
                f"{', '.join(LORA_ATTN_MODULES)}",
            )
    return list(modules)


def _check_nf4_shapes(builder: dict[str, Any], world_size: int) -> None:
    """NF4 quantizes whole blocks only: every base projection needs a multiple of 16384 weights,
    and of 16384 x world size when FSDP2 shards it over the ranks."""
    embed, head_dim = builder["embed_dim"], builder["embed_dim"] // builder["num_heads"]
    shapes = {
        "model.builder.embed_dim": embed * embed,
        "model.builder.num_kv_heads": builder["num_kv_heads"] * head_dim * embed,
        "model.builder.intermediate_dim": (builder.get("intermediate_dim") or 0) * embed,
    }
    block = NF4_WEIGHTS_PER_BLOCK * world_size
    over = f" ({NF4_WEIGHTS_PER_BLOCK} x {world_size} processes)" if world_size > 1 else ""
    for key, weights in shapes.items():
        if weights % block:
            raise UserError(
                key,
                builder[key.rpartition(".")[2]],
                f"method=qlora quantizes each base projection to NF4 in blocks of {block} "
                f"weights{over}, and this one has {weights}; pick a size that makes it a "
                "multiple (e.g. model.builder.num_kv_heads=8 for model=tiny in one process), "
                "or use method=lora",
            )


# The training keys that belong to no config group (typed and bounded by runner.config.schema).
TRAINING_KEYS = (
    "max_steps",
    "epochs",
    "batch_size",
    "gradient_accumulation_steps",
    "clip_grad_norm",
    "compile",
    "activation_checkpointing",
)


def _runtime(runtime: DictConfig) -> dict[str, Any]:
    if runtime.tensorboard is not None:
        fix = "[tensorboard]" if runtime.tensorboard else "[]"
        raise UserError(
            "runtime.tensorboard",
            runtime.tensorboard,
            f"replaced by runtime.loggers: write runtime.loggers={fix}",
        )
    check_loggers(list(runtime.loggers))
    return {
        "save_every_n_steps": runtime.save_every_n_steps,
        "keep_last_n_checkpoints": runtime.keep_last_n_checkpoints,
        "log_every_n_steps": runtime.log_every_n_steps,
        "loggers": list(runtime.loggers),
        "project": runtime.project,
        "progress_bar": runtime.progress_bar,
        "deterministic": runtime.deterministic,
        "env": _plain_env(runtime.env),
    }


def _plain_env(env: DictConfig) -> dict[str, str]:
    """runtime.env is recorded in the run directory, so it may not carry secrets."""
    for key in env:
        if SECRET_KEY.search(str(key)):
            raise UserError(
                f"runtime.env.{key}",
                "<hidden>",
                "looks like a secret, and runtime.env is written to the run directory; export "
                "it in the environment of `runner train` instead (training processes inherit it)",
            )
    return {str(k): str(v) for k, v in env.items()}


def _optimizer(optimizer: DictConfig) -> dict[str, Any]:
    """The chosen option: its component, the component's arguments and the schedule keys."""
    option = OmegaConf.to_container(optimizer, resolve=True)
    if "_component_" not in option:
        raise UserError(
            "optimizer._component_", None, "name the torch.optim class, e.g. torch.optim.AdamW"
        )
    shared = ("lr", *SCHEDULE_KEYS)
    missing = [key for key in shared if key not in option]
    if missing:
        raise UserError(f"optimizer.{missing[0]}", None, "every optimizer option sets it")
    checked = typed(OmegaConf.create({k: option[k] for k in shared}), OptimizerKeys, "optimizer.")
    option.update(OmegaConf.to_container(checked))
    if "fused" in option and option["fused"] is None:
        # PyTorch's fused kernel, on CPU as on CUDA: one pass over each weight instead of a
        # dozen elementwise ops (AdamW's step is 3x faster on CPU; scripts/bench_peers.py).
        option["fused"] = True
    # Builds it once: a refused argument fails here, not in training.
    state_per_weight(split_option(option)[0])
    return option


def _built_once(node: dict[str, Any], key: str) -> None:
    """Builds a component node once (a builder on the meta device), so that a refused argument
    (`loss.ignore_index=abc`, `model.builder.num_layers=abc`) fails here, not in training."""
    arguments = {k: v for k, v in node.items() if k != "_component_"}
    component = resolve_component(node.get("_component_"), f"{key}._component_")
    try:
        with torch.device("meta"):
            component(**arguments)
    except (TypeError, ValueError, AssertionError) as err:
        raise UserError(
            key,
            arguments,
            f"{node['_component_']} refuses them ({err}); give arguments it takes (see its "
            "documentation)",
        ) from None


def _held_out(value: Any) -> float | None:
    """dataset.validation.held_out: a percentage (5%) or a fraction (0.05) -> the fraction."""
    if value is None:
        return None
    text = str(value).strip()
    try:
        fraction = float(text[:-1]) / 100 if text.endswith("%") else float(text)
    except ValueError:
        fraction = -1.0
    if isinstance(value, bool) or not 0 < fraction < 1:
        raise UserError(
            "dataset.validation.held_out", value, "give a percentage such as 5% (or 0.05), or null"
        )
    return fraction


def _validation(dataset: DictConfig) -> dict[str, Any]:
    held = dataset.validation
    given = [k for k in ("held_out", "split", "source") if held[k] is not None]
    if given and given != ["held_out"] and "held_out" in given:
        raise UserError(
            "dataset.validation.held_out",
            held.held_out,
            f"set either held_out or a split/source, not both (also set: {given[1:]}); "
            "override the other with null",
        )
    source, split = held.source, held.split
    if source is not None:
        source = local_source("dataset.validation.source", str(source))
        # A separate file is read whole unless a split of it is named.
        split = "train" if split is None else split
    return {
        "held_out": _held_out(held.held_out),
        "seed": held.seed,
        "split": None if split is None else str(split),
        "source": source,
    }


def _dataset(dataset: DictConfig, model_max_seq_len: int) -> dict[str, Any]:
    """The dataset section of the recipe: every key present; those of other kinds are null."""
    kind = dataset.kind
    if kind not in KINDS:
        raise UserError("dataset.kind", kind, f"choose one of: {', '.join(KINDS)}")
    if OmegaConf.is_missing(dataset, "source"):
        raise UserError(
            "dataset.source",
            "???",
            f"dataset={dataset.name} reads your data: give dataset.source=PATH (a data file or "
            "a directory of them: json, jsonl, csv, parquet, arrow, text)",
        )
    source = local_source("dataset.source", str(dataset.source))
    max_seq_len = dataset.max_seq_len
    if max_seq_len is not None and max_seq_len > model_max_seq_len:
        raise UserError(
            "dataset.max_seq_len",
            max_seq_len,
            f"the model takes at most {model_max_seq_len} tokens; give at most that, or null",
        )
    column_map = OmegaConf.to_container(dataset.column_map)
    for ours, required in COLUMNS[kind].items():
        if ours not in column_map or (required and column_map[ours] is None):
            raise UserError(
                f"dataset.column_map.{ours}",
                column_map.get(ours),
                f"dataset.kind={kind} needs "
                f"the column that holds {ours}: dataset.column_map.{ours}=<column>",
            )
    conversations = kind in ("chat", "preference")
    chat_style = dataset.conversation_style if conversations else None
    if conversations and chat_style not in CONVERSATION_STYLES:
        raise UserError(
            "dataset.conversation_style",
            chat_style,
            f"choose one of: {', '.join(CONVERSATION_STYLES)}",
        )
    if kind == "preference" and dataset.packing:
        raise UserError(
            "dataset.packing", True, "preference pairs are not packed; set dataset.packing=false"
        )
    prompted = kind in ("instruct", "chat")
    data_format = source_format("dataset.source", source, dataset.format)
    return {
        "kind": kind,
        "format": data_format,
        "xml": {"record": dataset.xml.record if data_format == "xml" else None},
        "source": source,
        "split": str(dataset.split),
        "column_map": {k: column_map[k] for k in COLUMNS[kind]},
        "conversation_style": chat_style,
        "train_on_input": dataset.train_on_input if prompted else None,
        "new_system_prompt": dataset.new_system_prompt if kind != "text" else None,
        "max_seq_len": max_seq_len or model_max_seq_len,
        "packing": dataset.packing,
        "validation": _validation(dataset),
    }


def _padding_free(dataset: dict[str, Any], padding_free: bool | None, model: dict) -> bool:
    """Whether each batch is packed into rows (dataset.padding_free; null: wherever that is
    correct: SFT data, unpacked, on torchtune's models, which take a block-causal mask)."""
    for key, value in (("packing", dataset["packing"]), ("padding_free", padding_free)):
        if value and model["backend"] == "transformers":
            raise UserError(
                f"dataset.{key}",
                True,
                f"model.source={model['source']} trains through transformers' own model class "
                f"({model['backend_reason']}), which runner gives no per-document block-causal "
                f"mask; set dataset.{key}=false",
            )
    if padding_free and dataset["kind"] == "preference":
        raise UserError(
            "dataset.padding_free",
            True,
            "preference pairs are batched padded; set dataset.padding_free=false",
        )
    if dataset["packing"]:  # packs are rows already
        return False
    if padding_free is not None:
        return padding_free
    return model["backend"] != "transformers" and dataset["kind"] != "preference"


EVAL_STRATEGIES = ("no", "steps", "epoch")


def _eval(cfg: DictConfig) -> dict[str, Any]:
    """The eval block, checked; a dataset without a validation split is not evaluated."""
    evaluation = cfg.eval
    strategy = evaluation.strategy
    if strategy is False:  # YAML 1.1 reads a bare `no` as false
        strategy = "no"
    if strategy not in EVAL_STRATEGIES:
        raise UserError("eval.strategy", strategy, f"choose one of: {', '.join(EVAL_STRATEGIES)}")
    steps = evaluation.steps
    if strategy == "steps" and steps is None:
        raise UserError(
            "eval.steps", steps, "eval.strategy=steps needs an interval: give an integer >= 1"
        )
    metrics = evaluation.metrics
    if not OmegaConf.is_list(metrics):
        raise UserError("eval.metrics", metrics, f"give a list of: {', '.join(METRIC_MODES)}")
    for name in metrics:
        if name not in METRIC_MODES:
            raise UserError(
                "eval.metrics", name, f"no such metric; choose from: {', '.join(METRIC_MODES)}"
            )
    preference = cfg.method.name in PREFERENCE_METHODS
    for name in metrics:
        if name in (SFT_METRICS if preference else PREFERENCE_METRICS):
            other = "supervised methods" if preference else "preference methods (method=dpo)"
            raise UserError(
                "eval.metrics",
                name,
                f"is a metric of {other}; method={cfg.method.name} computes "
                f"{', '.join(cfg.method.eval_metrics)}",
            )
    if strategy != "no" and not metrics:
        raise UserError("eval.metrics", [], "name at least one metric, or set eval.strategy=no")
    if strategy != "no" and not evaluates(strategy, cfg.dataset.validation):
        log.warning(
            "eval.strategy=%s is ignored: dataset=%s has no validation split (set one of "
            "dataset.validation.held_out, .split, .source to evaluate)",
            strategy,
            cfg.dataset.name,
        )
        strategy = "no"
    return {
        "strategy": strategy,
        "steps": steps,
        "metrics": list(metrics),
        "max_samples": evaluation.max_samples,
    }


def _objective(
    objective: DictConfig, evaluation: dict[str, Any], eval_samples: int
) -> dict[str, str]:
    """The metric that picks the best checkpoint and the best job; it must be one a run records."""
    metric, mode = objective.metric, objective.mode
    modes = {**TRAINING_METRIC_MODES, **METRIC_MODES}
    if metric not in modes:
        raise UserError("objective.metric", metric, f"choose one of: {', '.join(modes)}")
    if mode != modes[metric]:
        better = "lower" if modes[metric] == "min" else "higher"
        raise UserError(
            "objective.mode",
            mode,
            f"{metric} is better {better}: use objective.mode={modes[metric]}",
        )
    if metric in METRIC_MODES:
        if evaluation["strategy"] == "no":
            raise UserError(
                "objective.metric",
                metric,
                "the run does not evaluate (eval.strategy=no, or no validation split): evaluate, "
                "or rank by the training loss with objective.metric=loss",
            )
        if metric not in evaluation["metrics"]:
            raise UserError(
                "objective.metric",
                metric,
                f"not computed: add it to eval.metrics={evaluation['metrics']}",
            )
        if metric == "eval_exact_match" and eval_samples == 0:
            raise UserError(
                "objective.metric",
                metric,
                "dataset.eval_samples=0 generates no answers: give it a count",
            )
    return {"metric": metric, "mode": mode}


def resolve_recipe(
    cfg: DictConfig, run_dir: Path, overrides: Sequence[str] = (), fetch: bool = True
) -> DictConfig:
    """The recipe (runner.config.schema.Recipe) of a composed `train` config.

    hf:// sources become local paths in the cache, downloaded if need be; `overrides` make the
    `runner download ...` command that an error about a missing source names. fetch=False (a
    dry run such as `runner estimate`) takes only what is cached and resolves a model whose
    source is not on this machine from its option's builder alone (tokenizer and config.json
    left unresolved: None).
    """
    cfg = typed(cfg)
    _check_pairing(cfg.method.name, cfg.dataset)
    device, nproc_per_node = resolve_device(cfg.compute)
    nnodes = checked_int(cfg.compute.nnodes, "compute.nnodes", 1)
    compute = {
        "device": device,
        "nproc_per_node": nproc_per_node,
        "nnodes": nnodes,
        **resolve_launch(cfg.compute, nnodes),
    }
    optimizer = _optimizer(cfg.optimizer)
    runtime = _runtime(cfg.runtime)
    # Last among the checks: fetching a source is the slow part.
    hub = Hub.from_runtime(cfg.runtime, list(overrides))
    cfg, hub_sources = localize(cfg, hub, only_cached=not fetch)
    model = resolve_model(cfg.model, need_files=fetch)
    _built_once(model["builder"], "model.builder")
    loss = OmegaConf.to_container(cfg.loss, resolve=True)
    _built_once(loss, "loss")
    method = resolve_method(
        cfg.method, cfg.model.name, model, run_dir, nnodes * nproc_per_node, device
    )
    dataset = {
        **_dataset(cfg.dataset, model["builder"]["max_seq_len"]),
        # Held-out prompts for eval_exact_match, and the longest answer generated.
        "eval_samples": cfg.dataset.eval_samples,
        "eval_max_new_tokens": cfg.dataset.eval_max_new_tokens,
    }
    dataset["padding_free"] = _padding_free(dataset, cfg.dataset.padding_free, model)
    if model["tokenizer"] is not None:
        # Samples are cut at dataset.max_seq_len (the model's when null).
        model["tokenizer"]["max_seq_len"] = dataset["max_seq_len"]
    evaluation = _eval(cfg)
    return recipe(
        {
            "run_dir": str(run_dir.resolve()),
            "seed": cfg.seed,
            "model": model,
            "hub_sources": hub_sources,
            "dataset": dataset,
            "dtype": {"name": resolve_dtype(cfg.dtype.name, device)},
            "loss": loss,
            "compute": compute,
            "method": method,
            "optimizer": optimizer,
            "runtime": runtime,
            "eval": evaluation,
            "objective": _objective(cfg.objective, evaluation, cfg.dataset.eval_samples),
            **{key: cfg[key] for key in TRAINING_KEYS},
        }
    )
