"""A hostile client against `runner deploy`: requests generated over the OpenAI request schema.

Every field is sometimes right, sometimes the wrong type, an extreme number, odd text or missing.
Whatever a request holds, the server answers it: a 2xx whose choices each finish once, or a 4xx
with an OpenAI error body; never a 5xx, never a dropped connection.
"""

from __future__ import annotations

import http.client
import json
from collections import Counter
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.serving import deploy_config, make_checkpoint, make_run, raw_request, serving

# About 30 s on 2 CPU cores. Derandomized, but not the same requests on every tree: Hypothesis
# mixes the string and number constants of the local modules imported so far (runner's, as
# hypothesis.internal.conjecture.providers collects them) into what it draws, so a change in
# runner, or the runner modules that a worker's earlier tests imported, change the requests
# (and a change in `send` below, whose source seeds the draws). A failure prints its request.
MAX_EXAMPLES = 600
VOCAB_SIZE = 264  # the tiny checkpoint's

ODD_TEXT = st.sampled_from(
    ["", " ", "\x00", "\ud800", "a\udfffb", "🙂" * 8, "\u202e", "</s>", "<|eot_id|>", "x" * 300]
)
TEXT = st.text(max_size=24) | ODD_TEXT
EXTREME_NUMBERS = st.sampled_from(
    [0, -1, 1, 2, 2**31, 2**63 - 1, 2**63, 2**64, -(2**63) - 1, 10**30, -0.0, 0.5, 1e-50,
     5e-324, 1e308, float("nan"), float("inf"), float("-inf")]
)  # fmt: skip
NUMBERS = st.integers() | st.floats() | EXTREME_NUMBERS
SCALARS = st.none() | st.booleans() | NUMBERS | TEXT
ANY_JSON = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(TEXT, inner, max_size=4),
    max_leaves=12,
)


def one_in(count: int, rare: st.SearchStrategy, usual: st.SearchStrategy) -> st.SearchStrategy:
    """`rare` one time in `count`, else `usual` (st.one_of weighs its branches alike)."""
    return st.integers(1, count).flatmap(lambda draw: rare if draw == 1 else usual)


def field(right: st.SearchStrategy) -> st.SearchStrategy:
    """A field's value: of the right type (odd text and edge values included) nine times in
    ten, else anything at all."""
    return one_in(10, ANY_JSON | EXTREME_NUMBERS, right)


SAMPLING = {
    "max_tokens": field(st.integers(1, 6)),
    "temperature": field(st.floats(0, 2)),
    "top_p": field(st.floats(0, 1, exclude_min=True)),
    "n": field(st.integers(1, 4)),
    "stop": field(TEXT | st.lists(TEXT, max_size=5)),
    "seed": field(st.integers(-(2**63), 2**64 - 1)),
    "stream": field(st.booleans()),
    "stream_options": field(st.fixed_dictionaries({"include_usage": st.booleans()})),
    "user": field(TEXT),
    "top_k": field(st.none() | st.integers(-1, 300)),
    # Unsupported, so right only at values that change nothing.
    "presence_penalty": field(st.sampled_from([None, 0, 0.0])),
    "frequency_penalty": field(st.sampled_from([None, 0, 0.0])),
    "logit_bias": field(st.sampled_from([None, {}])),
    # 1 is neutral beside n=1 alone, as OpenAI refuses best_of below n (test_deploy.py holds
    # both): here it would turn requests that should reach generation into 400s.
    "best_of": field(st.none()),
}
TOKEN_IDS = st.lists(st.integers(0, VOCAB_SIZE - 1), min_size=1, max_size=12)
COMPLETION = {
    "prompt": field(
        TEXT
        | st.lists(TEXT, min_size=1, max_size=3)
        | TOKEN_IDS
        | st.lists(TOKEN_IDS, min_size=1, max_size=3)
    ),
    "logprobs": field(st.none() | st.integers(0, 20)),
    "echo": field(st.none() | st.booleans()),
    "suffix": field(st.sampled_from([None, ""])),
}
TEXT_PART = st.fixed_dictionaries({"type": st.just("text"), "text": TEXT})
MESSAGE = st.fixed_dictionaries(
    {"role": field(st.sampled_from(["system", "user", "assistant", "developer", "tool"]))},
    optional={"content": field(TEXT | st.none() | st.lists(TEXT_PART, max_size=2)), "name": TEXT},
)
CHAT = {
    "messages": field(st.lists(MESSAGE, min_size=1, max_size=3)),
    "max_completion_tokens": field(st.integers(1, 6)),
    "logprobs": field(st.none() | st.booleans()),
    "top_logprobs": field(st.none() | st.integers(0, 20)),
    "tools": field(st.sampled_from([None, []])),
    "response_format": field(st.sampled_from([None, {"type": "text"}])),
    "tool_choice": field(st.sampled_from([None, "none", "auto"])),
    "parallel_tool_calls": field(st.booleans()),
}


