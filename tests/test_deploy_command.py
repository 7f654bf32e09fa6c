"""`runner deploy` as a command and as a server's lifetime: interrupted by Ctrl-C, SIGTERM or SIGHUP
with nothing left running, the engine in a process of its own or in the server's, a full
queue's 429, its startup heap frozen, and the config's checks; a tiny checkpoint on the CPU."""

from __future__ import annotations

import contextlib
import http.client
import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import torch
from transformers import AutoTokenizer, LlamaForCausalLM

from runner.deploy.loading import resolve_dtype
from runner.deploy.serve import bind_socket, prepare, served_url
from runner.errors import UserError
from runner.paths import CONF_DIR, TINY_TOKENIZER_DIR
from tests.serving import (
    API_KEY,
    LONG_REQUEST,
    PROMPTS,
    completion_body,
    deploy_config,
    raw_request,
    send_at_once,
    serving,
)


@pytest.fixture(scope="module")
def one_row_server(served_run: Path) -> Iterator[str]:
    """A server with room for two choices (one row running, one place in its queue), its
    engine in a process of its own (the CPU's default): its URL. Its tests fill it and leave
    it idle again, so they share it rather than each start an engine's process (~5 s)."""
    cfg = deploy_config(
        f"checkpoint={served_run}",
        "served_model_name=tiny",
        "port=0",
        "max_queue=1",
        "transformers.max_batch_size=1",
    )
    with serving(cfg) as url:
        yield url


def test_a_full_queue_answers_429_with_retry_after(one_row_server: str) -> None:
    url = one_row_server
    results = send_at_once(url, completion_body(**LONG_REQUEST), 6)
    # Idle again: one row and one place in the queue take two choices; three never fit,
    # which a retry would not mend.
    two = raw_request(url, "POST", "/v1/completions", completion_body(n=2))
    three = raw_request(url, "POST", "/v1/completions", completion_body(n=3))
    statuses = sorted(status for status, _ in results)
    assert set(statuses) == {200, 429}, statuses
    assert all(headers["retry-after"] == "1" for status, headers in results if status == 429)
    assert two[0] == 200, two
    error = json.loads(three[2])["error"]
    assert (three[0], error["param"]) == (400, "n"), three
    assert error["message"] == (
        "the request asks for 3 sequences (its prompts times n); this server holds 2 at once "
        "(its batch and max_queue): ask for fewer"
    )


