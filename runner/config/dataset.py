"""The dataset group: the source and its format, the columns, the sample shape, the validation
split; checked against the dataset's kind and the model."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Dict, Optional

from omegaconf import MISSING, DictConfig, OmegaConf

from runner.config.fields import flag, integer, typed_as
from runner.config.interpolations import has_validation
from runner.config.model import ModelRecipe
from runner.errors import NULL, UserError

log = logging.getLogger(__name__)

# typing's Optional/Dict: the forms OmegaConf 2.3 reads in structured-config annotations.
# ruff: noqa: UP006, UP035, UP045


@dataclass
class Validation:
    """dataset.validation: a held-out share of the train split, a split, or a separate source."""

    # A percentage (5%) or a fraction (0.05): checked by resolve_dataset.
    held_out: Any = None
    seed: int = integer(0, 0)
    split: Optional[str] = None
    source: Optional[str] = None


@dataclass
class ValidationRecipe(Validation):
    """The recipe's dataset.validation: held_out as typed (5% or 0.05, so that a message about
    it quotes what the user wrote; runner.data.held_out_fraction reads it), a source as a local
    path."""

    held_out: Optional[str] = None
    # The format validation.source is read in: dataset.format, or its own extension's where
    # that is null (a .csv beside a .jsonl training file); null without a source.
    format: Optional[str] = None


@dataclass
class Xml:
    # dataset.format=xml: the element of one record (null: each child of the root element).
    record: Optional[str] = None


@dataclass
class Dataset:
    """The dataset group, as the user types it."""

    name: str = MISSING
    kind: str = MISSING
    source: str = MISSING
    format: Optional[str] = None
    xml: Xml = field(default_factory=Xml)
    split: str = "train"
    column_map: Dict[str, Optional[str]] = field(default_factory=dict)
    conversation_style: Optional[str] = None
    train_on_input: bool = flag(False)
    new_system_prompt: Optional[str] = None
    max_seq_len: Optional[int] = integer(None, 2)
    packing: bool = flag(False)
    # Null: on wherever it is correct (padding_free).
    padding_free: Optional[bool] = flag(None)
    # The most tokens one forward pass takes (null: a whole batch in one).
    max_forward_tokens: Optional[int] = integer(None, 1)
    # Processes that tokenize and collate batches beside each training process (null: by device,
    # loader_workers()); at most 64 (past it a typo, e.g. 1000, would start a fork storm).
    num_workers: Optional[int] = integer(None, 0, 64)
    # Read the training split as a stream (runner.data.stream), shuffled in windows of
    # shuffle_buffer records of each reader's share.
    streaming: bool = flag(False)
    shuffle_buffer: int = integer(10000, 1)
    validation: Validation = field(default_factory=Validation)
    eval_samples: int = integer(200, 0)
    eval_max_new_tokens: int = integer(12, 1)


@dataclass
class DatasetRecipe:
    """The recipe's dataset section: every key present; those of other kinds are null."""

    kind: str = MISSING
    format: str = MISSING
    xml: Xml = field(default_factory=Xml)
    source: str = MISSING
    split: str = "train"
    column_map: Dict[str, Optional[str]] = field(default_factory=dict)
    # Null where the dataset's kind has no such key.
    conversation_style: Optional[str] = None
    train_on_input: Optional[bool] = None
    new_system_prompt: Optional[str] = None
    max_seq_len: int = MISSING
    packing: bool = False
    padding_free: bool = False
    max_forward_tokens: Optional[int] = None
    num_workers: int = 0
    streaming: bool = False
    shuffle_buffer: int = 10000
    validation: ValidationRecipe = field(default_factory=ValidationRecipe)
    # Held-out prompts for eval_exact_match, and the longest answer generated.
    eval_samples: int = 0
    eval_max_new_tokens: int = 12


def check_dataset_source_given(dataset: DictConfig) -> None:
    """A UserError naming dataset.source where the option needs the user's data and has none."""
    if OmegaConf.is_missing(dataset, "source"):
        raise UserError(
            "dataset.source",
            "???",
            f"dataset={dataset.name} reads your data: give dataset.source=PATH (a data file or "
            "a directory of them: json, jsonl, csv, parquet, arrow, text)",
        )


def check_data_found(dataset: DictConfig) -> None:
    """dataset.source given and, where it is a path on this machine, there, readable and not
    empty. `runner train` checks it first, so that a mistyped or empty file is refused in a
    second or two, where resolve_dataset (which checks it again) comes after torch's imports
    and the model's (ten seconds). A hub source is checked where it is fetched
    (runner.hub.download.localize)."""
    from runner.data import local_source
    from runner.hub.download import is_hub_uri

    check_dataset_source_given(dataset)
    if dataset.source is not None and not is_hub_uri(dataset.source):
        local_source("dataset.source", str(dataset.source))


