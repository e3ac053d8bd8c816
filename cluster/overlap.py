"""Encode/prefill overlap at the ingress: the prefill call goes out before its embeddings,
which follow item by item as the encoders finish them (`prefill.overlap_encode`)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable


async def overlapped(call: Awaitable, delivering: Awaitable[list]) -> tuple:
    """Await the prefill `call` while `delivering` hands it its embeddings; returns the call's
    result and the receive answers. A delivery that fails (its encoder died) fails the
    request at once: the prefill would wait for that item forever. The prefill worker
    answers only once every item has arrived, so the delivery is done or about to be."""
    calling, delivery = asyncio.ensure_future(call), asyncio.ensure_future(delivering)
    pending = {calling, delivery}
    try:
        while not calling.done():
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            if delivery in done and delivery.exception() is not None:
                raise delivery.exception()
        return calling.result(), await delivery
    except BaseException:
        calling.cancel()
        delivery.cancel()
        raise