def request_body(fields: dict[str, st.SearchStrategy]) -> st.SearchStrategy:
    """A body that mostly names the model and the prompt, so that many get as far as
    generating; else with any field missing, or not an object at all."""
    model = field(st.just("tiny"))
    named = st.fixed_dictionaries({"model": model, **fields}, optional=SAMPLING)
    anything = st.fixed_dictionaries({}, optional={"model": model, **fields, **SAMPLING})
    return one_in(5, anything | ANY_JSON, named)


REQUESTS = st.one_of(
    st.tuples(st.just("/v1/completions"), request_body(COMPLETION)),
    st.tuples(st.just("/v1/chat/completions"), request_body(CHAT)),
)


@pytest.fixture(scope="module")
def fuzz_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    checkpoint = make_checkpoint(tmp_path_factory.mktemp("model") / "checkpoint")
    run_dir = tmp_path_factory.mktemp("outputs") / "run"
    run = make_run(run_dir, checkpoint, steps=[1], state="completed", metrics=[])
    cfg = deploy_config(
        f"checkpoint={run}",
        "served_model_name=tiny",
        "port=0",
        # Small caps keep generation short: a fuzzed request costs milliseconds, not seconds.
        "limits.max_tokens=6",
        "limits.default_max_tokens=4",
        "limits.max_n=4",
        "limits.max_body_bytes=65536",
        "allowed_hosts=[Runner.Example.]",
    )
    with serving(cfg) as url:
        yield url


