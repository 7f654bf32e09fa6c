"""`runner deploy`: a real server on loopback, a tiny checkpoint, the real `openai` client."""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
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
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from runner.deploy.loading import resolve_dtype
from runner.deploy.selection import resolve_checkpoints
from runner.deploy.serve import bind_socket, prepare
from runner.errors import UserError
from runner.paths import CONF_DIR, TINY_TOKENIZER_DIR
from tests.conftest import load_script

API_KEY = "test-key-0123456789"
PROMPTS = ["hello", "the quick brown fox", "a", "once upon a time there was"]


def make_checkpoint(path: Path, seed: int = 0, width: int = 64) -> Path:
    """A tiny Llama checkpoint in the training contract's format, written by transformers.

    width: hidden_size, over 4 heads (256 gives the 64-wide heads that vLLM's attention kernels
    need at least)."""
    tokenizer = AutoTokenizer.from_pretrained(TINY_TOKENIZER_DIR)
    config = LlamaConfig(
        vocab_size=264,
        hidden_size=width,
        intermediate_size=2 * width,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        initializer_range=0.2,  # varied, multi-byte output instead of one repeated letter
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    LlamaForCausalLM(config).save_pretrained(path, safe_serialization=True)
    for file in TINY_TOKENIZER_DIR.iterdir():
        shutil.copy(file, path / file.name)
    torch.save({"step": 0}, path / "training_state.pt")
    return path


def make_run(
    run_dir: Path, checkpoint: Path, *, steps: list[int], state: str, metrics: list[dict]
) -> Path:
    """A run dir: status.json, metrics.jsonl and whole step_<N> checkpoints (copies)."""
    (run_dir / "checkpoints").mkdir(parents=True)
    for step in steps:
        shutil.copytree(checkpoint, run_dir / "checkpoints" / f"step_{step}")
    status = {"state": state, "step": max(steps, default=0), "total_steps": 10}
    (run_dir / "status.json").write_text(json.dumps(status))
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    return run_dir


def deploy_config(*overrides: str) -> DictConfig:
    """conf/deploy.yaml composed with overrides, as `runner deploy` composes it; served on the
    CPU in fp32 (the references below are fp32 CPU generations) unless an override says else."""
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose("deploy", overrides=["device=cpu", "dtype=fp32", *overrides])


@contextlib.contextmanager
def serving(cfg: DictConfig) -> Iterator[str]:
    """Run the server that `runner deploy` would run, in a thread; yield its base URL."""
    import uvicorn

    app, sock = prepare(cfg)
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def raw_request(
    base_url: str,
    method: str,
    path: str,
    body: bytes | None = None,
    key=API_KEY,
    host_header: str | None = None,
):
    """Status, headers and decoded body of one plain HTTP request (its Host: host_header, if
    given, else the URL's)."""
    host, port = base_url.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=30)
    headers = {"Content-Type": "application/json"}
    if host_header is not None:
        headers["Host"] = host_header
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    connection.request(method, path, body=body, headers=headers)
    response = connection.getresponse()
    payload = response.read()
    connection.close()
    return response.status, dict(response.getheaders()), payload


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("model") / "checkpoint")


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory, tiny_checkpoint: Path) -> Path:
    root = tmp_path_factory.mktemp("outputs")
    run = make_run(root / "run", tiny_checkpoint, steps=[2, 10], state="completed", metrics=[])
    (run / "checkpoints" / ".tmp-step_20").mkdir()  # being written: never served
    return run


@pytest.fixture(scope="module")
def sweep_dir(tmp_path_factory: pytest.TempPathFactory, tiny_checkpoint: Path) -> Path:
    sweep = tmp_path_factory.mktemp("multirun") / "sweep"
    other = make_checkpoint(tmp_path_factory.mktemp("other") / "checkpoint", seed=1)
    losses = {"0": (0.9, "completed", tiny_checkpoint), "1": (0.4, "completed", other)}
    losses["2"] = (0.1, "failed", tiny_checkpoint)  # best value, but the run failed
    for job, (loss, state, checkpoint) in losses.items():
        metrics = [{"step": 5, "eval_loss": loss + 1}, {"step": 10, "eval_loss": loss}]
        make_run(sweep / job, checkpoint, steps=[5], state=state, metrics=metrics)
    (sweep / "summary.json").write_text("{}")
    return sweep


