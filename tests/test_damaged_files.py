"""Damaged input files: a data file with no records, a line that is not JSON or not UTF-8,
weights cut short. Each is one error naming the file and where in it (exit 2 through the CLI, no
traceback, nothing written); resume passes over a damaged newest checkpoint to the one before."""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from runner.data import DataError, check_datasets
from runner.data.files import LineError
from runner.errors import UserError
from runner.paths import SAMPLE_DATA_DIR
from runner.rundir import check_safetensors, checkpoint_problem
from tests.conftest import QUICK, files_limited_to, losses
from tests.fixtures import write_tiny_checkpoint
from tests.test_data import data, tokenizer


def sample_lines(count: int) -> list[str]:
    return (SAMPLE_DATA_DIR / "train.jsonl").read_text().splitlines()[:count]


def cut_short(path: Path) -> None:
    """What a full disk or a killed copy leaves: the file's first half."""
    os.truncate(path, path.stat().st_size // 2)


def one_error(result) -> str:
    """The CLI's one error line, after checking that it failed as a user error should."""
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, result.stderr[-3000:]
    return errors[0]


# ---- data files -----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "name,content",
    [
        ("d.jsonl", ""),
        ("d.jsonl", "\n\n"),
        ("d.json", "[]"),
        ("d.csv", "instruction,input,output\n"),
        ("d.txt", ""),
    ],
    ids=["empty-jsonl", "blank-jsonl", "empty-json-list", "csv-header-only", "empty-txt"],
)
def test_a_data_file_without_records_is_named(tmp_path: Path, name: str, content: str) -> None:
    path = tmp_path / name
    path.write_text(content)
    with pytest.raises(UserError) as err:
        check_datasets(data("dataset=instruct", f"dataset.source={path}"), tokenizer())
    assert (err.value.key, err.value.value) == ("dataset.source", str(path))
    assert err.value.fix == "has no records; give a data file that holds some"


def test_a_directory_of_empty_files_names_them(tmp_path: Path) -> None:
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train.jsonl").write_text("")
    with pytest.raises(UserError) as err:
        check_datasets(data(f"dataset.source={tmp_path / 'data'}"), tokenizer())
    assert f"its files {tmp_path / 'data' / 'train.jsonl'} hold no records" in err.value.fix


def test_an_empty_data_file_stops_runner_train(runner_cli, tmp_path: Path) -> None:
    empty, out_root = tmp_path / "empty.jsonl", tmp_path / "outputs"
    empty.write_text("")
    result = runner_cli("train", f"dataset.source={empty}", f"runtime.output_root={out_root}")
    assert one_error(result) == (
        f"error: dataset.source='{empty}': has no records; give a data file that holds some"
    )
    assert not out_root.exists() or not any(out_root.rglob("status.json"))


def test_a_malformed_json_line_is_named_by_line_and_column(runner_cli, tmp_path: Path) -> None:
    lines = sample_lines(600)
    lines[499] = '{"instruction": "Reverse:", "input": "abc", "output": cba}'
    bad, out_root = tmp_path / "bad.jsonl", tmp_path / "outputs"
    bad.write_text("\n".join(lines) + "\n")
    result = runner_cli("train", f"dataset.source={bad}", f"runtime.output_root={out_root}")
    column = lines[499].index("cba") + 1
    assert one_error(result) == (
        f"error: dataset.source='{bad}': line 500, column {column}: not valid JSON (Expecting "
        "value); fix or drop the line (a JSON-lines file holds one JSON object a line)"
    )
    assert not out_root.exists() or not any(out_root.rglob("status.json"))


def test_a_malformed_line_in_a_directory_names_its_file(tmp_path: Path) -> None:
    (tmp_path / "data").mkdir()
    good, bad = tmp_path / "data" / "train-0.jsonl", tmp_path / "data" / "train-1.jsonl"
    good.write_text("\n".join(sample_lines(10)) + "\n")
    line = '{"instruction": "Upper:", "input": "ab", "output": "AB",}'
    bad.write_text(f"\n{line}\n")
    with pytest.raises(LineError) as err:
        check_datasets(data(f"dataset.source={tmp_path / 'data'}"), tokenizer())
    column = line.index(",}") + 2
    assert (err.value.file, err.value.line, err.value.column) == (str(bad), 2, column)
    assert f"{bad} line 2, column {column}: not valid JSON (Expecting property" in str(err.value)


