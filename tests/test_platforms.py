"""Each platform's variables lead to the right world and rendezvous, explicit overrides win, and
`runner cluster` writes a Slurm script and a TrainJob manifest running the same `runner train`."""

from __future__ import annotations

import dataclasses
import os
import shlex
from pathlib import Path
from typing import get_type_hints

import pytest
import yaml
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from runner.cli import as_user_error
from runner.config import platforms
from runner.config.resolve import resolve_recipe
from runner.config.schema import Cluster
from runner.errors import UserError
from runner.job.cluster import cluster_files
from runner.paths import CONF_DIR

PREFIXES = ("PET_", "BT_", "SLURM_", "TORCHELASTIC_")
TORCHRUN = ("NNODES", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "RANK", "WORLD_SIZE")

KUBEFLOW = {
    "PET_NNODES": "2",
    "PET_NPROC_PER_NODE": "3",
    "PET_NODE_RANK": "1",
    "PET_MASTER_ADDR": "ft-node-0-0.ft",
    "PET_MASTER_PORT": "29400",
}
BASETEN = {
    "BT_GROUP_SIZE": "2",
    "BT_NODE_RANK": "1",
    "BT_LEADER_ADDR": "10.1.2.3",
    "BT_NUM_GPUS": "4",
    "BT_TRAINING_JOB_ID": "gvpql31",
    "BT_CHECKPOINT_DIR": "/mnt/ckpts",
}
SLURM = {
    "SLURM_JOB_ID": "4242",
    "SLURM_NNODES": "3",
    "SLURM_NODEID": "2",
    "SLURM_JOB_NODELIST": "gpu[07-09],cpu1",
    "SLURM_NTASKS_PER_NODE": "1",
}
TORCHRUN_ENV = {"NNODES": "4", "NODE_RANK": "3", "MASTER_ADDR": "10.0.0.9", "MASTER_PORT": "23456"}


@pytest.fixture(autouse=True)
def no_platform(monkeypatch: pytest.MonkeyPatch) -> None:
    """Starts every test from an environment without any scheduler's variables."""
    for name in list(os.environ):
        if name.startswith(PREFIXES) or name in TORCHRUN:
            monkeypatch.delenv(name)


def compose_train(overrides: list[str]):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose("train", overrides=overrides, return_hydra_config=False)


def world(env: dict[str, str], monkeypatch, tmp_path: Path, *overrides: str) -> dict:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    # The layout, not the device: on the CPU, also where GPUs are visible (fewer than it asks).
    cfg = compose_train(["compute=multi_node", "compute.device=cpu", *overrides])
    recipe = resolve_recipe(cfg, tmp_path)
    run_dir = platforms.run_dir(None, "outputs/day/time", _root_=cfg)
    return {
        "world": recipe.compute.nnodes * recipe.compute.nproc_per_node,
        "nnodes": recipe.compute.nnodes,
        "nproc_per_node": recipe.compute.nproc_per_node,
        "rdzv_endpoint": recipe.compute.rdzv_endpoint,
        "run_dir": run_dir,
        "node_rank": cfg.compute.node_rank,
    }


CASES = {
    "nothing": (
        {},
        dict(world=1, nnodes=1, rdzv_endpoint="localhost:0", run_dir="outputs/day/time"),
    ),
    "kubeflow": (
        KUBEFLOW,
        dict(
            world=6,
            nnodes=2,
            nproc_per_node=3,
            node_rank=1,
            rdzv_endpoint="ft-node-0-0.ft:29400",
            run_dir="outputs/kubeflow-ft",
        ),
    ),
    "baseten": (
        BASETEN,
        dict(
            world=8,
            nnodes=2,
            nproc_per_node=4,
            node_rank=1,
            rdzv_endpoint="10.1.2.3:29500",
            run_dir="/mnt/ckpts/baseten-gvpql31",
        ),
    ),
    "slurm": (
        SLURM,
        dict(
            world=3,
            nnodes=3,
            nproc_per_node=1,
            node_rank=2,
            rdzv_endpoint="gpu07:29500",
            run_dir="outputs/slurm-4242",
        ),
    ),
}


