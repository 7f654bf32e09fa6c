"""Datasets: every format and kind reads through the real config; bad data is one clear error."""

from __future__ import annotations

import json
import re
from dataclasses import asdict
from pathlib import Path
from typing import Any
from xml.etree import ElementTree

import datasets
import pytest
import torch
from omegaconf import OmegaConf

from runner.components import instantiate
from runner.config.dataset import resolve_dataset
from runner.config.model import resolve_model
from runner.data import (
    FORMATS,
    DataError,
    check_datasets,
    checks,
    collate,
    eval_prompts,
    train_dataset,
    training_splits,
)
from runner.errors import UserError
from runner.models.attention import RowAttention
from runner.models.tokenizer import ChatTokenizer
from runner.models.torchtune_boundary import CROSS_ENTROPY_IGNORE_IDX
from runner.paths import SAMPLE_DATA_DIR, TINY_TOKENIZER_DIR
from tests.conftest import losses
from tests.test_config import compose_train

CPU = torch.device("cpu")

MODEL_MAX = 8192
# Our instruct columns under other names, to exercise column_map.
RENAMED = [
    "dataset.column_map.instruction=prompt",
    "dataset.column_map.input=context",
    "dataset.column_map.output=answer",
]


def records(count: int) -> list[dict[str, Any]]:
    return [
        {"prompt": f"Reverse word {i}.", "context": "" if i % 3 else f"w{i}", "answer": f"a{i}"}
        for i in range(count)
    ]


def write(rows: list[dict[str, Any]], path: Path) -> Path:
    """`rows` in the format that `path`'s extension names."""
    path.parent.mkdir(parents=True, exist_ok=True)
    table = datasets.Dataset.from_list(rows)
    if path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif path.suffix == ".json":
        path.write_text(json.dumps(rows))
    elif path.suffix == ".csv":
        table.to_csv(str(path), index=False)
    elif path.suffix == ".parquet":
        table.to_parquet(str(path))
    elif path.suffix == ".arrow":
        with datasets.arrow_writer.ArrowWriter(path=str(path)) as writer:
            writer.write_table(table.data.table)
            writer.finalize()
    elif path.suffix == ".xml":
        path.write_text(xml_document(rows))
    return path


def xml_document(rows: list[dict[str, Any]], record: str = "record") -> str:
    """`rows` as XML: a `record` element each, a child element per field."""
    root = ElementTree.Element("records")
    for row in rows:
        element = ElementTree.SubElement(root, record)
        for name, value in row.items():
            ElementTree.SubElement(element, name).text = str(value)
    return ElementTree.tostring(root, encoding="unicode")


def data(*overrides: str) -> dict[str, Any]:
    """The recipe's dataset section for `overrides`, through the real config groups."""
    return asdict(resolve_dataset(compose_train(list(overrides)).dataset, MODEL_MAX))


def tokenizer(max_seq_len: int = MODEL_MAX) -> ChatTokenizer:
    return ChatTokenizer(str(TINY_TOKENIZER_DIR), max_seq_len)


def validation_split(data: dict[str, Any], tok: ChatTokenizer) -> Any:
    """The validation split the recipe gets (None when the dataset has none)."""
    _, validation = training_splits(data, tok, validation=True)
    return validation


def trained_text(sample: dict[str, Any], tok: ChatTokenizer) -> str:
    return tok.decode(
        [
            t
            for t, label in zip(sample["tokens"], sample["labels"], strict=True)
            if label != CROSS_ENTROPY_IGNORE_IDX
        ],
        skip_special_tokens=False,
    )


