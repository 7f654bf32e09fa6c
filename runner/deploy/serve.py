"""The body of `runner deploy`: choose and load what to serve, read the API key, run the server."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import ipaddress
import logging
import math
import os
import signal
import socket
import threading
from collections.abc import Iterator, Mapping
from typing import Any

import uvicorn
from fastapi import FastAPI
from omegaconf import DictConfig, OmegaConf

from runner.components import plain_dict
from runner.config.schema import Deploy, typed
from runner.config.secrets import check_env_name
from runner.console import takeable
from runner.deploy.routes import ServedModel, close_engines
from runner.deploy.selection import ServedCheckpoint, check_given, resolve_checkpoints
from runner.errors import UserError
from runner.paths import refuse_empty_path, user_path

log = logging.getLogger(__name__)

ENGINES = ("transformers", "vllm")
# Seconds the requests in flight as the server stops have to finish (Server).
GRACE_S = 5.0


def deploy(cfg: DictConfig) -> None:
    """Serve the checkpoints that `cfg` names until interrupted."""
    app, sock = prepare(cfg)
    run_server(
        app, sock, ready=f"OpenAI-compatible API at {served_url(sock)} (engine={cfg.engine})"
    )


def prepare(cfg: DictConfig) -> tuple[FastAPI, socket.socket]:
    """Everything before serving: the API key, the bound socket, the loaded models, the app."""
    from runner.deploy.hosts import allowed_hosts, check_hosts, check_origins
    from runner.deploy.protocol import Limits
    from runner.deploy.routes import build_app

    check_given(cfg)
    cfg = typed(cfg, Deploy)
    if cfg.limits.default_max_tokens > cfg.limits.max_tokens:
        raise UserError(
            "limits.default_max_tokens",
            cfg.limits.default_max_tokens,
            f"is above limits.max_tokens={cfg.limits.max_tokens}, so every request that leaves "
            "max_tokens out would be refused; give at most that",
        )
    api_key = read_api_key(env=cfg.api_key.env, file=cfg.api_key.file)
    origins = list(cfg.allowed_origins)
    check_origins(origins)
    check_hosts(list(cfg.allowed_hosts))
    sock = bind_socket(cfg.host, cfg.port)  # a host that is not this machine's: refused
    if api_key is None and not is_loopback(cfg.host):
        log.warning("host=%s is reachable from other machines and no api_key is set", cfg.host)
    if api_key is None and "*" in origins:
        log.warning(
            "allowed_origins=[*] and no api_key: every web page its user visits can call it"
        )
    checkpoints = resolve_checkpoints(
        _plain(cfg.checkpoint),
        names=_plain(cfg.served_model_name),
        allowed_roots=list(cfg.allowed_roots),
        **cfg.select,
    )
    models = load_served_models(
        checkpoints,
        engine=cfg.engine,
        device=cfg.device,
        dtype=cfg.dtype.name,
        max_model_len=cfg.max_model_len,
        max_queue=cfg.max_queue,
        transformers_options=plain_dict(cfg.transformers),
        vllm_options=plain_dict(cfg.vllm),
    )
    hosts = allowed_hosts(cfg.host, list(cfg.allowed_hosts))
    app = build_app(
        models,
        api_key=api_key,
        limits=Limits(**cfg.limits),
        allowed_hosts=hosts,
        allowed_origins=origins,
    )
    for model in checkpoints:
        log.info("serving %s as model %r", model.path, model.name)
    return app, sock


def served_url(sock: socket.socket) -> str:
    """The base URL of the API served on the bound socket `sock`."""
    host, port = sock.getsockname()[:2]
    where = f"[{host}]" if ":" in host else host  # an IPv6 address, as URLs write it (RFC 3986)
    return f"http://{where}:{port}/v1"


def read_api_key(*, env: str | None, file: str | None) -> str | None:
    """The API key from the environment variable or file named in the config, or None."""
    if env is not None and file is not None:
        raise UserError("api_key", "env and file", "set api_key.env or api_key.file, not both")
    if env is not None:
        check_env_name("api_key.env", env)
        key = os.environ.get(env, "").strip()
        if not key:
            raise UserError("api_key.env", env, f"set it first: export {env}=<the key>")
        return key
    if file is not None:
        refuse_empty_path("api_key.file", file, "give the file that holds the key")
        try:
            key = user_path(file).read_text().strip()
        except OSError as error:
            raise UserError("api_key.file", file, f"cannot read it ({error.strerror})") from error
        if not key:
            raise UserError("api_key.file", file, "the file is empty: write the key into it")
        return key
    return None


def bind_socket(host: str, port: int) -> socket.socket:
    """A socket bound to host:port (port 0: any free one), before the slow model loading."""
    if not 0 <= port <= 65535:
        raise UserError("port", port, "use a port from 1 to 65535 (0 picks a free one)")
    try:
        family, kind, proto, _, _ = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as error:
        raise UserError("host", host, "use an address or name of this machine") from error
    # proto=IPPROTO_TCP matters: asyncio turns Nagle off (TCP_NODELAY) only on sockets that say
    # so, and with Nagle on, every keep-alive response waits ~40 ms for a delayed ACK.
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as error:
        sock.close()
        raise UserError(
            "port", port, f"cannot listen on {host}:{port} ({error.strerror})"
        ) from error
    return sock


def is_loopback(host: str) -> bool:
    """Whether only this machine can reach `host`."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def load_served_models(
    checkpoints: list[ServedCheckpoint],
    *,
    engine: str,
    device: str,
    dtype: str,
    max_model_len: int | None,
    max_queue: int,
    transformers_options: Mapping[str, Any],
    vllm_options: Mapping[str, Any],
) -> list[ServedModel]:
    """Load each checkpoint for `engine`; engines themselves start inside the server."""
    if engine not in ENGINES:
        raise UserError("engine", engine, f"use one of {', '.join(ENGINES)}")
    if engine == "transformers":
        from runner.deploy.loading import check_servable

        for checkpoint in checkpoints:  # its files, before torch and transformers import (seconds)
            check_servable(checkpoint.path)
        # The engines share the device: each takes its share of the KV cache's default memory.
        options = {**transformers_options, "engines": len(checkpoints)}
        return [
            _transformers_model(
                checkpoint,
                device=device,
                dtype=dtype,
                max_model_len=max_model_len,
                max_queue=max_queue,
                options=options,
            )
            for checkpoint in checkpoints
        ]
    return [
        _vllm_model(
            checkpoint,
            device=device,
            dtype=dtype,
            max_model_len=max_model_len,
            max_queue=max_queue,
            options=vllm_options,
        )
        for checkpoint in checkpoints
    ]