@pytest.mark.parametrize("process", ["true", "false"])
def test_requests_a_stop_leaves_unfinished_are_answered_503(
    served_run: Path, process: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Past the stop's grace, what is in flight is answered, not cut off: a 503 a whole
    request, its error event and [DONE] a stream; nothing for uvicorn to cancel (a traceback
    each in the log, a text/plain 500, a stream ended mid-answer)."""
    cfg = deploy_config(
        f"checkpoint={served_run}",
        "served_model_name=tiny",
        "port=0",
        f"transformers.process={process}",
        "transformers.max_batch_size=1",  # one runs, the others wait
    )
    answers: dict[str, tuple[int, bytes]] = {}
    started = {name: threading.Event() for name in ("whole", "stream")}

    def send(name: str, body: bytes) -> None:
        host, port = url.removeprefix("http://").split(":")
        connection = http.client.HTTPConnection(host, int(port), timeout=60)
        connection.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        if name != "stream":
            started["whole"].set()
        response = connection.getresponse()  # a stream's, as its first event is to come
        if name == "stream":
            started["stream"].set()
        answers[name] = (response.status, response.read())

    whole = completion_body(**LONG_REQUEST)
    threads = [threading.Thread(target=send, args=(f"whole {i}", whole)) for i in range(8)]
    threads.append(
        threading.Thread(target=send, args=("stream", completion_body(**LONG_REQUEST, stream=True)))
    )
    with caplog.at_level(logging.WARNING), serving(cfg, grace_s=0.05) as url:
        for thread in threads[:-1]:
            thread.start()
        assert started["whole"].wait(60)
        time.sleep(0.05)
        threads[-1].start()  # behind the others: 1,600 steps of them, then its own
        assert started["stream"].wait(60)
    for thread in threads:
        thread.join(60)
    status, stream = answers.pop("stream")
    events = stream.decode().split("\n\n")
    assert status == 200 and events[-2:] == ["data: [DONE]", ""], stream[-300:]
    error = json.loads(events[-3].removeprefix("data: "))["error"]
    assert error["code"] == "server_shutting_down", stream[-300:]
    assert error["message"] == "the server is shutting down: retry"
    statuses = []
    for status, payload in answers.values():
        statuses.append(status)
        if status != 200:
            error = json.loads(payload)["error"]
            assert (status, error["code"]) == (503, "server_shutting_down"), payload
    assert 503 in statuses and set(statuses) <= {200, 503}, statuses
    logged = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert not logged, logged
    assert "requests still in flight after 0.05 s: answering them 503" in caplog.text


@pytest.mark.parametrize(
    "option", sorted(path.stem for path in (CONF_DIR / "dtype").glob("*.yaml"))
)
def test_every_dtype_option_of_training_serves(option: str) -> None:
    cfg = deploy_config("checkpoint=unused", f"dtype={option}")
    assert resolve_dtype(cfg.dtype.name, torch.device("cpu")) in (torch.float32, torch.bfloat16)


@pytest.mark.parametrize(
    "override", ["max_queue=0", "transformers.max_batch_size=0", "limits.max_n=-1"]
)
def test_sizes_and_caps_must_be_at_least_1(override: str) -> None:
    with pytest.raises(UserError, match=override.split("=")[0]):
        prepare(deploy_config("checkpoint=unused", override))


def test_a_default_max_tokens_above_the_cap_is_refused_as_the_server_starts() -> None:
    # Served, every request that leaves max_tokens out got a 400 for a value it never sent.
    with pytest.raises(UserError) as refused:
        prepare(deploy_config("checkpoint=unused", "limits.max_tokens=5"))
    assert str(refused.value) == (
        "limits.default_max_tokens=256: is above limits.max_tokens=5, so every request that "
        "leaves max_tokens out would be refused; give at most that"
    )


def test_a_host_not_of_this_machine_is_one_error_and_no_warning(caplog) -> None:
    with pytest.raises(UserError, match="host='999.1.1.1'"):
        prepare(deploy_config("checkpoint=unused", "host=999.1.1.1"))
    assert "reachable from other machines" not in caplog.text


@pytest.mark.parametrize("origin", ["https://chat.example.com/", "chat.example.com", "https://A.b"])
def test_an_origin_no_browser_sends_is_refused(origin: str) -> None:
    """A browser's Origin is compared byte for byte: these never matched, and no page got in."""
    with pytest.raises(UserError, match="no origin a browser sends") as refused:
        prepare(deploy_config("checkpoint=unused", f"allowed_origins=[{origin}]"))
    assert refused.value.key == "allowed_origins"


@pytest.mark.parametrize("host", ["''", "chat.example.com:8000"])
def test_a_host_name_no_request_gives_is_refused(host: str) -> None:
    """A request's Host is compared by its name alone: an empty name or one with a port never
    matched (an empty Host header let in)."""
    with pytest.raises(UserError, match="no host name a request gives") as refused:
        prepare(deploy_config("checkpoint=unused", f"allowed_hosts=[{host}]"))
    assert refused.value.key == "allowed_hosts"


def test_an_ipv6_host_is_bracketed_in_the_url_it_serves_at(served_run: Path) -> None:
    """`http://:::PORT/v1` (host=::) is no URL: the OpenAI client refused it (Invalid port)."""
    # The engine in this process, which nothing starts before the server does: with an
    # engine's process, prepare() starts that process (to load meanwhile), which nothing here
    # closed; it ignores the SIGTERM that multiprocessing sends at exit, so pytest's exit
    # waited on it for good (and its imports and load cost ~5 s).
    overrides = ["host=::1", "port=0", "transformers.process=false"]
    _, sock = prepare(deploy_config(f"checkpoint={served_run}", *overrides))
    port = sock.getsockname()[1]
    url = served_url(sock)
    sock.close()
    assert url == f"http://[::1]:{port}/v1"
    assert openai.OpenAI(base_url=url, api_key="unused").base_url.port == port


def test_the_listening_socket_is_tcp_so_asyncio_turns_nagle_off() -> None:
    # With proto 0, asyncio leaves Nagle on and each keep-alive response waits ~40 ms.
    sock = bind_socket("127.0.0.1", 0)
    assert sock.proto == socket.IPPROTO_TCP
    sock.close()


def _children(pid: int) -> set[int]:
    """The process ids of `pid`'s children (Linux: /proc/<pid>/task/<tid>/children)."""
    found: set[int] = set()
    for task in Path(f"/proc/{pid}/task").glob("*/children"):
        with contextlib.suppress(OSError):
            found |= {int(child) for child in task.read_text().split()}
    return found


@pytest.mark.parametrize(
    ("stop", "process"),
    [(signal.SIGINT, "true"), (signal.SIGTERM, "true"), (signal.SIGHUP, "false")],
    ids=["ctrl-c, engine process", "sigterm, engine process", "hangup, one process"],
)
def test_deploy_command_serves_until_interrupted(
    served_run: Path, generate_reference, stop, process
) -> None:
    # compute=cpu dtype=fp32 (the command serves on the CPU here). Each stop, sent to the
    # whole process group, leaves nothing it started running; a hangup (its terminal closed)
    # ended the server at once, the stream in flight cut off. The server alone holds its
    # listening socket: the engine's process, forked after the port was bound, held it open,
    # and through the server's shutdown the port took connections nobody answered, reset as the
    # engine exited.
    env = {**os.environ, "DEPLOY_TEST_KEY": API_KEY}
    command = [sys.executable, "-m", "runner", "deploy", f"checkpoint={served_run}", "port=0"]
    command += ["device=cpu", "dtype=fp32", f"transformers.process={process}"]
    process_ = subprocess.Popen(
        [*command, "api_key.env=DEPLOY_TEST_KEY"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own process group, as a terminal gives a command
    )
    try:
        lines = []
        for line in process_.stdout:
            lines.append(line)
            if match := re.search(r"API at (http://\S+)/v1", line):
                break
        assert match, "".join(lines)
        url = match.group(1)
        # The address is printed once the server answers: a request sent on reading it found
        # the port closed, as the engines started.
        assert raw_request(url, "GET", "/health", key=None)[0] == 200
        # The engine's process, or none; forked (the server's own command line, where a
        # spawned one runs multiprocessing's), as runner deploy starts it on the CPU.
        children = _children(process_.pid)
        assert bool(children) == (process == "true"), children
        command_line = Path(f"/proc/{process_.pid}/cmdline").read_bytes()
        forked = [c for c in children if Path(f"/proc/{c}/cmdline").read_bytes() == command_line]
        assert forked == list(children), children
        sockets = _listening_sockets(int(url.rsplit(":", 1)[1]))
        holders = [pid for pid in (process_.pid, *children) if _holds(str(pid), sockets)]
        assert holders == [process_.pid], (holders, children)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0)
        # The server does not tell its clients where its files lie.
        (listed,) = client.models.list().data
        assert listed.id == f"{served_run.parent.name}/run/step_10"
        assert client.models.retrieve(str(served_run)).id == listed.id
        # Greedy, so the answer is transformers' own (a sampled one may stop at eos early).
        # A client that asks by the path given in checkpoint= (the id before) is still served.
        response = client.completions.create(
            model=str(served_run), prompt="hi", max_tokens=3, temperature=0
        )
        assert response.model == listed.id
        tokenizer, generate = generate_reference
        assert (response.choices[0].text, response.usage.completion_tokens) == generate(
            tokenizer.encode("hi"), 3
        )
        # A stream in flight as the stop comes finishes: the server drains it. Sent to the
        # whole group (a terminal's Ctrl-C; the SIGTERM of `timeout`, systemd, Slurm), the
        # engine's process was killed by it, and the stream failed with a 500.
        streamed: list[str] = []
        first = threading.Event()

        def stream() -> None:
            for chunk in client.completions.create(
                model=listed.id, prompt="hi", max_tokens=60, temperature=0, stream=True
            ):
                streamed.append(chunk.choices[0].finish_reason or "")
                first.set()

        reader = threading.Thread(target=stream)
        reader.start()
        assert first.wait(timeout=60)
        os.killpg(process_.pid, stop)
        reader.join(timeout=60)
        assert streamed and streamed[-1] == "length", streamed
        # uvicorn ends a graceful shutdown by raising the signal again: SIGTERM's exit is -15.
        assert process_.wait(timeout=60) in (0, -stop)
        deadline = time.monotonic() + 10
        while any(Path(f"/proc/{child}").exists() for child in children):
            assert time.monotonic() < deadline, f"{children} outlived the server"
            time.sleep(0.1)
    finally:
        if process_.poll() is None:
            process_.kill()
            process_.wait()


@pytest.mark.filterwarnings("error:.*past_key_values.*:FutureWarning")
def test_the_engine_answers_alike_in_a_process_of_its_own_and_in_the_servers(
    served_run: Path, generate_reference
) -> None:
    # compute=cpu dtype=fp32. Greedy equals generate, streamed and whole, in both placements;
    # seeded samples (n=3), a stop sequence and a full queue's 429 are the same in both. And in
    # both, what is alive once the engines start (torch, the model, the tokenizer) is kept out
    # of the garbage collector's walks while the server runs, and given back when it stops.
    import gc
    import multiprocessing

    tokenizer, generate = generate_reference
    prompt = PROMPTS[3]
    expected = generate(tokenizer.encode(prompt), 20)
    answers = {}
    before = set(multiprocessing.active_children())  # the module's other servers' engines

    def engines() -> list:
        return [c for c in set(multiprocessing.active_children()) - before if "engine" in c.name]

    long_body = completion_body(**LONG_REQUEST)
    for process in ("true", "false"):
        cfg = deploy_config(
            f"checkpoint={served_run}",
            "served_model_name=tiny",
            "port=0",
            f"transformers.process={process}",
            "max_queue=3",
            "transformers.max_batch_size=1",
        )
        with serving(cfg) as url:
            assert len(engines()) == (process == "true"), engines()
            assert gc.get_freeze_count() > 10_000, gc.get_freeze_count()
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
            greedy = {"model": "tiny", "prompt": prompt, "max_tokens": 20, "temperature": 0}
            whole = client.completions.create(**greedy)
            assert (whole.choices[0].text, whole.usage.completion_tokens) == expected
            stream = client.completions.create(**greedy, stream=True)
            assert "".join(chunk.choices[0].text for chunk in stream) == expected[0]
            sampled = client.completions.create(
                model="tiny", prompt="hello", max_tokens=12, temperature=1.0, n=3, seed=7
            )
            stop = expected[0][4:6]
            cut = client.completions.create(**greedy, stop=[stop])
            # One row runs and three wait: the fifth and sixth long requests are refused.
            statuses = [status for status, _ in send_at_once(url, long_body, 6)]
            answers[process] = ([c.text for c in sampled.choices], cut.choices[0].text)
            assert set(statuses) == {200, 429}, statuses
        assert not engines()
        assert gc.get_freeze_count() == 0
    assert answers["true"] == answers["false"]
    assert answers["true"][1] == expected[0][: expected[0].index(stop)]
    assert len(set(answers["true"][0])) == 3


SAY_WHAT = (
    "say what to serve: checkpoint=<checkpoint dir | run dir | sweep dir>, or a list "
    "checkpoint=[a,b] to serve several"
)


@pytest.mark.parametrize(
    "given,printed",
    [
        ((), f"checkpoint='???': {SAY_WHAT}"),
        # A TypeError's traceback; a null in the list was "no such directory" of 'None'.
        (("checkpoint=null",), f"checkpoint='null': {SAY_WHAT}"),
        (("checkpoint=[null]",), f"checkpoint[0]='null': {SAY_WHAT}"),
        (("checkpoint=''",), f"checkpoint='': {SAY_WHAT}"),  # was read as '.'
        (("checkpoint=[a,'']",), f"checkpoint[1]='': {SAY_WHAT}"),
    ],
)
def test_deploy_command_without_checkpoint_exits_2_with_one_message(
    runner_cli, given: tuple[str, ...], printed: str
) -> None:
    result = runner_cli("deploy", *given)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert result.stderr == f"error: {printed}\n"


def test_a_checkpoint_refused_after_an_engine_started_ends_the_command(
    served_run: Path, hermetic_env: dict[str, str], tmp_path: Path
) -> None:
    """device=cpu, whose engine runs in a process of its own. The first of two checkpoints had
    its engine's process started (to load while the server starts) when the second was refused:
    the error was printed, then `runner deploy` never exited, multiprocessing waiting at exit on
    an engine that ignores its SIGTERM. In a fresh interpreter: a forked CLI ends without
    running the exit handlers."""
    bad = tmp_path / "bad"
    shutil.copytree(served_run / "checkpoints" / "step_10", bad)
    (bad / "config.json").write_text('{"model_type": "llama"')  # cut short
    good = served_run / "checkpoints" / "step_10"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "runner",
            "deploy",
            f"checkpoint=[{good},{bad}]",
            "port=0",
            "device=cpu",
        ],
        env=hermetic_env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 2, result.stderr[-3000:]
    assert f"error: checkpoint='{bad}': its config.json" in result.stderr, result.stderr[-3000:]