@pytest.mark.parametrize("platform", CASES)
def test_platform_variables_give_the_world(platform, monkeypatch, tmp_path: Path) -> None:
    env, expected = CASES[platform]
    got = world(env, monkeypatch, tmp_path)
    assert {k: got[k] for k in expected} == expected


def test_a_kubeflow_address_that_names_no_trainjob_gives_no_job_id(monkeypatch, tmp_path) -> None:
    # Kubeflow's own address is <trainjob>-node-0-0.<trainjob>; an IP set by hand names no job,
    # and its first label (10) would give every such job the same run directory.
    for name, value in (KUBEFLOW | {"PET_MASTER_ADDR": "10.1.1.1"}).items():
        monkeypatch.setenv(name, value)
    cfg = compose_train(["compute=multi_node", "compute.device=cpu"])
    assert resolve_recipe(cfg, tmp_path).compute.rdzv_endpoint == "10.1.1.1:29400"
    with pytest.raises(UserError) as err:
        platforms.run_dir(None, "outputs/day/time", _root_=cfg)
    assert err.value.key == "hydra.run.dir" and "the same on every node" in err.value.fix
    monkeypatch.setenv("PET_MASTER_ADDR", "ft-node-0-0")  # without its domain
    assert platforms.run_dir(None, "outputs/day/time", _root_=cfg) == "outputs/kubeflow-ft"


def test_torchrun_variables_give_the_rendezvous(monkeypatch, tmp_path: Path) -> None:
    for name, value in TORCHRUN_ENV.items():
        monkeypatch.setenv(name, value)
    cfg = compose_train(["compute=multi_node", "compute.device=cpu"])
    recipe = resolve_recipe(cfg, tmp_path)
    assert (recipe.compute.nnodes, cfg.compute.node_rank) == (4, 3)
    assert recipe.compute.rdzv_endpoint == "10.0.0.9:23456"
    # torchrun's variables name no job, so four nodes need an explicit shared run directory.
    with pytest.raises(UserError) as err:
        platforms.run_dir(None, "outputs/day/time", _root_=cfg)
    assert err.value.key == "hydra.run.dir" and "the same on every node" in err.value.fix


def test_explicit_overrides_win_over_the_platform(monkeypatch, tmp_path: Path) -> None:
    got = world(
        SLURM,
        monkeypatch,
        tmp_path,
        "compute.nnodes=2",
        "compute.node_rank=0",
        "compute.master_addr=10.9.9.9",
        "compute.master_port=1234",
        "compute.nproc_per_node=2",
    )
    assert (got["world"], got["node_rank"], got["rdzv_endpoint"]) == (4, 0, "10.9.9.9:1234")
    # Forcing a platform reads only its variables.
    forced = world({**SLURM, **KUBEFLOW}, monkeypatch, tmp_path, "compute.platform=slurm")
    assert (forced["world"], forced["rdzv_endpoint"]) == (3, "gpu07:29500")


def test_a_variable_one_platform_lacks_comes_from_the_next(monkeypatch) -> None:
    # A Slurm script that exports MASTER_ADDR itself: the address is its, the rest Slurm's.
    env = {**SLURM, "MASTER_ADDR": "login7"}
    found = platforms.detect("auto", env)
    assert found.values["master_addr"] == "login7" and found.sources["master_addr"] == "MASTER_ADDR"
    assert found.values["nnodes"] == 3 and found.sources["nnodes"] == "SLURM_NNODES"
    assert found.platforms == ("torchrun", "slurm") and found.job_id == "slurm-4242"
    assert "nnodes=3 (SLURM_NNODES)" in found.describe()


@pytest.mark.parametrize(
    ("nodelist", "first"),
    [("gpu[03-04,09],cpu1", "gpu03"), ("node7", "node7"), ("a[1-2]-b[5-6]", "a1-b5"), ("x,y", "x")],
)
def test_first_host_of_a_slurm_node_list(nodelist: str, first: str) -> None:
    assert platforms.first_host(nodelist) == first


