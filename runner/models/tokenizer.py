"""Chat tokenization with the checkpoint's own chat template, rendered by transformers.

A conversation is rendered to text by `transformers`' own apply_chat_template (its sandboxed
Jinja environment, the template's own variables) and the text encoded in one piece without
added special tokens, exactly as apply_chat_template(tokenize=True) does; so training,
evaluation and `runner deploy` see the same ids for any published template.

The loss mask is read from the rendering, with no knowledge of the template: each trained
message's content is located by rendering the conversation again with that content replaced
(a changed span is the content), and the end-of-turn token that closes it trains too; the
header before it does not. A template that renders a turn one way when it ends the
conversation and another way once later turns follow (one that drops `<think>` blocks from
history, say) cannot be trained turn by turn: it is refused by name.
"""

from __future__ import annotations

import bisect
import re
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from runner.errors import UserError
from runner.models.chat_template import render_chat, template_message
from runner.models.torchtune_boundary import CROSS_ENTROPY_IGNORE_IDX, Message, truncate

# Tokens that end a generation besides eos_token, where the vocabulary has them: the published
# templates' ends of a turn (Llama 3, ChatML, Gemma, Phi-3) and the end-of-text tokens.
EXTRA_STOP_TOKENS = (
    "<|eot_id|>",
    "<|im_end|>",
    "<end_of_turn>",
    "<|end|>",
    "<|end_of_text|>",
    "<|endoftext|>",
    "<|eom_id|>",
)
# Two stand-ins for a message's content that differ in their first and in their last
# character: whatever the content, one of them differs from it at each end, so the span
# where a rendering changes is the content's exactly.
_STAND_INS = ("QqRunnerContentqQ", "ZzRunnerContentzZ")
# Llama 3.2's template, among others, writes today's date unless given date_string.
_DATE_FORMAT = "%d %b %Y"


def load_hf_tokenizer(path: Path) -> Any:
    """transformers' tokenizer of a directory (local files only); a UserError if it has none."""
    from transformers import AutoTokenizer

    files = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
    if path.is_dir() and not any((path / name).is_file() for name in files):
        # transformers' own message on it is about installing sentencepiece or tiktoken.
        raise UserError(
            "model.tokenizer",
            str(path),
            "holds no tokenizer files; give a directory holding tokenizer.json and "
            "tokenizer_config.json",
        )
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError) as err:
        raise UserError(
            "model.tokenizer",
            str(path),
            f"transformers cannot load a tokenizer from it ({err}); give a directory holding "
            "tokenizer.json and tokenizer_config.json",
        ) from err
    if tokenizer.eos_token is None:
        raise UserError(
            "model.tokenizer",
            str(path),
            "its tokenizer has no eos_token; set eos_token in its tokenizer_config.json",
        )
    return tokenizer


def _standing_in(messages: Sequence[Message], index: int, stand_in: str) -> list[Message]:
    """The conversation with `stand_in` for message `index`'s content, and nothing else changed:
    dropped, a name that the template writes would count as content, and train."""
    changed = list(messages)
    changed[index] = Message(role=messages[index].role, content=stand_in, name=messages[index].name)
    return changed


def _common_prefix(a: str, b: str) -> int:
    n = min(len(a), len(b))
    low, high = 0, n  # the longest common prefix is in [low, high]
    while low < high:
        mid = (low + high + 1) // 2
        if a[:mid] == b[:mid]:
            low = mid
        else:
            high = mid - 1
    return low


def _common_suffix(a: str, b: str, limit: int) -> int:
    low, high = 0, limit
    while low < high:
        mid = (low + high + 1) // 2
        if a[len(a) - mid :] == b[len(b) - mid :]:
            low = mid
        else:
            high = mid - 1
    return low


def _token_text(value: Any) -> str | None:
    return value["content"] if isinstance(value, dict) else value


