"""transformers.process=true: the TransformersEngine in a process of its own.

The server's process keeps the HTTP side (validation, the API key, tokenizing, streaming, JSON);
the engine's process holds the model, its scheduler and the detokenizing of what it generates.
With both in one process, the server's event loop and the engine's thread take turns at one
interpreter lock, and every step of the model waits for the server's work in between (vLLM
moved its engine core out for the same reason: vllm/v1/engine/core.py). They talk through one
multiprocessing pipe of pickled messages: one per request (or cancel) from the server, one per
decode step at most from the engine:

    server -> engine   ("submit", id, [SamplingRequest])  ("cancel", id)  ("close",)
    engine -> server   ("ready",)  ("failed", text)  ("events", [(id, ChoiceEvent | error)])

The engine's process ignores Ctrl-C (the terminal sends it to the whole process group): the
server closes it as it closes an engine of its own. It dies with the server's process if that
is killed (PR_SET_PDEATHSIG), and ends when the pipe closes.

On the CPU this measured faster than one process at 128 clients and level at one (docs:
benchmarks), so it is the CPU's default (PROCESS_BY_DEVICE); CUDA waits for a GPU run.
"""

from __future__ import annotations

import atexit
import ctypes
import itertools
import logging
import multiprocessing
import multiprocessing.util  # registers multiprocessing's exit handler before _kill_unclosed
import os
import signal
import socket
import sys
import threading
from multiprocessing.connection import Connection
from pathlib import Path
from typing import TYPE_CHECKING, Any

from runner.deploy.generation import (
    ChoiceEvent,
    EngineFailed,
    RequestHandle,
    SamplingRequest,
    ShuttingDown,
    check_room,
    deliver,
)

if TYPE_CHECKING:
    from runner.deploy.routes import ServedModel
    from runner.deploy.selection import ServedCheckpoint

log = logging.getLogger(__name__)

# Seconds the engine's process has to load its model, and to end once told to close.
START_TIMEOUT_S = 600
CLOSE_TIMEOUT_S = 30
# Whether the engine runs in a process of its own by default (transformers.process: null), by
# device type, as measured with scripts/serving/bench_deploy.py (docs: benchmarks). CPU: on the
# stand-in at c=128 (5 interleaved repeats) 19,711 tokens/s against 17,432 in one process
# (http/engine 0.855 and 0.756), faster in 4 repeats of 5, and level at c=1 (2,007 and 1,988)
# once a step without events sends nothing. CUDA: not measured yet; one process, as before,
# until a GPU run says.
PROCESS_BY_DEVICE = {"cpu": True, "cuda": False}
# The engine's process's switch interval (sys.setswitchinterval): how long its thread that takes
# the server's requests off the pipe may wait for the engine's thread, which holds the
# interpreter lock for all but its kernels, to let go of it (Python's default: 5 ms, more than a
# decode step of a small model). A switch is forced only while another thread waits for the lock.
ENGINE_SWITCH_INTERVAL_S = 0.0005
# prctl's option for the signal a process gets when its parent dies (<linux/prctl.h>).
_PR_SET_PDEATHSIG = 1
# The engines' processes started and not closed (EngineProcess.close). At exit, multiprocessing
# sends its daemonic children a SIGTERM and waits for them, and an engine ignores it
# (serve_engine): one that a failure left open between its start and the server's (a second
# checkpoint refused, a tokenizer that does not load) held `runner deploy` at exit for good,
# after its error. Killed instead, by a handler registered after multiprocessing's own, so run
# before it (atexit runs the last registered first).
_UNCLOSED: set[multiprocessing.process.BaseProcess] = set()


@atexit.register
def _kill_unclosed() -> None:
    """Kill the engines' processes that nothing closed: nothing is served by them at exit."""
    for process in list(_UNCLOSED):
        process.kill()
        process.join()
    _UNCLOSED.clear()