@pytest.mark.parametrize(
    "name,text,line",
    [
        ("d.csv", "instruction,input,output\nUpper:,ab,AB\nUpper:,cd,CD\nUpper:,\xff,X\n", 4),
        ("d.txt", "one\ntwo\nthr\xffee\n", 3),
        ("d.json", '[\n  {"instruction": "Upper:", "input": "ab", "output": "A\xff"}\n]\n', 2),
    ],
    ids=["csv", "text", "json-document"],
)
def test_each_reader_names_the_line_that_is_not_utf8(
    tmp_path: Path, name: str, text: str, line: int
) -> None:
    path = tmp_path / name
    # \xff stands for a byte that no UTF-8 text holds.
    path.write_bytes(text.encode("utf-8").replace(b"\xc3\xbf", b"\xff"))
    with pytest.raises(LineError) as err:
        check_datasets(data("dataset=instruct", f"dataset.source={path}"), tokenizer())
    column = text.splitlines()[line - 1].index("\xff") + 1
    assert (err.value.file, err.value.line, err.value.column) == (str(path), line, column)
    assert err.value.fix.endswith(
        "byte 0xff is not UTF-8 text; save the file as UTF-8, or fix or drop the line"
    )


def test_every_record_is_decoded_before_training(runner_cli, tmp_path: Path) -> None:
    """JSON lines keep a string's bytes as they are: the check decodes every record, not only
    those a run happens to draw."""
    lines = [line.encode() for line in sample_lines(3000)]
    lines[2499] = lines[2499].replace(b'"input": "', b'"input": "\xc3(', 1)
    bad, out_root = tmp_path / "bad.jsonl", tmp_path / "outputs"
    bad.write_bytes(b"\n".join(lines) + b"\n")
    with pytest.raises(DataError) as err:
        check_datasets(data(f"dataset.source={bad}"), tokenizer())
    assert (err.value.file, err.value.row, err.value.column) == (str(bad), 2500, "input")
    # A slice without that record is fine: only the records a run reads are checked.
    assert check_datasets(
        data(f"dataset.source={bad}", "dataset.split='train[:2000]'"), tokenizer()
    )
    result = runner_cli("train", f"dataset.source={bad}", f"runtime.output_root={out_root}")
    assert one_error(result) == (
        f"error: dataset.source='{bad}': row 2500, column 'input': holds bytes that are not "
        "UTF-8 text; save the file as UTF-8, or fix or drop the row"
    )
    assert not out_root.exists() or not any(out_root.rglob("status.json"))


def test_a_conversation_that_is_not_utf8_is_named(tmp_path: Path) -> None:
    rows = [
        {"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": "a"}]}
        for i in range(40)
    ]
    lines = [json.dumps(row).encode() for row in rows]
    lines[30] = lines[30].replace(b'"q30"', b'"q\xe930"')
    path = tmp_path / "chat.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    with pytest.raises(DataError) as err:
        check_datasets(data("dataset=chat", f"dataset.source={path}"), tokenizer())
    assert (err.value.row, err.value.column) == (31, "messages")


