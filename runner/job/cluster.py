"""`runner cluster`: the Slurm batch script and Kubeflow TrainJob manifest of a multi-node run.

Both run the same `runner train compute=multi_node [train overrides]` line once per node; each
node reads its place from the scheduler's variables (runner/config/platforms.py), so the line
carries no node-specific flags. A dry run: the files are printed, nothing is submitted.
"""

from __future__ import annotations

import re
import shlex
from typing import Any

import yaml
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig, OmegaConf

from runner.config.fields import MULTIRUN_FLAGS, check_chosen, check_removed, override_key
from runner.config.hydra_errors import from_hydra_error
from runner.config.method import check_method_keys
from runner.config.optimizer import checked_option
from runner.config.schema import Cluster, Train, typed
from runner.errors import UserError
from runner.paths import CONF_DIR, refuse_empty_path

USAGE = """usage: runner cluster [train overrides] [cluster.KEY=VALUE ...]

Prints a Slurm batch script and a Kubeflow Trainer TrainJob manifest that run
`runner train compute=multi_node [train overrides]` on every node. Nothing is submitted:
  runner cluster cluster.print=slurm cluster.nodes=4 max_steps=2000 > job.sbatch; sbatch job.sbatch

The cluster keys and their defaults (conf/cluster.yaml):
"""
_K8S_NAME = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
# sbatch's --time: minutes, minutes:seconds, hours:minutes:seconds, days-hours,
# days-hours:minutes, days-hours:minutes:seconds; or no limit. sbatch refuses anything else only
# when the job is submitted, after the script was written and copied to the cluster.
_SLURM_TIME = re.compile(r"\d+(:\d+){0,2}|\d+-\d+(:\d+){0,2}|(?i:infinite|unlimited)")
SLURM_TIME_FORMATS = (
    "minutes, minutes:seconds, hours:minutes:seconds, days-hours, days-hours:minutes or "
    "days-hours:minutes:seconds (e.g. 24:00:00 or 2-00:00:00)"
)
# Where a sweep on a cluster is made: runner cluster prints the files of one job.
CLUSTER_SWEEP = (
    "runner cluster prints one job and has no -m; a sweep on a cluster is "
    "`runner train -m hydra/launcher=slurm ...` (docs/sweeps.md)"
)
# What prints the keys of each config runner cluster composes (it is no Hydra app: `--cfg job`
# is not its): its --help prints conf/cluster.yaml; the rest of its overrides are runner train's.
CLUSTER_KEYS = "runner cluster --help"
TRAIN_KEYS = "runner train --cfg job"


def _compose_train(overrides: list[str]) -> DictConfig:
    """The train config the nodes run; a composition error points at `runner train`'s keys."""
    try:
        return _compose("train", overrides)
    except Exception as err:  # noqa: BLE001 - recast below if Hydra's, else re-raised
        error = from_hydra_error(err, command="train", listed_by=TRAIN_KEYS)
        if error is None:
            raise
        if error.fix.startswith("a comma list is a sweep"):
            # runner train's advice (add -m) is no option of runner cluster's.
            listed = f"{error.key}=[{error.value}]"
            fix = f"{CLUSTER_SWEEP}; for one value that is a list give {listed}"
            raise UserError(error.key, error.value, fix) from None
        if error.fix.startswith("a sweep of values"):  # choice(), range(), glob()
            raise UserError(error.key, error.value, CLUSTER_SWEEP) from None
        raise error from None


def _compose_cluster(overrides: list[str]) -> DictConfig:
    """The cluster config; a composition error names its key as the user typed it
    (`cluster.gpus`, not `gpus`)."""
    try:
        return _compose("cluster", overrides)
    except Exception as err:  # noqa: BLE001 - recast below if Hydra's, else re-raised
        error = from_hydra_error(err, listed_by=CLUSTER_KEYS)
        if error is None:
            raise
        key = error.key if error.key in ("override", "config") else f"cluster.{error.key}"
        raise UserError(key, error.value, error.fix) from None


def _compose(config_name: str, overrides: list[str]) -> DictConfig:
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name, overrides=overrides)


def _on_multi_node(train_overrides: list[str]) -> list[str]:
    """The user's train overrides, on compute=multi_node."""
    for override in train_overrides:
        key, _, value = override.partition("=")
        if key == "compute" and value != "multi_node":
            raise UserError("compute", value, "runner cluster runs compute=multi_node; drop it")
        if key in ("hydra.run.dir", "resume"):
            raise UserError(key, value, "runner cluster names the run directory (shared_dir)")
    rest = [o for o in train_overrides if o != "compute=multi_node"]
    return ["compute=multi_node", *rest]


def train_command(train_overrides: list[str], run_dir: str) -> list[str]:
    """The line every node runs: `runner train` on compute=multi_node, in one run directory."""
    return ["runner", "train", *_on_multi_node(train_overrides), f"hydra.run.dir={run_dir}"]


