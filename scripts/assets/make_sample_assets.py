"""Writes the embedded defaults that `runner train` uses with no overrides.

    python scripts/assets/make_sample_assets.py

- runner/assets/tiny_tokenizer/: a byte-level tokenizer (256 byte tokens plus Llama 3's chat
  special tokens) that `transformers.AutoTokenizer` and our recipe both load.
- runner/assets/sample/{train,validation}.jsonl: alpaca-format records of a task a tiny model
  learns in minutes (reverse a word, upper-case a word), the validation words held out. Every
  record has a word of its own: with no word seen twice, the model cannot get by on memorized
  answers and learns the rule (scripts/checks/default_learns.py checks that it does, seed after
seed).

Deterministic: the same files come out on every run.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
from transformers.convert_slow_tokenizer import bytes_to_unicode

ASSETS = Path(__file__).resolve().parents[2] / "runner" / "assets"
SPECIAL_TOKENS = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<|finetune_right_pad_id|>",
    "<|reserved_special_token_0|>",
    "<|reserved_special_token_1|>",
]
# Llama 3's chat format, without the date preamble; runner.models.tokenizer.ChatTokenizer produces
# the same ids in training.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' "
    "+ message['content'] + '<|eot_id|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    "{% endif %}"
)
# Short instructions: fewer tokens a step, so more steps in the same minutes (the tiny model
# learns the reversal surely only with enough of them: scripts/checks/default_learns.py).
TASKS = {
    "Reverse:": lambda word: word[::-1],
    "Upper:": str.upper,
}
TRAIN_RECORDS = 32000
VALIDATION_RECORDS = 200
PREFERENCE_RECORDS = 4000


def write_tokenizer(out_dir: Path) -> None:
    """Byte-level BPE without merges: token id == byte value, then the special tokens."""
    # GPT-2's byte -> printable-character map (ByteLevel's alphabet), in byte order: id == byte.
    vocab = {char: byte for byte, char in bytes_to_unicode().items()}
    assert set(vocab) == set(pre_tokenizers.ByteLevel.alphabet())
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(SPECIAL_TOKENS)
    bos_id = tokenizer.token_to_id("<|begin_of_text|>")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A",
        pair="<|begin_of_text|> $A <|begin_of_text|> $B",
        special_tokens=[("<|begin_of_text|>", bos_id)],
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|begin_of_text|>",
        "eos_token": "<|eot_id|>",
        "pad_token": "<|finetune_right_pad_id|>",
        "model_max_length": 256,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def make_words(rng: random.Random, count: int, exclude: set[str]) -> list[str]:
    """Pronounceable pseudo-words of 3 to 6 letters, distinct and not in `exclude`."""
    consonants, vowels = "bcdfghjklmnprstvwz", "aeiou"
    words: list[str] = []
    seen = set(exclude)
    while len(words) < count:
        length = rng.randint(3, 6)
        word = "".join(rng.choice(consonants if i % 2 == 0 else vowels) for i in range(length))
        if rng.random() < 0.5:
            word = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(length))
        if word not in seen:
            seen.add(word)
            words.append(word)
    return words


def records(rng: random.Random, words: list[str]) -> list[dict[str, str]]:
    """One record per word, the tasks taking turns, in a shuffled order."""
    out = []
    for i, word in enumerate(words):
        instruction = list(TASKS)[i % len(TASKS)]
        out.append({"instruction": instruction, "input": word, "output": TASKS[instruction](word)})
    rng.shuffle(out)
    return out


def write_sample_dataset(out_dir: Path) -> None:
    rng = random.Random(0)
    validation_words = make_words(rng, VALIDATION_RECORDS, exclude=set())
    train_words = make_words(rng, TRAIN_RECORDS, exclude=set(validation_words))
    out_dir.mkdir(parents=True, exist_ok=True)
    for split, words in (("train", train_words), ("validation", validation_words)):
        with open(out_dir / f"{split}.jsonl", "w") as f:
            for record in records(rng, words):
                f.write(json.dumps(record) + "\n")


def write_preference_dataset(out_dir: Path, exclude: set[str]) -> None:
    """Pairs of the sample task: chosen the right answer, rejected the word unchanged."""
    rng = random.Random(1)
    words = [w for w in make_words(rng, 2 * PREFERENCE_RECORDS, exclude) if w != w[::-1]]
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / "train.jsonl", "w") as f:
        for record in records(rng, words[:PREFERENCE_RECORDS]):
            pair = {
                "prompt": f"{record['instruction']}\n{record['input']}",
                "chosen": record["output"],
                "rejected": record["input"],
            }
            f.write(json.dumps(pair) + "\n")


def sample_words(sample_dir: Path) -> set[str]:
    return {
        json.loads(line)["input"]
        for split in ("train", "validation")
        for line in (sample_dir / f"{split}.jsonl").read_text().splitlines()
    }


if __name__ == "__main__":
    write_tokenizer(ASSETS / "tiny_tokenizer")
    write_sample_dataset(ASSETS / "sample")
    write_preference_dataset(ASSETS / "preference", exclude=sample_words(ASSETS / "sample"))
    print(f"wrote {ASSETS / 'tiny_tokenizer'}, {ASSETS / 'sample'} and {ASSETS / 'preference'}")