# ---- weights --------------------------------------------------------------------------------
def test_check_safetensors_reads_the_header_alone(tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    save_file({"a": torch.zeros(8), "b": torch.ones(4, 4)}, str(path))
    check_safetensors(path, key="checkpoint")
    whole = path.read_bytes()
    path.write_bytes(whole[:-1])
    with pytest.raises(UserError) as err:
        check_safetensors(path, key="model.source")
    assert (err.value.key, err.value.value) == ("model.source", str(path))
    assert err.value.fix.startswith(f"is cut short: tensor 'b' ends at byte {len(whole)}")
    path.write_bytes(b"\xff" * 8 + whole[8:])
    with pytest.raises(UserError, match="is cut short or not safetensors"):
        check_safetensors(path, key="checkpoint")
    path.write_bytes(whole[:8] + b"x" + whole[9:])
    with pytest.raises(UserError, match="its header is not JSON"):
        check_safetensors(path, key="checkpoint")
    with pytest.raises(UserError, match="is missing; download, copy or save it again"):
        check_safetensors(tmp_path / "other.safetensors", key="checkpoint")


@pytest.fixture(scope="module")
def tiny_source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_checkpoint("llama3_2", tmp_path_factory.mktemp("source") / "llama")


def damaged_copy(source: Path, destination: Path) -> Path:
    shutil.copytree(source, destination)
    cut_short(destination / "model.safetensors")
    return destination / "model.safetensors"


def test_deploy_names_a_weights_file_cut_short(runner_cli, tiny_source, tmp_path) -> None:
    weights = damaged_copy(tiny_source, tmp_path / "damaged")
    error = one_error(runner_cli("deploy", f"checkpoint={weights.parent}", "port=0"))
    assert error.startswith(f"error: checkpoint='{weights}': is cut short: tensor ")
    assert error.endswith("download, copy or save it again")


def test_deploy_names_a_lora_runs_base_cut_short_before_serving(
    runner_cli, tiny_source, tmp_path
) -> None:
    """A LoRA run's own base (RUN/base_model, written from the seed) cut short: resume and
    export named it in one line; deploy started the server, whose engine's process then failed
    in two tracebacks, with "serving ..." between them, and exit 3."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    run = tmp_path / "run"
    shutil.copytree(tiny_source, run / "base_model")
    adapter = run / "checkpoints" / "step_2"
    model = AutoModelForCausalLM.from_pretrained(run / "base_model")
    get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"])).save_pretrained(
        adapter
    )
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_source / name, adapter / name)
    (run / "status.json").write_text(json.dumps({"state": "failed", "step": 2}))
    weights = run / "base_model" / "model.safetensors"
    cut_short(weights)
    result = runner_cli("deploy", f"checkpoint={run}", "port=0", "device=cpu")
    error = one_error(result)
    assert error.startswith(f"error: checkpoint='{weights}': is cut short: tensor ")
    assert error.endswith("download, copy or save it again")
    assert "serving" not in result.stderr + result.stdout


def test_train_names_a_source_weights_file_cut_short(runner_cli, tiny_source, tmp_path) -> None:
    weights = damaged_copy(tiny_source, tmp_path / "damaged")
    out_root = tmp_path / "outputs"
    result = runner_cli(
        "train", "model=hf", f"model.source={weights.parent}", f"runtime.output_root={out_root}"
    )
    assert one_error(result).startswith(f"error: model.source='{weights}': is cut short: ")
    assert not out_root.exists() or not any(out_root.rglob("status.json"))


def test_resume_names_a_source_cut_short_since(runner_cli, tiny_source, tmp_path) -> None:
    """A run reads its source's weights again when it resumes."""
    source, run = tmp_path / "source", tmp_path / "run"
    shutil.copytree(tiny_source, source)
    args = [*QUICK, "compute=cpu", "max_steps=2", "batch_size=2", "eval.strategy=no"]
    args += ["model=hf", f"model.source={source}", f"hydra.run.dir={run}"]
    result = runner_cli("train", *args)
    assert result.returncode == 0, result.stderr[-3000:]
    status = json.loads((run / "status.json").read_text())
    (run / "status.json").write_text(json.dumps({**status, "state": "failed"}))
    cut_short(source / "model.safetensors")
    error = one_error(runner_cli("train", f"resume={run}"))
    assert error.startswith(f"error: checkpoint='{source / 'model.safetensors'}': is cut short")


# ---- resume ---------------------------------------------------------------------------------
def test_resume_passes_over_a_damaged_newest_checkpoint(runner_cli, tmp_path: Path) -> None:
    """Killed while its step-4 checkpoint's weights or training state were cut short, or its
    weights deleted since: resume sets that checkpoint aside, warns naming the file, and trains
    on from step 2 as if interrupted there."""
    straight = tmp_path / "straight"
    args = [*QUICK, "compute=cpu", "max_steps=4", "runtime.save_every_n_steps=2"]
    args += ["runtime.log_every_n_steps=1", "eval.strategy=no", f"hydra.run.dir={straight}"]
    result = runner_cli("train", *args)
    assert result.returncode == 0, result.stderr[-3000:]
    # A file cut short, or deleted (a checkpoint's own files were looked at, not those missing).
    damages = [("model.safetensors", "is cut short"), ("training_state.pt", "is cut short")]
    for name, problem in [*damages, ("model.safetensors", "is missing")]:
        run = tmp_path / f"{problem.split()[-1]}-{name}"
        shutil.copytree(straight, run)
        recipe = (run / "recipe.yaml").read_text().replace(str(straight), str(run))
        (run / "recipe.yaml").write_text(recipe)
        status = json.loads((run / "status.json").read_text())
        (run / "status.json").write_text(json.dumps({**status, "state": "failed"}))
        if problem == "is missing":
            (run / "checkpoints" / "step_4" / name).unlink()
        else:
            cut_short(run / "checkpoints" / "step_4" / name)

        result = runner_cli("train", f"resume={run}")
        assert result.returncode == 0, result.stderr[-3000:]
        checkpoints = run / "checkpoints"
        warning = f"checkpoint step_4 is damaged, set aside as {checkpoints / '.damaged-step_4'}"
        assert warning in result.stderr
        assert f"{checkpoints / 'step_4' / name} {problem}" in result.stderr
        assert f"resuming from {checkpoints / 'step_2'} at step 2" in result.stderr
        assert sorted(p.name for p in checkpoints.iterdir()) == [
            ".damaged-step_4",
            "step_2",
            "step_4",
        ]
        assert checkpoint_problem(checkpoints / "step_4") == ""
        assert losses(run) == losses(straight)


def runner_limited(
    cwd: Path, env: dict[str, str], limit: int, *args: str
) -> subprocess.CompletedProcess[str]:
    """`runner ARGS` in a fresh interpreter whose files may grow to `limit` bytes (RLIMIT_FSIZE):
    a write past it fails as on a full disk (EFBIG for ENOSPC)."""
    hard = resource.getrlimit(resource.RLIMIT_FSIZE)[1]
    return subprocess.run(
        [sys.executable, "-m", "runner", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard)),
    )