def test_every_fuzzed_request_gets_a_2xx_or_a_well_formed_4xx(fuzz_url: str, capsys) -> None:
    counts: Counter[str] = Counter()

    @settings(
        max_examples=MAX_EXAMPLES,
        derandomize=True,
        database=None,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(request=REQUESTS)
    def send(request: tuple[str, object]) -> None:
        path, body = request
        # json.dumps writes nan and inf as NaN and Infinity, which are not JSON but Python reads.
        status, headers, payload = raw_request(
            fuzz_url, "POST", path, json.dumps(body).encode(), key=None
        )
        counts["requests"] += 1
        counts[f"{status // 100}xx"] += 1
        assert status < 500, (status, payload)
        if status >= 400:
            error = json.loads(payload)["error"]
            assert isinstance(error["message"], str) and error["message"], payload
            assert error["type"] == "invalid_request_error", payload
        elif headers["content-type"].startswith("text/event-stream"):
            check_stream(payload)
        else:
            choices = json.loads(payload)["choices"]
            assert [choice["index"] for choice in choices] == list(range(len(choices))), payload
            assert all(choice["finish_reason"] for choice in choices), payload

    try:
        send()  # a dropped connection raises here, as a 5xx fails an assertion
    finally:
        with capsys.disabled():
            summary = ", ".join(f"{key} {counts[key]}" for key in ("requests", "2xx", "4xx", "5xx"))
            print(f"\nschema fuzz of runner deploy: {summary}")
    # The fuzz reaches generation too: from 46 to 84 of its 600 requests on the trees and
    # suites tried (the constants above); the floor only says that it is not nearly none.
    assert counts["2xx"] > MAX_EXAMPLES // 30, counts
    assert counts["4xx"] > MAX_EXAMPLES // 10, counts


@pytest.mark.parametrize(
    "content_type",
    [
        "text/plain",  # what a web page's fetch() sends without a CORS preflight
        "text/plain; charset=utf-8",
        "application/x-www-form-urlencoded",  # an HTML form, and curl -d
        "multipart/form-data; boundary=x",
        None,
    ],
)
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_body_not_declared_json_is_a_415(fuzz_url: str, path: str, content_type) -> None:
    body = {"model": "tiny", "prompt": "hi", "messages": [{"role": "user", "content": "hi"}]}
    status, payload = post(fuzz_url, path, json.dumps(body).encode(), content_type)
    assert status == 415, payload
    error = json.loads(payload)["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == "unsupported_media_type"
    assert "Content-Type: application/json" in error["message"]


@pytest.mark.parametrize("content_type", ["application/json; charset=utf-8", "Application/JSON"])
def test_json_with_parameters_or_in_capitals_is_served(fuzz_url: str, content_type) -> None:
    body = json.dumps({"model": "tiny", "prompt": "hi", "max_tokens": 2}).encode()
    status, payload = post(fuzz_url, "/v1/completions", body, content_type)
    assert status == 200, payload
    assert json.loads(payload)["choices"][0]["finish_reason"]


@pytest.mark.parametrize(
    ("host", "status"),
    [
        ("evil.example:{port}", 400),  # a page's own name, resolved again to 127.0.0.1
        ("evil.example", 400),
        ("127.0.0.1.evil.example", 400),
        ("", 400),
        ("127.0.0.1:{port}", 200),
        ("localhost:{port}", 200),
        ("LOCALHOST", 200),
        ("[::1]:{port}", 200),
        ("runner.example:{port}", 200),  # in allowed_hosts
        # An address is no name to resolve again: another machine, or a container, reaching a
        # server on 0.0.0.0 by its address (it was refused, the machine's own address too).
        ("192.0.2.7:{port}", 200),
        ("[2001:db8::7]:{port}", 200),
        ("192.0.2.7.nip.io", 400),
    ],
)
def test_without_an_api_key_the_host_must_name_the_server(
    fuzz_url: str, host: str, status: int
) -> None:
    """DNS rebinding: a web page's requests reach 127.0.0.1 under the page's own name."""
    port = fuzz_url.rpartition(":")[2]
    body = json.dumps({"model": "tiny", "prompt": "hi", "max_tokens": 1}).encode()
    header = host.format(port=port)
    answer = raw_request(fuzz_url, "POST", "/v1/completions", body, key=None, host_header=header)
    assert answer[0] == status, answer
    if status == 400:
        error = json.loads(answer[2])["error"]
        assert error["code"] == "invalid_host" and "allowed_hosts=[<name>]" in error["message"]
        assert raw_request(fuzz_url, "GET", "/v1/models", key=None, host_header=header)[0] == 400
        # Liveness probes call a pod by its address.
        assert raw_request(fuzz_url, "GET", "/health", key=None, host_header=header)[0] == 200


def post(base_url: str, path: str, body: bytes, content_type: str | None) -> tuple[int, bytes]:
    """Status and body of a POST with this Content-Type (None: no such header)."""
    host, port = base_url.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=30)
    headers = {} if content_type is None else {"Content-Type": content_type}
    connection.request("POST", path, body=body, headers=headers)
    response = connection.getresponse()
    payload = response.read()
    connection.close()
    return response.status, payload


def check_stream(payload: bytes) -> None:
    """Server-sent events that end in [DONE], carry no error, and finish each choice once."""
    events = payload.decode().split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""], payload
    finished: Counter[int] = Counter()
    seen = set()
    for event in events[:-2]:
        chunk = json.loads(event.removeprefix("data: "))
        assert "error" not in chunk, payload
        for choice in chunk["choices"]:
            seen.add(choice["index"])
            finished[choice["index"]] += choice["finish_reason"] is not None
    assert seen == set(range(len(seen))), payload
    assert all(finished[index] == 1 for index in seen), payload