def resolve_dataset(dataset: DictConfig, model_max_seq_len: int) -> DatasetRecipe:
    """The dataset section of the recipe (padding_free is decided with the model:
    padding_free())."""
    from runner.data import KINDS, local_source, source_format

    # A composed dataset section as Dataset types it (its defaults filled in).
    dataset = typed_as(dataset, Dataset, "dataset.")
    kind = dataset.kind
    if kind not in KINDS:
        raise UserError("dataset.kind", kind, f"choose one of: {', '.join(KINDS)}")
    check_dataset_source_given(dataset)
    source = local_source("dataset.source", str(dataset.source))
    max_seq_len = dataset.max_seq_len
    if max_seq_len is not None and max_seq_len > model_max_seq_len:
        raise UserError(
            "dataset.max_seq_len",
            max_seq_len,
            f"the model takes at most {model_max_seq_len} tokens; give at most that, or null",
        )
    if dataset.packing and max_seq_len is None:
        log.warning(
            "dataset.packing=true packs rows of dataset.max_seq_len tokens, left null: the "
            "model's whole context, %d tokens a row; set dataset.max_seq_len to pack shorter ones",
            model_max_seq_len,
        )
    column_map = _column_map(kind, dataset.column_map)
    chat_style = _conversation_style(kind, dataset.conversation_style)
    if kind == "preference" and dataset.packing:
        raise UserError(
            "dataset.packing", True, "preference pairs are not packed; set dataset.packing=false"
        )
    if kind == "preference" and dataset.max_forward_tokens is not None:
        raise UserError(
            "dataset.max_forward_tokens",
            dataset.max_forward_tokens,
            "a preference pair's chosen and rejected answers run in one forward pass; set "
            "dataset.max_forward_tokens=null",
        )
    if kind == "text" and dataset.eval_samples and has_validation(dataset.validation):
        raise UserError(
            "dataset.eval_samples",
            dataset.eval_samples,
            "text records have no answers to match (their held-out loss is evaluated without "
            "them); set it to 0",
        )
    data_format = source_format("dataset.source", source, dataset.format)
    if data_format == "xml" and dataset.xml.record is not None and not dataset.xml.record.strip():
        raise UserError(
            "dataset.xml.record",
            dataset.xml.record,
            "give the name of a record's element, or null (each child of the root a record)",
        )
    if dataset.streaming:
        _check_stream(dataset, data_format)
    return DatasetRecipe(
        kind=kind,
        format=data_format,
        xml=Xml(record=dataset.xml.record if data_format == "xml" else None),
        source=source,
        split=str(dataset.split),
        column_map=column_map,
        conversation_style=chat_style,
        train_on_input=dataset.train_on_input if kind in ("instruct", "chat") else None,
        # An empty prompt is none: instruct data put none first, chat data an empty one.
        new_system_prompt=(dataset.new_system_prompt or None) if kind != "text" else None,
        max_seq_len=max_seq_len or model_max_seq_len,
        packing=dataset.packing,
        max_forward_tokens=dataset.max_forward_tokens,
        streaming=dataset.streaming,
        shuffle_buffer=dataset.shuffle_buffer,
        validation=_validation(dataset.validation, dataset.format),
        eval_samples=dataset.eval_samples,
        eval_max_new_tokens=dataset.eval_max_new_tokens,
    )


def _check_stream(dataset: DictConfig, data_format: str) -> None:
    """What a stream cannot do: whole-split packing, pairs, XML, a share held out of it."""
    refusals = [
        ("kind", dataset.kind == "preference", "preference pairs are read whole"),
        ("format", data_format == "xml", "XML files are parsed whole"),
        (
            "packing",
            dataset.packing,
            "a stream is packed batch by batch (dataset.padding_free), not ahead of training",
        ),
        (
            "validation.held_out",
            dataset.validation.held_out is not None,
            "a share cannot be held out of a stream; name a validation split or source",
        ),
    ]
    for key, refused, why in refusals:
        if refused:
            value = data_format if key == "format" else OmegaConf.select(dataset, key)
            raise UserError(
                f"dataset.{key}", value, f"{why}; set it otherwise, or dataset.streaming=false"
            )


