"""The ingress side of encode/prefill overlap (cluster/overlap.py), on plain asyncio
awaitables standing in for the prefill call and the receive calls."""

from __future__ import annotations

import asyncio

import pytest

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
            await asyncio.wait_for(
                overlapped(call, after(0.01, exc=ConnectionError("encoder died"))), timeout=2
            )
        assert call.cancelled(), "the prefill call is given up"

    asyncio.run(scenario())


def test_a_failed_call_gives_up_the_delivery():
    async def scenario():
        delivery = asyncio.get_running_loop().create_future()
        with pytest.raises(RuntimeError, match="prefill worker died"):
            await overlapped(after(0.01, exc=RuntimeError("prefill worker died")), delivery)
        assert delivery.cancelled()

    asyncio.run(scenario())


def test_receive_answers_that_come_after_the_result_are_still_awaited():
    """The worker answers once every item arrived, but the receive replies may overtake
    the result or not: the transfer time is measured either way."""
    result, received = asyncio.run(overlapped(after(0.0, "first token"), after(0.03, [1.0])))
    assert (result, received) == ("first token", [1.0])


def test_pushed_items_the_worker_did_not_wait_for_are_given_up():
    """Over the object store the encoders push: a worker whose cached prefix covered an item
    answers before it comes, and the first token must not wait for it."""

    async def scenario():
        delivery = asyncio.ensure_future(after(5.0, [1.0]))
        started = asyncio.get_running_loop().time()
        got = await overlapped(after(0.01, "first token"), delivery, await_delivery=False)
        assert got == ("first token", None)
        assert asyncio.get_running_loop().time() - started < 1.0
        assert not delivery.done() and not delivery.cancelled(), "it ends on its own"
        delivery.cancel()
        # a delivery done by then is still read; one failing after the answer fails nothing
        done = await overlapped(after(0.02, "t"), after(0.0, [2.0]), await_delivery=False)
        assert done == ("t", [2.0])
        late = after(0.05, exc=ConnectionError("encoder died"))
        assert await overlapped(after(0.01, "t"), late, await_delivery=False) == ("t", None)

    asyncio.run(scenario())
