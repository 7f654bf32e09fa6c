"""`runner train` through the real CLI: run directory contract, HF checkpoint parity, sweeps."""

from __future__ import annotations

import importlib.util
import io
import json
import logging
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from transformers import AutoModelForCausalLM, AutoTokenizer

from runner.components import instantiate
from runner.config.runtime import resolve_runtime
from runner.errors import UserError
from runner.models.checkpoint import read_model_state
from runner.models.tokenizer import ChatTokenizer
from runner.models.torchtune_boundary import Message
from runner.rundir import STATES, RunDir
from runner.trainer.progress import shows_bar
from tests.conftest import QUICK, losses, transformers_warnings
from tests.test_config import compose_train


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory: pytest.TempPathFactory, hermetic_env) -> Path:
    """One short real training run shared by the tests of this module: the console as CI, nohup
    or Slurm has it (stdout and stderr pipes, runtime.progress_bar's default, auto), and a
    datasets cache of its own, so that the sample's splits are generated in this run."""
    import subprocess
    import sys

    run_dir = tmp_path_factory.mktemp("run") / "run"
    datasets_cache = tmp_path_factory.mktemp("datasets_cache")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "runner",
            "train",
            *QUICK,
            "runtime.progress_bar=auto",
            "max_steps=24",
            "runtime.save_every_n_steps=8",
            "runtime.keep_last_n_checkpoints=2",
            "runtime.log_every_n_steps=1",
            f"hydra.run.dir={run_dir}",
        ],
        env={**hermetic_env, "HF_DATASETS_CACHE": str(datasets_cache)},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (run_dir / "stdout.txt").write_text(proc.stdout)
    (run_dir / "stderr.txt").write_text(proc.stderr)
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
    # Each step logs the learning rate it trained with: the warmup's, from 0 at the first step
    # (torchtune's schedule), not the next step's.
    lrs = {m["step"]: m["lr"] for m in RunDir(trained_run).read_metrics() if "lr" in m}
    peak, warmup = recipe.optimizer.lr, recipe.optimizer.warmup_steps
    assert [lrs[step] for step in (1, 2, 3)] == pytest.approx([0, peak / warmup, 2 * peak / warmup])
    # And its gradient norm before clipping (clip_grad_norm=1.0): a random init's is far above.
    norms = [m["grad_norm"] for m in RunDir(trained_run).read_metrics() if "loss" in m]
    assert len(norms) == 24 and norms[0] > recipe.clip_grad_norm and min(norms) > 0
    # The weights are as readable as the config beside them (safetensors 0.8 writes 0600), so a
    # server run as another user loads what it can see.
    checkpoint = trained_run / "checkpoints" / "step_24"
    mode = (checkpoint / "config.json").stat().st_mode
    assert (checkpoint / "model.safetensors").stat().st_mode == mode


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


def _console(run_dir: Path) -> str:
    return (run_dir / "stdout.txt").read_text() + (run_dir / "stderr.txt").read_text()


def test_console_without_a_terminal_gets_a_line_per_logged_step(trained_run: Path) -> None:
    console = _console(trained_run)
    assert "\r" not in console
    steps = [line for line in console.splitlines() if line.startswith("step ")]
    assert [line.split()[1] for line in steps] == [f"{n}/24" for n in range(1, 25)]
    # Its ETA is the final evaluation's and save's, at the mean of those before.
    pattern = r"step 24/24 loss \d+\.\d{4} lr \S+ tokens/s \d+ eta 0:00:\d\d"
    assert re.fullmatch(pattern, steps[-1]), steps[-1]
    # The same lines, timestamped, in train.log.
    assert steps[-1] in (trained_run / "train.log").read_text()


def test_console_holds_no_third_party_noise(trained_run: Path) -> None:
    console = _console(trained_run)
    for noise in (
        "Detected no triton",  # torchao, at import, on a machine without Triton
        "Generating train split",  # datasets' progress bars, reading the sample's files
        "original_max_position_embeddings",  # transformers on a llama3 config.json
    ):
        assert noise not in console, noise
    if importlib.util.find_spec("triton") is None:
        assert "Detected no triton" in (trained_run / "train.log").read_text()


