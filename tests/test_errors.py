"""Bad input: one message naming the key, the value and the fix; exit 2; nothing left behind."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException

from runner.config.hydra_errors import as_user_error
from runner.config.secrets import refuse_tokens
from runner.paths import CONF_DIR, SAMPLE_DATA_DIR
from runner.rundir import RunDir
from tests.conftest import QUICK
from tests.fixtures import write_tiny_checkpoint

CASES = [
    # (overrides, text the message must contain)
    (["model=gpt5"], ["model='gpt5'", "no such option; choose one of: code_llama2_7b, gemma2_2b"]),
    (["dtype=bf61"], ["dtype='bf61'", "did you mean 'bf16'"]),
    (["batch_sise=4"], ["batch_sise='4'", "did you mean 'batch_size'"]),
    (["optimizer.lrr=0.1"], ["optimizer.lrr='0.1'", "did you mean 'lr'"]),
    (["batch_size=abc"], ["batch_size='abc'", "integer >= 1"]),
    (["optimizer.lr=fast"], ["optimizer.lr='fast'", "number > 0"]),
    (["max_steps=0"], ["max_steps=0", "integer >= 1"]),
    (["batch_size=0"], ["batch_size=0", "integer >= 1"]),
    (
        ["dataset.source=/no/such/file.jsonl"],
        ["dataset.source='/no/such/file.jsonl'", "no such file"],
    ),
    (
        ["dataset.column_map.output=answer"],
        ["dataset.column_map.output='answer'", "columns are ['instruction', 'input', 'output']"],
    ),
    # A value holding =, which Hydra's grammar reads only quoted (as it does a slice).
    (["key=a=b"], ["override='key=a=b'", "quote the value", "\"key='a=b'\""]),
    # A slice unquoted, which Hydra's grammar cannot read (docs/datasets.md).
    (
        ["dataset.split=train[:50%]"],
        [
            "override='dataset.split=train[:50%]'",
            "quote the value",
            "\"dataset.split='train[:50%]'\"",
        ],
    ),
    # A letter beyond ASCII, which Hydra's grammar reads only quoted: "override look like
    # key=value", said of a key=value.
    (
        ["dataset.source=dätä.jsonl"],
        ["quote the value", "\"dataset.source='dätä.jsonl'\""],
    ),
    (
        ["optimizer.lr=1e-3,2e-3"],
        ["optimizer.lr='1e-3,2e-3'", "a comma list is a sweep: add -m (--multirun)", "quote it"],
    ),
    (["+batch_sise=4"], ["batch_sise=4", "no such key; did you mean 'batch_size'"]),
    (["runtime.env.FOO=1"], ["runtime.env.FOO='1'", "add it with +runtime.env.FOO=1"]),
    # Under a section that is not there: named as typed, not as the section ("lora='4'").
    (["lora.rank=4"], ["lora.rank='4': no such key"]),
    (["model.nope.x=1"], ["model.nope.x='1': no such key"]),
    (
        ["--config-dir", "/nonexistent", "model=mine"],
        ["--config-dir='/nonexistent'", "no such dir"],
    ),
    # Raised inside an interpolation (load_checkpoint.mode's resolver), which OmegaConf wraps.
    (
        ["load_checkpoint.path=/no/such/dir"],
        ["load_checkpoint.path='/no/such/dir'", "neither a runner run directory"],
    ),
    # More than the sample's training records in one batch: refused before the run starts.
    (
        ["batch_size=100000"],
        ["batch_size=100000", "fewer than one global batch of 100000", "or less"],
    ),
    # One sample a process is already too many: the processes are at fault, not accumulation.
    (
        ["batch_size=1", "compute.nproc_per_node=100000"],
        ["fewer than one global batch of 100000", "train on fewer processes (compute.nproc_per"],
    ),
    (
        ["model=hf", f"model.source={CONF_DIR / 'train.yaml'}"],
        ["is a file; give the checkpoint directory that holds it", f"model.source={CONF_DIR}"],
    ),
    (
        ["dataset.format=yaml"],
        ["dataset.format='yaml'", "choose one of: json, jsonl, csv, parquet, arrow, text, xml"],
    ),
]
if not torch.cuda.is_available():
    CASES.append((["compute=gpu"], ["compute='gpu'", "no CUDA GPU", "compute=cpu"]))
    CASES.append((["compute=multi_gpu"], ["compute='multi_gpu'", "no CUDA GPU", "compute=cpu"]))


@pytest.mark.parametrize(("overrides", "expected"), CASES, ids=[" ".join(c[0]) for c in CASES])
def test_bad_input_is_one_clear_message(runner_cli, tmp_path: Path, overrides, expected) -> None:
    out_root = tmp_path / "outputs"
    result = runner_cli("train", *overrides, f"runtime.output_root={out_root}")
    assert result.returncode == 2, result.stderr[-2000:]
    error_lines = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(error_lines) == 1, result.stderr
    for text in expected:
        assert text in error_lines[0], error_lines[0]
    assert "Traceback" not in result.stderr
    assert "Error executing job" not in result.stderr
    # Nothing is left behind: no run directory to claim anything, no empty folder.
    assert not out_root.exists(), list(out_root.rglob("*"))


@pytest.mark.parametrize(
    ("override", "offered"),
    [("batch_sise=4", False), ("optimizer.lrr=0.1", False), ("runtime.env.FOO=1", True)],
)
def test_adding_a_key_is_offered_only_where_one_can_be_added(override: str, offered: bool) -> None:
    """+key=value adds a key only to a section the schema leaves open (runtime.env): a new
    top-level key or one in a typed section is refused all the same."""
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        with pytest.raises(ConfigCompositionException) as raised:
            compose("train", overrides=[override])
    error = as_user_error(raised.value, command="train")
    assert error is not None and "no such key" in error.fix
    assert (f"add it with +{override}" in error.fix) is offered, error.fix


def test_a_group_chosen_twice_is_named_before_its_keys_are_refused(runner_cli, tmp_path) -> None:
    """Hydra keeps the last of `compute=multi_node compute=cpu`: node_rank, a key of the first,
    is then unknown. The warning says why, before the error."""
    out_root = tmp_path / "outputs"
    result = runner_cli(
        "train",
        "compute=multi_node",
        "compute=cpu",
        "compute.node_rank=0",
        f"runtime.output_root={out_root}",
    )
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    warning, error = [
        line for line in result.stderr.splitlines() if line.startswith(("warn", "err"))
    ]
    assert warning == (
        "warning: compute is chosen 2 times (compute=multi_node, then compute=cpu): only the "
        "last, compute=cpu, is used; choose one and set its keys (compute.KEY=VALUE)"
    )
    assert error.startswith("error: compute.node_rank='0': no such key")
    assert not out_root.exists()


def test_the_commands_that_only_look_refuse_a_sweep(runner_cli, tmp_path: Path) -> None:
    """-m would have Hydra make a sweep directory of jobs that never ran, and a summary of them."""
    for command, flag in (("validate", "-m"), ("estimate", "--multirun")):
        result = runner_cli(command, flag, "optimizer.lr=1e-4,1e-3", "max_steps=10")
        assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
        assert result.stderr.startswith(
            f"error: {flag}: runner {command} checks one config and writes nothing; drop {flag}"
        ), result.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (["-m", "--cfg", "job"], "error: --cfg='job': prints one config and runs nothing, not a"),
        (["--multirun", "-cjob"], "error: -cjob: prints one config and runs nothing"),
        (["-m", "--info"], "error: --info: prints one config and runs nothing"),
        (["--cfg", "job", "--info"], "error: --cfg and --info: Hydra takes one of these at a"),
    ],
)
def test_two_of_hydras_modes_are_one_line(runner_cli, tmp_path: Path, flags, expected) -> None:
    """-m --cfg job (what would a sweep's jobs get?) ended in Hydra's ValueError traceback."""
    result = runner_cli("train", "seed=0,1", *flags)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert result.stderr.startswith(expected), result.stderr
    assert "drop -m (--multirun)" in result.stderr or "give one" in result.stderr
    assert list(tmp_path.iterdir()) == []


def test_config_path_names_config_dir_as_the_fix(runner_cli, tmp_path: Path) -> None:
    """--config-path replaces runner's conf/: Hydra's "Primary config module ... not found" (a
    relative path) or "Could not load 'train'" (a base file of the user's) was shown as a
    malformed override."""
    (tmp_path / "conf" / "model").mkdir(parents=True)
    (tmp_path / "conf" / "model" / "mine.yaml").write_text(
        (CONF_DIR / "model" / "tiny.yaml").read_text()
    )
    (tmp_path / "conf" / "mine.yaml").write_text("defaults:\n  - train\n  - _self_\n")
    for flags in (
        ["--config-path", "conf"],
        [f"--config-path={tmp_path / 'conf'}"],
        ["-cp", "conf"],
    ):
        result = runner_cli("validate", *flags, "--config-name", "mine", "model=mine")
        assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
        flag, _, given = " ".join(flags).replace("=", " ").partition(" ")
        assert result.stderr == (
            f"error: {flag}={given!r}: replaces runner's own configs (train.yaml and its "
            f"groups); add yours beside them with --config-dir {given}\n"
        )
    # The fix it names composes the same files.
    fixed = runner_cli(
        "validate", "--config-dir", "conf", "--config-name", "mine", "model=mine", "compute=cpu"
    )
    assert fixed.returncode == 0, fixed.stderr[-2000:]


def test_unknown_command_is_a_user_error(runner_cli) -> None:
    result = runner_cli("trian")
    assert result.returncode == 2
    assert "did you mean `runner train`" in result.stderr


def test_an_argument_left_out_is_named_not_shown_as_none(runner_cli) -> None:
    result = runner_cli("logs")
    assert result.returncode == 2
    assert result.stderr.startswith("error: RUN: missing: give RUN (usage: runner logs "), (
        result.stderr
    )


@pytest.mark.parametrize("args", [["train", "--help"], ["cluster", "--help"], ["--help"]])
def test_help_paged_to_a_reader_that_left_ends_quietly(hermetic_env, args: list[str]) -> None:
    """`runner train --help | head -1`: the reader closes the pipe; runner writes no traceback.
    The pipe's reading end closes before runner writes (a `head` that already has its line):
    whether head's close comes before runner's last write is otherwise a race."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    with subprocess.Popen(
        [sys.executable, "-m", "runner", *args],
        stdout=write_end,
        stderr=subprocess.PIPE,
        env=hermetic_env,
        text=True,
    ) as proc:
        os.close(write_end)
        _, stderr = proc.communicate(timeout=120)
    assert stderr == "" and proc.returncode == 1, stderr[-2000:]


def test_a_secret_in_runtime_env_is_refused_unwritten(runner_cli, tmp_path: Path) -> None:
    out_root = tmp_path / "outputs"
    result = runner_cli(
        "train", "+runtime.env.HF_TOKEN=hf_s3cr3t", f"runtime.output_root={out_root}"
    )
    assert result.returncode == 2
    assert "runtime.env.HF_TOKEN" in result.stderr and "looks like a secret" in result.stderr
    assert "hf_s3cr3t" not in result.stderr + result.stdout
    written = (
        [p.read_text() for p in out_root.rglob("*") if p.is_file()] if out_root.exists() else []
    )
    assert not any("hf_s3cr3t" in text for text in written)


@pytest.mark.parametrize(
    ("args", "env", "named"),
    [
        (["+runtime.env.OMP_NUM_THREADS=0"], None, "runtime.env.OMP_NUM_THREADS='0'"),
        # Read at import: fresh interpreters (tests/cli_forks.py), a run's and a sweep's.
        ([], {"OMP_NUM_THREADS": "0"}, "OMP_NUM_THREADS='0'"),
        (["-m", "seed=0,1"], {"OMP_NUM_THREADS": "two"}, "OMP_NUM_THREADS='two'"),
    ],
    ids=["runtime.env", "shell", "shell, sweep"],
)
def test_a_thread_count_below_one_is_refused_before_a_run(
    runner_cli, tmp_path: Path, args: list[str], env: dict | None, named: str
) -> None:
    """OMP_NUM_THREADS=0 failed the run in a traceback (torch.set_num_threads) after its
    directory was made; text was passed over without a word."""
    roots = [f"runtime.output_root={tmp_path / 'o'}", f"runtime.multirun_root={tmp_path / 'm'}"]
    result = runner_cli("train", *args, "compute=cpu", "max_steps=2", *roots, env=env)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert f"error: {named}: give the threads each training process computes on" in result.stderr
    assert not (tmp_path / "o").exists() and not (tmp_path / "m").exists()


def test_openmps_list_of_thread_counts_computes_on_its_first(runner_cli, tmp_path: Path) -> None:
    """OMP_NUM_THREADS=N,M (N threads, M in each nested region: OpenMP's list form, which the
    check above accepts) computes on N threads, as OpenMP reads it; it was passed over for a
    share of the cores. N is no share this machine would give."""
    count = (os.cpu_count() or 1) + 1
    run = tmp_path / "run"
    args = [*QUICK, "max_steps=1", "runtime.deterministic=false", f"hydra.run.dir={run}"]
    result = runner_cli("train", *args, f"+runtime.env.OMP_NUM_THREADS='{count},1'")
    assert result.returncode == 0, result.stderr[-3000:]
    kernels = json.loads((run / "manifest.json").read_text())["kernels"]
    assert kernels["intra_op_threads"] == count


def test_a_secret_typed_as_a_value_is_refused_before_any_config_is_printed(runner_cli) -> None:
    """--cfg job and --info print every value as typed (Hydra's, before runner's checks run),
    and an export without push_to never reads its hf_token: each is refused first, unprinted."""
    for command, override in (
        ("train", "runtime.hf_token=hf_s3cr3t"),
        ("export", "hf_token=hf_s3cr3t"),
        ("deploy", "api_key.env=sk-s3cr3t"),
        ("train", "+runtime.env.WANDB_API_KEY=s3cr3t"),
        # Hydra's own environment of the job, which it writes to .hydra/hydra.yaml.
        ("train", "+hydra.job.env_set.WANDB_API_KEY=s3cr3t"),
    ):
        for flags in (["--cfg", "job"], ["--info"], []):
            given = [override] if command == "train" else ["checkpoint=x", override]
            result = runner_cli(command, *given, *flags)
            assert result.returncode == 2, (command, override, flags, result.stderr[-2000:])
            key = override.lstrip("+").partition("=")[0]
            assert result.stderr.startswith(f"error: {key}='<hidden>': "), result.stderr
            assert "s3cr3t" not in result.stdout + result.stderr


def test_hydras_env_set_is_refused_for_runtime_env_which_the_run_records(runner_cli, tmp_path):
    """hydra.job.env_set reached the training processes, but the run recorded it nowhere:
    runner resume and repro ran without it (repro of a run on one thread re-ran on two)."""
    run_dir = tmp_path / "run"
    for command in (["validate"], ["train"], ["train", "-m", "seed=0,1"]):
        result = runner_cli(
            *command,
            "compute=cpu",
            "+hydra.job.env_set.OMP_NUM_THREADS=1",
            f"hydra.run.dir={run_dir}",
            f"hydra.sweep.dir={run_dir}",
        )
        assert result.returncode == 2, result.stderr[-2000:]
        assert result.stderr.endswith(
            "error: hydra.job.env_set.OMP_NUM_THREADS='1': the run would not record it, and "
            "runner resume and repro would run without it; give +runtime.env.OMP_NUM_THREADS=1 "
            "(recorded, and set again by both)\n"
        ), result.stderr[-2000:]
        assert not run_dir.exists()


def test_hydras_chdir_is_refused_before_anything_is_written(runner_cli, tmp_path: Path) -> None:
    """hydra.job.chdir=true moved the job into its run directory: a relative dataset.source was
    "no such file" there, after Hydra had made the run's directories (an empty date folder was
    left behind)."""
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train.jsonl").write_text((SAMPLE_DATA_DIR / "train.jsonl").read_text())
    for command in (["validate"], ["train"], ["train", "-m", "seed=0,1"]):
        result = runner_cli(
            *command, "compute=cpu", "hydra.job.chdir=true", "dataset.source=data/train.jsonl"
        )
        assert result.returncode == 2, result.stderr[-2000:]
        assert result.stderr.endswith(
            "error: hydra.job.chdir=true: runner reads the paths you give (dataset.source, "
            "load_checkpoint.path, runtime.output_root, ...) from the directory you run it in; "
            "leave hydra.job.chdir false, and give absolute paths for files elsewhere\n"
        ), result.stderr[-2000:]
        assert sorted(p.name for p in tmp_path.iterdir()) == ["data"]


def test_hydras_section_prints_resolved(runner_cli, tmp_path: Path) -> None:
    """`--cfg hydra --resolve` said "config: no such key to interpolate": Hydra resolved its
    section apart from the job's keys its run directory interpolates (runtime.output_root)."""
    out = tmp_path / "out"
    for cfg in (["--cfg", "hydra"], ["--cfg=hydra"], ["-chydra"]):
        result = runner_cli("train", *cfg, "--resolve", f"runtime.output_root={out}")
        assert result.returncode == 0, result.stderr[-2000:]
        assert re.search(rf"^run:\n  dir: {re.escape(str(out))}/\d{{4}}-", result.stdout, re.M)
        assert "${runtime" not in result.stdout and not out.exists()


def test_a_number_from_the_environment_says_how_to_read_it_as_one(runner_cli) -> None:
    """${oc.env:LR} gives text: optimizer.lr='1e-4' was refused as "give a number > 0", and a
    component's argument (weight_decay) by torch's words, with nothing on why or what to write;
    written as the message says, it is read as the number."""
    env = {"LR": "1e-4", "LAYERS": "2"}
    for given, key, value, written in (
        ("optimizer.lr=${oc.env:LR}", "optimizer.lr", "1e-4", "${oc.env:LR}"),
        ("optimizer.weight_decay=${oc.env:LR}", "optimizer.weight_decay", "1e-4", "${oc.env:LR}"),
        ("model.builder.num_layers=${oc.env:LAYERS}", "model.builder.num_layers", "2", None),
        ("loss.num_output_chunks=${oc.env:LAYERS}", "loss.num_output_chunks", "2", None),
        ("method=lora method.rank=${oc.env:LAYERS}", "method.rank", "2", None),
    ):
        result = runner_cli("validate", "compute=cpu", *given.split(), env=env)
        assert result.returncode == 2, result.stderr[-2000:]
        errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
        assert len(errors) == 1 and errors[0].startswith(f"error: {key}='{value}': "), errors
        decoded = "${oc.decode:" + (written or given.rpartition("=")[2]) + "}"
        assert f"'{decoded}'" in errors[0], errors[0]
    result = runner_cli(
        "validate", "compute=cpu", "optimizer.lr='${oc.decode:${oc.env:LR}}'", env=env
    )
    assert result.returncode == 0, result.stderr[-2000:]


TOKEN = "hf_AbCdEfGhIjKlMnOpQrStUvWxYz0123456789"  # a hub token's shape, no token


@pytest.mark.parametrize("typed", [True, False])
def test_a_token_under_any_key_is_refused_unwritten(runner_cli, tmp_path: Path, typed) -> None:
    """Under a key that names no secret, typed or brought in by an interpolation: it was
    written in clear to recipe.yaml, manifest.json and the trackers' records. A path that
    holds a prefix (/data/task-management.jsonl) is no token."""
    out_root = tmp_path / "outputs"
    given = "+runtime.env.FOO=" + (TOKEN if typed else "${oc.env:RUNNER_TEST_VALUE}")
    result = runner_cli(
        "train",
        "compute=cpu",
        given,
        f"runtime.output_root={out_root}",
        env=None if typed else {"RUNNER_TEST_VALUE": TOKEN},
    )
    assert result.returncode == 2 and "error: runtime.env.FOO='<hidden>': looks like a token" in (
        result.stderr
    ), result.stderr[-2000:]
    assert TOKEN not in result.stdout + result.stderr and not out_root.exists()
    refuse_tokens({"dataset": {"source": "/data/task-management_of_many_things.jsonl"}})


@pytest.mark.parametrize(
    "override",
    ["runtime.hf_tokn=hf_s3cr3tvalue", "+model.api_key=s3cr3t", "runtime.env={HF_TOKEN:s3cr3t}"],
)
def test_a_secret_under_a_misspelt_or_unknown_key_is_never_echoed(runner_cli, override) -> None:
    """The 'no such key' message showed the value, and for runtime.env={HF_TOKEN:...} told the
    user to write the secret into runtime.env."""
    result = runner_cli("validate", "compute=cpu", override)
    assert result.returncode == 2 and "='<hidden>': " in result.stderr, result.stderr
    assert "s3cr3t" not in result.stdout + result.stderr


def test_a_dict_given_to_an_open_section_says_how_it_merges(runner_cli) -> None:
    result = runner_cli("validate", "compute=cpu", "runtime.env={FOO:bar}")
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith(
        "error: runtime.env='{FOO:bar}': a dict of new keys merges into it with "
        "+runtime.env={FOO:bar}"
    ), result.stderr


def test_pickled_weights_are_refused_naming_how_to_save_safetensors(runner_cli, tmp_path) -> None:
    """A pickle can run code as it loads: training, deploy and export take safetensors only."""
    from safetensors.torch import load_file

    source = write_tiny_checkpoint("llama3_2", tmp_path / "bin")
    torch.save(load_file(source / "model.safetensors"), source / "pytorch_model.bin")
    (source / "model.safetensors").unlink()
    resave = "AutoModelForCausalLM.from_pretrained(DIR).save_pretrained(NEW_DIR)"
    for command, given in (
        ("train", ["model=hf", f"model.source={source}", "compute=cpu", "dtype=fp32"]),
        ("deploy", [f"checkpoint={source}", f"allowed_roots=[{tmp_path}]"]),
    ):
        result = runner_cli(command, *given)
        assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
        assert "pickled .bin files" in result.stderr and resave in result.stderr, result.stderr


def test_a_diverged_run_is_one_clear_message_and_keeps_its_directory(
    runner_cli, tmp_path: Path
) -> None:
    """lr=1e30 makes the weights overflow: the loss, read a few steps late (no host sync in each
    step), is reported at the first step where it is nan, and the run's log and status stay."""
    run_dir = tmp_path / "run"
    result = runner_cli(
        "train",
        *QUICK,
        "max_steps=6",
        "optimizer.lr=1e30",
        "optimizer.warmup_steps=0",
        "eval.strategy=no",
        f"hydra.run.dir={run_dir}",
    )
    assert result.returncode == 2, result.stderr[-2000:]
    error_lines = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(error_lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert error_lines[0].startswith("error: optimizer.lr=1e+30: the training loss is nan at step")
    status = RunDir(run_dir).status()
    assert status.state == "failed" and "lower the learning rate" in status.error
    assert (run_dir / "train.log").is_file() and not RunDir(run_dir).checkpoints()
    # Its status is at the step the error names; metrics.jsonl is there, with no step logged.
    nan_at = re.search(r"is nan at step (\d+);", error_lines[0])
    assert nan_at is not None and status.step == int(nan_at[1]) > 1, (status, error_lines)
    assert (run_dir / "metrics.jsonl").read_text() == ""
    # It saved nothing to go on from: its directory is started again with the lr corrected.
    again = ["train", *QUICK, "max_steps=2", "eval.strategy=no", f"hydra.run.dir={run_dir}"]
    result = runner_cli(*again)
    assert result.returncode == 0, result.stderr[-2000:]
    assert RunDir(run_dir).status().state == "completed"
    assert "optimizer.lr=1e30" not in (run_dir / "manifest.json").read_text()


def test_a_config_dir_option_that_is_broken_is_named(runner_cli, tmp_path: Path) -> None:
    """An option of the user's own (--config-dir) that is no YAML, or whose builder misspells
    an argument: each was a traceback (a ScannerError; a KeyError of the argument it lacked)."""
    (tmp_path / "mine" / "model").mkdir(parents=True)
    tiny = (CONF_DIR / "model" / "tiny.yaml").read_text()
    (tmp_path / "mine" / "model" / "broken.yaml").write_text("name: broken\nbuilder:\n a: [1\n")
    (tmp_path / "mine" / "model" / "typo.yaml").write_text(
        tiny.replace("name: tiny", "name: typo").replace("num_layers:", "num_layer:")
    )
    for option, wanted in (
        ("broken", "broken.yaml': not valid YAML at line 4, column 1"),
        (
            "typo",
            "error: model.builder.num_layer=4: torchtune.models.llama3_2.llama3_2 takes no "
            "such argument; did you mean 'num_layers'?",
        ),
    ):
        # --config-dir after an override: the overrides after a flag were "unrecognized".
        mine = str(tmp_path / "mine")
        result = runner_cli("validate", f"model={option}", "--config-dir", mine, "max_steps=4")
        assert result.returncode == 2 and wanted in result.stderr, result.stderr[-2000:]


def test_a_current_directory_removed_under_the_shell_is_one_line(hermetic_env, tmp_path) -> None:
    """Hydra read os.getcwd() first: a 40-line FileNotFoundError traceback, for any command."""
    gone = tmp_path / "gone"
    gone.mkdir()
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            "import os, sys; from runner.cli import main; "
            f"os.chdir({str(gone)!r}); os.rmdir({str(gone)!r}); sys.exit(main(['runs']))",
        ],
        env=hermetic_env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert (result.returncode, result.stderr) == (
        2,
        "error: the current directory no longer exists; cd to one that does\n",
    )


def test_memory_run_out_is_one_line_with_what_takes_less() -> None:
    """torch's own errors of memory run out (the CUDA allocator's, the CPU allocator's, Python's
    MemoryError), each with the settings that take less; any other error is left to its
    traceback. The address-space limit is named where one is set (a login node's ulimit -v)."""
    import resource

    from omegaconf import OmegaConf

    from runner.trainer.process import out_of_memory_line

    cfg = OmegaConf.create(
        {"batch_size": 8, "activation_checkpointing": False, "dataset": {"max_seq_len": 2048}}
    )
    gpu = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB.\nmore")
    assert out_of_memory_line(gpu, cfg, 3) == (
        "out of memory on the GPU after 3 step(s): OutOfMemoryError: CUDA out of memory. Tried "
        "to allocate 2.00 GiB.; lower batch_size=8 (a larger gradient_accumulation_steps keeps "
        "the global batch) or dataset.max_seq_len=2048, or set activation_checkpointing=true; "
        "`runner estimate` gives the memory a config takes"
    )
    with pytest.raises(RuntimeError) as host:
        torch.empty(2**60, dtype=torch.uint8)  # more than any address space holds
    cfg.activation_checkpointing = True
    line = out_of_memory_line(host.value, cfg, 0)
    assert line is not None and line.startswith("out of memory on the host after 0 step(s): ")
    assert "activation_checkpointing" not in line and "ulimit" not in line
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = 2**45 if hard == resource.RLIM_INFINITY else hard  # finite, far above any use here
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    try:
        line = out_of_memory_line(MemoryError(), cfg, 1)
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
    assert line is not None and line.endswith(f"at most {limit / 2**30:.1f} GiB (ulimit -v)")
    assert out_of_memory_line(RuntimeError("shape mismatch"), cfg, 1) is None


# Loaded first by the command below (sitecustomize.py): the training loop's module asks for
# more memory than the address-space limit allows as it loads, as a library too big for a login
# node's `ulimit -v` does (a real MemoryError: the kernel refuses the mapping).
TRAINING_MODULE_OUT_OF_MEMORY = """
import sys

class _Greedy:
    def find_spec(self, name, path=None, target=None):
        if name == "runner.recipes.finetune":
            bytearray(2**46)
        return None

sys.meta_path.insert(0, _Greedy())
"""


def test_libraries_that_do_not_fit_the_address_space_are_one_line_and_leave_nothing(
    hermetic_env, tmp_path: Path
) -> None:
    """Under `ulimit -v`, what training loads is loaded before Hydra makes the run directory:
    out of address space, the process could not even list the directory to remove it."""
    import resource

    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(TRAINING_MODULE_OUT_OF_MEMORY)
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = 2**45 if hard == resource.RLIM_INFINITY else hard  # finite, far above any use here
    run_dir = tmp_path / "run"
    result = subprocess.run(
        [sys.executable, "-m", "runner", "train", *QUICK, f"hydra.run.dir={run_dir}"],
        env={**hermetic_env, "PYTHONPATH": str(hooks)},
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS, (limit, hard)),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 2 and result.stderr == (
        f"error: ulimit -v: this shell lets a process map at most {limit // 1024} KiB "
        f"({limit / 2**30:.1f} GiB) of memory, and runner ran out of it (MemoryError); raise the "
        "limit (`ulimit -v unlimited`, where the machine allows) or run where it is higher\n"
    ), result.stderr[-3000:]
    assert not run_dir.exists()
    # Printing the config trains nothing here: it loads none of that (on a login node, too).
    for flags in (["--cfg", "job"], ["--cfg=job"], ["-cjob"]):
        printed = subprocess.run(
            [sys.executable, "-m", "runner", "train", *QUICK, *flags],
            env={**hermetic_env, "PYTHONPATH": str(hooks)},
            preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS, (limit, hard)),
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert printed.returncode == 0 and "max_steps:" in printed.stdout, printed.stderr[-3000:]


def test_only_memory_run_out_is_called_so_under_an_address_space_limit() -> None:
    """glibc says "failed to map segment" of any mapping refused (a library on a noexec mount),
    and a pids limit refuses threads: with room left under the limit, neither is memory."""
    import resource

    from runner.errors import address_space_error

    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = 2**45 if hard == resource.RLIM_INFINITY else hard  # finite, far above any use here
    mapped = ImportError("_sentencepiece.so: failed to map segment from shared object")
    thread = RuntimeError("can't start new thread")
    assert address_space_error(MemoryError()) is None  # no limit set
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    try:
        refused = address_space_error(MemoryError())
        unsure = [address_space_error(err) for err in (mapped, thread, SystemError("x"))]
        other = address_space_error(ValueError("bad value"))
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
    assert refused is not None and refused.key == "ulimit -v"
    assert unsure == [None, None, None] and other is None


def test_the_room_a_refused_thread_needs_grows_with_its_stack() -> None:
    """glibc gives each thread ulimit -s of stack: with 256 MiB stacks, 100 MiB left is too
    little for one, and the refusal is memory's."""
    import threading

    from runner.errors import _stack_room

    before = threading.stack_size(256 << 20)
    try:
        assert _stack_room() == 4 * (256 << 20)
    finally:
        threading.stack_size(before)
    assert _stack_room() >= 64 << 20
