"""Live settings (cluster/config.py LIVE_FIELDS) taken by running engines: the next step
uses them, what cannot change in place is refused by name (no Ray)."""

from __future__ import annotations

import dataclasses

import pytest

torch = pytest.importorskip("torch")

from actors.types import PrefillRequest  # noqa: E402
from router.worker_settings import DecodeSettings  # noqa: E402
from tests.unit.test_lm_runner import GREEDY, engines, lm  # noqa: E402, F401 (lm: a fixture)


def _steps_to_prefill(engine, request_id: str, num_tokens: int) -> int:
    engine.add(PrefillRequest(request_id, tuple(range(10, 10 + num_tokens)), (), GREEDY))
    steps = 0
    while engine.has_work:
        engine.step()
        steps += 1
    return steps


def test_a_new_chunk_budget_applies_from_the_next_request_on(lm):
    prefill, _ = engines(lm, max_chunk_tokens=512)
    assert _steps_to_prefill(prefill, "a", 37) == 1
    prefill.reconfigure(dataclasses.replace(prefill.settings, max_chunk_tokens=5))
    assert _steps_to_prefill(prefill, "b", 37) == 8  # 37 tokens, 5 a step
    assert prefill.runner.max_chunk_tokens == 5


def test_the_prefix_cache_shape_is_not_live(lm):
    prefill, _ = engines(lm, max_chunk_tokens=16, prefix_cache_mb=1.0)
    for change in ({"prefix_block_tokens": 8}, {"prefix_cache_mb": 2.0}):
        with pytest.raises(ValueError, match="cannot change while the worker runs"):
            prefill.reconfigure(dataclasses.replace(prefill.settings, **change))
    assert prefill.settings.prefix_block_tokens == 4


def test_a_new_kv_budget_reaches_the_decode_scheduler(lm):
    _, decode = engines(lm, max_chunk_tokens=16)
    decode.reconfigure(DecodeSettings(max_batch_size=4, kv_cache_mb=2.0))
    assert decode.scheduler.kv_budget_bytes == 2 * 2**20
    with pytest.raises(ValueError, match="max_batch_size cannot change"):
        decode.reconfigure(DecodeSettings(max_batch_size=8))
