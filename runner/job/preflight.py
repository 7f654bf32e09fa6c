"""`runner validate` and `runner estimate`: look before you leap, before any accelerator time.

Both compose exactly what `runner train` would (same config, same overrides) and write nothing.
"""

from __future__ import annotations

import dataclasses
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from runner.components import instantiate, plain_dict
from runner.config.fields import as_typed
from runner.config.interpolations import check_resume
from runner.config.load_checkpoint import check_one_global_batch
from runner.config.method import PREFERENCE_METHODS
from runner.config.optimizer import split_option, state_per_weight
from runner.config.resolve import resolve_recipe
from runner.config.schema import read_recipe
from runner.data import check_datasets, held_out_fraction, train_dataset
from runner.data.files import is_remote
from runner.models.backends import Backend, backend_for
from runner.rundir import RECIPE_FILE

# Bytes a value of each dtype option: (trained parameters, their gradients and AdamW moments;
# compute: frozen weights, activations).
BYTES = {"fp32": (4, 4), "bf16_mixed": (4, 2), "bf16": (2, 2)}
# torchao's NF4: 4 bits a weight, an int8 scaler per 64 weights, an fp32 one per 256 scalers.
NF4_BYTES = 0.5 + 1 / 64 + 4 / (64 * 256)


def recipe_of(
    cfg: DictConfig, overrides: list[str] | None = None, estimating: bool = False
) -> DictConfig:
    """The recipe `runner train` would run; estimating, nothing is downloaded and a GPU layout
    is priced as given on any machine (resolve_recipe's fetch and gpus_here). With resume=RUN,
    the recipe RUN recorded, which a resume goes on with (a fresh default was checked)."""
    if overrides is None:
        overrides = as_typed(HydraConfig.get().overrides.task) if HydraConfig.initialized() else []
    if cfg.get("resume") is not None:
        check_resume(cfg.resume, overrides)
        return read_recipe(Path(str(cfg.resume)) / RECIPE_FILE)
    with tempfile.TemporaryDirectory() as tmp:
        recipe = resolve_recipe(
            cfg, Path(tmp), overrides, fetch=not estimating, gpus_here=not estimating
        )
    recipe.run_dir = "<new run directory>"
    return recipe


def validate(cfg: DictConfig) -> None:
    """Prints the resolved recipe, then checks the model weights, tokenizer and data."""
    check(cfg, report=print)


def check(
    cfg: DictConfig,
    overrides: list[str] | None = None,
    report: Callable[[str], Any] | None = None,
) -> tuple[DictConfig, dict[str, int]]:
    """The resolved recipe and the records found in each split, after checking weights,
    tokenizer and every record (raises the first UserError); each finding goes to `report`.

    `overrides`: those `cfg` was composed with (None: Hydra's, inside a Hydra app).
    """
    say = report or (lambda line: None)
    recipe = recipe_of(cfg, overrides=overrides)
    say(OmegaConf.to_yaml(recipe))
    model = recipe.model
    weights = model.source or f"random init (seed {recipe.seed})"
    if model.source is not None and model.family is not None:
        weights += f" ({model.family})"
    tokenizer = instantiate(model.tokenizer)
    say(f"ok  weights    {weights}{_origin(recipe, 'model.source')}")
    say(f"ok  backend    {model.backend}: {model.backend_reason}")
    if recipe.method.quantization is not None:
        say(f"ok  base       {recipe.method.quantization}")
    say(
        f"ok  tokenizer  {model.tokenizer.path} ({tokenizer.vocab_size} tokens)"
        f"{_origin(recipe, 'model.tokenizer')}"
    )
    data = recipe.dataset
    found = check_datasets(data, tokenizer, evaluates=recipe.eval.strategy != "no")
    # A split streamed from the hub is named by its hub URL at the commit already.
    from_hub = is_remote(data.source)
    origin = "" if from_hub else _origin(recipe, "dataset.source")
    where = {"train": f"{data.source} [{data.split}]{origin}", "validation": _validation(recipe)}
    if data.streaming:
        read = " from the hub, its files read as it trains, never downloaded" if from_hub else ""
        say(
            f"--  {'train':<10} {where['train']}: a stream{read}, checked window by window "
            f"({data.shuffle_buffer} records of each process at a time) as it trains"
        )
    for split, records in found.items():
        say(f"ok  {split:<10} {where[split]} ({records} records)")
    # As `runner train` refuses it before it starts: a split of fewer records than one global
    # batch trains nothing.
    check_one_global_batch(recipe, found.get("train"))
    return recipe, found