def slurm_script(cluster: DictConfig, command: list[str]) -> str:
    """An sbatch script: one task per node, each running `command`."""
    slurm = cluster.slurm
    if not _SLURM_TIME.fullmatch(str(slurm.time)):
        raise UserError("cluster.slurm.time", slurm.time, f"give {SLURM_TIME_FORMATS}")
    if not str(cluster.name).strip() or any(c.isspace() for c in str(cluster.name)):
        # '#SBATCH --job-name=my job' and its output file's name broke at the space.
        raise UserError("cluster.name", cluster.name, "give a name without spaces")
    if re.search(r'["`\\$]', str(cluster.name)):  # it is in the double-quoted run directory
        raise UserError("cluster.name", cluster.name, 'give a name without " ` \\ or $')
    if slurm.partition is not None and not str(slurm.partition).strip():
        raise UserError("cluster.slurm.partition", slurm.partition, "give a partition, or null")
    options = {
        "job-name": cluster.name,
        "nodes": cluster.nodes,
        "ntasks-per-node": 1,
        "gpus-per-node": cluster.gpus_per_node or None,
        "cpus-per-task": slurm.cpus_per_task,
        "time": slurm.time,
        "partition": slurm.partition,
        "signal": f"TERM@{slurm.signal_before_end_s}",
        "requeue": "",
        "open-mode": "append",
        "output": f"{cluster.name}-%j.out",
    }
    lines = [
        "#!/bin/bash",
        "# Written by `runner cluster`: one `runner train` per node, which reads SLURM_NNODES,",
        "# SLURM_NODEID and SLURM_JOB_NODELIST and starts its processes with torch.distributed's",
        "# elastic agent. SIGTERM (preemption, time limit) saves a checkpoint; a requeued job",
        "# resumes from it in the same run directory.",
    ]
    for key, value in options.items():
        if value is not None:
            lines.append(f"#SBATCH --{key}" + (f"={value}" if value != "" else ""))
    lines += ["", "set -euo pipefail", *slurm.setup]
    # Every argument is quoted for the shell; the run directory is double-quoted so that each
    # node expands ${SLURM_JOB_ID}.
    *args, run_dir = command
    if re.search(r'["`\\]|\$(?!\{SLURM_JOB_ID\})', run_dir):
        raise UserError("cluster.shared_dir", run_dir, 'give a path without " ` \\ or $')
    quoted = " ".join(shlex.quote(a) for a in args)
    # Slurm 22.05 to 23.02's srun does not take sbatch's --cpus-per-task: said again.
    cpus = f" --cpus-per-task={slurm.cpus_per_task}" if slurm.cpus_per_task else ""
    srun = f"srun --ntasks-per-node=1{cpus} --kill-on-bad-exit=1"
    lines.append(f'{srun} {quoted} "{run_dir}"')
    return "\n".join(lines) + "\n"


def trainjob_manifest(cluster: DictConfig, command: list[str], nproc: Any) -> str:
    """A Kubeflow Trainer TrainJob: numNodes pods, each running `command`."""
    kubeflow = cluster.kubeflow
    if kubeflow.image is None:
        raise UserError(
            "cluster.kubeflow.image",
            None,
            "give a container image with runner installed, or cluster.print=slurm",
        )
    if not _K8S_NAME.match(cluster.name):
        raise UserError(
            "cluster.name",
            cluster.name,
            "a TrainJob name is lower-case letters, digits and '-', starting with a letter",
        )
    # JobSet refuses a TrainJob whose longest pod name (NAME-node-0-LAST-abcde) passes 63.
    longest = 63 - len(f"-node-0-{cluster.nodes - 1}-abcde")
    if len(cluster.name) > longest:
        raise UserError(
            "cluster.name",
            cluster.name,
            f"give at most {longest} characters: Kubeflow's JobSet names each pod "
            f"NAME-node-0-INDEX-XXXXX, at most 63 characters",
        )
    trainer: dict[str, Any] = {
        "image": kubeflow.image,
        # Kubernetes reads $(VAR) in a command as a variable and $$ as $: each $ is kept.
        "command": [arg.replace("$", "$$") for arg in command],
        "numNodes": cluster.nodes,
    }
    if isinstance(nproc, int):
        trainer["numProcPerNode"] = nproc
    if cluster.gpus_per_node:
        trainer["resourcesPerNode"] = {"limits": {"nvidia.com/gpu": cluster.gpus_per_node}}
    manifest = {
        "apiVersion": "trainer.kubeflow.org/v1alpha1",
        "kind": "TrainJob",
        "metadata": {"name": cluster.name, "namespace": kubeflow.namespace},
        "spec": {"runtimeRef": {"name": kubeflow.runtime}, "trainer": trainer},
    }
    header = (
        "# Written by `runner cluster`: every node runs `runner train`, which reads PET_NNODES,\n"
        "# PET_NODE_RANK, PET_MASTER_ADDR, PET_MASTER_PORT and PET_NPROC_PER_NODE. The run\n"
        f"# directory's storage ({cluster.shared_dir}) must be mounted on every node.\n"
    )
    body: str = yaml.safe_dump(manifest, sort_keys=False)
    return header + body


