"""`runner deploy`: a real server on loopback, a tiny checkpoint, the real `openai` client."""

from __future__ import annotations

import asyncio
import http.client
import json
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import torch
from transformers import AutoTokenizer, LlamaForCausalLM

from runner.deploy.protocol import ChatMessage
from runner.deploy.selection import resolve_checkpoints
from runner.paths import TINY_TOKENIZER_DIR
from tests.conftest import load_script, transformers_warnings
from tests.serving import (
    API_KEY,
    PROMPTS,
    completion_body,
    deploy_config,
    make_checkpoint,
    make_run,
    raw_request,
    serving,
)


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


PAGE = "https://chat.example"  # a web page whose scripts may call the keyed server


@pytest.fixture(scope="module")
def base_url(tmp_path_factory, served_run: Path, sweep_dir: Path) -> Iterator[str]:
    key_file = tmp_path_factory.mktemp("secrets") / "api_key"
    key_file.write_text(API_KEY + "\n")
    cfg = deploy_config(
        f"checkpoint=[{served_run},{sweep_dir}]",
        "served_model_name=[tiny,sweep-best]",
        "select.metric=eval_loss",
        f"api_key.file={key_file}",
        "port=0",
        "limits.max_body_bytes=65536",
        f"allowed_origins=[{PAGE}]",
    )
    with serving(cfg) as url:
        yield url


@pytest.fixture(scope="module")
def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key=API_KEY, max_retries=0)


def test_a_run_dir_is_served_from_its_latest_whole_checkpoint(served_run: Path) -> None:
    select = {"checkpoint": "latest", "metric": None, "mode": None}
    (served,) = resolve_checkpoints(str(served_run), names=None, allowed_roots=[], **select)
    assert served.path == (served_run / "checkpoints" / "step_10").resolve()  # not .tmp-step_20
    # Named by its run and step, not by where its files lie; the paths still find it.
    assert served.name == f"{served_run.parent.name}/run/step_10"
    assert set(served.aliases) == {str(served_run), str(served.path)}


def test_models_lists_every_served_checkpoint(client: openai.OpenAI) -> None:
    assert sorted(model.id for model in client.models.list()) == ["sweep-best", "tiny"]
    assert client.models.retrieve("tiny").id == "tiny"


def test_completion_greedy_equals_transformers_generate(client, generate_reference) -> None:
    tokenizer, generate = generate_reference
    for prompt in PROMPTS[:2]:
        ids = tokenizer.encode(prompt)
        expected, count = generate(ids, 24)
        response = client.completions.create(
            model="tiny", prompt=prompt, max_tokens=24, temperature=0
        )
        assert response.choices[0].text == expected
        assert response.usage.prompt_tokens == len(ids)
        assert response.usage.completion_tokens == count


def test_chat_uses_the_checkpoint_chat_template(client, generate_reference) -> None:
    tokenizer, generate = generate_reference
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


def browser_request(base_url: str, method: str, headers: dict[str, str], body: bytes = b""):
    """Status and headers of a request to /v1/chat/completions as a browser sends it."""
    host, port = base_url.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=30)
    connection.request(method, "/v1/chat/completions", body=body or None, headers=headers)
    response = connection.getresponse()
    response.read()
    connection.close()
    return response.status, {k.lower(): v for k, v in response.getheaders()}