def train_to_refused_checkpoint(run: Path, processes: int) -> list[str]:
    """A `runner train` whose first checkpoint, at step 2, a limit of 4 MiB refuses (below the
    tiny model's training state)."""
    return ["train", *QUICK, "max_steps=2", "eval.strategy=no", "dataset.eval_samples=0"] + [
        f"compute.nproc_per_node={processes}",
        f"hydra.run.dir={run}",
    ]


@pytest.mark.parametrize("processes", [1, 2])
def test_a_checkpoint_the_disk_refuses_is_one_message_with_nothing_half_written(
    tmp_path: Path, hermetic_env: dict[str, str], processes: int
) -> None:
    """A full disk or a file-size limit (here 4 MiB, below the tiny model's training state):
    torch.save's "[enforce fail at inline_container.cc] unexpected pos" ended a traceback of 60
    lines, and the part written stayed in checkpoints/ until a resume. With two processes, rank
    0's message came as three chained tracebacks, and the run exited 1 as for a bug."""
    run = tmp_path / "run"
    train = train_to_refused_checkpoint(run, processes)
    result = runner_limited(tmp_path, hermetic_env, 4 << 20, *train)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    said = f"hydra.run.dir='{run}': the checkpoint of step 2 could not be written"
    if processes == 1:
        (line,) = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    else:  # rank 0's line, then the launcher's, which names it
        (line,) = [line for line in result.stderr.splitlines() if line.startswith("[rank0]: ")]
        assert line.startswith(f"[rank0]: error: {said}"), result.stderr[-3000:]
        last = result.stderr.strip().splitlines()[-1]
        assert last.startswith("training failed after 0 restart(s) (compute.max_restarts): ")
        assert "rank 0 exited with 2; " + said in last, last
    assert said in line
    assert "files are limited to 4.0 MiB here (ulimit -f)" in line
    status = json.loads((run / "status.json").read_text())
    assert status["state"] == "failed" and "could not be written" in status["error"]
    assert list((run / "checkpoints").iterdir()) == []  # no .tmp-step_2 left