def _of_cluster(override: str) -> str | None:
    """A `cluster.` override as the cluster config takes it (`+cluster.x=1`: `+x=1`); None for
    one of the train config."""
    if not override_key(override).startswith("cluster."):
        return None
    return override.replace("cluster.", "", 1)  # the first is the key's, after its sign


def cluster_files(overrides: list[str]) -> dict[str, str]:
    """{"slurm": script, "kubeflow": manifest}, as cluster.print selects."""
    for flag in MULTIRUN_FLAGS:
        if flag in overrides:
            raise UserError(flag, None, CLUSTER_SWEEP)
    given = next((o for o in overrides if o.startswith("-")), None)
    if given is not None:  # --config-dir: a directory here, which the nodes need not have
        raise UserError(
            given,
            None,
            "runner cluster takes overrides only, and the nodes compose runner's own options; "
            "for options of your own, run runner train with --config-dir on a directory every "
            "node mounts",
        )
    by_cluster = {o: _of_cluster(o) for o in overrides}
    cluster_overrides = [own for own in by_cluster.values() if own is not None]
    train_overrides = [o for o, own in by_cluster.items() if own is None]
    cluster = typed(_compose_cluster(cluster_overrides), Cluster, "cluster.", CLUSTER_KEYS)
    if cluster.print not in ("both", "slurm", "kubeflow"):
        raise UserError("cluster.print", cluster.print, "choose both, slurm or kubeflow")
    # Composing and typing check every train override (keys, options, types, bounds) before
    # anything is written.
    # Composed without this machine's scheduler variables (platform none): a shell inside an
    # allocation of its own (SLURM_NTASKS_PER_NODE=4) is not the job being written.
    on_nodes = _on_multi_node(train_overrides)
    untyped = _compose_train([*on_nodes, "compute.platform=none"])
    check_chosen(untyped, Train)  # what every node would refuse: ~optimizer, a key unread
    check_method_keys(untyped.method, train_overrides)
    check_removed(untyped, train_overrides, Train, TRAIN_KEYS)
    composed = typed(untyped, listed_by=TRAIN_KEYS)
    # The GPUs asked of the scheduler are those the run trains on (auto: what each node has).
    device, gpus = composed.compute.device, cluster.gpus_per_node
    if device == "cpu" and gpus:
        fix = "compute.device=cpu trains on the CPUs: give cluster.gpus_per_node=0"
        raise UserError("cluster.gpus_per_node", gpus, fix)
    if device == "cuda" and not gpus:
        fix = "compute.device=cuda trains on GPUs: give the number each node has"
        raise UserError("cluster.gpus_per_node", gpus, fix)
    explicit = {override_key(o): o.split("=", 1)[1] for o in train_overrides if "=" in o}
    if "compute.nnodes" in explicit and composed.compute.nnodes != cluster.nodes:
        raise UserError(
            "compute.nnodes",
            composed.compute.nnodes,
            f"cluster.nodes={cluster.nodes} sets the node count; drop compute.nnodes",
        )
    if "compute.node_rank" in explicit:
        # Every node runs the one line: a rank in it would be every node's, and no two may share.
        raise UserError(
            "compute.node_rank",
            OmegaConf.select(composed, "compute.node_rank", throw_on_resolution_failure=False),
            "every node runs the same line and reads its own rank from its scheduler "
            "(SLURM_NODEID, PET_NODE_RANK); drop compute.node_rank",
        )
    if "compute.platform" in explicit:
        # A platform of another scheduler's variables: each node found none, trained alone.
        raise UserError(
            "compute.platform",
            explicit["compute.platform"],
            "each node reads its place from its scheduler's variables (SLURM_*, PET_*); drop "
            "compute.platform",
        )
    nproc = composed.compute.nproc_per_node if "compute.nproc_per_node" in explicit else None
    # optimizer.lr=abc, or a fused step the sharded weights refuse: every node would refuse it.
    per_node = nproc if isinstance(nproc, int) else cluster.gpus_per_node or 1
    checked_option(composed.optimizer, cluster.nodes * per_node)
    if isinstance(nproc, int) and cluster.gpus_per_node and nproc > cluster.gpus_per_node:
        raise UserError(
            "compute.nproc_per_node",
            nproc,
            f"a node has cluster.gpus_per_node={cluster.gpus_per_node}: give at most that many",
        )
    refuse_empty_path(
        "cluster.shared_dir",
        cluster.shared_dir,
        "give the directory every node mounts",
        means=f"the file system's root: /{cluster.name}",
    )
    files = {}
    if cluster.print in ("both", "slurm"):
        run_dir = f"{cluster.shared_dir}/{cluster.name}-${{SLURM_JOB_ID}}"
        files["slurm"] = slurm_script(cluster, train_command(train_overrides, run_dir))
    if cluster.print in ("both", "kubeflow"):
        run_dir = f"{cluster.shared_dir}/{cluster.name}"
        command = train_command(train_overrides, run_dir)
        files["kubeflow"] = trainjob_manifest(cluster, command, nproc)
    return files