@pytest.mark.parametrize("origin", [PAGE, "https://evil.example"])
def test_a_listed_web_page_may_call_the_api_from_a_browser(base_url: str, origin: str) -> None:
    """allowed_origins (CORS): a browser asks first, without the key (it sends none on a
    preflight), and reads an answer only where it is told the page may. Without the setting,
    the preflight was a 401 (405 without a key), so no page could call even a keyed server."""
    ask = {"Origin": origin, "Access-Control-Request-Method": "POST"}
    # As the OpenAI JavaScript SDK asks in a browser (the X-Stainless-* headers were refused).
    ask["Access-Control-Request-Headers"] = "authorization,content-type,x-stainless-os"
    status, headers = browser_request(base_url, "OPTIONS", ask)
    listed = origin == PAGE
    assert (status == 200) == listed and headers.get("access-control-allow-origin") == (
        origin if listed else None
    )
    body = json.dumps({"model": "tiny", "messages": HI, "max_tokens": 1}).encode()
    sent = {"Origin": origin, "Authorization": f"Bearer {API_KEY}"}
    status, headers = browser_request(
        base_url, "POST", {**sent, "Content-Type": "application/json"}, body
    )
    assert status == 200 and headers.get("access-control-allow-origin") == (
        origin if listed else None
    )
    # The key is still asked of the request itself.
    status, _ = browser_request(base_url, "POST", {"Origin": origin}, body)
    assert status == 401


def test_a_developer_message_is_the_system_message_of_a_template_without_one(client) -> None:
    """OpenAI's newer name for the system message: the template has no such role, and wrote a
    header its model never saw (ChatML's dropped the message)."""
    answers = {}
    for role in ("developer", "system"):
        messages = [{"role": role, "content": "be brief"}, {"role": "user", "content": "hi"}]
        answers[role] = client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=8, temperature=0
        )
    assert answers["developer"].choices[0].message == answers["system"].choices[0].message
    assert answers["developer"].usage == answers["system"].usage


def test_an_answer_sent_back_as_history_is_the_conversation_it_was(
    client, generate_reference
) -> None:
    """The openai client's message.model_dump() holds refusal, tool_calls, function_call, audio
    and annotations, each null: they were refused (400), and so was a tool message's
    tool_call_id, which OpenAI requires."""
    tokenizer, generate = generate_reference
    asked = [{"role": "user", "content": "hi"}]
    answer = client.chat.completions.create(model="tiny", messages=asked, max_tokens=4)
    sent_back = answer.choices[0].message.model_dump()
    assert {"refusal", "tool_calls", "function_call", "audio", "annotations"} <= set(sent_back)
    tool = {"role": "tool", "content": "42", "tool_call_id": "call_1"}
    messages = [*asked, sent_back, tool, {"role": "user", "content": "more"}]
    plain = [{k: v for k, v in m.items() if v is not None} for m in messages]
    text = tokenizer.apply_chat_template(plain, add_generation_prompt=True, tokenize=False)
    ids = tokenizer.encode(text, add_special_tokens=False)
    response = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=8, temperature=0
    )
    assert response.choices[0].message.content == generate(ids, 8)[0]
    assert response.usage.prompt_tokens == len(ids)
    # The tiny template writes no tool_call_id; a template that does is given it.
    given = ChatMessage.model_validate(tool).as_template_input()
    assert given == {"role": "tool", "content": "42", "tool_call_id": "call_1"}


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
        stream_options={"include_usage": True, "include_obfuscation": False},  # no padding here
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


