# ruff: noqa: E501  (the chat templates are quoted as published)
"""Published chat templates through runner's tokenizer: transformers' ids, masks read from the
rendering, history-rewriting templates refused by name, and checkpoints whose template runner
never saw (or that have none) train through the real CLI.

Tokenizers and checkpoints are written by transformers (save_pretrained); the templates are the
published ones, embedded as strings.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from runner.config.model import resolve_model
from runner.deploy.loading import load_tokenizer
from runner.deploy.protocol import ChatMessage
from runner.deploy.routes import _render_chat
from runner.errors import UserError
from runner.models.chat_template import names_role, with_system_prompt
from runner.models.tokenizer import ChatTokenizer
from runner.models.torchtune_boundary import Message
from runner.paths import CONF_DIR, TINY_TOKENIZER_DIR
from tests.conftest import losses
from tests.published_templates import (
    GEMMA3_TEMPLATE,
    GEMMA_TEMPLATE,
    LLAMA3_1_TEMPLATE,
    LLAMA3_2_TEMPLATE,
    MISTRAL_TEMPLATE,
    PHI3_TEMPLATE,
    PHI4_TEMPLATE,
    QWEN2_5_TEMPLATE,
    QWEN3_TEMPLATE,
    SMOLLM2_TEMPLATE,
)

_LLAMA3 = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>"]
_CHATML = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# name -> (template, special tokens, bos, eos, SentencePiece-style spaces, end of an answer)
TEMPLATES = {
    "smollm2": (SMOLLM2_TEMPLATE, _CHATML, "<|im_start|>", "<|im_end|>", False, "<|im_end|>"),
    "qwen2_5": (QWEN2_5_TEMPLATE, _CHATML, None, "<|im_end|>", False, "<|im_end|>"),
    "qwen3": (QWEN3_TEMPLATE, [*_CHATML, "<think>", "</think>"], None, "<|im_end|>", False, "<|im_end|>"),
    "llama3_1": (LLAMA3_1_TEMPLATE, [*_LLAMA3, "<|eot_id|>"], "<|begin_of_text|>", "<|eot_id|>", False, "<|eot_id|>"),
    "llama3_2": (LLAMA3_2_TEMPLATE, [*_LLAMA3, "<|eot_id|>"], "<|begin_of_text|>", "<|eot_id|>", False, "<|eot_id|>"),
    "mistral": (MISTRAL_TEMPLATE, ["<unk>", "<s>", "</s>", "[INST]", "[/INST]"], "<s>", "</s>", True, "</s>"),
    "phi3": (PHI3_TEMPLATE, ["<unk>", "<s>", "</s>", "<|endoftext|>", "<|assistant|>", "<|system|>", "<|user|>", "<|end|>"], "<s>", "<|endoftext|>", True, "<|end|>"),
    "phi4": (PHI4_TEMPLATE, ["<|endoftext|>", "<|im_start|>", "<|im_sep|>", "<|im_end|>"], "<|endoftext|>", "<|im_end|>", False, "<|im_end|>"),
    "gemma3": (GEMMA3_TEMPLATE, ["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>"], "<bos>", "<eos>", True, "<end_of_turn>"),
    "gemma2": (GEMMA_TEMPLATE, ["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>"], "<bos>", "<eos>", True, "<end_of_turn>"),
}  # fmt: skip
CORPUS = [
    "Reverse the word. Uppercase the word. hello olleh fox FOX dog god quick brown",
    "You are a helpful assistant. Answer briefly. Cutting Knowledge Date: December 2023",
    "system user assistant model Today Date: 26 Jul 2024 abcdefghijklmnopqrstuvwxyz",
] * 20
SYSTEM = [("system", "Answer briefly.")]
CHAT = [
    ("user", "Uppercase the word.\nfox"),
    ("assistant", "FOX"),
    ("user", "Reverse the word.\ndog"),
    ("assistant", "god, reversed"),
]


def write_tokenizer(name: str, path: Path, with_template: bool = True) -> Path:
    """A small BPE tokenizer with `name`'s special tokens and chat template, saved by
    transformers (tokenizer.json, tokenizer_config.json and the template)."""
    template, special, bos, eos, metaspace, _ = TEMPLATES[name]
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>" if metaspace else None))
    if metaspace:
        tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
        tokenizer.decoder = decoders.Metaspace(prepend_scheme="first")
        alphabet = ["▁", *(chr(c) for c in range(32, 127)), "\n"]
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = decoders.ByteLevel()
        alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(
        vocab_size=360, special_tokens=special, initial_alphabet=alphabet, show_progress=False
    )
    tokenizer.train_from_iterator(CORPUS, trainer)
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=bos,
        eos_token=eos,
        chat_template=template if with_template else None,
    )
    hf.save_pretrained(str(path))
    return path


def write_llama_checkpoint(name: str, path: Path, with_template: bool = True) -> Path:
    """A tiny Llama-architecture checkpoint carrying `name`'s tokenizer (SmolLM2's layout)."""
    write_tokenizer(name, path, with_template)
    vocab = len(AutoTokenizer.from_pretrained(path))
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        rope_theta=10000.0,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)
    return path


def to_messages(chat: list[tuple[str, str]]) -> list[Message]:
    return [Message(role=role, content=text, masked=role != "assistant") for role, text in chat]


def to_dicts(chat: list[tuple[str, str]]) -> list[dict[str, str]]:
    return [{"role": role, "content": text} for role, text in chat]


def trained_runs(tok: ChatTokenizer, tokens: list[int], mask: list[bool]) -> list[str]:
    """The text of each run of consecutive trained tokens."""
    runs, run = [], []
    for token, masked in [*zip(tokens, mask, strict=True), (None, True)]:
        if not masked:
            run.append(token)
        elif run:
            runs, run = [*runs, tok.decode(run, skip_special_tokens=False)], []
    return runs


@pytest.fixture(scope="module")
def tokenizers_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("templates")
    for name in TEMPLATES:
        write_tokenizer(name, root / name)
    return root


@pytest.mark.parametrize("name", [n for n in TEMPLATES if n != "qwen3"])
@pytest.mark.parametrize("system", [False, True], ids=["no system", "system"])
def test_ids_and_masks_of_published_templates(tokenizers_dir: Path, name: str, system: bool):
    ours = ChatTokenizer(str(tokenizers_dir / name))
    hf = AutoTokenizer.from_pretrained(tokenizers_dir / name)
    kwargs = {"date_string": ours.date_string} if ours.date_string else {}
    chat = SYSTEM + CHAT if system else CHAT
    if name == "gemma2" and system:
        # Gemma 2's template refuses a system message; so do we, naming the template's reason.
        with pytest.raises(UserError) as err:
            ours.tokenize_messages(to_messages(chat))
        assert err.value.key == "model.chat_template" and "System role not supported" in str(
            err.value
        )
        return
    for turns in (chat[: len(chat) - 2], chat):
        tokens, mask = ours.tokenize_messages(to_messages(turns))
        expected = hf.apply_chat_template(to_dicts(turns), return_dict=False, **kwargs)
        assert tokens == list(expected)
        # Exactly each answer and the end of its turn train; headers and prompts do not.
        end = TEMPLATES[name][-1]
        answers = [f"{text}{end}" for role, text in turns if role == "assistant"]
        assert [run.strip() for run in trained_runs(ours, tokens, mask)] == answers
        prompt = turns[:-1]
        expected = hf.apply_chat_template(
            to_dicts(prompt), add_generation_prompt=True, return_dict=False, **kwargs
        )
        assert ours.generation_prompt(to_messages(prompt)) == list(expected)


def test_a_template_that_rewrites_history_is_refused_by_name(tokenizers_dir: Path) -> None:
    ours = ChatTokenizer(str(tokenizers_dir / "qwen3"))
    hf = AutoTokenizer.from_pretrained(tokenizers_dir / "qwen3")
    # One turn renders as transformers renders it, the empty <think> block masked.
    single = CHAT[:2]
    tokens, mask = ours.tokenize_messages(to_messages(single))
    assert tokens == list(hf.apply_chat_template(to_dicts(single), return_dict=False))
    assert trained_runs(ours, tokens, mask) == ["FOX<|im_end|>"]
    # Qwen3 renders an earlier answer without the <think> block it had as the last one.
    with pytest.raises(UserError) as err:
        ours.tokenize_messages(to_messages(CHAT))
    assert err.value.key == "model.chat_template" and "rewrites earlier turns" in err.value.fix


@pytest.mark.parametrize("name", ["smollm2", "gemma2", "phi3"])
def test_a_cut_past_the_last_trained_token_keeps_the_end_of_turn_trained(
    tokenizers_dir: Path, name: str
) -> None:
    """Templates that write after the answer's end-of-turn (a newline, Phi-3's end of text):
    cut there alone, torchtune's truncate put an untrained EOS in the end-of-turn's place, and
    the answer trained without learning to stop."""
    whole, whole_mask = ChatTokenizer(str(tokenizers_dir / name)).tokenize_messages(
        to_messages(CHAT[:2])
    )
    last_trained = max(i for i, masked in enumerate(whole_mask) if not masked)
    assert last_trained < len(whole) - 1  # the template writes after it
    cut = ChatTokenizer(str(tokenizers_dir / name), max_seq_len=last_trained + 1)
    tokens, mask = cut.tokenize_messages(to_messages(CHAT[:2]))
    assert tokens == whole[: last_trained + 1] and mask == whole_mask[: last_trained + 1]
    end = TEMPLATES[name][-1]
    assert [run.strip() for run in trained_runs(cut, tokens, mask)] == [f"{CHAT[1][1]}{end}"]


@pytest.mark.parametrize("name", ["smollm2", "mistral"])
def test_train_on_input_trains_each_message_content(tokenizers_dir: Path, name: str) -> None:
    ours = ChatTokenizer(str(tokenizers_dir / name))
    messages = [Message(role=r, content=t, masked=False) for r, t in SYSTEM + CHAT]
    tokens, mask = ours.tokenize_messages(messages)
    runs = [run.strip() for run in trained_runs(ours, tokens, mask)]
    if name == "smollm2":  # every message closes with <|im_end|>
        assert runs == [f"{text}<|im_end|>" for _, text in SYSTEM + CHAT]
    else:  # [INST] user[/INST] answer</s>; a conversation ending in an answer has no system
        assert runs == [f"{text}</s>" if role == "assistant" else text for role, text in CHAT]


def model_section(overrides: list[str]) -> dict:
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return asdict(resolve_model(compose("train", overrides=overrides).model))


def test_a_template_file_for_a_tokenizer_without_one(tmp_path: Path) -> None:
    source = write_llama_checkpoint("smollm2", tmp_path / "bare", with_template=False)
    resolved = model_section(["model=hf", f"model.source={source}"])
    assert resolved["tokenizer"]["chat_template"] is None
    template = tmp_path / "chatml.jinja"
    template.write_text(SMOLLM2_TEMPLATE)
    overrides = ["model=hf", f"model.source={source}", f"model.chat_template={template}"]
    resolved = model_section(overrides)
    assert resolved["tokenizer"]["chat_template"] == str(template)
    ours = ChatTokenizer(**{k: v for k, v in resolved["tokenizer"].items() if k != "_component_"})
    hf = AutoTokenizer.from_pretrained(source)
    expected = hf.apply_chat_template(to_dicts(CHAT), chat_template=SMOLLM2_TEMPLATE)
    assert ours.encode_chat(to_messages(CHAT)) == list(expected["input_ids"])
    with pytest.raises(UserError) as err:
        model_section(["model=hf", f"model.source={source}", "model.chat_template=llama3"])
    assert err.value.key == "model.chat_template" and "Jinja chat template file" in err.value.fix


def test_a_template_whose_answers_end_in_no_stop_token_is_warned_of(
    tokenizers_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Its answers trained with no end-of-turn, and the model never learned to stop."""
    for name in TEMPLATES:  # every published one ends its answers in one
        assert ChatTokenizer(str(tokenizers_dir / name)).answers_end_in_a_stop_token(), name
    plain = tmp_path / "plain.jinja"
    plain.write_text("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}")
    assert not ChatTokenizer(
        str(tokenizers_dir / "smollm2"), None, str(plain)
    ).answers_end_in_a_stop_token()
    with caplog.at_level("WARNING", logger="runner.config.model"):
        model_section([f"model.chat_template={plain}"])
    (warning,) = [r.getMessage() for r in caplog.records if "no stop token" in r.getMessage()]
    assert warning.startswith(f"{plain} ends an assistant's answer with no stop token")


