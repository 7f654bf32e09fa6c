"""Chat tokenization that gives the ids of the model's own chat template.

torchtune's ModelTokenizer protocol over a Hugging Face tokenizer.json (the `tokenizers`
library). A chat format renders a conversation to the exact text the published Jinja template
renders (for conversations without tools), and the text is encoded in one piece, as
`transformers`' apply_chat_template does; so training, evaluation and `runner deploy` see the
same ids. Each rendered piece carries its mask (True: no loss).
"""

from __future__ import annotations

import bisect
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from runner.errors import UserError
from runner.tune import CROSS_ENTROPY_IGNORE_IDX, Message, truncate

# (text, masked): a run of the rendered conversation and whether it is excluded from the loss.
Piece = tuple[str, bool]
QWEN2_5_SYSTEM_PROMPT = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
# Llama 3.1's template dates its system block so when the caller gives no date; 3.2's uses today.
LLAMA3_1_DATE = "26 Jul 2024"
# Tokens that end a generation besides eos_token, where the vocabulary has them: the chat
# formats' own ends of a turn and the end-of-text tokens.
EXTRA_STOP_TOKENS = ("<|eot_id|>", "<|im_end|>", "<|end_of_text|>", "<|endoftext|>", "<|eom_id|>")


def _llama3_headers(messages: list[Message], *, open_last: bool, trim: bool) -> list[Piece]:
    pieces: list[Piece] = []
    for i, message in enumerate(messages):
        pieces.append((f"<|start_header_id|>{message.role}<|end_header_id|>\n\n", True))
        text = message.text_content.strip() if trim else message.text_content
        is_open = open_last and i == len(messages) - 1
        pieces.append((text + ("" if is_open else "<|eot_id|>"), message.masked))
    return pieces


def _llama3(
    messages: list[Message], *, open_last: bool, add_generation_prompt: bool, **_: Any
) -> list[Piece]:
    """Llama 3's headers, as the tiny model's template (and Llama 3.0's) renders them."""
    pieces = _llama3_headers(messages, open_last=open_last, trim=False)
    if add_generation_prompt:
        pieces.append(("<|start_header_id|>assistant<|end_header_id|>\n\n", True))
    return pieces


def _llama3_dated(
    messages: list[Message], *, open_last: bool, add_generation_prompt: bool, date_string: str
) -> list[Piece]:
    """Llama 3.1 / 3.2: a system block always, with the knowledge cutoff and today's date."""
    system, masked = "", True
    if messages and messages[0].role == "system":
        system, masked = messages[0].text_content.strip(), messages[0].masked
        messages = messages[1:]
    preamble = (
        "<|start_header_id|>system<|end_header_id|>\n\n"
        f"Cutting Knowledge Date: December 2023\nToday Date: {date_string}\n\n"
    )
    pieces: list[Piece] = [(preamble, True), (system + "<|eot_id|>", masked)]
    pieces += _llama3_headers(messages, open_last=open_last, trim=True)
    if add_generation_prompt:
        pieces.append(("<|start_header_id|>assistant<|end_header_id|>\n\n", True))
    return pieces


def _chatml(
    messages: list[Message], *, open_last: bool, add_generation_prompt: bool, **_: Any
) -> list[Piece]:
    """Qwen2.5's ChatML, with its default system prompt when the conversation has none."""
    pieces: list[Piece] = []
    if not messages or messages[0].role != "system":
        pieces.append((f"<|im_start|>system\n{QWEN2_5_SYSTEM_PROMPT}<|im_end|>\n", True))
    for i, message in enumerate(messages):
        pieces.append((f"<|im_start|>{message.role}\n", True))
        if open_last and i == len(messages) - 1:
            pieces.append((message.text_content, message.masked))
        else:
            # The newline after <|im_end|> is never generated: it belongs to the next prompt.
            pieces += [(message.text_content + "<|im_end|>", message.masked), ("\n", True)]
    if add_generation_prompt:
        pieces.append(("<|im_start|>assistant\n", True))
    return pieces