def test_logprobs_come_whole_and_streamed_as_the_openai_client_reads_them(client) -> None:
    """Each generated token's log probability and its top, on both routes, whole and
    streamed (the streamed chunks' together are the whole answer's, seeded alike); the engine's
    figures themselves are checked against the model's in test_deploy_engine.py."""
    asked = {"model": "tiny", "prompt": "hello", "max_tokens": 10, "seed": 3, "n": 2}
    whole = client.completions.create(**asked, logprobs=2)
    # One for each token counted (a choice may end at its end-of-sequence token before 10).
    assert sum(len(c.logprobs.tokens) for c in whole.choices) == whole.usage.completion_tokens
    for choice in whole.choices:
        logprobs = choice.logprobs
        count = len(logprobs.tokens)
        assert len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == count
        assert logprobs.text_offset == [sum(map(len, logprobs.tokens[:i])) for i in range(count)]
        for token, logprob, top in zip(
            logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs, strict=True
        ):
            assert logprob <= 0 and top[token] == logprob  # the sampled token among its top
            assert 1 <= len(top) <= 3 and max(top.values()) <= 0  # texts may coincide
    streamed = {0: [], 1: []}
    for chunk in client.completions.create(**asked, logprobs=2, stream=True):
        (choice,) = chunk.choices
        streamed[choice.index].append(choice.logprobs)
    for choice in whole.choices:
        parts = streamed[choice.index]
        for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
            assert [x for part in parts for x in getattr(part, key)] == getattr(
                choice.logprobs, key
            )

    messages = [{"role": "user", "content": "hi"}]
    chat = {"model": "tiny", "messages": messages, "max_tokens": 8, "temperature": 0}
    answer = client.chat.completions.create(**chat, logprobs=True, top_logprobs=3)
    content = answer.choices[0].logprobs.content
    assert len(content) == answer.usage.completion_tokens
    for token in content:
        assert token.bytes == list(token.token.encode())
        assert [top.logprob for top in token.top_logprobs][0] == token.logprob  # greedy: top 1
        assert len(token.top_logprobs) == 3
    chunks = client.chat.completions.create(**chat, logprobs=True, top_logprobs=3, stream=True)
    lists = [c.choices[0].logprobs.content for c in chunks if c.choices and c.choices[0].logprobs]
    assert [token for part in lists for token in part] == content
    # Not asked (or asked false): none, as before.
    assert client.chat.completions.create(**chat).choices[0].logprobs is None
    assert client.chat.completions.create(**chat, logprobs=False).choices[0].logprobs is None


