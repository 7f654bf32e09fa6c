"""dataset.streaming: records read as they come, sharded across processes, checked window by
window, resumed exactly; the same batches with any number of loader workers."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from runner.data.stream import START, StreamSplit
from runner.errors import UserError
from tests.conftest import QUICK, losses
from tests.test_data import data, tokenizer, trained_text, write, write_jsonl

RECORDS = 120


def corpus(tmp_path: Path, count: int = RECORDS, files: int = 3) -> Path:
    """`count` instruct records (answer a<i>) over `files` parquet files of a directory, named
    as the hub names a train split's shards."""
    folder = tmp_path / "corpus"
    rows = [
        {"instruction": f"Reverse word {i}.", "input": "", "output": f"a{i}"} for i in range(count)
    ]
    per_file = -(-count // files)
    for n in range(files):
        shard = folder / f"train-{n:05d}-of-{files:05d}.parquet"
        write(rows[n * per_file : (n + 1) * per_file], shard)
    return folder


def answers(split: StreamSplit, count: int) -> list[str]:
    tok = tokenizer()
    found = []
    for sample, _ in split.samples(START, lambda n: True):
        found.append(trained_text(sample, tok).removesuffix("<|eot_id|>"))
        if len(found) == count:
            return found
    raise AssertionError("the stream ended")


def stream_data(folder: Path, *overrides: str) -> dict:
    return data(
        "dataset=instruct",
        f"dataset.source={folder}",
        "dataset.format=parquet",
        "dataset.streaming=true",
        "dataset.shuffle_buffer=16",
        *overrides,
    )


@pytest.mark.parametrize("readers", [3, 2], ids=["by-file", "by-record"])
def test_each_process_reads_its_own_share_and_together_all(tmp_path: Path, readers: int) -> None:
    """3 shards: to 3 processes a shard each, to 2 every other record."""
    recipe = stream_data(corpus(tmp_path))
    share = RECORDS // readers
    shares = [
        answers(StreamSplit(recipe, tokenizer(), reader=rank, readers=readers, seed=0), share)
        for rank in range(readers)
    ]
    seen = [answer for answers_ in shares for answer in answers_]
    assert sorted(seen) == sorted(f"a{i}" for i in range(RECORDS))  # each once, none twice
    # Shuffled within windows of 16 records of each share: not in file order.
    assert shares[0] != sorted(shares[0], key=lambda a: int(a[1:]))
    # The next pass is shuffled anew.
    both = answers(StreamSplit(recipe, tokenizer(), reader=0, readers=readers, seed=0), 2 * share)
    assert sorted(both[:share]) == sorted(both[share:])
    assert both[:share] != both[share:]


def test_a_resumed_reader_continues_with_the_next_sample(tmp_path: Path) -> None:
    recipe = stream_data(corpus(tmp_path, files=1))
    whole = StreamSplit(recipe, tokenizer(), reader=1, readers=2, seed=3)
    positions, straight = [], []
    for sample, position in whole.samples(START, lambda n: True):
        straight.append(sample["tokens"])
        positions.append(position)
        if len(straight) == 100:  # past a pass of 60 records
            break
    for cut in (5, 16, 59, 60, 77):
        again = StreamSplit(recipe, tokenizer(), reader=1, readers=2, seed=3)
        rest = [
            s["tokens"]
            for s, _ in zip_n(again.samples(positions[cut - 1], lambda n: True), 100 - cut)
        ]
        assert rest == straight[cut:], cut


def zip_n(items, count: int) -> list:
    found = []
    for item in items:
        found.append(item)
        if len(found) == count:
            break
    return found


def test_a_bad_record_mid_stream_names_its_file_and_row(tmp_path: Path) -> None:
    folder = tmp_path / "corpus"
    rows = [
        {"instruction": f"Reverse word {i}.", "input": "", "output": f"a{i}"} for i in range(80)
    ]
    rows[57]["output"] = None
    write(rows, folder / "train.jsonl")
    split = StreamSplit(
        stream_data(folder, "dataset.format=jsonl"), tokenizer(), reader=0, readers=1, seed=0
    )
    taken = 0
    with pytest.raises(UserError, match=r"train.jsonl row 58, column 'output'") as caught:
        for _ in split.samples(START, lambda n: True):
            taken += 1
    assert taken == 48  # the three whole windows of 16 before it trained
    assert caught.value.key == "dataset.source"


CHAT_GOOD = {"messages": [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]}
MIXED = {"messages": [{"role": "user", "content": 5}, {"role": "assistant", "content": "a"}]}


@pytest.mark.parametrize("window", [1, 4], ids=["alone in its window", "among others"])
def test_a_record_of_mixed_types_mid_stream_names_its_file_and_row(tmp_path: Path, window: int):
    """A number beside text in one conversation: the window's records did not read as a table,
    nor did the record alone, and the stream recursed until Python's stack ran out."""
    path = write_jsonl([CHAT_GOOD] * 5 + [MIXED] + [CHAT_GOOD], tmp_path / "corpus" / "train.jsonl")
    recipe = data(
        "dataset=chat",
        f"dataset.source={path.parent}",
        "dataset.streaming=true",
        f"dataset.shuffle_buffer={window}",
    )
    split = StreamSplit(recipe, tokenizer(), reader=0, readers=1, seed=0)
    with pytest.raises(UserError) as caught:
        for _ in split.samples(START, lambda n: True):
            pass
    message = str(caught.value)
    assert "\n" not in message
    assert f"{path} row 6, column 'messages': message 1's 'content' is a number ('5')" in message


@pytest.mark.parametrize("save_every", [4, 1000], ids=["checkpoints", "none saved yet"])
def test_a_bad_record_mid_stream_stops_the_run_there(
    runner_cli, tmp_path: Path, save_every: int
) -> None:
    """Steps 1-12 train on the three windows before it; the run ends failed, naming the record,
    with its whole checkpoints and nothing half-written; a run that trained keeps its record
    with none saved yet (its directory was removed, as a run refused before its first step)."""
    folder = tmp_path / "corpus"
    rows = [
        {"instruction": f"Reverse word {i}.", "input": "", "output": f"a{i}"} for i in range(80)
    ]
    rows[57]["output"] = None
    write(rows, folder / "train.jsonl")
    run = tmp_path / "run"
    stream = [a for a in STREAM if not a.startswith(("dataset.format", "dataset.shuffle_buffer"))]
    result = runner_cli(
        "train",
        *stream,
        f"dataset.source={folder}",
        "dataset.shuffle_buffer=16",
        "max_steps=20",
        f"runtime.save_every_n_steps={save_every}",
        f"hydra.run.dir={run}",
    )
    assert result.returncode == 2, result.stderr[-3000:]
    assert "train.jsonl row 58, column 'output'" in result.stderr, result.stderr[-3000:]
    status = json.loads((run / "status.json").read_text())
    assert status["state"] == "failed" and "row 58" in status["error"], status
    assert sorted(losses(run)) == list(range(1, 13))
    # Whole checkpoints only (the last 2 kept), nothing half-written.
    saved = sorted(p.name for p in (run / "checkpoints").glob("*"))
    assert saved == (["step_12", "step_8"] if save_every == 4 else []), saved


@pytest.mark.parametrize(
    "override, key",
    [
        ("dataset.packing=true", "dataset.packing"),
        ("dataset.validation.held_out=5%", "dataset.validation.held_out"),
    ],
)
def test_what_a_stream_cannot_do_is_refused_by_name(tmp_path: Path, override: str, key: str):
    with pytest.raises(UserError) as caught:
        stream_data(corpus(tmp_path, files=1), override)
    assert caught.value.key == key and "dataset.streaming=false" in str(caught.value)


STREAM = [
    *QUICK,
    "dataset=instruct",
    "dataset.format=parquet",
    "dataset.streaming=true",
    "dataset.shuffle_buffer=32",
    "runtime.log_every_n_steps=1",
    "dataset.eval_samples=0",
    "eval.strategy=no",
    "batch_size=4",
]


def test_a_stream_needs_max_steps_and_whole_splits_and_validate_says_it_is_one(
    runner_cli, tmp_path: Path
) -> None:
    folder = corpus(tmp_path)
    for extra, wanted in (
        (
            ["max_steps=null"],
            "error: max_steps=null: dataset.streaming=true: a stream has no length",
        ),
        (["max_steps=2", "dataset.split='train[:50%]'"], "a stream reads whole splits"),
    ):
        result = runner_cli("train", *STREAM, f"dataset.source={folder}", *extra)
        assert result.returncode == 2, result.stderr[-2000:]
        assert wanted in result.stderr, result.stderr
    # validate refuses the slice train refuses: it passed, and train was refused at launch.
    sliced = ["max_steps=2", "dataset.split='train[:50%]'"]
    refused = runner_cli("validate", *STREAM, f"dataset.source={folder}", *sliced)
    assert refused.returncode == 2 and "a stream reads whole splits" in refused.stderr
    validated = runner_cli("validate", *STREAM, f"dataset.source={folder}", "max_steps=2")
    assert validated.returncode == 0, validated.stderr[-2000:]
    assert "a stream, checked window by window (32 records" in validated.stdout


# Trained twice over, and thrice with loader workers: two processes' in `pytest -m long`.
@pytest.mark.parametrize("nproc, workers", [(1, 2), pytest.param(2, 0, marks=pytest.mark.long)])
def test_a_killed_stream_resumes_with_the_straight_runs_losses(
    runner_cli, tmp_path: Path, nproc: int, workers: int
) -> None:
    """8 steps straight; the same cut after its step-4 checkpoint and resumed: the same per-step
    losses, bit for bit; and with loader workers, the same as with none."""
    folder = corpus(tmp_path)
    common = [*STREAM, f"dataset.source={folder}", f"compute.nproc_per_node={nproc}"]
    common += ["max_steps=8", "runtime.save_every_n_steps=4"]

    def train(run: Path, *extra: str) -> dict[int, float]:
        result = runner_cli("train", *common, *extra, f"hydra.run.dir={run}")
        assert result.returncode == 0, result.stderr[-3000:]
        return losses(run)

    straight_dir = tmp_path / "straight"
    straight = train(straight_dir, f"dataset.num_workers={workers}")
    assert sorted(straight) == list(range(1, 9))
    if workers:
        assert train(tmp_path / "none", "dataset.num_workers=0") == straight
    # The same run killed right after its step-4 checkpoint: drop what came later.
    cut = tmp_path / "cut"
    shutil.copytree(straight_dir, cut)
    shutil.rmtree(cut / "checkpoints" / "step_8")
    (cut / "recipe.yaml").write_text(
        (cut / "recipe.yaml").read_text().replace(str(straight_dir), str(cut))
    )
    resumed = runner_cli("train", f"resume={cut}")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resuming from {cut / 'checkpoints' / 'step_4'}" in resumed.stderr
    assert losses(cut) == straight


def test_a_stream_goes_on_only_on_as_many_processes(tmp_path: Path) -> None:
    """Checked as the launcher goes on with a run in another layout: refused in each worker,
    with a traceback each, after the run's record had been rewritten to the refused layout."""
    from omegaconf import DictConfig, OmegaConf

    from runner.config.load_checkpoint import check_same_global_batch

    def recipe(processes: int, batch: int) -> DictConfig:
        return OmegaConf.create(
            {
                "batch_size": batch,
                "gradient_accumulation_steps": 1,
                "dataset": {"streaming": True},
                "compute": {"nproc_per_node": processes, "nnodes": 1},
            }
        )

    one, two = recipe(1, 4), recipe(2, 2)  # the same global batch
    with pytest.raises(UserError, match="streamed its data on 1 process"):
        check_same_global_batch("RUN", one, two, two.compute)
    check_same_global_batch("RUN", one, recipe(1, 4), one.compute)  # as it was: goes on