# A training started twice in fresh interpreters (27-34 s); the status write's test below
# checks the key in the default run.
@pytest.mark.long
@pytest.mark.parametrize("processes", [1, 2])  # 2: the workers' key
def test_a_resumed_runs_checkpoint_the_disk_refuses_names_resume(
    tmp_path: Path, hermetic_env: dict[str, str], processes: int
) -> None:
    """`runner resume RUN` on a disk that refused its checkpoint said "hydra.run.dir=RUN", a key
    its user never typed; it names resume, in the workers' line too. The run is made by a first
    train that the same file-size limit (4 MiB) fails at its checkpoint. Before that, a resume
    on a disk too full for its first status (256 B, below status.json's size) ended in a
    traceback of the write: it is one message, with the run's records as they were."""
    run = tmp_path / "run"
    train = train_to_refused_checkpoint(run, processes)
    first = runner_limited(tmp_path, hermetic_env, 4 << 20, *train)
    assert f"hydra.run.dir='{run}': the checkpoint of step 2" in first.stderr, first.stderr[-3000:]
    status = (run / "status.json").read_text()

    no_status = runner_limited(tmp_path, hermetic_env, 256, "resume", str(run))
    assert one_error(no_status).startswith(
        f"error: resume='{run}': its records could not be written (File too large); its disk "
    ), no_status.stderr[-3000:]
    assert "files are limited to 256 B here" in no_status.stderr
    assert (run / "status.json").read_text() == status

    result = runner_limited(tmp_path, hermetic_env, 4 << 20, "resume", str(run))
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    said = f"resume='{run}': the checkpoint of step 2 could not be written (File too large)"
    errors = [line for line in result.stderr.splitlines() if said in line]
    assert errors, result.stderr[-3000:]
    assert "hydra.run.dir" not in result.stderr, result.stderr[-3000:]


@pytest.mark.long  # a training each (9 s); the default run's key is checked above
@pytest.mark.parametrize("placed", ["run", "sweep-job"])
def test_a_checkpoint_the_disk_refuses_names_the_root_the_run_was_made_under(
    tmp_path: Path, hermetic_env: dict[str, str], placed: str
) -> None:
    """A run placed by runtime.output_root (no hydra.run.dir given), or a sweep's job, was named
    "hydra.run.dir=RUN", a key its user never typed: it names the key that placed it, with the
    value typed, and the run to resume."""
    quick = ["train", *QUICK, "max_steps=2", "eval.strategy=no", "dataset.eval_samples=0"]
    if placed == "run":
        root = tmp_path / "outputs"
        result = runner_limited(
            tmp_path, hermetic_env, 4 << 20, *quick, f"runtime.output_root={root}"
        )
        (run,) = root.glob("*/*")
        said = f"runtime.output_root='{root}': the checkpoint of step 2 could not be written"
    else:
        root = tmp_path / "sweep"
        sweep = ["-m", f"hydra.sweep.dir={root}", "optimizer.lr=1e-3"]
        result = runner_limited(tmp_path, hermetic_env, 4 << 20, *quick, *sweep)
        run = root / "0"
        said = f"hydra.sweep.dir='{root}': the checkpoint of step 2 could not be written"
    assert result.returncode != 0 and "Traceback" not in result.stderr, result.stderr[-3000:]
    # A sweep's job's line is "error: job 0 (OVERRIDES): KEY=VALUE: ...".
    (line,) = [line for line in result.stderr.splitlines() if said in line]
    assert line.endswith(f"then `runner resume {run}` goes on from its last whole checkpoint")
    assert "hydra.run.dir" not in result.stderr, result.stderr[-3000:]


def test_a_status_write_a_resumed_run_cannot_make_names_resume(tmp_path: Path) -> None:
    """The status.json write of a resumed run (the job names it by resume while it trains)."""
    from runner.job.launch import environment
    from runner.rundir import RunDir
    from runner.rundir.io import RUN_KEY_ENV
    from runner.trainer.progress import Reporter

    run = RunDir(tmp_path / "run")
    run.path.mkdir()
    run.write_status("running", step=1, total_steps=10, loss=5.0)
    reporter = Reporter(run, is_rank_zero=True)
    with environment({RUN_KEY_ENV: f"resume={run.path}"}), files_limited_to(200):
        with pytest.raises(UserError) as raised:
            reporter.step(2, 10, {"loss": 4.0, "lr": 1e-3, "tokens_per_s": 100.0})
    assert str(raised.value).startswith(
        f"resume='{run.path}': its status.json could not be written (File too large)"
    ), str(raised.value)


