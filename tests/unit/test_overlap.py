"""The ingress side of encode/prefill overlap (cluster/overlap.py), on plain asyncio
awaitables standing in for the prefill call and the receive calls."""

from __future__ import annotations

import asyncio

import pytest

from cluster import overlap
from cluster.overlap import overlapped


async def after(delay_s: float, value=None, exc: Exception | None = None):
    await asyncio.sleep(delay_s)
    if exc is not None:
        raise exc
    return value


def test_result_and_receive_times_when_the_items_arrive_before_the_end():
    result, received = asyncio.run(overlapped(after(0.05, "first token"), after(0.01, [1.0, 2.0])))
    assert (result, received) == ("first token", [1.0, 2.0])


def test_a_failed_delivery_fails_the_request_at_once():
    """The encoder died: the prefill waits for that item forever, so the ingress must not."""

    async def scenario():
        call = asyncio.get_running_loop().create_future()  # never answers by itself
        with pytest.raises(ConnectionError, match="encoder died"):
            await asyncio.wait_for(overlapped(call, after(0.01, exc=ConnectionError("encoder died"))), timeout=2)
        assert call.cancelled(), "the prefill call is given up"

    asyncio.run(scenario())


def test_a_prefill_that_finishes_first_leaves_the_delivery_running_to_its_end():
    """A prefix-cache hit covered the item: no receive time, and the delivery still finishes
    (into a request the worker has closed) instead of being cut off mid-transfer."""

    async def scenario():
        delivered = asyncio.Event()

        async def delivery():
            await asyncio.sleep(0.05)
            delivered.set()
            raise RuntimeError("refused: the request is closed")  # retrieved, not logged as never retrieved

        result, received = await overlapped(after(0.0, "first token"), delivery())
        assert (result, received) == ("first token", None) and len(overlap._late) == 1
        await asyncio.wait_for(delivered.wait(), timeout=2)
        await asyncio.sleep(0)
        assert not overlap._late

    asyncio.run(scenario())
