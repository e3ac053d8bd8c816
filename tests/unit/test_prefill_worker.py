"""The prefill worker's side of encode/prefill overlap, on the worker class itself (the
Ray actor's body, driven with asyncio as the actor's event loop would): the prefill call
comes before the embeddings, a prompt the prefix cache finishes answers only with every
item's encode stats, and a request dropped while it waits leaves nothing behind."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from actors.prefill import PrefillWorker  # noqa: E402
from actors.runtime import WorkerSpec  # noqa: E402
from actors.types import EncodeStats, PrefillRequest, WorkerRequestError  # noqa: E402
from router.worker_settings import PrefillSettings  # noqa: E402
from tests.unit.test_engine_overlap import text_then_images  # noqa: E402
from tests.unit.test_lm_runner import GREEDY, encoder, processor  # noqa: E402,F401


@pytest.fixture
def worker(ckpt):  # one per test: its drive task belongs to that test's event loop
    spec = WorkerSpec(
        checkpoint=str(ckpt), dtype="float32", device="cpu", torch_threads=1, max_model_len=4096
    )
    return PrefillWorker(
        spec, PrefillSettings(max_chunk_tokens=32, prefix_block_tokens=4, prefix_cache_mb=256)
    )


@pytest.fixture(scope="module")
def prompt(encoder, processor):
    from actors.types import MediaItem
    from router.types import Modality

    array = np.random.default_rng(8).integers(0, 256, (40, 40, 3), dtype=np.uint8)
    ids, ranges, _ = text_then_images(processor, encoder.config.image_token_id, [array])
    [emb] = encoder.encode([MediaItem(Modality.IMAGE, "img", data=array)])
    return ids, ranges, (emb, EncodeStats("img", 1.0, 2.0, 1, finished_at_s=time.time()))


def request(name: str, prompt) -> PrefillRequest:
    ids, ranges, _ = prompt
    return PrefillRequest(name, ids, ranges, GREEDY, media_identifiers=("img",))


async def until(condition, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


def test_embeddings_after_the_call_and_a_prefix_hit_answers_without_them(worker, prompt):
    ids, ranges, encoded = prompt

    async def scenario():
        call = asyncio.create_task(worker.prefill(request("a", prompt)))
        await until(
            lambda: worker.engine.stats()["waiting_for_items"] == 1
        )  # the text is done, the image not here
        await worker.receive("a", 0, encoded)
        first = await asyncio.wait_for(call, 20)
        assert first.encode_stats == (encoded[1],) and first.item_wait_ms > 0

        # Turn 2 from the prefix cache: its prompt is done before its image arrives, and its
        # first token goes at once (the ingress counts the encode from the encode call).
        second = await asyncio.wait_for(worker.prefill(request("b", prompt)), 20)
        assert second.encode_stats == () and second.item_wait_ms == 0
        assert second.num_cached_tokens > ranges[0].offset + ranges[0].length
        assert second.first_token_id == first.first_token_id
        await worker.receive("b", 0, encoded)  # the image, after the answer: refused
        assert worker.stats()["held_embeddings"] == 0
        for name in ("a", "b"):
            worker.drop(name)
        assert worker.stats()["held_embeddings"] == worker.stats()["held_kv"] == 0

    asyncio.run(scenario())


def test_dropped_while_waiting_for_its_image_leaves_nothing(worker, prompt):
    async def scenario():
        call = asyncio.create_task(worker.prefill(request("c", prompt)))
        await until(lambda: worker.engine.stats()["waiting_for_items"] == 1)
        worker.drop("c")
        with pytest.raises(WorkerRequestError, match="dropped during its prefill"):
            await asyncio.wait_for(call, 20)
        await worker.receive("c", 0, prompt[2])  # the encoder finished after the request ended
        # stats are the engine's snapshot at the end of a step: the job may be gone before it
        await until(
            lambda: not worker.engine.jobs and not worker.engine.stats()["waiting_for_items"]
        )
        stats = worker.stats()
        assert stats["held_embeddings"] == stats["held_kv"] == stats["waiting_for_items"] == 0
        assert worker.engine.pool.num_referenced() == 0

    asyncio.run(scenario())


def test_a_prefill_call_that_comes_after_its_drop_is_refused_and_queues_nothing(worker, prompt):
    """The drop goes over Ray, the prefill call over a link: the drop may come first."""

    async def scenario():
        worker.drop("late")
        with pytest.raises(WorkerRequestError, match="dropped before its prefill"):
            await asyncio.wait_for(worker.prefill(request("late", prompt)), 20)
        assert not worker.engine.jobs and not worker.engine.has_work
        assert worker.stats()["queued"] == 0

    asyncio.run(scenario())


def test_a_slowed_workers_timings_count_its_emulated_slowness(ckpt):
    """Benchmarks emulate a slower device by sleeping after each step (WorkerSpec.slowdown); the
    router must see that worker as slower, so its reported compute is stretched alike, and its
    prefill_ms runs until the first token is handed on, after the sleep (the simulator's fit
    takes what TTFT holds beyond the stages as ingress overhead)."""
    spec = WorkerSpec(
        checkpoint=str(ckpt),
        dtype="float32",
        device="cpu",
        torch_threads=1,
        max_model_len=4096,
        slowdown=4.0,
    )
    slowed = PrefillWorker(spec, PrefillSettings(max_chunk_tokens=512))
    prompt_ids = tuple(range(10, 210))

    async def timed(name: str):
        started = time.perf_counter()
        result = await slowed.prefill(PrefillRequest(name, prompt_ids, (), GREEDY))
        return result, (time.perf_counter() - started) * 1e3

    asyncio.run(timed("warm"))
    result, wall_ms = asyncio.run(timed("r"))
    assert result.compute_ms >= 0.5 * wall_ms, (
        f"the forwards alone are about a quarter of the {wall_ms:.1f} ms the call took"
    )
    assert result.compute_ms <= wall_ms * 1.05
    assert 0.6 * wall_ms <= result.prefill_ms <= wall_ms, (
        f"one step and its sleep: most of the {wall_ms:.1f} ms call"
    )


def test_a_prompt_run_between_a_chunks_layers_answers_before_the_chunk_ends(ckpt):
    """Layer-boundary preemption on the worker: a text prompt called while a long prompt's
    chunk is in its forward is answered from the device thread's hand-off while that chunk
    still runs, and both answers are what each gives alone."""
    spec = WorkerSpec(
        checkpoint=str(ckpt), dtype="float32", device="cpu", torch_threads=1, max_model_len=4096
    )
    worker = PrefillWorker(spec, PrefillSettings(max_chunk_tokens=256, preempt_at_layers=True))
    layers = worker.adapter.decoder_layers()
    long = PrefillRequest("long", tuple(range(10, 250)), (), GREEDY)
    short = PrefillRequest("short", tuple(range(40, 52)), (), GREEDY)

    def wait_for(condition) -> None:  # on the device thread: the event loop runs meanwhile
        deadline = time.monotonic() + 20
        while not condition():
            assert time.monotonic() < deadline, "timed out"
            time.sleep(0.005)

    async def scenario():
        loop, answered_mid_chunk = asyncio.get_running_loop(), []
        calls = {}

        def call_short(_module, _args):  # before the long chunk's first layer, once
            first_layer.remove()
            calls["short"] = asyncio.run_coroutine_threadsafe(worker.prefill(short), loop)
            wait_for(lambda: worker.engine.stats()["queued"] > 0)  # added: the next layer takes it

        def after_last_layer(_module, _args, _output):  # the short forward's, then the chunk's
            calls["last_layers"] = calls.get("last_layers", 0) + 1
            if calls["last_layers"] == 2:
                last_layer.remove()
                wait_for(calls["short"].done)
                answered_mid_chunk.append(True)

        first_layer = layers[0].register_forward_pre_hook(call_short)
        last_layer = layers[-1].register_forward_hook(after_last_layer)
        long_result = await worker.prefill(long)
        short_result = await asyncio.wrap_future(calls["short"])
        return long_result, short_result, answered_mid_chunk

    long_result, short_result, answered_mid_chunk = asyncio.run(scenario())
    assert answered_mid_chunk == [True], "the short prompt waited for the chunk"
    assert short_result.queue_ms < long_result.prefill_ms
    for result, req in ((long_result, long), (short_result, short)):
        alone = PrefillWorker(spec, PrefillSettings(max_chunk_tokens=256))
        assert asyncio.run(alone.prefill(req)).first_token_id == result.first_token_id
        assert torch.equal(worker.kv.take(req.request_id), alone.kv.take(req.request_id))
