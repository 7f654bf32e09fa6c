"""The OpenAI request bodies this server accepts, their limits, and the responses it sends."""

from __future__ import annotations

import itertools
import json
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from runner.deploy.generation import MAX_LOGPROBS, SamplingRequest, TokenLogprob
from runner.models.chat_template import template_message

# OpenAI parameters this server does not implement: accepted only at values that change nothing,
# so a client never silently gets something other than what it asked for.
_NEUTRAL_VALUES: dict[str, tuple[Any, ...]] = {
    "suffix": (None, ""),
    "best_of": (None, 1),
    "presence_penalty": (None, 0),
    "frequency_penalty": (None, 0),
    "logit_bias": (None, {}),
    "tools": (None, []),
    "functions": (None, []),
    "response_format": (None, {"type": "text"}),
    "tool_choice": (None, "none", "auto"),  # with no tools, auto is none
    "function_call": (None, "none", "auto"),
    "modalities": (None, ["text"]),
}
# OpenAI parameters that change nothing in the answer (who asks, what the client keeps, how it
# is billed; parallel_tool_calls without tools): accepted at any value. Any other field not in
# the request's model is refused, as OpenAI refuses it: a misspelt max_tokens or another
# server's sampling option would otherwise be dropped unseen.
_NO_EFFECT = frozenset(
    {
        "user",
        "metadata",
        "store",
        "service_tier",
        "prompt_cache_key",
        "safety_identifier",
        "parallel_tool_calls",
    }
)

# The kinds of a field that takes several, as pydantic names them in an error's location.
_KINDS = {
    "str": "a string",
    "list[str]": "a list of strings",
    "list[int]": "a list of token ids",
    "list[list[int]]": "a list of lists of token ids",
    "list[TextPart]": "a list of text parts",
}

# Arrays and objects nested deeper than this are refused; a real request nests about 5 deep.
MAX_JSON_DEPTH = 64

# A log probability of minus infinity (a token the model rules out), which JSON cannot write,
# is written as this, as OpenAI and vLLM write it.
LOGPROB_FLOOR = -9999.0

# Temperatures below this sample greedily. Sampling there is greedy but for exact ties anyway
# (a logit gap of 0.001 becomes a factor of e^-100), and dividing float32 logits by a still
# smaller temperature overflows them to inf, whose softmax is nan. vLLM draws the line here too.
GREEDY_BELOW = 1e-5


class ApiError(Exception):
    """An error answered to the client as OpenAI does: a status and {"error": {...}}."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        """The JSON body of the error response."""
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        error = {"message": self.message, "type": kind, "param": self.param, "code": self.code}
        return {"error": error}


@dataclass(frozen=True)
class Limits:
    """Caps on what one request may ask for (the `limits` config slice)."""

    max_n: int
    max_tokens: int
    default_max_tokens: int
    max_stop: int
    max_stop_chars: int
    max_body_bytes: int


class StreamOptions(BaseModel):
    """`stream_options`: whether the last streamed chunk carries the usage counts."""

    model_config = ConfigDict(extra="forbid")  # a misspelt include_usage is no usage, unseen

    include_usage: bool | None = False
    include_obfuscation: bool | None = None  # OpenAI's padding of each chunk: none is added here


class SamplingBody(BaseModel):
    """What both request bodies share: the model asked for and how to sample."""

    # NaN and Infinity (which Python's json reads) are "not a finite number", not "above 2".
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    # vLLM's and SGLang's extension: 0 or -1 keeps every token.
    top_k: int | None = Field(default=None, ge=-1)
    n: int | None = Field(default=None, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**64)
    stream: bool | None = False
    stream_options: StreamOptions | None = None

    def wants_usage_chunk(self) -> bool:
        """Whether a streamed response ends with a usage chunk."""
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def token_cap(self) -> tuple[str, int | None]:
        """The field that caps the answer's tokens, as the client named it, and its value."""
        return "max_tokens", self.max_tokens

    def logprobs_asked(self) -> int | None:
        """How many top log probabilities each generated token is returned with (None: no
        logprobs at all; 0: the sampled token's alone)."""
        return None

    def prompt_logprobs_asked(self) -> bool:
        """Whether the prompt's tokens' logprobs are returned too."""
        return False

    def check(self) -> None:
        """What holds between fields, past each field's own type and range: a 400 naming it."""
        if self.stream_options is not None and not self.stream:
            # OpenAI refuses it so: the options of a stream asked of no stream are no options.
            message = "stream_options is only allowed when stream is true"
            raise ApiError(400, message, param="stream_options")


