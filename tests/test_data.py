"""Datasets: every format and kind reads through the real config (bad data: test_data_errors.py;
packing: test_packing.py)."""

from __future__ import annotations

import bz2
import gzip
import json
import lzma
from dataclasses import asdict
from pathlib import Path
from typing import Any
from xml.etree import ElementTree

import datasets
import pytest
import torch

from runner.config.dataset import resolve_dataset
from runner.data import (
    FORMATS,
    DataError,
    check_datasets,
    checks,
    eval_prompts,
    train_dataset,
    training_splits,
)
from runner.errors import UserError
from runner.models.tokenizer import ChatTokenizer
from runner.models.torchtune_boundary import CROSS_ENTROPY_IGNORE_IDX
from runner.paths import SAMPLE_DATA_DIR, TINY_TOKENIZER_DIR
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


def write_jsonl(rows: list[dict[str, Any]], path: Path) -> Path:
    """`rows` as JSON lines, as written: values of mixed types too, which a table cannot hold."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
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
    # Text that pandas takes for null by default: a CSV made an answer "NA" (Namibia's code)
    # null, refused, and dropped an input "None" from its prompt.
    for row, column, text in ((1, "answer", "NA"), (2, "context", "None"), (4, "answer", "nan")):
        rows[row][column] = text
    rows[5]["context"], rows[7]["answer"] = "N/A", "null"
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
    # A CSV saved with a byte-order mark (Excel's "CSV UTF-8") was refused: its first column
    # read as "\ufeffprompt".
    marked = tmp_path / "marked.csv"
    marked.write_bytes(b"\xef\xbb\xbf" + (tmp_path / "data.csv").read_bytes())
    train = train_dataset(data("dataset=instruct", f"dataset.source={marked}", *RENAMED), tok)
    samples["marked.csv"] = [train[i] for i in range(len(train))]
    # Compressed files, read decompressed as datasets reads them (a CSV's header was read
    # compressed, and refused as "not UTF-8").
    for name, compress in (
        ("data.jsonl.gz", gzip.compress),
        ("data.csv.bz2", bz2.compress),
        ("data.xml.xz", lzma.compress),
    ):
        packed = tmp_path / name
        packed.write_bytes(compress((tmp_path / name.rsplit(".", 1)[0]).read_bytes()))
        train = train_dataset(data("dataset=instruct", f"dataset.source={packed}", *RENAMED), tok)
        samples[name] = [train[i] for i in range(len(train))]
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
    # In a default namespace, elements and attributes go by their local names (the file had
    # no <item>, and its fields were named "{urn:x}answer").
    # Another namespace's field of the same local name is another field (it overwrote the
    # record's own).
    spaced = tmp_path / "spaced.xml"
    spaced.write_text(
        nested.read_text()
        .replace("<export>", '<export xmlns="urn:x" xmlns:m="urn:m">')
        .replace("</answer>", "</answer><m:answer>draft</m:answer>")
    )
    got = train_dataset(
        data("dataset=instruct", f"dataset.source={spaced}", "dataset.xml.record=item", *RENAMED),
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
    # Saved with a byte-order mark (Notepad's), which began the first record.
    txt.write_bytes(b"\xef\xbb\xbf" + ("\n".join(lines) + "\n").encode())
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
    # A percent slice's rounding, as datasets takes it (it was refused): 33% of 150 rows.
    longer = write(records(150), tmp_path / "longer.jsonl")
    for rounding, rows in (("closest", 50), ("pct1_dropremainder", 33)):
        rounded = {**sliced, "source": str(longer), "split": f"train[:33%]({rounding})"}
        taken = datasets.load_dataset("json", data_files=str(longer), split=rounded["split"])
        assert len(train_dataset(rounded, tok)) == rows == len(taken)
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


def test_a_directory_is_split_as_its_dataset_cards_configs_say(tmp_path: Path) -> None:
    """README.md's `configs:` name each split's files, as `datasets` reads a repository: split
    by file name alone, the validation file was trained on."""
    rows = records(36)
    write(rows[:30], tmp_path / "repo" / "alpha.jsonl")
    write(rows[30:], tmp_path / "repo" / "beta.jsonl")
    card = tmp_path / "repo" / "README.md"
    card.write_text(
        "---\nconfigs:\n- config_name: default\n  data_files:\n  - split: train\n"
        "    path: alpha.jsonl\n  - split: validation\n    path: beta.jsonl\n---\n# A card\n"
    )
    given = ["dataset=instruct", f"dataset.source={tmp_path / 'repo'}", *RENAMED]
    found = check_datasets(data(*given, "dataset.validation.split=validation"), tokenizer())
    expected = datasets.load_dataset(str(tmp_path / "repo"))
    assert found == {"train": 30, "validation": 6} == {k: len(v) for k, v in expected.items()}
    # A card's only config is its default, whatever its name.
    card.write_text(card.read_text().replace("config_name: default", "config_name: first"))
    assert check_datasets(data(*given, "dataset.validation.split=validation"), tokenizer()) == found
    two = "---\nconfigs:\n- config_name: a\n  data_files: alpha.jsonl\n- config_name: b\n"
    card.write_text(two + "  data_files: beta.jsonl\n---\n")
    with pytest.raises(UserError, match=r"names the configs \['a', 'b'\] and no default"):
        check_datasets(data(*given), tokenizer())
    # A config's data_dir holds its files (every file there, none naming a split, is train).
    write(rows[:5], tmp_path / "repo" / "sub" / "part1.jsonl")
    write(rows[5:8], tmp_path / "repo" / "sub" / "part2.jsonl")
    card.write_text("---\nconfigs:\n- config_name: default\n  data_dir: sub\n---\n")
    expected = datasets.load_dataset(str(tmp_path / "repo"))
    assert (
        check_datasets(data(*given), tokenizer())
        == {"train": 8}
        == {k: len(v) for k, v in expected.items()}
    )


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


def test_the_default_dataset_with_a_source_of_yours_evaluates_on_yours_alone(
    tmp_path: Path,
) -> None:
    """`runner train dataset.source=mine.csv` (the default dataset, sample, with the user's
    file) read it as JSON (the sample's format), evaluated on the sample's held-out words, and
    refused a held_out of the user's as a second validation set."""
    source = write(records(40), tmp_path / "mine.csv")
    tok = tokenizer()
    sample = data()
    assert sample["validation"]["source"] == str(SAMPLE_DATA_DIR / "validation.jsonl")
    assert data(f"dataset.source={SAMPLE_DATA_DIR / 'train.jsonl'}") == sample
    mine = data(f"dataset.source={source}", *RENAMED)
    assert mine["format"] == "csv" and validation_split(mine, tok) is None
    held = data(f"dataset.source={source}", *RENAMED, "dataset.validation.held_out=10%")
    train, validation = training_splits(held, tok, validation=True)
    assert (len(train), len(validation)) == (36, 4)


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
    # An empty prompt is none, as instruct data read it; its checkpoint was served an empty one.
    assert data(*base, "dataset.new_system_prompt=''")["new_system_prompt"] is None


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
    chat = data(
        "dataset=chat",
        f"dataset.source={openai}",
        "dataset.split='train[:1]'",
        "dataset.validation.split='train[1:]'",  # the same conversation, in its second record
    )
    prompt = eval_prompts(validation_split(chat, tok), tok, 1)[0]
    assert prompt.reference == "Goodbye"
    assert tok.decode(prompt.tokens, skip_special_tokens=False).endswith(
        "Bye<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
    )


def parts(*texts: str) -> list[dict[str, str]]:
    return [{"type": "text", "text": text} for text in texts]


def test_openai_text_parts_train_as_the_server_joins_them(tmp_path: Path) -> None:
    """Content as OpenAI's list of text parts (which runner deploy takes) was refused as "a
    list, not text"; it trains as the same text given as a string does, whole or streamed."""
    from runner.data.stream import START, StreamSplit
    from runner.deploy.protocol import ChatMessage

    text = [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello"}]
    split = [
        {"role": "user", "content": parts("Hi", " there")},
        {"role": "assistant", "content": parts("Hel", "lo")},
    ]
    served = [ChatMessage.model_validate(m).as_template_input()["content"] for m in split]
    assert served == ["Hi there", "Hello"]
    path = write_jsonl([{"messages": text}, {"messages": split}], tmp_path / "d" / "chat.jsonl")
    tok = tokenizer()
    whole = train_dataset(data("dataset=chat", f"dataset.source={path}"), tok)
    assert whole[0] == whole[1] and trained_text(whole[1], tok) == "Hello<|eot_id|>"
    stream = data("dataset=chat", f"dataset.source={path.parent}", "dataset.streaming=true")
    samples = StreamSplit(stream, tok, reader=0, readers=1, seed=0).samples(START, lambda n: True)
    first, second = (next(samples)[0] for _ in range(2))
    assert first["tokens"] == second["tokens"] == whole[0]["tokens"]


def test_an_assistant_message_of_weight_0_stays_in_the_conversation_untrained(tmp_path):
    """OpenAI's fine-tuning format marks an answer not to train with weight 0: it trained."""
    conversation = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "BAD", "weight": 0},
        {"role": "user", "content": "Again"},
        {"role": "assistant", "content": "Good", "weight": 1},
        {"role": "user", "content": "Bye"},
        {"role": "assistant", "content": "WORSE", "weight": 0},
    ]
    path = write_jsonl([{"messages": conversation}] * 2, tmp_path / "chat.jsonl")
    tok = tokenizer()
    # With a system message of the data's, which new_system_prompt replaces: the weights keep to
    # their messages (the transform drops that one and puts its own first).
    system = [{"role": "system", "content": "Old."}, *conversation]
    replaced = write_jsonl([{"messages": system}], tmp_path / "system.jsonl")
    prompt = ["dataset=chat", f"dataset.source={replaced}", "dataset.new_system_prompt=New."]
    sample = train_dataset(data(*prompt), tok)[0]
    assert trained_text(sample, tok) == "Good<|eot_id|>"
    for extra in ([], ["dataset.train_on_input=true"]):
        sample = train_dataset(data("dataset=chat", f"dataset.source={path}", *extra), tok)[0]
        assert "BAD" not in trained_text(sample, tok) and "Good<|eot_id|>" in trained_text(
            sample, tok
        )
        assert "BAD<|eot_id|>" in tok.decode(sample["tokens"], skip_special_tokens=False)
    chat = data(
        "dataset=chat",
        f"dataset.source={path}",
        "dataset.split='train[:1]'",
        "dataset.validation.split='train[1:]'",
    )
    assert eval_prompts(validation_split(chat, tok), tok, 1)[0].reference == "Good"