# ---- formats, column_map, splits ------------------------------------------------------------
def test_every_format_reads_the_same_samples_through_column_map(tmp_path: Path) -> None:
    rows, tok = records(12), tokenizer()
    samples = {}
    for suffix in (".json", ".jsonl", ".csv", ".parquet", ".arrow", ".xml"):
        path = write(rows, tmp_path / f"data{suffix}")
        # format: null reads the extension; naming it explicitly reads the same.
        for fmt in ("null", suffix.lstrip(".")):
            train = train_dataset(
                data(
                    "dataset=instruct", f"dataset.source={path}", f"dataset.format={fmt}", *RENAMED
                ),
                tok,
            )
            samples[f"{suffix} {fmt}"] = [train[i] for i in range(len(train))]
    first = samples.pop(".jsonl null")
    assert len(first) == 12 and trained_text(first[0], tok) == "a0<|eot_id|>"
    assert "Reverse word 0.\nw0" in tok.decode(first[0]["tokens"])
    for name, got in samples.items():
        assert got == first, name
    assert set(FORMATS) == {"json", "jsonl", "csv", "parquet", "arrow", "text", "xml"}


def test_a_validation_source_is_read_in_its_own_files_format(tmp_path: Path) -> None:
    """dataset.format=null reads each source's extension: a .csv held out beside a .jsonl
    (read as JSON, it was refused as not JSON; a parquet file as not UTF-8)."""
    rows, tok = records(12), tokenizer()
    train = write(rows, tmp_path / "train.jsonl")
    for suffix in (".csv", ".parquet"):
        held = write(rows[:4], tmp_path / f"held{suffix}")
        spec = data("dataset=instruct", f"dataset.source={train}", *RENAMED)
        assert spec["validation"]["format"] is None
        spec = data(
            "dataset=instruct",
            f"dataset.source={train}",
            f"dataset.validation.source={held}",
            *RENAMED,
        )
        assert (spec["format"], spec["validation"]["format"]) == ("json", suffix.lstrip("."))
        validation = validation_split(spec, tok)
        assert [validation[i] for i in range(4)] == [train_dataset(spec, tok)[i] for i in range(4)]


def test_xml_reads_records_from_attributes_and_nested_elements(tmp_path: Path) -> None:
    """dataset.format=xml: fields as attributes or child elements; dataset.xml.record names the
    record element wherever it sits (null: each child of the root)."""
    rows, tok = records(6), tokenizer()
    jsonl = write(rows, tmp_path / "data.jsonl")
    as_attributes = "".join(
        f'<item prompt="{r["prompt"]}" context="{r["context"]}">'
        f"<answer>{r['answer']}</answer></item>"
        for r in rows
    )
    nested = tmp_path / "nested.xml"
    nested.write_text(f"<export><meta><n>6</n></meta><items>{as_attributes}</items></export>")
    expected = train_dataset(data("dataset=instruct", f"dataset.source={jsonl}", *RENAMED), tok)
    got = train_dataset(
        data("dataset=instruct", f"dataset.source={nested}", "dataset.xml.record=item", *RENAMED),
        tok,
    )
    assert [got[i] for i in range(6)] == [expected[i] for i in range(6)]


def test_bad_xml_names_the_file_line_column_or_record(tmp_path: Path) -> None:
    broken = tmp_path / "broken.xml"
    broken.write_text("<records>\n<record><prompt>a</prompt>\n<answer>b</record>\n</records>\n")
    with pytest.raises(UserError) as err:
        check_datasets(data("dataset=instruct", f"dataset.source={broken}", *RENAMED), tokenizer())
    assert str(err.value).startswith(f"dataset.source='{broken}': line 3, column ")
    assert "not well-formed XML (mismatched tag)" in str(err.value)
    rows = records(5)
    del rows[3]["answer"]  # the fourth record has no answer element
    missing = write(rows, tmp_path / "missing.xml")
    with pytest.raises(DataError) as found:
        check_datasets(data("dataset=instruct", f"dataset.source={missing}", *RENAMED), tokenizer())
    assert (found.value.file, found.value.row, found.value.column) == (str(missing), 4, "answer")