def test_the_engine_in_its_own_process_serves_a_lora_checkpoint_and_its_end_fails_health(
    tiny_checkpoint: Path,
) -> None:
    """compute=cpu dtype=fp32. A LoRA checkpoint as method=lora writes one (a PEFT adapter
    naming its base by path, the tokenizer beside it), with random B matrices so that the
    adapter changes the answers: the engine's process merges it, as the server's own would.
    Then that process is killed: /health said ok and every request was answered 503 "shutting
    down: retry" for good, so a supervisor probing /health never restarted the server."""
    import multiprocessing

    from peft import LoraConfig, PeftModel, get_peft_model

    adapter = tiny_checkpoint.parent / "lora"
    config = LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False
    )
    torch.manual_seed(0)
    get_peft_model(LlamaForCausalLM.from_pretrained(tiny_checkpoint), config).save_pretrained(
        adapter
    )
    base = LlamaForCausalLM.from_pretrained(tiny_checkpoint)
    for file in TINY_TOKENIZER_DIR.iterdir():
        shutil.copy(file, adapter / file.name)
    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoint)
    ids = torch.tensor([tokenizer.encode(PROMPTS[3])])
    merged = PeftModel.from_pretrained(
        LlamaForCausalLM.from_pretrained(tiny_checkpoint), adapter
    ).merge_and_unload()
    answers = {
        name: tokenizer.decode(
            model.eval().generate(ids, max_new_tokens=16, do_sample=False)[0, ids.shape[1] :],
            skip_special_tokens=True,
        )
        for name, model in (("merged", merged), ("base", base))
    }
    assert answers["merged"] != answers["base"]
    cfg = deploy_config(
        f"checkpoint={adapter}",
        "served_model_name=lora",
        f"allowed_roots=[{tiny_checkpoint}]",
        "port=0",
        "transformers.process=true",
    )
    before = set(multiprocessing.active_children())  # the module's other servers' engines
    with serving(cfg) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        response = client.completions.create(
            model="lora", prompt=PROMPTS[3], max_tokens=16, temperature=0
        )
        assert response.choices[0].text == answers["merged"]
        (engine,) = set(multiprocessing.active_children()) - before
        os.kill(engine.pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while (health := raw_request(url, "GET", "/health", key=None))[0] != 503:
            assert time.monotonic() < deadline, health
            time.sleep(0.1)
        said = json.loads(health[2])
        assert said["status"] == "failed", said
        assert "the engine's process ended unexpectedly (exit code -9)" in said["error"]
        request = completion_body(model="lora")
        status, _, body = raw_request(url, "POST", "/v1/completions", request)
        assert status == 503 and "ended unexpectedly" in json.loads(body)["error"]["message"]


def _gone_after(url: str, body: bytes, wait_s: float) -> None:
    """POST `body` to /v1/completions, then hang up after `wait_s` (a stream: once its first
    event has come), as a client that went away."""
    host, port = url.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=30)
    connection.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    if json.loads(body).get("stream"):
        connection.getresponse().read1(1)
    time.sleep(wait_s)
    connection.sock.shutdown(socket.SHUT_RDWR)
    connection.close()