def _validation(recipe: DictConfig) -> str:
    data = recipe.dataset
    held = data.validation
    if held.held_out is not None:
        share = held_out_fraction(held.held_out)
        return f"{share:.1%} of the train split, held out (seed {held.seed})"
    if held.source is None:
        return f"{data.source} [{held.split}]{_origin(recipe, 'dataset.source')}"
    return f"{held.source} [{held.split}]{_origin(recipe, 'dataset.validation.source')}"


def _origin(recipe: DictConfig, key: str) -> str:
    """' from hf://...@commit' where `key` came from the hub, else nothing."""
    pinned = recipe.hub_sources.get(key)
    return f" from {pinned}" if pinned else ""


@dataclass(frozen=True)
class Estimate:
    """What a run will need per device, and how much data an epoch is."""

    parameters: int
    trainable_parameters: int
    world_size: int
    weights_bytes: int
    gradients_bytes: int
    optimizer_bytes: int
    # Weight-sized tensors the optimizer keeps per trained weight (AdamW: 2).
    optimizer_tensors_per_weight: int
    # None: the model's tokenizer is not on this machine, so the data is not measured.
    activations_bytes: int | None
    tokens_per_epoch: int | None
    # The longest row of a forward pass: a sample, or a preference pair's longer answer.
    longest_sample: int | None
    steps_per_epoch: int | None
    # The total per device under each dtype option, for comparison (without activations where
    # activations_bytes is None).
    total_by_dtype: dict[str, int]

    @property
    def total_bytes(self) -> int:
        """Everything per device: weights, gradients, optimizer state and activations (if any)."""
        return (
            self.weights_bytes
            + self.gradients_bytes
            + self.optimizer_bytes
            + (self.activations_bytes or 0)
        )


def estimate(recipe: DictConfig) -> Estimate:
    """Parameter count (built on the meta device), memory per device and tokens per epoch.

    Trained weights, their gradients and the optimizer's state (AdamW: two moments, counted by
    runner.config.optimizer) are in the parameter dtype and sharded over the world (FSDP2); with
    LoRA, gradients and moments are the adapters' only, the frozen base is in the compute dtype, and
    with QLoRA its projections take NF4's ~4.1 bits a weight. bf16_mixed in one process also
    holds autocast's bf16 copy of the weights.
    Activations, in the compute dtype, are what each layer keeps for backward (measured:
    LAYER_VALUES) for the longest sample in a full batch, with layer inputs only under
    activation checkpointing, plus the logits as the loss keeps them (LOGITS_BYTES); with
    Korthikanti et al.'s (2022) attention scores where the attention is not fused
    (_activations).
    """
    counts = _parameter_counts(recipe)
    world = recipe.compute.nproc_per_node * recipe.compute.nnodes
    moments = state_per_weight(split_option(plain_dict(recipe.optimizer))[0])

    def state_bytes(dtype: str) -> tuple[int, int, int]:
        """Weights, gradients and optimizer state per device under `dtype`."""
        return _state_bytes(counts, world, moments, dtype)

    weights_bytes, gradients_bytes, optimizer_bytes = state_bytes(recipe.dtype.name)
    model_only = Estimate(
        parameters=counts.parameters,
        trainable_parameters=counts.trainable,
        world_size=world,
        weights_bytes=weights_bytes,
        gradients_bytes=gradients_bytes,
        optimizer_bytes=optimizer_bytes,
        optimizer_tensors_per_weight=moments,
        activations_bytes=None,
        tokens_per_epoch=None,
        longest_sample=None,
        steps_per_epoch=None,
        total_by_dtype={dtype: sum(state_bytes(dtype)) for dtype in BYTES},
    )
    if recipe.model.tokenizer is None:
        return model_only
    if recipe.dataset.streaming:
        # A stream is not read ahead: a batch of samples of max_seq_len tokens bounds it.
        values, logits_bytes = _activations(recipe, recipe.dataset.max_seq_len)
        streamed = _Data([], values, logits_bytes, recipe.dataset.max_seq_len)
        return dataclasses.replace(
            model_only,
            activations_bytes=streamed.activations_bytes(recipe.dtype.name),
            longest_sample=recipe.dataset.max_seq_len,
            total_by_dtype={
                dtype: sum(state_bytes(dtype)) + streamed.activations_bytes(dtype)
                for dtype in BYTES
            },
        )
    data = _measure_data(recipe)
    global_batch = recipe.batch_size * world * recipe.gradient_accumulation_steps
    return dataclasses.replace(
        model_only,
        activations_bytes=data.activations_bytes(recipe.dtype.name),
        tokens_per_epoch=sum(data.lengths),
        longest_sample=data.row,
        steps_per_epoch=len(data.lengths) // global_batch,
        total_by_dtype={
            dtype: sum(state_bytes(dtype)) + data.activations_bytes(dtype) for dtype in BYTES
        },
    )


