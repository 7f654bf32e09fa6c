"""The reproducibility manifest of a run: what was run, on what data, code and machine."""

from __future__ import annotations

import hashlib
import json
import os
import platform
import re
import shlex
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any, TypedDict

from omegaconf import DictConfig

from runner.components import plain_dict
from runner.errors import SECRET_KEY, UserError
from runner.rundir.io import write_json_atomic
from runner.rundir.run import BASE_MODEL_DIR, RunDir

MANIFEST_FILE = "manifest.json"
PACKAGES = (
    "runner",
    "torch",
    "torchtune",
    "torchao",
    "transformers",
    "tokenizers",
    "datasets",
    "hydra-core",
    "omegaconf",
    "safetensors",
    "numpy",
)
REDACTED = "<redacted>"
# Recipe keys that name this run rather than what it computes: left out of the config hash.
RUN_SPECIFIC_KEYS = ("run_dir", "stop_at_step")


class GitState(TypedDict):
    """The commit checked out where the run was launched, and whether its tree had changes."""

    commit: str
    dirty: bool


class TorchBuild(TypedDict):
    """The torch build: its version, the CUDA it was built for (None: CPU only), its commit."""

    version: str
    cuda: str | None
    git: str


class Hardware(TypedDict):
    """The device a run computed on, and the CPU kernel path (ATen's) it used."""

    device: str
    name: str
    cores: int | None
    cpu_capability: str


class DataFile(TypedDict):
    """A data source and its sha256 (`sha256_data`)."""

    path: str
    sha256: str


class Manifest(TypedDict):
    """manifest.json as a run starts it; record_checkpoint and record_kernels add to it."""

    config: dict[str, Any]
    config_hash: str
    overrides: list[str]
    packages: dict[str, str | None]
    python: str
    torch_build: TorchBuild
    git: GitState | None
    data: dict[str, DataFile]
    tokenizer_sha256: dict[str, str]
    weights_sha256: dict[str, str]
    load_checkpoint_sha256: dict[str, str]
    seed: int
    world_size: int
    deterministic: bool
    hardware: Hardware
    checkpoints: dict[str, dict[str, str]]


def redact(value: Any, key: str = "") -> Any:
    """A copy of a config with the values of secret-looking keys replaced."""
    if isinstance(value, dict):
        return {k: redact(v, str(k)) for k, v in value.items()}
    if isinstance(value, list):
        return [redact(v, key) for v in value]
    return REDACTED if SECRET_KEY.search(key) and value not in (None, "") else value