def test_a_disk_too_full_to_start_a_run_on_is_refused_before_anything_is_written(
    tmp_path: Path, hermetic_env: dict[str, str]
) -> None:
    """A disk with a few KiB left: Hydra's first write (.hydra/config.yaml) failed in a
    traceback of 40 lines, and left .hydra/, .lock and an empty train.log. The floor a run
    starts on (START_ROOM) is raised past this disk's free space, as a full disk would be."""
    runs = tmp_path / "outputs"
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; import runner.job.start as start; start.START_ROOM = 1 << 50; "
            "from runner.cli import main; "
            f"sys.exit(main(['train', *{QUICK!r}, 'runtime.output_root={runs}']))",
        ],
        cwd=tmp_path,
        env=hermetic_env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    line = one_error(result)
    assert line.startswith(f"error: runtime.output_root='{runs}': the disk of {runs}/"), line
    assert line.endswith(
        "free, less than the 1024.0 TiB a run starts on (its checkpoints take more): make room, "
        "or give a directory on another disk"
    ), line
    assert not runs.exists()


def test_records_the_disk_refuses_at_a_runs_start_are_one_line_and_no_directory(
    tmp_path: Path, hermetic_env: dict[str, str], runner_cli
) -> None:
    """A disk that fills between the check of its room and the run's first records: the
    manifest's write (6.8 KiB) ended in a traceback and left a half-made run directory. A
    file-size limit of 6 KiB takes Hydra's files and recipe.yaml and refuses manifest.json."""
    assert runner_cli("validate", *QUICK).returncode == 0  # the data's cache, written ahead
    run = tmp_path / "run"
    train = ["train", *QUICK, f"hydra.run.dir={run}"]
    result = runner_limited(tmp_path, hermetic_env, 6 << 10, *train)
    line = one_error(result)
    assert line.startswith(
        f"error: hydra.run.dir='{run}': the run's records could not be written (File too "
        "large); its disk has "
    ), line
    assert line.endswith(
        "and files are limited to 6.0 KiB here (ulimit -f): raise the file-size limit (ulimit "
        "-f) or make room, or give a directory on another disk"
    ), line
    assert not run.exists()


def test_a_save_says_when_the_checkpoints_to_come_will_not_fit() -> None:
    """A disk that holds this checkpoint but not the ones to come failed hours later, at the
    save that found no room; the save before says so, by the size the run's checkpoints take."""
    from runner.trainer.checkpointing import room_short

    mib = 1 << 20
    # keep_last_n_checkpoints=2: up to 3 at once. After the first save (1 held), 2 more to come.
    assert room_short(free=20 * mib, size=10 * mib, held_now=1, held_at_most=3) is None
    assert room_short(free=15 * mib, size=10 * mib, held_now=1, held_at_most=3) == (
        "its disk has 15.0 MiB free and a checkpoint takes 10.0 MiB; the run holds up to 3 at "
        "once (1 now), so the next 2 need 20.0 MiB and 1 of them fit"
    )
    # Pruned to its last 2: each save then needs room for one while the oldest is still there.
    assert room_short(free=10 * mib, size=10 * mib, held_now=2, held_at_most=3) is None
    assert room_short(free=9 * mib, size=10 * mib, held_now=2, held_at_most=3) == (
        "its disk has 9.0 MiB free and a checkpoint takes 10.0 MiB; the run holds up to 3 at "
        "once (2 now), so the next checkpoint will not fit"
    )


def test_the_best_being_written_is_counted_once_among_the_checkpoints_held(
    tmp_path: Path,
) -> None:
    """A new best, being written, was counted twice: "the disk holds 4 at once" of 3."""
    from runner.rundir import RunDir
    from runner.trainer.checkpointing import _held_at_most

    run = RunDir(tmp_path / "run")
    for step in (1, 2, 4):
        (run.checkpoints_dir / f"step_{step}").mkdir(parents=True)
    # Steps 2 and 4, and the one written.
    assert _held_at_most(run, 2, keep_step=None, evaluates=False) == 3
    assert _held_at_most(run, 2, keep_step=6, evaluates=False) == 3  # the one written is the best
    assert _held_at_most(run, 2, keep_step=4, evaluates=False) == 3
    assert _held_at_most(run, 2, keep_step=1, evaluates=False) == 4  # an older best, kept besides