def test_text_trains_on_every_token_in_any_format(tmp_path: Path) -> None:
    lines = ["the first line", "", "   ", "a second, longer line"]
    txt = tmp_path / "corpus.txt"
    txt.write_text("\n".join(lines) + "\n")
    jsonl = write([{"body": line} for line in lines], tmp_path / "corpus.jsonl")
    tok = tokenizer()
    from_txt = train_dataset(data("dataset=text", f"dataset.source={txt}"), tok)
    from_jsonl = train_dataset(
        data("dataset=text", f"dataset.source={jsonl}", "dataset.column_map.text=body"), tok
    )
    assert len(from_txt) == 2  # blank lines are skipped
    assert [from_txt[i] for i in range(2)] == [from_jsonl[i] for i in range(2)]
    sample = from_txt[1]
    assert sample["tokens"] == tok.encode("a second, longer line", add_bos=True, add_eos=True)
    assert sample["labels"][0] == CROSS_ENTROPY_IGNORE_IDX
    assert list(sample["labels"][1:]) == sample["tokens"][1:]
    # max_seq_len cuts a line; what is left still trains.
    short = train_dataset(
        data("dataset=text", f"dataset.source={txt}", "dataset.max_seq_len=5"), tokenizer(5)
    )
    assert len(short[1]["tokens"]) == 5 and short[1]["labels"][1] != CROSS_ENTROPY_IGNORE_IDX


def test_split_slicing_and_named_splits_of_a_directory(tmp_path: Path) -> None:
    source = write(records(20), tmp_path / "all.jsonl")
    tok = tokenizer()

    def answers(dataset: Any) -> list[str]:
        return [dataset.records[i]["answer"] for i in range(len(dataset))]

    sliced = data(
        "dataset=instruct",
        f"dataset.source={source}",
        *RENAMED,
        "dataset.split='train[:25%]'",
        "dataset.validation.split='train[-3:]'",
    )
    assert answers(train_dataset(sliced, tok)) == [f"a{i}" for i in range(5)]
    assert answers(validation_split(sliced, tok)) == ["a17", "a18", "a19"]
    # A directory split by file names, as hub repositories are.
    repo = tmp_path / "repo"
    write(records(6), repo / "data" / "train-00000-of-00001.parquet")
    write(records(2), repo / "data" / "validation-00000-of-00001.parquet")
    (repo / "README.md").write_text("# not data\n")
    named = data(
        "dataset=instruct",
        f"dataset.source={repo}",
        *RENAMED,
        "dataset.validation.split=validation",
    )
    assert named["format"] == "parquet"
    assert check_datasets(named, tok) == {"train": 6, "validation": 2}
    with pytest.raises(UserError) as err:
        check_datasets({**named, "split": "test"}, tok)
    assert err.value.key == "dataset.split" and "['train', 'validation']" in err.value.fix


def test_held_out_validation_is_seeded_and_disjoint(tmp_path: Path) -> None:
    source = write(records(40), tmp_path / "all.jsonl")
    tok = tokenizer()
    base = ["dataset=instruct", f"dataset.source={source}", *RENAMED]
    held = data(*base, "dataset.validation.held_out=10%")
    train, validation = training_splits(held, tok, validation=True)
    picked = {validation.records[i]["answer"] for i in range(len(validation))}
    kept = {train.records[i]["answer"] for i in range(len(train))}
    assert len(picked) == 4 and len(kept) == 36 and not picked & kept
    again = validation_split(data(*base, "dataset.validation.held_out=0.1"), tok)
    assert {again.records[i]["answer"] for i in range(4)} == picked
    other = validation_split(
        data(*base, "dataset.validation.held_out=10%", "dataset.validation.seed=1"), tok
    )
    assert {other.records[i]["answer"] for i in range(4)} != picked
    assert validation_split(data(*base), tok) is None
    with pytest.raises(UserError) as err:
        data(*base, "dataset.validation.held_out=5%", "dataset.validation.split=train")
    assert err.value.key == "dataset.validation.held_out" and "not both" in err.value.fix


