"""Where this node stands in a multi-node job, read from the scheduler's environment.

`compute=multi_node` leaves `nnodes`, `node_rank`, `master_addr`, `master_port` and
`nproc_per_node` to the platform the command runs on. Each value comes from the first of these
that sets it (a value given on the command line always wins):

| platform | variables |
| --- | --- |
| kubeflow | PET_NNODES, PET_NODE_RANK, PET_MASTER_ADDR, PET_MASTER_PORT, PET_NPROC_PER_NODE |
| baseten  | BT_GROUP_SIZE, BT_NODE_RANK, BT_LEADER_ADDR, BT_NUM_GPUS; runs in BT_CHECKPOINT_DIR |
| torchrun | NNODES, NODE_RANK, MASTER_ADDR, MASTER_PORT |
| slurm    | SLURM_NNODES, SLURM_NODEID, SLURM_JOB_NODELIST (first host), SLURM_NTASKS_PER_NODE |

All nodes must write to one run directory on storage they share. An explicit `hydra.run.dir`
names it; otherwise the platform's job id does (SLURM_JOB_ID, BT_TRAINING_JOB_ID, the TrainJob
behind PET_MASTER_ADDR): `<runtime.output_root>/<platform>-<job id>`, under BT_CHECKPOINT_DIR on
Baseten. A re-run of the same job (a Slurm requeue, a restarted TrainJob) lands in the same
directory and resumes from its latest whole checkpoint.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from omegaconf import DictConfig

from runner.errors import UserError

PLATFORMS = ("kubeflow", "baseten", "torchrun", "slurm")
# The values a platform can provide (compute.<name>).
KEYS = ("nnodes", "node_rank", "master_addr", "master_port", "nproc_per_node")
_TORCHRUN_WORKER_VARS = ("LOCAL_RANK", "RANK", "WORLD_SIZE")


@dataclass(frozen=True)
class Detection:
    """What the environment says about this node: values and the variable each came from."""

    values: dict[str, Any] = field(default_factory=dict)
    sources: dict[str, str] = field(default_factory=dict)
    platforms: tuple[str, ...] = ()
    # "<platform>-<the platform's job id>": the same on every node of one job.
    job_id: str | None = None

    def describe(self) -> str:
        if not self.platforms:
            return "no platform detected (no torchrun, Kubeflow, Baseten or Slurm variables)"
        found = ", ".join(f"{k}={self.values[k]} ({self.sources[k]})" for k in self.values)
        job = f", job {self.job_id}" if self.job_id else ""
        return f"{'+'.join(self.platforms)}: {found}{job}"


def _int_var(env: Mapping[str, str], name: str) -> int:
    value = env[name]
    try:
        return int(value)
    except ValueError:
        raise UserError(name, value, "this environment variable must be an integer") from None


def _kubeflow(env: Mapping[str, str]) -> dict[str, tuple[Any, str]]:
    found: dict[str, tuple[Any, str]] = {}
    for key, var in (("nnodes", "PET_NNODES"), ("node_rank", "PET_NODE_RANK")):
        if var in env:
            found[key] = (_int_var(env, var), var)
    if "PET_MASTER_ADDR" in env:
        found["master_addr"] = (env["PET_MASTER_ADDR"], "PET_MASTER_ADDR")
    if "PET_MASTER_PORT" in env:
        found["master_port"] = (_int_var(env, "PET_MASTER_PORT"), "PET_MASTER_PORT")
    if "PET_NPROC_PER_NODE" in env:
        # torchrun's own spellings: an integer, or auto/gpu/cpu (one per GPU, else one).
        value = env["PET_NPROC_PER_NODE"]
        if not value.isdigit() and value not in ("auto", "gpu", "cpu"):  # two: read as auto
            raise UserError(
                "PET_NPROC_PER_NODE", value, "give an integer, or auto, gpu or cpu (torchrun's)"
            )
        nproc = int(value) if value.isdigit() else "auto"
        found["nproc_per_node"] = (nproc, "PET_NPROC_PER_NODE")
    return found


def _baseten(env: Mapping[str, str]) -> dict[str, tuple[Any, str]]:
    found: dict[str, tuple[Any, str]] = {}
    for key, var in (("nnodes", "BT_GROUP_SIZE"), ("node_rank", "BT_NODE_RANK")):
        if var in env:
            found[key] = (_int_var(env, var), var)
    if "BT_LEADER_ADDR" in env:
        found["master_addr"] = (env["BT_LEADER_ADDR"], "BT_LEADER_ADDR")
    if "BT_NUM_GPUS" in env and _int_var(env, "BT_NUM_GPUS") > 0:
        found["nproc_per_node"] = (_int_var(env, "BT_NUM_GPUS"), "BT_NUM_GPUS")
    return found


def _torchrun(env: Mapping[str, str]) -> dict[str, tuple[Any, str]]:
    found: dict[str, tuple[Any, str]] = {}
    for key, var in (("nnodes", "NNODES"), ("node_rank", "NODE_RANK")):
        if var in env:
            found[key] = (_int_var(env, var), var)
    if "MASTER_ADDR" in env:
        found["master_addr"] = (env["MASTER_ADDR"], "MASTER_ADDR")
    if "MASTER_PORT" in env:
        found["master_port"] = (_int_var(env, "MASTER_PORT"), "MASTER_PORT")
    return found


def _slurm(env: Mapping[str, str]) -> dict[str, tuple[Any, str]]:
    found: dict[str, tuple[Any, str]] = {}
    if "SLURM_NTASKS_PER_NODE" in env and _int_var(env, "SLURM_NTASKS_PER_NODE") > 1:
        raise UserError(
            "SLURM_NTASKS_PER_NODE",
            env["SLURM_NTASKS_PER_NODE"],
            "run one `runner train` per node (srun --ntasks-per-node=1); its elastic agent "
            "starts compute.nproc_per_node processes there",
        )
    for key, var in (("nnodes", "SLURM_NNODES"), ("node_rank", "SLURM_NODEID")):
        if var in env:
            found[key] = (_int_var(env, var), var)
    if env.get("SLURM_JOB_NODELIST"):
        found["master_addr"] = (first_host(env["SLURM_JOB_NODELIST"]), "SLURM_JOB_NODELIST")
    return found


_READERS: dict[str, Callable[[Mapping[str, str]], dict[str, tuple[Any, str]]]] = {
    "kubeflow": _kubeflow,
    "baseten": _baseten,
    "torchrun": _torchrun,
    "slurm": _slurm,
}


def _job_id(platform: str, env: Mapping[str, str]) -> str | None:
    if platform == "slurm":
        return env.get("SLURM_JOB_ID")
    if platform == "baseten":
        return env.get("BT_TRAINING_JOB_ID")
    if platform == "kubeflow":
        # <trainjob>-node-0-0.<trainjob>: the TrainJob's name, the same on every node. Another
        # address (an IP set by hand) names no job: its first label would be shared by every job.
        named = re.match(r"(.+)-node-0-0(\.|$)", env.get("PET_MASTER_ADDR", ""))
        return named.group(1) if named else None
    return None


def first_host(nodelist: str) -> str:
    """The first host of a Slurm node list: `gpu[03-04,09],cpu1` -> `gpu03`."""
    depth, end = 0, len(nodelist)
    for i, char in enumerate(nodelist):
        depth += {"[": 1, "]": -1}.get(char, 0)
        if char == "," and depth == 0:
            end = i
            break
    first = nodelist[:end]
    return re.sub(r"\[([^\]]*)\]", lambda m: re.split(r"[,-]", m.group(1))[0], first)


def check_platform(platform: str) -> None:
    """A UserError unless compute.platform names one: auto, none, or one of PLATFORMS."""
    if platform not in ("auto", "none", *PLATFORMS):
        raise UserError("compute.platform", platform, f"choose auto, none, {', '.join(PLATFORMS)}")


def detect(platform: str, env: Mapping[str, str] | None = None) -> Detection:
    """Reads the node layout from the environment: `auto` tries every platform, in order."""
    env = os.environ if env is None else env
    check_platform(platform)
    if platform == "none":
        return Detection()
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    used: list[str] = []
    job_id = None
    for name in PLATFORMS if platform == "auto" else (platform,):
        found = _READERS[name](env)
        own_id = _job_id(name, env)
        if not found and own_id is None:
            continue
        used.append(name)
        job_id = job_id or (f"{name}-{own_id}" if own_id else None)
        for key, (value, var) in found.items():
            if key not in values:
                values[key], sources[key] = value, var
    return Detection(values, sources, tuple(used), job_id)


def platform_value(platform: str, key: str, default: Any) -> Any:
    """`${runner_platform:PLATFORM,KEY,DEFAULT}`: the platform's value for compute.KEY."""
    if key == "detected":
        return detect(platform).describe()
    assert key in KEYS, key
    return detect(platform).values.get(key, default)


