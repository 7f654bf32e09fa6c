"""Benchmark: the whole-dataset checks of `runner train` on an Alpaca-sized file (52k rows).

    python scripts/bench/bench_data_checks.py [--rows 52002]

Writes synthetic instruct and chat files (tiny tokenizer), then times `check_datasets` (Arrow
for types and sizes; only the records that might be truncated are tokenized) beside the
baseline of tokenizing every record, in the same run. The first read of a file also builds
`datasets`' Arrow cache; it is timed apart.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path
from typing import Any

from runner.data import CROSS_ENTROPY_IGNORE_IDX, check_datasets, train_dataset
from runner.models.tokenizer import ChatTokenizer
from runner.paths import TINY_TOKENIZER_DIR

WORDS = "the a model data train token word answer question reverse upper case list".split()


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def write_files(directory: Path, rows: int) -> dict[str, Path]:
    """Alpaca-like lengths: a short instruction, an input in 40% of rows, a longer answer."""
    rng = random.Random(0)
    instruct, chat = directory / "instruct.jsonl", directory / "chat.jsonl"
    with instruct.open("w") as f_instruct, chat.open("w") as f_chat:
        for _ in range(rows):
            instruction = _text(rng, rng.randint(5, 25))
            extra = _text(rng, rng.randint(5, 60)) if rng.random() < 0.4 else ""
            output = _text(rng, rng.randint(5, 120))
            record = {"instruction": instruction, "input": extra, "output": output}
            f_instruct.write(json.dumps(record) + "\n")
            messages = [
                {"role": "user", "content": f"{instruction}\n{extra}"},
                {"role": "assistant", "content": output},
            ]
            f_chat.write(json.dumps({"messages": messages}) + "\n")
    return {"instruct": instruct, "chat": chat}


def data_config(kind: str, source: Path, max_seq_len: int) -> dict[str, Any]:
    column_map = (
        {"instruction": "instruction", "input": "input", "output": "output"}
        if kind == "instruct"
        else {"messages": "messages"}
    )
    return {
        "kind": kind,
        "format": "json",
        "xml": {"record": None},
        "source": str(source),
        "split": "train",
        "column_map": column_map,
        "conversation_style": "openai" if kind == "chat" else None,
        "train_on_input": False,
        "new_system_prompt": None,
        "max_seq_len": max_seq_len,
        "packing": False,
        "validation": {"held_out": None, "seed": 0, "split": None, "source": None},
    }


def tokenize_all(data: dict[str, Any], tokenizer: ChatTokenizer, rows: int) -> float:
    """The baseline: seconds to tokenize every record (timed on `rows` of them, scaled)."""
    dataset = train_dataset(data, tokenizer)
    rows = min(rows, len(dataset))
    started = time.perf_counter()
    for i in range(rows):
        all(label == CROSS_ENTROPY_IGNORE_IDX for label in dataset[i]["labels"])
    return (time.perf_counter() - started) * len(dataset) / rows


def timed(fn: Any, *args: Any) -> float:
    started = time.perf_counter()
    fn(*args)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=52002)
    parser.add_argument(
        "--baseline-rows", type=int, default=5000, help="records the baseline tokenizes, scaled"
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        files = write_files(Path(tmp), args.rows)
        print(
            f"{args.rows:,} rows per file; seconds (tokenize all: timed on "
            f"{args.baseline_rows:,} records, scaled)"
        )
        print(f"{'kind':10}{'max_seq_len':>12}{'first read':>12}{'checks':>10}{'tokenize all':>14}")
        for kind, source in files.items():
            for max_seq_len in (8192, 600):
                data = data_config(kind, source, max_seq_len)
                tokenizer = ChatTokenizer(str(TINY_TOKENIZER_DIR), max_seq_len)
                first = timed(check_datasets, data, tokenizer) if max_seq_len == 8192 else 0
                checks = timed(check_datasets, data, tokenizer)
                baseline = tokenize_all(data, tokenizer, args.baseline_rows)
                first_text = f"{first:.2f}" if first else "-"
                print(f"{kind:10}{max_seq_len:>12}{first_text:>12}{checks:>10.2f}{baseline:>14.2f}")


if __name__ == "__main__":
    main()
