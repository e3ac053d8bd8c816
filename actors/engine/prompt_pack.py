"""Several prompts' last chunks in one forward: their new tokens side by side in one row, each
attending only to its own prompt's earlier tokens (cached prefix, earlier chunks, itself), at
its own positions.

A forward's fixed cost (every layer's kernels launched, its Python run once) is paid once for
the pack instead of once a prompt: a burst of short prompts spent most of its prefill time on
that cost one prompt at a time, and on a GPU that cost is nearly all of a short prompt's. The
pack's keys and values live in one buffer, each prompt's slots after its own past, which the
model fills in place (which chunks pack, and how many slots they may take:
router/prefill_schedule.py `num_packed`); the model must attend the whole window in every layer
with SDPA, which takes the pack's mask as is.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

from actors.engine.prompt_kv import PromptKV


@dataclass(frozen=True)
class PackPart:
    """One prompt's share: the tokens to compute, and its own cache, which holds those before
    them and takes the new ones."""

    embeds: torch.Tensor  # [1, n, hidden]
    positions: torch.Tensor  # [..., n]: 1-D or multimodal rotary
    cache: PromptKV

    @property
    def num_past(self) -> int:
        return self.cache.get_seq_length()

    @property
    def num_new(self) -> int:
        return self.embeds.shape[1]

    @property
    def past(self) -> torch.Tensor | None:
        """[layers, 2, kv_heads, past, head_dim], None before its first token."""
        return self.cache.buffer[:, :, :, : self.num_past] if self.num_past else None


def pack_mask(parts: list[PackPart], device: torch.device) -> torch.Tensor:
    """[1, 1, new tokens, all slots]: True where a new token may attend, that is its own
    prompt's slots up to its own position."""
    past = [p.num_past for p in parts]
    whole = [p.num_past + p.num_new for p in parts]
    key_prompt = torch.repeat_interleave(torch.arange(len(parts)), torch.tensor(whole))
    key_pos = torch.cat([torch.arange(n) for n in whole])
    query_prompt = torch.repeat_interleave(
        torch.arange(len(parts)), torch.tensor([p.num_new for p in parts])
    )
    query_pos = torch.cat([torch.arange(p, p + part.num_new) for p, part in zip(past, parts)])
    mask = (query_prompt[:, None] == key_prompt[None, :]) & (key_pos[None, :] <= query_pos[:, None])
    return mask[None, None].to(device)


class PackKV(DynamicCache):
    """The pack's cache: every prompt's slots, its past copied in at the first write."""

    def __init__(self, num_layers: int, parts: list[PackPart], device: torch.device):
        super().__init__()
        self.parts, self.buffer = parts, None
        self.offsets, start = [], 0
        for part in parts:
            self.offsets.append(start)
            start += part.num_past + part.num_new
        self.num_slots = start
        self.new_index = torch.cat(
            [
                torch.arange(o + p.num_past, o + p.num_past + p.num_new)
                for o, p in zip(self.offsets, parts)
            ]
        ).to(device)
        self.layers = [_PackLayer(self, i) for i in range(num_layers)]

    def allocate(self, like: torch.Tensor, heads: int, head_dim: int) -> torch.Tensor:
        if self.buffer is None:
            shape = (len(self.layers), 2, heads, self.num_slots, head_dim)
            self.buffer = torch.empty(shape, dtype=like.dtype, device=like.device)
            for offset, part in zip(self.offsets, self.parts):
                if part.past is not None:
                    self.buffer[:, :, :, offset : offset + part.num_past] = part.past
        return self.buffer

    def new_kv(self, i: int) -> torch.Tensor:
        start = self.offsets[i] + self.parts[i].num_past
        return self.buffer[:, :, :, start : start + self.parts[i].num_new]


class _PackLayer(DynamicLayer):
    def __init__(self, cache: PackKV, index: int):
        super().__init__()
        self.cache, self.index = cache, index

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        _, heads, _, head_dim = key_states.shape
        buffer = self.cache.allocate(key_states, heads, head_dim)
        buffer[self.index, 0].index_copy_(1, self.cache.new_index, key_states[0])
        buffer[self.index, 1].index_copy_(1, self.cache.new_index, value_states[0])
        self.keys = buffer[self.index, 0].unsqueeze(0)
        self.values = buffer[self.index, 1].unsqueeze(0)
        self.dtype, self.device, self.is_initialized = buffer.dtype, buffer.device, True
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return 0  # positions and the mask come with the forward, not from the cache


@torch.inference_mode()
def forward_packed(adapter, parts: list[PackPart]) -> list[torch.Tensor]:
    """One forward over every part (`adapter.full_window_layers` > 0); each part's cache then
    holds its new tokens too. Returns each part's last hidden state [1, 1, hidden], which
    samples its first token."""
    embeds = torch.cat([p.embeds for p in parts], dim=1)
    positions = torch.cat(_alike(adapter, [p.positions for p in parts]), dim=-1)
    cache = PackKV(adapter.full_window_layers, parts, embeds.device)
    hidden = adapter.forward(embeds, positions, cache, pack_mask(parts, embeds.device))
    out, end = [], 0
    for i, part in enumerate(parts):
        end += part.num_new
        part.cache.extend([cache.new_kv(i)])  # a copy: the pack's buffer is let go
        out.append(hidden[:, end - 1 : end])
    return out


def _alike(adapter, positions: list[torch.Tensor]) -> list[torch.Tensor]:
    """Plain [1, n] positions (a text-only prompt) in the form of the others' multimodal rotary
    ones where the pack has any: the same position on every axis, as in a decode step."""
    if len({p.ndim for p in positions}) == 1:
        return positions
    widest = max(p.ndim for p in positions)
    return [p if p.ndim == widest else adapter.step_positions(p) for p in positions]
