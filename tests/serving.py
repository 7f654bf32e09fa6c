"""What the deploy tests share: a tiny checkpoint written by transformers, run directories,
deploy's config as `runner deploy` composes it, its server in a thread, plain HTTP requests, and
transformers' own greedy generate as the reference; with their module-scoped fixtures
(`tiny_checkpoint`, `served_run` holding it, `generate_reference`), which tests/conftest.py
registers for every test module."""

from __future__ import annotations

import contextlib
import http.client
import json
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from runner.deploy.serve import GRACE_S, Server, prepare
from runner.paths import CONF_DIR, TINY_TOKENIZER_DIR

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
def serving(cfg: DictConfig, grace_s: float = GRACE_S) -> Iterator[str]:
    """Run the server that `runner deploy` would run, in a thread; yield its base URL. Leaving
    the block stops it as a SIGTERM would (`grace_s`: runner.deploy.serve.Server's)."""
    app, sock = prepare(cfg)
    port = sock.getsockname()[1]
    server = Server(app, grace_s=grace_s, log_level="warning")
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


# A request that holds its row for 200 steps: greedy, "hello" runs every one of them on the tiny
# checkpoint without meeting its end-of-sequence token (sampled, about a quarter of its answers
# end within 50 tokens, and a queue's test then saw six such requests pass one at a time).
LONG_REQUEST = {"prompt": "hello", "max_tokens": 200, "temperature": 0}


def send_at_once(url: str, body: bytes, count: int) -> list[tuple[int, dict]]:
    """`count` POSTs of `body` to /v1/completions without a key, released together: the status
    and headers of each."""
    start = threading.Barrier(count)
    results: list[tuple[int, dict]] = []

    def send() -> None:
        start.wait()
        status, headers, _ = raw_request(url, "POST", "/v1/completions", body, key=None)
        results.append((status, headers))

    threads = [threading.Thread(target=send) for _ in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


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


def completion_body(**fields) -> bytes:
    """A /v1/completions body for the served model `tiny`, with `fields` over its defaults."""
    return json.dumps({"model": "tiny", "prompt": "hi", "max_tokens": 4, **fields}).encode()


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("model") / "checkpoint")


@pytest.fixture(scope="module")
def served_run(tmp_path_factory: pytest.TempPathFactory, tiny_checkpoint: Path) -> Path:
    """A completed run directory holding `tiny_checkpoint` at steps 2 and 10, and a step being
    written."""
    root = tmp_path_factory.mktemp("outputs")
    run = make_run(root / "run", tiny_checkpoint, steps=[2, 10], state="completed", metrics=[])
    (run / "checkpoints" / ".tmp-step_20").mkdir()  # being written: never served
    return run


@pytest.fixture(scope="module")
def generate_reference(tiny_checkpoint: Path):
    """Greedy continuations from transformers' own generate on `tiny_checkpoint` (which every
    run directory above serves)."""
    return greedy_reference(tiny_checkpoint)
