"""All language-model device work: prefill (splice + chunked forward) and one batched decode step.

The actors around this module only queue, batch and move data; everything here is plain
torch on one device, so it can be driven directly by tests and benchmarks.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicCache

from actors.engine import kv
from actors.engine.prompt_kv import PromptKV
from actors.engine.sampling import Sampled, on_device, sample_rows
from actors.engine.step_graphs import FixedStep
from actors.models.adapter import ModelAdapter
from actors.types import PlaceholderRange, SamplingParams, TokenHistory


def splice(
    embeds: torch.Tensor, ranges: tuple[PlaceholderRange, ...], items: list[torch.Tensor]
) -> torch.Tensor:
    """Write each item's embeddings over its placeholder range, in one indexed copy."""
    if not ranges:
        return embeds
    for r, item in zip(ranges, items, strict=True):
        check_item(r, item)
    index = torch.cat([torch.arange(r.offset, r.offset + r.length) for r in ranges]).to(
        embeds.device
    )
    out = embeds.clone()
    out[0, index] = torch.cat(items).to(embeds.device, embeds.dtype)
    return out


def check_item(r: PlaceholderRange, item: torch.Tensor) -> None:
    if item.shape[0] != r.length:
        raise ValueError(
            f"item at offset {r.offset} has {item.shape[0]} embeddings for {r.length} placeholders"
        )


class LMRunner:
    def __init__(self, adapter: ModelAdapter, max_chunk_tokens: int = 512):
        self.adapter = adapter
        self.max_chunk_tokens = max_chunk_tokens
        self.device = torch.device(adapter.device)

    @torch.inference_mode()
    def prefill(
        self,
        token_ids: tuple[int, ...],
        ranges: tuple[PlaceholderRange, ...],
        items: list[torch.Tensor],
        params: SamplingParams,
        history: TokenHistory | None = None,
        matcher=None,
    ) -> tuple[Sampled | None, torch.Tensor, int]:
        """First token (None if it could not be sampled), the packed KV cache of the whole
        prompt, and the rope delta decode adds to cache lengths (0 for 1-D positions);
        `matcher`: the request's grammar matcher (see first_token)."""
        embeds, positions, rope_delta = self.prompt_inputs(token_ids, ranges, items)
        cache = self.prompt_cache(len(token_ids))
        for start in range(0, embeds.shape[1], self.max_chunk_tokens):
            hidden = self.forward_chunk(
                embeds, positions, cache, start, start + self.max_chunk_tokens
            )
        first = self.first_token(hidden, params, len(token_ids), history, matcher)
        return first, kv.pack(cache), rope_delta

    def prompt_cache(
        self, num_tokens: int, prefix: list[torch.Tensor] | None = None
    ) -> DynamicCache:
        """An empty cache for a prompt of `num_tokens`, or one holding the packed `prefix`
        blocks: one buffer where the model allows it (prompt_kv.py), else HF's own."""
        if num_layers := self.adapter.full_window_layers:
            cache = PromptKV(num_layers, num_tokens)
            cache.extend([block.to(self.device) for block in prefix or ()])
            return cache
        return kv.cache_of(torch.cat(prefix, dim=3).to(self.device)) if prefix else DynamicCache()

    @torch.inference_mode()
    def prompt_inputs(
        self,
        token_ids: tuple[int, ...],
        ranges: tuple[PlaceholderRange, ...],
        items: list[torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor, int]:
        """The prompt's input embeddings (items spliced in), its positions and rope delta."""
        embeds, positions, rope_delta = self.text_inputs(token_ids, ranges)
        return splice(embeds, ranges, items), positions, rope_delta

    @torch.inference_mode()
    def text_inputs(
        self, token_ids: tuple[int, ...], ranges: tuple[PlaceholderRange, ...]
    ) -> tuple[torch.Tensor, torch.Tensor, int]:
        """The prompt's token embeddings with no item spliced in yet, its positions and rope
        delta. Positions need only the token ids and each range's layout (the grid and seconds
        per grid of 3-D rotary families travel in the PlaceholderRange from the ingress's
        plan), so every family can start a prompt before its items' embeddings arrive."""
        ids = torch.tensor([token_ids], dtype=torch.long, device=self.device)
        positions, rope_delta = self.adapter.prompt_positions(ids, ranges)
        return self.adapter.embed_tokens(ids), positions, rope_delta

    @torch.inference_mode()
    def splice_item(self, embeds: torch.Tensor, r: PlaceholderRange, item: torch.Tensor) -> None:
        """Write one item's embeddings over its range of `embeds` (the job's own), in place."""
        check_item(r, item)
        embeds[0, r.offset : r.offset + r.length] = item.to(embeds.device, embeds.dtype)

    @torch.inference_mode()
    def forward_chunk(
        self,
        embeds: torch.Tensor,
        positions: torch.Tensor,
        cache: DynamicCache,
        start: int,
        end: int,
    ) -> torch.Tensor:
        """Prompt tokens [start, end) through the LM on top of `cache` (which holds [0, start))."""
        return self.adapter.forward(embeds[:, start:end], positions[..., start:end], cache)

    @torch.inference_mode()
    def first_token(
        self,
        hidden: torch.Tensor,
        params: SamplingParams,
        num_prompt_tokens: int,
        history: TokenHistory | None = None,
        matcher=None,
    ) -> Sampled | None:
        """`matcher`: the request's grammar matcher (None: unconstrained), which takes the
        token."""
        return sample_rows(
            self.adapter.logits(hidden[:, -1]),
            [params],
            [num_prompt_tokens],
            [history] if history else None,
            [matcher] if matcher is not None else None,
        )[0]

    @torch.inference_mode()
    def decode_step(
        self,
        batch: kv.BatchedKV,
        last_tokens: list[int],
        params: list[SamplingParams],
        positions: list[int],
        rope_deltas: list[int] | None = None,
        histories: list[TokenHistory] | None = None,
        matchers: list | None = None,
        fixed: FixedStep | None = None,
    ) -> list[Sampled | None]:
        """Feed each row its last token; the cache grows by one slot; returns the next tokens.
        `matchers`: each row's grammar matcher or None (None: no row is constrained); `fixed`:
        the forward on fixed buffers (a CUDA graph on a GPU) instead of the eager one."""
        if fixed is not None:
            logits = fixed.logits(batch, last_tokens, rope_deltas)
        else:
            logits = self._eager_logits(batch, last_tokens, rope_deltas)
        batch.absorb()
        return sample_rows(logits, params, positions, histories, matchers)

    def _eager_logits(
        self, batch: kv.BatchedKV, last_tokens: list[int], rope_deltas: list[int] | None
    ) -> torch.Tensor:
        ids = on_device(self.device, last_tokens, torch.long).unsqueeze(1)
        cache = batch.as_cache()  # first: it may regrow the buffers the views below read
        position_ids = batch.lengths().unsqueeze(1)
        if rope_deltas and any(rope_deltas):
            position_ids = position_ids + on_device(self.device, rope_deltas, torch.long).unsqueeze(
                1
            )
        position_ids = self.adapter.step_positions(position_ids)
        mask = self.adapter.step_mask(batch.step_mask())
        hidden = self.adapter.forward(self.adapter.embed_tokens(ids), position_ids, cache, mask)
        return self.adapter.logits(hidden[:, -1])