# The tiny tokenizer's template, writing each message's speaker where it has one.
NAMED_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}"
    "{% if m['name'] is defined %} ({{ m['name'] }}){% endif %}<|end_header_id|>\n\n"
    "{{ m['content'] }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)


def test_a_messages_name_reaches_the_chat_template_as_the_server_gives_it(tmp_path: Path):
    """OpenAI's `name` of a message (its speaker) was dropped in training, though `runner
    deploy` gives it to the template: the model trained on other text than it was served. The
    name is the template's text, not the message's: it never trains."""
    from transformers import AutoTokenizer

    from runner.deploy.protocol import ChatMessage
    from runner.deploy.routes import _render_chat

    conversation = [
        {"role": "system", "content": "Be nice."},
        {"role": "user", "name": "alice", "content": "Hi"},
        {"role": "assistant", "name": "bot", "content": "Hello"},
        {"role": "user", "content": "Bye"},  # read with "name": null, as the reader fills keys
        {"role": "assistant", "content": "Goodbye"},
    ]
    path = write_jsonl([{"messages": conversation}] * 2, tmp_path / "chat.jsonl")
    template = tmp_path / "named.jinja"
    template.write_text(NAMED_TEMPLATE)
    tok = ChatTokenizer(str(TINY_TOKENIZER_DIR), MODEL_MAX, str(template))
    served = AutoTokenizer.from_pretrained(TINY_TOKENIZER_DIR)
    served.chat_template = NAMED_TEMPLATE
    chat = data("dataset=chat", f"dataset.source={path}")
    sample = train_dataset(chat, tok)[0]
    text = tok.decode(sample["tokens"], skip_special_tokens=False)
    assert "<|start_header_id|>user (alice)<|end_header_id|>\n\nHi<|eot_id|>" in text
    assert "<|start_header_id|>assistant (bot)<|end_header_id|>\n\nHello<|eot_id|>" in text
    assert "<|start_header_id|>user<|end_header_id|>\n\nBye<|eot_id|>" in text
    assert trained_text(sample, tok) == "Hello<|eot_id|>Goodbye<|eot_id|>"
    everything = train_dataset(
        data("dataset=chat", f"dataset.source={path}", "dataset.train_on_input=true"), tok
    )[0]
    assert "alice" not in trained_text(everything, tok)
    held_out = data(
        "dataset=chat",
        f"dataset.source={path}",
        "dataset.split='train[:1]'",
        "dataset.validation.split='train[1:]'",
    )
    prompt = eval_prompts(validation_split(held_out, tok), tok, 1)[0]
    asked = [ChatMessage.model_validate(m) for m in conversation[:-1]]
    assert prompt.tokens == _render_chat(served, asked)


