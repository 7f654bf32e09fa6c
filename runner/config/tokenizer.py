"""model.tokenizer and model.chat_template: the tokenizer a model trains with, checked against
the model it feeds (its vocabulary, its chat template's answers ending in a stop token)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omegaconf import DictConfig

from runner.errors import UserError
from runner.paths import user_path

if TYPE_CHECKING:
    from runner.models.tokenizer import ChatTokenizer

log = logging.getLogger(__name__)


def _chat_template_file(value: str | None) -> str | None:
    """model.chat_template as an absolute path to a template file (None: the tokenizer's own)."""
    if value is None:
        return None
    path = user_path(value).resolve()
    if not path.is_file():
        raise UserError(
            "model.chat_template",
            value,
            "is not a file; give the path of a Jinja chat template file (for a tokenizer that "
            "has none), or null to use the tokenizer's own template",
        )
    return str(path)


def checked_tokenizer(
    model: DictConfig, builder: dict[str, Any], tokenizer_dir: Path
) -> ChatTokenizer:
    """The tokenizer with its chat template (the tokenizer's own unless model.chat_template
    names a file), its vocabulary checked against the builder's; a template whose answers end
    in no stop token is warned of."""
    from runner.models.tokenizer import ChatTokenizer

    template = _chat_template_file(model.chat_template)
    try:
        tokenizer = ChatTokenizer(str(tokenizer_dir), builder["max_seq_len"], template)
    except UserError as err:
        if err.key != "model.tokenizer" or model.tokenizer is not None:
            raise
        # model.tokenizer left null is model.source's files: the key the user gave.
        fix = f"{err.fix} (model.tokenizer left null reads the source's)"
        raise UserError("model.source", model.source, fix) from None
    if not tokenizer.answers_end_in_a_stop_token():
        stops = [tokenizer.decode([t], skip_special_tokens=False) for t in tokenizer.stop_tokens]
        log.warning(
            "%s ends an assistant's answer with no stop token (%s): a model trained on it "
            "never learns to stop, and generates to max_new_tokens; end the assistant's turn "
            "with {{ eos_token }} in model.chat_template",
            tokenizer.template_name,
            ", ".join(stops),
        )
    rows = builder["vocab_size"]
    if tokenizer.max_token_id >= rows:
        fits = (
            f"token ids up to {tokenizer.max_token_id}, and the model's embedding has {rows} rows"
        )
        if model.builder is not None:
            raise UserError(
                "model.builder.vocab_size",
                rows,
                f"the tokenizer gives {fits}; give at least {tokenizer.max_token_id + 1}",
            )
        if model.tokenizer is not None:
            raise UserError(
                "model.tokenizer",
                model.tokenizer,
                f"it gives {fits} (model.source's vocab_size); give the model's own tokenizer",
            )
        raise UserError(
            "model.source",
            model.source,
            f"its tokenizer gives {fits} (config.json's vocab_size); give a checkpoint whose "
            "tokenizer and weights belong together",
        )
    return tokenizer