@pytest.fixture(scope="module")
def base_url(tmp_path_factory, run_dir: Path, sweep_dir: Path) -> Iterator[str]:
    key_file = tmp_path_factory.mktemp("secrets") / "api_key"
    key_file.write_text(API_KEY + "\n")
    cfg = deploy_config(
        f"checkpoint=[{run_dir},{sweep_dir}]",
        "served_model_name=[tiny,sweep-best]",
        "select.metric=eval_loss",
        f"api_key.file={key_file}",
        "port=0",
        "limits.max_body_bytes=65536",
    )
    with serving(cfg) as url:
        yield url


@pytest.fixture(scope="module")
def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key=API_KEY, max_retries=0)


def greedy_reference(path: Path):
    """transformers' own greedy generate on the checkpoint at `path`: its tokenizer, and a
    function of prompt ids and max new tokens giving the continuation's text and length."""
    model = LlamaForCausalLM.from_pretrained(path).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)

    def generate(prompt_ids: list[int], max_new_tokens: int) -> tuple[str, int]:
        output = model.generate(
            torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False
        )[0, len(prompt_ids) :]
        return tokenizer.decode(output, skip_special_tokens=True), len(output)

    return tokenizer, generate


@pytest.fixture(scope="module")
def reference(run_dir: Path):
    """Greedy continuations from transformers' own generate on the served checkpoint."""
    return greedy_reference(run_dir / "checkpoints" / "step_10")


def test_a_run_dir_is_served_from_its_latest_whole_checkpoint(run_dir: Path) -> None:
    select = {"checkpoint": "latest", "metric": "eval_loss", "mode": "min"}
    (served,) = resolve_checkpoints(str(run_dir), names=None, allowed_roots=[], **select)
    assert served.path == (run_dir / "checkpoints" / "step_10").resolve()  # not .tmp-step_20
    # Named by its run and step, not by where its files lie; the paths still find it.
    assert served.name == f"{run_dir.parent.name}/run/step_10"
    assert set(served.aliases) == {str(run_dir), str(served.path)}


def test_models_lists_every_served_checkpoint(client: openai.OpenAI) -> None:
    assert sorted(model.id for model in client.models.list()) == ["sweep-best", "tiny"]
    assert client.models.retrieve("tiny").id == "tiny"


def test_completion_greedy_equals_transformers_generate(client, reference) -> None:
    tokenizer, generate = reference
    for prompt in PROMPTS[:2]:
        ids = tokenizer.encode(prompt)
        expected, count = generate(ids, 24)
        response = client.completions.create(
            model="tiny", prompt=prompt, max_tokens=24, temperature=0
        )
        assert response.choices[0].text == expected
        assert response.usage.prompt_tokens == len(ids)
        assert response.usage.completion_tokens == count


def test_chat_uses_the_checkpoint_chat_template(client, reference) -> None:
    tokenizer, generate = reference
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = tokenizer.encode(text, add_special_tokens=False)
    expected, count = generate(ids, 16)
    response = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=16, temperature=0
    )
    assert response.choices[0].message.role == "assistant"
    assert response.choices[0].message.content == expected
    assert (response.usage.prompt_tokens, response.usage.completion_tokens) == (len(ids), count)


def test_streaming_gives_the_same_text_as_a_whole_response(client) -> None:
    whole = client.completions.create(model="tiny", prompt="hello", max_tokens=32, temperature=0)
    stream = client.completions.create(
        model="tiny", prompt="hello", max_tokens=32, temperature=0, stream=True
    )
    chunks = list(stream)
    assert len(chunks) > 2
    assert "".join(chunk.choices[0].text for chunk in chunks) == whole.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"

    messages = [{"role": "user", "content": "hi"}]
    chat = client.chat.completions.create(
        model="tiny",
        messages=messages,
        max_tokens=20,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(chat)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    whole_chat = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=20, temperature=0
    )
    assert text == whole_chat.choices[0].message.content
    assert chunks[-1].usage == whole_chat.usage


