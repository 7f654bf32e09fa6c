"""The typed schemas of the composed configs: `runner train`'s (a section per config group, each
declared in its own module beside its checks and resolution), `runner deploy`'s, `runner
export`'s and `runner cluster`'s, and of the recipe `runner train` resolves.

`typed(cfg)` merges the composed config into the schema (runner.config.fields.typed_as), so a
wrong type, an unknown key or a value out of its field's bound is one UserError naming the key,
the value and the fix. What cannot be said per field is checked by each section's module.

Open-ended sections stay dictionaries: `loss` and `optimizer` are a component's keyword
arguments, `model.builder` a builder's, `runtime.env` environment variables.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

from omegaconf import MISSING, DictConfig, OmegaConf, ValidationError

from runner.components import plain_dict
from runner.config.compute import Compute, ComputeRecipe, Dtype
from runner.config.dataset import Dataset, DatasetRecipe
from runner.config.evaluation import Eval, EvalRecipe, Objective
from runner.config.fields import EVERY_KEY, flag, integer, number, typed_as
from runner.config.method import Method, MethodRecipe
from runner.config.model import Model, ModelRecipe
from runner.config.runtime import Runtime, RuntimeRecipe
from runner.errors import UserError
from runner.paths import pasteable
from runner.rundir import write_text_atomic

# typing's Optional/Dict/List: the forms OmegaConf 2.3 reads in structured-config annotations.
# ruff: noqa: UP006, UP035, UP045


@dataclass
class Profile:
    """profile: torch.profiler over a few steps (runner.trainer.profiling)."""

    enabled: bool = flag(False)
    start_step: int = integer(3, 1)
    steps: int = integer(2, 1)


@dataclass
class Training:
    """The training keys that belong to no config group; the recipe records them as given."""

    max_steps: Optional[int] = integer(None, 1)
    epochs: int = integer(1, 1)
    batch_size: int = integer(1, 1)
    gradient_accumulation_steps: int = integer(1, 1)
    clip_grad_norm: Optional[float] = number(None, positive=True)
    compile: bool = flag(False)
    attention: str = "auto"
    activation_checkpointing: bool = flag(False)
    profile: Profile = field(default_factory=Profile)


@dataclass
class LoadCheckpoint:
    """load_checkpoint: a checkpoint to start from (runner.config.load_checkpoint)."""

    path: Optional[str] = None
    mode: Optional[str] = None


@dataclass
class Train(Training):
    """`runner train`: the training keys that belong to no group, and the config groups."""

    runtime: Runtime = field(default_factory=Runtime)
    model: Model = field(default_factory=Model)
    dataset: Dataset = field(default_factory=Dataset)
    dtype: Dtype = field(default_factory=Dtype)
    loss: Dict[str, Any] = field(default_factory=dict)
    compute: Compute = field(default_factory=Compute)
    method: Method = field(default_factory=Method)
    optimizer: Dict[str, Any] = field(default_factory=dict)
    # torch's generators take 64 bits; the data's sampler adds the epoch to it.
    seed: int = integer(0, 0, 2**63 - 1)
    resume: Optional[str] = None
    load_checkpoint: LoadCheckpoint = field(default_factory=LoadCheckpoint)
    objective: Objective = field(default_factory=Objective)
    eval: Eval = field(default_factory=Eval)


@dataclass
class Select:
    checkpoint: str = "latest"
    metric: Optional[str] = None
    mode: Optional[str] = None


@dataclass
class TransformersEngine:
    max_batch_size: Optional[int] = integer(None, 1)
    kv_cache_gib: Optional[float] = number(None, positive=True)
    max_prefill_tokens: Optional[int] = integer(None, 1)
    max_waiting_steps: int = integer(20, 0)
    waiting_served_ratio: float = number(0.3, positive=False)
    stream_interval: int = integer(1, 1)
    process: Optional[bool] = None
    compile: bool = False


@dataclass
class VllmEngine:
    max_num_seqs: int = integer(256, 1)
    gpu_memory_utilization: Optional[float] = number(None, positive=True)
    tensor_parallel_size: int = integer(1, 1)


@dataclass
class ApiKey:
    env: Optional[str] = None
    file: Optional[str] = None


@dataclass
class Limits:
    max_n: int = integer(8, 1)
    max_tokens: int = integer(4096, 1)
    default_max_tokens: int = integer(256, 1)
    max_stop: int = integer(4, 1)
    max_stop_chars: int = integer(256, 1)
    max_body_bytes: int = integer(1048576, 1)


@dataclass
class Deploy:
    """`runner deploy`: what to serve, the engine, the address, the key and the request caps."""

    dtype: Dtype = field(default_factory=Dtype)
    # A path or a list of them; a name or a list (runner.deploy.selection checks them).
    checkpoint: Any = MISSING
    served_model_name: Any = None
    select: Select = field(default_factory=Select)
    allowed_roots: List[str] = field(default_factory=list)
    engine: str = "transformers"
    device: str = "auto"
    max_model_len: Optional[int] = integer(None, 1)
    max_queue: int = integer(256, 1)
    transformers: TransformersEngine = field(default_factory=TransformersEngine)
    vllm: VllmEngine = field(default_factory=VllmEngine)
    host: str = "127.0.0.1"
    # 0 picks a free port.
    port: int = integer(8000, 0)
    api_key: ApiKey = field(default_factory=ApiKey)
    allowed_hosts: List[str] = field(default_factory=list)
    allowed_origins: List[str] = field(default_factory=list)
    limits: Limits = field(default_factory=Limits)


@dataclass
class MergedExport:
    dtype: str = "fp32"
    quantization: Optional[str] = None


@dataclass
class GgufExport:
    quantization: str = "f16"


@dataclass
class Export:
    """`runner export`: which checkpoint, in which format, where."""

    checkpoint: str = MISSING
    select: Select = field(default_factory=Select)
    format: str = "merged"
    merged: MergedExport = field(default_factory=MergedExport)
    gguf: GgufExport = field(default_factory=GgufExport)
    base: Optional[str] = None
    out: Optional[str] = None
    push_to: Optional[str] = None
    private: bool = flag(True)
    hf_token: Optional[str] = "env:HF_TOKEN"


@dataclass
class Slurm:
    partition: Optional[str] = None
    time: str = "24:00:00"
    cpus_per_task: int = integer(16, 1)
    signal_before_end_s: int = integer(120, 0)
    setup: List[str] = field(default_factory=list)


@dataclass
class Kubeflow:
    namespace: str = "default"
    runtime: str = "torch-distributed"
    image: Optional[str] = None


@dataclass
class Cluster:
    """`runner cluster`: the job files for a multi-node run (its `cluster.` keys)."""

    print: str = "both"
    name: str = "runner-train"
    nodes: int = integer(2, 1)
    gpus_per_node: int = integer(8, 0)
    shared_dir: str = "/shared/runs"
    slurm: Slurm = field(default_factory=Slurm)
    kubeflow: Kubeflow = field(default_factory=Kubeflow)


# ---- the recipe: what `runner train` resolved, as every training process reads it ------------
# recipe.yaml keeps the sections and names of Train, each value resolved (`auto` made concrete,
# hf:// sources made local paths, components named), plus what resolution derives (the builder,
# tokenizer and config.json of the model; where the processes meet). Bumped when a key moves,
# goes or comes (5: method.recipe went; one recipe loop runs every method. 6: runtime.hf_token
# came, the reference a stream from the hub reads its token through. 7: profile came. 8:
# attention came).
RECIPE_VERSION = 8


@dataclass
class RecipeSections:
    """The head of recipe.yaml: what names the run, then each section of Train, resolved."""

    version: int = RECIPE_VERSION
    run_dir: str = MISSING
    seed: int = 0
    model: ModelRecipe = field(default_factory=ModelRecipe)
    # Where each hf:// source came from, pinned to the commit that was used.
    hub_sources: Dict[str, Any] = field(default_factory=dict)
    dataset: DatasetRecipe = field(default_factory=DatasetRecipe)
    dtype: Dtype = field(default_factory=Dtype)
    loss: Dict[str, Any] = field(default_factory=dict)
    compute: ComputeRecipe = field(default_factory=ComputeRecipe)
    method: MethodRecipe = field(default_factory=MethodRecipe)
    # The option's component and arguments with its schedule keys (runner.config.optimizer).
    optimizer: Dict[str, Any] = field(default_factory=dict)
    runtime: RuntimeRecipe = field(default_factory=RuntimeRecipe)
    eval: EvalRecipe = field(default_factory=EvalRecipe)
    objective: Objective = field(default_factory=Objective)


# A dataclass takes its bases' fields in reverse method resolution order: recipe.yaml lists the
# sections (RecipeSections), then the training keys (Training), then stop_at_step.
@dataclass
class Recipe(Training, RecipeSections):
    """recipe.yaml: Train's sections and keys, resolved (see RECIPE_VERSION)."""

    # Set by `runner repro --steps N`: end after step N without changing the schedule.
    stop_at_step: Optional[int] = None
    # load_checkpoint in mode resume: another run's checkpoint to start from (the run's own
    # latest whole checkpoint, where it has one, wins).
    resume_from: Optional[str] = None