def test_a_process_reads_each_split_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The recipe's one call reads the training split once, whatever validation comes from."""
    source = write(records(20), tmp_path / "all.jsonl")
    tok = tokenizer()
    base = ["dataset=instruct", f"dataset.source={source}", *RENAMED]
    read = []
    load_records = checks.load_records

    def counted(**spec: Any) -> Any:
        read.append(spec["split"])
        return load_records(**spec)

    monkeypatch.setattr(checks, "load_records", counted)
    named = data(*base, "dataset.split='train[:15]'", "dataset.validation.split='train[15:]'")
    train, validation = training_splits(named, tok, validation=True)
    assert read == ["train[:15]", "train[15:]"] and (len(train), len(validation)) == (15, 5)
    read.clear()
    held = data(*base, "dataset.validation.held_out=10%", "dataset.packing=true")
    train, validation = training_splits(held, tok, validation=True)
    assert read == ["train"] and len(validation) == 2
    read.clear()
    assert training_splits(named, tok, validation=False)[1] is None and read == ["train[:15]"]


# ---- train_on_input, system prompt, chat ----------------------------------------------------
def test_train_on_input_and_new_system_prompt(tmp_path: Path) -> None:
    source = write(records(3), tmp_path / "d.jsonl")
    tok = tokenizer()
    base = ["dataset=instruct", f"dataset.source={source}", *RENAMED]
    answer_only = train_dataset(data(*base), tok)[0]
    with_input = train_dataset(data(*base, "dataset.train_on_input=true"), tok)[0]
    assert answer_only["tokens"] == with_input["tokens"]
    assert trained_text(answer_only, tok) == "a0<|eot_id|>"
    assert trained_text(with_input, tok) == "Reverse word 0.\nw0<|eot_id|>a0<|eot_id|>"
    system = train_dataset(data(*base, "dataset.new_system_prompt=Be brief."), tok)[0]
    assert "<|start_header_id|>system<|end_header_id|>\n\nBe brief." in tok.decode(
        system["tokens"], skip_special_tokens=False
    )
    assert trained_text(system, tok) == "a0<|eot_id|>"


CONVERSATION = [
    ("system", "Be nice."),
    ("user", "Hi"),
    ("assistant", "Hello"),
    ("user", "Bye"),
    ("assistant", "Goodbye"),
]
SHAREGPT_ROLES = {"system": "system", "user": "human", "assistant": "gpt"}


def test_chat_in_both_styles(tmp_path: Path) -> None:
    openai = write(
        [{"messages": [{"role": r, "content": c} for r, c in CONVERSATION]}] * 2,
        tmp_path / "openai.jsonl",
    )
    sharegpt = write(
        [{"conversations": [{"from": SHAREGPT_ROLES[r], "value": c} for r, c in CONVERSATION]}] * 2,
        tmp_path / "sharegpt.parquet",
    )
    tok = tokenizer()
    one = train_dataset(data("dataset=chat", f"dataset.source={openai}"), tok)
    two = train_dataset(
        data(
            "dataset=chat",
            f"dataset.source={sharegpt}",
            "dataset.conversation_style=sharegpt",
            "dataset.column_map.messages=conversations",
        ),
        tok,
    )
    assert one[0] == two[0]
    assert trained_text(one[0], tok) == "Hello<|eot_id|>Goodbye<|eot_id|>"
    everything = train_dataset(
        data("dataset=chat", f"dataset.source={openai}", "dataset.train_on_input=true"), tok
    )[0]
    assert (
        trained_text(everything, tok) == "Be nice.<|eot_id|>Hi<|eot_id|>Hello<|eot_id|>"
        "Bye<|eot_id|>Goodbye<|eot_id|>"
    )
    replaced = train_dataset(
        data("dataset=chat", f"dataset.source={openai}", "dataset.new_system_prompt=Be terse."),
        tok,
    )[0]
    text = tok.decode(replaced["tokens"], skip_special_tokens=False)
    assert "Be terse." in text and "Be nice." not in text
    chat = data("dataset=chat", f"dataset.source={openai}", "dataset.validation.split=train")
    prompt = eval_prompts(validation_split(chat, tok), tok, 1)[0]
    assert prompt.reference == "Goodbye"
    assert tok.decode(prompt.tokens, skip_special_tokens=False).endswith(
        "Bye<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
    )


