"""KV caches between stages and inside the decode batch.

A request's cache travels as ONE contiguous tensor [layers, 2, kv_heads, tokens, head_dim]
so each transport moves a single buffer. Inside a decode worker the running batch keeps
one left-padded [batch, kv_heads, tokens, head_dim] tensor per layer and key/value plus a
[batch, tokens] validity mask; requests join and leave by re-padding between steps.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

SPARE_SLOTS = 64  # decode steps a slab absorbs before it must grow (and copy)


class _SlabLayer(DynamicLayer):
    """A cache layer in a buffer with spare slots: a decode step writes its column in place,
    where the stock layer would concatenate (copy) the whole cache every step."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor):
        super().__init__()
        self.dtype, self.device, self.is_initialized = keys.dtype, keys.device, True
        self._length = keys.shape[-2]
        self._k, self._v = self._alloc(keys), self._alloc(values)
        self._expose()

    def _alloc(self, t: torch.Tensor) -> torch.Tensor:
        buf = t.new_zeros(*t.shape[:-2], t.shape[-2] + SPARE_SLOTS, t.shape[-1])
        buf[:, :, : t.shape[-2]] = t
        return buf

    def _expose(self) -> None:
        self.keys, self.values = self._k[:, :, : self._length], self._v[:, :, : self._length]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        n = key_states.shape[-2]
        if self._length + n > self._k.shape[-2]:
            self._k, self._v = self._alloc(self.keys), self._alloc(self.values)
        self._k[:, :, self._length : self._length + n] = key_states
        self._v[:, :, self._length : self._length + n] = value_states
        self._length += n
        self._expose()
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self._length


def bytes_per_token(text_config, dtype_bytes: int) -> int:
    """KV bytes one token takes in every layer: layers x (key + value) x kv heads x head dim x
    dtype size, from the language model's config (what `pack` gives per token)."""
    head_dim = getattr(text_config, "head_dim", None) or text_config.hidden_size // text_config.num_attention_heads
    kv_heads = getattr(text_config, "num_key_value_heads", None) or text_config.num_attention_heads
    return text_config.num_hidden_layers * 2 * kv_heads * head_dim * dtype_bytes


def packed_bytes_per_token(packed: torch.Tensor) -> int:
    """The same figure read off a packed cache [layers, 2, kv_heads, tokens, head_dim]."""
    return packed.numel() * packed.element_size() // max(packed.shape[-2], 1)


def sequence_bytes(per_token: int, num_prompt_tokens: int, max_tokens: int, max_model_len: int) -> int:
    """The most KV a sequence can come to hold: its prompt plus every token it may generate."""
    return per_token * min(num_prompt_tokens + max_tokens, max_model_len)


def pack(cache: DynamicCache) -> torch.Tensor:
    """One request's cache (batch 1) as a single contiguous tensor."""
    layers = [torch.stack((layer.keys[0], layer.values[0])) for layer in cache.layers]
    return torch.stack(layers).contiguous()


def unpack(packed: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per-layer (key, value), each [1, kv_heads, tokens, head_dim]."""
    return [(layer[0].unsqueeze(0), layer[1].unsqueeze(0)) for layer in packed]


def _left_pad(t: torch.Tensor, num_tokens: int) -> torch.Tensor:
    pad = num_tokens - t.shape[-2]
    if pad == 0:
        return t
    zeros = t.new_zeros(*t.shape[:-2], pad, t.shape[-1])
    return torch.cat((zeros, t), dim=-2)


class BatchedKV:
    """The decode batch's cache: rows are requests, columns are token slots (left-padded)."""

    def __init__(self) -> None:
        self._cache = DynamicCache()
        self.mask = torch.zeros(0, 0, dtype=torch.long)

    @property
    def layers(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(layer.keys, layer.values) for layer in self._cache.layers]

    @layers.setter
    def layers(self, layers: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self._cache = DynamicCache()
        self._cache.layers = [_SlabLayer(k, v) for k, v in layers]

    @property
    def num_rows(self) -> int:
        return self.mask.shape[0]

    @property
    def num_slots(self) -> int:
        return self.mask.shape[1]

    def join(self, packed: torch.Tensor) -> None:
        """Append one request's cache as a new last row."""
        new = unpack(packed)
        new_len = new[0][0].shape[-2]
        width = max(self.num_slots, new_len)
        dev = packed.device
        row_mask = torch.cat((torch.zeros(width - new_len, dtype=torch.long, device=dev), torch.ones(new_len, dtype=torch.long, device=dev)))
        if self.num_rows == 0:
            self.layers = [(_left_pad(k, width), _left_pad(v, width)) for k, v in new]
            self.mask = row_mask.unsqueeze(0)
            return
        self.layers = [
            (torch.cat((_left_pad(k, width), _left_pad(nk, width))), torch.cat((_left_pad(v, width), _left_pad(nv, width))))
            for (k, v), (nk, nv) in zip(self.layers, new)
        ]
        old_mask = torch.cat((self.mask.new_zeros(self.num_rows, width - self.num_slots), self.mask), dim=1)
        self.mask = torch.cat((old_mask, row_mask.unsqueeze(0)))

    def keep(self, rows: list[int]) -> None:
        """Keep only these rows (in this order) and drop columns no remaining row uses."""
        index = torch.tensor(rows, dtype=torch.long, device=self.mask.device)
        mask = self.mask.index_select(0, index)
        used = mask.any(dim=0).nonzero()
        start = int(used[0]) if len(used) else mask.shape[1]
        self.mask = mask[:, start:]
        self.layers = [(k.index_select(0, index)[:, :, start:], v.index_select(0, index)[:, :, start:]) for k, v in self.layers]

    def as_cache(self) -> DynamicCache:
        """The batch's own cache object: a step's forward pass appends to it in place."""
        return self._cache

    def absorb(self, cache: DynamicCache) -> None:
        """Take back the cache after a step that appended one slot to every row."""
        if cache is not self._cache:
            self.layers = [(layer.keys, layer.values) for layer in cache.layers]
        self.mask = torch.cat((self.mask, self.mask.new_ones(self.num_rows, 1)), dim=1)

    def step_mask(self) -> torch.Tensor:
        """Attention mask for a step: existing slots plus the token being fed."""
        return torch.cat((self.mask, self.mask.new_ones(self.num_rows, 1)), dim=1)

    def lengths(self) -> torch.Tensor:
        return self.mask.sum(dim=1)


def cache_of(packed: torch.Tensor) -> DynamicCache:
    """A batch-1 cache holding `packed` (e.g. a cached prefix a prefill continues from)."""
    cache = DynamicCache()
    for i, (k, v) in enumerate(unpack(packed)):
        cache.update(k, v, i)
    return cache
