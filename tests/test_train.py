"""`runner train` through the real CLI: run directory contract, HF checkpoint parity, sweeps."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from transformers import AutoModelForCausalLM, AutoTokenizer

from runner.components import instantiate
from runner.models.checkpoint import read_model_state
from runner.models.tokenizer import ChatTokenizer
from runner.models.torchtune_boundary import Message
from runner.rundir import STATES
from tests.conftest import QUICK, losses


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory: pytest.TempPathFactory, hermetic_env) -> Path:
    """One short real training run shared by the tests of this module."""
    import subprocess
    import sys

    run_dir = tmp_path_factory.mktemp("run") / "run"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "runner",
            "train",
            *QUICK,
            "max_steps=24",
            "runtime.save_every_n_steps=8",
            "runtime.keep_last_n_checkpoints=2",
            "runtime.log_every_n_steps=1",
            f"hydra.run.dir={run_dir}",
        ],
        env=hermetic_env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (run_dir / "stdout.txt").write_text(proc.stdout)
    return run_dir


def test_run_directory_holds_the_contract(trained_run: Path) -> None:
    for name in (
        ".hydra/config.yaml",
        ".hydra/overrides.yaml",
        "recipe.yaml",
        "status.json",
        "metrics.jsonl",
        "train.log",
    ):
        assert (trained_run / name).is_file(), name
    assert list((trained_run / "tensorboard").glob("events.out.tfevents.*"))
    status = json.loads((trained_run / "status.json").read_text())
    assert status["state"] == "completed" and status["state"] in STATES
    assert status["step"] == 24 and status["total_steps"] == 24
    for key in ("created_at", "started_at", "ended_at", "updated_at"):
        assert status[key]
    assert sorted(losses(trained_run)) == list(range(1, 25))
    recipe = OmegaConf.load(trained_run / "recipe.yaml")
    assert recipe.compute.device == "cpu" and recipe.dtype.name == "fp32"


def test_retention_keeps_the_last_whole_checkpoints(trained_run: Path) -> None:
    names = sorted(p.name for p in (trained_run / "checkpoints").iterdir())
    assert names == ["step_16", "step_24"]
    checkpoint = trained_run / "checkpoints" / "step_24"
    for name in (
        "config.json",
        "model.safetensors",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "training_state.pt",
    ):
        assert (checkpoint / name).is_file(), name


def test_last_lines_say_where_things_are_and_what_next(trained_run: Path) -> None:
    out = (trained_run / "stdout.txt").read_text()
    assert f"run directory: {trained_run}" in out
    assert f"checkpoint:    {trained_run / 'checkpoints' / 'step_24'}" in out
    assert "held-out exact match:" in out and "runner deploy checkpoint=" in out


def test_transformers_loads_the_checkpoint_with_equal_logits(trained_run: Path) -> None:
    checkpoint = trained_run / "checkpoints" / "step_24"
    recipe = OmegaConf.load(trained_run / "recipe.yaml")
    ours = instantiate(recipe.model.builder)
    ours.load_state_dict(read_model_state(checkpoint))
    theirs = AutoModelForCausalLM.from_pretrained(checkpoint, use_safetensors=True)
    tokens = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = (ours(tokens) - theirs(tokens).logits).abs().max().item()
    assert diff <= 1e-5, diff


def test_transformers_tokenizer_gives_the_training_ids(trained_run: Path) -> None:
    checkpoint = trained_run / "checkpoints" / "step_24"
    hf = AutoTokenizer.from_pretrained(checkpoint)
    ours = ChatTokenizer(str(checkpoint))
    chat = [{"role": "user", "content": "Reverse the word.\nhello"}]
    expected = ours.generation_prompt([Message(role="user", content=chat[0]["content"])])
    got = hf.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert list(got) == expected


def test_multirun_gives_one_run_directory_per_job(runner_cli, tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    result = runner_cli(
        "train",
        "-m",
        *QUICK,
        "max_steps=3",
        "dataset.eval_samples=0",
        "optimizer.lr=1e-3,2e-3",
        f"hydra.sweep.dir={sweep}",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    for job, lr in (("0", 1e-3), ("1", 2e-3)):
        recipe = OmegaConf.load(sweep / job / "recipe.yaml")
        assert recipe.optimizer.lr == lr
        assert json.loads((sweep / job / "status.json").read_text())["state"] == "completed"
        assert (sweep / job / "checkpoints" / "step_3" / "model.safetensors").is_file()
