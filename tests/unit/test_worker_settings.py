"""Each pool's settings reach its workers as one record under the config's names: config ->
record (`settings()` in cluster/config.py) -> fleet -> actor -> engine, the same values under
the same names, converted only where they are used."""

from __future__ import annotations

import dataclasses

import pytest

from cluster.config import ClusterConfig
from router.types import WorkerKind
from router.worker_settings import MIB, DecodeSettings, EncoderSettings, PrefillSettings

# Every setting away from its default, so that one which went astray shows.
CONFIG = ClusterConfig.model_validate(
    {
        "model": {"checkpoint": "/tmp/ckpt", "served_name": "m", "max_model_len": 256},
        "encoder": {
            "max_batch_size": 3,
            "max_wait_ms": 7.5,
            "cache_mb": 12.0,
            "urgent_images": False,
            "urgent_niceness": 4,
        },
        "prefill": {
            "max_chunk_tokens": 48,
            "max_media_tokens_per_step": 99,
            "overlap_min_tokens": 5,
            "aging_tokens_per_s": 25.0,
            "prefix_block_tokens": 8,
            "prefix_cache_mb": 3.0,
            "preempt_at_layers": False,
            "node_priority": False,
            "urgent_niceness": 5,
            "pack_prompts": False,
        },
        "decode": {
            "max_batch_size": 5,
            "kv_cache_mb": 2.5,
            "cuda_graphs": "off",
            "make_way_for_short": False,
        },
    }
)
POOLS = {
    EncoderSettings: CONFIG.encoder_pools[0],
    PrefillSettings: CONFIG.prefill,
    DecodeSettings: CONFIG.decode,
}
KINDS = {
    WorkerKind.ENCODER: EncoderSettings,
    WorkerKind.PREFILL: PrefillSettings,
    WorkerKind.DECODE: DecodeSettings,
}


@pytest.mark.parametrize("record", POOLS, ids=lambda r: r.__name__)
def test_a_pools_record_holds_its_config_fields_under_their_names(record):
    pool = POOLS[record]
    settings = pool.settings()
    assert type(settings) is record
    for field in dataclasses.fields(record):
        default = type(pool).model_fields[field.name].default
        assert getattr(settings, field.name) == getattr(pool, field.name) != default, field.name


def test_units_convert_where_they_are_used():
    assert CONFIG.encoder_pools[0].settings().cache_bytes == 12 * MIB
    assert CONFIG.prefill.settings().prefix_cache_bytes == 3 * MIB
    assert CONFIG.decode.settings().kv_cache_bytes == int(2.5 * MIB)
    assert DecodeSettings(max_batch_size=1).kv_cache_bytes is None, "no budget: rows only"


def test_the_fleet_hands_each_actor_its_pools_record(monkeypatch):
    import cluster.fleet as fleet_module
    from actors.runtime import WorkerSpec

    started = {}

    class _ActorClass:
        def __init__(self, kind: WorkerKind):
            self.kind = kind

        def options(self, **_):
            return self

        def remote(self, spec, settings):
            started[self.kind] = settings

    monkeypatch.setattr(fleet_module, "_ACTORS", {kind: _ActorClass(kind) for kind in WorkerKind})
    fleet = object.__new__(fleet_module.Fleet)
    fleet.config, fleet.spec = CONFIG, WorkerSpec("/tmp/ckpt", "float32", "cpu", 1, 256)
    for kind in WorkerKind:
        fleet._start(kind, 0)
    assert started == {kind: POOLS[record].settings() for kind, record in KINDS.items()}


def test_each_worker_and_its_engine_read_the_record_it_was_given(ckpt):
    pytest.importorskip("torch")
    from actors.decode import DecodeWorker
    from actors.encoder import EncoderWorker
    from actors.prefill import PrefillWorker
    from actors.runtime import WorkerSpec

    spec = WorkerSpec(str(ckpt), "float32", "cpu", 1, 256)
    encoder = EncoderWorker(spec, CONFIG.encoder_pools[0].settings())
    assert (encoder.batcher.max_batch_size, encoder.batcher.max_wait_s) == (3, 7.5e-3)
    assert encoder.cache.capacity_bytes == 12 * MIB

    prefill = PrefillWorker(spec, CONFIG.prefill.settings())
    assert prefill.engine.settings is prefill.settings == CONFIG.prefill.settings()
    assert prefill.engine.runner.max_chunk_tokens == 48
    assert prefill.engine.pool.capacity_bytes == 3 * MIB

    decode = DecodeWorker(spec, CONFIG.decode.settings())
    assert decode.engine.settings is decode.settings == CONFIG.decode.settings()
    assert decode.engine.scheduler.max_batch_size == 5
    assert decode.engine.scheduler.kv_budget_bytes == int(2.5 * MIB)