def _mistral(
    messages: list[Message], *, open_last: bool, add_generation_prompt: bool, **_: Any
) -> list[Piece]:
    """Mistral v0.3's [INST] format; as its template does, a system message joins the
    conversation's last message only when that is the user's (a generation prompt)."""
    system = None
    if messages and messages[0].role == "system":
        system, messages = messages[0].text_content, messages[1:]
    pieces: list[Piece] = []
    for i, message in enumerate(messages):
        last = i == len(messages) - 1
        if message.role == "user":
            text = message.text_content
            if last and system is not None:
                text = f"{system}\n\n{text}"
            pieces += [("[INST]", True), (" " + text, message.masked), ("[/INST]", True)]
        elif message.role == "assistant":
            end = "" if open_last and last else "</s>"
            pieces.append((" " + message.text_content.strip() + end, message.masked))
        else:
            raise ValueError(f"Mistral's chat format has no role {message.role!r}")
    return pieces


# chat format name -> renderer. Names are what model.chat_template takes.
CHAT_FORMATS: dict[str, Callable[..., list[Piece]]] = {
    "llama3": _llama3,
    "llama3_1": _llama3_dated,
    "llama3_2": _llama3_dated,
    "qwen2_5": _chatml,
    "mistral": _mistral,
}


def read_chat_template(path: Path) -> str | None:
    """The Jinja chat template of a tokenizer directory (tokenizer_config.json or its own file)."""
    if (path / "chat_template.jinja").is_file():
        return (path / "chat_template.jinja").read_text()
    config = json.loads((path / "tokenizer_config.json").read_text())
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: the default one
        template = next((t["template"] for t in template if t["name"] == "default"), None)
    return template


def detect_chat_format(template: str | None) -> str | None:
    """Which of CHAT_FORMATS a published chat template is, by the markers only it has."""
    if not template:
        return None
    if "<|im_start|>" in template and QWEN2_5_SYSTEM_PROMPT in template:
        return "qwen2_5"
    if "<|start_header_id|>" in template:
        if "Cutting Knowledge Date" not in template:
            return "llama3"
        return "llama3_2" if "strftime_now" in template else "llama3_1"
    if "[INST]" in template:
        return "mistral"
    return None


def default_date_string(chat_format: str) -> str | None:
    """The date a dated format renders when the caller gives none, as the template does."""
    if chat_format == "llama3_2":
        return time.strftime("%d %b %Y")
    if chat_format == "llama3_1":
        return LLAMA3_1_DATE
    return None


def _token_text(value: Any) -> str | None:
    return value["content"] if isinstance(value, dict) else value


