"""The method group: which parameters train and how (full, LoRA, QLoRA, DPO and its LoRA forms)
(runner.trainer.methods trains each)."""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

from omegaconf import DictConfig, OmegaConf

from runner.config.compute import ComputeRecipe
from runner.config.fields import flag, integer, number, override_key
from runner.config.model import ModelRecipe
from runner.errors import UserError
from runner.rundir import BASE_MODEL_DIR

# typing's Optional/Dict/List: the forms OmegaConf 2.3 reads in structured-config annotations.
# ruff: noqa: UP006, UP035, UP045

log = logging.getLogger(__name__)

# The methods (runner.trainer.methods pairs each with what trains and what its loss is made of).
METHOD_NAMES = ("full", "lora", "qlora", "dpo", "lora_dpo", "qlora_dpo")
# The methods that train on preference pairs (dataset.kind=preference), and their losses.
PREFERENCE_METHODS = ("dpo", "lora_dpo", "qlora_dpo")
PREFERENCE_LOSSES = ("sigmoid", "ipo", "hinge")
LORA_ATTN_MODULES = ("q_proj", "k_proj", "v_proj", "output_proj")
# The keys of the method group that only some methods read (the others read none of them).
LORA_KEYS = (
    "rank",
    "alpha",
    "dropout",
    "lora_attn_modules",
    "apply_lora_to_mlp",
    "apply_lora_to_output",
    "quantize_base",
    "save_merged",
)
PREFERENCE_KEYS = ("beta", "loss", "label_smoothing")
# method.quantize_base through transformers' backend: bitsandbytes' NF4, every linear
# projection of the decoder layers in blocks of 64 (any shape), the output head kept as loaded.
BITSANDBYTES_NF4 = "bitsandbytes: in NF4 (blocks of 64): every linear projection of the layers"


@dataclass
class Method:
    """The method group, as the user types it."""

    name: str = "full"
    rank: int = integer(8, 1)
    alpha: float = number(16.0, positive=True)
    dropout: float = number(0.0, positive=False)
    lora_attn_modules: Any = field(default_factory=lambda: ["q_proj", "v_proj"])
    apply_lora_to_mlp: bool = flag(False)
    apply_lora_to_output: bool = flag(False)
    quantize_base: bool = flag(False)
    save_merged: bool = flag(False)
    # The metrics eval.metrics defaults to (conf/method/*.yaml).
    eval_metrics: List[str] = field(default_factory=list)
    # Preference methods (dpo, lora_dpo, qlora_dpo); checked by resolve_method.
    beta: float = number(0.1, positive=True)
    loss: str = "sigmoid"
    label_smoothing: float = number(0.0, positive=False)


@dataclass
class MethodRecipe:
    """The recipe's method section: what the training loop needs of the method."""

    name: str = "full"
    # LoRA: the adapter builder and its arguments, the Hugging Face base the adapter loads onto
    # (and DPO's reference, the weights it starts from).
    builder: Optional[Dict[str, Any]] = None
    base_model_dir: Optional[str] = None
    save_merged: bool = False
    # Preference methods: the loss, its beta and label smoothing (null for the others).
    loss: Optional[str] = None
    beta: Optional[float] = None
    label_smoothing: Optional[float] = None
    # QLoRA: which base projections are in NF4 and which stay in the compute dtype (one line).
    quantization: Optional[str] = None


def resolve_method(
    method: DictConfig, model: ModelRecipe, run_dir: Path, compute: ComputeRecipe
) -> MethodRecipe:
    """The method section of the recipe: for LoRA, the adapter builder and its arguments and the
    base's home; for DPO, its loss and the reference's home."""
    if method.name not in METHOD_NAMES:
        raise UserError("method.name", method.name, f"choose one of: {', '.join(METHOD_NAMES)}")
    resolved = MethodRecipe(name=method.name)
    if method.name == "full":
        return resolved
    if method.name in PREFERENCE_METHODS:
        _check_preference(method)
        resolved.loss, resolved.beta = method.loss, method.beta
        resolved.label_smoothing = method.label_smoothing
    # The Hugging Face base the adapter loads onto (adapter_config.json names it); DPO's frozen
    # reference, the weights training starts from.
    source = Path(run_dir / BASE_MODEL_DIR if model.source is None else model.source)
    resolved.base_model_dir = str(source.resolve())
    if method.name == "dpo":
        return resolved
    world_size = compute.nnodes * compute.nproc_per_node
    resolved.builder = _adapter_builder(method, model, world_size, compute.device)
    if method.quantize_base:
        resolved.quantization = _quantization(resolved.builder, model, world_size)
    resolved.save_merged = method.save_merged
    return resolved


