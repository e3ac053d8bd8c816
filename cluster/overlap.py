"""Encode/prefill overlap at the ingress: the prefill call goes out before its embeddings,
which follow item by item as the encoders finish them (`prefill.overlap_encode`)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable

_late: set[asyncio.Task] = set()  # deliveries still running after their prefill finished (strong references)


async def overlapped(call: Awaitable, delivering: Awaitable[list]) -> tuple:
    """Await the prefill `call` while `delivering` hands it its embeddings. A delivery that
    fails (its encoder died) fails the request at once: the prefill would wait for that item
    forever. Returns the call's result and the receive answers, or None if some are still on
    their way (a prefix-cache hit finished the prompt first; they are refused or freed by the
    attempt's drop() and finish in the background)."""
    calling, delivery = asyncio.ensure_future(call), asyncio.ensure_future(delivering)
    pending = {calling, delivery}
    try:
        while not calling.done():
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            if delivery in done and delivery.exception() is not None:
                raise delivery.exception()
        result = calling.result()
    except BaseException:
        calling.cancel()
        delivery.cancel()
        raise
    if not delivery.done():
        _late.add(delivery)
        delivery.add_done_callback(_forget)
        return result, None
    return result, delivery.result()


def _forget(task: asyncio.Task) -> None:
    _late.discard(task)
    if not task.cancelled():
        task.exception()  # retrieved: a late delivery's failure no longer matters