def run_dir(resume: Any, fresh: str, *, _root_: DictConfig) -> str:
    """hydra.run.dir: the resumed run, else one directory every node of the job agrees on."""
    if resume:
        return str(resume)
    compute = _root_.compute
    if compute.get("platform") is None:  # a single-machine compute option
        return fresh
    found = detect(compute.platform)
    if found.job_id is not None:
        on_baseten = found.job_id.startswith("baseten-")
        root = os.environ.get("BT_CHECKPOINT_DIR") if on_baseten else None
        return os.path.join(root or str(_root_.runtime.output_root), found.job_id)
    if compute.nnodes != 1:
        raise UserError(
            "hydra.run.dir",
            fresh,
            f"compute.nnodes={compute.nnodes}: every node must write to one run directory and "
            "no platform job id names it here; give hydra.run.dir=/shared/PATH, the same on "
            "every node",
        )
    return fresh


def refuse_torchrun_worker(env: Mapping[str, str] | None = None) -> None:
    """`runner train` starts torch.distributed's elastic agent itself, so never inside one."""
    env = os.environ if env is None else env
    if all(var in env for var in _TORCHRUN_WORKER_VARS):
        raise UserError(
            "LOCAL_RANK",
            env["LOCAL_RANK"],
            "runner train is running inside a torchrun worker; it starts the elastic agent "
            "itself: run `runner train compute=multi_node ...` once per node instead, or run "
            "a resolved recipe under your torchrun: "
            "torchrun ... -m runner.recipes.finetune RUN/recipe.yaml",
        )
