"""One bad row never fails its batch: the real prefill and decode worker classes (without
Ray) on the tiny checkpoint, with a row whose sampling overflows beside greedy rows. The
decode worker's output is read as the ingress reads it (cluster/decode_feed.py)."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

pytest.importorskip("torch")

import itertools  # noqa: E402

from actors.decode import DecodeWorker  # noqa: E402
from actors.prefill import PrefillWorker  # noqa: E402
from actors.runtime import WorkerSpec  # noqa: E402
from actors.types import (
    DecodeRequest,
    FinishReason,
    PrefillRequest,
    SamplingParams,
    WorkerRequestError,
)  # noqa: E402
from cluster.decode_feed import DecodeFeed  # noqa: E402
from router.worker_settings import DecodeSettings, PrefillSettings  # noqa: E402

_owners = itertools.count()


class Reader:
    """The ingress's end of one decode worker, in the running event loop: a fresh owner tag
    each time (a worker's outbox belongs to the loop that made it)."""

    def __init__(self, decode: DecodeWorker, stream_interval: int = 1):
        self.decode, self.interval = decode, stream_interval
        self.owner = f"t{next(_owners)}:"
        self.feed = DecodeFeed(lambda: decode.stream(self.owner))

    async def generate(self, request: DecodeRequest) -> list:
        self.feed.listen(request.request_id)
        if not await self.decode.submit(request, None, self.owner):
            return []
        return [c async for c in self.feed.chunks(request.request_id, self.interval)]


GREEDY = SamplingParams(temperature=0.0, max_tokens=12)
PROMPTS = [tuple(range(3, 3 + n)) for n in (9, 17, 5, 12)]


@pytest.fixture(scope="module")
def workers(ckpt):
    spec = WorkerSpec(str(ckpt), "float32", "cpu", 1, 256)
    return PrefillWorker(spec, PrefillSettings(64)), DecodeWorker(spec, DecodeSettings(8))


async def _run(prefill: PrefillWorker, reader: Reader, rid: str, prompt, sampling: SamplingParams):
    result = await prefill.prefill(PrefillRequest(rid, prompt, (), GREEDY))
    await reader.decode.receive(rid, 0, await prefill.pop_kv(rid))
    tokens, reason = [result.first_token_id], None
    request = DecodeRequest(rid, result.num_prompt_tokens, result.first_token_id, sampling)
    for chunk in await reader.generate(request):
        tokens += chunk.token_ids
        reason = chunk.finish_reason
    return tokens, reason


def _alone(prefill, decode, rid, prompt, sampling):
    async def main():
        return await _run(prefill, Reader(decode), rid, prompt, sampling)

    return asyncio.run(main())


def test_a_row_that_cannot_be_sampled_ends_alone_and_the_batch_is_token_exact(workers):
    prefill, decode = workers
    alone = [_alone(prefill, decode, f"solo{i}", p, GREEDY) for i, p in enumerate(PROMPTS)]
    bad = dataclasses.replace(
        GREEDY, temperature=1e-38, seed=5
    )  # past the HTTP check, as a bug would be

    async def together():
        reader = Reader(decode)
        runs = [
            _run(prefill, reader, f"mix{i}", p, bad if i == 1 else GREEDY)
            for i, p in enumerate(PROMPTS)
        ]
        return await asyncio.gather(*runs)

    mixed = asyncio.run(together())
    assert mixed[1][1] == FinishReason.ERROR and len(mixed[1][0]) < GREEDY.max_tokens
    for i in (0, 2, 3):
        assert mixed[i] == alone[i], f"row {i} was harmed by its neighbour"
    assert decode.stats()["rows"] == 0 and decode.stats()["held_kv"] == 0


def test_a_first_token_that_cannot_be_sampled_fails_that_prefill_alone(workers):
    prefill, _ = workers
    bad = dataclasses.replace(
        GREEDY, temperature=1e-45, seed=5
    )  # a denormal: every logit overflows
    with pytest.raises(WorkerRequestError, match="could not be sampled"):
        asyncio.run(prefill.prefill(PrefillRequest("bad", PROMPTS[0], (), bad)))
    assert prefill.stats()["held_kv"] == 0
    ok = asyncio.run(prefill.prefill(PrefillRequest("next", PROMPTS[0], (), GREEDY)))
    assert ok.first_token_id is not None
    prefill.drop("next")


def test_a_closed_request_refuses_late_tensors(workers):
    """The client left while the KV was on its way: it is dropped on arrival, not held."""
    prefill, decode = workers
    asyncio.run(prefill.prefill(PrefillRequest("late", PROMPTS[2], (), GREEDY)))
    packed = asyncio.run(prefill.pop_kv("late"))
    decode.abort("late")
    asyncio.run(decode.receive("late", 0, packed))
    assert decode.stats()["held_kv"] == 0
    prefill.drop("gone")  # the prefill call came after its request was dropped: refused
    with pytest.raises(WorkerRequestError, match="dropped before its prefill"):
        asyncio.run(prefill.prefill(PrefillRequest("gone", PROMPTS[2], (), GREEDY)))
    assert prefill.stats()["held_kv"] == 0 and not prefill.engine.jobs


def test_a_request_aborted_while_waiting_for_a_row_ends_its_stream(ckpt):
    """The ingress drains a stream it no longer wants (dropping it would cancel the call): an
    abort must end it even when the request never got a row, and the running one is unharmed."""
    spec = WorkerSpec(str(ckpt), "float32", "cpu", 1, 256)
    prefill, decode = (
        PrefillWorker(spec, PrefillSettings(64)),
        DecodeWorker(spec, DecodeSettings(1)),
    )
    long = dataclasses.replace(GREEDY, max_tokens=40)

    async def generate(reader: Reader, rid: str, prompt, sampling: SamplingParams) -> list:
        result = await prefill.prefill(PrefillRequest(rid, prompt, (), sampling))
        await decode.receive(rid, 0, await prefill.pop_kv(rid))
        request = DecodeRequest(rid, result.num_prompt_tokens, result.first_token_id, sampling)
        return await reader.generate(request)

    async def main():
        reader = Reader(decode)
        running = asyncio.ensure_future(generate(reader, "running", PROMPTS[0], long))
        waiting = asyncio.ensure_future(generate(reader, "waiting", PROMPTS[1], GREEDY))
        for _ in range(10_000):  # until "running" has the only row and "waiting" waits for it
            if "waiting" in decode._owner_of and decode.stats()["rows"] == 1:
                break
            await asyncio.sleep(0.001)
        assert not running.done() and decode.stats()["queued"] == 1, decode.stats()
        decode.abort("waiting")
        return await asyncio.wait_for(waiting, 10), await asyncio.wait_for(running, 60)

    aborted, finished = asyncio.run(main())
    assert [c.finish_reason for c in aborted] == [FinishReason.ABORT] and not aborted[0].token_ids
    assert finished[-1].finish_reason == FinishReason.LENGTH
    assert 1 + sum(len(c.token_ids) for c in finished) == long.max_tokens
    assert decode.stats()["rows"] == 0 and decode.stats()["held_kv"] == 0


def test_a_stream_interval_sends_fewer_chunks_of_the_same_tokens(ckpt):
    """decode.stream_interval 4: chunks of at least 4 tokens (the last one may be shorter),
    the same tokens and finish reason as one token a chunk."""
    spec = WorkerSpec(str(ckpt), "float32", "cpu", 1, 256)
    prefill, decode = (
        PrefillWorker(spec, PrefillSettings(64)),
        DecodeWorker(spec, DecodeSettings(max_batch_size=8)),
    )

    async def run(rid: str):
        result = await prefill.prefill(PrefillRequest(rid, PROMPTS[1], (), GREEDY))
        await decode.receive(rid, 0, await prefill.pop_kv(rid))
        request = DecodeRequest(rid, result.num_prompt_tokens, result.first_token_id, GREEDY)
        return [result.first_token_id], await Reader(decode, stream_interval=4).generate(request)

    first, chunks = asyncio.run(run("gathered"))
    assert [len(c.token_ids) for c in chunks[:-1]] and all(
        len(c.token_ids) >= 4 for c in chunks[:-1]
    )
    assert len(chunks) <= -(-(GREEDY.max_tokens - 1) // 4), "fewer chunks than tokens"
    tokens = first + [t for c in chunks for t in c.token_ids]
    one_by_one, _ = _alone(
        prefill, DecodeWorker(spec, DecodeSettings(8)), "single", PROMPTS[1], GREEDY
    )
    assert tokens == one_by_one and chunks[-1].finish_reason == FinishReason.LENGTH


def test_one_message_per_step_carries_every_request_of_an_ingress(ckpt):
    """8 requests of one ingress replica decode together: each step's tokens leave the worker
    as one message, not one per request or per token, and each request gets all of its own."""
    spec = WorkerSpec(str(ckpt), "float32", "cpu", 1, 256)
    prefill, decode = (
        PrefillWorker(spec, PrefillSettings(256)),
        DecodeWorker(spec, DecodeSettings(8)),
    )

    async def main():
        reader = Reader(decode)
        runs = [_run(prefill, reader, f"m{i}", PROMPTS[i % 4], GREEDY) for i in range(8)]
        return await asyncio.gather(*runs)

    results = asyncio.run(main())
    assert all(len(tokens) == GREEDY.max_tokens for tokens, _ in results)
    tokens_out = sum(len(tokens) - 1 for tokens, _ in results)  # the first came from prefill
    stats = decode.stats()  # requests join as each one's prefill ends, so steps vary
    assert stats["messages"] <= stats["steps"] < tokens_out, stats
    assert stats["max_batch"] > 1, "the requests never decoded together"
    assert decode.stats()["open_streams"] == 0 and decode.stats()["rows"] == 0
