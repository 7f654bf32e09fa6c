"""The tiny model's tokenizer: a Hugging Face tokenizer.json in Llama 3's chat format.

torchtune's ModelTokenizer protocol over the `tokenizers` library; the same ids as the
chat_template in tokenizer_config.json, so `transformers` reproduces what training saw.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from runner.tune import CROSS_ENTROPY_IGNORE_IDX, Message, truncate


class ChatTokenizer:
    """Llama 3's chat format: <|start_header_id|>role<|end_header_id|>, content, <|eot_id|>."""

    def __init__(self, path: str, max_seq_len: int | None = None) -> None:
        self._tokenizer = Tokenizer.from_file(str(Path(path) / "tokenizer.json"))
        config = json.loads((Path(path) / "tokenizer_config.json").read_text())
        self.special_tokens = {
            token.content: token_id
            for token_id, token in self._tokenizer.get_added_tokens_decoder().items()
        }
        self.bos_id = self.special_tokens[config["bos_token"]]
        self.eos_id = self.special_tokens[config["eos_token"]]
        self.pad_id = self.special_tokens[config["pad_token"]]
        self.stop_tokens = [self.eos_id, self.special_tokens["<|end_of_text|>"]]
        self._start_header = self.special_tokens["<|start_header_id|>"]
        self._end_header = self.special_tokens["<|end_header_id|>"]
        self.max_seq_len = max_seq_len

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size()

    def encode(self, text: str, add_bos: bool = True, add_eos: bool = True) -> list[int]:
        ids = self._tokenizer.encode(text, add_special_tokens=False).ids
        return ([self.bos_id] if add_bos else []) + ids + ([self.eos_id] if add_eos else [])

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def _header(self, role: str) -> list[int]:
        role_ids = self.encode(role, add_bos=False, add_eos=False)
        return [self._start_header, *role_ids, self._end_header] + self.encode(
            "\n\n", add_bos=False, add_eos=False
        )

    def tokenize_messages(
        self, messages: list[Message], add_end_tokens: bool = True
    ) -> tuple[list[int], list[bool]]:
        """Token ids and a mask (True: no loss) for a conversation.

        Headers are always masked: they are the prompt's, not the answer's. With
        add_end_tokens=False the last message is left open, as a generation prompt.
        """
        tokens, mask = [self.bos_id], [True]
        for i, message in enumerate(messages):
            header = self._header(message.role)
            tokens += header
            mask += [True] * len(header)
            body = self.encode(message.text_content, add_bos=False, add_eos=False)
            is_open = not add_end_tokens and i == len(messages) - 1
            if not is_open:
                body.append(self.eos_id)
            tokens += body
            mask += [message.masked] * len(body)
        if self.max_seq_len and len(tokens) > self.max_seq_len:
            tokens = truncate(tokens, self.max_seq_len, self.eos_id if add_end_tokens else None)
            mask = truncate(mask, self.max_seq_len, True if add_end_tokens else None)
        return tokens, mask

    def generation_prompt(self, messages: list[Message]) -> list[int]:
        """Ids of `messages` followed by an open assistant header, as for generation."""
        tokens, _ = self.tokenize_messages(messages)
        return tokens + self._header("assistant")

    def __call__(self, sample: dict[str, Any], inference: bool = False) -> dict[str, Any]:
        """torchtune's model transform: messages -> tokens, mask."""
        tokens, mask = self.tokenize_messages(sample.pop("messages"))
        sample["tokens"], sample["mask"] = tokens, mask
        return sample


__all__ = ["ChatTokenizer", "CROSS_ENTROPY_IGNORE_IDX"]