BodyT = TypeVar("BodyT", bound=SamplingBody)


class CompletionRequest(SamplingBody):
    """POST /v1/completions."""

    prompt: str | list[str] | list[int] | list[list[int]]
    # The sampled token's log probability and the most likely `logprobs` tokens' (0 to 20, as
    # vLLM allows; OpenAI's own API stops at 5).
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    # The prompt before the answer's text, and with logprobs before its tokens' (lm-evaluation-
    # harness scores a continuation so: echo, logprobs 1, max_tokens 1).
    echo: bool | None = None

    def logprobs_asked(self) -> int | None:
        """`logprobs` as given."""
        return self.logprobs

    def prompt_logprobs_asked(self) -> bool:
        """echo with logprobs."""
        return bool(self.echo) and self.logprobs is not None


class TextPart(BaseModel):
    """A text part of a chat message's content."""

    type: Literal["text"]
    text: str


# Fields of an assistant's message as OpenAI answers it, which a client sends back as the
# conversation's history (the openai client's message.model_dump() holds them all): accepted at
# the values that change nothing, as _NEUTRAL_VALUES are.
_MESSAGE_NEUTRAL_VALUES: dict[str, tuple[Any, ...]] = {
    "refusal": (None,),
    "tool_calls": (None, []),
    "function_call": (None,),
    "audio": (None,),
    "annotations": (None, []),
}


class ChatMessage(BaseModel):
    """One message of a chat, rendered through the checkpoint's chat template. Any other field
    (a misspelt `content`, an assistant's `tool_calls`) is refused (ChatRequest.check): dropped,
    the model answered another conversation than the one sent."""

    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None  # the speaker, for the templates that write it (as vLLM passes it)
    tool_call_id: str | None = None  # the call a tool message answers (OpenAI requires it)

    def as_template_input(self) -> dict[str, str]:
        """The message as chat templates expect it (template_message, as training gives it):
        role, plain-text content, and its name and tool_call_id where it has them."""
        content = self.content or ""
        if not isinstance(content, str):
            content = "".join(part.text for part in content)
        return template_message(self.role, content, name=self.name, tool_call_id=self.tool_call_id)

    def check(self, where: str) -> None:
        """A field of no use here is refused unless at a value that changes nothing."""
        for key, value in (self.model_extra or {}).items():
            if key not in _MESSAGE_NEUTRAL_VALUES:
                raise ApiError(
                    400, f"unrecognized request argument: {where}.{key}", param=f"{where}.{key}"
                )
            _check_neutral(f"{where}.{key}", value, _MESSAGE_NEUTRAL_VALUES[key])


class ChatRequest(SamplingBody):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)

    def logprobs_asked(self) -> int | None:
        """`top_logprobs` (0 where left out) once `logprobs` is true."""
        return (self.top_logprobs or 0) if self.logprobs else None

    def token_cap(self) -> tuple[str, int | None]:
        """max_completion_tokens (OpenAI's name now) where given, else max_tokens."""
        if self.max_completion_tokens is not None:
            return "max_completion_tokens", self.max_completion_tokens
        return super().token_cap()

    def check(self) -> None:
        """Past SamplingBody's: each message's fields, and every message but an assistant's
        has its content (OpenAI's rule); one without read as an empty message."""
        super().check()
        if self.top_logprobs and not self.logprobs:
            # OpenAI's rule: the top of tokens whose own log probabilities were not asked for.
            why = "top_logprobs needs logprobs: true, which returns the tokens' logprobs"
            raise ApiError(400, why, param="top_logprobs")
        for i, message in enumerate(self.messages):
            message.check(f"messages.{i}")
            if message.content is None and message.role != "assistant":
                where = f"messages.{i}.content"
                raise ApiError(
                    400, f"{where}: a {message.role} message needs its content", param=where
                )