@pytest.mark.parametrize("drop", [False, True])
def test_library_notices_are_demoted_or_dropped(drop: bool, caplog) -> None:
    """Training keeps them in train.log (INFO) off its console (WARNING and up); serving, whose
    console shows INFO and is its only log, drops them: bitsandbytes' "Failed to load CPU
    gemm_4bit_forward" read as an error on every healthy start of a LoRA deployment."""
    from runner.notices import NOTICES, keep_notices_off_the_console

    try:
        keep_notices_off_the_console(drop=drop)
        with caplog.at_level(logging.INFO):
            for name, start in NOTICES:
                logging.getLogger(name).warning("%s: a notice", start)
            logging.getLogger(NOTICES[0][0]).warning("another warning")
        kept = [(r.levelname, r.getMessage()) for r in caplog.records]
        notices = [] if drop else [("INFO", f"{start}: a notice") for _, start in NOTICES]
        assert kept == [*notices, ("WARNING", "another warning")]
    finally:
        keep_notices_off_the_console(drop=False)  # as this process's training imports left it


@pytest.mark.parametrize(
    ("setting", "terminal", "bar"),
    [("auto", True, True), ("auto", False, False), (True, False, True), (False, True, False)],
)
def test_progress_bar_auto_draws_a_bar_only_on_a_terminal(
    setting: bool | str, terminal: bool, bar: bool
) -> None:
    class Stream(io.StringIO):
        def isatty(self) -> bool:
            return terminal

    assert shows_bar(setting, Stream()) is bar


def test_progress_bar_takes_true_false_or_auto() -> None:
    with pytest.raises(UserError, match="runtime.progress_bar='yes': give true, false or auto"):
        resolve_runtime(compose_train(["runtime.progress_bar=yes"]).runtime)


def test_transformers_loads_the_checkpoint_with_equal_logits(trained_run: Path) -> None:
    checkpoint = trained_run / "checkpoints" / "step_24"
    recipe = OmegaConf.load(trained_run / "recipe.yaml")
    ours = instantiate(recipe.model.builder)
    ours.load_state_dict(read_model_state(checkpoint))
    with transformers_warnings() as warned:
        theirs = AutoModelForCausalLM.from_pretrained(checkpoint, use_safetensors=True)
    assert not warned, warned
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