def test_stop_sequences_cut_the_text_whole_and_streamed(client) -> None:
    full = client.completions.create(model="tiny", prompt="a", max_tokens=30, temperature=0)
    text = full.choices[0].text
    # A stop sequence of two printable characters, first seen a few characters in.
    stop = next(
        text[i : i + 2]
        for i in range(3, len(text) - 2)
        if text[i : i + 2].isascii()
        and text[i : i + 2].isprintable()
        and text.index(text[i : i + 2]) == i
    )
    cut = client.completions.create(
        model="tiny", prompt="a", max_tokens=30, temperature=0, stop=[stop]
    )
    assert cut.choices[0].text == text[: text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    stream = client.completions.create(
        model="tiny", prompt="a", max_tokens=30, temperature=0, stop=stop, stream=True
    )
    assert "".join(chunk.choices[0].text for chunk in stream) == cut.choices[0].text


def test_seed_and_n_sample_reproducibly(client) -> None:
    def sample():
        response = client.completions.create(
            model="tiny", prompt="hello", max_tokens=12, temperature=1.0, top_p=0.9, n=3, seed=7
        )
        return [choice.text for choice in sorted(response.choices, key=lambda c: c.index)]

    first = sample()
    assert first == sample()
    assert len(set(first)) == 3


def test_sweep_serves_the_best_completed_run(client, sweep_dir: Path) -> None:
    # Run 1 (eval_loss 0.4) beats run 0 (0.9); run 2 (0.1) failed and does not count.
    tokenizer = AutoTokenizer.from_pretrained(TINY_TOKENIZER_DIR)
    model = LlamaForCausalLM.from_pretrained(sweep_dir / "1" / "checkpoints" / "step_5")
    ids = tokenizer.encode("hello")
    expected = model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)
    expected_text = tokenizer.decode(expected[0, len(ids) :], skip_special_tokens=True)
    response = client.completions.create(
        model="sweep-best", prompt="hello", max_tokens=12, temperature=0
    )
    assert response.choices[0].text == expected_text


def test_32_concurrent_requests_all_complete_as_if_alone(base_url: str, client) -> None:
    alone = {
        prompt: client.completions.create(
            model="tiny", prompt=prompt, max_tokens=40, temperature=0
        ).choices[0]
        for prompt in PROMPTS
    }

    async def together():
        async_client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key=API_KEY)
        async with async_client:
            return await asyncio.gather(
                *(
                    async_client.completions.create(
                        model="tiny", prompt=PROMPTS[i % 4], max_tokens=40, temperature=0
                    )
                    for i in range(32)
                )
            )

    responses = asyncio.run(together())
    assert len(responses) == 32
    for i, response in enumerate(responses):
        assert response.choices[0].text == alone[PROMPTS[i % 4]].text


@pytest.mark.parametrize("kind", ["http", "stream", "openai"])
def test_the_benchmarks_clients_in_two_processes_count_every_request(
    base_url, client, kind
) -> None:
    """scripts/serving/deploy_clients.py, which bench_deploy.py measures the server with (each
    kind of client): three clients over two processes, then one client in one of them, answer
    each prompt once, with its tokens, inside the measured time; streamed, with the time to
    each answer's first text."""
    tokens = {
        prompt: client.completions.create(
            model="tiny", prompt=prompt, max_tokens=6, temperature=0
        ).usage.completion_tokens
        for prompt in PROMPTS
    }
    with load_script("serving/deploy_clients").Clients(2, kind) as clients:
        for texts, concurrency in [(PROMPTS * 2, 3), (PROMPTS[1:], 1)]:
            load = clients.run(base_url, texts, 6, concurrency, 2, model="tiny", api_key=API_KEY)
            assert load.output_tokens == sum(tokens[text] for text in texts)
            assert len(load.latencies_s) == len(texts)
            assert 0 < max(load.latencies_s) <= load.wall_s
            assert 0 < load.busy and 0 < load.cpu_per_request_s
            assert bool(load.first_token_s) == (kind == "stream")
            assert all(0 < first <= load.wall_s for first in load.first_token_s)


