"""The optimizer group: each option names its torch.optim component; its arguments are checked
before anything runs; the estimate counts the state the chosen optimizer keeps."""

from __future__ import annotations

from pathlib import Path

import pytest
from omegaconf import OmegaConf

from runner.config.optimizer import resolve_optimizer, state_per_weight
from runner.errors import UserError
from runner.models.checkpoint import read_training_state
from tests.conftest import ESTIMATE_DATA, QUICK

FOUR_STEPS = [
    *QUICK,
    "compute=cpu",
    "dtype=fp32",
    "max_steps=4",
    "batch_size=4",
    "eval.strategy=no",
    "runtime.loggers=[]",
]


@pytest.mark.parametrize(
    ("node", "tensors"),
    [
        ({"_component_": "torch.optim.AdamW", "lr": 1e-3}, 2),
        ({"_component_": "torch.optim.AdamW", "lr": 1e-3, "amsgrad": True}, 3),
        ({"_component_": "torch.optim.SGD", "lr": 1e-2, "momentum": 0.9}, 1),
        ({"_component_": "torch.optim.SGD", "lr": 1e-2}, 0),
    ],
)
def test_state_per_weight_is_counted_from_the_optimizer_itself(node: dict, tensors: int) -> None:
    assert state_per_weight(node) == tensors


def test_an_argument_the_optimizer_refuses_is_a_user_error() -> None:
    with pytest.raises(UserError, match="torch.optim.AdamW refuses them"):
        state_per_weight({"_component_": "torch.optim.AdamW", "lr": 1e-3, "betas": [1.5, 0.9]})
    with pytest.raises(UserError, match=r"give 2 values \(its class's default is \[0.9, 0.999\]\)"):
        state_per_weight({"_component_": "torch.optim.AdamW", "lr": 1e-3, "betas": [0.9]})
    with pytest.raises(UserError, match="does not take it"):
        state_per_weight({"_component_": "torch.optim.SGD", "lr": 1e-2, "betas": [0.9, 0.9]})
    # A key it takes, of another kind: no "drop or rename the key" (SGD takes momentum).
    with pytest.raises(UserError, match="SGD refuses it .*; give a value of its kind, as its"):
        state_per_weight({"_component_": "torch.optim.SGD", "lr": 1e-2, "momentum": "abc"})
    # Taken by the default kernel as a true value, refused by the fused one training runs.
    fused = {"_component_": "torch.optim.AdamW", "lr": 1e-3, "fused": True, "amsgrad": "maybe"}
    with pytest.raises(UserError) as refused:
        state_per_weight(fused)
    assert (refused.value.key, refused.value.value) == ("optimizer.amsgrad", "maybe")
    with pytest.raises(UserError, match="components may only come from"):
        state_per_weight({"_component_": "os.system", "lr": 1e-2})


def test_sgd_trains_and_keeps_its_momentum_in_the_checkpoint(runner_cli, tmp_path: Path) -> None:
    # Two processes, whose weights FSDP2 shards: SGD's fused step has no rule for them, and its
    # default (fused=null) failed every such run's first step, then each restart's.
    run = tmp_path / "sgd"
    two = "compute.nproc_per_node=2"
    result = runner_cli("train", *FOUR_STEPS, "optimizer=sgd", two, f"hydra.run.dir={run}")
    assert result.returncode == 0, result.stderr[-3000:]
    recipe = (run / "recipe.yaml").read_text()
    assert "_component_: torch.optim.SGD" in recipe and "fused: false" in recipe
    state = read_training_state(run / "checkpoints" / "step_4")["optimizer"]["state"]
    assert state and all(set(entry) == {"momentum_buffer"} for entry in state.values())


@pytest.mark.parametrize(
    ("component", "processes", "fused"),
    [("SGD", 1, True), ("SGD", 2, False), ("AdamW", 2, True), ("Adam", 8, True)],
)
def test_null_fuses_where_the_kernel_runs_on_the_weights_as_trained(
    component: str, processes: int, fused: bool
) -> None:
    node = {"_component_": f"torch.optim.{component}", "lr": 1e-2, "fused": None}
    keys = {"warmup_steps": 0, "cosine_decay": True}
    assert resolve_optimizer(OmegaConf.create({**node, **keys}), processes)["fused"] is fused


def test_fused_sgd_over_several_processes_is_refused_naming_the_fix() -> None:
    node = {"_component_": "torch.optim.SGD", "lr": 1e-2, "fused": True, "warmup_steps": 0}
    with pytest.raises(UserError, match="over 2 processes .* give optimizer.fused=null") as refused:
        resolve_optimizer(OmegaConf.create({**node, "cosine_decay": True}), 2)
    assert (refused.value.key, refused.value.value) == ("optimizer.fused", True)


def test_a_refused_optimizer_argument_stops_train_before_a_run_dir(
    runner_cli, tmp_path: Path
) -> None:
    run = tmp_path / "bad"
    result = runner_cli("train", *FOUR_STEPS, "optimizer.betas=[0.9]", f"hydra.run.dir={run}")
    assert result.returncode == 2, result.stderr[-3000:]
    wanted = "error: optimizer.betas=[0.9]: give 2 values (its class's default is [0.9, 0.999])"
    assert wanted in result.stderr
    assert "Traceback" not in result.stderr
    assert not run.exists()


def test_estimate_counts_the_chosen_optimizers_state(runner_cli) -> None:
    adamw = runner_cli("estimate", "compute=cpu", "dtype=fp32", ESTIMATE_DATA)
    sgd = runner_cli("estimate", "compute=cpu", "dtype=fp32", "optimizer=sgd", ESTIMATE_DATA)
    assert adamw.returncode == sgd.returncode == 0, adamw.stderr + sgd.stderr
    assert "(AdamW, 2 state tensor(s) per weight)" in adamw.stdout
    assert "(SGD, 1 state tensor(s) per weight)" in sgd.stdout


def test_the_constant_schedule_warms_up_as_the_cosine_one() -> None:
    """optimizer.cosine_decay=false began at lr/warmup_steps and peaked a step before the
    cosine schedule; both start from 0 now, as conf/optimizer/adamw.yaml says."""
    import torch

    from runner.trainer.optimization import _lr_scheduler

    rates = {}
    for cosine in (True, False):
        optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
        schedule = _lr_scheduler(optimizer, {"cosine_decay": cosine, "warmup_steps": 4}, 100)
        rates[cosine] = []
        for _ in range(5):
            rates[cosine].append(optimizer.param_groups[0]["lr"])
            optimizer.step()
            schedule.step()
    assert rates[False] == rates[True] == [0.0, 0.25, 0.5, 0.75, 1.0]


def test_a_warmup_as_long_as_the_run_is_said(caplog) -> None:
    """The default 50 steps of warmup in a run of 20 trains at 2/5 of optimizer.lr at most,
    unsaid: said now, not refused."""
    from runner.config.optimizer import warn_long_warmup

    warn_long_warmup({"lr": 1e-3, "warmup_steps": 50}, 100)
    assert not caplog.records
    warn_long_warmup({"lr": 1e-3, "warmup_steps": 50}, 20)
    (record,) = caplog.records
    assert "optimizer.warmup_steps=50 is not below max_steps=20" in record.getMessage()
    assert "(at most 0.00038)" in record.getMessage()
