"""What a request leaves running when it ends early (the client left, a stop string matched,
a worker failed), finished in tasks of their own so that nothing is held and nothing crashes.

A client that leaves cancels the request's task, and under Serve (anyio) every later await in
that task is cancelled too: clean-up that awaits must run elsewhere. Serve also cancels the
replica's Ray task for the request, and Ray then cancels every actor call that task submitted
(a recursive cancel). A call cancelled while Ray still resolves its ObjectRef arguments (a
decode call's KV, a prefill worker's embeddings) fails a reference-count check and kills the
calling process, the ingress replica, with every request it was serving (RAY_CHECK
submitted_task_ref_count > 0 in reference_counter.cc, seen in CI on a storm of clients leaving
mid-stream; ray-project/ray#56123 names the race). So calls that carry refs, and the clean-up
calls, are submitted `detached`.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Coroutine

from actors.worker_links import detached  # noqa: F401 - the request path's, defined with the links

CLOSE_RETRY_S, CLOSE_RETRY_FOR_S = (
    0.02,
    30.0,
)  # close_soon: a running stream is closed once its step ends

_running: set[asyncio.Task] = set()  # strong references until each clean-up finishes


def _in_background(coro: Coroutine) -> None:
    task = asyncio.get_running_loop().create_task(coro)
    _running.add(task)
    task.add_done_callback(_running.discard)


def close_soon(stream: AsyncIterator) -> None:
    """Close an async generator in a task of its own: an inline `await stream.aclose()` in a
    cancelled request would stop half-way and skip the clean-up (freeing the request's KV)
    further down the chain."""

    async def close() -> None:
        # A generator running a step in another task (the first token's wait_for, a closing
        # inner stage) refuses aclose(); wait for that step to end and close it then, or it
        # stays suspended, holding its KV, until the garbage collector finds it.
        for _ in range(int(CLOSE_RETRY_FOR_S / CLOSE_RETRY_S)):
            try:
                await stream.aclose()
                return
            except RuntimeError:
                if getattr(stream, "ag_frame", None) is None:  # finished meanwhile
                    return
                await asyncio.sleep(CLOSE_RETRY_S)

    _in_background(close())
