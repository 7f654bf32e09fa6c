"""The typed schemas of the composed configs: `runner train`'s (a dataclass per config group),
`runner deploy`'s, `runner export`'s and `runner cluster`'s, and of the recipe `runner train`
resolves.

`typed(cfg)` merges the composed config into the schema, so a wrong type or an unknown key
fails before anything runs, with the key named; then every bounded field is checked against
the bound its field declares (`integer`, `number`, `flag`). Each message is one UserError
naming the key, the value and the fix. What cannot be said per field (cross-field rules,
files that must exist) is checked by runner.config.resolve, section by section.

Open-ended sections stay dictionaries: `loss` and `optimizer` are a component's keyword
arguments, `model.builder` a builder's, `runtime.env` environment variables.
"""

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, get_args

from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, ValidationError

from runner.errors import UserError
from runner.rundir import write_text_atomic

# typing's Optional/Dict/List: the forms OmegaConf 2.3 reads in structured-config annotations.
# ruff: noqa: UP006, UP035, UP045


def integer(default: Optional[int], minimum: int) -> Any:
    """An int field of at least `minimum` (an Optional one may be null)."""
    return field(default=default, metadata={"minimum": minimum})


def number(default: Optional[float], *, positive: bool) -> Any:
    """A float field, > 0 when `positive`, else >= 0 (an Optional one may be null)."""
    return field(default=default, metadata={"positive": positive})


def flag(default: bool) -> Any:
    return field(default=default, metadata={"flag": True})


@dataclass
class Runtime:
    output_root: str = "outputs"
    multirun_root: str = "multirun"
    save_every_n_steps: Optional[int] = integer(200, 1)
    keep_last_n_checkpoints: int = integer(2, 1)
    log_every_n_steps: int = integer(10, 1)
    # Checked by runner.train.trackers.check_loggers (names, installed packages).
    loggers: List[str] = field(default_factory=list)
    project: str = "runner"
    # Replaced by `loggers`; set, it is refused with the migration (runner.config.resolve).
    tensorboard: Optional[bool] = None
    progress_bar: bool = flag(True)
    deterministic: bool = flag(False)
    env: Dict[str, str] = field(default_factory=dict)
    cache_dir: str = MISSING
    hf_token: Optional[str] = None
    hub_model_ignore_patterns: List[str] = field(default_factory=list)


@dataclass
class Model:
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
class Validation:
    # A percentage (5%) or a fraction (0.05): checked by runner.config.resolve.
    held_out: Any = None
    seed: int = integer(0, 0)
    split: Optional[str] = None
    source: Optional[str] = None


@dataclass
class Xml:
    # dataset.format=xml: the element of one record (null: each child of the root element).
    record: Optional[str] = None


@dataclass
class Dataset:
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
    # Null: on wherever it is correct (runner.config.resolve._padding_free).
    padding_free: Optional[bool] = flag(None)
    validation: Validation = field(default_factory=Validation)
    eval_samples: int = integer(200, 0)
    eval_max_new_tokens: int = integer(12, 1)


@dataclass
class Dtype:
    name: str = "auto"


@dataclass
class Compute:
    device: str = "auto"
    # An int, or auto; several keys come from the platform a multi-node job runs on.
    nproc_per_node: Any = 1
    nnodes: Any = 1
    max_restarts: int = integer(0, 0)
    collective_timeout_s: int = integer(600, 1)
    platform: Optional[str] = None
    detected: Any = None
    node_rank: Any = None
    master_addr: Any = None
    master_port: Any = None
    rdzv_backend: Optional[str] = None
    rdzv_timeout_s: Optional[int] = integer(None, 1)


@dataclass
class Method:
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
    # Preference methods (dpo, lora_dpo, qlora_dpo); checked by runner.config.resolve.
    beta: float = number(0.1, positive=True)
    loss: str = "sigmoid"
    label_smoothing: float = number(0.0, positive=False)


@dataclass
class Objective:
    metric: str = MISSING
    mode: str = "min"


@dataclass
class Eval:
    # steps, epoch or no (YAML 1.1 reads a bare `no` as false): checked by runner.config.resolve.
    strategy: Any = "steps"
    steps: Optional[int] = integer(None, 1)
    metrics: Any = field(default_factory=list)
    max_samples: Optional[int] = integer(None, 1)


@dataclass
class Train:
    """`runner train`: the config groups, then the training keys that belong to no group."""

    runtime: Runtime = field(default_factory=Runtime)
    model: Model = field(default_factory=Model)
    dataset: Dataset = field(default_factory=Dataset)
    dtype: Dtype = field(default_factory=Dtype)
    loss: Dict[str, Any] = field(default_factory=dict)
    compute: Compute = field(default_factory=Compute)
    method: Method = field(default_factory=Method)
    optimizer: Dict[str, Any] = field(default_factory=dict)
    seed: int = integer(0, 0)
    max_steps: Optional[int] = integer(None, 1)
    epochs: int = integer(1, 1)
    batch_size: int = integer(1, 1)
    gradient_accumulation_steps: int = integer(1, 1)
    clip_grad_norm: Optional[float] = number(None, positive=True)
    compile: bool = flag(False)
    activation_checkpointing: bool = flag(False)
    resume: Optional[str] = None
    objective: Objective = field(default_factory=Objective)
    eval: Eval = field(default_factory=Eval)