def parse_body(model: type[BodyT], raw: bytes) -> BodyT:
    """Decode and validate a request body into a request model, or raise a 400 naming the field.

    Everything a client sends is checked here, before it reaches a tokenizer or an engine.
    """
    try:
        body = json.loads(raw)
    except RecursionError as error:  # the C decoder's own limit, well past MAX_JSON_DEPTH
        raise _too_deep(param=None) from error
    except ValueError as error:  # UnicodeDecodeError is a ValueError too
        raise ApiError(400, f"the request body is not valid JSON: {error}") from error
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    _check_json_values(body)
    unknown = sorted(set(body) - set(model.model_fields) - set(_NEUTRAL_VALUES) - _NO_EFFECT)
    if unknown:
        takes = ", ".join(model.model_fields)
        message = f"unrecognized request argument: {unknown[0]}; this route takes {takes}"
        raise ApiError(400, message, param=unknown[0])
    for key, neutral in _NEUTRAL_VALUES.items():
        if key in body:
            _check_neutral(key, body[key], neutral)
    try:
        # Strict: a "5" is not a max_tokens, nor "yes" a stream (OpenAI refuses both).
        parsed = model.model_validate(body, strict=True)
    except ValidationError as error:
        raise _invalid(error) from error
    parsed.check()
    n = getattr(parsed, "n", None) or 1  # n left out (null) is 1
    if body.get("best_of") is not None and n > 1:  # best_of is 1 here: one candidate, n answers
        message = f"best_of must be at least n ({n}), as OpenAI's API says; leave best_of out"
        raise ApiError(400, message, param="best_of")
    return parsed


def _check_neutral(param: str, value: Any, neutral: tuple[Any, ...]) -> None:
    """A 400 naming `param` unless its `value` is one of those that change nothing."""
    if not any(_same(value, one) for one in neutral):
        raise ApiError(400, f"{param} is not supported by this server", param=param)


def _same(value: Any, neutral: Any) -> bool:
    """Equal, and a bool only to a bool (0 == False in Python, not in a request)."""
    return bool(value == neutral) and isinstance(value, bool) == isinstance(neutral, bool)


def _invalid(error: ValidationError) -> ApiError:
    """A 400 naming the field as the client wrote it; one that takes several kinds (a prompt:
    text, texts or token ids) names them all, where pydantic gives one complaint a kind."""
    errors = error.errors()
    path = [str(part) for part in errors[0]["loc"]]
    if errors[0]["type"] == "extra_forbidden":  # inside a message or stream_options
        where = ".".join(path)
        return ApiError(400, f"unrecognized request argument: {where}", param=where)
    cut = next((i for i, part in enumerate(path) if part in _KINDS), None)
    if cut is None:
        where = ".".join(path)
        return ApiError(400, f"{where}: {errors[0]['msg']}", param=where or None)
    where = ".".join(path[:cut])
    kinds = [
        _KINDS[str(e["loc"][cut])]
        for e in errors
        if [str(part) for part in e["loc"][:cut]] == path[:cut] and len(e["loc"]) > cut
    ]
    kinds = list(dict.fromkeys(kinds))
    listed = ", ".join(kinds[:-1]) + f" or {kinds[-1]}" if len(kinds) > 1 else kinds[0]
    return ApiError(400, f"{where}: give {listed}", param=where)


