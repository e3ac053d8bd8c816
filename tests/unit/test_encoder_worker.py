"""The real encoder worker class (without Ray) on the tiny checkpoint: requests for the same
item share one tower pass, its entry stays referenced until every request is dropped, and
a failed pass leaves nothing pinned."""

from __future__ import annotations

import asyncio
import dataclasses

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from actors.encoder import EncoderWorker  # noqa: E402
from actors.runtime import WorkerSpec  # noqa: E402
from actors.types import Delivered, EncodeJob, MediaItem  # noqa: E402
from router.types import Modality  # noqa: E402
from router.worker_settings import EncoderSettings  # noqa: E402

NUM_EMBEDDINGS = 16  # tiny-llava: one image, 16 placeholder tokens


@pytest.fixture(scope="module")
def worker(ckpt) -> EncoderWorker:
    return EncoderWorker(
        WorkerSpec(str(ckpt), "float32", "cpu", 1, 256),
        EncoderSettings(max_batch_size=4, max_wait_ms=5, cache_mb=64),
    )


def _job(request_id: str, colour: int, num_embeddings: int = NUM_EMBEDDINGS) -> EncodeJob:
    image = np.full((32, 32, 3), colour, dtype=np.uint8)
    return EncodeJob(
        request_id, MediaItem(Modality.IMAGE, f"img-{colour}", data=image), num_embeddings
    )


def _held(worker: EncoderWorker) -> tuple[int, int, int]:
    stats = worker.stats()
    return (
        stats["cache_encoding_entries"],
        stats["cache_referenced_entries"],
        stats["cache_cached_entries"],
    )


def test_concurrent_requests_for_one_item_share_one_tower_pass(worker):
    async def both():
        return await asyncio.gather(worker.encode(_job("r1", 10)), worker.encode(_job("r2", 10)))

    batches = worker.batcher.num_batches
    (a, stats_a), (b, stats_b) = asyncio.run(both())
    assert worker.batcher.num_batches == batches + 1, "the second request ran the tower again"
    assert torch.equal(a, b) and not stats_a.cache_hit and stats_b.cache_hit
    assert _held(worker) == (0, 1, 0)
    worker.drop("r1")
    assert _held(worker) == (0, 1, 0), "r2 has not handed it to prefill yet"
    worker.drop("r2")
    assert _held(worker) == (0, 0, 1)
    worker.cache.check_integrity()


def test_a_failed_pass_fails_every_waiter_and_pins_nothing(worker):
    async def both():
        wrong = _job(
            "r3", 20, num_embeddings=NUM_EMBEDDINGS + 1
        )  # the tower gives 16: the pass is refused
        return await asyncio.gather(
            worker.encode(wrong), worker.encode(_job("r4", 20)), return_exceptions=True
        )

    before = _held(worker)
    results = asyncio.run(both())
    assert all(isinstance(r, ValueError) for r in results), results
    assert _held(worker) == before and "img-20" not in worker.cached_identifiers()
    worker.cache.check_integrity()


class _PrefillStandIn:
    """What the encoder calls on a prefill worker: `receive.remote(...)`, answering the
    arrival's wall clock."""

    def __init__(self):
        self.received: list[tuple] = []
        self.receive = self  # `.receive.remote` as on an actor handle

    async def remote(self, request_id: str, slot: int, encoded: tuple) -> float:
        self.received.append((request_id, slot, encoded))
        return 123.0


def test_the_encoder_hands_the_embeddings_to_the_prefill_worker_itself(worker):
    """Over the object store the encoder delivers (one hop, not two through the ingress) and
    answers only how the encoding went and when the embeddings arrived."""
    prefill = _PrefillStandIn()
    job = dataclasses.replace(_job("r5", 30), deliver_to=prefill, slot=2)
    done = asyncio.run(worker.encode(job))
    assert isinstance(done, Delivered) and done.received_at_s == 123.0
    [(request_id, slot, (embedding, stats))] = prefill.received
    assert (request_id, slot) == ("r5", 2) and stats == done.stats
    assert embedding.shape[0] == NUM_EMBEDDINGS and stats.identifier == "img-30"
    worker.drop("r5")
    worker.cache.check_integrity()