@dataclass
class Select:
    checkpoint: str = "latest"
    metric: Optional[str] = None
    mode: Optional[str] = None


@dataclass
class TransformersEngine:
    max_batch_size: int = integer(32, 1)


@dataclass
class VllmEngine:
    max_num_seqs: int = integer(256, 1)
    gpu_memory_utilization: float = number(0.9, positive=True)
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
    gpus_per_node: int = integer(8, 1)
    shared_dir: str = "/shared/runs"
    slurm: Slurm = field(default_factory=Slurm)
    kubeflow: Kubeflow = field(default_factory=Kubeflow)


@dataclass
class OptimizerKeys:
    """The keys every optimizer option sets (its others are its component's arguments)."""

    lr: float = number(MISSING, positive=True)
    warmup_steps: int = integer(0, 0)
    cosine_decay: bool = flag(True)


# ---- the recipe: what `runner train` resolved, as every training process reads it ------------
# recipe.yaml keeps the sections and names of Train, each value resolved (`auto` made concrete,
# hf:// sources made local paths, components named), plus what resolution derives (the builder,
# tokenizer and config.json of the model; where the processes meet). Bumped when a key moves.
RECIPE_VERSION = 4


@dataclass
class RecipeModel:
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


@dataclass
class RecipeValidation:
    held_out: Optional[float] = None
    seed: int = 0
    split: Optional[str] = None
    source: Optional[str] = None


@dataclass
class RecipeDataset:
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
    validation: RecipeValidation = field(default_factory=RecipeValidation)
    eval_samples: int = 0
    eval_max_new_tokens: int = 12


@dataclass
class RecipeCompute:
    device: str = MISSING
    nproc_per_node: int = 1
    nnodes: int = 1
    # Where the node layout was read from (none, or a platform's name) and how processes meet.
    platform: str = "none"
    rdzv_endpoint: str = "localhost:0"
    rdzv_timeout_s: Optional[int] = None
    max_restarts: int = 0
    collective_timeout_s: int = 600


@dataclass
class RecipeMethod:
    name: str = "full"
    # The module that trains it (runner.config.resolve.RECIPES).
    recipe: str = MISSING
    # LoRA: the adapter builder and its arguments, the Hugging Face base the adapter loads onto
    # (and DPO's reference, the weights it starts from).
    builder: Optional[Dict[str, Any]] = None
    base_model_dir: Optional[str] = None
    save_merged: bool = False
    # Preference methods: the loss, its beta and label smoothing (null for the others).
    loss: Optional[str] = None
    beta: Optional[float] = None
    label_smoothing: Optional[float] = None


@dataclass
class RecipeRuntime:
    save_every_n_steps: Optional[int] = None
    keep_last_n_checkpoints: int = 2
    log_every_n_steps: int = 10
    loggers: List[str] = field(default_factory=list)
    project: str = "runner"
    progress_bar: bool = True
    deterministic: bool = False
    env: Dict[str, str] = field(default_factory=dict)


@dataclass
class RecipeEval:
    strategy: str = "no"
    steps: Optional[int] = None
    metrics: List[str] = field(default_factory=list)
    max_samples: Optional[int] = None


@dataclass
class Recipe:
    """recipe.yaml: Train's sections and keys, resolved (see RECIPE_VERSION)."""

    version: int = RECIPE_VERSION
    run_dir: str = MISSING
    seed: int = 0
    model: RecipeModel = field(default_factory=RecipeModel)
    # Where each hf:// source came from, pinned to the commit that was used.
    hub_sources: Dict[str, Any] = field(default_factory=dict)
    dataset: RecipeDataset = field(default_factory=RecipeDataset)
    dtype: Dtype = field(default_factory=Dtype)
    loss: Dict[str, Any] = field(default_factory=dict)
    compute: RecipeCompute = field(default_factory=RecipeCompute)
    method: RecipeMethod = field(default_factory=RecipeMethod)
    # The option's component and arguments with its schedule keys (runner.config.optimizer).
    optimizer: Dict[str, Any] = field(default_factory=dict)
    runtime: RecipeRuntime = field(default_factory=RecipeRuntime)
    eval: RecipeEval = field(default_factory=RecipeEval)
    objective: Objective = field(default_factory=Objective)
    max_steps: Optional[int] = None
    epochs: int = 1
    batch_size: int = 1
    gradient_accumulation_steps: int = 1
    clip_grad_norm: Optional[float] = None
    compile: bool = False
    activation_checkpointing: bool = False
    # Set by `runner repro --steps N`: end after step N without changing the schedule.
    stop_at_step: Optional[int] = None