class ChatTokenizer:
    """A model's tokenizer and chat template, as torchtune's model transform.

    chat_template: a Jinja template file, for a tokenizer that has none (None: the tokenizer's
    own, from tokenizer_config.json or chat_template.jinja). date_string: the date the template
    writes where it reads the clock (pinned, so every process and a repro render the same).
    """

    def __init__(
        self,
        path: str,
        max_seq_len: int | None = None,
        chat_template: str | None = None,
        date_string: str | None = None,
    ) -> None:
        directory = Path(path)
        self._hf = load_hf_tokenizer(directory)
        # A copy of its Rust tokenizer without the post-processor: offsets into the text as it
        # is (untrimmed), and no special tokens added; the ids are the transformers tokenizer's.
        self._tokenizer = Tokenizer.from_str(self._hf.backend_tokenizer.to_str())
        self._tokenizer.post_processor = None
        self.special_tokens = {
            token.content: token_id
            for token_id, token in self._tokenizer.get_added_tokens_decoder().items()
        }
        self.bos_token = _token_text(self._hf.bos_token)
        self.bos_id = self._tokenizer.token_to_id(self.bos_token) if self.bos_token else None
        self.eos_id = self._eos_id(directory)
        pad = _token_text(self._hf.pad_token)
        self.pad_id = self._tokenizer.token_to_id(pad) if pad else self.eos_id
        extra = [self.special_tokens[t] for t in EXTRA_STOP_TOKENS if t in self.special_tokens]
        self.stop_tokens = [self.eos_id] + [t for t in extra if t != self.eos_id]
        ends = {e for t in self.stop_tokens if (e := self._tokenizer.id_to_token(t)) is not None}
        self._end_of_turn = re.compile(
            r"\s*(?:" + "|".join(re.escape(t) for t in sorted(ends, key=len, reverse=True)) + ")"
        )
        self.chat_template_file = chat_template
        self.template_name = chat_template or f"the chat template of {directory}"
        self.template = self._template(directory, chat_template)
        if date_string is None and self.template and "strftime_now" in self.template:
            date_string = time.strftime(_DATE_FORMAT)
        self.date_string = date_string
        self.max_seq_len = max_seq_len

    def _eos_id(self, directory: Path) -> int:
        """The id of eos_token (load_hf_tokenizer refused a tokenizer without one)."""
        eos_token = _token_text(self._hf.eos_token)
        eos_id = self._tokenizer.token_to_id(eos_token) if eos_token else None
        if eos_id is None:
            raise UserError(
                "model.tokenizer",
                str(directory),
                f"its eos_token {eos_token!r} is not in its vocabulary; set eos_token in its "
                "tokenizer_config.json to a token of tokenizer.json",
            )
        return eos_id

    def _template(self, directory: Path, chat_template: str | None) -> str | None:
        if chat_template is not None:
            return Path(chat_template).read_text()
        template = self._hf.chat_template
        if isinstance(template, dict):  # named templates: the default one
            template = template.get("default")
        return template or None

    @property
    def vocab_size(self) -> int:
        """Tokens in the vocabulary, added tokens included."""
        return self._tokenizer.get_vocab_size()

    @property
    def max_token_id(self) -> int:
        """The highest id the tokenizer gives: the model's embedding needs a row for it, and the
        ids of added tokens need not follow the vocabulary's (so not vocab_size - 1)."""
        return max(self._tokenizer.get_vocab(with_added_tokens=True).values())

    def encode(self, text: str, add_bos: bool = True, add_eos: bool = True) -> list[int]:
        """Ids of plain `text` (no chat template), between BOS and EOS as asked."""
        ids = self._tokenizer.encode(text, add_special_tokens=False).ids
        bos_id = self.bos_id
        bos = [bos_id] if add_bos and bos_id is not None else []
        return bos + ids + ([self.eos_id] if add_eos else [])

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        """The text of `token_ids`."""
        return self._tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def require_chat_template(self) -> None:
        """A UserError unless there is a chat template to render conversations with."""
        if self.template is None:
            raise UserError(
                "model.chat_template",
                None,
                f"{self.template_name} is missing: chat and instruct data are rendered with the "
                "tokenizer's chat template and this tokenizer has none; give "
                "model.chat_template=<a Jinja chat template file>, or train on dataset=text",
            )

    def answers_end_in_a_stop_token(self) -> bool:
        """Whether the template ends an assistant's answer with a stop token (eos, <|eot_id|>,
        <|im_end|>, ...), which then trains: a model trained without one never learns to stop.
        True where there is no template, or it refuses a bare user, assistant conversation."""
        if self.template is None:
            return True
        messages = [
            Message(role="user", content="x", masked=True),
            Message(role="assistant", content="y"),
        ]
        try:
            tokens, mask = self.tokenize_messages(messages)
        except UserError:
            return True
        trained = [token for token, masked in zip(tokens, mask, strict=True) if not masked]
        return bool(trained) and trained[-1] in self.stop_tokens

    def render(
        self,
        messages: Sequence[Message],
        *,
        add_generation_prompt: bool = False,
        continue_final_message: bool = False,
    ) -> str:
        """The conversation as the chat template renders it (render_chat, with our settings)."""
        self.require_chat_template()
        dicts = [template_message(m.role, m.text_content, name=m.name) for m in messages]
        kwargs = {"date_string": self.date_string} if self.date_string else {}
        try:
            return render_chat(
                self._hf,
                dicts,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                chat_template=self.template,
                **kwargs,
            )
        except Exception as err:  # noqa: BLE001 - the template's raise_exception, Jinja errors
            raise UserError(
                "model.chat_template",
                self.template_name,
                f"the template refused a conversation of roles "
                f"{[m.role for m in messages]} ({type(err).__name__}: {err}); give data it "
                "accepts, or model.chat_template=<a Jinja chat template file>",
            ) from err

    def _encode(self, text: str, spans: list[tuple[int, int]]) -> tuple[list[int], list[bool]]:
        """Ids of `text`; a token trains (mask False) where it covers a character of a span."""
        encoding = self._tokenizer.encode(text, add_special_tokens=False)
        offsets = encoding.offsets
        mask = [True] * len(offsets)
        ends = [end for _, end in offsets]
        for span_start, span_end in spans:
            # The first token ending after the span starts, on while tokens start before its end.
            index = bisect.bisect_right(ends, span_start)
            while index < len(offsets) and offsets[index][0] < span_end:
                mask[index] = False
                index += 1
        return encoding.ids, mask

    def _content_span(
        self, messages: list[Message], index: int, text: str, open_last: bool
    ) -> tuple[int, int]:
        """Where message `index`'s content lies in `text`, the whole conversation rendered
        (its last message left open if `open_last`).

        The conversation is rendered with a stand-in for the content: the text before and after
        the change is the template's. Where the content starts (or ends) with the stand-in's
        own character the change looks shorter; the second stand-in settles that.
        """
        start, end = len(text), 0
        for stand_in in _STAND_INS:
            other = self.render(
                _standing_in(messages, index, stand_in), continue_final_message=open_last
            )
            prefix = _common_prefix(text, other)
            suffix = _common_suffix(text, other, min(len(text), len(other)) - prefix)
            start, end = min(start, prefix), max(end, len(text) - suffix)
            if other[prefix:].startswith(stand_in) and other[: len(other) - suffix].endswith(
                stand_in
            ):
                break  # the change is the stand-in itself: its ends are the content's
        return start, max(start, end)

    def renders_content(self, messages: Sequence[Message], index: int) -> bool:
        """Whether the conversation's rendering holds message `index`'s content (Mistral's
        template writes a system message into the last user turn only, so into no
        conversation that ends in an answer)."""
        renderings = {self.render(_standing_in(messages, index, s)) for s in _STAND_INS}
        return len(renderings) == len(_STAND_INS)

    def _check_history(self, messages: list[Message], index: int, text: str, end: int) -> None:
        """A UserError unless the conversation up to answer `index` renders as `text` does up
        to that answer's end (`end`): what the model saw when it wrote the answer, and the
        answer, are what it trains on. What follows may differ (Phi-3's template closes a
        conversation with eos_token), and so may prompts (Mistral's moves the system message
        onto the last user turn)."""
        if self.render(messages[: index + 1])[:end] != text[:end]:
            raise UserError(
                "model.chat_template",
                self.template_name,
                f"the template rewrites earlier turns: it renders {messages[index].role} turn "
                f"{index + 1} one way when it ends the conversation and another once later turns "
                "follow (it drops or changes history, e.g. <think> blocks), so a multi-turn "
                "conversation cannot be trained turn by turn; give single-turn data, or "
                "model.chat_template=<a template file that keeps history as it is>",
            )

    def _trained_spans(
        self, messages: list[Message], text: str, open_last: bool
    ) -> list[tuple[int, int]]:
        """The character spans of `text` that train: each unmasked message's content, and the
        end-of-turn token right after it (not for a message left open)."""
        spans = []
        last = len(messages) - 1
        for index, message in enumerate(messages):
            if message.masked:
                continue
            start, end = self._content_span(messages, index, text, open_last)
            if not (open_last and index == last):
                closing = self._end_of_turn.match(text, end)
                end = closing.end() if closing else end
            if message.role == "assistant" and index < last:
                self._check_history(messages, index, text, end)
            spans.append((start, end))
        return spans

    def encode_chat(self, messages: list[Message]) -> list[int]:
        """Ids of a whole conversation, untruncated."""
        return self._encode(self.render(messages), [])[0]

    def tokenize_messages(
        self, messages: list[Message], add_end_tokens: bool = True
    ) -> tuple[list[int], list[bool]]:
        """Token ids and a mask (True: no loss) for a conversation.

        Only the content of unmasked messages and the end-of-turn token after each train.
        With add_end_tokens=False the last message is left open.
        """
        messages = list(messages)
        text = self.render(messages, continue_final_message=not add_end_tokens)
        tokens, mask = self._encode(text, self._trained_spans(messages, text, not add_end_tokens))
        if self.max_seq_len and len(tokens) > self.max_seq_len:
            if all(mask[self.max_seq_len :]):
                # Only what the template writes after the last trained token (Qwen's and
                # Gemma's newline after the end-of-turn) is past the limit: cut it alone. Put
                # in its place, an untrained EOS took the end-of-turn's place, and the answer
                # trained without learning to stop.
                return tokens[: self.max_seq_len], mask[: self.max_seq_len]
            tokens = truncate(tokens, self.max_seq_len, self.eos_id if add_end_tokens else None)
            mask = truncate(mask, self.max_seq_len, True if add_end_tokens else None)
        return tokens, mask

    def generation_prompt(self, messages: list[Message]) -> list[int]:
        """Ids of `messages` and what the template adds to ask for the assistant's answer."""
        return self._encode(self.render(messages, add_generation_prompt=True), [])[0]

    def __call__(self, sample: dict[str, Any], inference: bool = False) -> dict[str, Any]:
        """torchtune's model transform: messages -> tokens, mask."""
        tokens, mask = self.tokenize_messages(sample.pop("messages"))
        sample["tokens"], sample["mask"] = tokens, mask
        return sample


__all__ = ["ChatTokenizer", "CROSS_ENTROPY_IGNORE_IDX", "render_chat"]
