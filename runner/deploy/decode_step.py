"""The engine's forward passes: the prefill of new prompts, and the decode step, eager or on
CUDA captured once per window size and replayed.

A step launches a few hundred small kernels; on a GPU, launching them from Python costs more
than running them. A CUDA graph launches them all at once. It replays the captured kernels on
the same memory, which BatchCache keeps in place; its window sizes come in buckets, so a few
graphs cover every batch. On the CPU, which has no launch overhead to save, the step runs
eagerly over exactly the running rows.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import DynamicCache, PreTrainedModel

from runner.deploy.kv_cache import BatchCache, Window, cache_keyword


class DecodeStep:
    """Runs the model over the batch: a prefill of new prompts, and one decode step for every
    running row (`graphs` replays CUDA graphs)."""

    def __init__(self, model: PreTrainedModel, *, graphs: bool) -> None:
        self._model = model
        self._cache_keyword = cache_keyword(model)
        self.graphs = graphs
        self._captured: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._allocation = 0  # BatchCache.allocation of the buffers the graphs were captured over
        self._pool: Any = None

    @property
    def captured(self) -> int:
        """How many window sizes have a captured graph."""
        return len(self._captured)

    def __call__(self, cache: BatchCache, window: Window) -> torch.Tensor:
        """The window's next-token logits [window.rows, vocab]."""
        if not self.graphs:
            return self._forward(cache, window)
        if cache.allocation != self._allocation:  # the graphs hold the old buffers' addresses
            # Their memory pool goes with them: a pool whose graphs are all gone is released,
            # and capturing into its handle again breaks the caching allocator's count of it.
            self._captured.clear()
            self._pool = None
            self._allocation = cache.allocation
        key = (window.rows, window.width)
        if key not in self._captured:
            self._captured[key] = self._capture(cache, window)
        graph, logits = self._captured[key]
        graph.replay()
        return logits

    def prefill(
        self, input_ids: torch.Tensor, mask: torch.Tensor
    ) -> tuple[DynamicCache, torch.Tensor]:
        """Left-padded prompts (`mask` 0 on the padding) in one forward pass: the KV cache it
        wrote, and each row's next-token logits [rows, vocab]."""
        # Full-attention layers throughout: a sliding-window layer keeps every token here, and
        # the model's own sliding-window mask (built from config.json for those layers) hides
        # what lies outside the window, so rows of any length share one left-padded cache.
        cache = DynamicCache()
        logits = self._model(
            input_ids=input_ids,
            attention_mask=mask,
            position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
            use_cache=True,
            logits_to_keep=1,
            **{self._cache_keyword: cache},
        ).logits[:, -1, :]
        return cache, logits

    def _forward(self, cache: BatchCache, window: Window) -> torch.Tensor:
        rows, width = window.rows, window.width
        return self._model(
            input_ids=cache.ids[:rows],
            attention_mask=cache.mask[:rows, :width],
            position_ids=cache.positions[:rows],
            use_cache=True,
            **{self._cache_keyword: cache},
        ).logits[:, -1, :]

    def _capture(
        self, cache: BatchCache, window: Window
    ) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        # Warm up on a side stream first (lazy initialisation and kernel selection must not
        # happen inside the capture); the warm-up writes the same keys and values the step will.
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._forward(cache, window)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        # thread_local: the server's threads may touch CUDA meanwhile (a request's generator),
        # which the default mode ("global") would count as an error in this capture.
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            logits = self._forward(cache, window)
        self._pool = graph.pool()
        return graph, logits
