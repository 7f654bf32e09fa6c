"""The sides bench_deploy.py measures, each giving a Result, and the models they serve.

- in its own process: `generate` over static batches (`batched_generate`) and transformers'
  continuous batching (`continuous_generate`), on the model `load_baseline` loads;
- `runner deploy` in a process of its own (`start_server`), of this tree or of another source
  tree (`importable`), with its process's CPU read from /proc (`process_cpu_s`);
- the engine alone, without the server (`EngineAlone`: profile_engine.py --serve);
- the tiny model and the stand-in (`make_tiny_checkpoint`, `STAND_IN`), which profile_decode.py
  and compile_start.py build too.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from runner.paths import TINY_TOKENIZER_DIR


@dataclass
class Result:
    """One measured configuration."""

    label: str
    concurrency: int
    latencies_s: list[float]
    output_tokens: int
    wall_s: float
    busy: float | None = None  # the busiest client process's CPU over wall (HTTP sides)
    client_cpu_s: float | None = None  # the clients' CPU a request (HTTP sides)
    server_cpu_s: float | None = None  # the server's process's CPU a request (Linux)
    first_token_s: list[float] = field(default_factory=list)  # streamed requests' (HTTP sides)

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_s

    def percentile_ms(self, q: int) -> float:
        """The q-th latency percentile in milliseconds."""
        return percentile_ms(self.latencies_s, q)


def percentile_ms(seconds: list[float], q: int) -> float:
    """The q-th percentile of `seconds`, in milliseconds (statistics.quantiles, inclusive)."""
    if len(seconds) == 1:
        return seconds[0] * 1000
    return statistics.quantiles(seconds, n=100, method="inclusive")[q - 1] * 1000


# (layers, width) of the stand-in (--stand-in): its decode step of 128 rows on two CPU cores
# costs about what the 1B Llama's costs on an H100 (3-4 ms), so that the server's overhead
# weighs on a CPU as it does on the GPU. Sized by profile_decode.py --rows 128.
STAND_IN = (2, 64)


def make_tiny_checkpoint(path: Path, layers: int = 4, width: int = 128) -> Path:
    """The tiny model's architecture (or another depth and width: heads of 16) with random
    weights, saved as training saves checkpoints."""
    tokenizer = AutoTokenizer.from_pretrained(TINY_TOKENIZER_DIR)
    config = LlamaConfig(
        vocab_size=264,
        hidden_size=width,
        intermediate_size=4 * width,
        num_hidden_layers=layers,
        num_attention_heads=width // 16,
        num_key_value_heads=width // 32,
        max_position_embeddings=512,  # bench prompts (up to ~200 byte tokens) and new tokens
        rope_theta=500000.0,
        tie_word_embeddings=True,
        initializer_range=0.2,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path, safe_serialization=True)
    for file in TINY_TOKENIZER_DIR.iterdir():
        shutil.copy(file, path / file.name)
    return path


def load_baseline(checkpoint: Path, device: torch.device, dtype: torch.dtype) -> tuple[Any, Any]:
    """The model and tokenizer for the baseline, loaded as `transformers` users load them, on
    the server's device and dtype; the tokenizer pads on the left, as batched generate needs."""
    tokenizer = AutoTokenizer.from_pretrained(checkpoint, padding_side="left")
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(checkpoint, use_safetensors=True, dtype=dtype)
    model = model.to(device).eval()
    warm = tokenizer(["warm up"], return_tensors="pt").to(device)
    model.generate(**warm, max_new_tokens=4, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    return model, tokenizer


def sampling(temperature: float) -> dict[str, Any]:
    """`generate`'s arguments for greedy decoding (temperature 0) or sampling at `temperature`
    over the whole distribution, as the servers are asked."""
    if temperature == 0:
        return {"do_sample": False}
    return {"do_sample": True, "temperature": temperature, "top_p": 1.0, "top_k": 0}


def batched_generate(
    model: Any,
    tokenizer: Any,
    texts: list[str],
    max_tokens: int,
    batch_size: int,
    temperature: float = 0.0,
) -> Result:
    """The baseline: `generate` over static batches of `batch_size` prompts, greedy (or sampled
    at `temperature`); a batch's latency is each of its requests' latency. Tokens past a
    sequence's end are not counted."""
    latencies, tokens = [], 0
    start = time.perf_counter()
    with torch.inference_mode():
        for first in range(0, len(texts), batch_size):
            batch = texts[first : first + batch_size]
            inputs = tokenizer(batch, return_tensors="pt", padding=True).to(model.device)
            began = time.perf_counter()
            output = model.generate(
                **inputs,
                max_new_tokens=max_tokens,
                pad_token_id=tokenizer.pad_token_id,
                **sampling(temperature),
            )
            _synchronize(model.device)
            latencies += [time.perf_counter() - began] * len(batch)
            new = output[:, inputs["input_ids"].shape[1] :]
            tokens += sum(_generated_length(row, tokenizer) for row in new.tolist())
    wall = time.perf_counter() - start
    return Result("transformers generate", batch_size, latencies, tokens, wall)


def continuous_generate(
    model: Any,
    tokenizer: Any,
    texts: list[str],
    max_tokens: int,
    batch_size: int,
    temperature: float = 0.0,
) -> Result:
    """transformers' continuous batching (`generate_batch`) over chunks of `batch_size` prompts,
    greedy (or sampled at `temperature`); a chunk's latency is each of its requests' latency."""
    from transformers import GenerationConfig

    config = GenerationConfig(
        max_new_tokens=max_tokens,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **sampling(temperature),
    )
    latencies, tokens = [], 0
    start = time.perf_counter()
    for first in range(0, len(texts), batch_size):
        batch = [tokenizer(text)["input_ids"] for text in texts[first : first + batch_size]]
        began = time.perf_counter()
        outputs = model.generate_batch(inputs=batch, generation_config=config)
        _synchronize(model.device)
        latencies += [time.perf_counter() - began] * len(batch)
        tokens += sum(len(output.generated_tokens) for output in outputs.values())
    wall = time.perf_counter() - start
    return Result("transformers generate_batch", batch_size, latencies, tokens, wall)


def _generated_length(row: list[int], tokenizer: Any) -> int:
    """Tokens generated up to and including the first end of sequence (the rest is padding)."""
    stops = {tokenizer.eos_token_id, tokenizer.pad_token_id} - {None}
    for index, token in enumerate(row):
        if token in stops:
            return index + 1
    return len(row)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def start_server(
    checkpoint: Path, device: str, dtype: str, max_batch_size: int, *extra: str, source: Path | None
) -> tuple[subprocess.Popen, str]:
    """`runner deploy` in its own process (so client and server do not share one GIL); `source`:
    import runner from that source tree instead of this one."""
    # An absolute checkpoint: another source's server runs in that source's directory.
    command = [sys.executable, "-m", "runner", "deploy", f"checkpoint={checkpoint.resolve()}"]
    command += ["port=0", "served_model_name=bench", "max_queue=4096", "limits.max_n=1"]
    command += [f"device={device}", f"dtype={dtype}"]
    command += [f"transformers.max_batch_size={max_batch_size}", *extra]
    env = dict(os.environ)
    if source is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(source.resolve()), env.get("PYTHONPATH", "")])
    # `python -m` puts its working directory first on sys.path: run the other source from its own.
    process = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        cwd=None if source is None else source.resolve(),
    )
    said = []
    for line in process.stdout:
        said.append(line.rstrip())
        if match := re.search(r"API at (http://\S+)/v1", line):
            url = match.group(1)
            break
    else:
        # Its own last line says why (vLLM not installed, a bad override): it was dropped.
        why = next((line for line in reversed(said) if line.strip()), "")
        raise SystemExit(f"the server did not start (exit code {process.wait()}): {why}")
    # Keep reading its log (one line per request) so that a full pipe never blocks it.
    threading.Thread(target=lambda: all(process.stdout), daemon=True).start()
    # The engines start before the first answer: vLLM's compiles its model first (a minute or more).
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5):
                return process, url
        except OSError:
            time.sleep(0.1)
    process.kill()
    raise SystemExit("the server did not answer /health")