def _check_json_values(body: dict[str, Any]) -> None:
    """Refuse nesting past MAX_JSON_DEPTH and text that is not Unicode, naming the field.

    JSON's \\ud800 escapes decode to lone surrogates, which no tokenizer or UTF-8 encoder takes.
    """
    # Field names come off the stack first: an error names its field only once that is known good.
    pending: list[tuple[object, int, str | None]] = [(v, 2, k) for k, v in body.items()]
    pending += [(key, 1, None) for key in body]
    while pending:
        item, depth, field = pending.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError as error:
                bad = item[error.start].encode("unicode_escape").decode()
                where = f"{field}: the text" if field else "a field name"
                message = f"{where} holds a lone surrogate ({bad}), which is not Unicode"
                raise ApiError(400, message, param=field) from error
        elif isinstance(item, (list, dict)):
            if depth > MAX_JSON_DEPTH:
                raise _too_deep(param=field)
            children = [*item.keys(), *item.values()] if isinstance(item, dict) else item
            pending.extend((child, depth + 1, field) for child in children)


def _too_deep(param: str | None) -> ApiError:
    message = f"the request body nests arrays and objects more than {MAX_JSON_DEPTH} levels deep"
    return ApiError(400, message, param=param)


def sampling_requests(
    params: SamplingBody,
    prompts: list[list[int]],
    *,
    limits: Limits,
    context: int,
    vocab_size: int,
) -> list[SamplingRequest]:
    """Check the tokenized prompts against the model and the limits; the engine's requests."""
    if not prompts:
        raise ApiError(400, "the prompt is empty", param="prompt")
    n = params.n or 1
    if len(prompts) * n > limits.max_n:
        asked = f"n is {n}" if len(prompts) == 1 else f"prompts times n is {len(prompts) * n}"
        raise ApiError(400, f"{asked}; this server allows at most {limits.max_n}", param="n")
    stops = [params.stop] if isinstance(params.stop, str) else list(params.stop or [])
    if len(stops) > limits.max_stop:
        raise ApiError(400, f"at most {limits.max_stop} stop sequences are allowed", param="stop")
    if any(not stop or len(stop) > limits.max_stop_chars for stop in stops):
        message = f"each stop sequence must have 1 to {limits.max_stop_chars} characters"
        raise ApiError(400, message, param="stop")
    temperature = 1.0 if params.temperature is None else params.temperature
    field = "messages" if hasattr(params, "messages") else "prompt"
    cap = params.token_cap()
    return [
        SamplingRequest(
            prompt_ids=prompt_ids,
            max_tokens=_tokens_to_generate(prompt_ids, cap, limits, context, vocab_size, field),
            temperature=0.0 if temperature < GREEDY_BELOW else temperature,
            top_p=1.0 if params.top_p is None else params.top_p,
            seed=params.seed,
            stop=stops,
            n=n,
            stream=bool(params.stream),
            logprobs=params.logprobs_asked(),
            prompt_logprobs=params.prompt_logprobs_asked(),
            top_k=max(params.top_k or 0, 0),
        )
        for prompt_ids in prompts
    ]


def _tokens_to_generate(
    prompt_ids: list[int],
    cap: tuple[str, int | None],
    limits: Limits,
    context: int,
    vocab_size: int,
    field: str,
) -> int:
    """How many tokens one prompt may generate: the cap (max_tokens or max_completion_tokens,
    named as the client sent it), or the default where it is left out; a 400 when the prompt's
    token ids or that count do not fit the model (`field`: what holds the prompt, named where
    the prompt alone does not fit)."""
    cap_field, max_tokens = cap
    if not prompt_ids:
        raise ApiError(400, "the prompt is empty", param="prompt")
    if any(not 0 <= token_id < vocab_size for token_id in prompt_ids):
        raise ApiError(400, f"prompt token ids must be in [0, {vocab_size})", param="prompt")
    room = context - len(prompt_ids)
    if room < 1:
        message = (
            f"this model's maximum context length is {context} tokens; the prompt has "
            f"{len(prompt_ids)} tokens, which leaves none to generate: shorten the {field}"
        )
        raise ApiError(400, message, param=field, code="context_length_exceeded")
    if max_tokens is None:
        max_tokens = min(limits.default_max_tokens, room)
    if max_tokens > limits.max_tokens:
        message = f"{cap_field} is {max_tokens}; this server allows at most {limits.max_tokens}"
        raise ApiError(400, message, param=cap_field)
    if max_tokens > room:
        message = (
            f"this model's maximum context length is {context} tokens; the prompt has "
            f"{len(prompt_ids)} tokens and {cap_field} is {max_tokens}: shorten the prompt "
            f"or lower {cap_field}"
        )
        raise ApiError(400, message, param=cap_field, code="context_length_exceeded")
    return max_tokens


