"""KV caches between stages and inside the decode batch.

A request's cache travels as ONE contiguous tensor [layers, 2, kv_heads, tokens, head_dim]
so each transport moves a single buffer. Inside a decode worker the running batch keeps
one left-padded [batch, kv_heads, tokens, head_dim] tensor per layer and key/value plus a
[batch, tokens] validity mask; requests join and leave by re-padding between steps.
"""
from __future__ import annotations

import torch
from transformers.cache_utils import DynamicCache


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
        self.layers: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.mask = torch.zeros(0, 0, dtype=torch.long)

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
        return DynamicCache(ddp_cache_data=self.layers)

    def absorb(self, cache: DynamicCache) -> None:
        """Take back the cache after a step that appended one slot to every row."""
        self.layers = [(layer.keys, layer.values) for layer in cache.layers]
        self.mask = torch.cat((self.mask, self.mask.new_ones(self.num_rows, 1)), dim=1)

    def step_mask(self) -> torch.Tensor:
        """Attention mask for a step: existing slots plus the token being fed."""
        return torch.cat((self.mask, self.mask.new_ones(self.num_rows, 1)), dim=1)

    def lengths(self) -> torch.Tensor:
        return self.mask.sum(dim=1)
