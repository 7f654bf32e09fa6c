"""runner.config.schema: the composed train and deploy configs are typed, so a wrong type, an
unknown key or a value out of its field's bound is one UserError naming the key, the value and
the fix."""

from __future__ import annotations

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from runner.config.schema import Deploy, Export, Train, typed
from runner.errors import UserError
from runner.paths import CONF_DIR
from tests.test_config import compose_train
from tests.test_imports import _loaded_after


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["batch_size=abc"], "batch_size='abc': give an integer >= 1"),
        (["batch_size=2.5"], "batch_size=2.5: give an integer >= 1"),
        (["max_steps=0"], "max_steps=0: give an integer >= 1 or null"),
        (["seed=-1"], "seed=-1: give an integer from 0 to 9223372036854775807"),
        (["compile=3"], "compile=3: give true or false"),
        (["runtime.deterministic=maybe"], "runtime.deterministic='maybe': give true or false"),
        (["clip_grad_norm=0"], "clip_grad_norm=0: give a number > 0 or null"),
        (["method=lora", "method.rank=0"], "method.rank=0: give an integer >= 1"),
        (["method=lora", "method.dropout=-0.1"], "method.dropout=-0.1: give a number >= 0"),
        (["dataset.eval_samples=-1"], "dataset.eval_samples=-1: give an integer >= 0"),
        (["compute.collective_timeout_s=0"], "compute.collective_timeout_s=0: give an integer"),
        (["model.initializer_range=0"], "model.initializer_range=0: give a number > 0"),
    ],
)
def test_a_bad_value_names_key_value_and_fix(overrides: list[str], message: str) -> None:
    with pytest.raises(UserError) as caught:
        typed(compose_train(overrides))
    assert str(caught.value).startswith(message), str(caught.value)


def test_every_option_of_every_group_fits_the_schema() -> None:
    for overrides in (
        [],
        ["method=lora"],
        ["method=qlora"],
        ["compute=multi_node"],
        ["dataset=chat", "dataset.source=x"],
        ["dataset=text", "dataset.source=x"],
        ["model=hf"],
        ["optimizer=sgd", "loss=ce", "dtype=bf16_mixed"],
    ):
        cfg = typed(compose_train(overrides))
        assert OmegaConf.get_type(cfg) is Train


def test_an_unknown_key_is_refused() -> None:
    cfg = OmegaConf.create({"batch_size": 4, "batch_sise": 4})
    with pytest.raises(UserError, match="batch_sise"):
        typed(cfg)


def test_values_come_back_typed() -> None:
    cfg = typed(compose_train(["batch_size=8", "optimizer.lr=1e-4", "clip_grad_norm=2"]))
    assert cfg.batch_size == 8 and cfg.clip_grad_norm == 2.0
    assert isinstance(cfg.clip_grad_norm, float)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("port=abc", "port='abc': give an integer >= 0"),
        ("port=-1", "port=-1: give an integer >= 0"),
        ("max_queue=0", "max_queue=0: give an integer >= 1"),
        ("limits.max_tokens=x", "limits.max_tokens='x': give an integer >= 1"),
        ("vllm.gpu_memory_utilization=0", "vllm.gpu_memory_utilization=0: give a number > 0"),
    ],
)
def test_deploy_config_is_typed_too(override: str, message: str) -> None:
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("deploy", overrides=["checkpoint=unused", override])
    with pytest.raises(UserError) as caught:
        typed(cfg, Deploy)
    assert str(caught.value).startswith(message), str(caught.value)


def test_a_recipe_of_another_layout_is_refused_by_name(tmp_path) -> None:
    """recipe.yaml is read typed: one written before the layout changed (no version) is one
    UserError naming the file, not a KeyError deep in a training process."""
    from runner.config.schema import read_recipe

    old = tmp_path / "recipe.yaml"
    old.write_text("run_dir: /x\ndevice: cpu\ndtype: fp32\ntraining:\n  max_steps: 4\n")
    with pytest.raises(UserError) as caught:
        read_recipe(old)
    assert str(caught.value).startswith(f"{old}='version 1': was written by another runner")


@pytest.mark.parametrize(
    ("override", "message"),
    [
        # The type as a value is typed, not Python's name of it.
        ("select.checkpoint=[1,2]", "select.checkpoint=[1, 2]: give a string"),
        ("merged=3", "merged=3: is a section of dtype, quantization: set them, e.g. merged.dtype="),
        ("+colour=red", "colour='red': no such key"),
    ],
)
def test_export_config_is_typed_too(override: str, message: str) -> None:
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("export", overrides=["checkpoint=unused", override])
    with pytest.raises(UserError) as caught:
        typed(cfg, Export)
    assert str(caught.value).startswith(message), str(caught.value)


def test_the_schemas_import_light() -> None:
    """Each section's module imports torch, transformers or datasets only inside the functions
    that use them, so the commands that only type a config (export, deploy, cluster) start
    fast."""
    assert _loaded_after("import runner.config.schema") == []