def process_by_default(device: str) -> bool:
    """transformers.process: null on `device` (deploy's `device` key)."""
    from runner.deploy.loading import resolve_device

    return PROCESS_BY_DEVICE.get(resolve_device(device).type, False)


def start_method(device: str) -> str:
    """How the engine's process starts: forked on the CPU where this process runs no other
    thread (`runner deploy` as it starts), so that it has torch and transformers imported
    already; a spawned one imports them afresh, about 2.5 s more to the first /health answer
    on two CPU cores (the tiny checkpoint: 6.1 s spawned, 3.75 s forked, as in one process).
    Spawned anywhere else: a CUDA context does not survive a fork, and a lock that another
    thread held at the fork would stay held in the child."""
    from runner.deploy.loading import resolve_device

    if resolve_device(device).type == "cpu" and threading.active_count() == 1:
        return "fork"
    return "spawn"


class EngineProcess:
    """The server's side of an engine in another process; implements generation.Engine."""

    def __init__(
        self,
        checkpoint: Path,
        *,
        device: str,
        dtype: str,
        max_model_len: int | None,
        max_queue: int,
        options: dict[str, Any],
    ) -> None:
        """Start the engine's process, which loads its model meanwhile (`started` waits for
        it). `options`: the TransformersEngine's (conf/deploy.yaml `transformers`)."""
        self._max_queue = max_queue
        self._max_batch_size = int(options["max_batch_size"])
        context: Any = multiprocessing.get_context(start_method(device))  # typeshed: no Process
        self._conn, child = context.Pipe()
        # The engine never refuses: the queue's limit is kept here, where submit must answer.
        load = (checkpoint, device, dtype, max_model_len)
        engine_queue = max_queue + self._max_batch_size
        self._process = context.Process(
            target=serve_engine,
            args=(child, load, engine_queue, options),
            name="runner-deploy-engine",
            daemon=True,
        )
        self._process.start()
        _UNCLOSED.add(self._process)
        child.close()
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()  # the fields below, shared with the reader thread
        self._handles: dict[int, tuple[RequestHandle, int]] = {}  # id: handle, unfinished
        self._unfinished = 0  # sequences queued or running
        self._closed = False
        self.failure: str | None = None  # why it can no longer generate (Engine.failure)
        self._ids = itertools.count()
        self._reader = threading.Thread(target=self._read, name="deploy-engine-reader")

    def started(self) -> EngineProcess:
        """Wait until the engine's model is loaded; raises EngineFailed if it failed."""
        self._wait_ready()
        self._reader.start()
        return self

    def submit(self, requests: list[SamplingRequest]) -> RequestHandle:
        """Queue the prompts' sequences in the engine; raises as check_room does when they do
        not fit beside those running or waiting."""
        count = sum(request.n for request in requests)
        with self._lock:
            if self.failure is not None:
                raise EngineFailed(self.failure)
            if self._closed:
                raise ShuttingDown()
            check_room(self._unfinished, count, self._max_batch_size + self._max_queue)
            request_id = next(self._ids)
            handle = RequestHandle(n=count, on_cancel=lambda: self._cancel(request_id))
            self._handles[request_id] = (handle, count)
            self._unfinished += count
        self._send(("submit", request_id, requests))
        return handle

    def close(self) -> None:
        """Tell the engine to fail what it has not finished and end; wait for its process."""
        with self._lock:
            self._closed = True
        try:
            self._send(("close",))
        except OSError:  # it has already gone
            pass
        self._process.join(CLOSE_TIMEOUT_S)
        if self._process.is_alive():  # still loading, or stuck
            log.error("the engine's process did not end in %d s: killing it", CLOSE_TIMEOUT_S)
            self._process.kill()
            self._process.join()
        _UNCLOSED.discard(self._process)
        if self._reader.ident is not None:
            self._reader.join()
        self._conn.close()

    def _wait_ready(self) -> None:
        if not self._conn.poll(START_TIMEOUT_S):
            self._process.kill()
            raise EngineFailed(f"the engine's process did not start in {START_TIMEOUT_S} s")
        try:
            message = self._conn.recv()
        except EOFError:
            self._process.join()
            message = ("failed", f"it exited with code {self._process.exitcode}")
        if message[0] != "ready":
            self._process.join(CLOSE_TIMEOUT_S)
            raise EngineFailed(f"the engine's process failed to start: {message[1]}")

    def _cancel(self, request_id: int) -> None:
        with self._lock:
            if request_id not in self._handles or self._closed:
                return  # finished already: nothing to stop
            # Its choices leave the count now: the engine sends nothing for a cancelled
            # sequence, and every client that went away held its room for good, until the
            # server answered each request 429 with the engine idle.
            _, unfinished = self._handles.pop(request_id)
            self._unfinished -= unfinished
        self._send(("cancel", request_id))

    def _send(self, message: tuple) -> None:
        with self._send_lock:
            self._conn.send(message)

    def _read(self) -> None:
        """Hand each step's events to their handles until the engine's process ends."""
        while True:
            try:
                _, events = self._conn.recv()
            except (EOFError, OSError):
                break
            self._deliver(events)
        with self._lock:
            closed, self._closed = self._closed, True
            left = [handle for handle, _ in self._handles.values()]
            self._handles.clear()
        if not closed:
            self._process.join(CLOSE_TIMEOUT_S)
            self.failure = (
                f"the engine's process ended unexpectedly (exit code {self._process.exitcode})"
            )
            log.error("%s: requests are answered 503 and /health says so", self.failure)
        ended = EngineFailed("the engine's process ended unexpectedly")
        deliver([(handle, ShuttingDown() if closed else ended) for handle in left])

    def _deliver(self, events: list[tuple[int, ChoiceEvent | Exception]]) -> None:
        outgoing: list[tuple[RequestHandle, ChoiceEvent | Exception]] = []
        with self._lock:
            for request_id, event in events:
                if request_id not in self._handles:
                    continue  # a request that has already failed
                handle, unfinished = self._handles[request_id]
                done = 1 if isinstance(event, ChoiceEvent) and event.finish_reason else 0
                if isinstance(event, Exception):
                    done = unfinished
                self._unfinished -= done
                if unfinished - done:
                    self._handles[request_id] = (handle, unfinished - done)
                else:
                    del self._handles[request_id]
                outgoing.append((handle, event))
        deliver(outgoing)


