"""A prefill's KV cache in one buffer sized to its prompt, written in place chunk by chunk.

HF's DynamicCache grows each layer by concatenation: every chunk of a long prompt copied the
whole cache so far, and packing it for the decode worker copied it twice more (a 2,197-token
bench-omni prompt: 38 ms of packing alone on one CPU thread). Here every layer's keys and values
are views of one [layers, 2, kv_heads, tokens, head_dim] buffer, the layout `kv.pack` gives,
so a finished prompt's packed KV is the buffer itself. For models whose every layer attends the
whole window (a sliding-window layer keeps only its window: those keep HF's own cache).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer


class PromptKV(DynamicCache):
    """One prompt's cache (batch 1) for `num_tokens` tokens over `num_layers` layers; the
    buffer is allocated at the first write, when dtype, heads and head size are known."""

    def __init__(self, num_layers: int, num_tokens: int):
        super().__init__()
        self.num_tokens = num_tokens
        self.buffer: torch.Tensor | None = None
        self.layers = [_PromptLayer(self, i) for i in range(num_layers)]

    def allocate(self, like: torch.Tensor, heads: int, head_dim: int) -> torch.Tensor:
        if self.buffer is None:
            shape = (len(self.layers), 2, heads, self.num_tokens, head_dim)
            self.buffer = torch.empty(shape, dtype=like.dtype, device=like.device)
        return self.buffer

    def extend(self, blocks: list[torch.Tensor]) -> None:
        """Append packed blocks [layers, 2, kv_heads, n, head_dim] (a cached prefix), in order.
        The layers' views are made once, at the end: made after each block, a 13-block
        prefix (bench-llava's 219 tokens, one CPU thread) took 4.4 ms against 0.8."""
        if not blocks:
            return
        buffer = self.allocate(blocks[0], blocks[0].shape[2], blocks[0].shape[4])
        end = self.layers[0].length
        for block in blocks:
            buffer[:, :, :, end : end + block.shape[3]] = block
            end += block.shape[3]
        for layer in self.layers:
            layer.advance(end)

    def packed(self) -> torch.Tensor:
        """The whole prompt's KV in `kv.pack`'s layout: the buffer itself, no copy."""
        if self.buffer is None or self.layers[0].length != self.num_tokens:
            raise ValueError("a prompt's KV is packed once all its tokens are in")
        return self.buffer


class _PromptLayer(DynamicLayer):
    """One layer as HF's attention sees it: views of the filled part of the buffer."""

    def __init__(self, cache: PromptKV, index: int):
        super().__init__()
        self.cache, self.index, self.length = cache, index, 0

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        _, heads, num_new, head_dim = key_states.shape
        buffer = self.cache.allocate(key_states, heads, head_dim)
        start, end = self.length, self.length + num_new
        buffer[self.index, 0, :, start:end] = key_states[0]
        buffer[self.index, 1, :, start:end] = value_states[0]
        self.advance(end)
        return self.keys, self.values

    def advance(self, length: int) -> None:
        buffer, self.length = self.cache.buffer, length
        self.keys = buffer[self.index, 0, :, :length].unsqueeze(0)
        self.values = buffer[self.index, 1, :, :length].unsqueeze(0)
        self.dtype, self.device, self.is_initialized = buffer.dtype, buffer.device, True

    def get_seq_length(self) -> int:
        return self.length