def test_echo_scores_prompts_as_lm_evaluation_harness_asks(
    base_url: str, tiny_checkpoint: Path
) -> None:
    """lm-evaluation-harness's local-completions scores a continuation with token-id prompts,
    echo, logprobs 1 and max_tokens 1, and sums token_logprobs[context:-1]: each prompt token's
    log probability given those before it (the first's null), then the one generated token's.
    Streamed, the first chunk of each choice starts with its prompt, and the chunks' logprobs
    together are the whole answer's."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoint)
    prompts = [tokenizer(text)["input_ids"] for text in PROMPTS[:2]]
    body = {"model": "tiny", "prompt": prompts, "echo": True, "logprobs": 1, "max_tokens": 1}
    body["temperature"] = 0
    status, _, payload = raw_request(base_url, "POST", "/v1/completions", json.dumps(body).encode())
    assert status == 200, payload
    choices = json.loads(payload)["choices"]
    model = LlamaForCausalLM.from_pretrained(tiny_checkpoint).eval()
    for prompt, choice in zip(prompts, choices, strict=True):
        logprobs = choice["logprobs"]
        decoded = tokenizer.decode(prompt, skip_special_tokens=False)
        assert choice["text"].startswith(decoded)
        assert len(logprobs["tokens"]) == len(prompt) + 1
        assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
        with torch.no_grad():
            logits = model(torch.tensor([prompt])).logits[0].log_softmax(dim=-1)
        expected = [logits[i - 1, prompt[i]].item() for i in range(1, len(prompt))]
        expected.append(logits[-1].max().item())  # greedy: the generated token is the top one
        assert logprobs["token_logprobs"][1:] == pytest.approx(expected, abs=1e-4)
        tops = logprobs["top_logprobs"][1:]
        for logprob, top in zip(logprobs["token_logprobs"][1:], tops, strict=True):
            assert logprob in top.values() and len(top) <= 2  # its own, and the top 1
    # Streamed: the same, in chunks (one request's text prompt this time).
    body = {**body, "prompt": PROMPTS[0], "max_tokens": 4, "stream": True}
    status, _, payload = raw_request(base_url, "POST", "/v1/completions", json.dumps(body).encode())
    chunks = [
        json.loads(line.removeprefix("data: "))["choices"][0]
        for line in payload.decode().split("\n\n")
        if line.startswith("data: {")
    ]
    assert chunks[0]["text"].startswith(PROMPTS[0])
    whole = json.loads(
        raw_request(
            base_url, "POST", "/v1/completions", json.dumps({**body, "stream": False}).encode()
        )[2]
    )["choices"][0]
    assert "".join(chunk["text"] for chunk in chunks) == whole["text"]
    for key in ("tokens", "token_logprobs", "text_offset"):
        assert [x for chunk in chunks for x in chunk["logprobs"][key]] == whole["logprobs"][key]


def test_top_k_1_samples_greedily_and_top_k_keeps_each_token_among_its_k(client) -> None:
    """top_k (vLLM's and SGLang's extension, through the OpenAI client's extra_body): at 1 a
    sample at any temperature is the greedy answer; at 3 each sampled token is among the 3 most
    likely, as the logprobs show (a temperature of 1.5 over the random model draws outside its
    top 3 at most steps)."""
    greedy = client.completions.create(model="tiny", prompt="hello", max_tokens=16, temperature=0)
    one = client.completions.create(
        model="tiny", prompt="hello", max_tokens=16, temperature=1.5, extra_body={"top_k": 1}
    )
    assert one.choices[0].text == greedy.choices[0].text
    three = client.completions.create(
        model="tiny",
        prompt="hello",
        max_tokens=16,
        temperature=1.5,
        seed=5,
        n=3,
        logprobs=3,
        extra_body={"top_k": 3},
    )
    for choice in three.choices:
        logprobs = choice.logprobs
        for token, logprob, top in zip(
            logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs, strict=True
        ):
            # The top holds the 3 most likely and the sampled token (OpenAI's logprobs + 1):
            # the sampled one is among the 3 when its figure reaches the third highest (texts
            # may coincide, U+FFFD, and merge two entries).
            third = sorted(top.values(), reverse=True)[: min(3, len(top))][-1]
            assert logprob >= third, (token, top)


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


BAD_REQUESTS = {
    "not json": (b"{not json", 400),
    "not utf-8": (b'{"model": "\xff\xfe"}', 400),
    "a list": (b"[1, 2, 3]", 400),
    "empty body": (b"", 400),
    "no prompt": (json.dumps({"model": "tiny"}).encode(), 400),
    "unknown model": (completion_body(model="gpt-9"), 404),
    "temperature not a number": (completion_body(temperature="hot"), 400),
    "temperature too high": (completion_body(temperature=9), 400),
    "top_p zero": (completion_body(top_p=0), 400),
    "n zero": (completion_body(n=0), 400),
    "n over the cap": (completion_body(n=1000), 400),
    "max_tokens zero": (completion_body(max_tokens=0), 400),
    "max_tokens over the cap": (completion_body(max_tokens=10**9), 400),
    "prompt plus max_tokens over the context": (completion_body(max_tokens=254), 400),
    "prompt over the context": (completion_body(prompt="x" * 300), 400),
    "too many stops": (completion_body(stop=["a", "b", "c", "d", "e"]), 400),
    "empty stop": (completion_body(stop=[""]), 400),
    "token id out of range": (completion_body(prompt=[1, 2, 99999]), 400),
    "negative token id": (completion_body(prompt=[-1]), 400),
    "empty prompt list": (completion_body(prompt=[]), 400),
    "prompts times n over the cap": (completion_body(prompt=["a"] * 5, n=2), 400),
    "seed too large": (completion_body(seed=2**70), 400),
    "logprobs over 20": (completion_body(logprobs=21), 400),
    "logprobs negative": (completion_body(logprobs=-1), 400),
    "logprobs true, chat's form": (completion_body(logprobs=True), 400),
    "chat's top_logprobs on completions": (completion_body(top_logprobs=2), 400),
    "echo not a bool": (completion_body(echo=1), 400),
    "a misspelt field": (completion_body(max_token=2), 400),
    "another server's sampling option": (completion_body(repetition_penalty=2.0), 400),
    "chat's max_completion_tokens on completions": (completion_body(max_completion_tokens=2), 400),
    "max_tokens a string": (completion_body(max_tokens="5"), 400),
    "max_tokens a bool": (completion_body(max_tokens=True), 400),
    "stream a string": (completion_body(stream="yes"), 400),
    "top_k below -1": (completion_body(top_k=-2), 400),
    "top_k a fraction": (completion_body(top_k=2.5), 400),
    "unsupported presence_penalty": (completion_body(presence_penalty=1.5), 400),
    "best_of under n": (completion_body(best_of=1, n=2), 400),
    "temperature negative": (completion_body(temperature=-0.5), 400),
    "temperature NaN": (
        completion_body().replace(b'"max_tokens"', b'"temperature": NaN, "max_tokens"'),
        400,
    ),
    "top_p Infinity": (
        completion_body().replace(b'"max_tokens"', b'"top_p": Infinity, "max_tokens"'),
        400,
    ),
    "top_p over 1": (completion_body(top_p=1.5), 400),
    "max_tokens a fraction": (completion_body(max_tokens=1.5), 400),
    "n negative": (completion_body(n=-2), 400),
    "seed too small": (completion_body(seed=-(2**70)), 400),
    "stop not text": (completion_body(stop=[1]), 400),
    "stream not a bool": (completion_body(stream="maybe"), 400),
    "lone surrogate in the prompt": (b'{"model": "tiny", "prompt": "a\\ud800b"}', 400),
    "lone surrogate in a stop": (
        completion_body().replace(b'"hi"', b'"hi", "stop": ["\\udfff"]'),
        400,
    ),
    "lone surrogate in a key": (completion_body().replace(b'"hi"', b'"hi", "\\ud800": 1'), 400),
    "JSON nested 5,000 deep": (
        completion_body(prompt="P").replace(b'"P"', b"[" * 5000 + b"]" * 5000),
        400,
    ),
    "body over the size limit": (completion_body(prompt="x" * 100_000), 413),
}


def test_best_of_1_beside_one_answer_changes_nothing(base_url: str) -> None:
    """best_of=1 is OpenAI's default; below n it is refused (BAD_REQUESTS)."""
    status, _, payload = raw_request(
        base_url, "POST", "/v1/completions", completion_body(best_of=1, n=1)
    )
    assert status == 200 and len(json.loads(payload)["choices"]) == 1, payload


@pytest.mark.parametrize("name", BAD_REQUESTS)
def test_malformed_and_oversize_completions_get_a_clear_4xx(base_url: str, name: str) -> None:
    body, expected = BAD_REQUESTS[name]
    status, _, payload = raw_request(base_url, "POST", "/v1/completions", body)
    assert status == expected, payload
    assert json.loads(payload)["error"]["message"]


WRONG_FIELDS = {  # body fields -> the error's param and message
    "misspelt": (
        {"max_token": 2},
        "max_token",
        "unrecognized request argument: max_token; this route takes model, max_tokens, "
        "temperature, top_p, top_k, n, stop, seed, stream, stream_options, prompt, logprobs, "
        "echo",
    ),
    "a number as text": ({"n": "2"}, "n", "n: Input should be a valid integer"),
    "a prompt past the context": (
        {"prompt": [5] * 300},
        "prompt",
        "this model's maximum context length is 256 tokens; the prompt has 300 tokens, which "
        "leaves none to generate: shorten the prompt",
    ),
    "a prompt of no kind it takes": (
        {"prompt": 123},
        "prompt",
        "prompt: give a string, a list of strings, a list of token ids or a list of lists of "
        "token ids",
    ),
}


HI = [{"role": "user", "content": "hi"}]
CALL = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
WRONG_CHAT_FIELDS = {  # body fields -> the error's param and message
    "a misspelt content": (
        {"messages": [{"role": "user", "contnet": "hi"}]},
        "messages.0.contnet",
        "unrecognized request argument: messages.0.contnet",
    ),
    "a user message without content": (
        {"messages": [*HI, {"role": "assistant", "content": None}, {"role": "user"}]},
        "messages.2.content",
        "messages.2.content: a user message needs its content",
    ),
    "an assistant's tool calls": (
        {"messages": [*HI, {"role": "assistant", "content": None, "tool_calls": [CALL]}]},
        "messages.1.tool_calls",
        "messages.1.tool_calls is not supported by this server",
    ),
    "an assistant's refusal": (
        {"messages": [*HI, {"role": "assistant", "content": None, "refusal": "no"}]},
        "messages.1.refusal",
        "messages.1.refusal is not supported by this server",
    ),
    "a misspelt include_usage": (
        {"messages": HI, "stream": True, "stream_options": {"include_usag": True}},
        "stream_options.include_usag",
        "unrecognized request argument: stream_options.include_usag",
    ),
    "top_logprobs without logprobs": (
        {"messages": HI, "top_logprobs": 2},
        "top_logprobs",
        "top_logprobs needs logprobs: true, which returns the tokens' logprobs",
    ),
    "top_logprobs over 20": (
        {"messages": HI, "logprobs": True, "top_logprobs": 21},
        "top_logprobs",
        "top_logprobs: Input should be less than or equal to 20",
    ),
    "logprobs a number, the completions' form": (
        {"messages": HI, "logprobs": 2},
        "logprobs",
        "logprobs: Input should be a valid boolean",
    ),
    "max_completion_tokens over the cap, by its own name": (
        {"messages": HI, "max_completion_tokens": 10**6},
        "max_completion_tokens",
        "max_completion_tokens is 1000000; this server allows at most 4096",
    ),
}


@pytest.mark.parametrize("name", WRONG_CHAT_FIELDS)
def test_a_chat_field_it_does_not_take_is_named_by_its_place(base_url: str, name: str) -> None:
    """Inside a message or stream_options as at the top: a misspelt content was dropped, and
    the model answered an empty message; a misspelt include_usage sent no usage, unsaid."""
    fields, param, message = WRONG_CHAT_FIELDS[name]
    body = json.dumps({"model": "tiny", **fields}).encode()
    status, _, payload = raw_request(base_url, "POST", "/v1/chat/completions", body)
    error = json.loads(payload)["error"]
    assert (status, error["param"], error["message"]) == (400, param, message)


@pytest.mark.parametrize("name", WRONG_FIELDS)
def test_a_field_it_does_not_take_or_of_the_wrong_kind_is_named(base_url: str, name: str) -> None:
    """Refused as OpenAI refuses them; dropped or coerced, the client would get an answer to
    another request than its own (256 tokens for a misspelt max_tokens)."""
    fields, param, message = WRONG_FIELDS[name]
    status, _, payload = raw_request(base_url, "POST", "/v1/completions", completion_body(**fields))
    error = json.loads(payload)["error"]
    assert (status, error["param"], error["message"]) == (400, param, message)


def test_a_prompt_past_the_context_is_refused_without_a_warning_of_a_run(base_url: str) -> None:
    """The tokenizer's own length check logged "Running this sequence through the model will
    result in indexing errors" for a prompt that is refused, never run."""
    body = completion_body(prompt="hello " * 300)
    with transformers_warnings() as warned:
        status, _, payload = raw_request(base_url, "POST", "/v1/completions", body)
    assert status == 400 and json.loads(payload)["error"]["param"] == "prompt", payload
    assert not warned


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
    "stream_options without a stream": {
        "messages": [{"role": "user", "content": "hi"}],
        "stream_options": {"include_usage": True},
    },
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
    refused = [
        completion_body(temperature=-1),
        completion_body(top_p=0),
        completion_body(prompt="\ud800"),
        completion_body(n=0),
    ]
    for body in refused:
        assert raw_request(base_url, "POST", "/v1/completions", body)[0] == 400
    joined = client.completions.create(model="tiny", prompt="hi", max_tokens=8, temperature=1e-50)
    assert joined.choices[0].finish_reason is not None
    chunks = list(stream)  # an error event here would raise openai.APIError
    text += "".join(chunk.choices[0].text for chunk in chunks)
    assert text == alone.choices[0].text
    assert chunks[-1].choices[0].finish_reason == alone.choices[0].finish_reason