def test_a_validation_split_holding_training_records_is_refused_where_the_run_evaluates(
    tmp_path: Path,
) -> None:
    """dataset=alpaca dataset.split=train kept the preset's validation.split=train[95%:]: the
    run scored, and chose its best checkpoint by, records it trained on."""
    source = write(
        [{"instruction": f"add {i}", "output": f"{i + 1}"} for i in range(40)], tmp_path / "a.jsonl"
    )
    link = tmp_path / "link.jsonl"
    link.symlink_to(source)
    given = ["dataset=instruct", f"dataset.source={source}", "dataset.column_map.input=null"]
    apart = data(*given, "dataset.split='train[:90%]'", "dataset.validation.split='train[90%:]'")
    assert check_datasets(apart, tokenizer()) == {"train": 36, "validation": 4}
    inside = data(*given, "dataset.split=train", "dataset.validation.split='train[90%:]'")
    with pytest.raises(UserError, match=f"holds records 37 to 40 of {source}") as err:
        check_datasets(inside, tokenizer())
    assert err.value.key == "dataset.validation.split"
    # A run that does not evaluate reads no validation record: nothing to refuse.
    assert check_datasets(inside, tokenizer(), evaluates=False) == {"train": 40, "validation": 4}
    linked = data(*given, f"dataset.validation.source={link}")  # the same file, by a link
    with pytest.raises(UserError, match="holds records 1 to 40") as err:
        check_datasets(linked, tokenizer())
    assert err.value.key == "dataset.validation.source"
    # One shard of a sharded split, named as the validation source, is that split's too:
    # compared as whole lists of files, it passed. Named by its own rows.
    shards = tmp_path / "shards"
    for index, rows in enumerate((range(0, 30), range(30, 50))):
        write([{"instruction": f"add {i}", "output": f"{i + 1}"} for i in rows],
              shards / f"train-0000{index}-of-00002.jsonl")  # fmt: skip
    shard = shards / "train-00001-of-00002.jsonl"
    sharded = ["dataset=instruct", "dataset.column_map.input=null"]
    for train_source, held_source in ((shards, shard), (shard, shards)):
        one_shard = data(
            *sharded,
            f"dataset.source={train_source}",
            f"dataset.validation.source={held_source}",
            "dataset.validation.split=train",
        )
        with pytest.raises(UserError, match=f"holds records 1 to 20 of {shard}"):
            check_datasets(one_shard, tokenizer())
    tail = data(*sharded, f"dataset.source={shards}", "dataset.validation.split='train[45:]'")
    with pytest.raises(UserError, match=f"holds records 16 to 20 of {shard}"):
        check_datasets(tail, tokenizer())
