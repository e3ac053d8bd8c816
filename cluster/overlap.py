"""Encode/prefill overlap at the ingress: the prefill call goes out before its embeddings,
which follow item by item as the encoders finish them (`prefill.overlap_encode`)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable


async def overlapped(
    call: Awaitable, delivering: Awaitable[list], await_delivery: bool = True
) -> tuple:
    """Await the prefill `call` while `delivering` hands it its embeddings; returns the call's
    result and the receive answers. A delivery that fails (its encoder died) fails the
    request at once: the prefill would wait for that item forever.

    The prefill worker answers once every item it needs has arrived: an item its cached
    prefix covered (a new turn about the same image) may still be on its way. With
    `await_delivery` (a collective transport, whose transfer under way must end) it is
    awaited; without (the encoders push over the object store, and the worker refuses what
    comes after its answer) it is not: it ends on its own, and the answers are None."""
    calling, delivery = asyncio.ensure_future(call), asyncio.ensure_future(delivering)
    pending = {calling, delivery}
    try:
        while not calling.done():
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            if delivery in done and delivery.exception() is not None:
                raise delivery.exception()
        if await_delivery or _delivered(delivery):
            return calling.result(), await delivery
        delivery.add_done_callback(_retrieve)  # it ends on its own; nobody waits for it
        return calling.result(), None
    except BaseException:
        calling.cancel()
        delivery.cancel()
        raise


def _retrieve(delivery: asyncio.Future) -> None:
    if not delivery.cancelled():
        delivery.exception()  # an encoder lost after the answer fails nothing: no warning


def _delivered(delivery: asyncio.Future) -> bool:
    return delivery.done() and not delivery.cancelled() and delivery.exception() is None
