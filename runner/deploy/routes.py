"""The HTTP side: an OpenAI-compatible FastAPI app over one engine per served model."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import hmac
import json
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from runner.deploy import protocol
from runner.deploy.generation import (
    ChoiceEvent,
    Engine,
    EngineFailed,
    QueueFull,
    RequestHandle,
    RequestTooLarge,
    ShuttingDown,
    TokenLogprob,
)
from runner.deploy.hosts import HostCheckMiddleware
from runner.deploy.protocol import ApiError, Limits
from runner.models.chat_template import names_role, render_chat

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger(__name__)

T = TypeVar("T")

# Seconds a client is told to wait (Retry-After) when the queue is full.
RETRY_AFTER_S = 1
# Prompts (or chats) of at most this many characters are tokenized on the event loop; longer
# ones in a worker thread, so that one long prompt does not hold every other request up. A hop
# to a thread and back costs two takes of the interpreter lock, each of which can wait for the
# engine's thread (up to sys.getswitchinterval()), far more than tokenizing a short prompt.
INLINE_TOKENIZE_CHARS = 2048


@dataclass
class ServedModel:
    """A model the server answers for: its tokenizer, context and (once started) engine."""

    name: str
    tokenizer: PreTrainedTokenizerBase
    max_model_len: int
    start_engine: Callable[[], Engine]
    engine: Engine | None = None
    # Names a request may also give (runner.deploy.selection.ServedCheckpoint.aliases).
    aliases: tuple[str, ...] = ()
    _token_texts: dict[int, str] = field(default_factory=dict, repr=False)

    def token_text(self, token_id: int) -> str:
        """One token's text alone, as logprobs name a token (as vLLM decodes it: by itself,
        a special token written out; a token that ends inside a character reads as U+FFFD)."""
        text = self._token_texts.get(token_id)
        if text is None:
            decoded = self.tokenizer.decode(
                [token_id], skip_special_tokens=False, clean_up_tokenization_spaces=False
            )
            text = self._token_texts[token_id] = str(decoded)
        return text


def build_app(
    models: list[ServedModel],
    *,
    api_key: str | None,
    limits: Limits,
    allowed_hosts: list[str],
    allowed_origins: list[str],
) -> FastAPI:
    """The ASGI app; engines start with the app's lifespan and stop with it. Without an API
    key, requests must name one of `allowed_hosts` in their Host (runner.deploy.hosts); web
    pages of `allowed_origins` may call it from a browser (CORS)."""
    app = FastAPI(lifespan=_lifespan(models), docs_url=None, redoc_url=None, openapi_url=None)
    if api_key is not None:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)
    else:
        app.add_middleware(HostCheckMiddleware, allowed=allowed_hosts)
    if allowed_origins:
        # Outermost (added last): a browser's preflight carries no key, and is answered here.
        app.add_middleware(
            CORSMiddleware,
            allow_origins=allowed_origins,
            allow_methods=["GET", "POST"],
            # Any header a page's client sends (the OpenAI SDKs add X-Stainless-*): the key,
            # or the Host check, guards the request itself.
            allow_headers=["*"],
        )
    app.add_exception_handler(ApiError, _api_error_response)
    app.add_exception_handler(HTTPException, _http_error_response)
    app.add_exception_handler(Exception, _internal_error_response)
    _add_routes(app, models, limits)
    app.state.models = models  # runner.deploy.serve.Server ends their engines as it stops
    return app


def _lifespan(
    models: list[ServedModel],
) -> Callable[[FastAPI], contextlib.AbstractAsyncContextManager[None]]:
    """Start every model's engine when the server starts; close them when it stops."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        """Engines up while the server runs."""
        for model in models:
            model.engine = model.start_engine()
        # What is alive now (torch, transformers, the tokenizers, the engines) lives as long as
        # the server: out of the garbage collector's sight, whose full collections walked all of
        # it (vLLM's freeze_gc_heap does the same). At 128 clients on the stand-in, collections
        # held 41% of the server's samples of the interpreter lock before and 16% after (py-spy
        # --gil --native); the engine's own process collects too little to matter (0.5%).
        gc.collect()
        gc.freeze()
        try:
            yield
        finally:
            gc.unfreeze()  # a server run inside a longer process (the tests) leaves nothing behind
            await close_engines(models)

    return lifespan