class ChatTokenizer:
    """A model's tokenizer.json and chat format, as torchtune's model transform."""

    def __init__(
        self,
        path: str,
        max_seq_len: int | None = None,
        chat_format: str | None = None,
        date_string: str | None = None,
    ) -> None:
        directory = Path(path)
        self._tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
        # Offsets into the text, untrimmed: masks are read from them.
        self._tokenizer.post_processor = None
        config = json.loads((directory / "tokenizer_config.json").read_text())
        self.special_tokens = {
            token.content: token_id
            for token_id, token in self._tokenizer.get_added_tokens_decoder().items()
        }
        self.bos_token = _token_text(config.get("bos_token"))
        self.bos_id = self.special_tokens[self.bos_token] if self.bos_token else None
        self.eos_id = self.special_tokens[_token_text(config["eos_token"])]
        pad = _token_text(config.get("pad_token"))
        self.pad_id = self.special_tokens[pad] if pad else self.eos_id
        extra = [self.special_tokens[t] for t in EXTRA_STOP_TOKENS if t in self.special_tokens]
        self.stop_tokens = [self.eos_id] + [t for t in extra if t != self.eos_id]
        self.chat_format = chat_format or detect_chat_format(read_chat_template(directory))
        if self.chat_format not in CHAT_FORMATS:
            raise UserError(
                "model.chat_template",
                self.chat_format,
                f"the tokenizer in {directory} has no chat template runner knows; "
                f"name one of: {', '.join(CHAT_FORMATS)}",
            )
        self._render = CHAT_FORMATS[self.chat_format]
        self.date_string = date_string or default_date_string(self.chat_format)
        self.max_seq_len = max_seq_len

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size()

    def encode(self, text: str, add_bos: bool = True, add_eos: bool = True) -> list[int]:
        ids = self._tokenizer.encode(text, add_special_tokens=False).ids
        bos = [self.bos_id] if add_bos and self.bos_id is not None else []
        return bos + ids + ([self.eos_id] if add_eos else [])

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def _encode_pieces(self, pieces: list[Piece]) -> tuple[list[int], list[bool]]:
        """Encodes the pieces as one text; a token takes the mask of the piece it starts in."""
        prefix = [(self.bos_token, True)] if self.bos_token else []
        pieces = prefix + pieces
        starts, position = [], 0
        for text, _ in pieces:
            starts.append(position)
            position += len(text)
        encoding = self._tokenizer.encode("".join(t for t, _ in pieces), add_special_tokens=False)
        masks = [pieces[bisect.bisect_right(starts, start) - 1][1] for start, _ in encoding.offsets]
        return encoding.ids, masks

    def _pieces(self, messages: list[Message], open_last: bool, generation: bool) -> list[Piece]:
        return self._render(
            messages,
            open_last=open_last,
            add_generation_prompt=generation,
            date_string=self.date_string,
        )

    def encode_chat(self, messages: list[Message]) -> list[int]:
        """Ids of a whole conversation, untruncated."""
        return self._encode_pieces(self._pieces(messages, False, False))[0]

    def tokenize_messages(
        self, messages: list[Message], add_end_tokens: bool = True
    ) -> tuple[list[int], list[bool]]:
        """Token ids and a mask (True: no loss) for a conversation.

        Headers and the format's own text are always masked: they are the prompt's, not the
        answer's. With add_end_tokens=False the last message is left open.
        """
        tokens, mask = self._encode_pieces(self._pieces(messages, not add_end_tokens, False))
        if self.max_seq_len and len(tokens) > self.max_seq_len:
            tokens = truncate(tokens, self.max_seq_len, self.eos_id if add_end_tokens else None)
            mask = truncate(mask, self.max_seq_len, True if add_end_tokens else None)
        return tokens, mask

    def generation_prompt(self, messages: list[Message]) -> list[int]:
        """Ids of `messages` and what the template adds to ask for the assistant's answer."""
        tokens, _ = self._encode_pieces(self._pieces(messages, False, True))
        return tokens

    def __call__(self, sample: dict[str, Any], inference: bool = False) -> dict[str, Any]:
        """torchtune's model transform: messages -> tokens, mask."""
        tokens, mask = self.tokenize_messages(sample.pop("messages"))
        sample["tokens"], sample["mask"] = tokens, mask
        return sample


PROBE = [
    Message(role="system", content="Be brief.", masked=True),
    Message(role="user", content="Name a colour.", masked=True),
    Message(role="assistant", content="Blue.", masked=False),
]


def template_mismatch(tokenizer: ChatTokenizer, path: str) -> str | None:
    """How our ids differ from `transformers`' apply_chat_template on a probe chat, or None.

    None too when transformers cannot render the template itself (nothing to compare with).
    """
    from transformers import AutoTokenizer

    try:
        hf = AutoTokenizer.from_pretrained(path)
    except Exception:  # noqa: BLE001 - a tokenizer transformers cannot load: no reference
        return None
    for name, chat in {"a conversation": PROBE, "a generation prompt": PROBE[:2]}.items():
        generation = name == "a generation prompt"
        try:
            theirs = hf.apply_chat_template(
                [{"role": m.role, "content": m.text_content} for m in chat],
                add_generation_prompt=generation,
                tokenize=True,
                return_dict=False,
                date_string=tokenizer.date_string,
            )
        except Exception:  # noqa: BLE001 - a template transformers cannot render: no reference
            return None
        ours = tokenizer.generation_prompt(chat) if generation else tokenizer.encode_chat(chat)
        if list(theirs) != ours:
            return f"for {name} the template gives {hf.decode(theirs)!r}"
    return None


__all__ = ["CHAT_FORMATS", "ChatTokenizer", "CROSS_ENTROPY_IGNORE_IDX", "detect_chat_format"]
