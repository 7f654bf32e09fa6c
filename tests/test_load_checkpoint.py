"""load_checkpoint: a new run starts from another run or a model checkpoint, given or mounted by
the platform (Baseten's BT_LOAD_CHECKPOINT_DIR)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from tests.conftest import QUICK, losses

STEPS = [
    *QUICK,
    "max_steps=4",
    "runtime.save_every_n_steps=2",
    "runtime.log_every_n_steps=1",
    "dataset.eval_samples=0",
    "gradient_accumulation_steps=2",
    "batch_size=8",
]


@pytest.fixture(scope="module")
def straight(tmp_path_factory: pytest.TempPathFactory, forked_cli) -> Path:
    """Four steps, checkpointed at steps 2 and 4."""
    run = tmp_path_factory.mktemp("straight") / "run"
    result = forked_cli(["train", *STEPS, f"hydra.run.dir={run}"], run.parent, timeout_s=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return run


@pytest.fixture(scope="module")
def lora_run(straight: Path, tmp_path_factory: pytest.TempPathFactory, forked_cli) -> Path:
    """Two LoRA steps on the straight run's step-4 weights, checkpointed and evaluated at step 2."""
    run = tmp_path_factory.mktemp("lora") / "run"
    given = [f"load_checkpoint.path={straight}", "load_checkpoint.mode=weights", "method=lora"]
    result = forked_cli(
        ["train", *STEPS, *given, "max_steps=2", f"hydra.run.dir={run}"], run.parent, timeout_s=600
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return run


def mount_with(tmp_path: Path, *entries: tuple[str, Path]) -> dict[str, str]:
    """A BT_LOAD_CHECKPOINT_DIR holding copies of `entries` (name, source) under a job folder."""
    mount = tmp_path / "loaded_checkpoints"
    for name, source in entries:
        shutil.copytree(source, mount / "job-1" / name)
    return {"BT_LOAD_CHECKPOINT_DIR": str(mount)}


def test_a_mounted_run_is_continued_in_the_new_run(runner_cli, straight: Path, tmp_path: Path):
    """The mounted run stopped after its step-2 checkpoint; the new job continues it with the
    uninterrupted run's losses and leaves the mount as it was."""
    env = mount_with(tmp_path, ("run", straight))
    loaded = tmp_path / "loaded_checkpoints" / "job-1" / "run"
    shutil.rmtree(loaded / "checkpoints" / "step_4")
    shown = runner_cli("train", *STEPS, "--cfg", "job", "--resolve", env=env)
    assert shown.returncode == 0, shown.stderr[-3000:]
    section = OmegaConf.create(shown.stdout).load_checkpoint
    assert (section.path, section.mode) == (str(loaded), "resume")
    before = sorted(str(p.relative_to(loaded)) for p in loaded.rglob("*"))
    run = tmp_path / "new"
    result = runner_cli("train", *STEPS, f"hydra.run.dir={run}", env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"resuming from {loaded / 'checkpoints' / 'step_2'}" in result.stderr
    assert sorted(losses(run)) == [3, 4]
    assert losses(run) == {step: losses(straight)[step] for step in (3, 4)}  # bit for bit
    assert sorted(str(p.relative_to(loaded)) for p in loaded.rglob("*")) == before


def test_a_mounted_model_checkpoint_is_the_model_source(
    runner_cli, straight: Path, tmp_path: Path
) -> None:
    env = mount_with(tmp_path, ("step_4", straight / "checkpoints" / "step_4"))
    loaded = tmp_path / "loaded_checkpoints" / "job-1" / "step_4"
    run = tmp_path / "new"
    result = runner_cli("train", *STEPS, "max_steps=1", f"hydra.run.dir={run}", env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    recipe = OmegaConf.load(run / "recipe.yaml")
    assert (recipe.model.source, recipe.resume_from) == (str(loaded), None)
    assert sorted(losses(run)) == [1]
    # Trained from the step-4 weights: its first loss is below the first of the run that made them.
    assert losses(run)[1] < losses(straight)[1]


def test_a_run_given_with_mode_weights_gives_its_latest_weights(
    runner_cli, straight: Path, tmp_path: Path
) -> None:
    run = tmp_path / "new"
    given = [f"load_checkpoint.path={straight}", "load_checkpoint.mode=weights"]
    result = runner_cli("train", *STEPS, *given, "max_steps=1", f"hydra.run.dir={run}")
    assert result.returncode == 0, result.stderr[-3000:]
    assert OmegaConf.load(run / "recipe.yaml").model.source == str(
        straight / "checkpoints" / "step_4"
    )
    # The weights it started from, by hash: those the straight run recorded as it saved them.
    started_from = json.loads((run / "manifest.json").read_text())["weights_sha256"]
    saved = json.loads((straight / "manifest.json").read_text())["checkpoints"]["4"]
    assert started_from == saved and "model.safetensors" in saved


def test_a_lora_run_is_continued_on_its_own_base_with_its_best(
    runner_cli, straight: Path, lora_run: Path, tmp_path: Path
) -> None:
    """The continued run's adapter sits on the base the loaded run trained it on (it sat on the
    seed's random weights, and its loss went back to the untrained model's), and its best,
    where no later evaluation beats it, names the loaded run's checkpoint (it named one of the
    new run's, never saved)."""
    import json

    run = tmp_path / "new"
    given = [f"load_checkpoint.path={lora_run}", "method=lora", "max_steps=3"]
    # No evaluation in the new run: its best stays the loaded run's.
    unevaluated = ["eval.strategy=no", "objective.metric=loss"]
    result = runner_cli("train", *STEPS, *given, *unevaluated, f"hydra.run.dir={run}")
    assert result.returncode == 0, result.stderr[-3000:]
    base = str(straight / "checkpoints" / "step_4")
    assert OmegaConf.load(run / "recipe.yaml").model.source == base
    adapter = json.loads((run / "checkpoints" / "step_3" / "adapter_config.json").read_text())
    assert adapter["base_model_name_or_path"] == base
    # Trained on the base it adapts: its loss is the loaded run's, below the untrained model's.
    assert abs(losses(run)[3] - losses(lora_run)[2]) < 0.05 < losses(straight)[1] - losses(run)[3]
    best = json.loads((run / "status.json").read_text())["best"]
    assert best["checkpoint"] == str(lora_run / "checkpoints" / "step_2"), best


@pytest.mark.parametrize(
    "case",
    [
        "two_mounted",
        "another_shape",
        "another_optimizer",
        "another_optimizer_of_an_adapter",
        "another_global_batch",
        "weights_of_an_adapter",
        "not_a_checkpoint",
        "both_sources",
        "resume_a_model",
        "another_method",
        "another_method_of_an_adapter",
        "another_adapter",
        "no_steps_left",
        "a_sweep",
        "no_training_state",
    ],
)
def test_what_cannot_be_started_from_is_refused_by_name(
    runner_cli, straight: Path, tmp_path: Path, case: str, request: pytest.FixtureRequest
) -> None:
    step = straight / "checkpoints" / "step_4"
    env, extra = None, []
    if case == "two_mounted":
        env = mount_with(tmp_path, ("a", step), ("b", straight))
        wanted = "2 checkpoints are mounted there"
    elif case == "another_shape":
        # Its weights load into no model of another shape (a load_state_dict traceback).
        extra = [f"load_checkpoint.path={straight}", "model.builder.num_layers=1", "max_steps=6"]
        wanted = "a run of model.builder.num_layers=4, where this run's model has 1"
    elif case == "another_optimizer":
        # Its optimizer state goes on: the new lr was recorded, and never trained with.
        extra = [f"load_checkpoint.path={straight}", "optimizer.lr=1e-2", "max_steps=6"]
        wanted = "error: optimizer.lr=0.01: load_checkpoint.path="
    elif case == "another_optimizer_of_an_adapter":
        # mode=weights, which a full run's refusal gives, refuses an adapter: its export merged.
        lora = request.getfixturevalue("lora_run")
        extra = [f"load_checkpoint.path={lora}", "method=lora", "optimizer.lr=0.5", "max_steps=6"]
        wanted = f"new optimizer: export it merged (runner export checkpoint={lora} format=merged)"
    elif case == "another_global_batch":
        # Its data position is in its own batches: 10 a step went on into a ValueError traceback.
        extra = [f"load_checkpoint.path={straight}", "batch_size=10", "max_steps=6"]
        wanted = "error: batch_size=10: "
    elif case == "weights_of_an_adapter":
        # A LoRA run's checkpoints hold its adapter alone (the model.source error, no config.json).
        lora = request.getfixturevalue("lora_run")
        extra = [f"load_checkpoint.path={lora}", "load_checkpoint.mode=weights"]
        wanted = "saved a LoRA adapter, not the whole model's weights"
    elif case == "not_a_checkpoint":
        extra, wanted = [f"load_checkpoint.path={tmp_path}"], "neither a runner run directory"
    elif case == "both_sources":
        env = mount_with(tmp_path, ("step_4", step))
        extra, wanted = [f"model.source={step}"], "names the weights to start from too"
    elif case == "resume_a_model":
        extra = [f"load_checkpoint.path={step}", "load_checkpoint.mode=resume"]
        wanted = "is a model checkpoint; give weights"
    elif case == "another_method":
        # Its checkpoint holds full weights, no adapter: a LoRA run cannot continue it.
        extra = [f"load_checkpoint.path={straight}", "method=lora", "max_steps=6"]
        wanted = "error: method='lora': load_checkpoint.path="
    elif case == "another_method_of_an_adapter":
        # An adapter alone is no model to start from: its export merged is (the fix said none).
        lora = request.getfixturevalue("lora_run")
        extra = [f"load_checkpoint.path={lora}", "max_steps=6"]
        wanted = f"run from its weights: export them merged (runner export checkpoint={lora} "
    elif case == "another_adapter":
        # Another rank loads into no adapter (a size-mismatch traceback at the first load), and
        # another alpha took the trained adapter's output at another scale, unsaid.
        lora = request.getfixturevalue("lora_run")
        extra = [f"load_checkpoint.path={lora}", "method=lora", "method.rank=16", "max_steps=6"]
        wanted = f"error: method.rank=16: load_checkpoint.path={lora} trained an adapter of "
    elif case == "a_sweep":
        sweep = tmp_path / "sweep"
        shutil.copytree(straight, sweep / "0")
        (sweep / "multirun.yaml").write_text("{}")
        extra, wanted = [f"load_checkpoint.path={sweep}"], "a sweep dir: name the run of it"
    elif case == "no_training_state":
        # Deleted to save room: a FileNotFoundError traceback, after the new run dir was made.
        copy = tmp_path / "copy"
        shutil.copytree(straight, copy)
        (copy / "checkpoints" / "step_4" / "training_state.pt").unlink()
        extra = [f"load_checkpoint.path={copy}", "max_steps=6"]
        wanted = f"{copy / 'checkpoints' / 'step_4'}': has no training_state.pt (the optimizer, "
    else:
        # At step 4 already: max_steps=4 would train nothing and save no checkpoint.
        extra, wanted = [f"load_checkpoint.path={straight}"], "error: max_steps=4: "
    # validate refuses what train refuses (the job service's validate-then-launch).
    checked = runner_cli("validate", *STEPS, *extra, env=env)
    assert checked.returncode == 2 and wanted in checked.stderr, checked.stderr[-3000:]
    run = tmp_path / "new"
    result = runner_cli("train", *STEPS, *extra, f"hydra.run.dir={run}", env=env)
    assert result.returncode == 2, result.stderr[-3000:]
    assert "load_checkpoint." in result.stderr and wanted in result.stderr, result.stderr
    assert not run.exists()


def test_a_run_continued_with_more_steps_trains_on_the_longer_schedule(
    runner_cli, straight: Path, tmp_path: Path
) -> None:
    """The fix a completed run's resume gives (load_checkpoint.path=RUN max_steps=<more>): the
    first step goes on at the 8-step schedule's lr for step 5, as torchtune's recipes rebuild
    theirs at the resumed step; it trained at the 4-step schedule's end, 0."""
    import torch

    from runner.models.torchtune_boundary import get_cosine_schedule_with_warmup

    run = tmp_path / "longer"
    args = ["train", *STEPS, f"load_checkpoint.path={straight}", "max_steps=8"]
    result = runner_cli(*args, f"hydra.run.dir={run}")
    assert result.returncode == 0, result.stderr[-3000:]
    recipe = OmegaConf.load(run / "recipe.yaml").optimizer
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=recipe.lr)
    schedule = get_cosine_schedule_with_warmup(optimizer, recipe.warmup_steps, 8)
    for _ in range(4):
        optimizer.step()
        schedule.step()
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    first = next(step for step in steps if step.get("step") == 5 and "lr" in step)
    # The same product (base lr x the schedule's factor) in both: equal to the last bit.
    assert first["lr"] == optimizer.param_groups[0]["lr"] > 0


def test_a_data_position_that_the_data_does_not_fit(runner_cli, tmp_path: Path) -> None:
    """A run continued on more data than its checkpoint's (2 steps an epoch, now 4): the saved
    position, epoch 1 after its 2 steps, leaves 2 steps of 8 in the new data's epochs: the run
    ends where its data does, said (it ended completed at step 6 of 8 with no checkpoint of its
    steps); one that would end before its checkpoint's step is refused by its epochs."""
    short = tmp_path / "short"
    args = ["train", *STEPS, "dataset.split='train[:32]'", "epochs=2", "max_steps=null"]
    result = runner_cli(*args, f"hydra.run.dir={short}")
    assert result.returncode == 0, result.stderr[-3000:]
    longer = tmp_path / "longer"
    args = ["train", *STEPS, "dataset.split='train[:64]'", "epochs=2", "max_steps=null"]
    result = runner_cli(*args, "seed=1", f"load_checkpoint.path={short}", f"hydra.run.dir={longer}")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "the data ends at step 6 of 8" in result.stderr
    # Another seed orders the records otherwise: the position goes on in another order, said.
    assert f"seed=1 (loaded run: 0): the steps from {short}'s data position" in result.stderr
    assert "dataset.split='train[:64]' (loaded run: 'train[:32]')" in result.stderr
    # Its last step is a last step: logged, evaluated, saved; the run completed there.
    assert (longer / "checkpoints" / "step_6").is_dir()
    steps = [json.loads(line) for line in (longer / "metrics.jsonl").read_text().splitlines()]
    assert {"loss", "eval_loss"} <= {key for step in steps if step["step"] == 6 for key in step}
    status = json.loads((longer / "status.json").read_text())
    assert (status["state"], status["step"], status["total_steps"]) == ("completed", 6, 6)
    fewer = tmp_path / "fewer"
    args = ["train", *STEPS, "dataset.split='train[:32]'", "epochs=1", "max_steps=null"]
    result = runner_cli(*args, f"load_checkpoint.path={short}", f"hydra.run.dir={fewer}")
    assert result.returncode != 0
    assert "error: epochs=1: load_checkpoint.path's checkpoint is at step 4" in result.stderr


def test_paths_given_with_a_tilde_are_in_the_home_directory(
    runner_cli, straight: Path, tmp_path: Path
) -> None:
    """Quoted, Hydra keeps `~` as typed: `hydra.run.dir='~/next'` made a directory named `~` in
    the working directory, and `load_checkpoint.path='~/run'` or `runner resume '~/run'` found
    no run (model.source and dataset.source expanded it)."""
    home = tmp_path / "home"
    shutil.copytree(straight, home / "straight")
    env = {"HOME": str(home)}
    given = ["load_checkpoint.path='~/straight'", "hydra.run.dir='~/next'", "max_steps=6"]
    result = runner_cli("train", *STEPS, *given, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert max(losses(home / "next")) == 6 and not (tmp_path / "~").exists()
    result = runner_cli("resume", "~/next", env=env)
    assert result.returncode == 2 and f"RUN='{home / 'next'}': the run is already completed" in (
        result.stderr
    )