def _transformers_model(
    checkpoint: ServedCheckpoint,
    *,
    device: str,
    dtype: str,
    max_model_len: int | None,
    max_queue: int,
    options: Mapping[str, Any],
) -> ServedModel:
    """A checkpoint loaded here, for a TransformersEngine (the `transformers` options), or in
    an engine's process of its own (`transformers.process`)."""
    from runner.deploy.engine import (
        TransformersEngine,
        max_batch_size_by_default,
        max_prefill_tokens_by_default,
    )
    from runner.deploy.engine_process import process_by_default, served_model
    from runner.deploy.kv_cache import check_supported
    from runner.deploy.loading import load_checkpoint, resolve_device

    options = dict(options)
    process = options.pop("process")
    here = resolve_device(device)
    if options["max_batch_size"] is None:
        options["max_batch_size"] = max_batch_size_by_default(here)
    if options["max_prefill_tokens"] is None:
        options["max_prefill_tokens"] = max_prefill_tokens_by_default(here)
    if process if process is not None else process_by_default(device):
        return served_model(
            checkpoint,
            device=device,
            dtype=dtype,
            max_model_len=max_model_len,
            max_queue=max_queue,
            options=options,
        )

    loaded = load_checkpoint(
        checkpoint.path, device=device, dtype=dtype, max_model_len=max_model_len
    )
    check_supported(loaded.model)
    start = functools.partial(TransformersEngine, loaded, max_queue=max_queue, **options)
    return ServedModel(
        checkpoint.name,
        loaded.tokenizer,
        loaded.max_model_len,
        start,
        aliases=checkpoint.aliases,
    )