def _state_bytes(counts: _Counts, world: int, moments: int, dtype: str) -> tuple[int, int, int]:
    """Weights, gradients and optimizer state per device under `dtype`."""
    master, compute = BYTES[dtype]
    weights = counts.trainable * master + counts.frozen * compute + counts.quantized * NF4_BYTES
    weights += counts.reference * master
    if master != compute and world == 1:
        weights += counts.trainable * compute
    shard = counts.trainable * master // world
    return int(weights) // world, shard, moments * shard


@dataclass(frozen=True)
class _Data:
    """The training split as measured: each sample's tokens, and the activations of a full batch
    of the longest (values kept for backward, and the logits' bytes); `row` the longest
    row a forward pass takes (a preference pair's longer answer: its answers are two rows)."""

    lengths: list[int]
    activation_values: float
    logits_bytes: int
    row: int

    def activations_bytes(self, dtype: str) -> int:
        """The activations' bytes, their values in `dtype`'s compute dtype."""
        return int(self.activation_values * BYTES[dtype][1] + self.logits_bytes)


def _measure_data(recipe: DictConfig) -> _Data:
    """Reads and tokenizes the training split as training does (packed if dataset.packing)."""
    tokenizer = instantiate(recipe.model.tokenizer)
    # torch's Dataset declares no __iter__; the splits (tokenized records, torchtune's packs)
    # are sequences of samples, read by index until IndexError.
    samples = cast("Iterable[dict[str, Any]]", train_dataset(recipe.dataset, tokenizer))
    lengths, rows = [], []
    for sample in samples:
        lengths.append(_sample_tokens(sample))
        rows.append(_sample_rows(sample))
    values, logits_bytes = _activations(recipe, max(rows))
    return _Data(lengths, values, logits_bytes, max(rows))


@dataclass(frozen=True)
class _Counts:
    """Parameters of the model as trained: all, trained, frozen in the compute dtype, in NF4,
    and DPO's frozen reference (built as the policy is, in the master dtype)."""

    parameters: int
    trainable: int
    frozen: int
    quantized: int
    reference: int = 0


def _parameter_counts(recipe: DictConfig) -> _Counts:
    """The model's parameters (built on the meta device by its backend), with LoRA's adapters
    and frozen base."""
    backend = backend_for(recipe.model)
    model = backend.meta_model(None)
    parameters = sum(p.numel() for p in model.parameters())
    method = recipe.method
    if method.builder is None:  # full, dpo: every parameter trains
        # DPO holds a frozen reference copy of the weights besides.
        return _Counts(parameters, parameters, 0, 0, parameters if method.name == "dpo" else 0)
    trainable = _adapter_parameters(backend, method.builder)
    quantized = 0
    if method.builder.quantize_base and recipe.model.backend == "torchtune":
        # Those of the base projections whose weights make whole NF4 blocks (runner.models.nf4).
        from runner.models.nf4 import base_projections

        world_size = recipe.compute.nnodes * recipe.compute.nproc_per_node
        adapted = backend.meta_model(method.builder)
        quantized = sum(
            p.shape[0] * p.shape[1]
            for p in base_projections(adapted, world_size)
            if p.scaler_block is not None
        )
    elif method.builder.quantize_base:
        # The projections of the decoder layers (2-D weights; norms are 1-D).
        quantized = sum(
            p.numel()
            for layer in backend.layers(model)
            for name, p in layer.named_parameters()
            if p.dim() == 2 and "norm" not in name
        )
    return _Counts(parameters + trainable, trainable, parameters - quantized, quantized)


