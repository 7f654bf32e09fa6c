"""The model group -> the recipe's model section: backend, family, weights, builder, config.json,
tokenizer.

The backend (runner.models.backends) is torchtune's where a runner family builds the source's
model_type (or the option's family), transformers' for any other causal LM it implements.

A source's config.json names its family (runner/models/families/) and, for a builder-less option
(model=hf), the builder's arguments; an option's own builder arguments must build the same
model. The family supplies the torchtune builder and its LoRA twin.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, Optional

from omegaconf import MISSING, DictConfig, OmegaConf

from runner.components import check_arguments, plain_dict
from runner.config.fields import number, typed_as
from runner.config.tokenizer import checked_tokenizer
from runner.errors import NULL, UserError
from runner.paths import user_path

if TYPE_CHECKING:
    from runner.models.families import Family
    from runner.models.tokenizer import ChatTokenizer

# typing's Optional/Dict: the forms OmegaConf 2.3 reads in structured-config annotations.
# ruff: noqa: UP006, UP035, UP045


@dataclass
class Model:
    """The model group, as the user types it."""

    name: str = MISSING
    family: Optional[str] = None
    source: Optional[str] = None
    tokenizer: Optional[str] = None
    chat_template: Optional[str] = None
    checkpoint_format: str = "hf"
    initializer_range: float = number(0.02, positive=True)
    builder: Optional[Dict[str, Any]] = None
    # auto: torchtune's builder where a runner family builds the model, else transformers' own
    # model class (runner.models.backends); torchtune or transformers to insist.
    backend: str = "auto"


@dataclass
class ModelRecipe:
    """The recipe's model section: the backend, the weights, the builder, config.json and the
    tokenizer, resolved."""

    name: str = MISSING
    # torchtune (a runner family's builder) or transformers (AutoModelForCausalLM), and why.
    backend: str = MISSING
    backend_reason: str = MISSING
    # The runner family (null: the transformers backend, which builds config.json's model_type).
    family: Optional[str] = None
    # A local checkpoint directory, or null: random init (initializer_range).
    source: Optional[str] = None
    # The builder and its arguments (torchtune's; for transformers
    # runner.models.backends.transformers.from_config with the sizes read from config.json); the
    # family's LoRA twin of the builder (torchtune's).
    builder: Dict[str, Any] = MISSING
    lora_builder: Optional[str] = None
    initializer_range: float = 0.02
    # config.json of the checkpoints the run writes; runner.models.tokenizer.ChatTokenizer and its
    # arguments (its path, and model.chat_template's file or null). Null only in a dry run that
    # has no tokenizer files (`runner estimate` of a model not downloaded).
    hf_config: Optional[Dict[str, Any]] = None
    tokenizer: Optional[Dict[str, Any]] = None


def _model_source(value: str | None) -> Path | None:
    """model.source as a local checkpoint directory (None: random init)."""
    from runner.models.checkpoint import weight_files

    if value is None:
        return None
    if str(value).startswith("hf://"):
        # Only a dry run (fetch=False) gets here: runner.hub.download.localize has made every
        # cached or fetched hf:// source a local path.
        raise UserError("model.source", value, "is not in the cache; `runner download` fetches it")
    path = user_path(value).resolve()
    if path.is_file():
        raise UserError(
            "model.source",
            value,
            f"is a file; give the checkpoint directory that holds it: model.source={path.parent}",
        )
    if not (path / "config.json").is_file():
        raise UserError(
            "model.source",
            value,
            "is not a Hugging Face checkpoint directory (no config.json); give a directory "
            "holding config.json, safetensors weights and tokenizer files, or hf://org/name",
        )
    if not all(f.is_file() for f in weight_files(path)):
        raise UserError(
            "model.source",
            value,
            "has no safetensors weights (model.safetensors or an index of shards), and runner "
            "loads no pickled .bin files: re-save it as safetensors, "
            "AutoModelForCausalLM.from_pretrained(DIR).save_pretrained(NEW_DIR), with its "
            "tokenizer files",
        )
    return path


def _config_json(source: Path) -> dict[str, Any]:
    """The checkpoint's config.json, read; one that is not JSON (cut short, edited by hand) is
    refused by key, where it was a JSONDecodeError traceback."""
    path = source / "config.json"
    try:
        config = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        where = (
            f" (line {err.lineno} column {err.colno})"
            if isinstance(err, json.JSONDecodeError)
            else ""
        )
        raise UserError(
            "model.source",
            str(source),
            f"its config.json is not valid JSON{where}; download, copy or save it again",
        ) from None
    if not isinstance(config, dict):
        raise UserError("model.source", str(source), "its config.json holds no JSON object")
    return config


# The builder arguments that count something (layers, heads, rows, widths, positions): torchtune
# builds a model with 0 or -1 of them (no layers, an empty embedding), which fails only in
# training, with an IndexError.
COUNT_ARGS = (
    "num_layers",
    "num_heads",
    "num_kv_heads",
    "embed_dim",
    "vocab_size",
    "intermediate_dim",
    "head_dim",
    "max_seq_len",
)


# The builder arguments that are positive reals: 'abc' passed validate and failed the first step
# with a TypeError traceback, -1 (rope_base) made the loss nan, blamed on the learning rate, and
# null failed the build with a traceback. query_pre_attn_scalar may be null (Gemma 2's default).
POSITIVE_ARGS = ("norm_eps", "rope_base", "scale_factor", "query_pre_attn_scalar")


def check_builder_args(args: dict[str, Any]) -> None:
    """A UserError naming the first count argument of model.builder that is no integer >= 1
    (null stays: a builder computes intermediate_dim or head_dim from the rest), or the first
    positive real argument that is no number > 0."""
    for name in COUNT_ARGS:
        value = args.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise UserError(f"model.builder.{name}", value, "give an integer >= 1")
    for name in POSITIVE_ARGS:
        if name not in args or (args[name] is None and name == "query_pre_attn_scalar"):
            continue
        value = args[name]
        if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
            raise UserError(
                f"model.builder.{name}", NULL if value is None else value, "give a number > 0"
            )


def option_builder(name: str) -> dict[str, Any] | None:
    """The builder arguments of the model option `name` as conf/model/ gives them (arguments
    known to build, for naming the one a changed builder is refused for); None where the
    option has no file or no builder (model=hf)."""
    from runner.paths import CONF_DIR

    path = CONF_DIR / "model" / f"{name}.yaml"
    if not path.is_file():
        return None
    option = OmegaConf.load(path)
    builder = option.get("builder") if isinstance(option, DictConfig) else None
    if not isinstance(builder, DictConfig):
        return None
    return {k: v for k, v in plain_dict(builder, resolve=True).items() if k != "_component_"}


# Weight name -> shape (or, for a checkpoint that cannot be read, the reason).
Shapes = dict[str, tuple[Any, ...]]


def _weight_shapes(source: Path, builder: dict[str, Any]) -> tuple[Shapes, Shapes]:
    """(the builder's weight shapes, the source's in torchtune's names), read from the
    safetensors headers and a model on the meta device: nothing is loaded."""
    import torch
    from safetensors import safe_open

    from runner.components import instantiate
    from runner.models.checkpoint import weight_files
    from runner.models.families import hf_to_tune, read_config
    from runner.rundir import check_safetensors

    shapes = {}
    for path in weight_files(source):
        check_safetensors(path, key="model.source")
        with safe_open(str(path), "pt") as weights:
            shapes.update({name: weights.get_slice(name).get_shape() for name in weights.keys()})  # noqa: SIM118
    with torch.device("meta"):
        model = instantiate(OmegaConf.create(builder))
        ours = {name: tuple(t.shape) for name, t in model.state_dict().items()}
        try:
            empty = {name: torch.empty(shape) for name, shape in shapes.items()}
            converted = hf_to_tune(empty, read_config(source))
            theirs: Shapes = {name: tuple(t.shape) for name, t in converted.items()}
        except (RuntimeError, KeyError, ValueError) as err:
            theirs = {"<unreadable>": (str(err),)}
    return ours, theirs


def _check_weights(source: Path, builder: dict[str, Any]) -> None:
    """A UserError naming model.source unless its weights fit the builder's model, name for name
    and shape for shape."""
    ours, theirs = _weight_shapes(source, builder)
    problems = [f"no {name}" for name in sorted(set(ours) - set(theirs))]
    problems += [f"unexpected {name}" for name in sorted(set(theirs) - set(ours))]
    problems += [
        f"{name} is {list(theirs[name])}, the builder's {list(shape)}"
        for name, shape in ours.items()
        if name in theirs and theirs[name] != shape
    ]
    if problems:
        raise UserError(
            "model.source",
            str(source),
            f"its weights do not fit the model its config.json describes ({'; '.join(problems[:3])}"
            f"{'; ...' if len(problems) > 3 else ''}); re-save the checkpoint with save_pretrained",
        )


def _source_config(config: dict[str, Any]) -> dict[str, Any]:
    """The source's config.json as checkpoints write it: weights are saved in fp32."""
    dtype_key = "dtype" if "dtype" in config else "torch_dtype"
    return {**config, dtype_key: "float32"}


def check_model_source_given(model: DictConfig) -> None:
    """A UserError naming model.source where the option builds nothing without one (model=hf)."""
    if model.builder is None and model.source is None:
        raise UserError(
            "model.source", None, f"model={model.name} takes model.source=<dir or hf://org/name>"
        )


def resolve_model(model: DictConfig, need_files: bool = True) -> ModelRecipe:
    """The recipe's model section: family, source, builder, config.json and tokenizer.

    A source's config.json names its family and, for a builder-less option (model=hf), the
    builder's arguments; an option's own builder must build the same model.
    """
    # A composed model section as Model types it (its defaults filled in).
    model = typed_as(model, Model, "model.")
    if model.checkpoint_format != "hf":
        raise UserError("model.checkpoint_format", model.checkpoint_format, "only hf is supported")
    check_model_source_given(model)
    try:
        source = _model_source(model.source)
    except UserError:
        if need_files or model.builder is None:
            raise
        source = None
    raw_config = _config_json(source) if source else None
    resolved, family = _built_model(model, source, raw_config)
    tokenizer_dir = model.tokenizer or source
    if tokenizer_dir is None:
        if need_files:
            raise UserError("model.tokenizer", None, "give a tokenizer directory or model.source")
        return resolved
    tokenizer = checked_tokenizer(model, resolved.builder, Path(tokenizer_dir))
    resolved.hf_config = _hf_config(resolved, family, raw_config, tokenizer)
    resolved.tokenizer = {
        "_component_": "runner.models.tokenizer.ChatTokenizer",
        "path": str(Path(tokenizer_dir).resolve()),
        "max_seq_len": resolved.builder["max_seq_len"],
        "chat_template": tokenizer.chat_template_file,
        # Recorded, so every process and a later `runner repro` render the same date.
        "date_string": tokenizer.date_string,
    }
    return resolved


def _built_model(
    model: DictConfig, source: Path | None, raw_config: dict[str, Any] | None
) -> tuple[ModelRecipe, Family | None]:
    """The model section without its tokenizer and config.json, and the runner family that
    builds it (None: transformers does)."""
    from runner.models.backends.transformers import (
        check_transformers_weights,
        transformers_builder,
    )
    from runner.models.families import read_config

    backend, reason = _backend(model, raw_config)
    family: Family | None = None
    if backend == "transformers":
        # _backend picks transformers only for a source's config.json.
        assert source is not None
        builder = transformers_builder(source)
        check_transformers_weights(source, builder)
    else:
        family, builder = _family_and_builder(model, read_config(source) if source else None)
        if source is not None:
            _check_weights(source, builder)
    resolved = ModelRecipe(
        name=model.name,
        backend=backend,
        backend_reason=reason,
        family=family.name if family else None,
        # Unresolved only for need_files=False: then the option's source as given, for display.
        source=str(source) if source else model.source,
        builder=builder,
        lora_builder=family.builders[builder["_component_"]] if family else None,
        # Bounded (> 0) by Model.
        initializer_range=float(model.initializer_range),
    )
    return resolved, family


def _hf_config(
    model: ModelRecipe,
    family: Family | None,
    raw_config: dict[str, Any] | None,
    tokenizer: ChatTokenizer,
) -> dict[str, Any]:
    """config.json of the checkpoints: the source's, or the family's for a random init."""
    from runner.models.families import hf_config

    if raw_config:
        return _source_config(raw_config)
    # Without a source the family's builder makes the model (_built_model).
    assert family is not None
    return hf_config(
        family,
        model.builder,
        initializer_range=model.initializer_range,
        bos_token_id=tokenizer.bos_id,
        eos_token_id=tokenizer.eos_id,
    )


def _backend(model: DictConfig, config: dict[str, Any] | None) -> tuple[str, str]:
    """(backend, why): torchtune where a runner family builds config.json's model_type (or the
    option's family, with no source), transformers for another causal LM that transformers
    implements; model.backend may insist on one."""
    from runner.models.backends import BACKENDS

    wanted = model.backend
    if wanted not in ("auto", *BACKENDS):
        raise UserError("model.backend", wanted, f"choose auto, {' or '.join(BACKENDS)}")
    if config is None:
        if wanted == "transformers":
            raise UserError(
                "model.backend",
                wanted,
                "transformers builds a model from its checkpoint: give model.source=DIR, or "
                "model.backend=auto",
            )
        weights = "random init" if model.source is None else f"{model.source}, not here yet"
        return "torchtune", f"model={model.name} is runner's {model.family} family ({weights})"
    return _source_backend(model, wanted, config)


def _source_backend(model: DictConfig, wanted: str, config: dict[str, Any]) -> tuple[str, str]:
    """_backend of a source whose config.json is `config`. A family's model with a setting its
    torchtune builder lacks (Llama's biases) goes to transformers, which builds it, under auto."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from runner.models.families import FAMILIES, complete_config, unbuilt_setting

    model_type: Any = config.get("model_type")
    family = {f.model_type: f for f in FAMILIES.values()}.get(model_type)
    unbuilt = unbuilt_setting(family, complete_config(config)) if family else None
    if family is not None and wanted != "transformers" and unbuilt is None:
        return "torchtune", f"model_type {model_type!r} is runner's {family.name} family"
    if family is not None and wanted == "torchtune":
        raise UserError(
            "model.backend",
            wanted,
            f"model.source={model.source} sets {unbuilt} in its config.json, which torchtune's "
            f"{family.name} builder does not build; model.backend=auto trains it through "
            f"transformers' {MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]}",
        )
    known = ", ".join(f"{f.model_type} ({f.name})" for f in FAMILIES.values())
    if wanted == "torchtune" or model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise UserError(
            "model.source",
            model.source,
            f"its config.json has model_type={model_type!r}, which "
            + (
                "no runner family builds (model.backend=torchtune); use model.backend=auto"
                if wanted == "torchtune" and model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
                else f"neither a runner family ({known}) nor transformers' "
                "AutoModelForCausalLM builds (runner runs no remote code); give a checkpoint "
                "of a causal LM architecture that transformers implements"
            ),
        )
    if family is None:
        why = f"model_type {model_type!r} has no runner family"
    elif unbuilt is not None:
        why = f"{unbuilt} in config.json, which torchtune's {family.name} builder does not build"
    else:
        why = "model.backend=transformers"
    if model.family is not None or model.builder is not None:
        held = f"a {model_type!r} model" + (f" ({why})" if unbuilt else "")
        raise UserError(
            "model",
            model.name,
            f"is an option of runner's {model.family} family, and model.source holds {held}; "
            f"give model=hf model.source={model.source}",
        )
    return "transformers", f"{why}; transformers' {MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]}"


def _family_and_builder(
    model: DictConfig, config: dict[str, Any] | None
) -> tuple[Family, dict[str, Any]]:
    """The model's family (its source's, which must agree with the option's) and builder node."""
    from runner.models.families import (
        builder_args,
        builder_component,
        check_source_matches,
        family_named,
        family_of,
    )

    family = family_named(model.family) if model.family else None
    if config is not None:
        found = family_of(config, str(model.source))
        if family is not None and found != family:
            raise UserError(
                "model.source",
                model.source,
                f"holds a {found.name} model but model.family={family.name}; pick the model "
                f"option of this checkpoint, or model=hf",
            )
        family = found
    # A model option names its family, a source's config.json names it otherwise.
    if family is None:
        from runner.models.families import FAMILIES

        raise UserError(
            "model.family",
            NULL if model.family is None else model.family,
            "a model with no model.source (random weights) is built by its family's builder; "
            f"give one of: {', '.join(FAMILIES)}",
        )
    derived = builder_args(family, config, str(model.source)) if config else None
    if model.builder is None:
        assert derived is not None  # resolve_model refuses no builder and no source
        return family, {"_component_": family.builder, **derived}
    args = plain_dict(model.builder, resolve=True)
    check_builder_args(args)
    builder = {"_component_": builder_component(family, args), **args}
    check_arguments(builder["_component_"], args, "model.builder")
    if derived is not None:
        check_source_matches(family, builder, derived, str(model.source))
    return family, builder