# ---- bad data: one message naming the file, the row and the column ----------------------------
GOOD = {"prompt": "p", "context": "", "answer": "a"}
CHAT_GOOD = {"messages": [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]}
BAD_CELLS = [
    # (kind, rows written as jsonl, extra overrides, row, column, text in the message)
    ("instruct", [GOOD, GOOD, {**GOOD, "answer": 42}], [], 3, "answer", "holds a number ('42')"),
    # Text that looks like a number beside a number: the loader reads the column as pandas does
    # ("5" a number too), and the message named row 1, which holds text.
    (
        "instruct",
        [{**GOOD, "answer": "5"}, GOOD, {**GOOD, "answer": 42}],
        [],
        3,
        "answer",
        "holds a number ('42')",
    ),
    ("instruct", [GOOD, {**GOOD, "prompt": None}, GOOD], [], 2, "prompt", "holds null"),
    ("chat", [CHAT_GOOD, {"messages": "hello"}], [], 2, "messages", "not a list of"),
    (
        "chat",
        [
            CHAT_GOOD,
            CHAT_GOOD,
            {
                "messages": [
                    {"role": "user", "content": "u"},
                    {"role": "assistant", "content": None},
                ]
            },
        ],
        [],
        3,
        "messages",
        "message 2's 'content' is null",
    ),
    (
        "chat",
        [{"messages": [{"role": "bot", "content": "x"}]}],
        [],
        1,
        "messages",
        "role='bot'",
    ),
    (
        "chat",
        [CHAT_GOOD, {"messages": [{"role": "user", "content": "u"}]}],
        [],
        2,
        "messages",
        "no assistant message",
    ),
    (
        "chat",
        [CHAT_GOOD],
        ["dataset.conversation_style=sharegpt"],
        1,
        "messages",
        "sharegpt style",
    ),
]


@pytest.mark.parametrize(
    ("kind", "rows", "extra", "row", "column", "problem"),
    BAD_CELLS,
    ids=[f"{c[0]}-{c[5]}" for c in BAD_CELLS],
)
def test_a_bad_cell_names_file_row_and_column(tmp_path, kind, rows, extra, row, column, problem):
    path = tmp_path / "bad.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    renamed = RENAMED if kind == "instruct" else []
    with pytest.raises(DataError) as err:
        check_datasets(
            data(f"dataset={kind}", f"dataset.source={path}", *renamed, *extra), tokenizer()
        )
    assert (err.value.file, err.value.row, err.value.column) == (str(path), row, column)
    message = str(err.value)
    assert f"dataset.source='{path}': row {row}, column {column!r}: " in message, message
    assert problem in message, message


def test_a_bad_row_in_a_later_file_of_a_directory(tmp_path: Path) -> None:
    write(records(5), tmp_path / "d" / "part-0.csv")
    bad = write(
        [*records(3), {"prompt": None, "context": "x", "answer": "y"}],
        tmp_path / "d" / "part-1.csv",
    )
    with pytest.raises(DataError) as err:
        check_datasets(
            data("dataset=instruct", f"dataset.source={tmp_path / 'd'}", *RENAMED), tokenizer()
        )
    assert (err.value.file, err.value.row, err.value.column) == (str(bad), 4, "prompt")
    assert f"{bad} row 4, column 'prompt': holds null" in str(err.value)


def test_no_trainable_token_after_truncation(tmp_path: Path) -> None:
    rows = [*records(3), {"prompt": "x" * 60, "context": "", "answer": "y"}, *records(2)]
    path = write(rows, tmp_path / "long.jsonl")
    base = ["dataset=instruct", f"dataset.source={path}", *RENAMED, "dataset.max_seq_len=48"]
    with pytest.raises(DataError) as err:
        check_datasets(data(*base), tokenizer(48))
    assert (err.value.row, err.value.column) == (4, "prompt, context")
    assert err.value.key == "dataset.max_seq_len" and "raise dataset.max_seq_len" in str(err.value)
    # Training on the prompt too leaves tokens to train on.
    assert check_datasets(data(*base, "dataset.train_on_input=true"), tokenizer(48))["train"] == 6