def check_stream_steps(streaming: bool, max_steps: int | None, eval_strategy: str) -> None:
    """A stream has no length: max_steps ends the run, and there is no epoch to evaluate at."""
    if streaming and max_steps is None:
        raise UserError(
            "max_steps", NULL, "dataset.streaming=true: a stream has no length; give max_steps=N"
        )
    if streaming and eval_strategy == "epoch":
        raise UserError(
            "eval.strategy",
            "epoch",
            "dataset.streaming=true: a stream has no epochs; give eval.strategy=steps or no",
        )


def _column_map(kind: str, given: DictConfig) -> dict[str, str | None]:
    """dataset.column_map: the column of each of the kind's fields (a required one named)."""
    from runner.data import COLUMNS

    column_map = {str(k): v for k, v in given.items()}
    for ours, required in COLUMNS[kind].items():
        if ours not in column_map or (required and column_map[ours] is None):
            raise UserError(
                f"dataset.column_map.{ours}",
                column_map.get(ours),
                f"dataset.kind={kind} needs "
                f"the column that holds {ours}: dataset.column_map.{ours}=<column>",
            )
    read_for: dict[str, str] = {}  # column: the field read from it
    for ours in COLUMNS[kind]:
        column = column_map[ours]
        if column is not None and column in read_for:
            # Named: the field moved onto the column, not the one reading its namesake (the
            # default, `output: output`) that it was moved onto.
            fields = sorted((read_for[column], ours), key=lambda field: field == column)
            raise UserError(
                f"dataset.column_map.{fields[0]}",
                column,
                f"dataset.column_map.{fields[1]} reads that column already; give each "
                "field a column of its own",
            )
        read_for.setdefault(column, ours)
    return {k: column_map[k] for k in COLUMNS[kind]}


def _conversation_style(kind: str, style: str | None) -> str | None:
    """dataset.conversation_style of a kind of conversations (None for the other kinds)."""
    from runner.data import CONVERSATION_STYLES

    if kind not in ("chat", "preference"):
        return None
    if style not in CONVERSATION_STYLES:
        raise UserError(
            "dataset.conversation_style",
            style,
            f"choose one of: {', '.join(CONVERSATION_STYLES)}",
        )
    return style


def _held_out(value: Any) -> str | None:
    """dataset.validation.held_out, checked: a percentage (5%) or a fraction (0.05), as typed."""
    from runner.data import held_out_fraction

    if value is None:
        return None
    held_out_fraction(value)
    return str(value).strip()


def _validation(held: DictConfig, given_format: str | None) -> ValidationRecipe:
    """dataset.validation: one of a held-out share, a split or a source (read in
    `given_format`, dataset.format, or where it is null in its own extension's)."""
    from runner.data import local_source, source_format

    held_out = _held_out(held.held_out)  # its own value first: held_out= is no second set
    given = [k for k in ("held_out", "split", "source") if held[k] is not None]
    if given and given != ["held_out"] and "held_out" in given:
        raise UserError(
            "dataset.validation.held_out",
            held.held_out,
            f"set either held_out or a split/source, not both (also set: {given[1:]}); "
            "override the other with null",
        )
    source, split, data_format = held.source, held.split, None
    if source is not None:
        source = local_source("dataset.validation.source", str(source))
        data_format = source_format("dataset.validation.source", source, given_format)
        # A separate file is read whole unless a split of it is named.
        split = "train" if split is None else split
    return ValidationRecipe(
        held_out=held_out,
        seed=held.seed,
        split=None if split is None else str(split),
        source=source,
        format=data_format,
    )


def loader_workers(given: int | None, device: str) -> int:
    """dataset.num_workers; null: none on the CPU, where workers share the cores the training
    computes on and measured within the runs' spread of none on two cores
    (scripts/bench/bench_loader.py: 1.09x and 1.10x median, ranges overlapping), and 2 per process
    on CUDA, where the CPU would otherwise prepare each batch while the GPU waits."""
    if given is not None:
        return given
    return 0 if device == "cpu" else 2


def check_packing(packing: bool, model: ModelRecipe, device: str) -> None:
    """Packs on a GPU get flex attention's block mask, which some families' torchtune attention
    does not take (Gemma 2's)."""
    from runner.models.families import family_named

    if not packing or device != "cuda" or model.backend != "torchtune" or model.family is None:
        return
    if not family_named(model.family).block_mask:
        raise UserError(
            "dataset.packing",
            True,
            f"torchtune's {model.family} attention takes no flex-attention block mask, which "
            "packs get on a GPU; set dataset.packing=false (dataset.padding_free packs each "
            "batch with a dense mask)",
        )


# attention: how rows of several samples attend on CUDA (runner.models.attention.RowAttention).
ATTENTION = ("auto", "flex", "varlen")