def importable(source: Path, scratch: Path) -> Path:
    """A directory from which `python -m runner` imports runner from the source tree `source`,
    its configs and recipes included. Installed, setuptools maps runner.conf and runner.recipes
    to the tree's conf/ and recipes/; an uninstalled tree lacks them, and Python would find this
    tree's installed ones instead. Here they are links beside links to the package's files."""
    root = scratch / f"source-{source.name}"
    package = root / "runner"
    package.mkdir(parents=True)
    for entry in (source / "runner").iterdir():
        (package / entry.name).symlink_to(entry.resolve())
    for name in ("conf", "recipes"):
        if (source / name).is_dir() and not (package / name).exists():
            (package / name).symlink_to((source / name).resolve())
    return root


def process_cpu_s(pid: int) -> float | None:
    """The CPU seconds process `pid` has used, all its threads (not its children: the engine's
    own process, where it has one); None where /proc does not tell (not Linux)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rpartition(")")[2].split()  # from the state on: utime and stime are 12th, 13th
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# The engine alone's label in bench_deploy.py's table and lines.
ENGINE_ALONE = "engine alone"


class EngineAlone:
    """profile_engine.py's engine, without the server: one process for the whole run, as each
    server is (loaded once, its buffers and captures kept across concurrencies), answering the
    same prompts the servers get, after a wave it does not count at each new concurrency."""

    def __init__(self, checkpoint: Path, args: argparse.Namespace, scratch: Path) -> None:
        command = [sys.executable, str(Path(__file__).with_name("profile_engine.py"))]
        command += [f"--checkpoint={checkpoint}", f"--device={args.device}"]
        command += [f"--dtype={args.dtype}", f"--concurrency={max(args.concurrency)}"]
        command += [f"--max-tokens={args.max_tokens}", f"--temperature={args.temperature}"]
        command += ["--serve", *(["--stream"] if args.client == "stream" else [])]
        self._log = (scratch / "engine_alone.log").open("w+")
        self._process = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True
        )
        self._answer()  # loaded: nothing else measured meanwhile shares the machine with that

    def _answer(self) -> dict:
        assert self._process.stdout is not None
        try:
            return json.loads(self._process.stdout.readline())
        except ValueError:
            self._log.seek(0)
            raise SystemExit(f"profile_engine.py failed:\n{self._log.read()[-3000:]}") from None

    def run(self, concurrency: int, count: int) -> Result:
        """The engine alone over the first `count` prompts, `concurrency` clients."""
        assert self._process.stdin is not None
        try:
            self._process.stdin.write(f"{concurrency} {count}\n")
            self._process.stdin.flush()
        except OSError:
            pass  # it exited: _answer reads nothing and shows its log
        run = self._answer()
        return Result(
            ENGINE_ALONE,
            concurrency,
            run["latencies_s"],
            run["tokens"],
            run["wall_s"],
            first_token_s=run["first_token_s"],
        )

    def close(self) -> None:
        if self._process.stdin is not None:
            self._process.stdin.close()
        try:
            self._process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._process.kill()
        self._log.close()