async def close_engines(models: list[ServedModel]) -> None:
    """Stop every model's engine, failing what it had not finished (ShuttingDown: a 503);
    once, whether the shutdown's grace ran out (runner.deploy.serve.Server) or the app ends."""
    for model in models:
        engine, model.engine = model.engine, None
        if engine is not None:
            await asyncio.to_thread(engine.close)


def _add_routes(app: FastAPI, models: list[ServedModel], limits: Limits) -> None:
    """GET /health, /v1/models and /v1/models/{name}; POST /v1/completions and
    /v1/chat/completions."""
    by_name = {name: model for model in models for name in (model.name, *model.aliases)}
    created = protocol.now()

    @app.get("/health")
    async def health() -> Any:
        """Liveness, without an API key: 503 once an engine can no longer generate (its
        process ended), so that a supervisor restarts the server."""
        failed = [f"{m.name}: {m.engine.failure}" for m in models if m.engine and m.engine.failure]
        if failed:
            return JSONResponse({"status": "failed", "error": "; ".join(failed)}, status_code=503)
        return {"status": "ok"}

    @app.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        """Every served model, as OpenAI lists models."""
        return {"object": "list", "data": [_model_card(m, created) for m in models]}

    @app.get("/v1/models/{name:path}")
    async def get_model(name: str) -> dict[str, Any]:
        """One served model by name; 404 if none."""
        return _model_card(_find(by_name, name), created)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        """A text completion of a prompt (or several)."""
        body = await read_body(request, limits.max_body_bytes)
        params = protocol.parse_body(protocol.CompletionRequest, body)
        model = _find(by_name, params.model)
        size = _prompt_chars(params.prompt)
        prompts = await _off_loop(size, _tokenize_prompts, model.tokenizer, params.prompt)
        echoed = _echoed(model.tokenizer, params.prompt, prompts) if params.echo else []
        return await _respond(request, model, params, prompts, limits, chat=False, echoed=echoed)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        """The assistant's answer to a conversation."""
        body = await read_body(request, limits.max_body_bytes)
        params = protocol.parse_body(protocol.ChatRequest, body)
        model = _find(by_name, params.model)
        size = sum(len(m.as_template_input()["content"]) for m in params.messages)
        prompt = await _off_loop(size, _render_chat, model.tokenizer, params.messages)
        return await _respond(request, model, params, [prompt], limits, chat=True)


async def _off_loop(size: int, work: Callable[..., T], *args: Any) -> T:
    """`work(*args)` here if the text it works on is short (`size` characters), else in a
    worker thread (INLINE_TOKENIZE_CHARS)."""
    if size <= INLINE_TOKENIZE_CHARS:
        return work(*args)
    return await asyncio.to_thread(work, *args)


def _prompt_chars(prompt: str | list[Any]) -> int:
    """Characters of a completion's prompt(s); a token id counts as one."""
    if isinstance(prompt, str):
        return len(prompt)
    return sum(len(item) if isinstance(item, str | list) else 1 for item in prompt)


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The request body, declared as JSON; 415 if it is not, 413 past `max_bytes`.

    A browser sends a POST of text/plain, form or multipart data from any web page without
    asking first (no CORS preflight), so a server on 127.0.0.1 without an API key would take
    orders from every page its user visits; a JSON body can come only from a client that means it.
    """
    media_type = request.headers.get("content-type", "").partition(";")[0].strip().lower()
    if media_type != "application/json":
        given = f"Content-Type {media_type}" if media_type else "no Content-Type"
        message = f"the request body must be JSON: send Content-Type: application/json ({given})"
        raise ApiError(415, message, code="unsupported_media_type")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise ApiError(413, f"the request body is larger than {max_bytes} bytes")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > max_bytes:
            raise ApiError(413, f"the request body is larger than {max_bytes} bytes")
    return bytes(body)


class ApiKeyMiddleware:
    """Refuses every request but GET /health that lacks `Authorization: Bearer <api_key>`."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._key = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan" or (scope["type"] == "http" and scope["path"] == "/health"):
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers", []))
        scheme, _, given = headers.get(b"authorization", b"").partition(b" ")
        # compare_digest takes as long for a wrong key as for a right one of the same length.
        if scheme.lower() == b"bearer" and hmac.compare_digest(given.strip(), self._key):
            await self.app(scope, receive, send)
            return
        if scope["type"] != "http":
            return  # a websocket closes without being accepted
        error = ApiError(401, "a valid API key is required", code="invalid_api_key")
        response = JSONResponse(error.body(), 401, {"WWW-Authenticate": "Bearer"})
        await response(scope, receive, send)