def test_clients_that_go_away_give_their_room_back(one_row_server: str) -> None:
    """The engine in its own process (the CPU's default) sends nothing for a cancelled
    request, whose choices stayed counted: three streams cut off, and every request after was
    answered 429 with the engine idle. A whole answer's client that left went on generating to
    its last token, holding its rows and room."""
    url = one_row_server  # room for two choices: one running, one waiting
    long = {"prompt": "hello", "max_tokens": 240, "temperature": 0, "n": 2}
    for _ in range(3):
        _gone_after(url, completion_body(**long, stream=True), 0.0)
        deadline = time.monotonic() + 30
        while (
            status := raw_request(url, "POST", "/v1/completions", completion_body(n=2))[0]
        ) != 200:
            assert status == 429 and time.monotonic() < deadline, status
            time.sleep(0.1)
    # Whole: its two choices take about twice 240 steps; the room is back at once.
    _gone_after(url, completion_body(**long), 0.1)
    time.sleep(0.1)
    status, _, body = raw_request(url, "POST", "/v1/completions", completion_body(n=2))
    assert status == 200, body


def _listening_sockets(port: int) -> set[str]:
    """The sockets listening on `port`, as a process's /proc/PID/fd links name them."""
    return {  # /proc/net/tcp: local address, remote, state (0A: LISTEN), ..., inode
        f"socket:[{fields[9]}]"
        for table in ("/proc/net/tcp", "/proc/net/tcp6")
        for fields in (line.split() for line in Path(table).read_text().splitlines()[1:])
        if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] == "0A"
    }


def _holds(pid: str, sockets: set[str]) -> bool:
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    return any(_link(f"/proc/{pid}/fd/{fd}") in sockets for fd in fds)


def _link(path: str) -> str:
    try:
        return os.readlink(path)
    except OSError:
        return ""