def serve_engine(conn: Connection, load: tuple, max_queue: int, options: dict[str, Any]) -> None:
    """The engine's process: load the model, then serve the server's messages until it closes."""
    # A stop sent to the whole process group (a terminal's Ctrl-C; the SIGTERM of `timeout`,
    # systemd, Slurm) is the server's to act on: it drains its requests, then closes this
    # process. Killed at once, the engine failed the requests in flight with a 500.
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, signal.SIG_IGN)
    sys.setswitchinterval(ENGINE_SWITCH_INTERVAL_S)
    if sys.platform == "linux":
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    _close_server_sockets()
    from runner.deploy.engine import TransformersEngine
    from runner.deploy.loading import load_checkpoint

    side = _EngineSide(conn)
    try:
        checkpoint, device, dtype, max_model_len = load
        loaded = load_checkpoint(
            checkpoint, device=device, dtype=dtype, max_model_len=max_model_len
        )
        engine = TransformersEngine(loaded, max_queue=max_queue, deliver=side.send, **options)
    except Exception as error:
        conn.send(("failed", str(error)))
        raise
    conn.send(("ready",))
    try:
        side.serve(engine)
    finally:
        engine.close()
        conn.close()


def _close_server_sockets() -> None:
    """The server's sockets (its port, bound before the engine was forked and listened on
    after), which a forked engine inherits: held open here, the port took connections through
    the server's shutdown that nobody answered, reset as the engine exited. The engine talks
    to no network; the pipe to the server (a Unix socket pair) stays."""
    fds = Path("/proc/self/fd")
    for name in os.listdir(fds) if fds.is_dir() else []:
        try:
            probe = socket.socket(fileno=int(name))
        except OSError:  # not a socket, or the listing's own descriptor, closed since
            continue
        if probe.family in (socket.AF_INET, socket.AF_INET6):
            probe.close()
        else:
            probe.detach()


