"""The serving engine's forward passes read nothing back from the device: on a GPU each read
(a tensor's bool, item, tolist, int) waits for every kernel queued, which would undo the engine
running a step ahead of the GPU (runner/deploy/engine.py). The same Python runs on the CPU,
where the reads are counted (compute=cpu, fp32, the tiny checkpoint, SDPA attention)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.overrides import TorchFunctionMode

from runner.deploy.decode_step import DecodeStep
from runner.deploy.kv_cache import BatchCache
from runner.deploy.loading import load_checkpoint
from tests.serving import make_checkpoint

# What reads a tensor's value on the host.
READS = {"__bool__", "item", "tolist", "__int__", "__float__", "__index__"}


class HostReads(TorchFunctionMode):
    """The host reads of tensors' values made while it is active."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if getattr(func, "__name__", None) in READS:
            self.reads.append(func.__name__)
        return func(*args, **(kwargs or {}))


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory):
    path = make_checkpoint(tmp_path_factory.mktemp("model") / "checkpoint")
    loaded = load_checkpoint(path, device="cpu", dtype="fp32", max_model_len=None)
    assert loaded.model.config._attn_implementation == "sdpa"
    return loaded.model


def _counted(model, monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    """The reads of each call of the model's forward from here on (the engine's own host-side
    work around it, on host tensors, is not counted)."""
    calls: list[list[str]] = []
    forward = model.forward

    def counted(*args: Any, **kwargs: Any) -> Any:
        with HostReads() as reads:
            output = forward(*args, **kwargs)
        calls.append(reads.reads)
        return output

    monkeypatch.setattr(model, "forward", counted)
    return calls


PREFILLS = {
    "one prompt": [[5, 6, 7, 8]],
    "equal lengths": [[5, 6, 7], [8, 9, 10]],
    "shared rows": [list(range(5, 16)), [5, 6], [5, 6, 7]],
    "left-padded rows": [list(range(5, 16)), list(range(5, 15))],
}


@pytest.mark.parametrize("prompts", PREFILLS.values(), ids=PREFILLS.keys())
def test_a_prefill_and_the_decode_steps_after_it_read_nothing_from_the_device(
    model, monkeypatch, prompts: list[list[int]]
) -> None:
    step = DecodeStep(model, graphs=False)
    calls = _counted(model, monkeypatch)
    with torch.inference_mode():
        prefilled = step.prefill(prompts)
        cache = BatchCache(prefilled.cache, padded=False)
        cache.append_rows(prefilled, [prompt[-1] for prompt in prompts])
        for _ in range(3):
            logits = step(cache, cache.next_window())
            cache.advance(logits[: cache.rows].argmax(dim=-1))
    assert len(calls) == 4 and calls == [[]] * 4, calls
