"""Every option of every config group composes and resolves into a recipe (or says why not)."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
from huggingface_hub import constants as hub_constants
from hydra import compose, initialize_config_dir

from runner.config.resolve import resolve_recipe
from runner.errors import UserError
from runner.models.families import family_named
from runner.paths import ASSETS_DIR, CONF_DIR, SAMPLE_DATA_DIR

GROUPS = sorted(p.name for p in CONF_DIR.iterdir() if p.is_dir() and not p.name.startswith("_"))
OPTIONS = [(g, f.stem) for g in GROUPS for f in sorted((CONF_DIR / g).glob("*.yaml"))]
NEEDS_CUDA = {("compute", "gpu"), ("compute", "multi_gpu")}
# model=tiny's k/v projections hold half an NF4 block (tests/test_lora.py checks the message).
PREFERENCE_FILE = ASSETS_DIR / "preference" / "train.jsonl"
# The hub's preference sets, read from the shipped pairs: one file, one split, a prompt column.
HUB_PREFERENCE = [
    "method=dpo",
    f"dataset.source={PREFERENCE_FILE}",
    "dataset.split=train",
    "dataset.validation.split=null",
    "dataset.validation.held_out=5%",
    "dataset.column_map.prompt=prompt",
]
NEEDS_OVERRIDES = {
    ("method", "qlora"): ["model.builder.num_kv_heads=8"],
    # Preference methods train on preference pairs, preference datasets need one of them.
    ("method", "dpo"): ["dataset=preference"],
    ("method", "lora_dpo"): ["dataset=preference"],
    ("method", "qlora_dpo"): ["dataset=preference", "model.builder.num_kv_heads=8"],
    ("dataset", "preference"): ["method=dpo", f"dataset.source={PREFERENCE_FILE}"],
    ("dataset", "ultrafeedback"): HUB_PREFERENCE,
    ("dataset", "orca_dpo"): HUB_PREFERENCE,
}


def compose_train(overrides: list[str]):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose("train", overrides=overrides)


def test_every_group_of_the_design_is_there() -> None:
    for group in ("runtime", "model", "dataset", "dtype", "loss", "compute", "method"):
        assert group in GROUPS


@pytest.mark.parametrize(("group", "option"), OPTIONS, ids=[f"{g}={o}" for g, o in OPTIONS])
def test_option_composes_and_resolves(
    group: str, option: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Dataset options whose source is the user's (???) or on the hub read a local file here.
    # (read by its extension: the option's own format, parquet for alpaca, is another file's)
    sample = [f"dataset.source={SAMPLE_DATA_DIR / 'train.jsonl'}", "dataset.format=null"]
    local = sample if group == "dataset" else []
    # Offline, with an empty cache: tests never reach the hub.
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    cache = f"runtime.cache_dir={tmp_path / 'hub'}"
    extra = NEEDS_OVERRIDES.get((group, option), [])
    cfg = compose_train([f"{group}={option}", *local, cache, *extra])
    if (group, option) in NEEDS_CUDA and not torch.cuda.is_available():
        with pytest.raises(UserError) as err:
            resolve_recipe(cfg, tmp_path, [f"{group}={option}"])  # named as the user typed it
        assert err.value.key == "compute" and err.value.value == option
        assert "compute=cpu" in err.value.fix
        return
    if group == "model" and cfg.model.source is not None or option == "hf":
        # Real models come from the hub, never reached in tests: a train says what is missing;
        # the options with a builder still resolve for `runner estimate`.
        with pytest.raises(UserError) as err:
            resolve_recipe(cfg, tmp_path)
        assert err.value.key == "model.source"
        if option == "hf":
            return
        recipe = resolve_recipe(cfg, tmp_path, fetch=False)
        assert recipe.model.tokenizer is None and recipe.model.lora_builder
    else:
        recipe = resolve_recipe(cfg, tmp_path)
    # One of its family's builders: torchtune's, or a wrapper of one (Gemma 2's logit cap).
    assert recipe.model.builder._component_ in family_named(recipe.model.family).builders
    assert recipe.compute.device in ("cpu", "cuda")
    assert recipe.dtype.name in ("fp32", "bf16_mixed", "bf16")
    if group == "dtype" and option != "auto":
        assert recipe.dtype.name == option
    if group == "loss":
        assert recipe["loss"]["_component_"] == cfg.loss._component_


def test_defaults_pick_what_runs_here(tmp_path: Path) -> None:
    recipe = resolve_recipe(compose_train([]), tmp_path)
    if torch.cuda.is_available():
        # Mixed precision: bf16 compute over fp32 master weights, which keep small updates.
        assert (recipe.compute.device, recipe.dtype.name) == ("cuda", "bf16_mixed")
    else:
        assert (recipe.compute.device, recipe.dtype.name, recipe.compute.nproc_per_node) == (
            "cpu",
            "fp32",
            1,
        )
    # Loader workers where the device leaves the CPU free to prepare batches.
    assert recipe.dataset.num_workers == (2 if torch.cuda.is_available() else 0)
    # An explicit choice wins over the machine's default.
    assert resolve_recipe(compose_train(["dtype=bf16"]), tmp_path).dtype.name == "bf16"


def test_a_section_interpolates_keys_outside_it(tmp_path: Path) -> None:
    """dataset and model.builder were typed apart from the config around them, and an
    interpolation out of them was "not found" (a traceback), though --cfg job --resolve gave it."""
    overrides = [
        "dataset.eval_samples=${batch_size}",
        "dataset.max_seq_len=256",
        "model.builder.max_seq_len=${dataset.max_seq_len}",
        "eval.steps=${max_steps}",
    ]
    recipe = resolve_recipe(compose_train(overrides), tmp_path, fetch=False)
    assert recipe.dataset.eval_samples == recipe.batch_size
    assert recipe.model.builder.max_seq_len == 256 and recipe.eval.steps == recipe.max_steps


def test_help_lists_groups_and_options(runner_cli) -> None:
    result = runner_cli("train", "--help")
    assert result.returncode == 0, result.stderr
    for group, option in OPTIONS:
        assert group in result.stdout and option in result.stdout


def test_cfg_job_prints_the_composed_config(runner_cli) -> None:
    result = runner_cli("train", "--cfg", "job", "batch_size=7", "model=tiny")
    assert result.returncode == 0, result.stderr
    assert "batch_size: 7" in result.stdout
    # The option names its family; the family (runner/models/families/llama3.py) supplies the
    # builder.
    assert "family: llama3" in result.stdout


@pytest.mark.parametrize(
    "args",
    [["seed=7", "--info"], ["--info", "seed=7"], ["-i", "seed=7"], ["seed=7", "--info", "config"]],
)
def test_info_prints_the_config_with_the_overrides_around_it(runner_cli, tmp_path, args) -> None:
    """--info's value is optional: a bare one before or after the overrides prints all (or the
    part named) of the config they compose, as plain Hydra does, and writes nothing."""
    result = runner_cli("train", *args)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "seed: 7" in result.stdout, result.stdout[-2000:]
    assert list(tmp_path.iterdir()) == []


def test_config_dir_adds_a_users_own_option(runner_cli, tmp_path: Path) -> None:
    (tmp_path / "mine" / "model").mkdir(parents=True)
    (tmp_path / "mine" / "model" / "tiny_wide.yaml").write_text(
        "# runner train --config-dir mine model=tiny_wide\n"
        "defaults:\n  - tiny\n  - _self_\nname: tiny_wide\nbuilder:\n  embed_dim: 192\n"
    )
    result = runner_cli("train", "--config-dir", "mine", "model=tiny_wide", "--cfg", "job")
    assert result.returncode == 0, result.stderr
    assert "embed_dim: 192" in result.stdout and "name: tiny_wide" in result.stdout


def test_non_editable_install_finds_configs_recipes_and_assets(tmp_path: Path) -> None:
    """The built wheel, installed elsewhere, composes and resolves without the source tree."""
    root = Path(__file__).resolve().parent.parent
    pip = [sys.executable, "-m", "pip"]
    subprocess.run(
        [*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path), str(root)],
        check=True,
        capture_output=True,
    )
    (wheel,) = tmp_path.glob("runner-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for name in (
        "runner/conf/train.yaml",
        "runner/conf/model/tiny.yaml",
        "runner/recipes/finetune.py",
        "runner/conf/method/qlora.yaml",
        "runner/deploy/__init__.py",
        "runner/deploy/routes.py",
        "runner/cli/train.py",
        "runner/job/job.py",
        "runner/models/torchtune_boundary.py",
        "runner/assets/sample/train.jsonl",
        "runner/assets/tiny_tokenizer/tokenizer.json",
    ):
        assert name in names, name
    site = tmp_path / "site"
    subprocess.run(
        [*pip, "install", "--no-deps", "--target", str(site), str(wheel)],
        check=True,
        capture_output=True,
    )
    code = (
        "import runner.paths as p, runner.config.resolve as r, runner.config.interpolations as rs\n"
        "from hydra import compose, initialize_config_dir as i\n"
        "rs.register()\n"
        "with i(config_dir=str(p.CONF_DIR), version_base='1.3'):\n"
        "    c = compose('train')\n"
        "recipe = r.resolve_recipe(c, p.CONF_DIR)\n"
        "print(p.CONF_DIR, p.RECIPES_DIR, recipe['dataset']['source'])"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        check=True,
        text=True,
        capture_output=True,
        env={**os.environ, "PYTHONPATH": str(site)},
    ).stdout
    assert out.split() == [
        str(site / "runner" / "conf"),
        str(site / "runner" / "recipes"),
        str(site / "runner" / "assets" / "sample" / "train.jsonl"),
    ]


@pytest.mark.parametrize(
    ("key", "value", "fix"),
    [
        ("max_steps", "12", "give an integer >= 1 or null"),
        ("batch_size", "abc", "give an integer >= 1"),
        ("batch_size", 4.0, "give an integer >= 1"),
        ("seed", True, "give an integer from 0 to 9223372036854775807"),
        # torch's generator overflowed on it, after the run directory was made.
        ("seed", 10**20, "give an integer from 0 to 9223372036854775807"),
        ("eval.steps", "10", "give an integer >= 1 or null"),
        ("method.rank", "4", "give an integer >= 1"),
        ("method.alpha", "16", "give a number > 0"),
        ("model.initializer_range", "0.02", "give a number > 0"),
        ("optimizer.lr", "1e-3", "give a number > 0"),
        ("optimizer.lr", "fast", "give a number > 0"),
    ],
)
def test_a_typed_field_refuses_a_value_of_another_type(key, value, fix, tmp_path: Path) -> None:
    """What a YAML file quotes ("12") or an override gives as a string stays one: OmegaConf would
    convert it, the schema refuses it by name."""
    from omegaconf import OmegaConf

    cfg = compose_train(["compute=cpu", "method=lora"])
    OmegaConf.update(cfg, key, value, force_add=True)
    with pytest.raises(UserError) as err:
        resolve_recipe(cfg, tmp_path)
    assert (err.value.key, err.value.value, err.value.fix) == (key, value, fix)


@pytest.mark.parametrize(
    ("key", "fix"),
    [
        ("epochs", "give an integer >= 1 (it takes no null)"),
        ("optimizer.lr", "give a number > 0 (it takes no null)"),
    ],
)
def test_a_null_typed_where_none_is_taken_is_named_as_typed(key, fix, tmp_path: Path) -> None:
    """`epochs=null` read `epochs: give an integer >= 1`, as if nothing had been given."""
    from omegaconf import OmegaConf

    cfg = compose_train(["compute=cpu", "max_steps=null"])
    OmegaConf.update(cfg, key, None, force_add=True)
    with pytest.raises(UserError) as err:
        resolve_recipe(cfg, tmp_path)
    assert str(err.value) == f"{key}=null: {fix}"
