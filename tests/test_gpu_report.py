"""scripts/gpu/gpu_report.py's CPU side: the refusal without CUDA, its arguments, the budgets, the
table built from sample stage outputs, the MFU arithmetic, and the bare torchtune loop for two
steps of the tiny model on the CPU (the GPU runs it at 1B)."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
# The report and its helpers, and the serving benchmarks it runs.
sys.path[:0] = [str(SCRIPTS / "gpu"), str(SCRIPTS / "serving")]
import gpu_bare  # noqa: E402
import gpu_logs  # noqa: E402
import gpu_report  # noqa: E402
import gpu_table  # noqa: E402

# Sample measurements of bench_deploy.py: side, concurrency, tokens/s, latencies (s).
DEPLOY_ROWS = [
    ("transformers generate", 1, 41, [1.56, 1.56, 1.65]),
    ("runner deploy", 1, 55, [1.15, 1.19, 1.23]),
    ("transformers generate", 8, 290, [1.70, 1.75, 1.80]),
    ("runner deploy", 8, 410, [1.24, 1.30, 1.39]),
    ("runner deploy transformers.max_waiting_steps=0", 1, 54, [1.16, 1.20, 1.24]),
    ("runner deploy transformers.max_waiting_steps=0", 8, 470, [1.10, 1.14, 1.20]),
]


def deploy_log() -> str:
    """What bench_deploy.py prints for DEPLOY_ROWS: its own report(), so that a change of its
    table's shape fails here, not on the GPU."""
    import bench_deploy

    runs: dict[str, dict[int, list]] = {}
    for label, concurrency, rate, latencies in DEPLOY_ROWS:
        busy = 0.9 if label.startswith("runner") else None  # a client past BUSY_CLIENT
        result = bench_deploy.Result(label, concurrency, latencies, rate * 10, 10.0, busy)
        runs.setdefault(label, {})[concurrency] = [result]
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        bench_deploy.report(runs, None)
    return "  runner deploy, concurrency 1: 55 tokens/s\n" + printed.getvalue()


def test_bench_deploy_spreads_its_clients_over_a_quarter_of_the_cores(monkeypatch) -> None:
    import bench_deploy

    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    wanted = [bench_deploy.client_processes(None, c) for c in (1, 8, 32, 33, 128, 512)]
    assert wanted == [1, 1, 1, 2, 4, 4]
    monkeypatch.setattr(os, "cpu_count", lambda: 2)  # the cores serve: one client process
    assert bench_deploy.client_processes(None, 128) == 1
    assert bench_deploy.client_processes(3, 2) == 2  # never more processes than clients
    assert "the client may bound the figure" in deploy_log()


PYTEST_LOG = """\
........s.......
=========================== short test summary info ============================
SKIPPED [1] tests/test_gpu.py:150: no second GPU
15 passed, 1 skipped in 212.40s (0:03:32)
"""


def test_refuses_without_cuda_in_one_line(tmp_path: Path) -> None:
    out = tmp_path / "report"
    result = subprocess.run(
        [sys.executable, str(SCRIPTS / "gpu" / "gpu_report.py"), "--out", str(out)],
        env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr.splitlines() == [
        "gpu_report: no CUDA GPU visible (torch.cuda.is_available() is False); it measures the "
        "GPU, so run it on a machine with one"
    ]
    assert not out.exists()  # nothing half-written


def test_defaults_run_every_stage_in_budget_order() -> None:
    args = gpu_report.arguments([])
    assert args.stages == list(gpu_report.SHARES)
    assert (args.budget_min, args.concurrency, args.warmup, args.steps) == (
        11.0,
        "1,8,32,128",
        5,
        20,
    )
    only_deploy = gpu_report.arguments(["--only", "deploy", "--checkpoint", "c"])
    assert only_deploy.stages == ["deploy", "profile decode", "profile engine"]
    assert gpu_report.arguments(["--only", "pytest,train"]).stages == [
        "train runner eager",
        "train bare eager",
        "train runner compiled",
        "train bare compiled",
        "train runner eager varlen",
        "pytest -m gpu",
    ]


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--only", "train,bench"], "--only 'train,bench'"),
        (["--concurrency", "1,0"], "--concurrency '1,0'"),
        (["--concurrency", "8,"], "--concurrency '8,'"),
        (["--steps", "0"], "--steps 0"),
        (["--budget-min", "-1"], "--budget-min -1.0"),
        (["--requests", "0"], "--requests 0"),
        (["--warmup", "two"], "--warmup"),
        (["--only", "deploy"], "give --checkpoint DIR"),
    ],
)
def test_bad_arguments_exit_2_naming_the_flag(argv: list[str], named: str, capsys) -> None:
    with pytest.raises(SystemExit) as exit:
        gpu_report.arguments(argv)
    assert exit.value.code == 2
    assert named in capsys.readouterr().err