TRAIN = [
    "compute=cpu",
    "dtype=fp32",
    "max_steps=2",
    "batch_size=2",
    "dataset.eval_samples=2",
    "runtime.progress_bar=false",
    "runtime.loggers=[]",
    "runtime.log_every_n_steps=1",
]


def test_a_chatml_llama_checkpoint_validates_and_trains(runner_cli, tmp_path: Path) -> None:
    source = write_llama_checkpoint("smollm2", tmp_path / "smollm2")
    result = runner_cli("validate", "model=hf", f"model.source={source}")
    assert result.returncode == 0, result.stderr[-3000:]
    run_dir = tmp_path / "run"
    result = runner_cli(
        "train",
        "model=hf",
        f"model.source={source}",
        *TRAIN,
        f"hydra.run.dir={run_dir}",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert sorted(losses(run_dir)) == [1, 2]
    checkpoint = run_dir / "checkpoints" / "step_2"
    assert AutoTokenizer.from_pretrained(checkpoint).chat_template == SMOLLM2_TEMPLATE


def test_text_data_needs_no_chat_template(runner_cli, tmp_path: Path) -> None:
    source = write_llama_checkpoint("smollm2", tmp_path / "bare", with_template=False)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(f"hello olleh fox FOX line {i}\n" for i in range(40)))
    # Instruct data needs a template: one message naming the key and the ways out.
    result = runner_cli("validate", "model=hf", f"model.source={source}")
    assert result.returncode != 0 and "model.chat_template" in result.stderr
    assert "dataset=text" in result.stderr and "Traceback" not in result.stderr
    run_dir = tmp_path / "run"
    result = runner_cli(
        "train",
        "model=hf",
        f"model.source={source}",
        "dataset=text",
        f"dataset.source={corpus}",
        *TRAIN,
        f"hydra.run.dir={run_dir}",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert sorted(losses(run_dir)) == [1, 2]
    assert json.loads((run_dir / "checkpoints" / "step_2" / "config.json").read_text())


def test_a_template_file_trains_and_every_checkpoint_keeps_it(runner_cli, tmp_path: Path) -> None:
    """model.chat_template=FILE for a tokenizer without one: the checkpoint carries the file as
    chat_template.jinja, so what deploy and export render is what trained."""
    source = write_llama_checkpoint("smollm2", tmp_path / "bare", with_template=False)
    template = tmp_path / "chatml.jinja"
    template.write_text(SMOLLM2_TEMPLATE)
    run_dir = tmp_path / "run"
    result = runner_cli(
        "train",
        "model=hf",
        f"model.source={source}",
        f"model.chat_template={template}",
        *TRAIN,
        f"hydra.run.dir={run_dir}",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    checkpoint = run_dir / "checkpoints" / "step_2"
    assert (checkpoint / "chat_template.jinja").read_text() == SMOLLM2_TEMPLATE
    assert AutoTokenizer.from_pretrained(checkpoint).chat_template == SMOLLM2_TEMPLATE


@pytest.mark.parametrize("name", [n for n in TEMPLATES if n != "gemma2"])  # gemma2: no system
def test_a_template_with_a_system_prompt_renders_it_where_a_chat_has_none(
    tokenizers_dir: Path, name: str
) -> None:
    """What a checkpoint of a run trained with dataset.new_system_prompt carries: a chat
    without a system message renders as with the prompt; one with its own keeps it."""
    hf = AutoTokenizer.from_pretrained(tokenizers_dir / name)
    prompt = 'Answer "yes" or\n"no" {{ not jinja }} \\ é'
    template = with_system_prompt(hf.chat_template, prompt)
    kwargs = {"add_generation_prompt": True, "tokenize": False, "date_string": "26 Jul 2024"}
    asked = to_dicts(CHAT[:1])
    given = [{"role": "system", "content": prompt}, *asked]
    assert hf.apply_chat_template(asked, chat_template=template, **kwargs) == (
        hf.apply_chat_template(given, **kwargs)
    )
    own = to_dicts(SYSTEM + CHAT[:1])
    assert hf.apply_chat_template(own, chat_template=template, **kwargs) == (
        hf.apply_chat_template(own, **kwargs)
    )


def test_a_run_trained_with_a_system_prompt_is_served_with_it(runner_cli, tmp_path: Path) -> None:
    """dataset.new_system_prompt trained every chat, and built the run's evaluation prompts,
    with it; the checkpoint carried the tokenizer's template alone, and a request without a
    system message was served without it (or with the template's own default)."""
    run_dir = tmp_path / "run"
    prompt = "Answer in one word."
    result = runner_cli(
        "train", *TRAIN, f"dataset.new_system_prompt='{prompt}'", f"hydra.run.dir={run_dir}"
    )
    assert result.returncode == 0, result.stderr[-3000:]
    served = load_tokenizer(run_dir / "checkpoints" / "step_2")
    trained = ChatTokenizer(str(TINY_TOKENIZER_DIR))  # today's date, where it writes one
    user = [ChatMessage(role="user", content="hi")]
    assert _render_chat(served, user) == trained.generation_prompt(
        [Message(role="system", content=prompt), Message(role="user", content="hi")]
    )


@pytest.mark.parametrize("name", ["llama3_2", "qwen2_5"])
def test_a_developer_role_is_told_by_the_templates_code_not_its_prompt(
    tokenizers_dir: Path, name: str
) -> None:
    """runner deploy renders a developer message as the system message where the template has
    no developer role: a run's system prompt that said "developers" turned that off, and the
    message was dropped (ChatML) or written under a header no model trained on (Llama 3)."""
    template = AutoTokenizer.from_pretrained(tokenizers_dir / name).chat_template
    assert not names_role(template, "developer")
    prompt = "You help 'developer' teams and \"developers\" {%- endif %} 'developer'"
    assert not names_role(with_system_prompt(template, prompt), "developer")
    own = "{%- if message['role'] == 'developer' %}D{%- endif %}" + template
    assert names_role(own, "developer") and names_role(with_system_prompt(own, prompt), "developer")
    served = load_tokenizer(tokenizers_dir / name)
    served.chat_template = with_system_prompt(template, prompt)
    asked = [
        ChatMessage(role="developer", content="Reply in French."),
        ChatMessage(role="user", content="hi"),
    ]
    told = [
        ChatMessage(role="system", content="Reply in French."),
        ChatMessage(role="user", content="hi"),
    ]
    assert _render_chat(served, asked) == _render_chat(served, told)