def _sample_tokens(sample: dict[str, Any]) -> int:
    """A sample's tokens; a preference pair's, both answers'."""
    if "tokens" in sample:
        return len(sample["tokens"])
    return len(sample["chosen_tokens"]) + len(sample["rejected_tokens"])


def _sample_rows(sample: dict[str, Any]) -> int:
    """The longest row of a sample in a forward pass: a preference pair's answers are two rows
    (runner.data.preference.collate_preference), each padded to the longest."""
    if "tokens" in sample:
        return len(sample["tokens"])
    return max(len(sample["chosen_tokens"]), len(sample["rejected_tokens"]))


def _rows_per_sample(recipe: DictConfig) -> int:
    """Rows a sample makes in a forward pass: a preference pair two, its answers."""
    return 2 if recipe.method.name in PREFERENCE_METHODS else 1


def _forward_samples(recipe: DictConfig, seq: int) -> int:
    """How many `seq`-token rows one forward pass takes: the batch's (a preference pair's two),
    or of as many of its samples as dataset.max_forward_tokens holds (one at least)."""
    cap, batch = recipe.dataset.max_forward_tokens, int(recipe.batch_size)
    rows = _rows_per_sample(recipe)
    return rows * (batch if cap is None else max(1, min(batch, int(cap) // seq)))


# The values a decoder layer keeps for backward, a token, as runner trains it (its feed-forward
# and norms keeping fewer, runner.models.activation_memory; fused attention): 8 of the model's
# width and 3 of its feed-forward's, measured with saved_tensors_hooks on torchtune's Llama
# (tests/test_preflight.py). Korthikanti et al.'s 34 bytes at 2 a value, 17 of the width, were
# a GPT layer's, whose feed-forward is 4 widths of GeLU: they priced every model's alike, 1.2x
# low at Llama's 4 widths and 3.5x at 16.
LAYER_VALUES = {"width": 8, "feed_forward": 3}
# The bytes a logit takes at the step's live peak, in any dtype, measured (tests/test_preflight.py,
# fp32 and bf16 within 5%): a loss over the whole logits (loss=ce) casts them to fp32 and keeps
# their log-softmax, and backward makes its gradient and the logits' beside it, 12 bytes; a
# chunked loss (loss=chunked_ce) keeps each chunk's fp32 log-softmax beside the logits, 7.
# Priced as one fp32 copy, they were 1.7x (chunked) to 3x (ce) low: 7.8 GiB short with loss=ce
# at a 128k vocabulary and 4 rows of 2,048 tokens.
LOGITS_BYTES = {"whole": 12, "chunked": 7}


def _activations(recipe: DictConfig, seq: int) -> tuple[float, int]:
    """(activation values kept for backward, the logits' bytes) for a full batch of
    `seq`-token samples, as many as one forward pass takes (dataset.max_forward_tokens)."""
    builder, batch = recipe.model.builder, _forward_samples(recipe, seq)
    hidden, layers, heads = builder["embed_dim"], builder["num_layers"], builder["num_heads"]
    # Korthikanti et al.'s 5as/h (bytes at 2 a value): the attention's scores, softmax and
    # dropout mask, quadratic in the length. Fused attention (SDPA on the CPU and CUDA, flex,
    # varlen) keeps none of them; a torchtune attention that does its own arithmetic on a dense
    # mask (Gemma 2's soft-capping) does.
    scores = 5 * heads * seq / hidden / 2 if _computes_scores(recipe.model) else 0
    width = LAYER_VALUES["width"] + scores
    # Where the builder leaves it out (a transformers model's builder, or null: torchtune's
    # Llama builders scale it from the width): a GPT's 4 widths.
    feed_forward = builder.get("intermediate_dim") or 4 * hidden
    per_layer = seq * batch * (width * hidden + LAYER_VALUES["feed_forward"] * feed_forward)
    kept = layers * seq * batch * hidden + per_layer
    values = kept if recipe.activation_checkpointing else layers * per_layer
    chunked = "num_output_chunks" in recipe.loss
    per_logit = LOGITS_BYTES["chunked" if chunked else "whole"]
    return values, seq * batch * builder["vocab_size"] * per_logit


def _computes_scores(model: DictConfig) -> bool:
    """Whether the model's attention computes its scores itself, keeping them for backward."""
    from runner.models.families import family_named

    if model.backend != "torchtune" or model.family is None:
        return False
    return not family_named(model.family).block_mask


def _adapter_parameters(backend: Backend, lora: DictConfig) -> int:
    """The parameters of the LoRA adapters the method adds to the model (built on meta)."""
    model = backend.meta_model(plain_dict(lora))
    return sum(p.numel() for name, p in model.named_parameters() if "lora_" in name)


def _gib(n: int) -> str:
    return f"{n / 2**30:.3f} GiB"


def print_estimate(recipe: DictConfig, found: Estimate) -> None:
    """What `runner estimate` prints: the model, the memory per device by part, the data."""
    print(
        f"model          {found.parameters:,} parameters, {recipe.dtype.name}, "
        f"{recipe.compute.device} x {found.world_size}"
    )
    print(f"backend        {recipe.model.backend}: {recipe.model.backend_reason}")
    if found.trainable_parameters != found.parameters:
        print(
            f"trained        {found.trainable_parameters:,} adapter parameters "
            f"(method={recipe.method.name})"
        )
    print(f"weights        {_gib(found.weights_bytes)} per device")
    print(f"gradients      {_gib(found.gradients_bytes)} per device")
    component = recipe.optimizer._component_.rpartition(".")[2]
    print(
        f"optimizer      {_gib(found.optimizer_bytes)} per device ({component}, "
        f"{found.optimizer_tensors_per_weight} state tensor(s) per weight)"
    )
    if found.activations_bytes is None:
        print(
            f"activations    not estimated: the tokenizer of model.source={recipe.model.source} "
            "is not here to measure the data (`runner download` fetches it)"
        )
        print(f"total          at least {_gib(found.total_bytes)} per device")
        _print_by_dtype(found, "at least ")
        return
    assert found.longest_sample is not None  # measured with the activations
    print(
        f"activations    {_gib(found.activations_bytes)} per device (a forward pass of "
        f"{_forward_samples(recipe, found.longest_sample)} x {found.longest_sample} tokens)"
    )
    print(f"total          {_gib(found.total_bytes)} per device")
    _print_by_dtype(found)
    if found.tokens_per_epoch is None or found.steps_per_epoch is None:
        print(f"data           a stream, read as it trains ({recipe.max_steps:,} steps)")
        return
    print(
        f"data           {found.tokens_per_epoch:,} tokens per epoch, "
        f"{found.steps_per_epoch:,} optimizer steps per epoch"
    )


def _print_by_dtype(found: Estimate, bound: str = "") -> None:
    print(
        f"by dtype       {bound}"
        + ", ".join(f"{name} {_gib(total)}" for name, total in found.total_by_dtype.items())
        + " per device"
    )


def estimated(cfg: DictConfig, overrides: list[str] | None = None) -> tuple[DictConfig, Estimate]:
    """The resolved recipe and its Estimate. The builder gives the parameter count: an
    uncached hf:// model is not downloaded. A GPU layout (compute=multi_gpu with
    compute.nproc_per_node=8) is priced on any machine, with or without GPUs: the model is built
    on the meta device. `overrides`: as for `check`."""
    recipe = recipe_of(cfg, overrides=overrides, estimating=True)
    return recipe, estimate(recipe)