def profiled_run(runner_cli, run_dir: Path, max_steps: int):
    """`runner train` of max_steps steps with profile.enabled=true (its default window, steps
    3-4), no evaluation; the CLI's result, once it succeeded."""
    result = runner_cli(
        "train",
        *QUICK,
        f"max_steps={max_steps}",
        "eval.strategy=no",
        "dataset.eval_samples=0",
        "profile.enabled=true",
        f"hydra.run.dir={run_dir}",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def test_profile_writes_the_steps_trace_ops_and_summary(runner_cli, tmp_path: Path) -> None:
    """profile.enabled=true: steps 3-4 profiled on the CPU, into the run's profile/ folder; the
    console names it and holds none of libkineto's own lines."""
    run_dir = tmp_path / "run"
    result = profiled_run(runner_cli, run_dir, max_steps=5)
    profile = run_dir / "profile"
    trace = json.loads((profile / "trace.json").read_text())
    assert any(event.get("name") == "aten::mm" for event in trace["traceEvents"])
    assert "aten::mm" in (profile / "ops.txt").read_text()
    summary = json.loads((profile / "summary.json").read_text())
    assert summary["device"] == "cpu" and summary["steps"] == 2
    assert summary["ms_per_step"]["matmul"] > 0 and summary["ms_per_step"]["optimizer"] > 0
    # Ops' self times sum to less than the steps' wall time (the host's Python between them).
    assert 0 < summary["busy_ms"] <= summary["wall_ms"]
    assert "profiled steps 3-4:" in (run_dir / "train.log").read_text()
    assert f"profile:       {profile}" in result.stdout
    assert "USDT" not in result.stdout + result.stderr


def test_a_profile_window_past_the_run_warns_and_writes_nothing(runner_cli, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    result = profiled_run(runner_cli, run_dir, max_steps=2)
    warning = "profile: steps 3-4 are outside this run's steps 1-2: nothing is profiled"
    assert warning in (run_dir / "train.log").read_text()
    assert not (run_dir / "profile").exists()
    assert "profile:  " not in result.stdout


def test_a_cuda_traces_kernels_fall_in_their_kinds() -> None:
    """Kernel names in the forms CUDA traces give them (cuBLAS's, flash and flex attention's,
    inductor's, PyTorch's own) and CPU ops, each in the kind that summary.json adds it to."""
    from runner.trainer.profiling import kind_of

    names = {
        "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64": "matmul",
        "nvjet_hsh_128x256_64x4_1x2_h_bz_coopA_NNN": "matmul",
        "aten::addmm": "matmul",
        "pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel": "attention",
        "triton_tem_fused_flex_attention_backward_0": "attention",
        "aten::_scaled_dot_product_flash_attention_for_cpu": "attention",
        "triton_per_fused__log_softmax_nll_loss_forward_0": "loss",
        "void at::native::multi_tensor_apply_kernel<FusedAdamMathFunctor>": "optimizer",
        "aten::_fused_adamw_": "optimizer",
        "Memcpy HtoD (Pinned -> Device)": "copy",
        "void at::native::elementwise_kernel<128, 4, direct_copy_kernel_cuda>": "copy",
        "triton_poi_fused_add_mul_rsqrt_silu_0": "other",
        "void at::native::vectorized_layer_norm_kernel<c10::BFloat16>": "other",
    }
    assert {name: kind_of(name) for name in names} == names


def test_the_throughput_and_the_eta_leave_evaluations_and_saves_out() -> None:
    """The step logged after an evaluation or a checkpoint read 10-100x below the others: its
    window held their time (tokens_per_s in metrics.jsonl, every tracker, the ETA)."""
    import time

    from runner.trainer.progress import Console, Throughput

    throughput = Throughput()
    throughput.add(1000)
    with throughput.paused():
        time.sleep(0.5)  # an evaluation
    # What is left is the few statements around the pause: well under a tenth of it.
    assert throughput.read() > 1000 / 0.05
    # The ETA's mean step likewise (it read 4-5 s here: the evaluation's 0.5 s times 9 steps).
    console = Console(step=0, total_steps=10, bar=False)
    with console.paused():
        time.sleep(0.5)
    assert console.eta(1) == "0:00:00+"  # "+": the final save, not timed yet


def test_a_checkpoint_is_priced_before_one_is_written(trained_run: Path) -> None:
    """The warning before the first step prices a checkpoint by the model's weights and the
    optimizer's state (AdamW: 2 moments a weight): within 2% of the one the run wrote, whose
    config and tokenizer files it leaves out."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from runner.rundir.io import tree_size
    from runner.trainer.checkpointing import expected_size

    checkpoint = trained_run / "checkpoints" / "step_24"
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(checkpoint))
    assert 0.98 < expected_size(model, moments=2, whole_model=True) / tree_size(checkpoint) <= 1.0
    # A bf16 run writes the same fp32 weights, and its moments in bf16: priced by the weights'
    # dtype, its checkpoint read as 3/4 of that.
    weights = tree_size(checkpoint / "model.safetensors")
    moments = tree_size(checkpoint / "training_state.pt") / 2
    bf16 = expected_size(model.to(torch.bfloat16), moments=2, whole_model=True)
    assert 0.98 < bf16 / (weights + moments) <= 1.01


def test_a_lora_checkpoint_is_priced_by_its_adapters(runner_cli, tmp_path: Path) -> None:
    """A LoRA run's checkpoints hold its adapters (and their optimizer state), not its base: the
    warning before its first step priced one as the whole base, 20x the 0.2 MiB of the tiny
    model's, and warned of a disk that held them all."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from runner.rundir.io import tree_size
    from runner.trainer.checkpointing import expected_size

    run = tmp_path / "run"
    args = [*QUICK, "method=lora", "max_steps=1", "eval.strategy=no", f"hydra.run.dir={run}"]
    result = runner_cli("train", *args)
    assert result.returncode == 0, result.stderr[-3000:]
    checkpoint = run / "checkpoints" / "step_1"
    base = AutoModelForCausalLM.from_pretrained(run / "base_model")
    model = PeftModel.from_pretrained(base, checkpoint, is_trainable=True)
    size = expected_size(model, moments=2, whole_model=False)
    # The tokenizer and config files and the random states, 17% of a checkpoint this small,
    # are left out.
    assert 0.8 < size / tree_size(checkpoint) <= 1.0


def test_the_eta_counts_the_evaluations_and_saves_still_to_come() -> None:
    """The ETA left evaluations and saves out: "eta 0:00:00" at the last step, then the final
    evaluation and save took 20-40 s more. The breaks still to come count at their mean."""
    import time

    from runner.trainer.progress import Console, breaks_after

    # Every 4 steps (eval.steps) and every 6 (save_every_n_steps) of 14, and the last.
    assert breaks_after(0, 14, [4, 6]) == len([4, 6, 8, 12, 14])
    assert breaks_after(12, 14, [4, 6]) == 1 and breaks_after(14, 14, [4, 6]) == 0
    assert breaks_after(0, 12, [4, 6]) == len([4, 6, 8, 12])  # the last is one of them
    assert breaks_after(0, 10, [0, 0]) == 1  # no evaluation, no cadence: the final save

    console = Console(step=0, total_steps=10, bar=False, breaks_every=[5])
    assert console.eta(5) == "0:00:00+"  # no break taken yet: nothing to price them by
    with console.paused():  # step 5's evaluation and save
        time.sleep(1.2)
    assert console.eta(6) == "0:00:01"  # step 10's to come
    assert console.eta(10) == "0:00:01"  # logged before its own break


def test_the_eta_is_marked_at_least_until_an_evaluation_or_save_is_timed() -> None:
    """A short run's last step line read "eta 0:00:00", then its final evaluation and save
    took seconds more: with none timed yet they counted as nothing. The figure is the steps'
    alone until one is timed, marked "+" (at least that long)."""
    import re

    from runner.trainer.progress import Console

    figure = r"\d+:\d\d:\d\d"
    # max_steps=2, eval.strategy=no, no save cadence: the final save alone, after step 2.
    console = Console(step=0, total_steps=2, bar=False, breaks_every=[0, 0])
    assert re.fullmatch(figure + r"\+", console.eta(1)), console.eta(1)
    assert re.fullmatch(figure + r"\+", console.eta(2)), console.eta(2)
    # An evaluation every 5 steps of 10: timed once step 5's is taken.
    console = Console(step=0, total_steps=10, bar=False, breaks_every=[0, 5])
    assert re.fullmatch(figure + r"\+", console.eta(5)), console.eta(5)
    with console.paused():  # step 5's evaluation
        pass
    assert re.fullmatch(figure, console.eta(6)), console.eta(6)
    assert re.fullmatch(figure, console.eta(10)), console.eta(10)


def read_only_mounts() -> bool:
    """Whether this user may bind-mount a directory read-only in a mount namespace of its own
    (root, or unprivileged user namespaces): a read-only disk, where chmod binds no root."""
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "--mount", "--map-root-user", "true"], capture_output=True)
    return probe.returncode == 0