def sha256_file(path: Path) -> str:
    """A file's sha256, read a MiB at a time."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def sha256_data(path: Path) -> str:
    """A data file's sha256; for a directory, of its files' relative paths and sha256s."""
    if path.is_file():
        return sha256_file(path)
    digest = hashlib.sha256()
    for file in sorted(p for p in path.rglob("*") if p.is_file()):
        digest.update(f"{file.relative_to(path)}\0{sha256_file(file)}\n".encode())
    return digest.hexdigest()


def weights_sha256(source: str | None) -> dict[str, str]:
    """The sha256 of each file of the directory a run's weights start from (model.source: a
    download's snapshot, a checkpoint it was continued from), by name; {} for random weights.
    A file of the Hugging Face cache is a link to its blob, which the hub names by its sha256
    where it stores it by Git LFS (the weights): that name is read, not the gigabytes."""
    if not source or not Path(source).is_dir():
        return {}
    found = {}
    for path in sorted(Path(source).iterdir()):
        blob = path.resolve()
        if not blob.is_file():
            continue
        named = blob.parent.name == "blobs" and re.fullmatch(r"[0-9a-f]{64}", blob.name)
        found[path.name] = blob.name if named else sha256_file(blob)
    return found


def hashed_config(recipe: dict[str, Any]) -> dict[str, Any]:
    """The redacted recipe without its run-specific keys: what config_hash hashes. A base that
    the run wrote from the seed into its own directory (method.base_model_dir, RUN/base_model)
    is one: it moves with the run (runner.config.method.move_recipe)."""
    kept = {k: v for k, v in redact(recipe).items() if k not in RUN_SPECIFIC_KEYS}
    method, run_dir = kept.get("method"), recipe.get("run_dir")
    if isinstance(method, dict) and method.get("base_model_dir") and run_dir:
        own = (Path(run_dir) / BASE_MODEL_DIR).resolve()
        if Path(method["base_model_dir"]).resolve() == own:
            kept["method"] = {k: v for k, v in method.items() if k != "base_model_dir"}
    return kept


def config_hash(recipe: dict[str, Any]) -> str:
    """sha256 of the hashed_config, in canonical JSON."""
    return hashlib.sha256(json.dumps(hashed_config(recipe), sort_keys=True).encode()).hexdigest()


def _git(cwd: Path) -> GitState | None:
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain"], cwd=cwd, capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return {"commit": commit, "dirty": bool(dirty)}


def _hardware(device: str) -> Hardware:
    import torch

    kind = torch.cuda.get_device_name() if device == "cuda" else platform.processor()
    if device == "cpu" and Path("/proc/cpuinfo").exists():
        names = re.findall(r"^model name\s*:\s*(.+)$", Path("/proc/cpuinfo").read_text(), re.M)
        kind = names[0] if names else kind
    return {
        "device": device,
        "name": kind,
        "cores": os.cpu_count(),
        # ATen's kernel path here: the CPU's best, unless ATEN_CPU_CAPABILITY asks for another.
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
    }


def _versions() -> dict[str, str | None]:
    found: dict[str, str | None] = {}
    for name in PACKAGES:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = None
    return found


def build_manifest(resolved: DictConfig, overrides: list[str], cwd: Path) -> Manifest:
    """Everything needed to tell, from the record alone, what a re-run would change."""
    import torch

    recipe = plain_dict(resolved)
    data = recipe["dataset"]
    tokenizer_dir = Path(recipe["model"]["tokenizer"]["path"])
    return {
        "config": redact(recipe),
        "config_hash": config_hash(recipe),
        "overrides": recorded_form(overrides),
        "packages": _versions(),
        "python": sys.version.split()[0],
        "torch_build": {
            "version": torch.__version__,
            "cuda": torch.version.cuda,
            "git": torch.version.git_version,
        },
        "git": _git(cwd),
        "data": {
            key: {"path": path, "sha256": sha256_data(Path(path))}
            for key, path in (
                ("source", data["source"]),
                ("validation_source", data["validation"]["source"]),
            )
            if path
        },
        "tokenizer_sha256": {p.name: sha256_file(p) for p in sorted(tokenizer_dir.glob("*.json"))},
        "weights_sha256": weights_sha256(recipe["model"]["source"]),
        # The checkpoint a run went on from (load_checkpoint.path, to resume): its weights and
        # training state, where model.source names the base it was trained from.
        "load_checkpoint_sha256": weights_sha256(recipe["resume_from"]),
        "seed": recipe["seed"],
        "world_size": recipe["compute"]["nproc_per_node"] * recipe["compute"]["nnodes"],
        "deterministic": recipe["runtime"]["deterministic"],
        "hardware": _hardware(recipe["compute"]["device"]),
        "checkpoints": {},
    }


def recorded_form(overrides: list[str]) -> list[str]:
    """Command-line overrides as the manifest records them: a secret's whole override redacted."""
    return [o if not SECRET_KEY.search(o.split("=")[0]) else REDACTED for o in overrides]


# What may change when a run (or a sweep) goes on in its directory: the layout, the processes and
# the batch each takes (docs/nodes.md: a checkpoint resumes on any number of processes with the
# same global batch), of which the node's rank tells apart the nodes of one run.
LAYOUT = ("compute", "batch_size", "gradient_accumulation_steps")


def changed_overrides(recorded: list[str], given: list[str]) -> list[str]:
    """The overrides in which `given` differs from `recorded`, as recorded (recorded_form),
    by the key each sets (`+a.b=1` sets a.b), those of the LAYOUT left out: `given (recorded:
    ...)` each, a key one of them lacks as `not given`."""

    def by_key(overrides: list[str]) -> dict[str, str]:
        # The key an override sets, as runner.config.fields.override_key reads it (that folder
        # comes before this one in the flow: tests/test_imports.py).
        keyed = {o.split("=", 1)[0].lstrip("+~"): o for o in recorded_form(overrides)}
        return {k: o for k, o in keyed.items() if k.split(".")[0] not in LAYOUT}

    before, now = by_key(recorded), by_key(given)
    return [
        f"{now.get(key, key + ' not given')} (recorded: {before.get(key, 'not given')})"
        for key in sorted(before.keys() | now.keys())
        if before.get(key) != now.get(key)
    ]