def read_recipe(path: Path) -> DictConfig:
    """A run's recipe.yaml, typed; one recorded before the layout changed is refused by name."""
    values = OmegaConf.load(path)
    if isinstance(values, DictConfig) and not values:
        raise _cut_short(path, "it is empty")
    version = values.get("version") if isinstance(values, DictConfig) else None
    if version != RECIPE_VERSION:
        raise UserError(
            str(path),
            f"version {version or 1}",
            f"was written by another runner (recipe version {RECIPE_VERSION} here): train it "
            "again from its overrides (manifest.json) with this one, or use the runner that "
            "wrote it",
        )
    # A key Recipe does not know is a bug of runner's, not the user's.
    try:
        typed_recipe = OmegaConf.merge(OmegaConf.structured(Recipe), values)
    except ValidationError as err:  # a value cut off by the end of the file: `format:`
        raise _cut_short(path, f"{err.full_key}: {err.msg}") from None
    assert isinstance(typed_recipe, DictConfig)  # a dataclass merges into a DictConfig
    validation = typed_recipe.dataset.validation
    if validation.source is not None and validation.format is None:
        # Recorded before a validation file was read in its own format: it was read in
        # dataset.format (a recipe written since holds the format it resolved).
        validation.format = typed_recipe.dataset.format
    return typed_recipe


