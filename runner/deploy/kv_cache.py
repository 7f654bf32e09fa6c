"""The running batch's KV cache: rows join, leave and grow without copying it every step.

transformers' DynamicLayer appends each new token with torch.cat, copying the whole cache on
every decode step; with a batch of sequences that copy costs as much as the model itself. Here
each layer writes into a buffer with room to spare, and only joins, leaves and running out of
room copy. Sequences are left-padded to one length, with the padding masked out by the caller's
attention mask.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import Cache, DynamicLayer, PreTrainedModel

from runner.errors import UserError

# Tokens of room a buffer gets beyond what it holds (at least; it grows by doubling).
_MIN_ROOM = 64


class BatchLayer(DynamicLayer):
    """One layer's keys and values, [batch, heads, tokens, head_dim], in a growable buffer."""

    # Set from the first call on, unlike DynamicLayer's, which are None until its first update.
    keys: torch.Tensor
    values: torch.Tensor
    # The buffers, and the token positions [_start, _end) in them that keys and values view.
    _key_buffer: torch.Tensor
    _value_buffer: torch.Tensor
    _start: int
    _end: int

    def __init__(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        super().__init__()
        self.dtype, self.device, self.is_initialized = keys.dtype, keys.device, True
        self._store(keys, values)

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the new tokens in place after the cached ones; return all of them."""
        end = self._end + key_states.shape[-2]
        if end > self._key_buffer.shape[2]:
            self._store(self.keys, self.values)
            end = self._end + key_states.shape[-2]
        self._key_buffer[:, :, self._end : end] = key_states
        self._value_buffer[:, :, self._end : end] = value_states
        self._end = end
        self._sync_views()
        return self.keys, self.values

    def append_rows(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Add sequences (rows) after the current ones, left-padding whichever is shorter."""
        width = max(self.keys.shape[2], keys.shape[2])
        self._store(
            torch.cat([_pad_left(self.keys, width), _pad_left(keys, width)]),
            torch.cat([_pad_left(self.values, width), _pad_left(values, width)]),
        )

    def select_rows(self, index: torch.Tensor) -> None:
        """Keep only the rows in `index`, in that order."""
        self._store(self.keys[index], self.values[index])

    def drop_left(self, count: int) -> None:
        """Forget the first `count` token positions (padding in every row)."""
        self._start += count
        self._sync_views()

    def _store(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        batch, heads, length, dim = keys.shape
        room = max(length, _MIN_ROOM)
        self._key_buffer = keys.new_empty(batch, heads, length + room, dim)
        self._value_buffer = values.new_empty(batch, values.shape[1], length + room, dim)
        self._key_buffer[:, :, :length] = keys
        self._value_buffer[:, :, :length] = values
        self._start, self._end = 0, length
        self._sync_views()

    def _sync_views(self) -> None:
        self.keys = self._key_buffer[:, :, self._start : self._end]
        self.values = self._value_buffer[:, :, self._start : self._end]


class BatchCache(Cache):
    """The running batch's cache: a BatchLayer per layer, whose rows join and leave together."""

    def __init__(self, prefilled: Cache) -> None:
        """A cache holding what a prefill wrote into an ordinary DynamicCache."""
        self._batch_layers = [BatchLayer(*_keys_and_values(layer)) for layer in prefilled.layers]
        super().__init__(layers=[*self._batch_layers])

    def append_rows(self, prefilled: Cache) -> None:
        """Add the sequences of another prefill after the current ones."""
        for layer, new_layer in zip(self._batch_layers, prefilled.layers, strict=True):
            layer.append_rows(*_keys_and_values(new_layer))

    def select_rows(self, index: torch.Tensor) -> None:
        """Keep only the rows in `index`, in that order."""
        for layer in self._batch_layers:
            layer.select_rows(index)

    def drop_left(self, count: int) -> None:
        """Forget the first `count` token positions (padding in every row)."""
        for layer in self._batch_layers:
            layer.drop_left(count)


def _keys_and_values(layer: object) -> tuple[torch.Tensor, torch.Tensor]:
    """What a prefill's layer holds; check_supported let through only models whose every layer
    caches attention keys and values."""
    assert isinstance(layer, DynamicLayer) and layer.keys is not None and layer.values is not None
    return layer.keys, layer.values


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


def _pad_left(tensor: torch.Tensor, width: int) -> torch.Tensor:
    missing = width - tensor.shape[2]
    if not missing:
        return tensor
    padding = tensor.new_zeros(tensor.shape[0], tensor.shape[1], missing, tensor.shape[3])
    return torch.cat([padding, tensor], dim=2)
