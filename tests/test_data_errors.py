"""Bad data: one message naming the file, the row and the column, before anything trains."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from runner.data import DataError, check_datasets
from runner.errors import UserError
from runner.models.tokenizer import ChatTokenizer
from runner.paths import SAMPLE_DATA_DIR, TINY_TOKENIZER_DIR
from tests.conftest import files_limited_to
from tests.fixtures import write_family_tokenizer
from tests.test_data import (
    RENAMED,
    data,
    records,
    tokenizer,
    write,
)

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
    # A number among texts: Arrow held it as JSON text, which passed for text, and trained.
    (
        "chat",
        [CHAT_GOOD, {"messages": [CHAT_GOOD["messages"][0], {"role": "assistant", "content": 5}]}],
        [],
        2,
        "messages",
        "message 2's 'content' is a number ('5'), not text",
    ),
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
    # Valid OpenAI data that runner does not train: said so, not taken for a malformed file.
    (
        "chat",
        [
            CHAT_GOOD,
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "text", "text": "What is this?"},
                            {"type": "image_url", "image_url": {"url": "https://x/y.png"}},
                        ],
                    },
                    {"role": "assistant", "content": "a cat"},
                ]
            },
        ],
        [],
        2,
        "messages",
        "message 1's 'content' holds a part of type 'image_url'; only text parts",
    ),
    (
        "chat",
        [
            {
                "messages": [
                    CHAT_GOOD["messages"][0],
                    {"role": "assistant", "content": None, "tool_calls": [{"id": "c1"}]},
                    {"role": "tool", "content": "42", "tool_call_id": "c1"},
                    {"role": "assistant", "content": "42"},
                ]
            }
        ],
        [],
        1,
        "messages",
        "message 2 is a tool call or its result (its 'tool_calls'); tool calls are not supported",
    ),
    (
        "chat",
        [{"messages": [CHAT_GOOD["messages"][0], {"role": "tool", "content": "42"}]}],
        [],
        1,
        "messages",
        "message 2 is a tool call or its result (role='tool'); tool calls are not supported",
    ),
    (
        "chat",
        [{"conversations": [{"from": "human", "value": [{"type": "text", "text": "u"}]}]}],
        ["dataset.conversation_style=sharegpt", "dataset.column_map.messages=conversations"],
        1,
        "conversations",
        "message 1's 'value' is a list",
    ),
    # OpenAI's fine-tuning weight: 0 or 1, on an assistant message; something to train.
    *[
        (
            "chat",
            [
                CHAT_GOOD,
                {"messages": [CHAT_GOOD["messages"][0], {**CHAT_GOOD["messages"][1], **weight}]},
            ],
            [],
            2,
            "messages",
            problem,
        )
        for weight, problem in (
            ({"weight": 2}, "message 2's 'weight' is a number ('2'); give 0 (not trained) or 1"),
            ({"weight": "0"}, "message 2's 'weight' is text ('0'); give 0"),
            ({"weight": 0}, "has only assistant messages of weight 0, so nothing to train on"),
        )
    ],
    (
        "chat",
        [{"messages": [{**CHAT_GOOD["messages"][0], "weight": 1}, CHAT_GOOD["messages"][1]]}],
        [],
        1,
        "messages",
        "message 1 is a user message with a 'weight' (1); only an assistant message has one",
    ),
    # A message's speaker (OpenAI's `name`) reaches the chat template: text, or none.
    *[
        (
            "chat",
            [
                {
                    "messages": [
                        {**CHAT_GOOD["messages"][0], "name": "alice"},
                        CHAT_GOOD["messages"][1],
                    ]
                },
                {
                    "messages": [
                        {**CHAT_GOOD["messages"][0], "name": name},
                        CHAT_GOOD["messages"][1],
                    ]
                },
            ],
            [],
            2,
            "messages",
            problem,
        )
        for name, problem in (
            (5, "message 1's 'name' is a number ('5'); give the speaker's name as text, or none"),
            ({"first": "Al"}, "message 1's 'name' is an object"),
        )
    ],
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


def test_a_default_system_prompt_counts_toward_the_prompt_that_fills_the_sample(tmp_path):
    """A template that writes its default system prompt where a conversation has none (Qwen
    2.5's, here on the fixture's coarse vocabulary): the check measured the template on a
    conversation with an empty system message, which leaves it out, and passed a sample whose
    prompt fills max_seq_len."""
    write_family_tokenizer("qwen2_5", tmp_path / "qwen")
    tok = ChatTokenizer(str(tmp_path / "qwen"), 64)
    conversation = [{"role": "user", "content": "~" * 7}, {"role": "assistant", "content": "ok"}]
    path = write([CHAT_GOOD, {"messages": conversation}], tmp_path / "chat.jsonl")
    with pytest.raises(DataError) as err:
        check_datasets(
            data("dataset=chat", f"dataset.source={path}", "dataset.max_seq_len=64"), tok
        )
    assert (err.value.key, err.value.row) == ("dataset.max_seq_len", 2), str(err.value)
    assert "no token is left to train on after truncation to 64 tokens" in str(err.value)


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


def test_a_file_of_another_kinds_columns_names_that_dataset(tmp_path: Path) -> None:
    """A chat file given to the default dataset (instruct's columns) was told to map a column
    to `instruction`, which no mapping of a `messages` column can give."""
    chat = write([CHAT_GOOD], tmp_path / "chat.jsonl")
    with pytest.raises(UserError) as err:
        check_datasets(data(f"dataset.source={chat}"), tokenizer())
    assert err.value.fix.endswith(
        "its columns are ['messages']; they are those of dataset=chat: give dataset=chat, or map "
        "it with dataset.column_map.instruction=<column>"
    ), err.value.fix


def test_an_unreadable_file_is_a_user_error(tmp_path: Path) -> None:
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"instruction": "x", "output": "y"}\n{not json\n')
    with pytest.raises(UserError) as err:
        check_datasets(data(f"dataset.source={broken}"), tokenizer())
    assert err.value.key == "dataset.source"
    assert err.value.fix.startswith("line 2, column 2: not valid JSON (Expecting property name")
    # Compressed, the line is found in the text (it was "line 1: byte 0x8b", gzip's header).
    packed = tmp_path / "broken.jsonl.gz"
    packed.write_bytes(gzip.compress(broken.read_bytes()))
    with pytest.raises(UserError) as err:
        check_datasets(data(f"dataset.source={packed}"), tokenizer())
    assert err.value.fix.startswith("line 2, column 2: not valid JSON (Expecting property name")
    empty = tmp_path / "empty.jsonl.gz"  # gzip of nothing: 20 bytes, which datasets stopped on
    empty.write_bytes(gzip.compress(b""))
    with pytest.raises(UserError, match="has no records; give a data file that holds some"):
        check_datasets(data(f"dataset.source={empty}"), tokenizer())
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


def test_a_cache_that_cannot_take_a_file_is_one_line(tmp_path: Path, monkeypatch) -> None:
    """A read-only or full home (clusters, containers) failed every run, the shipped data's too,
    in a 40-line traceback from `datasets`' cache. A file-size limit fails the cache's write
    as a full disk does (EFBIG for ENOSPC; Python ignores SIGXFSZ)."""

    import datasets

    from runner.data import sources

    data = tmp_path / "train.jsonl"
    record = {"instruction": "x" * 50, "input": "", "output": "y" * 50}
    data.write_text((json.dumps(record) + "\n") * 2000)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "cache"))
    with files_limited_to(16384):
        with pytest.raises(UserError) as raised:
            sources._read_if_any("dataset.source", str(data), "json", [str(data)])
    assert str(raised.value) == (
        f"dataset.source='{data}': datasets could not write its cache {tmp_path / 'cache'} "
        "(File too large); free space there, or set HF_DATASETS_CACHE (or HF_HOME) to a "
        "directory with room that this user may write"
    )


SYSTEM_CHAT = {"messages": [{"role": "system", "content": "Be brief."}, *CHAT_GOOD["messages"]]}


@pytest.mark.parametrize(
    ("family", "problem"),
    [
        (
            "gemma2",
            "refuses a conversation of roles ['system', 'user', 'assistant'] "
            "(TemplateError: System role not supported)",
        ),
        (
            "mistral",
            "leaves the system message out of a conversation of roles "
            "['system', 'user', 'assistant'], so it would train without it",
        ),
    ],
)
def test_a_conversation_the_chat_template_refuses_or_cuts_is_named_before_training(
    tmp_path: Path, family: str, problem: str
) -> None:
    """Gemma 2's template raised on the row only when training drew it (the run failed there,
    naming no row); Mistral's left its system message out of every sample, silently."""
    write_family_tokenizer(family, tmp_path / family)
    tok = ChatTokenizer(str(tmp_path / family))
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in [CHAT_GOOD] * 5 + [SYSTEM_CHAT] * 2))
    with pytest.raises(DataError) as err:
        check_datasets(data("dataset=chat", f"dataset.source={path}"), tok)
    assert (err.value.file, err.value.row, err.value.column) == (str(path), 6, "messages")
    assert problem in str(err.value) and "drop such rows' system message" in str(err.value)
    assert "model.chat_template=" in str(err.value)
    # The system message new_system_prompt puts first, in instruct data too.
    instruct = write(records(3), tmp_path / "instruct.jsonl")
    prompt = ["dataset.new_system_prompt=Be brief.", *RENAMED]
    with pytest.raises(DataError) as err:
        check_datasets(data("dataset=instruct", f"dataset.source={instruct}", *prompt), tok)
    assert (err.value.row, err.value.column) == (1, "prompt, context")
    assert "set dataset.new_system_prompt=null" in str(err.value)
    # The rows without a system message are taken.
    sliced = data("dataset=chat", f"dataset.source={path}", "dataset.split='train[:5]'")
    assert check_datasets(sliced, tok)["train"] == 5


