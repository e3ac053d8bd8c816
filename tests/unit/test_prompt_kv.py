"""Unit tests for actors.engine.prompt_kv: a prompt's cache written in place in one buffer
gives what HF's DynamicCache gives, chunk by chunk and from a cached prefix, and packs with
no copy."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
from transformers.cache_utils import DynamicCache  # noqa: E402

from actors.engine import kv  # noqa: E402
from actors.engine.prompt_kv import PromptKV  # noqa: E402

LAYERS, HEADS, DIM, TOKENS = 3, 2, 4, 11


def chunks(seed: int, bounds: list[int]) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """Per chunk [start, end) of `bounds`, each layer's new keys and values."""
    gen = torch.Generator().manual_seed(seed)
    return [
        [
            (
                torch.randn(1, HEADS, end - start, DIM, generator=gen),
                torch.randn(1, HEADS, end - start, DIM, generator=gen),
            )
            for _ in range(LAYERS)
        ]
        for start, end in zip(bounds, bounds[1:])
    ]


def fill(cache: DynamicCache, steps) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Write every chunk as a forward would, layer by layer; what attention saw last."""
    seen = []
    for step in steps:
        seen = [cache.update(k, v, layer) for layer, (k, v) in enumerate(step)]
    return seen


def test_chunk_by_chunk_it_is_what_a_dynamic_cache_holds_and_packs_without_a_copy():
    steps = chunks(0, [0, 4, 8, TOKENS])
    ours, theirs = PromptKV(LAYERS, TOKENS), DynamicCache()
    seen = fill(ours, steps)
    want = fill(theirs, steps)
    for (k, v), (wk, wv) in zip(seen, want):  # attention reads the same keys and values
        assert torch.equal(k, wk) and torch.equal(v, wv)
    assert ours.get_seq_length() == TOKENS
    packed = kv.pack(ours)
    assert torch.equal(packed, kv.pack(theirs)) and packed.is_contiguous()
    assert packed.data_ptr() == ours.buffer.data_ptr()  # the buffer itself


def test_a_cached_prefix_then_the_rest_equals_the_whole_prompt():
    steps = chunks(1, [0, 4, 8, TOKENS])
    whole = kv.pack(_filled(steps))
    blocks = [whole[:, :, :, 0:4], whole[:, :, :, 4:8]]  # two cached 4-token blocks
    resumed = PromptKV(LAYERS, TOKENS)
    resumed.extend([b.clone() for b in blocks])
    assert resumed.get_seq_length() == 8
    for i, layer in enumerate(resumed.layers):  # what attention reads before the next chunk
        assert torch.equal(layer.keys[0], whole[i, 0, :, :8])
        assert torch.equal(layer.values[0], whole[i, 1, :, :8])
    fill(resumed, steps[2:])
    assert torch.equal(kv.pack(resumed), whole)


def test_packing_before_the_last_token_is_refused():
    cache = PromptKV(LAYERS, TOKENS)
    fill(cache, chunks(2, [0, 4]))
    with pytest.raises(ValueError, match="all its tokens"):
        kv.pack(cache)


def _filled(steps) -> DynamicCache:
    cache = DynamicCache()
    fill(cache, steps)
    return cache