ROUTES = [
    ("GET", "/v1/models"),
    ("GET", "/v1/models/tiny"),
    ("POST", "/v1/completions"),
    ("POST", "/v1/chat/completions"),
    ("GET", "/no/such/route"),
]


@pytest.mark.parametrize(("method", "path"), ROUTES)
@pytest.mark.parametrize("key", [None, "wrong-key", API_KEY + "x", ""])
def test_every_route_but_health_refuses_a_missing_or_wrong_key(base_url, method, path, key):
    body = json.dumps({"model": "tiny", "prompt": "hi", "max_tokens": 1}).encode()
    status, headers, payload = raw_request(base_url, method, path, body, key=key)
    assert status == 401
    assert json.loads(payload)["error"]["code"] == "invalid_api_key"


def test_health_needs_no_key_and_the_client_reports_a_wrong_one(base_url: str) -> None:
    status, _, payload = raw_request(base_url, "GET", "/health", key=None)
    assert (status, json.loads(payload)) == (200, {"status": "ok"})
    wrong = openai.OpenAI(base_url=f"{base_url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.completions.create(model="tiny", prompt="hi", max_tokens=1)


def _body(**fields) -> bytes:
    return json.dumps({"model": "tiny", "prompt": "hi", "max_tokens": 4, **fields}).encode()


BAD_REQUESTS = {
    "not json": (b"{not json", 400),
    "not utf-8": (b'{"model": "\xff\xfe"}', 400),
    "a list": (b"[1, 2, 3]", 400),
    "empty body": (b"", 400),
    "no prompt": (json.dumps({"model": "tiny"}).encode(), 400),
    "unknown model": (_body(model="gpt-9"), 404),
    "temperature not a number": (_body(temperature="hot"), 400),
    "temperature too high": (_body(temperature=9), 400),
    "top_p zero": (_body(top_p=0), 400),
    "n zero": (_body(n=0), 400),
    "n over the cap": (_body(n=1000), 400),
    "max_tokens zero": (_body(max_tokens=0), 400),
    "max_tokens over the cap": (_body(max_tokens=10**9), 400),
    "prompt plus max_tokens over the context": (_body(max_tokens=254), 400),
    "prompt over the context": (_body(prompt="x" * 300), 400),
    "too many stops": (_body(stop=["a", "b", "c", "d", "e"]), 400),
    "empty stop": (_body(stop=[""]), 400),
    "token id out of range": (_body(prompt=[1, 2, 99999]), 400),
    "negative token id": (_body(prompt=[-1]), 400),
    "empty prompt list": (_body(prompt=[]), 400),
    "prompts times n over the cap": (_body(prompt=["a"] * 5, n=2), 400),
    "seed too large": (_body(seed=2**70), 400),
    "unsupported logprobs": (_body(logprobs=5), 400),
    "unsupported top_k": (_body(top_k=40), 400),
    "unsupported presence_penalty": (_body(presence_penalty=1.5), 400),
    "temperature negative": (_body(temperature=-0.5), 400),
    "temperature NaN": (_body().replace(b'"max_tokens"', b'"temperature": NaN, "max_tokens"'), 400),
    "top_p Infinity": (_body().replace(b'"max_tokens"', b'"top_p": Infinity, "max_tokens"'), 400),
    "top_p over 1": (_body(top_p=1.5), 400),
    "max_tokens a fraction": (_body(max_tokens=1.5), 400),
    "n negative": (_body(n=-2), 400),
    "seed too small": (_body(seed=-(2**70)), 400),
    "stop not text": (_body(stop=[1]), 400),
    "stream not a bool": (_body(stream="maybe"), 400),
    "lone surrogate in the prompt": (b'{"model": "tiny", "prompt": "a\\ud800b"}', 400),
    "lone surrogate in a stop": (_body().replace(b'"hi"', b'"hi", "stop": ["\\udfff"]'), 400),
    "lone surrogate in a key": (_body().replace(b'"hi"', b'"hi", "\\ud800": 1'), 400),
    "JSON nested 5,000 deep": (_body(prompt="P").replace(b'"P"', b"[" * 5000 + b"]" * 5000), 400),
    "body over the size limit": (_body(prompt="x" * 100_000), 413),
}


@pytest.mark.parametrize("name", BAD_REQUESTS)
def test_malformed_and_oversize_completions_get_a_clear_4xx(base_url: str, name: str) -> None:
    body, expected = BAD_REQUESTS[name]
    status, _, payload = raw_request(base_url, "POST", "/v1/completions", body)
    assert status == expected, payload
    assert json.loads(payload)["error"]["message"]


@pytest.mark.parametrize("depth", [65, 5000])
def test_deeply_nested_json_is_a_400_that_says_so(base_url: str, depth: int) -> None:
    # 65: parsed, then refused by the depth limit; 5,000: past the JSON decoder's own recursion.
    nested = b"[" * depth + b"]" * depth
    body = b'{"model": "tiny", "messages": ' + nested + b"}"
    status, _, payload = raw_request(base_url, "POST", "/v1/chat/completions", body)
    error = json.loads(payload)["error"]
    assert status == 400
    assert "more than 64 levels deep" in error["message"]
    assert error["type"] == "invalid_request_error"


def test_invalid_unicode_is_a_400_naming_the_field(base_url: str) -> None:
    body = b'{"model": "tiny", "messages": [{"role": "user", "content": "\\udc00"}]}'
    status, _, payload = raw_request(base_url, "POST", "/v1/chat/completions", body)
    error = json.loads(payload)["error"]
    assert (status, error["param"]) == (400, "messages")
    assert "surrogate" in error["message"]


def test_a_tiny_temperature_samples_greedily(client: openai.OpenAI) -> None:
    greedy = client.completions.create(model="tiny", prompt="hello", max_tokens=8, temperature=0)
    for temperature in (1e-6, 1e-50, 5e-324):  # 1e-50 made nan probabilities: a 500
        tiny = client.completions.create(
            model="tiny", prompt="hello", max_tokens=8, temperature=temperature
        )
        assert tiny.choices[0].text == greedy.choices[0].text


BAD_CHATS = {
    "no messages": {"messages": []},
    "messages not a list": {"messages": "hi"},
    "unknown role": {"messages": [{"role": "wizard", "content": "hi"}]},
    "image content": {
        "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]
    },
    "max_completion_tokens over the context": {
        "messages": [{"role": "user", "content": "hi"}],
        "max_completion_tokens": 1000,
    },
    "tools": {"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]},
}


@pytest.mark.parametrize("name", BAD_CHATS)
def test_malformed_chats_get_400(base_url: str, name: str) -> None:
    body = json.dumps({"model": "tiny", **BAD_CHATS[name]}).encode()
    status, _, payload = raw_request(base_url, "POST", "/v1/chat/completions", body)
    assert status == 400, payload


CHOICES = {  # request fields -> how many choices the answer has
    "n=2": ({"prompt": "hi", "n": 2}, 2),
    "two prompts": ({"prompt": ["hi", "the quick brown fox"]}, 2),
    "two token prompts, n=3": ({"prompt": [[5, 6, 7], [8, 9]], "n": 3}, 6),
    "chat, n=3": ({"messages": [{"role": "user", "content": "hi"}], "n": 3}, 3),
}


@pytest.mark.parametrize("max_tokens", [1, 5])
@pytest.mark.parametrize("name", CHOICES)
def test_each_choice_finishes_once_whole_and_streamed(base_url, name, max_tokens) -> None:
    fields, count = CHOICES[name]
    chat = "messages" in fields
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body = {"model": "tiny", "max_tokens": max_tokens, "temperature": 0, **fields}
    status, _, payload = raw_request(base_url, "POST", path, json.dumps(body).encode())
    assert status == 200, payload  # max_tokens=1 was a KeyError: a 500, connection dropped
    whole = json.loads(payload)
    assert [choice["index"] for choice in whole["choices"]] == list(range(count))
    assert all(choice["finish_reason"] for choice in whole["choices"])
    if max_tokens == 1:
        assert whole["usage"]["completion_tokens"] == count

    body["stream"] = True
    status, _, payload = raw_request(base_url, "POST", path, json.dumps(body).encode())
    assert status == 200, payload
    events = payload.decode().split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""]
    texts, finishes = {i: "" for i in range(count)}, {i: [] for i in range(count)}
    for event in events[:-2]:
        for choice in json.loads(event.removeprefix("data: "))["choices"]:
            texts[choice["index"]] += choice["delta"].get("content", "") if chat else choice["text"]
            if choice["finish_reason"]:
                finishes[choice["index"]].append(choice["finish_reason"])
    assert all(len(reasons) == 1 for reasons in finishes.values()), finishes  # was index 0 twice
    whole_texts = [c["message"]["content"] if chat else c["text"] for c in whole["choices"]]
    assert list(texts.values()) == whole_texts


def test_bad_requests_do_not_disturb_a_running_stream(base_url: str, client) -> None:
    alone = client.completions.create(model="tiny", prompt="hello", max_tokens=60, temperature=0)
    stream = iter(
        client.completions.create(
            model="tiny", prompt="hello", max_tokens=60, temperature=0, stream=True
        )
    )
    text = next(stream).choices[0].text  # the stream is in the running batch now
    # Refused before they reach the batch, and a tiny temperature that joins it (once a 500
    # whose failed sampling step took every running stream down with it).
    refused = [_body(temperature=-1), _body(top_p=0), _body(prompt="\ud800"), _body(n=0)]
    for body in refused:
        assert raw_request(base_url, "POST", "/v1/completions", body)[0] == 400
    joined = client.completions.create(model="tiny", prompt="hi", max_tokens=8, temperature=1e-50)
    assert joined.choices[0].finish_reason is not None
    chunks = list(stream)  # an error event here would raise openai.APIError
    text += "".join(chunk.choices[0].text for chunk in chunks)
    assert text == alone.choices[0].text
    assert chunks[-1].choices[0].finish_reason == alone.choices[0].finish_reason


def test_the_servers_startup_heap_is_frozen_while_it_serves(run_dir: Path) -> None:
    # What is alive once the engines start (torch, the model, the tokenizer) is kept out of the
    # garbage collector's walks while the server runs, and given back when it stops.
    import gc

    cfg = deploy_config(f"checkpoint={run_dir}", "served_model_name=tiny", "port=0")
    with serving(cfg) as url:
        assert gc.get_freeze_count() > 10_000, gc.get_freeze_count()
        status, _, _ = raw_request(url, "GET", "/health", key=None)
        assert status == 200
    assert gc.get_freeze_count() == 0


def test_a_full_queue_answers_429_with_retry_after(run_dir: Path) -> None:
    cfg = deploy_config(
        f"checkpoint={run_dir}",
        "served_model_name=tiny",
        "port=0",
        "max_queue=1",
        "transformers.max_batch_size=1",
    )
    with serving(cfg) as url:
        body = _body(max_tokens=200, prompt="hello")
        results: list[tuple[int, dict]] = []

        def send() -> None:
            status, headers, _ = raw_request(url, "POST", "/v1/completions", body, key=None)
            results.append((status, headers))

        threads = [threading.Thread(target=send) for _ in range(6)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    statuses = sorted(status for status, _ in results)
    assert set(statuses) == {200, 429}, statuses
    assert all(headers["retry-after"] == "1" for status, headers in results if status == 429)


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
    [(signal.SIGINT, "true"), (signal.SIGTERM, "true"), (signal.SIGINT, "false")],
    ids=["ctrl-c, engine process", "sigterm, engine process", "ctrl-c, one process"],
)
def test_deploy_command_serves_until_interrupted(run_dir: Path, reference, stop, process) -> None:
    # compute=cpu dtype=fp32 (the command serves on the CPU here). Ctrl-C reaches the whole
    # process group, SIGTERM only the server: either way nothing it started is left running.
    env = {**os.environ, "DEPLOY_TEST_KEY": API_KEY}
    command = [sys.executable, "-m", "runner", "deploy", f"checkpoint={run_dir}", "port=0"]
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
        while True:  # the address is printed as the server starts listening
            with contextlib.suppress(ConnectionError):
                if raw_request(url, "GET", "/health", key=None)[0] == 200:
                    break
            time.sleep(0.05)
        # The engine's process, or none; forked (the server's own command line, where a
        # spawned one runs multiprocessing's), as runner deploy starts it on the CPU.
        children = _children(process_.pid)
        assert bool(children) == (process == "true"), children
        command_line = Path(f"/proc/{process_.pid}/cmdline").read_bytes()
        forked = [c for c in children if Path(f"/proc/{c}/cmdline").read_bytes() == command_line]
        assert forked == list(children), children
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0)
        # The server does not tell its clients where its files lie.
        (listed,) = client.models.list().data
        assert listed.id == f"{run_dir.parent.name}/run/step_10"
        assert client.models.retrieve(str(run_dir)).id == listed.id
        # Greedy, so the answer is transformers' own (a sampled one may stop at eos early).
        # A client that asks by the path given in checkpoint= (the id before) is still served.
        response = client.completions.create(
            model=str(run_dir), prompt="hi", max_tokens=3, temperature=0
        )
        assert response.model == listed.id
        tokenizer, generate = reference
        assert (response.choices[0].text, response.usage.completion_tokens) == generate(
            tokenizer.encode("hi"), 3
        )
        if stop == signal.SIGINT:
            os.killpg(process_.pid, stop)
        else:
            process_.send_signal(stop)
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
    run_dir: Path, reference
) -> None:
    # compute=cpu dtype=fp32. Greedy equals generate, streamed and whole, in both placements;
    # seeded samples (n=3), a stop sequence and a full queue's 429 are the same in both.
    import multiprocessing

    tokenizer, generate = reference
    prompt = PROMPTS[3]
    expected = generate(tokenizer.encode(prompt), 20)
    answers = {}
    before = set(multiprocessing.active_children())  # the module's other servers' engines

    def engines() -> list:
        return [c for c in set(multiprocessing.active_children()) - before if "engine" in c.name]

    for process in ("true", "false"):
        cfg = deploy_config(
            f"checkpoint={run_dir}",
            "served_model_name=tiny",
            "port=0",
            f"transformers.process={process}",
            "max_queue=3",
            "transformers.max_batch_size=1",
        )
        with serving(cfg) as url:
            assert len(engines()) == (process == "true"), engines()
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
            statuses: list[int] = []

            def send(url: str = url, statuses: list[int] = statuses) -> None:
                body = _body(model="tiny", max_tokens=200, prompt="hello")
                statuses.append(raw_request(url, "POST", "/v1/completions", body, key=None)[0])

            threads = [threading.Thread(target=send) for _ in range(6)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            answers[process] = ([c.text for c in sampled.choices], cut.choices[0].text)
            assert set(statuses) == {200, 429}, statuses
        assert not engines()
    assert answers["true"] == answers["false"]
    assert answers["true"][1] == expected[0][: expected[0].index(stop)]
    assert len(set(answers["true"][0])) == 3


def test_deploy_command_without_checkpoint_exits_2_with_one_message() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "runner", "deploy"], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 2
    assert "checkpoint" in result.stderr and "Traceback" not in result.stderr


def test_the_engine_in_its_own_process_serves_a_lora_checkpoint(tiny_checkpoint: Path) -> None:
    # compute=cpu dtype=fp32. A LoRA checkpoint as method=lora writes one (a PEFT adapter naming
    # its base by path, the tokenizer beside it), with random B matrices so that the adapter
    # changes the answers: the engine's process merges it, as the server's own would.
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
    with serving(cfg) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        response = client.completions.create(
            model="lora", prompt=PROMPTS[3], max_tokens=16, temperature=0
        )
    assert response.choices[0].text == answers["merged"]