async def _respond(
    request: Request,
    model: ServedModel,
    params: protocol.SamplingBody,
    prompts: list[list[int]],
    limits: Limits,
    *,
    chat: bool,
    echoed: list[str] | None = None,
) -> Response:
    """Validate, queue and answer a (chat) completion, whole or as server-sent events;
    `echoed`: each prompt's text, where a completion's echo asks for it before its answer."""
    requests = protocol.sampling_requests(
        params,
        prompts,
        limits=limits,
        context=model.max_model_len,
        vocab_size=len(model.tokenizer),
    )
    if model.engine is None:  # engines start with the app, and end as the server stops
        raise _shutting_down(ShuttingDown())
    try:
        handle = model.engine.submit(requests)
    except RequestTooLarge as error:
        raise ApiError(400, str(error), param="n") from error
    except QueueFull as error:
        headers = {"Retry-After": str(RETRY_AFTER_S)}
        message = f"the server is busy ({error}): retry after {RETRY_AFTER_S}s"
        raise ApiError(429, message, code="queue_full", headers=headers) from error
    except ShuttingDown as error:
        raise _shutting_down(error) from error
    except EngineFailed as error:
        raise ApiError(503, str(error)) from error
    prompt_tokens = sum(len(prompt) for prompt in prompts)
    kind = "chatcmpl" if chat else "cmpl"
    answer = _Answer(
        protocol.new_response_id(kind),
        model.name,
        protocol.now(),
        chat,
        model.token_text if params.logprobs_asked() is not None else None,
        # Choice i * n + j answers prompt i.
        tuple(text for text in echoed or [] for _ in range(params.n or 1)),
    )
    if params.stream:
        events = answer.stream(handle, prompt_tokens, params.wants_usage_chunk())
        # No caching or proxy buffering: each event should reach the client as it is made.
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        return StreamingResponse(events, media_type="text/event-stream", headers=headers)
    whole = asyncio.ensure_future(answer.whole(handle, prompt_tokens))
    if not await _done_unless_gone(request, whole):
        return Response(status_code=499)  # nginx's "client closed request": nobody reads it
    # A response, not a dict: FastAPI would pass a dict through jsonable_encoder first (about
    # 20 us a body of plain values, which it leaves as they are).
    return JSONResponse(whole.result())


async def _done_unless_gone(request: Request, work: asyncio.Future[Any]) -> bool:
    """Whether `work` finished; False where the client went away first, and `work` is
    cancelled (a whole answer's cancels its request): an answer nobody waited for held its
    rows and its room in the queue to its last token. A stream's ends as its first write
    after the client left fails."""
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    if work.done():
        return True
    work.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await work
    return False


