"""Generated token ids to text: incremental detokenization and stop sequences."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import tokenizers
from tokenizers.decoders import DecodeStream

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger(__name__)

_INCOMPLETE = "\ufffd"
# What DecodeStream raises when a tokenizer's decoding of the ids so far is not a prefix of its
# decoding of one more (vLLM resets the stream then: vllm/v1/engine/detokenizer.py).
_INVALID_PREFIX = "Invalid prefix encountered"


class TextStream:
    """The text of one generated sequence, released in deltas that are safe to send.

    A delta never ends inside an incomplete UTF-8 character (byte-level tokenizers split
    characters across tokens) nor inside what may be the start of a stop sequence, so a client
    never sees text that is later taken back.

    With `step_decoding` (`steps_decode(tokenizer)`), each new token is decoded by the
    `tokenizers` library's own incremental decoder (DecodeStream, as vLLM's
    FastIncrementalDetokenizer does); otherwise by decoding the window of ids since the last
    whole character, twice a token, through transformers (scripts/bench/bench_detokenize.py
    times both).
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        stop: list[str],
        incremental: bool,
        step_decoding: bool = False,
    ) -> None:
        self._tokenizer = tokenizer
        self._stop = stop
        # Neither streamed nor watched for stop sequences: decoded once, at the end.
        self._incremental = incremental or bool(stop)
        self.token_ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0
        self._text = ""
        self._sent = 0
        # Whether the text is over: a stop sequence found, or finish() called.
        self.stopped = False
        # Whether a stop sequence was found (the text cut before it), by push() or by finish()'s
        # flush of what was held back.
        self.stop_found = False
        self._stream = DecodeStream(skip_special_tokens=True) if step_decoding else None

    def push(self, token_id: int) -> None:
        """Add one generated token (never an end-of-sequence token)."""
        self.token_ids.append(token_id)
        if not self._incremental or self.stopped:
            return
        if self._stream is not None:
            if delta := self._step(token_id):
                self._append(delta)
            return
        prefix = self._decode(self._prefix_offset, self._read_offset)
        text = self._decode(self._prefix_offset, len(self.token_ids))
        if len(text) > len(prefix) and not text.endswith(_INCOMPLETE):
            self._append(text[len(prefix) :])
            self._prefix_offset, self._read_offset = self._read_offset, len(self.token_ids)

    @property
    def started(self) -> bool:
        """Whether any text has been sent."""
        return self._sent > 0

    def ready(self) -> str:
        """Text that can be sent now and was not sent before."""
        end = len(self._text) if self.stopped else len(self._text) - self._held_back()
        delta = self._text[self._sent : end]
        self._sent = max(self._sent, end)
        return delta

    def finish(self) -> str:
        """All text not sent yet, including a trailing incomplete character."""
        if not self._incremental:
            self._text = self._decode(0, len(self.token_ids))
        elif not self.stopped and self._stream is not None:
            # What DecodeStream holds back: the trailing incomplete character.
            whole = self._decode(0, len(self.token_ids))
            if whole.startswith(self._text):
                self._append(whole[len(self._text) :])
        elif not self.stopped:
            prefix = self._decode(self._prefix_offset, self._read_offset)
            self._append(self._decode(self._prefix_offset, len(self.token_ids))[len(prefix) :])
        self.stopped = True
        return self.ready()

    def _step(self, token_id: int) -> str:
        """The text one more token completes (DecodeStream)."""
        assert self._stream is not None, "step decoding"
        backend = self._tokenizer.backend_tokenizer
        try:
            delta = self._stream.step(backend, token_id)
        except Exception as error:
            if not str(error).startswith(_INVALID_PREFIX):
                raise
            log.warning("incremental decoding lost its prefix; decoding on from this token")
            self._stream = DecodeStream(skip_special_tokens=True)
            delta = self._stream.step(backend, token_id)
        return delta or ""

    def _decode(self, start: int, end: int) -> str:
        return decode(self._tokenizer, self.token_ids[start:end])

    def _append(self, delta: str) -> None:
        searched = len(self._text)
        self._text += delta
        longest = max((len(stop) for stop in self._stop), default=0)
        start = max(0, searched - longest + 1)
        hits = [i for i in (self._text.find(stop, start) for stop in self._stop) if i >= 0]
        if hits:
            self._text = self._text[: min(hits)]
            self.stopped = self.stop_found = True

    def _held_back(self) -> int:
        """Length of the longest suffix of the text that begins some stop sequence."""
        held = 0
        for stop in self._stop:
            for size in range(min(len(stop) - 1, len(self._text)), held, -1):
                if self._text.endswith(stop[:size]):
                    held = size
                    break
        return held


def decode(tokenizer: PreTrainedTokenizerBase, ids: list[int]) -> str:
    """The text of generated `ids`, as the model wrote it: special tokens skipped, and spaces
    before punctuation kept even where the tokenizer's config asks transformers to tidy them
    (`clean_up_tokenization_spaces`), as vLLM and text-generation-inference keep them. Tidied,
    a window of ids decodes differently from the same ids inside the whole answer (" ." alone
    is "."), so a stream would drop what the whole answer has."""
    text = tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    assert isinstance(text, str), "one sequence of ids decodes to one text"
    return text


# Text that some decoders change beyond joining tokens (spaces before punctuation, "n't").
_PROBE = " a . b , c ! d ? e's f n't"


def steps_decode(tokenizer: PreTrainedTokenizerBase) -> bool:
    """Whether `tokenizer` can decode a token at a time with DecodeStream (TextStream's
    `step_decoding`): a `tokenizers` backend, whose decoding `decode` above passes on
    unchanged."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if not isinstance(backend, tokenizers.Tokenizer):
        return False
    ids = backend.encode(_PROBE, add_special_tokens=False).ids
    return decode(tokenizer, ids) == backend.decode(ids, skip_special_tokens=True)