@pytest.mark.parametrize(
    ("env", "overrides", "key"),
    [
        ({}, ["compute.nnodes=2"], "compute.master_addr"),
        (
            {},
            ["compute.nnodes=2", "compute.master_addr=h", "compute.node_rank=2"],
            "compute.node_rank",
        ),
        ({**SLURM, "SLURM_NTASKS_PER_NODE": "4"}, [], "SLURM_NTASKS_PER_NODE"),
        ({"PET_NNODES": "two"}, [], "PET_NNODES"),
        ({"PET_NNODES": "2", "PET_NPROC_PER_NODE": "two"}, [], "PET_NPROC_PER_NODE"),
        ({"LOCAL_RANK": "0", "RANK": "1", "WORLD_SIZE": "2"}, [], "LOCAL_RANK"),
        ({}, ["compute.platform=lsf"], "compute.platform"),
    ],
)
def test_impossible_layouts_are_user_errors(env, overrides, key, monkeypatch, tmp_path) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    # A variable read while resolving the config comes wrapped; the CLI unwraps it the same way.
    with pytest.raises(Exception) as err:
        cfg = compose_train(["compute=multi_node", "compute.device=cpu", *overrides])
        resolve_recipe(cfg, tmp_path)
    assert as_user_error(err.value).key == key


def test_several_nodes_need_compute_multi_node(tmp_path: Path) -> None:
    with pytest.raises(UserError) as err:
        resolve_recipe(compose_train(["compute=cpu", "compute.nnodes=2"]), tmp_path)
    assert err.value.key == "compute.nnodes" and "compute=multi_node" in err.value.fix


def test_cfg_job_shows_what_was_detected_and_from_where(runner_cli) -> None:
    result = runner_cli("train", "compute=multi_node", "--cfg", "job", "--resolve", env=KUBEFLOW)
    assert result.returncode == 0, result.stderr
    compute = yaml.safe_load(result.stdout)["compute"]
    assert compute["detected"].startswith("kubeflow: nnodes=2 (PET_NNODES), node_rank=1")
    assert (compute["nnodes"], compute["node_rank"], compute["nproc_per_node"]) == (2, 1, 3)
    assert (compute["master_addr"], compute["master_port"]) == ("ft-node-0-0.ft", 29400)


def test_several_nodes_without_a_shared_run_dir_leave_nothing(runner_cli, tmp_path) -> None:
    result = runner_cli("train", "compute=multi_node", "compute.nnodes=2", cwd=tmp_path)
    assert result.returncode == 2
    assert "hydra.run.dir=" in result.stderr and "the same on every node" in result.stderr
    assert "Traceback" not in result.stderr and not (tmp_path / "outputs").exists()


# ---- runner cluster ---------------------------------------------------------------------
TRAIN = [
    "max_steps=2000",
    "dataset.new_system_prompt=Answer in one word.",
    "compute.nproc_per_node=4",
]
CLUSTER = [
    "cluster.name=ft-tiny",
    "cluster.nodes=3",
    "cluster.gpus_per_node=4",
    "cluster.shared_dir=/scratch/runs",
    "cluster.slurm.partition=gpu",
    "cluster.slurm.time=02:00:00",
    "cluster.slurm.setup=[source /scratch/venv/bin/activate]",
    "cluster.kubeflow.image=ghcr.io/acme/runner:1.0",
    "cluster.kubeflow.namespace=ml",
]
LINE = ["runner", "train", "compute=multi_node", *TRAIN]


def test_slurm_script_field_by_field() -> None:
    script = cluster_files([*TRAIN, *CLUSTER])["slurm"]
    lines = script.splitlines()
    assert lines[0] == "#!/bin/bash"
    options = dict(
        line.removeprefix("#SBATCH --").partition("=")[::2]
        for line in lines
        if line.startswith("#SBATCH")
    )
    assert options == {
        "job-name": "ft-tiny",
        "nodes": "3",
        "ntasks-per-node": "1",
        "gpus-per-node": "4",
        "cpus-per-task": "16",
        "time": "02:00:00",
        "partition": "gpu",
        "signal": "TERM@120",
        "requeue": "",
        "open-mode": "append",
        "output": "ft-tiny-%j.out",
    }
    body = [line for line in lines if line and not line.startswith("#")]
    assert body[:2] == ["set -euo pipefail", "source /scratch/venv/bin/activate"]
    srun = shlex.split(body[2])
    # --cpus-per-task again: srun 22.05 to 23.02 does not take sbatch's.
    assert srun[:4] == ["srun", "--ntasks-per-node=1", "--cpus-per-task=16", "--kill-on-bad-exit=1"]
    assert srun[4:] == [*LINE, "hydra.run.dir=/scratch/runs/ft-tiny-${SLURM_JOB_ID}"]
    assert len(body) == 3


