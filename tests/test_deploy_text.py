"""Generated ids to text as the server streams it (runner/deploy/text.py): deltas that are never
taken back, decoded a token at a time by tokenizers' DecodeStream or by windows of ids through
transformers, each giving the whole answer's text: what transformers' decode gives, without the
tidying of spaces that some tokenizers' configs ask of it."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from runner.deploy.text import TextStream, steps_decode
from runner.paths import TINY_TOKENIZER_DIR
from tests.fixtures import FAMILIES, write_family_tokenizer

DECODING = pytest.mark.parametrize("step_decoding", [True, False], ids=["step", "window"])


def streamed(tokenizer, ids: list[int], stop: list[str], step_decoding: bool) -> list[str]:
    """The deltas a stream of `ids` sends: one per token (until a stop), then its end's."""
    stream = TextStream(tokenizer, stop, incremental=True, step_decoding=step_decoding)
    sent = []
    for token_id in ids:
        stream.push(token_id)
        sent.append(stream.ready())
        if stream.stopped:
            break
    return [*sent, stream.finish()]


@DECODING
def test_streamed_text_never_takes_back_what_it_sent(step_decoding: bool) -> None:
    tokenizer = AutoTokenizer.from_pretrained(TINY_TOKENIZER_DIR)

    def deltas(text: str, stop: list[str]) -> list[str]:
        ids = tokenizer.encode(text, add_special_tokens=False)
        return streamed(tokenizer, ids, stop, step_decoding)

    # "é" is two byte tokens: nothing is sent until the character is whole.
    assert deltas("aé", []) == ["a", "", "é", ""]
    # "xy" might begin the stop sequence "xyz" until "b" shows it does not.
    assert deltas("axyb", ["xyz"]) == ["a", "", "", "xyb", ""]
    # A stop sequence spread over tokens: the text ends before it, and none of it was sent.
    assert "".join(deltas("axyzb", ["xyz"])) == "a"
    # An answer cut inside a character ends with what decode writes for its bytes.
    ids = tokenizer.encode("aé", add_special_tokens=False)[:-1]
    assert "".join(streamed(tokenizer, ids, [], step_decoding)) == tokenizer.decode(ids)


@DECODING
def test_a_stop_found_only_in_the_flushed_tail_is_a_stop(step_decoding: bool) -> None:
    """An answer cut by max_tokens inside a character ends with U+FFFD for its bytes, and a
    stop sequence found there cut the text but was reported as finish_reason `length`."""
    tokenizer = AutoTokenizer.from_pretrained(TINY_TOKENIZER_DIR)
    ids = tokenizer.encode("xa€", add_special_tokens=False)[:3]  # "x", "a", €'s first byte
    stream = TextStream(tokenizer, ["a\ufffd"], incremental=True, step_decoding=step_decoding)
    for token_id in ids:
        stream.push(token_id)
    assert not stream.stop_found
    assert stream.ready() + stream.finish() == "x"
    assert stream.stop_found
    unstopped = TextStream(tokenizer, ["b\ufffd"], incremental=True, step_decoding=step_decoding)
    for token_id in ids:
        unstopped.push(token_id)
    assert unstopped.ready() + unstopped.finish() == "xa\ufffd" and not unstopped.stop_found


@pytest.mark.parametrize("family", FAMILIES)
def test_every_familys_stream_decodes_as_its_whole_answer(family: str, tmp_path: Path) -> None:
    # Each fixture family's tokenizer (byte-level and SentencePiece-style, special tokens,
    # Llama 3's clean_up_tokenization_spaces that transformers skips for BPE): random ids,
    # special ones among them, and spaces before punctuation, both ways alike.
    write_family_tokenizer(family, tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    assert steps_decode(tokenizer)
    punctuation = tokenizer.encode(" a . b , c n't", add_special_tokens=False)
    rng = random.Random(0)
    for _ in range(20):
        ids = [rng.randrange(len(tokenizer)) for _ in range(40)] + punctuation
        whole = tokenizer.decode(ids, skip_special_tokens=True)
        for step_decoding in (True, False):
            assert "".join(streamed(tokenizer, ids, [], step_decoding)) == whole


@DECODING
def test_a_tokenizer_asking_to_tidy_spaces_streams_the_text_as_written(
    step_decoding: bool, tmp_path: Path
) -> None:
    # transformers' decode removes spaces before punctuation where a tokenizer's config asks it
    # to; a window of ids tidies differently from the whole (" ." alone is "."), so the window
    # path once streamed " a  b" for " a . b". Every answer keeps the spaces, as vLLM's and
    # text-generation-inference's do: streamed or whole, a token at a time or by windows.
    write_family_tokenizer("llama3_2", tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output"] = True
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    ids = tokenizer.encode(" a . b , c n't x", add_special_tokens=False)
    assert tokenizer.decode(ids) == " a. b, cn't x"  # the premise: this decode tidies
    assert steps_decode(tokenizer)
    assert "".join(streamed(tokenizer, ids, [], step_decoding)) == " a . b , c n't x"
    whole = TextStream(tokenizer, [], incremental=False, step_decoding=step_decoding)
    for token_id in ids:
        whole.push(token_id)
    assert whole.finish() == " a . b , c n't x"