def test_missing_column_and_empty_splits(tmp_path: Path) -> None:
    path = write(records(4), tmp_path / "d.jsonl")
    tok = tokenizer()
    with pytest.raises(UserError) as err:
        check_datasets(data("dataset=instruct", f"dataset.source={path}"), tok)
    assert err.value.key == "dataset.column_map.instruction"
    assert str(path) in err.value.fix and "['prompt', 'context', 'answer']" in err.value.fix
    base = ["dataset=instruct", f"dataset.source={path}", *RENAMED]
    with pytest.raises(UserError) as err:
        check_datasets(data(*base, "dataset.split='train[4:]'"), tok)
    assert err.value.key == "dataset.split" and "no records" in err.value.fix
    with pytest.raises(UserError) as err:
        check_datasets(data(*base, "dataset.validation.held_out=10%"), tok)
    assert err.value.key == "dataset.validation.held_out" and "holds out 0 of" in err.value.fix
    assert err.value.value == "10%"  # as typed
    blank = tmp_path / "blank.txt"
    blank.write_text("\n  \n\n")
    with pytest.raises(UserError) as err:
        check_datasets(data("dataset=text", f"dataset.source={blank}"), tok)
    assert err.value.key == "dataset.split" and "only blank lines" in err.value.fix
    with pytest.raises(UserError) as err:
        data("dataset=chat")
    assert err.value.key == "dataset.source" and "dataset.source=PATH" in err.value.fix


def test_an_unreadable_file_is_a_user_error(tmp_path: Path) -> None:
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"instruction": "x", "output": "y"}\n{not json\n')
    with pytest.raises(UserError) as err:
        check_datasets(data(f"dataset.source={broken}"), tokenizer())
    assert err.value.key == "dataset.source"
    assert err.value.fix.startswith("line 2, column 2: not valid JSON (Expecting property name")
    # Where no line is at fault, the reader's own message.
    parquet = tmp_path / "broken.parquet"
    parquet.write_bytes(b"not parquet")
    with pytest.raises(UserError) as err:
        check_datasets(data("dataset=instruct", f"dataset.source={parquet}"), tokenizer())
    assert "could not be read as dataset.format=parquet" in err.value.fix


def test_bad_data_stops_runner_train_before_launch(runner_cli, tmp_path: Path) -> None:
    lines = (SAMPLE_DATA_DIR / "train.jsonl").read_text().splitlines()[:50]
    lines[36] = json.dumps({"instruction": "Reverse the word.", "input": 7, "output": "x"})
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join(lines) + "\n")
    out_root = tmp_path / "outputs"
    result = runner_cli("train", f"dataset.source={bad}", f"runtime.output_root={out_root}")
    assert result.returncode == 2, result.stderr[-2000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "Traceback" not in result.stderr
    assert f"dataset.source='{bad}': row 37, column 'input': holds a number ('7')" in errors[0]
    assert not out_root.exists() or not any(out_root.rglob("status.json"))


# ---- packing --------------------------------------------------------------------------------
def test_packing_without_a_row_length_says_it_packs_the_whole_context(caplog) -> None:
    """Null max_seq_len packs rows of the model's whole context: 131,072 tokens a row for a
    Llama 3.2, where the docs ask for max_seq_len with packing."""
    packed = ["dataset=instruct", f"dataset.source={SAMPLE_DATA_DIR / 'validation.jsonl'}"]
    data(*packed, "dataset.packing=true", "dataset.max_seq_len=96")
    assert "dataset.packing" not in caplog.text
    assert data(*packed, "dataset.packing=true")["max_seq_len"] == MODEL_MAX
    assert (
        "dataset.packing=true packs rows of dataset.max_seq_len tokens, left null: the model's "
        f"whole context, {MODEL_MAX} tokens a row" in caplog.text
    )


def test_packed_and_unpacked_batches_give_the_same_per_token_loss(tmp_path: Path) -> None:
    """On a fixed model: the summed loss and the token count of the same samples agree."""
    torch.manual_seed(0)
    # The builder node as resolved: its family supplies the torchtune builder.
    model = instantiate(OmegaConf.create(resolve_model(compose_train([]).model).builder))
    tok = tokenizer(96)
    base = [
        f"dataset.source={SAMPLE_DATA_DIR / 'validation.jsonl'}",
        "dataset.max_seq_len=96",
        "dataset.split='train[:24]'",
    ]
    plain = train_dataset(data(*base), tok)
    packed = train_dataset(data(*base, "dataset.packing=true"), tok)
    assert sum(len(p["seq_lens"]) for p in packed) > len(packed)  # several samples per pack

    def summed(dataset: Any, is_packed: bool) -> tuple[float, int]:
        batch = collate(
            [dataset[i] for i in range(len(dataset))], packed=is_packed, padding_idx=tok.pad_id
        )
        with torch.no_grad():
            logits = model(batch["tokens"], **RowAttention.of(model, CPU).inputs(batch, CPU))
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.size(-1)), batch["labels"].reshape(-1), reduction="sum"
        )
        return loss.item(), int((batch["labels"] != CROSS_ENTROPY_IGNORE_IDX).sum())

    loss_plain, tokens_plain = summed(plain, False)
    loss_packed, tokens_packed = summed(packed, True)
    assert tokens_plain == tokens_packed > 0
    assert loss_packed == pytest.approx(loss_plain, rel=1e-5)