def test_trainjob_manifest_field_by_field() -> None:
    manifest = yaml.safe_load(cluster_files([*TRAIN, *CLUSTER])["kubeflow"])
    assert manifest == {
        "apiVersion": "trainer.kubeflow.org/v1alpha1",
        "kind": "TrainJob",
        "metadata": {"name": "ft-tiny", "namespace": "ml"},
        "spec": {
            "runtimeRef": {"name": "torch-distributed"},
            "trainer": {
                "image": "ghcr.io/acme/runner:1.0",
                "command": [*LINE, "hydra.run.dir=/scratch/runs/ft-tiny"],
                "numNodes": 3,
                "numProcPerNode": 4,
                "resourcesPerNode": {"limits": {"nvidia.com/gpu": 4}},
            },
        },
    }


def test_cpu_nodes_ask_for_no_gpu() -> None:
    """cluster.gpus_per_node=0 is CPU nodes (conf/cluster.yaml, docs/nodes.md): the files are
    the GPU nodes' without their GPU request."""
    on_gpus = cluster_files([*TRAIN, *CLUSTER])
    on_cpus = [o for o in CLUSTER if not o.startswith("cluster.gpus_per_node=")]
    files = cluster_files([*TRAIN, *on_cpus, "cluster.gpus_per_node=0"])
    assert "#SBATCH --gpus-per-node=4\n" in on_gpus["slurm"]
    assert files["slurm"] == on_gpus["slurm"].replace("#SBATCH --gpus-per-node=4\n", "")
    manifest = yaml.safe_load(on_gpus["kubeflow"])
    assert manifest["spec"]["trainer"].pop("resourcesPerNode")
    assert yaml.safe_load(files["kubeflow"]) == manifest


def test_script_and_manifest_run_one_composed_config() -> None:
    files = cluster_files([*TRAIN, *CLUSTER])
    srun = shlex.split(files["slurm"].splitlines()[-1])
    command = yaml.safe_load(files["kubeflow"])["spec"]["trainer"]["command"]
    slurm_cfg = compose_train([a for a in srun[6:] if not a.startswith("hydra.")])
    kubeflow_cfg = compose_train([a for a in command[2:] if not a.startswith("hydra.")])
    assert OmegaConf.to_container(slurm_cfg) == OmegaConf.to_container(kubeflow_cfg)
    assert OmegaConf.to_container(slurm_cfg) == OmegaConf.to_container(
        compose_train(["compute=multi_node", *TRAIN])
    )


def test_the_slurm_line_reads_its_node_from_slurm(runner_cli) -> None:
    srun = shlex.split(cluster_files([*TRAIN, *CLUSTER])["slurm"].splitlines()[-1])
    train_args = [a.replace("${SLURM_JOB_ID}", "4242") for a in srun[6:]]
    env = {**SLURM, "SLURM_NNODES": "3", "SLURM_JOB_NODELIST": "gpu[01-03]", "SLURM_NODEID": "1"}
    result = runner_cli("train", *train_args, "--cfg", "job", "--resolve", env=env)
    assert result.returncode == 0, result.stderr
    config = yaml.safe_load(result.stdout)
    compute = config["compute"]
    assert (compute["nnodes"], compute["node_rank"], compute["master_addr"]) == (3, 1, "gpu01")
    assert config["max_steps"] == 2000