def new_response_id(prefix: str) -> str:
    """An id for a completion, like OpenAI's cmpl-... and chatcmpl-..."""
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    """Seconds since the epoch, as OpenAI's `created` fields."""
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    """The usage block of a response."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def completion_choice(
    index: int, text: str, finish_reason: str | None, logprobs: dict[str, Any] | None = None
) -> dict[str, Any]:
    """One choice of a text completion (whole or streamed)."""
    return {"index": index, "text": text, "finish_reason": finish_reason, "logprobs": logprobs}


def chat_choice(
    index: int, text: str, finish_reason: str | None, logprobs: dict[str, Any] | None = None
) -> dict[str, Any]:
    """One choice of a chat completion."""
    message = {"role": "assistant", "content": text}
    return {
        "index": index,
        "message": message,
        "finish_reason": finish_reason,
        "logprobs": logprobs,
    }


def chat_chunk_choice(
    index: int,
    delta: dict[str, str],
    finish_reason: str | None,
    logprobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One choice of a streamed chat completion chunk."""
    return {"index": index, "delta": delta, "finish_reason": finish_reason, "logprobs": logprobs}


def chat_logprobs(
    tokens: Sequence[TokenLogprob], token_text: Callable[[int], str]
) -> dict[str, Any]:
    """A chat choice's `logprobs` (or a chunk's, for its tokens): each token's text, log
    probability and UTF-8 bytes, with its `top_logprobs` alike; `token_text`: one token's text."""

    def entry(token_id: int, logprob: float | None) -> dict[str, Any]:  # never None: no echo
        text = token_text(token_id)
        return {"token": text, "logprob": _finite(logprob), "bytes": list(text.encode())}

    content = [
        {**entry(t.token_id, t.logprob), "top_logprobs": [entry(*top) for top in t.top]}
        for t in tokens
    ]
    return {"content": content, "refusal": None}


def completion_logprobs(
    tokens: Sequence[TokenLogprob], token_text: Callable[[int], str], text_offset: int = 0
) -> dict[str, Any]:
    """A text completion choice's `logprobs` (or a chunk's), in OpenAI's older form: the tokens'
    texts, their log probabilities, the top ones by text (the sampled token's among them, as
    OpenAI writes it: up to logprobs + 1; where two tokens read as one text, as the pieces of
    a character split across tokens read U+FFFD, the sampled token's figure stands for it), and
    where each token starts, counting the tokens' texts as `tokens` gives them (as vLLM counts
    them), from `text_offset` (a streamed chunk's: the texts of the tokens before it)."""
    texts = [token_text(t.token_id) for t in tokens]
    starts = list(itertools.accumulate(map(len, texts), initial=text_offset))[: len(texts)]
    tops: list[dict[str, float | None] | None] = []
    for token in tokens:
        if token.logprob is None:  # a prompt's first token: nothing predicts it
            tops.append(None)
            continue
        top = {token_text(token_id): _finite(logprob) for token_id, logprob in token.top}
        top[token_text(token.token_id)] = _finite(token.logprob)
        tops.append(top)
    return {
        "tokens": texts,
        "token_logprobs": [_finite(t.logprob) for t in tokens],
        "top_logprobs": tops,
        "text_offset": starts,
    }


def _finite(logprob: float | None) -> float | None:
    """A log probability JSON can write (LOGPROB_FLOOR for minus infinity; None, a prompt's first
    token's, as null)."""
    return None if logprob is None else max(logprob, LOGPROB_FLOOR)