def _vllm_model(
    checkpoint: ServedCheckpoint,
    *,
    device: str,
    dtype: str,
    max_model_len: int | None,
    max_queue: int,
    options: Mapping[str, Any],
) -> ServedModel:
    """A checkpoint checked here and loaded by vLLM when its engine starts (`vllm` options)."""
    from runner.deploy.loading import (
        check_servable,
        load_tokenizer,
        model_context_length,
        vllm_dtype,
    )
    from runner.deploy.vllm_engine import VllmEngine, require_vllm, unmerged_adapter

    require_vllm()
    if device != "auto":
        log.warning("device=%s is ignored with engine=vllm, which places the model itself", device)
    check_servable(checkpoint.path)
    context = model_context_length(checkpoint.path, max_model_len)
    start = functools.partial(
        VllmEngine,
        checkpoint.path,
        adapter=unmerged_adapter(checkpoint.path),
        max_model_len=context,
        max_queue=max_queue,
        dtype=vllm_dtype(dtype),
        **options,
    )
    return ServedModel(
        checkpoint.name, load_tokenizer(checkpoint.path), context, start, aliases=checkpoint.aliases
    )


def run_server(app: FastAPI, sock: socket.socket, *, ready: str) -> None:
    """Serve `app` on the bound socket until SIGINT, SIGTERM or SIGHUP, then drain and stop the
    engines; `ready` is logged once it answers."""
    # uvicorn shuts down gracefully on Ctrl-C, then raises it again: that is a normal end.
    with contextlib.suppress(KeyboardInterrupt):
        Server(app, ready=ready).run(sockets=[sock])


class Server(uvicorn.Server):
    """uvicorn's server, whose shutdown gives the requests in flight `grace_s` seconds to
    finish, then ends those left through their engines (routes.close_engines): each is
    answered, a 503 or a stream's error event and [DONE], in the second uvicorn waits beyond.
    Left to uvicorn, its tasks were cancelled: a traceback each, a text/plain 500, a stream
    cut off."""

    def __init__(
        self,
        app: FastAPI,
        grace_s: float = GRACE_S,
        log_level: str = "info",
        ready: str | None = None,
    ) -> None:
        # Colours where uvicorn finds a terminal, but none asked off (no-color.org) or unable.
        plain = bool(os.environ.get("NO_COLOR")) or os.environ.get("TERM") == "dumb"
        config = uvicorn.Config(
            app,
            log_level=log_level,
            timeout_graceful_shutdown=math.ceil(grace_s) + 1,
            use_colors=False if plain else None,
        )
        super().__init__(config)
        self._app, self._grace_s, self._ready = app, grace_s, ready

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        # The engines have started and the socket listens: a request sent on reading this line
        # is answered (printed before, as the engines started, it found the port closed).
        # uvicorn logs no line of its own for sockets given to it.
        if self.started and self._ready is not None:
            log.info("%s", self._ready)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        """uvicorn's SIGINT and SIGTERM, and SIGHUP (the terminal or ssh session the server
        was started in, closed: it ended the server at once, the requests in flight with it),
        unless it was started ignored (nohup)."""
        on_main = threading.current_thread() is threading.main_thread()  # as uvicorn's
        with super().capture_signals():
            taken = takeable((signal.SIGHUP,)) if on_main else []
            previous = {signum: signal.signal(signum, self.handle_exit) for signum in taken}
            try:
                yield
            finally:
                for signum, handler in previous.items():
                    signal.signal(signum, handler)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        async def end_in_flight() -> None:
            await asyncio.sleep(self._grace_s)
            if not self.server_state.tasks:
                return  # all answered: the app's lifespan is closing the engines
            log.warning("requests still in flight after %g s: answering them 503", self._grace_s)
            await close_engines(self._app.state.models)

        ending = asyncio.create_task(end_in_flight())
        try:
            await super().shutdown(sockets)
        finally:
            ending.cancel()


def _plain(value: Any) -> Any:
    """A config value as plain Python: a ListConfig becomes a list, a scalar stays itself."""
    return OmegaConf.to_container(value) if OmegaConf.is_config(value) else value