@pytest.mark.parametrize(
    ("args", "key"),
    [
        (["compute=cpu"], "compute"),
        (["hydra.run.dir=/tmp/x"], "hydra.run.dir"),
        (["cluster.nodes=2", "compute.nnodes=3"], "compute.nnodes"),
        # Every node runs the one line: a rank in it would be every node's.
        (["cluster.print=slurm", "compute.node_rank=1"], "compute.node_rank"),
        (["cluster.print=slurm", "++compute.node_rank=0"], "compute.node_rank"),
        # One job: a sweep is runner train -m hydra/launcher=slurm.
        (["cluster.print=slurm", "-m", "max_steps=1,2"], "-m"),
        (["cluster.print=slurm", "--multirun", "max_steps=1,2"], "--multirun"),
        (["cluster.print=slurm", "cluster.slurm.time=forever"], "cluster.slurm.time"),
        (["cluster.print=slurm", "cluster.slurm.time=1:2:3:4"], "cluster.slurm.time"),
        (["cluster.print=kubeflow"], "cluster.kubeflow.image"),
        (["cluster.name=Bad_Name", "cluster.kubeflow.image=i"], "cluster.name"),
        (["cluster.print=pdf"], "cluster.print"),
        # Typed by runner.config.schema.Cluster and Train before any file is printed.
        (["cluster.nodes=0"], "cluster.nodes"),
        (["cluster.slurm.cpus_per_task=many"], "cluster.slurm.cpus_per_task"),
        (["batch_size=abc"], "batch_size"),
        # What every node would refuse, or where each node would train alone.
        (["cluster.print=slurm", "optimizer.lr=abc"], "optimizer.lr"),
        (["cluster.print=slurm", "compute.platform=kubeflow"], "compute.platform"),
        (["cluster.print=slurm", "compute.nproc_per_node=9"], "compute.nproc_per_node"),
        (["cluster.print=slurm", "hydra.mode=MULTIRUN"], "hydra.mode=MULTIRUN"),
        (["cluster.print=slurm", "max_steps=choice(1,2)"], "max_steps"),
        # A directory of options here, which the nodes need not have.
        (["cluster.print=slurm", "--config-dir", "/tmp"], "--config-dir"),
        # GPUs asked for that the run does not train on, or none for a run on GPUs.
        (["cluster.print=slurm", "compute.device=cpu"], "cluster.gpus_per_node"),
        (["compute.device=cuda", "cluster.gpus_per_node=0"], "cluster.gpus_per_node"),
        # JobSet's pod names (NAME-node-0-INDEX-XXXXX) are at most 63 characters.
        (
            [f"cluster.name={'a' * 49}", "cluster.print=kubeflow", "cluster.kubeflow.image=i"],
            "cluster.name",
        ),
        # sbatch lines that a space or an empty value breaks, and the double-quoted run
        # directory that a $ in the name would expand.
        (["cluster.print=slurm", "cluster.name=my job"], "cluster.name"),
        (["cluster.print=slurm", "cluster.name=a$b"], "cluster.name"),
        (["cluster.print=slurm", "cluster.slurm.partition=''"], "cluster.slurm.partition"),
    ],
)
def test_cluster_refuses_what_cannot_run(args: list[str], key: str) -> None:
    with pytest.raises(UserError) as err:
        cluster_files(args)
    assert err.value.key == key


def test_cluster_takes_sbatch_times_and_no_sweep() -> None:
    """Each of sbatch's --time forms is written as given; a comma list is not sent to -m."""
    for time in ("90", "90:30", "24:00:00", "2-12", "2-12:30", "2-12:30:00", "UNLIMITED"):
        script = cluster_files(["cluster.print=slurm", f"cluster.slurm.time={time}"])["slurm"]
        assert f"#SBATCH --time={time}\n" in script
    with pytest.raises(UserError) as err:
        cluster_files(["cluster.print=slurm", "max_steps=1,2"])
    assert err.value.key == "max_steps" and "add -m" not in err.value.fix
    assert "runner train -m hydra/launcher=slurm" in err.value.fix


