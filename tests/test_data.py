"""Instruction data reads the same in every supported format; unreadable files are user errors."""

from __future__ import annotations

from pathlib import Path

import datasets
import pytest

from runner.data import FORMATS, build_dataset
from runner.errors import UserError
from runner.paths import SAMPLE_DATA_DIR, TINY_TOKENIZER_DIR
from runner.tokenizer import ChatTokenizer

COLUMNS = {"instruction": "instruction", "input": "input", "output": "output"}


def load(data_format: str, path: Path, tokenizer: ChatTokenizer):
    return build_dataset(
        data_format=data_format,
        data_files=str(path),
        files_key="dataset.train_files",
        column_map=COLUMNS,
        train_on_input=False,
        new_system_prompt=None,
        tokenizer=tokenizer,
    )


def test_every_format_gives_the_same_samples(tmp_path: Path) -> None:
    tokenizer = ChatTokenizer(str(TINY_TOKENIZER_DIR), 256)
    source = SAMPLE_DATA_DIR / "validation.jsonl"
    records = datasets.load_dataset("json", data_files=str(source), split="train")
    written = {
        "json": source,
        "csv": tmp_path / "v.csv",
        "parquet": tmp_path / "v.parquet",
        "arrow": tmp_path / "v.arrow",
    }
    records.to_csv(str(written["csv"]))
    records.to_parquet(str(written["parquet"]))
    with datasets.arrow_writer.ArrowWriter(path=str(written["arrow"])) as writer:
        writer.write_table(records.data.table)
        writer.finalize()
    assert set(written) == set(FORMATS)
    expected = [load("json", source, tokenizer)[i] for i in range(5)]
    for data_format, path in written.items():
        dataset = load(data_format, path, tokenizer)
        assert len(dataset) == 200, data_format
        assert [dataset[i] for i in range(5)] == expected, data_format


def test_an_unreadable_file_is_a_user_error(tmp_path: Path) -> None:
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"instruction": "x", "output": "y"}\n{not json\n')
    with pytest.raises(UserError) as err:
        load("json", broken, ChatTokenizer(str(TINY_TOKENIZER_DIR), 256))
    assert err.value.key == "dataset.train_files" and "could not be read as" in err.value.fix