def test_padding_free_batches_train_each_token_as_padded_batches_do(tmp_path: Path) -> None:
    """Samples of mixed lengths packed into one row, attended per sample: every trained
    token's loss the same as padded (attention stays within each sample, positions restart);
    the multiset of per-token losses shows a leak across samples."""
    torch.manual_seed(0)
    model = instantiate(OmegaConf.create(resolve_model(compose_train([]).model).builder))
    tok = tokenizer(256)
    lines = (SAMPLE_DATA_DIR / "validation.jsonl").read_text().splitlines()[:60]
    words = [json.loads(line)["input"] for line in lines]
    rows = [
        {"instruction": "Reverse:", "input": " ".join(words[:n]), "output": words[n]}
        for n in (40, 3, 17, 1, 9, 25, 2, 12)
    ]
    source = write(rows, tmp_path / "mixed.jsonl")
    samples = list(train_dataset(data(f"dataset.source={source}"), tok))
    attention = RowAttention.of(model, CPU)  # per sample, in one row

    def token_losses(padding_free: bool) -> tuple[torch.Tensor, int]:
        batch = collate(
            samples,
            packed=False,
            padding_free=padding_free,
            padding_idx=tok.pad_id,
            row_limit=attention.row_limit,
        )
        with torch.no_grad():
            logits = model(batch["tokens"], **attention.inputs(batch, CPU))
        labels = batch["labels"].reshape(-1)
        trained = labels != CROSS_ENTROPY_IGNORE_IDX
        each = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.size(-1))[trained], labels[trained], reduction="none"
        )
        return each.sort().values, batch["tokens"].shape[0]

    padded, padded_rows = token_losses(False)
    packed, packed_rows = token_losses(True)
    assert padded_rows == len(samples) and packed_rows == 1
    # The same tokens; float32 sums in another order (other row shapes): 1e-5 relative.
    assert packed.shape == padded.shape
    torch.testing.assert_close(packed, padded, rtol=1e-5, atol=1e-5)


def test_training_with_packing_through_the_cli(runner_cli, tmp_path: Path) -> None:
    run = tmp_path / "run"
    result = runner_cli(
        "train",
        "compute=cpu",
        "dtype=fp32",
        "max_steps=6",
        "batch_size=4",
        "dataset.packing=true",
        "dataset.max_seq_len=256",
        "dataset.eval_samples=0",
        "runtime.log_every_n_steps=1",
        "runtime.save_every_n_steps=null",
        "runtime.progress_bar=false",
        "runtime.loggers=[]",
        f"hydra.run.dir={run}",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    found = losses(run)
    assert len(found) == 6 and all(map(torch.isfinite, torch.tensor(list(found.values()))))
    assert found[6] < found[1]
    # torchtune's "Packing dataset" bar filled the console; a line of the log says it instead.
    assert "Packing dataset" not in result.stderr
    assert re.search(
        r"data: 32000 samples packed into \d+ rows of 256 tokens", (run / "train.log").read_text()
    )