def move_recipe(recipe: DictConfig, run_dir: Path) -> None:
    """Points `recipe` at `run_dir`, a run directory it moved or was copied to: its run_dir, and
    the base the run wrote into its own directory (RUN/base_model, a random-init base), which
    goes with it; a base read from model.source stays where it is."""
    own = str((Path(recipe.run_dir) / BASE_MODEL_DIR).resolve())
    recipe.run_dir = str(run_dir.resolve())
    if OmegaConf.select(recipe, "method.base_model_dir") == own:
        recipe.method.base_model_dir = str(Path(recipe.run_dir) / BASE_MODEL_DIR)


def _adapter_builder(
    method: DictConfig, model: ModelRecipe, world_size: int, device: str
) -> dict[str, Any]:
    """The LoRA builder node: the family's LoRA twin of the model's builder (torchtune's; the
    transformers backend's adapters are peft's) and the adapter's arguments, checked."""
    modules = _lora_modules(method.lora_attn_modules)
    if not modules and (model.backend == "torchtune" or not method.apply_lora_to_mlp):
        # torchtune's LoRA attention builders refuse an empty list; peft's MLP alone is fine.
        raise UserError(
            "method.lora_attn_modules",
            [],
            "name at least one attention projection (e.g. [q_proj,v_proj])"
            + ("" if model.backend == "torchtune" else ", or set method.apply_lora_to_mlp=true"),
        )
    if method.apply_lora_to_output and _ties_embeddings(model):
        raise UserError(
            "method.apply_lora_to_output",
            True,
            f"model={model.name} ties its output projection to the embeddings, which LoRA cannot "
            "adapt; leave it false",
        )
    if method.quantize_base and model.backend == "transformers":
        _check_bitsandbytes(model, device, world_size)
    if method.dropout >= 1:
        raise UserError("method.dropout", method.dropout, "give a probability in [0, 1)")
    width = (model.hf_config or {}).get("hidden_size")
    if isinstance(width, int) and method.rank > width:
        # A rank of 1e12 passed, and the adapter's allocation failed in a traceback.
        raise UserError(
            "method.rank",
            method.rank,
            f"give at most {width}, the model's width (hidden_size): a larger rank adapts "
            "nothing more",
        )
    lora = {
        **({"_component_": model.lora_builder} if model.lora_builder else {}),
        "lora_attn_modules": modules,
        "apply_lora_to_mlp": method.apply_lora_to_mlp,
        "apply_lora_to_output": method.apply_lora_to_output,
        "lora_rank": method.rank,
        "lora_alpha": method.alpha,
        "lora_dropout": method.dropout,
        "quantize_base": method.quantize_base,
    }
    if model.lora_builder:
        _check_lora_builds(method.name, {**model.builder, **lora})
    return lora


def _quantization(lora: dict[str, Any], model: ModelRecipe, world_size: int) -> str:
    """What QLoRA keeps in NF4: with torchtune's backend, each base projection whose weights
    make whole NF4 blocks (runner.models.nf4), the others in the compute dtype."""
    import torch

    from runner.components import instantiate
    from runner.models.nf4 import base_projections, describe

    if model.backend == "transformers":
        return BITSANDBYTES_NF4
    with torch.device("meta"):
        meta = instantiate(OmegaConf.create({**model.builder, **lora, "quantize_base": False}))
    return "torchao: " + describe(base_projections(meta, world_size), world_size)