# What the layout decides where the config leaves it open: the dtype (auto: by the device), the
# optimizer's fused step and the loader's workers (null: by the processes, by the device), and
# what QLoRA keeps in NF4 (by the processes). They may change only where the layout does.
DECIDED_BY_LAYOUT = ("dtype.name", "optimizer.fused", "dataset.num_workers", "method.quantization")


def changed_recipe(recorded: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """The keys in which a run's recipe, resolved again by its command on its directory (a
    requeue), differs from the recipe it recorded, each as `key=NOW (recorded: THEN)`: the
    overrides may be the same while a config file they compose was edited, or an interpolation
    reads another value. Left out: the LAYOUT and what it decides (DECIDED_BY_LAYOUT) where it
    changed, the keys that name the run (hashed_config), and resume_from (the checkpoint of
    another run it started from: the run goes on from its own)."""

    def layout(recipe: dict[str, Any]) -> tuple[str, int]:
        compute = recipe["compute"]
        return compute["device"], compute["nproc_per_node"] * compute["nnodes"]

    decided = DECIDED_BY_LAYOUT if layout(recorded) != layout(now) else ()
    return [
        f"{key}={value!r} (recorded: {before!r})"
        for key, before, value in config_differences(recorded, now)
        if key.split(".")[0] not in (*LAYOUT, "resume_from") and key not in decided
    ]


def changed_data(run: RunDir, now: dict[str, DataFile] | None = None) -> list[str]:
    """The data files of the run's manifest that differ now from what it recorded (a record
    appended, a file cut short), each as `key PATH (sha256 A -> B)`: a run going on over them
    trains on other data than its uninterrupted run would, unsaid. `now`: the files as a new
    manifest records them, hashed already (each file is read once, not twice)."""
    if not (run.path / MANIFEST_FILE).is_file():
        return []
    changed = []
    for key, data in read_manifest(run).get("data", {}).items():
        path, fresh = Path(data["path"]), (now or {}).get(key)
        if fresh is not None and fresh["path"] == data["path"]:
            sha = fresh["sha256"]
        else:
            sha = sha256_data(path) if path.exists() else data["sha256"]
        if sha != data["sha256"]:
            changed.append(f"dataset.{key} {path} (sha256 {data['sha256'][:12]} -> {sha[:12]})")
    return changed


def unlike_loaded(loaded: RunDir, manifest: Manifest | dict[str, Any]) -> list[str]:
    """How a run continued from another's checkpoint (load_checkpoint, mode resume; `manifest`
    its own) reads other records than the loaded run did: a training file of other content,
    another seed (another order), slice, held-out share or packing, as `what (loaded run:
    THEN)`."""
    if not (loaded.path / MANIFEST_FILE).is_file():
        return []
    recorded = read_manifest(loaded)
    unlike = []
    # The training split's: the position goes on in it (a validation source is read whole).
    data, before = manifest["data"].get("source"), recorded.get("data", {}).get("source")
    if data is not None and before is not None and before["sha256"] != data["sha256"]:
        unlike.append(
            f"dataset.source {data['path']} (loaded run: {before['path']}, other records)"
        )
    # Other records of the same files: another order, slice or share held out of them; or
    # other samples of them (the position counts samples: packs, where either run packs).
    now, then = dotted(manifest["config"]), dotted(recorded.get("config", {}))
    keys = ["seed", "dataset.split", "dataset.validation.held_out", "dataset.validation.seed"]
    if now.get("dataset.packing") or then.get("dataset.packing"):
        keys += ["dataset.packing", "dataset.max_seq_len"]
    for key in keys:
        if key in then and then[key] != now.get(key):
            unlike.append(f"{key}={now.get(key)!r} (loaded run: {then[key]!r})")
    return unlike


def dotted(value: Any, prefix: str = "") -> dict[str, Any]:
    """A config's leaves by their dotted keys ({"a": {"b": 1}}: {"a.b": 1}); an empty mapping
    is a leaf of its own, so that a section emptied or filled is a change."""
    if not isinstance(value, dict) or (prefix and not value):
        return {prefix: value}
    leaves: dict[str, Any] = {}
    for key, child in value.items():
        leaves.update(dotted(child, f"{prefix}.{key}" if prefix else str(key)))
    return leaves


def changed_config(run: RunDir, recipe: dict[str, Any]) -> list[str]:
    """The keys of `recipe` (recipe.yaml as it reads now) whose values differ from the config
    the run's manifest recorded as it started, each as `key=NOW (recorded: THEN)`; those a
    run sets itself (run_dir, stop_at_step) left out, and those whose value was redacted (an
    older runner redacted every key with "token" in its name: eos_token_id)."""
    recorded = read_manifest(run).get("config") if (run.path / MANIFEST_FILE).is_file() else None
    if recorded is None:
        return []
    return [
        f"{key}={now!r} (recorded: {before!r})"
        for key, before, now in config_differences(recorded, recipe)
    ]


def missing_config(run: RunDir, recipe: dict[str, Any]) -> list[str]:
    """The dotted keys of the config the run's manifest recorded as it started that `recipe`
    (recipe.yaml as it reads now) lacks: a file cut short, or keys removed."""
    recorded = read_manifest(run).get("config") if (run.path / MANIFEST_FILE).is_file() else None
    if recorded is None:
        return []
    now = dotted(hashed_config(recipe))
    return [key for key in dotted(hashed_config(recorded)) if key not in now]


def config_differences(
    recorded: dict[str, Any], now: dict[str, Any], keys: set[str] | None = None
) -> list[tuple[str, Any, Any]]:
    """(key, recorded value, value now) for each dotted key whose values differ, of `keys`
    (None: both configs' keys); the keys a run sets itself left out (hashed_config), and a value
    the record redacted (an older runner redacted every key with "token" in its name)."""
    before, after = dotted(hashed_config(recorded)), dotted(hashed_config(now))
    return [
        (key, before.get(key), after.get(key))
        for key in sorted(before.keys() | after.keys() if keys is None else keys)
        if before.get(key) != after.get(key) and before.get(key) != REDACTED
    ]


def write_manifest(run: RunDir, manifest: Manifest | dict[str, Any]) -> None:
    """Writes the run's manifest.json (whole, or not at all)."""
    write_json_atomic(run.path / MANIFEST_FILE, manifest)


def read_manifest(run: RunDir) -> dict[str, Any]:
    """The run's manifest.json as written: a Manifest, with what was recorded since. One that
    does not read (cut short by a killed copy, or by a power cut that kept the rename without
    the data) is a UserError naming it: resume, repro and a continued run read it before they
    write anything."""
    path = run.path / MANIFEST_FILE
    try:
        manifest = json.loads(path.read_bytes())
    except ValueError as err:  # not JSON, or not UTF-8
        problem = str(err)
    else:
        if isinstance(manifest, dict):
            return manifest
        problem = "not a JSON object"
    raise UserError(
        str(path),
        None,
        f"cannot be read (cut short, or not runner's: {problem}), so how the run started is "
        f"unknown; put back a whole copy, or move it aside "
        f"({shlex.join(['mv', str(path), f'{path}.damaged'])}) to go "
        "on without it: runner resume then trains by recipe.yaml unchecked against it, and "
        "runner repro cannot re-run the run",
    )


def record_checkpoint(run: RunDir, step: int, checkpoint_dir: Path) -> None:
    """Adds the sha256 of each file of a whole checkpoint to the run's manifest, if it has one."""
    if not (run.path / MANIFEST_FILE).exists():
        return
    manifest = read_manifest(run)
    manifest["checkpoints"][str(step)] = {
        p.name: sha256_file(p) for p in sorted(checkpoint_dir.iterdir()) if p.is_file()
    }
    write_manifest(run, manifest)


def record_kernels(run: RunDir, settings: dict[str, Any]) -> None:
    """Records the kernel path and threads the training processes compute with (rank 0's)."""
    if not (run.path / MANIFEST_FILE).exists():
        return
    manifest = read_manifest(run)
    manifest["kernels"] = settings
    write_manifest(run, manifest)