@pytest.mark.skipif(not read_only_mounts(), reason="no mount namespace for a read-only disk")
def test_a_run_on_a_read_only_disk_is_one_message_to_export_and_resume(
    trained_run: Path, tmp_path: Path, hermetic_env: dict[str, str]
) -> None:
    """A colleague's run or a mounted checkpoint volume: RUN/exports/ could not be made, and the
    export ended in Hydra's traceback; a resume named runtime.output_root, which it never read."""
    shared = tmp_path / "shared"
    run = shared / "run"
    shutil.copytree(trained_run, run)
    runner = f"{sys.executable} -m runner"
    for command, said in [
        (f"export checkpoint={run} format=merged", f"out='{run}/exports/step_24-merged-fp32': "),
        (f"train resume={run}", f"resume='{run}': cannot write in the run directory"),
    ]:
        read_only = f"mount --bind {shared} {shared} && mount -o remount,bind,ro {shared}"
        result = subprocess.run(
            [
                "unshare",
                "--mount",
                "--map-root-user",
                "sh",
                "-c",
                f"{read_only} && {runner} {command}",
            ],
            env=hermetic_env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
        (line,) = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
        assert line.startswith(f"error: {said}"), line


@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("unshare") is None,
    reason="mounts a tiny /dev/shm in a mount namespace of its own: needs root and unshare",
)
def test_a_shared_memory_without_room_for_the_loaders_workers_is_one_line(
    hermetic_env, tmp_path: Path
) -> None:
    """A container's /dev/shm (Docker's is 64 MB) full: `dataset.num_workers=2` failed the run
    with a bare `OSError: [Errno 28] No space left on device`, naming neither."""
    run_dir = tmp_path / "run"
    train = shlex.join(
        [sys.executable, "-m", "runner", "train", *QUICK, "max_steps=2", "eval.strategy=no"]
        + ["dataset.num_workers=2", f"hydra.run.dir={run_dir}"]
    )
    fill = "dd if=/dev/zero of=/dev/shm/fill bs=1k count=1100 2>/dev/null"
    result = subprocess.run(
        ["unshare", "-m", "sh", "-c", f"mount -t tmpfs -o size=1m tmpfs /dev/shm; {fill}; {train}"],
        env=hermetic_env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert result.stderr.endswith(
        "give dataset.num_workers=0, or more shared memory (a container's --shm-size)\n"
    ), result.stderr[-3000:]
    assert "error: dataset.num_workers=2: its workers pass batches through /dev/shm" in (
        result.stderr
    )