def test_the_files_keep_every_dollar_and_ignore_this_machines_scheduler(monkeypatch) -> None:
    """Kubernetes expands $(VAR) and reads $$ as $ in a command: each $ is written $$. The
    machine that prints may sit inside an allocation of its own, which is not the job's."""
    monkeypatch.setenv("SLURM_NTASKS_PER_NODE", "4")
    prompt = "dataset.new_system_prompt='Reply in $$ or $(CURRENCY)'"
    files = cluster_files([prompt, *CLUSTER])
    command = yaml.safe_load(files["kubeflow"])["spec"]["trainer"]["command"]
    assert "dataset.new_system_prompt='Reply in $$$$ or $$(CURRENCY)'" in command
    assert prompt in shlex.split(files["slurm"].splitlines()[-1])


def test_cluster_command_prints_or_explains(runner_cli) -> None:
    printed = runner_cli("cluster", "cluster.print=slurm", "max_steps=10")
    assert printed.returncode == 0 and printed.stdout.startswith("#!/bin/bash")
    helped = runner_cli("cluster", "--help")
    assert helped.returncode == 0 and "kubeflow:" in helped.stdout and "slurm:" in helped.stdout
    wrong = runner_cli("cluster", "batch_sise=3")
    assert wrong.returncode == 2 and "did you mean 'batch_size'" in wrong.stderr
    # A secret typed on the line is refused as runner train refuses it, never printed.
    token = "hf_" + "x" * 34
    secret = runner_cli("cluster", "cluster.print=slurm", f"runtime.hf_token={token}")
    assert secret.returncode == 2 and "runtime.hf_token='<hidden>'" in secret.stderr
    assert token not in secret.stdout + secret.stderr


def _dotted(section: object, prefix: str = "") -> set[str]:
    """The dotted keys of a YAML mapping or a schema dataclass, sections unfolded."""
    if isinstance(section, dict):
        children = dict(section)
    else:
        assert isinstance(section, type)
        hints = get_type_hints(section)
        children = {spec.name: hints[spec.name] for spec in dataclasses.fields(section)}
    keys = set()
    for name, child in children.items():
        if isinstance(child, dict) or dataclasses.is_dataclass(child):
            keys |= _dotted(child, f"{prefix}{name}.")
        else:
            keys.add(f"{prefix}{name}")
    return keys


def test_cluster_messages_name_what_runner_cluster_runs(runner_cli) -> None:
    """runner cluster is no Hydra app (`--cfg job` is not its): a key it does not know points at
    `runner cluster --help`, which prints every cluster key, or, for a train override, at
    `runner train --cfg job`; the image left null reads as missing, not as None."""
    helped = runner_cli("cluster", "--help")
    assert helped.returncode == 0, helped.stderr
    printed = yaml.safe_load(helped.stdout.split("(conf/cluster.yaml):\n", 1)[1])
    assert _dotted(printed) == _dotted(Cluster)
    cluster_key = runner_cli("cluster", "cluster.bogus=1")
    assert cluster_key.returncode == 2
    assert cluster_key.stderr == (
        "error: cluster.bogus='1': no such key; `runner cluster --help` prints every key\n"
    )
    appended = runner_cli("cluster", "+cluster.bogus=1")  # a key added is the cluster's too
    assert appended.stderr == (
        "error: cluster.bogus=1: no such key; `runner cluster --help` prints every key\n"
    )
    train_key = runner_cli("cluster", "bogus=1")
    assert train_key.returncode == 2
    assert train_key.stderr == (
        "error: bogus='1': no such key; `runner train --cfg job` prints every key\n"
    )
    listed = runner_cli("train", "--cfg", "job")
    assert listed.returncode == 0 and "max_steps:" in listed.stdout, listed.stderr
    no_image = runner_cli("cluster", "max_steps=10")
    assert no_image.returncode == 2
    assert no_image.stderr == (
        "error: cluster.kubeflow.image: give a container image with runner installed, or "
        "cluster.print=slurm\n"
    )
    # A value of the wrong kind is named in the words it is typed in, not Python's type.
    not_a_list = runner_cli("cluster", "cluster.slurm.setup=3")
    assert not_a_list.stderr == "error: cluster.slurm.setup=3: give a list, e.g. [a, b]\n"