def check_attention(
    attention: str, dataset: DatasetRecipe, model: ModelRecipe, device: str, dtype: str
) -> None:
    """attention: auto (the best measured for the device: flex attention's block mask on CUDA,
    attention per sample on the CPU), flex, or varlen (FlashAttention's variable-length kernel:
    CUDA of compute capability 8.0 and up, bf16, torch 2.10 and later). Rows of one sample
    each need none of them: there it is ignored, with a warning."""
    if attention not in ATTENTION:
        raise UserError("attention", attention, f"choose one of: {', '.join(ATTENTION)}")
    if attention == "auto":
        return
    if device != "cuda":
        raise UserError(
            "attention",
            attention,
            "flex and varlen are CUDA's kernels (on the CPU, rows of several samples attend "
            "per sample); set attention=auto",
        )
    if not (dataset.packing or dataset.padding_free):
        log.warning(
            "attention=%s is ignored: no row holds several samples (dataset.packing and "
            "dataset.padding_free are false)",
            attention,
        )
        return
    _check_kernel(attention, model, dtype)


def _check_kernel(attention: str, model: ModelRecipe, dtype: str) -> None:
    """That this model, dtype, torch and GPU take the attention kernel asked for."""
    import torch

    from runner.models.attention import VARLEN_KEYWORDS
    from runner.models.families import family_named
    from runner.models.torchtune_boundary import SUPPORTS_FLEX_ATTENTION

    why = kernel_refusal(
        attention,
        family=model.family,
        block_mask=model.family is None or family_named(model.family).block_mask,
        dtype=dtype,
        # None: no GPU here, a GPU layout that runner estimate prices.
        capability=torch.cuda.get_device_capability() if torch.cuda.is_available() else None,
        torch_version=torch.__version__,
        has_flex=SUPPORTS_FLEX_ATTENTION,
        has_varlen=VARLEN_KEYWORDS is not None,
    )
    if why is not None:
        raise UserError("attention", attention, why)


def kernel_refusal(
    attention: str,
    *,
    family: str | None,
    block_mask: bool,
    dtype: str,
    capability: tuple[int, int] | None,
    torch_version: str,
    has_flex: bool,
    has_varlen: bool,
) -> str | None:
    """Why the model (its `family`, whose torchtune attention takes a `block_mask` or not),
    `dtype`, torch and GPU (its compute `capability`; `has_flex`, torchtune's own verdict on
    flex attention, which RowAttention follows) cannot take `attention` (flex or varlen), with
    the fix; None where they can. capability=None: no GPU is here (a layout runner estimate
    prices), so what the GPU decides is left to the run on it."""
    if not block_mask:
        return (
            f"torchtune's {family} attention does its own arithmetic on a dense mask, which it "
            "always gets; set attention=auto"
        )
    gpu = "" if capability is None else f"this GPU's is {capability[0]}.{capability[1]}"
    if attention == "flex" and not has_flex and gpu:  # compute capability 7.5 and up
        return f"flex attention needs compute capability 7.5 or more, and {gpu}; set attention=auto"
    if attention != "varlen":
        return None
    if dtype == "fp32":
        return (
            "FlashAttention computes in bf16: set dtype=bf16_mixed or dtype=bf16, or attention=auto"
        )
    if not has_varlen:
        return (
            f"torch {torch_version} has no torch.nn.attention.varlen (2.10 and later have it); "
            "set attention=auto"
        )
    if capability is not None and capability < (8, 0):
        return f"FlashAttention needs compute capability 8.0 or more, and {gpu}; set attention=auto"
    return None


def padding_free(dataset: DatasetRecipe, given: bool | None, model: ModelRecipe) -> bool:
    """Whether each batch is packed into rows (dataset.padding_free; null: wherever that is
    correct: SFT data, unpacked, on torchtune's models, which take a block-causal mask)."""
    for key, value in (("packing", dataset.packing), ("padding_free", given)):
        if value and model.backend == "transformers":
            raise UserError(
                f"dataset.{key}",
                True,
                f"model.source={model.source} trains through transformers' own model class "
                f"({model.backend_reason}), which runner gives no per-document block-causal "
                f"mask; set dataset.{key}=false",
            )
    if given and dataset.kind == "preference":
        raise UserError(
            "dataset.padding_free",
            True,
            "preference pairs are batched padded; set dataset.padding_free=false",
        )
    if dataset.packing:  # packs are rows already
        if given:  # taken, recorded and run as false, unsaid
            raise UserError(
                "dataset.padding_free",
                True,
                "dataset.packing=true lays the rows out already; set dataset.padding_free=null "
                "(or false), or packing=false to batch padding-free",
            )
        return False
    if given is not None:
        return given
    return model.backend != "transformers" and dataset.kind != "preference"
