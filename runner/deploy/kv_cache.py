"""The running batch's KV cache, in buffers whose addresses stay put while rows join and leave.

Every layer's keys live in one buffer [layers, rows, heads, tokens, head_dim] allocated ahead,
and its values in another (rows and tokens grow by doubling, which is the only reallocation), so
that a step indexes the layer as a number it can be given symbolically: one compiled decoder
layer serves them all (decode_step.py). The attention mask, the
next input ids and their positions live in buffers beside them. Sequences are right-aligned:
every running row writes its next token into the same column, `end`, with its left padding
masked out; a row that leaves gives its place to one of the last rows, so that the rest stay
where they are. A decode step writes in place (index_put_ at a device-side column) and attends
a window [0, width) of the first `rows` rows, so the same step at the same (rows, width) touches
the same memory every time: on CUDA it is captured once in a CUDA graph and replayed. On the
CPU the window is exactly the running rows and tokens; on CUDA it is rounded up to a bucket
(powers of two) so that a few graphs cover every batch.
"""

from __future__ import annotations

import inspect
import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from transformers import Cache, DynamicLayer, PreTrainedModel

from runner.devices import to_device
from runner.errors import UserError

if TYPE_CHECKING:
    from transformers import DynamicCache

# The fewest tokens a buffer (and a CUDA graph's window) holds.
MIN_TOKENS = 64
# The share of a step's window that dropping the columns every row has left behind must save
# before BatchCache drops them (moving every row): below it, the steps read a few dead columns
# rather than copy the cache. Padded, windows come in powers of two, so that is when the bucket
# shrinks, or when the window would otherwise double.
TRIM_SHARE = 0.25
# Numbers each allocation of buffers, across caches: a captured step is valid for one only.
_ALLOCATIONS = itertools.count(1)


def bucket(count: int, minimum: int = 1) -> int:
    """The power of two at or above `count` (and `minimum`): the sizes CUDA graphs are kept for."""
    return 1 << (max(count, minimum) - 1).bit_length()


def grown(
    capacity: tuple[int, int], rows: int, tokens: int, *, padded: bool, compiled: bool
) -> tuple[int, int]:
    """The buffers' (rows, tokens) capacity once they make room for `rows` rows and `tokens`
    tokens (a padded window included): as it is while they fit, else the power of two at or
    above the need in the dimension that grew (capacities never shrink, and being powers of
    two, each growth at least doubles them). `compiled`: a column past the widest window
    (BatchCache's docstring)."""
    row_capacity, token_capacity = capacity
    if padded:
        rows, tokens = bucket(rows), bucket(tokens, MIN_TOKENS)
    spare = 1 if compiled else 0
    if rows > row_capacity or tokens + spare > token_capacity:
        return max(bucket(rows), row_capacity), max(
            bucket(tokens + spare, MIN_TOKENS), token_capacity
        )
    return capacity


def token_bytes(cache: Cache) -> int:
    """The bytes one token of one row takes in every layer's keys and values of `cache` (a
    prefill's), as BatchCache's buffers hold them."""
    layers = [_keys_and_values(layer) for layer in cache.layers]
    return sum(
        keys.shape[1] * keys.shape[3] * keys.element_size()
        + values.shape[1] * values.shape[3] * values.element_size()
        for keys, values in layers
    )


@dataclass(frozen=True)
class Prefilled:
    """What a prefill wrote: the KV cache of each prompt's prefix (all but its last token), in
    row `rows[i]` from column `starts[i]`, `lengths[i]` tokens."""

    cache: DynamicCache
    rows: list[int]
    starts: list[int]
    lengths: list[int]


@dataclass(frozen=True)
class PrefixTokens:
    """Every prefix token's sequence, row, column and offset in its sequence."""

    sequences: torch.Tensor
    rows: torch.Tensor
    columns: torch.Tensor
    offsets: torch.Tensor


def prefix_tokens(rows: list[int], starts: list[int], lengths: list[int]) -> PrefixTokens:
    """Where each prefix token lies, from each prefix's row, first column and length."""
    counts = torch.tensor(lengths, dtype=torch.long)
    sequences = torch.repeat_interleave(torch.arange(len(lengths)), counts)
    firsts = torch.cumsum(counts, 0) - counts
    offsets = torch.arange(int(counts.sum())) - firsts[sequences]
    columns = torch.tensor(starts, dtype=torch.long)[sequences] + offsets
    return PrefixTokens(
        sequences, torch.tensor(rows, dtype=torch.long)[sequences], columns, offsets
    )