def test_budgets_split_the_total_and_pass_unused_time_on() -> None:
    names = ["train runner eager", "deploy", "pytest -m gpu"]
    ends = gpu_report.budgets(names, 1500)
    shares = [gpu_report.SHARES[name] for name in names]
    whole = sum(shares)
    first, second = shares[0] / whole, (shares[0] + shares[1]) / whole
    assert ends == pytest.approx([1500 * first, 1500 * second, 1500])
    assert gpu_report.budgets(list(gpu_report.SHARES), 1500)[-1] == pytest.approx(1500)


def test_a_stage_past_its_budget_is_killed_and_reported(tmp_path: Path) -> None:
    command = [sys.executable, "-c", "import time; print('started', flush=True); time.sleep(60)"]
    stage = gpu_report.run_stage("deploy", command, tmp_path / "deploy.log", budget_s=2)
    assert stage.status == "overran its 2 s"
    assert stage.seconds < 30
    assert "started" in stage.log.read_text()
    failed = gpu_report.run_stage("x", [sys.executable, "-c", "exit(3)"], tmp_path / "x.log", 60)
    assert failed.status == "failed (exit 3)"


def test_a_runner_arm_writing_its_final_checkpoint_gets_the_grace(tmp_path: Path) -> None:
    """Past its share, an arm whose run says `checkpointing` (its timed steps done) may finish
    the write; one still training is killed at its share as before."""
    run = tmp_path / "run"
    run.mkdir()

    def arm(state: str) -> list[str]:
        status = json.dumps({"state": state})
        write = f"open({str(run / 'status.json')!r}, 'w').write({status!r})"
        return [sys.executable, "-c", f"import time; {write}; time.sleep(4)"]

    saving = gpu_report.run_stage("train runner eager", arm("checkpointing"), run / "a.log", 1, run)
    assert (saving.status, saving.seconds > 3) == ("ok", True)
    training = gpu_report.run_stage("train runner eager", arm("running"), run / "b.log", 1, run)
    assert training.status == "overran its 1 s" and training.seconds < 3


PYTEST_FILE = """\
import time, pytest

def test_passes():
    pass

@pytest.mark.parametrize("n", [1, 2])
def test_fails(n):
    assert n == 1

def test_skips():
    pytest.skip("no second GPU")

@pytest.mark.timeout(1)
def test_hangs():
    time.sleep(30)
"""