def _cut_short(path: Path, why: str) -> UserError:
    """A run's recipe.yaml that does not read as a recipe: cut short (a copy stopped midway, a
    full disk), or edited. Its run's checkpoints still start a new run."""
    return UserError(
        str(path),
        None,
        f"does not read as a recipe ({why}): cut short (a copy stopped midway, a full disk) or "
        "edited; put back a whole copy (manifest.json's `config` recorded the values the run "
        "started with), or start a new run from its checkpoint (runner train "
        f"{pasteable('load_checkpoint.path', str(path.parent))} ...)",
    )


def recipe_as_written(path: Path) -> dict[str, Any]:
    """A run's recipe.yaml as the file holds it: an edit's keys, and none a later Recipe added
    at its default (read_recipe's typed recipe has those)."""
    written = OmegaConf.load(path)
    assert isinstance(written, DictConfig), "read_recipe reads it as a mapping"
    return plain_dict(written)


def write_recipe(path: Path, resolved: DictConfig) -> None:
    """Writes the resolved recipe to `path` (recipe.yaml of a run directory)."""
    # Whole or absent: a run killed while writing it resumes from a readable recipe, or was
    # never started.
    write_text_atomic(path, OmegaConf.to_yaml(resolved))


def typed(
    cfg: DictConfig, schema: type = Train, prefix: str = "", listed_by: str = EVERY_KEY
) -> DictConfig:
    """`cfg` merged into `schema` (the composed `train` config into Train), every bounded field
    checked; `prefix` is where `cfg` sits in the whole config, and `listed_by` what prints its
    keys, for the messages."""
    return typed_as(cfg, schema, prefix, listed_by)