@dataclass
class Window:
    """What the next decode step reads: the first `rows` rows and `width` tokens of the buffers.

    `write_at` is `end` on the device, so that a captured step reads it where it is.
    """

    rows: int
    width: int
    write_at: torch.Tensor


class BatchLayer(DynamicLayer):
    """One layer of the batch: views of its keys and values in the stacked buffers, which the
    batch writes (BatchCache.update), and the window the next step reads."""

    def __init__(self, window: Window, keys: torch.Tensor, values: torch.Tensor) -> None:
        super().__init__()
        self.dtype, self.device, self.is_initialized = keys.dtype, keys.device, True
        self._window = window
        self.keys, self.values = keys, values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """The mask spans the window; the query sits at `write_at` within it."""
        return self._window.width, 0

    def get_seq_length(self) -> Any:
        """Where the query sits (a device tensor, so a captured step needs no host value)."""
        return self._window.write_at


class BatchCache(Cache):
    """The running batch: the KV buffers, the mask, ids and positions, and where rows end.

    `rows` sequences are running, right-aligned so that each writes its next token at `end`.
    """

    key_stack: torch.Tensor  # [layers, rows, heads, tokens, head_dim]
    value_stack: torch.Tensor
    mask: torch.Tensor  # [rows, tokens]: which columns each row attends
    ids: torch.Tensor  # [rows, 1]: each row's next input token
    positions: torch.Tensor  # [rows, 1]: that token's position in its sequence

    def __init__(self, prefilled: Cache, *, padded: bool, compiled: bool = False) -> None:
        """A batch holding what a prefill wrote into an ordinary DynamicCache; `padded` rounds
        each step's window up to a bucket, as CUDA graphs need; `compiled`: the step is
        compiled, and every window stays narrower than the buffers (a window as wide as its
        buffer is a case the compiled step specializes, and it would compile again)."""
        layers = [_keys_and_values(layer) for layer in prefilled.layers]
        keys, values = layers[0]
        shapes = {(k.shape[1], k.shape[3], v.shape[1], v.shape[3], k.dtype) for k, v in layers}
        if len(shapes) > 1:
            raise UserError(
                "engine",
                "transformers",
                "the model's layers cache keys and values of different shapes, which this "
                "engine's stacked buffers do not hold: serve it with engine=vllm",
            )
        self.padded, self.compiled, self.device = padded, compiled, keys.device
        self.rows, self.end = 0, 0
        # Each running row's tokens in the buffers (its `positions`, kept on the host too): the
        # row holds columns [end - length, end), so that what every row has left behind is
        # known without reading the mask back from the device.
        self.lengths: list[int] = []
        self.window = Window(0, 0, torch.zeros(1, dtype=torch.long, device=self.device))
        # What the buffers are made like (no storage: the prefill's tensors are not kept).
        self._like = (len(layers), keys.new_empty(0), values.new_empty(0), keys.shape, values.shape)
        self._layer_numbers = torch.arange(len(layers), device=self.device)
        self.allocation = 0  # renumbered on each reallocation: captured steps hold old addresses
        # Room for the prefill's rows and their next token, as append_rows reserves it.
        first = grown((0, 0), keys.shape[0], keys.shape[2] + 1, padded=padded, compiled=compiled)
        self._allocate(*first)
        super().__init__(layers=self.layers)

    def _allocate(self, row_capacity: int, token_capacity: int) -> None:
        """Buffers of the given capacity holding what the current ones hold."""
        count, keys, values, key_shape, value_shape = self._like
        rows, tokens = slice(0, self.rows), slice(0, self.end)
        heads, key_dim, value_dim = key_shape[1], key_shape[3], value_shape[3]
        key_stack = keys.new_zeros(count, row_capacity, heads, token_capacity, key_dim)
        value_stack = values.new_zeros(count, row_capacity, heads, token_capacity, value_dim)
        mask = torch.zeros(row_capacity, token_capacity, dtype=torch.bool, device=self.device)
        ids = torch.zeros(row_capacity, 1, dtype=torch.long, device=self.device)
        positions = torch.zeros(row_capacity, 1, dtype=torch.long, device=self.device)
        if hasattr(self, "key_stack"):
            key_stack[:, rows, :, tokens] = self.key_stack[:, rows, :, tokens]
            value_stack[:, rows, :, tokens] = self.value_stack[:, rows, :, tokens]
            mask[rows, tokens] = self.mask[rows, tokens]
            ids[rows], positions[rows] = self.ids[rows], self.positions[rows]
        self.key_stack, self.value_stack = key_stack, value_stack
        self.mask, self.ids, self.positions = mask, ids, positions
        self._views = [(key_stack[index], value_stack[index]) for index in range(count)]
        self.layers = [BatchLayer(self.window, keys, values) for keys, values in self._views]
        self.allocation = next(_ALLOCATIONS)

    def update(
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        layer_idx: int,
        *args: Any,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write layer `layer_idx`'s token of the step at column `end` of each row; return the
        window's keys and values of that layer. Compiled, the layer is an index into the
        stacked buffers, not into a list, so that it can be a symbolic number (decode_step.py)."""
        rows, width = self.window.rows, self.window.width
        at = (
            torch.arange(rows, device=self.device)[:, None],
            torch.arange(self.key_stack.shape[2], device=self.device)[None, :],
            self.window.write_at,
        )
        if not torch.compiler.is_compiling():  # eager: into the layer's views, 3 us a call less
            keys, values = self._views[layer_idx]
            keys.index_put_(at, key_states[:, :, 0])
            values.index_put_(at, value_states[:, :, 0])
            return keys[:rows, :, :width], values[:rows, :, :width]
        # Into the buffers themselves, not a view of them: compiled, a write into a view of a
        # graph input is replayed as a copy of the whole view (the window's every key, twice).
        stacked = (self._layer_numbers[layer_idx], *at)  # a view: no kernel makes the index
        self.key_stack.index_put_(stacked, key_states[:, :, 0])
        self.value_stack.index_put_(stacked, value_states[:, :, 0])
        keys = self.key_stack.select(0, layer_idx)[:rows, :, :width]
        return keys, self.value_stack.select(0, layer_idx)[:rows, :, :width]

    @property
    def capacity(self) -> tuple[int, int]:
        """The buffers' (rows, tokens)."""
        return tuple(self.mask.shape)  # type: ignore[return-value]

    @property
    def nbytes(self) -> int:
        """The bytes of the buffers' keys and values."""
        return self.key_stack.nbytes + self.value_stack.nbytes

    def _reserve(self, rows: int, tokens: int) -> None:
        """Make room for `rows` rows and `tokens` tokens (a padded window included)."""
        capacity = grown(self.capacity, rows, tokens, padded=self.padded, compiled=self.compiled)
        if capacity != self.capacity:
            self._allocate(*capacity)

    def append_rows(self, prefilled: Prefilled, last_ids: list[int]) -> None:
        """Add sequences after the running ones: their prompts' prefixes as a prefill wrote
        them, and each prompt's last token as the row's next input (the next decode step reads
        it and gives the first new token)."""
        count, lengths = len(last_ids), prefilled.lengths
        shift = max(max(lengths) - self.end, 0)
        self._reserve(self.rows + count, self.end + shift + 1)
        if shift and self.rows:  # the new rows are longer: move the running ones right
            self._shift(slice(0, self.end), shift)
        self.end += shift
        new = slice(self.rows, self.rows + count)
        self.mask[new] = False
        # Every prefix token from its place in the prefill to its row's columns before `end`.
        tokens = prefix_tokens(prefilled.rows, prefilled.starts, lengths)
        source_rows = to_device(tokens.rows, self.device)
        source_columns = to_device(tokens.columns, self.device)
        counts = torch.tensor(lengths, dtype=torch.long)
        rows = to_device(self.rows + tokens.sequences, self.device)
        columns = to_device(self.end - counts[tokens.sequences] + tokens.offsets, self.device)
        for index, prefilled_layer in enumerate(prefilled.cache.layers):
            keys, values = _keys_and_values(prefilled_layer)
            self.key_stack[index, rows, :, columns] = keys[source_rows, :, source_columns]
            self.value_stack[index, rows, :, columns] = values[source_rows, :, source_columns]
        self.mask[rows, columns] = True
        self.ids[new, 0] = to_device(torch.tensor(last_ids, dtype=torch.long), self.device)
        self.positions[new, 0] = to_device(counts, self.device)
        self.lengths += lengths
        self.rows += count

    def select_rows(self, keep: list[int]) -> list[int]:
        """Keep only the rows in `keep` (ascending) and return their new order: the old row at
        each new place. A kept row stays where it is unless it lies past the kept count; those
        fill the places of the rows that left, so only they are copied (unless the columns
        left behind are dropped, `_trimmed`)."""
        count, kept = len(keep), set(keep)
        movers = iter(row for row in keep if row >= count)
        order = [row if row in kept else next(movers) for row in range(count)]
        if not self._trimmed(order):
            moved = [new for new, old in enumerate(order) if new != old]
            if moved:
                places = to_device(torch.tensor(moved), self.device)
                sources = to_device(torch.tensor([order[new] for new in moved]), self.device)
                self._gather(sources, places, slice(0, self.end))
        self.lengths = [self.lengths[old] for old in order]
        self.rows = count
        return order

    def _trimmed(self, sources: list[int]) -> bool:
        """Move rows `sources` to the first rows without the leading columns that are padding
        in all of them, if that narrows the step's window by TRIM_SHARE or more (a copy of
        every row, which the narrower steps after it repay); whether it did. The rows' lengths
        say where they begin: no read of the device (which would wait for its queued steps)."""
        dead = min((self.end - self.lengths[row] for row in sources), default=0)
        if dead >= self.end:  # no row holds a token yet: nothing to drop
            dead = 0
        if not dead or self._width(self.end - dead) > (1 - TRIM_SHARE) * self._width(self.end):
            return False
        count = len(sources)
        index = to_device(torch.tensor(sources), self.device)
        self._gather(index, slice(0, count), slice(dead, self.end))
        self.end -= dead
        self.mask[:count, self.end :] = False
        return True

    def _gather(self, sources: torch.Tensor, places: Any, columns: slice) -> None:
        """Copy rows `sources`, columns `columns`, to rows `places` from column 0."""
        width = columns.stop - columns.start
        self.key_stack[:, places, :, :width] = self.key_stack[:, sources, :, columns]
        self.value_stack[:, places, :, :width] = self.value_stack[:, sources, :, columns]
        self.mask[places, :width] = self.mask[sources, columns]
        self.ids[places], self.positions[places] = self.ids[sources], self.positions[sources]

    def next_window(self) -> Window:
        """Open column `end` for the next token and size the step's window over it. Padded, a
        window about to double first drops the columns every row has left behind, if any."""
        if self.padded and self.rows and self._width(self.end) > self._width(self.end - 1):
            self._trimmed(list(range(self.rows)))  # each row stays in its place
        self._reserve(self.rows, self.end + 1)
        self.window.rows = bucket(self.rows) if self.padded else self.rows
        self.window.width = self._width(self.end)
        # Padding rows attend their own token too: a row that attends nothing gives nan, and a
        # nan left in the buffer would poison the row that takes its place (0 * nan is nan).
        self.mask[: self.window.rows, self.end] = True
        self.window.write_at.fill_(self.end)
        return self.window

    def _width(self, end: int) -> int:
        """The width of a step's window that writes column `end`: a bucket when padded."""
        return bucket(end + 1, MIN_TOKENS) if self.padded else end + 1

    def advance(self, next_ids: torch.Tensor) -> None:
        """After a step: its tokens are the next inputs, one position on, one column on."""
        self.ids[: self.rows, 0] = next_ids
        self.positions[: self.rows] += 1
        self.lengths = [length + 1 for length in self.lengths]
        self.end += 1

    def clear(self) -> None:
        """Empty the batch, keeping the buffers (and with them the steps captured over them)."""
        self.rows, self.end, self.lengths = 0, 0, []

    def _shift(self, columns: slice, by: int) -> None:
        moved = slice(columns.start + by, columns.stop + by)
        rows = slice(0, self.rows)
        self.key_stack[:, rows, :, moved] = self.key_stack[:, rows, :, columns].clone()
        self.value_stack[:, rows, :, moved] = self.value_stack[:, rows, :, columns].clone()
        self.mask[rows, moved] = self.mask[rows, columns].clone()
        self.mask[rows, : moved.start] = False


def _keys_and_values(layer: object) -> tuple[torch.Tensor, torch.Tensor]:
    """What a prefill's layer holds; check_supported let through only models whose every layer
    caches attention keys and values."""
    assert isinstance(layer, DynamicLayer) and layer.keys is not None and layer.values is not None
    return layer.keys, layer.values


def cache_keyword(model: PreTrainedModel) -> str:
    """The name under which the model's forward takes a KV cache: `cache` in transformers 5.24
    and later (which warns at the old name and drops it in 5.40), `past_key_values` before."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def check_supported(model: PreTrainedModel) -> None:
    """Refuse models whose cache holds more than keys and values of attention (linear attention,
    state-space layers): BatchLayer holds full attention, and sliding-window attention as full
    attention under the model's sliding-window mask."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicSlidingWindowLayer

    kinds = (DynamicLayer, DynamicSlidingWindowLayer)
    if any(type(layer) not in kinds for layer in DynamicCache(config=model.config).layers):
        raise UserError(
            "engine",
            "transformers",
            f"{type(model).__name__} keeps a cache other than attention keys and values, "
            "which this engine does not batch: serve it with engine=vllm",
        )