def _check_lora_builds(name: str, node: dict[str, Any]) -> None:
    """Builds the LoRA model once on the meta device, so that whatever else torchtune's LoRA
    builder refuses fails here, by name, not in the training process."""
    import torch

    from runner.components import resolve_component

    builder = resolve_component(node["_component_"], "method")
    arguments = {k: v for k, v in node.items() if k != "_component_"}
    try:
        with torch.device("meta"):
            builder(**{**arguments, "quantize_base": False})
    except (TypeError, ValueError, AssertionError) as err:
        raise UserError(
            "method",
            name,
            f"{node['_component_']} refuses the method's LoRA settings ({err}); change "
            "method.lora_attn_modules, apply_lora_to_mlp or apply_lora_to_output",
        ) from None


def _ties_embeddings(model: ModelRecipe) -> bool:
    """Whether the model's output projection is its embeddings: torchtune's builder's arguments
    with its defaults say (Gemma's always), transformers' config.json."""
    from runner.models.families import family_named, ties_embeddings

    if model.backend != "torchtune":
        return bool(model.builder["tie_word_embeddings"])
    assert model.family is not None, "torchtune's backend builds a runner family"
    return ties_embeddings(family_named(model.family), model.builder)


def _check_preference(method: DictConfig) -> None:
    """The DPO loss keys (beta > 0 is Method's bound)."""
    if method.beta > 10:
        # 1e12 ran to a loss of 0 and a gradient of 0 at its first step: nothing trained.
        log.warning(
            "method.beta=%g is far above the usual 0.1 to 0.5: the loss saturates as soon as "
            "the policy moves off the reference, and its gradient with it",
            method.beta,
        )
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


def methods_reading(key: str) -> list[str]:
    """The methods that read method.`key` (every one, for a key all of them read)."""
    return [
        name
        for name in METHOD_NAMES
        if (key not in LORA_KEYS or name not in ("full", "dpo"))
        and (key not in PREFERENCE_KEYS or name in PREFERENCE_METHODS)
    ]


def check_method_name(overrides: Sequence[str]) -> None:
    """method.name given on the command line (or removed), which the option sets: refused,
    naming the option to choose instead."""
    for override in overrides:
        if override_key(override) == "method.name":
            value = override.partition("=")[2]
            choose = f"method={value}" if value else f"method=<one of {', '.join(METHOD_NAMES)}>"
            fix = f"the option sets it: choose the method with {choose}"
            raise UserError("method.name", value or None, fix)


def check_method_keys(method: DictConfig, overrides: Sequence[str]) -> None:
    """A key of the composed method section (its option's, an override's, a user's own
    option's) that the method does not read (`+method.rank=4` with method=full) is refused, as
    is method.name given on the command line (or removed), which the option sets: either went
    unread. `method` before typing, which gives every method every key."""
    check_method_name(overrides)
    if method.name not in METHOD_NAMES:
        return  # resolve_method names the methods there are
    for name in map(str, method):
        readers = methods_reading(name)
        if method.name not in readers:
            raise UserError(
                f"method.{name}",
                method[name],
                f"method={method.name} does not read it: drop it, or choose a method that "
                f"does (method={', '.join(readers)})",
            )


def check_pairing(method: str, dataset: DictConfig) -> None:
    """Preference methods train on preference pairs, supervised methods on anything else."""
    from runner.data import KINDS, SFT_KINDS

    if dataset.kind not in KINDS:  # kind=qa read as preference pairs, for a full run
        raise UserError("dataset.kind", dataset.kind, f"choose one of: {', '.join(KINDS)}")
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


def _check_bitsandbytes(model: ModelRecipe, device: str, world_size: int) -> None:
    """QLoRA of a transformers model quantizes its base with bitsandbytes, whose 4-bit kernels
    (forward and backward) run on CUDA and on the CPU, in one process: its 4-bit weights do not
    shard with FSDP2."""
    why = None
    if world_size > 1:
        why = f"bitsandbytes' 4-bit base does not shard over {world_size} processes"
    elif importlib.util.find_spec("bitsandbytes") is None:
        why = "bitsandbytes is not installed (pip install bitsandbytes)"
    if why is not None:
        raise UserError(
            "method",
            "qlora",
            f"model.source={model.source} trains through transformers ({model.backend_reason}"
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
    return [str(name) for name in modules]
