"""The engine's forward passes: the prefill of new prompts, and the decode step, eager or on
CUDA captured once per window size and replayed.

A step launches a few hundred small kernels; on a GPU, launching them from Python costs more
than running them. A CUDA graph launches them all at once. It replays the captured kernels on
the same memory, which BatchCache keeps in place; its window sizes come in buckets, so a few
graphs cover every batch. On the CPU, which has no launch overhead to save, the step runs
eagerly over exactly the running rows.

Compiled (transformers.compile), torch.compile's inductor fuses the step's elementwise work
(norms, rotary embeddings, activations, residual adds) into fewer kernels, which a CUDA graph
then captures like any others. On the CUDA path (`layers`) it compiles one decoder layer, which
serves every layer (the layer's index is a symbolic number, BatchCache.update): the model
unrolled took minutes to compile (regional compilation, as PyTorch's tutorial on cold starts
calls it), and a CUDA graph replays the layers without the host's call of each. On the CPU,
where each compiled layer's call costs host time every step, it compiles the whole step. It
compiles with symbolic sizes as the engine starts (`warm_up`), so no request waits on a compile.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from transformers import (
    AttentionInterface,
    AttentionMaskInterface,
    DynamicCache,
    PreTrainedModel,
)
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

from runner.deploy.generation import TokenLogprob
from runner.deploy.kv_cache import (
    MIN_TOKENS,
    BatchCache,
    Prefilled,
    Window,
    cache_keyword,
    prefix_tokens,
)
from runner.deploy.sampling import token_logprobs
from runner.devices import to_device
from runner.errors import UserError

# The compiled step's attention (`grouped_sdpa`), by the name transformers looks it up by.
GROUPED_SDPA = "runner_grouped_sdpa"


def grouped_sdpa(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' SDPA attention, in which a decode step's one query token of each query
    head of a group attends its key head as a row of that head, compiled as eagerly.

    With grouped-query attention and a mask (SDPA's own grouped kernels on CUDA take none),
    transformers' SDPA call folds one query token's heads onto their key heads when eager
    (pack_gqa), but under torch.compile it copies every key and value once per query head of
    its group instead (repeat_kv: the whole window's, each layer, each step). Anything but that
    step (a prefill, a position bias or softcap, a per-head mask) is transformers' call as it
    is."""
    groups = getattr(module, "num_key_value_groups", 1)
    plain = kwargs.get("position_bias") is None and kwargs.get("softcap") is None
    one_token = query.shape[2] == 1 and plain
    if (
        groups == 1
        or not one_token
        or (attention_mask is not None and attention_mask.shape[1] != 1)
    ):
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    rows, heads, _, dim = query.shape
    out = F.scaled_dot_product_attention(
        query.reshape(rows, heads // groups, groups, dim),  # each key head's query heads
        key,
        value,
        attn_mask=attention_mask,  # [rows, 1, 1, width]: the same for every head and token
        dropout_p=kwargs.get("dropout", 0.0),
        scale=kwargs.get("scaling"),
    )
    return out.reshape(rows, 1, heads, out.shape[-1]), None  # [rows, tokens, heads, dim]


AttentionInterface.register(GROUPED_SDPA, grouped_sdpa)
AttentionMaskInterface.register(GROUPED_SDPA, sdpa_mask)


def packs(model: PreTrainedModel) -> bool:
    """Whether prompts may share a row under a block-diagonal mask: SDPA attention, which takes
    a custom 4D mask as it is, and no sliding window, which such a mask would override."""
    config = model.config
    text = config.get_text_config(decoder=True)
    full = all(kind == "full_attention" for kind in getattr(text, "layer_types", None) or [])
    sdpa = config._attn_implementation in ("sdpa", GROUPED_SDPA)
    return sdpa and full and getattr(text, "sliding_window", None) is None


def decoder_layers(model: PreTrainedModel) -> list[torch.nn.Module]:
    """The model's decoder layers (transformers' `get_decoder().layers`), each alike but for its
    weights and index: the region the compiled step compiles once."""
    layers = getattr(model.get_decoder(), "layers", None)
    if not isinstance(layers, torch.nn.ModuleList) or not len(layers):
        raise UserError(
            "transformers.compile",
            True,
            f"{type(model).__name__} has no list of decoder layers to compile "
            "(get_decoder().layers): set transformers.compile=false",
        )
    return list(layers)


def pack(lengths: list[int], width: int) -> tuple[list[int], list[int]]:
    """Each length's row and first column in rows of `width` columns: first fit, longest
    first (a row is at least as wide as the longest, so every one fits)."""
    rows, starts = [0] * len(lengths), [0] * len(lengths)
    used: list[int] = []  # columns taken in each row
    for index in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        length = lengths[index]
        row = next((r for r, taken in enumerate(used) if taken + length <= width), len(used))
        if row == len(used):
            used.append(0)
        rows[index], starts[index] = row, used[row]
        used[row] += length
    return rows, starts


def _padded(lengths: list[int], width: int) -> tuple[list[int], list[int]]:
    """A row each, right-aligned (left padding)."""
    return list(range(len(lengths))), [width - length for length in lengths]


# Positions of a prompt whose logprobs are taken at once (DecodeStep.prompt_logprobs): 512 rows
# of Llama 3's 128,256 logits are 256 MiB in float32.
PROMPT_LOGPROB_ROWS = 512


class DecodeStep:
    """Runs the model over the batch: a prefill of new prompts, and one decode step for every
    running row (`graphs` replays CUDA graphs, `compiled` fuses the step with inductor; with
    `layers` it compiles the model's decoder layers in place, and an eager step over the same
    model would run them compiled: it wants a model of its own)."""

    def __init__(
        self, model: PreTrainedModel, *, graphs: bool, compiled: bool = False, layers: bool = False
    ) -> None:
        """`layers`: compiled, compile each decoder layer (one compile serves them all) rather
        than the whole step (see the module's docstring)."""
        self._model = model
        self._cache_keyword = cache_keyword(model)
        self._packs = packs(model)
        self.graphs, self.compiled = graphs, compiled
        self._layers = compiled and layers
        if compiled and model.config._attn_implementation == "sdpa":
            model.set_attn_implementation(GROUPED_SDPA)
        # dynamic=True: every size symbolic from the first compile (the rows, the window, the
        # buffers' capacity), so that no later batch compiles again (warm_up); sizes of 1 are
        # still specialized. A graph per window size would pass dynamo's limit of recompiles
        # and fall back to eager; sizes made symbolic as they first change (dynamic=None) would
        # compile again as the buffers grow, while requests wait.
        if self._layers:
            for layer in decoder_layers(model):
                layer.compile(dynamic=True)
            self._step = self._forward_by_layer
        elif compiled:
            self._step = torch.compile(self._forward, dynamic=True)
        else:
            self._step = self._forward
        self._captured: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._allocation = 0  # BatchCache.allocation of the buffers the graphs were captured over
        self._pool: Any = None
        self._capture_stream: torch.cuda.Stream | None = None

    @property
    def captured(self) -> int:
        """How many window sizes have a captured graph."""
        return len(self._captured)

    def __call__(self, cache: BatchCache, window: Window) -> torch.Tensor:
        """The window's next-token logits [window.rows, vocab]."""
        if not self.graphs:
            return self._step(cache, window)
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

    def warm_up(self, *, padded: bool, context: int, rows: int) -> None:
        """Compile the step for every batch it will see before any request waits on it (a
        compiled step only). Sizes of 1 are specialized, so three graphs cover every batch: one
        row in buffers of one row, `rows` rows (the engine's most, the sizes inductor tunes
        its kernels for) in larger buffers, then one row in those. `padded`: the engine's
        windows are rounded up to buckets; `context`: the model's tokens of context."""
        if not self.compiled:
            return
        long = max(min(MIN_TOKENS + 2, context - 2), 2)  # past the first bucket of columns
        with torch.inference_mode():
            first = self.prefill([[0, 0]])
            cache = BatchCache(first.cache, padded=padded, compiled=True)
            cache.append_rows(first, [0])
            self._warm_step(cache)
            more = max(rows, 2) - 1
            cache.append_rows(self.prefill([[0] * long] * more), [0] * more)
            self._warm_step(cache)
            cache.select_rows([1])
            self._warm_step(cache)

    def _warm_step(self, cache: BatchCache) -> None:
        logits = self(cache, cache.next_window())
        cache.advance(logits[: cache.rows].argmax(dim=-1))

    def prefill(self, prompts: list[list[int]]) -> Prefilled:
        """The KV cache of each prompt but its last token, in one forward pass that computes
        no logits: the last token is the row's first input to the next decode step, whose
        logits give the first new token (so the output projection runs only where a token is
        sampled). Prompts share rows without padding where the attention allows (packed);
        otherwise each has a row, left-padded to the longest."""
        # The last tokens are first read by the decode step, which all running rows share: a
        # token the model has no embedding for must fail its own request here, not all of them.
        vocabulary = int(getattr(self._model.get_input_embeddings(), "num_embeddings", 1 << 62))
        if any(not 0 <= prompt[-1] < vocabulary for prompt in prompts):
            raise ValueError(f"a prompt's token id is outside the vocabulary (0-{vocabulary - 1})")
        lengths = [len(prompt) - 1 for prompt in prompts]
        width = max(max(lengths), 1)  # all prompts of one token: one token of padding
        shared = pack(lengths, width) if self._packs else None
        packed = shared is not None and max(shared[0]) + 1 < len(prompts)
        rows, starts = shared if shared is not None and packed else _padded(lengths, width)
        count = max(rows) + 1
        ids = torch.zeros(count, width, dtype=torch.long)
        positions = torch.zeros(count, width, dtype=torch.long)
        # The sequence each column belongs to; padding, each column alone (it attends itself).
        owner = -1 - torch.arange(width).repeat(count, 1)
        flat = prefix_tokens(rows, starts, lengths)
        ids[flat.rows, flat.columns] = torch.tensor(
            [token for prompt in prompts for token in prompt[:-1]], dtype=torch.long
        )
        positions[flat.rows, flat.columns] = flat.offsets
        owner[flat.rows, flat.columns] = flat.sequences
        # Where SDPA takes it, the mask is the 4D one it attends by (block-diagonal where rows
        # are shared; a left-padded row's padding attending itself alone): transformers would
        # read a 2D mask back from the device to see whether it may skip it (masking_utils'
        # fast_all), which on a GPU waits for every step queued. Nothing padded, no mask at
        # all: SDPA's own causal attention (the flash kernel on a GPU).
        mask: torch.Tensor | None = None
        if min(lengths) < width and self._packs:
            causal = torch.ones(width, width, dtype=torch.bool).tril()
            mask = ((owner[:, :, None] == owner[:, None, :]) & causal)[:, None]
        elif min(lengths) < width:  # the model builds its own mask (eager, sliding window)
            mask = (owner >= 0).long()
        # Full-attention layers throughout: a sliding-window layer keeps every token here, and
        # the model's own sliding-window mask (built from config.json for those layers) hides
        # what lies outside the window, so rows of any length share one left-padded cache.
        cache = DynamicCache()
        device = self._model.device
        # Compiled layers run the decode step only: a prefill's shapes and cache are others.
        with torch.compiler.set_stance("force_eager" if self._layers else "default"):
            self._model(
                input_ids=to_device(ids, device),
                attention_mask=None if mask is None else to_device(mask, device),
                position_ids=to_device(positions, device),
                use_cache=True,
                logits_to_keep=torch.empty(0, dtype=torch.long, device=device),
                **{self._cache_keyword: cache},
            )
        return Prefilled(cache, rows, starts, lengths)

    def prompt_logprobs(self, prompt: list[int], top: int) -> tuple[TokenLogprob, ...]:
        """Each prompt token's log probability given the tokens before it, and the `top` most
        likely there (the first token's: None), from one forward pass of its own beside the
        prefill, which computes no logits; the log-softmax taken PROMPT_LOGPROB_ROWS positions
        at a time, so that a long prompt's float32 copy of its logits stays bounded."""
        device = self._model.device
        with torch.compiler.set_stance("force_eager" if self._layers else "default"):
            ids = to_device(torch.tensor([prompt], dtype=torch.long), device)
            logits = self._model(input_ids=ids, use_cache=False).logits[0, :-1]
        targets = to_device(torch.tensor(prompt[1:], dtype=torch.long), device)
        found = [TokenLogprob(prompt[0], None, ())]
        for start in range(0, len(prompt) - 1, PROMPT_LOGPROB_ROWS):
            positions = list(range(start, min(start + PROMPT_LOGPROB_ROWS, len(prompt) - 1)))
            chosen, values, top_ids = token_logprobs(logits, targets, positions, top)
            for position, logprob, most_likely, ids_there in zip(
                positions, chosen.tolist(), values.tolist(), top_ids.tolist(), strict=True
            ):
                most = tuple(zip(ids_there, most_likely, strict=True))
                found.append(TokenLogprob(prompt[position + 1], logprob, most))
        return tuple(found)

    def _forward_by_layer(self, cache: BatchCache, window: Window) -> torch.Tensor:
        # The layer's index (an int on its attention module) read as a symbolic number: one
        # compiled layer for every layer, where each index would be a compile of its own, and
        # past dynamo's limit of recompiles, eager.
        with torch._dynamo.config.patch(allow_unspec_int_on_nn_module=True):
            return self._forward(cache, window)

    def _forward(self, cache: BatchCache, window: Window) -> torch.Tensor:
        rows, width = window.rows, window.width
        # Where SDPA takes it, the window's mask as the 4D one it attends by (a view of the
        # buffer): a 2D mask, transformers would read back from the device every step to see
        # whether it may skip it (the prefill's comment).
        mask = cache.mask[:rows, None, None, :width] if self._packs else cache.mask[:rows, :width]
        return self._model(
            input_ids=cache.ids[:rows],
            attention_mask=mask,
            position_ids=cache.positions[:rows],
            use_cache=True,
            **{self._cache_keyword: cache},
        ).logits[:, -1, :]

    def _capture(
        self, cache: BatchCache, window: Window
    ) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        # Warm up on a side stream first (lazy initialisation and kernel selection must not
        # happen inside the capture); the warm-up writes the same keys and values the step will.
        device = cache.ids.device
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            for _ in range(2):  # compiled: the first compiles, if these shapes are new
                self._step(cache, window)
        torch.cuda.current_stream(device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        # thread_local: the server's threads may touch CUDA meanwhile (a request's generator),
        # which the default mode ("global") would count as an error in this capture. A stream
        # of the model's device to capture on: torch's default is made once, on the device
        # current at the first capture, and shared by every later one.
        if self._capture_stream is None:
            self._capture_stream = torch.cuda.Stream(device)
        with torch.cuda.graph(
            graph, pool=self._pool, stream=self._capture_stream, capture_error_mode="thread_local"
        ):
            logits = self._step(cache, window)
        self._pool = graph.pool()
        return graph, logits