async def _disconnected(request: Request) -> None:
    """Returns once the client has gone (its body already read, the next message is that)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _shutting_down(error: ShuttingDown) -> ApiError:
    """What a request the stopping server will not finish is answered: another server may."""
    return ApiError(503, f"{error}: retry", code="server_shutting_down")


@dataclass(frozen=True)
class _Answer:
    """The fixed parts of one response: its id, model, creation time and kind."""

    id: str
    model: str
    created: int
    chat: bool
    # One token's text, where the request asked for logprobs (ServedModel.token_text); None
    # where it did not, and every choice's logprobs is null.
    token_text: Callable[[int], str] | None = None
    # Each choice's prompt, where a completion's echo writes it before the answer; () if not.
    echoed: tuple[str, ...] = ()

    def envelope(self, chunk: bool) -> dict[str, Any]:
        """The fields every response or chunk starts with."""
        kind = "chat.completion" if self.chat else "text_completion"
        kind = f"{kind}.chunk" if chunk and self.chat else kind
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def choice(self, event: ChoiceEvent, text_offset: int, first: bool) -> dict[str, Any]:
        """One choice of a streamed chunk (`first`: its choice's first, which an echo's prompt
        begins); `text_offset`: the length of its choice's tokens' texts before it (a text
        completion's logprobs count on from there)."""
        logprobs = self.logprobs([*event.prompt_logprobs, *event.logprobs], text_offset)
        if self.chat:
            delta = {"content": event.text} if event.text else {}
            return protocol.chat_chunk_choice(event.index, delta, event.finish_reason, logprobs)
        text = self.echoed[event.index] + event.text if first and self.echoed else event.text
        return protocol.completion_choice(event.index, text, event.finish_reason, logprobs)

    def logprobs(
        self, tokens: Sequence[TokenLogprob], text_offset: int = 0
    ) -> dict[str, Any] | None:
        """A choice's `logprobs` for `tokens`, in its route's form; None where none were asked."""
        if self.token_text is None:
            return None
        if self.chat:
            return protocol.chat_logprobs(tokens, self.token_text)
        return protocol.completion_logprobs(tokens, self.token_text, text_offset)

    async def whole(self, handle: RequestHandle, prompt_tokens: int) -> dict[str, Any]:
        """The whole response, once every choice has finished."""
        texts = {index: [self.echoed[index]] if self.echoed else [] for index in range(handle.n)}
        logprobs: dict[int, list[TokenLogprob]] = {index: [] for index in range(handle.n)}
        finish: dict[int, str | None] = {}
        tokens: dict[int, int] = {}
        try:
            async for event in handle.events():
                texts[event.index].append(event.text)
                logprobs[event.index] += [*event.prompt_logprobs, *event.logprobs]
                finish[event.index] = event.finish_reason
                tokens[event.index] = event.completion_tokens
        except RequestTooLarge as error:
            raise ApiError(400, str(error), param="max_tokens") from error
        except ShuttingDown as error:
            raise _shutting_down(error) from error
        except EngineFailed as error:
            raise ApiError(500, f"generation failed: {error}") from error
        finally:
            handle.cancel()
        make = protocol.chat_choice if self.chat else protocol.completion_choice
        choices = [
            make(i, "".join(texts[i]), finish[i], self.logprobs(logprobs[i]))
            for i in range(handle.n)
        ]
        usage = protocol.usage(prompt_tokens, sum(tokens.values()))
        return {**self.envelope(chunk=False), "choices": choices, "usage": usage}

    async def stream(
        self, handle: RequestHandle, prompt_tokens: int, include_usage: bool
    ) -> AsyncIterator[str]:
        """The response as server-sent events, ending in [DONE]."""
        tokens: dict[int, int] = {}
        # Each choice's tokens' texts so far: a text completion's logprobs count on from there.
        offsets = dict.fromkeys(range(handle.n), 0)
        try:
            if self.chat:
                role = {"role": "assistant", "content": ""}
                choices = [protocol.chat_chunk_choice(i, role, None) for i in range(handle.n)]
                yield _sse({**self.envelope(chunk=True), "choices": choices})
            async for batch in handle.batches():
                chunks = []
                for event in coalesced(batch):
                    first = event.index not in tokens
                    tokens[event.index] = event.completion_tokens
                    choice = self.choice(event, offsets[event.index], first)
                    if choice["logprobs"] and not self.chat:
                        offsets[event.index] += sum(map(len, choice["logprobs"]["tokens"]))
                    chunks.append(_sse({**self.envelope(chunk=True), "choices": [choice]}))
                yield "".join(chunks)  # one write for what arrived together
            if include_usage:
                usage = protocol.usage(prompt_tokens, sum(tokens.values()))
                yield _sse({**self.envelope(chunk=True), "choices": [], "usage": usage})
        except RequestTooLarge as error:
            yield _sse(ApiError(400, str(error), param="max_tokens").body())
        except ShuttingDown as error:
            yield _sse(_shutting_down(error).body())
        except EngineFailed as error:
            yield _sse(ApiError(500, f"generation failed: {error}").body())
        except Exception:  # headers are sent: end the stream cleanly rather than cut it off
            log.exception("unexpected error streaming %s", self.id)
            yield _sse(ApiError(500, "internal server error").body())
        finally:
            handle.cancel()  # a client that went away stops costing generation steps
        yield "data: [DONE]\n\n"


def coalesced(events: list[ChoiceEvent]) -> list[ChoiceEvent]:
    """One event per choice for `events` that arrived together: its texts and logprobs joined,
    its last finish_reason and token count (an OpenAI chunk may hold several tokens' text)."""
    merged: dict[int, ChoiceEvent] = {}
    for event in events:
        if (before := merged.get(event.index)) is not None:
            event = dataclasses.replace(
                event,
                text=before.text + event.text,
                logprobs=before.logprobs + event.logprobs,
                prompt_logprobs=before.prompt_logprobs + event.prompt_logprobs,
            )
        merged[event.index] = event
    return list(merged.values())


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def _find(by_name: dict[str, ServedModel], name: str) -> ServedModel:
    if name not in by_name:
        served = ", ".join(sorted({model.name for model in by_name.values()}))
        message = f"the model {name!r} does not exist; this server serves: {served}"
        raise ApiError(404, message, param="model", code="model_not_found")
    return by_name[name]


def _model_card(model: ServedModel, created: int) -> dict[str, Any]:
    return {
        "id": model.name,
        "object": "model",
        "created": created,
        "owned_by": "runner",
        "max_model_len": model.max_model_len,
    }


def _tokenize_prompts(
    tokenizer: PreTrainedTokenizerBase, prompt: str | list[Any]
) -> list[list[int]]:
    """Token ids of each prompt: a string, a list of strings, token ids, or lists of them."""
    if isinstance(prompt, str):
        return [tokenizer.encode(prompt, add_special_tokens=True)]
    if prompt and all(isinstance(item, int) for item in prompt):
        return [list(prompt)]
    return [
        tokenizer.encode(item, add_special_tokens=True) if isinstance(item, str) else list(item)
        for item in prompt
    ]


def _echoed(
    tokenizer: PreTrainedTokenizerBase, prompt: str | list[Any], prompts: list[list[int]]
) -> list[str]:
    """Each prompt's text as echo writes it: as sent, or its token ids decoded (special tokens
    written out)."""
    if isinstance(prompt, str):
        return [prompt]
    given = [prompt] if all(isinstance(item, int) for item in prompt) else prompt
    return [
        item
        if isinstance(item, str)
        else str(
            tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        )
        for item, ids in zip(given, prompts, strict=True)
    ]


def _render_chat(
    tokenizer: PreTrainedTokenizerBase, messages: list[protocol.ChatMessage]
) -> list[int]:
    if not tokenizer.chat_template:
        message = "this model has no chat template: use /v1/completions with a plain prompt"
        raise ApiError(400, message, param="messages")
    rendered = [message.as_template_input() for message in messages]
    if not names_role(str(tokenizer.chat_template), "developer"):
        # OpenAI's developer message is its newer models' system message. A template without
        # it dropped it (ChatML's) or wrote a header no model was trained on (Llama 3's), and
        # training refuses the role: it is rendered as the system message, as llama.cpp does.
        rendered = [{**m, "role": "system"} if m["role"] == "developer" else m for m in rendered]
    try:
        text = render_chat(tokenizer, rendered, add_generation_prompt=True)
    except Exception as error:  # the template's own checks (raise_exception) and Jinja errors
        raise ApiError(400, f"the chat template refused these messages: {error}") from error
    # The template writes the special tokens (begin_of_text) itself.
    return tokenizer.encode(text, add_special_tokens=False)


async def _api_error_response(request: Request, error: Exception) -> JSONResponse:
    assert isinstance(error, ApiError)
    return JSONResponse(error.body(), error.status, error.headers)


async def _http_error_response(request: Request, error: Exception) -> JSONResponse:
    assert isinstance(error, HTTPException)
    api_error = ApiError(error.status_code, str(error.detail))
    return JSONResponse(api_error.body(), error.status_code, error.headers)


async def _internal_error_response(request: Request, error: Exception) -> JSONResponse:
    log.error("unexpected error serving %s", request.url.path, exc_info=error)
    return JSONResponse(ApiError(500, "internal server error").body(), 500)