def test_a_commit_warns_of_the_room_its_next_checkpoints_lack(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The save's own warning, by the checkpoint it wrote and the disk's room as it reads it
    (a disk cannot be filled here, so its free space is read as 1.5 checkpoints)."""
    from runner.rundir import RunDir
    from runner.trainer import checkpointing

    run = RunDir(tmp_path / "run")
    run.checkpoints_dir.mkdir(parents=True)

    def write(tmp: Path) -> None:
        tmp.mkdir()
        (tmp / "training_state.pt").write_bytes(b"\0" * 1024 * 1024)

    monkeypatch.setattr(checkpointing, "free_space", lambda path: 1536 * 1024)
    with caplog.at_level("WARNING", logger="runner.recipe"):
        checkpointing.commit(
            run, 2, write, keep_last_n=2, keep_step=None, evaluates=False, saved=lambda: None
        )
    assert caplog.messages == [
        f"{run.path}: its disk has 1.5 MiB free and a checkpoint takes 1.0 MiB; the run holds "
        "up to 3 at once (1 now), so the next 2 need 2.0 MiB and 1 of them fit; make room now, "
        "or keep fewer (runtime.keep_last_n_checkpoints=2)"
    ]
    caplog.clear()
    monkeypatch.setattr(checkpointing, "free_space", lambda path: 1 << 40)
    checkpointing.commit(
        run, 4, write, keep_last_n=2, keep_step=None, evaluates=False, saved=lambda: None
    )
    assert caplog.messages == []


def room_checked_before_training(
    run_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    free: int,
    keep_last_n: int,
    saves_left: int,
    evaluates: bool = False,
) -> None:
    """The check before the first step of a run whose checkpoint is a 256 x 1024 Linear (1 MiB
    of fp32 weights, 3 MiB with AdamW's 2 moments), on a disk with `free` bytes."""
    from runner.rundir import RunDir
    from runner.trainer import checkpointing

    monkeypatch.setattr(checkpointing, "free_space", lambda path: free)
    checkpointing.warn_before_training(
        RunDir(run_dir),
        torch.nn.Linear(256, 1024, bias=False),
        moments=2,
        whole_model=True,
        keep_last_n=keep_last_n,
        keep_step=None,
        evaluates=evaluates,
        saves_left=saves_left,
    )


def test_a_run_warns_before_its_first_step_where_its_checkpoints_will_not_fit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A disk too small for one checkpoint was found at the first save, hours in. Before the
    first step, the checkpoint is priced by the model (weights, and AdamW's 2 moments of each
    trained one), and only the saves the run will make count."""
    run = tmp_path / "run"
    with caplog.at_level("WARNING", logger="runner.recipe"):
        for saves_left in (0, 1):
            room_checked_before_training(run, monkeypatch, 2 << 20, 2, saves_left)
    assert caplog.messages == [
        f"{run}: its disk has 2.0 MiB free and a checkpoint will take about 3.0 MiB; the "
        "run holds up to 3 at once (0 now), so the next checkpoint will not fit; make room now, "
        "or keep fewer (runtime.keep_last_n_checkpoints=2)"
    ]


def test_a_run_that_evaluates_counts_the_best_kept_besides_its_last_checkpoints(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """max_steps=6, runtime.save_every_n_steps=2, eval.steps=3, keep_last_n_checkpoints=1: the
    run saves at steps 2, 3 (a new best), 4 and 6, and holds steps 3 and 4 while it writes 6.
    The check before the first step counted 2 at once, so a disk with room for 2 of its 3 had
    no warning."""
    from runner.rundir import RunDir
    from runner.trainer.checkpointing import _held_at_most
    from runner.trainer.progress import breaks_after

    run = tmp_path / "run"
    assert _held_at_most(RunDir(run), 1, keep_step=None, evaluates=True) == 3
    assert _held_at_most(RunDir(run), 1, keep_step=None, evaluates=False) == 2
    saves = breaks_after(0, 6, [2, 3])
    assert saves == len([2, 3, 4, 6])
    with caplog.at_level("WARNING", logger="runner.recipe"):
        for evaluates in (False, True):  # 8 MiB free: room for 2 checkpoints of 3 MiB
            room_checked_before_training(run, monkeypatch, 8 << 20, 1, saves, evaluates=evaluates)
    assert caplog.messages == [
        f"{run}: its disk has 8.0 MiB free and a checkpoint will take about 3.0 MiB; the "
        "run holds up to 3 at once (0 now), so the next 3 need 9.0 MiB and 2 of them fit; make "
        "room now, or keep fewer (runtime.keep_last_n_checkpoints=1)"
    ]


def test_a_status_write_the_disk_refuses_is_one_message_with_nothing_left(tmp_path: Path) -> None:
    """A disk that fills between checkpoints: the status.json write of the next logged step
    ended the run in a traceback of 90 lines, and left an empty .status.json.HOST.PID.tmp that
    nothing removed. A file-size limit fails the write as a full disk does (EFBIG for ENOSPC;
    Python ignores SIGXFSZ)."""
    from runner.rundir import RunDir
    from runner.trainer.progress import Reporter

    run = RunDir(tmp_path / "run")
    run.path.mkdir()
    run.write_status("running", step=1, total_steps=10, loss=5.0)
    before = (run.path / "status.json").read_text()
    reporter = Reporter(run, is_rank_zero=True)
    with files_limited_to(200):  # below status.json's size
        with pytest.raises(UserError) as raised:
            reporter.step(2, 10, {"loss": 4.0, "lr": 1e-3, "tokens_per_s": 100.0})
    said = str(raised.value)
    assert said.startswith(
        f"hydra.run.dir='{run.path}': its status.json could not be written (File too large); "
        "its disk has "
    ), said
    assert "files are limited to 200 B here (ulimit -f)" in said
    assert said.endswith(f"then `runner resume {run.path}` goes on from its last whole checkpoint")
    assert (run.path / "status.json").read_text() == before
    assert sorted(p.name for p in run.path.iterdir()) == ["metrics.jsonl", "status.json"]


def test_a_checkpoint_the_disk_refuses_says_the_room_it_takes(tmp_path: Path) -> None:
    """The message said "its disk has 0.0 GiB free" of a disk with 5.8 MiB left, kept torch's
    "[enforce fail at inline_container.cc:672] . unexpected pos 1729856 vs 1729748", and never
    said what a checkpoint takes, so "keep fewer" did not say whether keeping one would fit.
    Its advice to keep fewer, then resume, could not be followed: a resume refuses a recipe
    edited to keep fewer. The checkpoints the run does not need to go on are named instead."""
    from runner.rundir import RunDir
    from runner.rundir.io import size_text
    from runner.trainer.checkpointing import commit

    run = RunDir(tmp_path / "run")
    for step in (1, 2):
        (run.checkpoint_path(step)).mkdir(parents=True)
        (run.checkpoint_path(step) / "training_state.pt").write_bytes(b"\0" * 300 * 1024)

    def write(tmp: Path) -> None:
        tmp.mkdir()
        torch.save(torch.zeros(75 * 1024), tmp / "training_state.pt")  # 300 KiB

    with files_limited_to(100 * 1024):
        with pytest.raises(UserError) as raised:
            commit(
                run, 4, write, keep_last_n=2, keep_step=None, evaluates=False, saved=lambda: None
            )
    said = str(raised.value)
    assert said.startswith(
        f"hydra.run.dir='{run.path}': the checkpoint of step 4 could not be written (a file's "
        "write stopped short); its disk has "
    ), said
    assert size_text(6_081_741) == "5.8 MiB"  # the room of the disk that read "0.0 GiB free"
    assert (
        "files are limited to 100.0 KiB here (ulimit -f); a checkpoint takes 300.0 KiB, and with "
        "runtime.keep_last_n_checkpoints=2 the disk holds 3 at once while one is written; the "
        "run goes on from its latest checkpoint alone, and "
        f"`rm -r {run.checkpoint_path(1)}` frees 300.0 KiB: raise the file-size limit (ulimit "
        "-f) or make room, then `runner resume "
    ) in said, said
    # "make room (runtime.keep_last_n_checkpoints keeps fewer), then `runner resume`": a resume
    # goes on with the recipe the run started with, and refuses one edited to keep fewer.
    assert "keeps fewer" not in said
    assert sorted(p.name for p in run.checkpoints_dir.iterdir()) == ["step_1", "step_2"]