@pytest.mark.parametrize("workers", [[], ["-n", "2", "--dist", "loadgroup"]], ids=["one", "xdist"])
def test_each_gpu_test_by_name_outcome_and_seconds(tmp_path: Path, workers: list[str]) -> None:
    """pytest run as the report runs it (its options, a real run, with and without xdist's
    workers): every test named with its outcome and seconds, a hung one failed by its timeout
    (pytest-timeout) by name, in the table."""
    tests = tmp_path / "test_sample.py"
    tests.write_text(PYTEST_FILE)
    command = gpu_report.commands(gpu_report.arguments([]), tmp_path)["pytest -m gpu"]
    options = command[command.index("pytest") + 1 : command.index("-m", 3)]
    assert "-v" in options and "--durations=0" in options
    # Every file with tests marked gpu (the kernel checks beside test_gpu.py's runs), no other.
    files = [Path(arg).name for arg in command if arg.endswith(".py")]
    assert "test_gpu.py" in files and "test_varlen_attention.py" in files
    assert "test_resume.py" not in files
    result = subprocess.run(
        [sys.executable, "-m", "pytest", *options, *workers, "-p", "no:cacheprovider", str(tests)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    found = {name: (outcome, took) for name, outcome, took in gpu_logs.pytest_tests(result.stdout)}
    assert {name: outcome for name, (outcome, _) in found.items()} == {
        "test_passes": "passed",
        "test_fails[1]": "passed",
        "test_fails[2]": "failed",
        "test_skips": "skipped",
        "test_hangs": "failed",
    }, result.stdout
    assert 1 <= found["test_hangs"][1] < 10  # stopped by its 1 s timeout, not the 30 s sleep
    log = tmp_path / "pytest.log"
    log.write_text(result.stdout)
    stage = gpu_table.Stage("pytest -m gpu", "failed (exit 1)", 12, log)
    rows = gpu_table.table([stage], tmp_path, 10, 1, None).splitlines()
    assert rows[1].endswith("2 failed, 2 passed, 1 skipped in " + rows[1].split(" in ")[-1])
    assert any(re.fullmatch(r"  test_hangs +failed, \d+\.\d s", row) for row in rows), rows


def test_mfu_and_the_known_gpus() -> None:
    # 6 FLOPs x 1e9 parameters x 1e4 tokens/s over a peak of 1e14 FLOP/s.
    assert gpu_table.mfu(10**9, 1e4, 1e14) == pytest.approx(0.6, rel=1e-12)
    names = {
        "NVIDIA H100 80GB HBM3": "H100 SXM",
        "NVIDIA H100 PCIe": "H100 PCIe",
        "NVIDIA H100 NVL": "H100 NVL",
        "NVIDIA H200": "H200",
        "NVIDIA GH200 480GB": "GH200",
        "NVIDIA A100-SXM4-80GB": "A100",
        "NVIDIA L40S": "L40S",
        "NVIDIA L40": "L40",
        "NVIDIA L4": "L4",
    }
    for name, label in names.items():
        found = gpu_table.peak_bf16(name)
        assert found is not None and found[0] == label, name
    assert gpu_table.peak_bf16("NVIDIA H100 80GB HBM3") == ("H100 SXM", 989e12)
    assert gpu_table.peak_bf16("Tesla T4") is None


def test_the_1b_parameter_count() -> None:
    # Llama 3.2 1B: 1.24B parameters with its output tied to the embeddings.
    assert gpu_table.param_count(gpu_bare.builder_dims("llama3_2_1b")) == 1_235_814_400


def sample_outputs(out: Path) -> list[gpu_table.Stage]:
    """Logs as each stage leaves them: runner's metrics.jsonl, the bare loop's JSON line,
    bench_deploy's table, pytest's summary; one arm overran."""
    # Logged every 10 steps: step 10 ends the warm-up; 3 windows of 10 steps after it.
    for name, rates in {
        "train_runner_eager": {10: 900.0, 20: 12000.0, 30: 10000.0, 40: 15000.0},
        "train_runner_eager_varlen": {10: 900.0, 20: 13750.0, 30: 13750.0, 40: 13750.0},
    }.items():
        run = out / name
        run.mkdir(parents=True)
        run.joinpath("metrics.jsonl").write_text(
            "".join(
                json.dumps({"step": s, "loss": 11.9, "tokens_per_s": r}) + "\n"
                for s, r in rates.items()
            )
        )
        # As recipes/finetune.py logs it on CUDA at the last step.
        run.joinpath("train.log").write_text(
            "[2026-11-27 21:00:00,000][runner.recipe][INFO] - peak device memory: 9.87 GiB "
            "(torch.cuda.max_memory_allocated)\n"
        )
    bare = {
        "arm": "bare",
        "params": 1,
        "tokens_per_s": 12500.0,
        "window_tokens_per_s": [12000.0, 13000.0],
        "peak_gib": 10.5,
        "graph_breaks": 0,
    }
    logs = {
        "train_bare_eager.log": "compiling...\n" + json.dumps(bare) + "\n",
        "train_bare_compiled.log": json.dumps(bare | {"graph_breaks": 2}) + "\n",
        "train_runner_compiled.log": "step 10/40 ...\n",
        "train_runner_eager_varlen.log": "",
        "deploy.log": deploy_log(),
        "pytest_m_gpu.log": PYTEST_LOG,
    }
    for name, text in logs.items():
        out.joinpath(name).write_text(text)
    return [
        gpu_table.Stage("train runner eager", "ok", 95, out / "train_runner_eager.log"),
        gpu_table.Stage("train bare eager", "ok", 60, out / "train_bare_eager.log"),
        gpu_table.Stage("train bare compiled", "ok", 70, out / "train_bare_compiled.log"),
        gpu_table.Stage(
            "train runner compiled", "overran its 180 s", 180, out / "train_runner_compiled.log"
        ),
        gpu_table.Stage(
            "train runner eager varlen", "ok", 50, out / "train_runner_eager_varlen.log"
        ),
        gpu_table.Stage("deploy", "ok", 400, out / "deploy.log"),
        gpu_table.Stage("pytest -m gpu", "failed (exit 1)", 215, out / "pytest_m_gpu.log"),
    ]


def test_the_table_from_sample_stage_outputs(tmp_path: Path) -> None:
    params, peak = 1_235_814_400, 989e12
    text = gpu_table.table(sample_outputs(tmp_path), tmp_path, 10, params, peak)
    rows = {line[:28].strip(): line for line in text.splitlines()}
    # 30 steps in 10/12000 + 10/10000 + 10/15000 s of each step's tokens: 12,000 tokens/s.
    runner = rows["train runner eager"].split()
    assert runner[3:7] == ["ok", "95", "12,000", f"{6 * params * 12000 / peak:.1%}"]
    # Peak memory beside tokens/s; graph breaks for the compiled arms.
    assert rows["train runner eager"].endswith("windows 10,000-15,000, peak 9.87 GiB")
    assert rows["train bare eager"].endswith("windows 12,000-13,000, peak 10.50 GiB")
    assert rows["train bare compiled"].endswith("peak 10.50 GiB, 2 graph breaks")
    assert rows["train bare eager"].split()[3:7] == [
        "ok",
        "60",
        "12,500",
        f"{6 * params * 12500 / peak:.1%}",
    ]
    compiled = rows["train runner compiled"]
    # An overrun says where it stopped: its log's last line.
    assert "overran its 180 s" in compiled
    assert compiled.endswith("no timed window in its log: step 10/40 ...")
    generate = rows["hf generate c=1"].split()[3:]
    # The median latency and its 99th percentile (statistics.quantiles, inclusive) of 3 samples.
    assert generate == ["41", "p50", "1,560", "ms,", "p99", "1,648", "ms"]
    assert rows["runner deploy c=8"].split()[3] == "410"
    # A --variant server's rows, under their own label (longer than the others).
    variant = [line for line in text.splitlines() if "max_waiting_steps=0 c=8" in line]
    assert [line.split()[4] for line in variant] == ["470"]
    assert rows["pytest -m gpu"].endswith("15 passed, 1 skipped in 212.40s (0:03:32)")
    # Each runner arm beside the bare loop of its mode; the compiled arm gave no figure.
    assert text.splitlines()[-2:] == ["ours/bare eager: 0.96", "ours/bare eager varlen: 1.10"]


def test_a_failed_deploy_says_why_in_the_table(tmp_path: Path) -> None:
    # As the first GPU run's deploy failed: the client's exception is its log's last line.
    log = tmp_path / "deploy.log"
    error = "openai.InternalServerError: Error code: 500 - generation failed: INTERNAL ASSERT"
    log.write_text(f"checkpoint ...\nTraceback (most recent call last):\n  File x\n{error}\n\n")
    stage = gpu_table.Stage("deploy", "failed (exit 1)", 52, log)
    text = gpu_table.table([stage], tmp_path, 10, 1, None)
    assert text.splitlines()[1].endswith(f"no table in its log: {error}")


def test_a_deploy_stopped_before_its_table_gives_the_repeats_that_landed(tmp_path: Path) -> None:
    # As the H200 run's deploy overran its share in its second repeat: its progress lines only.
    log = tmp_path / "deploy.log"
    log.write_text(
        "checkpoint ... median of 3 repeats\n"
        "  transformers generate, concurrency 1: 39 tokens/s\n"
        "  runner deploy, concurrency 1: 250 tokens/s (busiest client process 0% busy; ...)\n"
        "  engine alone, concurrency 1: 200 tokens/s\n"
        "  runner deploy, concurrency 1: 270 tokens/s (busiest client process 0% busy; ...)\n"
        "  runner deploy, concurrency 1: 200 tokens/s (busiest client process 0% busy; ...)\n"
        "  runner deploy x=1, concurrency 128: 11167 tokens/s\n"
    )
    stage = gpu_table.Stage("deploy", "overran its 192 s", 193, log)
    lines = gpu_table.table([stage], tmp_path, 10, 1, None).splitlines()
    assert lines[1].split() == ["deploy", "overran", "its", "192", "s", "193"]  # no "why"
    rows = {line[:55].strip(): line[55:].split(None, 1) for line in lines[2:]}
    assert rows["hf generate c=1"] == [
        "39",
        "stopped before its table: median of the 1 repeat(s) that landed",
    ]
    runner = rows["runner deploy c=1"]
    assert runner[0] == "250" and runner[1].endswith(
        "of the 3 repeat(s) that landed, http/engine 1.25"
    )
    assert rows["runner deploy x=1 c=128"][0] == "11,167"  # no engine alone there: no ratio


def test_an_unknown_gpu_leaves_mfu_blank_and_says_so(tmp_path: Path) -> None:
    args = gpu_report.arguments([])
    assert "MFU left blank: this GPU is not in" in gpu_report.heading(args, "Tesla T4", 1)
    text = gpu_table.table(sample_outputs(tmp_path), tmp_path, 10, 1_235_814_400, None)
    assert "%" not in text


def test_the_bare_torchtune_loop_trains_the_tiny_model_on_the_cpu(tmp_path: Path) -> None:
    profile = tmp_path / "train_bare_eager" / "profile"
    args = argparse.Namespace(
        model="tiny",
        device="cpu",
        dtype="fp32",
        compile=False,
        batch_size=2,
        seq_len=16,
        warmup=1,
        steps=2,
        profile_out=profile,
    )
    result = gpu_bare.train(args)
    # Its one warm-up step profiled, as runner.trainer.profiling profiles a run's.
    summary = json.loads((profile / "summary.json").read_text())
    assert summary["steps"] == 1 and summary["ms_per_step"]["matmul"] > 0
    assert result["params"] == gpu_table.param_count(gpu_bare.builder_dims("tiny"))
    assert len(result["window_tokens_per_s"]) == 2  # two windows of one step after the warm-up
    assert result["tokens_per_s"] == pytest.approx(
        gpu_bare.overall_rate([1, 1], result["window_tokens_per_s"]), rel=1e-12
    )
    assert gpu_bare.windows(10, 25) == [10, 10, 5]
    # 25 steps in 10/100 + 10/50 + 5/25 s: 50 steps per second.
    assert gpu_bare.overall_rate([10, 10, 5], [100.0, 50.0, 25.0]) == pytest.approx(50.0, rel=1e-12)


def test_deploy_serves_the_runner_arms_checkpoint(tmp_path: Path) -> None:
    lines = gpu_report.commands(gpu_report.arguments([]), tmp_path)
    runner = lines["train runner eager"]
    for override in ["compute=gpu", "dtype=bf16", "compile=false", "max_steps=25"]:
        assert override in runner
    assert "runtime.log_every_n_steps=5" in runner  # a window per warm-up's worth of steps
    assert f"hydra.run.dir={tmp_path / 'train_runner_eager'}" in runner
    assert "compile=true" in lines["train runner compiled"]
    # The varlen arm: the eager arm's command, attending through FlashAttention's varlen kernel.
    varlen = lines["train runner eager varlen"]
    assert varlen[-1] == "attention=varlen" and "compile=false" in varlen
    assert f"hydra.run.dir={tmp_path / 'train_runner_eager_varlen'}" in varlen
    assert "--compile" in lines["train bare compiled"]
    # The last two warm-up steps profiled in every arm, runner's and the bare loop's alike.
    assert ["profile.enabled=true", "profile.start_step=4", "profile.steps=2"] == [
        o for o in runner if o.startswith("profile.")
    ]
    bare = lines["train bare eager"]
    assert bare[bare.index("--profile-out") + 1] == str(tmp_path / "train_bare_eager" / "profile")
    deploy = " ".join(lines["deploy"])
    checkpoint = tmp_path / "train_runner_eager" / "checkpoints" / "step_25"
    assert (
        f"--checkpoint {checkpoint} --device cuda --dtype bf16 --concurrency 1,8,32,128" in deploy
    )
    assert "--client http" in deploy  # aiohttp's clients, installed with the test extra
    # The decode step is profiled on the same checkpoint, alone and at the largest concurrency.
    profile = " ".join(lines["profile decode"])
    assert f"--checkpoint {checkpoint} --device cuda --dtype bf16 --rows 1,128" in profile
    # So is the engine, at the largest concurrency, one wave a repeat as deploy sends there.
    engine = " ".join(lines["profile engine"])
    assert f"--checkpoint {checkpoint} --device cuda --dtype bf16 --concurrency 128 --waves 1" in (
        engine
    )


def test_the_decode_profile_rows_in_the_table(tmp_path: Path) -> None:
    # profile_decode.py run on the CPU (the tiny model, two batch sizes, a few steps): its
    # lines are what the table reads.
    script = SCRIPTS / "serving" / "profile_decode.py"
    command = [sys.executable, str(script), "--device", "cpu", "--rows", "1,4", "--steps", "3"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    log = tmp_path / "profile_decode.log"
    # With --compile, a compiled line follows (as gpu_report runs it; not compiled here, for time).
    compiled = "rows 1 compiled: 0.40 ms a step, 2,500 tokens/s (window 130 -> 150 columns)\n"
    log.write_text(result.stdout + compiled)
    found = gpu_logs.profile_rows(result.stdout)
    assert [(rows, compiled) for rows, _, _, compiled in found] == [(1, False), (4, False)]
    assert all(ms > 0 and rate > 0 for _, ms, rate, _ in found)
    assert "aten::mm" in result.stdout  # the profiler's table of ops
    stage = gpu_table.Stage("profile decode", "ok", 20, log)
    text = gpu_table.table([stage], tmp_path, 10, 1, None).splitlines()
    assert text[2].startswith("  decode step, 1 rows") and text[3].startswith("  decode step, 4")
    assert text[4].startswith("  decode step, 1 rows compiled") and "2,500" in text[4]


def test_the_engine_profile_in_the_table(tmp_path: Path) -> None:
    # profile_engine.py run on the CPU (the tiny model, 4 clients, 2 short repeats): its lines
    # are what the table reads, and the clients come from its command line (the log's first).
    script = SCRIPTS / "serving" / "profile_engine.py"
    command = [sys.executable, str(script), "--device", "cpu", "--concurrency", "4"]
    command += ["--waves", "2", "--max-tokens", "4", "--repeats", "2"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    rates = gpu_logs.engine_rates(result.stdout)
    assert len(rates) == 2 and all(rate > 0 for rate in rates)
    assert "decode steps by rows:" in result.stdout
    for part in ("prefill", "prefill forward", "join", "decode", "publish"):
        assert re.search(rf"^  {part} +\d+ calls", result.stdout, re.MULTILINE), part
    log = tmp_path / "profile_engine.log"
    log.write_text(" ".join(command) + "\n" + result.stdout)
    stage = gpu_table.Stage("profile engine", "ok", 20, log)
    text = gpu_table.table([stage], tmp_path, 10, 1, None).splitlines()
    assert text[2].startswith("  engine by part, no HTTP, c=4")
    assert f"median of 2, {min(rates):,.0f}-{max(rates):,.0f}" in text[2]


def test_engine_calls_counts_the_engines_python_calls_in_each_tree(tmp_path: Path) -> None:
    # engine_calls.py patches the engine's loop to profile it: as the loop's arguments change,
    # it must still run (it once waited forever on an engine whose thread had failed), for
    # this tree and for another given with --source (here this tree's package again, linked
    # from another directory).
    import bench_deploy

    checkpoint = bench_deploy.make_tiny_checkpoint(tmp_path / "tiny")
    other = tmp_path / "other"
    other.mkdir()
    (other / "runner").symlink_to(SCRIPTS.parent / "runner")
    script = SCRIPTS / "serving" / "engine_calls.py"
    command = [sys.executable, str(script), "--checkpoint", str(checkpoint), "--prompts", "2"]
    command += ["--repeats", "1", "--source", str(other)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = re.findall(r"^(this tree|\S+) +(\d+) +(\d+) +[\d.]+", result.stdout, re.MULTILINE)
    assert [row[0] for row in rows] == ["this tree", str(other.resolve())], result.stdout
    assert all(int(tokens) > 0 and int(calls) > 0 for _, tokens, calls in rows), rows


@pytest.mark.long  # compiles
def test_runner_rate_reads_a_real_runs_windows(runner_cli, tmp_path: Path) -> None:
    """The compiled training arm's own overrides on the CPU (the tiny model, fp32): its
    metrics.jsonl gives one window per 2 warm-up-sized steps after the warm-up, the last one
    shorter, and its train.log its graph breaks."""
    argv = ["--batch-size", "2", "--seq-len", "64", "--warmup", "2", "--steps", "3"]
    args, text, run = gpu_report.arguments(argv), tmp_path / "text.txt", tmp_path / "run"
    gpu_report.write_text(text, 8)
    overrides = gpu_report.train_overrides(args, text, True, run, where=("tiny", "cpu", "fp32"))
    result = runner_cli("train", *overrides)
    assert result.returncode == 0, result.stderr[-3000:]
    # The compiled arm's graph breaks, as its table row gives them (no peak memory on the CPU).
    assert gpu_logs.runner_totals((run / "train.log").read_text()) == {"graph_breaks": 0}
    rate, per_window = gpu_logs.runner_rate((run / "metrics.jsonl").read_text(), 2)
    assert len(per_window) == 2  # steps 3-4 and step 5
    assert rate == pytest.approx(gpu_bare.overall_rate([2, 1], per_window), rel=1e-12)
    # Its two warm-up steps profiled (outside the windows), read beside the bare loop's.
    assert "profiled steps 1-2:" in (run / "train.log").read_text()
    arm = tmp_path / "train_runner_compiled"
    arm.mkdir()
    (arm / "profile").symlink_to(run / "profile")
    lines = gpu_table.profile_table(["train runner compiled", "train bare compiled"], tmp_path)
    assert lines[0] == "profile, ms a step (2 warm-up steps; by kind, ops' self time on the CPU):"
    assert lines[1].split() == ["kind", "runner", "compiled"]
    kinds = [line.split()[0] for line in lines[2:]]
    assert kinds == ["attention", "matmul", "loss", "optimizer", "copy", "other", "busy", "wall"]
    # A longer arm's name widens every column and stays apart from its neighbour's.
    varlen = tmp_path / "train_runner_eager_varlen"
    varlen.mkdir()
    (varlen / "profile").symlink_to(run / "profile")
    arms = ["train runner compiled", "train runner eager varlen"]
    lines = gpu_table.profile_table(arms, tmp_path)
    assert lines[1].split() == ["kind", "runner", "compiled", "runner", "eager", "varlen"]
    assert len({len(line) for line in lines[1:]}) == 1  # the values under their names


def test_bench_deploy_prints_http_over_the_engine_alone_and_marks_noisy_rows() -> None:
    import bench_deploy

    def results(label: str, concurrency: int, rates: list[float]) -> list:
        return [bench_deploy.Result(label, concurrency, [1.0], r * 10, 10.0) for r in rates]

    runs = {
        "transformers generate": {1: results("transformers generate", 1, [50, 51, 52])},
        "runner deploy": {1: results("runner deploy", 1, [80, 90, 100])},  # range 20/90: noisy
        "runner deploy x=1": {1: results("runner deploy x=1", 1, [99, 100, 101])},
        bench_deploy.ENGINE_ALONE: {1: results(bench_deploy.ENGINE_ALONE, 1, [99, 100, 101])},
    }
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        bench_deploy.report(runs, None)
        bench_deploy.ratio_lines(runs)
    lines = printed.getvalue().splitlines()
    assert "http/engine c=1 0.900" in lines
    assert "http/engine c=1 1.000 (runner deploy x=1, over the default engine)" in lines
    noisy = [line.split()[0:2] for line in lines if line.endswith(" noisy")]
    assert noisy == [["runner", "deploy"]], lines