class _EngineSide:
    """The engine's process's end of the pipe: the server's requests in, their events out."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self._send_lock = threading.Lock()  # the engine's thread and this one both send
        # The requests not yet finished, by the server's id: their handle and unfinished choices.
        self._handles: dict[int, RequestHandle] = {}
        self._unfinished: dict[int, int] = {}

    def serve(self, engine: Any) -> None:
        """Submit and cancel as the server says, until it says close or goes away."""
        while True:
            try:
                message = self._conn.recv()
            except EOFError:  # the server's process has gone
                return
            if message[0] == "submit":
                _, request_id, requests = message
                count = sum(request.n for request in requests)
                handle = RequestHandle(n=count, loop=None, request_id=request_id)
                self._handles[request_id], self._unfinished[request_id] = handle, count
                try:
                    engine.submit(requests, handle)
                except Exception as error:  # its room (cancelled rows not yet dropped): that
                    self.send([(handle, error)])  # request fails, not the engine's process
            elif message[0] == "cancel" and (cancelled := self._handles.get(message[1])):
                cancelled.cancel()
            elif message[0] == "close":
                return

    def send(self, events: list[tuple[RequestHandle, ChoiceEvent | Exception]]) -> None:
        """The engine's `deliver`: one step's events in one message, none for a step without
        any (a non-streamed choice has one, at its end); forget finished requests."""
        if not events:
            return
        message = ("events", [(handle.request_id, event) for handle, event in events])
        try:
            with self._send_lock:
                self._conn.send(message)
        except OSError:  # the server's process has gone: nobody is listening
            pass
        for handle, event in events:
            failed = isinstance(event, Exception)
            done = failed or (isinstance(event, ChoiceEvent) and event.finish_reason is not None)
            left = self._unfinished.get(handle.request_id, 0) - done
            if failed or left <= 0:
                self._handles.pop(handle.request_id, None)
                self._unfinished.pop(handle.request_id, None)
            else:
                self._unfinished[handle.request_id] = left


def served_model(
    checkpoint: ServedCheckpoint,
    *,
    device: str,
    dtype: str,
    max_model_len: int | None,
    max_queue: int,
    options: dict[str, Any],
) -> ServedModel:
    """A checkpoint whose files the caller checked (runner.deploy.loading.check_servable, as
    load_checkpoint checks them), its architecture checked here without loading its weights, and
    its engine's process started, to load them while the server starts."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from runner.deploy.kv_cache import check_supported
    from runner.deploy.loading import (
        load_tokenizer,
        lora_base_dir,
        model_context_length,
        resolve_device,
        resolve_dtype,
    )
    from runner.deploy.routes import ServedModel

    resolve_dtype(dtype, resolve_device(device))
    context = model_context_length(checkpoint.path, max_model_len)
    config = AutoConfig.from_pretrained(lora_base_dir(checkpoint.path) or checkpoint.path)
    with torch.device("meta"):  # the architecture alone, for the engine's check
        check_supported(AutoModelForCausalLM.from_config(config))
    engine = EngineProcess(
        checkpoint.path,
        device=device,
        dtype=dtype,
        max_model_len=max_model_len,
        max_queue=max_queue,
        options=options,
    )
    return ServedModel(
        checkpoint.name,
        load_tokenizer(checkpoint.path),
        context,
        engine.started,
        aliases=checkpoint.aliases,
    )