def recipe(values: dict[str, Any]) -> DictConfig:
    """`values` as a typed Recipe (a key it does not know is a bug of runner's, not the user's)."""
    return OmegaConf.merge(OmegaConf.structured(Recipe), values)


def read_recipe(path: Path) -> DictConfig:
    """A run's recipe.yaml, typed; one recorded before the layout changed is refused by name."""
    values = OmegaConf.load(path)
    version = values.get("version")
    if version != RECIPE_VERSION:
        raise UserError(
            str(path),
            f"version {version or 1}",
            f"was written by another runner (recipe version {RECIPE_VERSION} here): train it "
            "again from its overrides (manifest.json) with this one, or use the runner that "
            "wrote it",
        )
    return recipe(values)


def write_recipe(path: Path, resolved: DictConfig) -> None:
    # Whole or absent: a run killed while writing it resumes from a readable recipe, or was
    # never started.
    write_text_atomic(path, OmegaConf.to_yaml(resolved))


def typed(cfg: DictConfig, schema: type = Train, prefix: str = "") -> DictConfig:
    """`cfg` merged into `schema` (the composed `train` config into Train), every bounded field
    checked; `prefix` is where `cfg` sits in the whole config, for the messages."""
    _check_sections(schema, cfg, prefix)
    try:
        merged = OmegaConf.merge(OmegaConf.structured(schema), cfg)
    except ConfigKeyError as err:
        given = OmegaConf.select(cfg, str(err.full_key), default="", throw_on_missing=False)
        raise UserError(
            f"{prefix}{err.full_key}", given, "no such key; `--cfg job` prints every key"
        ) from None
    except ValidationError as err:
        key = str(err.full_key)
        given = OmegaConf.select(cfg, key, default=None, throw_on_missing=False)
        raise UserError(f"{prefix}{key}", given, _fix(_field_of(schema, key))) from None
    _check_bounds(schema, merged, cfg, prefix)
    return merged


def _check_sections(schema: type, given: DictConfig, prefix: str) -> None:
    """Each section of `schema` given as a section (`merged=3` would fail the merge with no key
    named)."""
    for spec in dataclasses.fields(schema):
        section = _section(spec.type)
        if section is None or spec.name not in given:
            continue
        value = OmegaConf.select(given, spec.name, throw_on_missing=False)
        key = f"{prefix}{spec.name}"
        if not isinstance(value, DictConfig):
            raise UserError(key, value, f"is a section: set its keys, e.g. {key}.KEY=VALUE")
        _check_sections(section, value, f"{key}.")


def _field_of(schema: Any, key: str) -> Optional[dataclasses.Field]:
    """The field of `schema` at a dotted key, if the schema types it."""
    found = None
    for part in key.split("."):
        fields = {f.name: f for f in dataclasses.fields(schema)} if schema else {}
        found = fields.get(part)
        if found is None:
            return None
        schema = _section(found.type)
    return found


def _section(annotation: Any) -> Optional[type]:
    """The section dataclass a field's annotation is, if it is one."""
    section = annotation if isinstance(annotation, type) else None
    return section if dataclasses.is_dataclass(section) else None


def _fix(spec: Optional[dataclasses.Field]) -> str:
    """What to give instead, from the field's declared bound."""
    if spec is None:
        return "give a value of the type `--cfg job` shows"
    optional = " or null" if type(None) in get_args(spec.type) else ""
    if "minimum" in spec.metadata:
        return f"give an integer >= {spec.metadata['minimum']}{optional}"
    if "positive" in spec.metadata:
        return f"give a number {'> 0' if spec.metadata['positive'] else '>= 0'}{optional}"
    if "flag" in spec.metadata:
        return f"give true or false{optional}"
    return f"give a value of type {spec.type}"


def _check_bounds(schema: type, merged: DictConfig, given: Any, prefix: str) -> None:
    """Each bounded field of `merged` within its bound; a flag given as a true boolean."""
    for spec in dataclasses.fields(schema):
        key = f"{prefix}{spec.name}"
        if spec.name not in merged:
            continue
        raw = given.get(spec.name) if isinstance(given, DictConfig) else None
        section = _section(spec.type)
        if section is not None:
            _check_bounds(section, merged[spec.name], raw, f"{key}.")
            continue
        value = OmegaConf.select(merged, spec.name, throw_on_missing=False)
        if value is None or not spec.metadata:
            continue
        if "flag" in spec.metadata:
            # OmegaConf takes 3 or "yes" for true: only a boolean is one here.
            if raw is not None and not isinstance(raw, bool):
                raise UserError(key, raw, _fix(spec))
            continue
        minimum, positive = spec.metadata.get("minimum"), spec.metadata.get("positive")
        too_small = (
            (minimum is not None and value < minimum)
            or (positive is True and value <= 0)
            or (positive is False and value < 0)
        )
        if too_small:
            raise UserError(key, value, _fix(spec))