def test_a_template_that_refuses_a_name_is_met_on_the_first_named_row(tmp_path: Path) -> None:
    """The template renders one row of each sequence of roles and of named messages: a row
    whose only difference is a name the template refuses is named before training, not met
    when training draws it."""
    template = tmp_path / "nameless.jinja"
    template.write_text(
        "{% for m in messages %}{% if m['name'] is defined %}"
        "{{ raise_exception('no names, please') }}{% endif %}"
        "{{ m['role'] }}: {{ m['content'] }}<|eot_id|>{% endfor %}"
    )
    tok = ChatTokenizer(str(TINY_TOKENIZER_DIR), chat_template=str(template))
    named = {"messages": [{**CHAT_GOOD["messages"][0], "name": "alice"}, CHAT_GOOD["messages"][1]]}
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in [CHAT_GOOD] * 2 + [named]))
    with pytest.raises(DataError) as err:
        check_datasets(data("dataset=chat", f"dataset.source={path}"), tok)
    assert (err.value.row, err.value.column) == (3, "messages")
    assert "(TemplateError: no names, please)" in str(err.value)


def test_a_system_message_written_after_every_answer_trains_none_and_is_refused(
    tmp_path: Path,
) -> None:
    """Mistral's template writes the system message into the last user turn: a conversation
    that ends with one holds it, after every answer, where no trained token sees it."""
    write_family_tokenizer("mistral", tmp_path / "mistral")
    tok = ChatTokenizer(str(tmp_path / "mistral"))
    ending = {"messages": [*SYSTEM_CHAT["messages"], {"role": "user", "content": "More?"}]}
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in [CHAT_GOOD, ending]))
    with pytest.raises(DataError) as err:
        check_datasets(data("dataset=chat", f"dataset.source={path}"), tok)
    assert err.value.row == 2 and "leaves the system message out" in str(err.value)


def test_a_template_that_does_not_compile_is_the_templates_error_not_a_rows(
    tmp_path: Path,
) -> None:
    """It read "row 1, column 'messages': ... (TemplateSyntaxError ...); fix or drop the row"."""
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}{{ m.content }")
    tok = ChatTokenizer(str(TINY_TOKENIZER_DIR), chat_template=str(broken))
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps(CHAT_GOOD) + "\n")
    with pytest.raises(UserError) as refused:
        check_datasets(data("dataset=chat", f"dataset.source={path}"), tok)
    assert not isinstance(refused.value, DataError) and refused.value.key == "model.chat_template"
    assert "TemplateSyntaxError" in str(refused.value)
