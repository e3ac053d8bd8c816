"""A streaming response frees its body however it ends (no Serve, no HTTP: plain ASGI calls)."""

from __future__ import annotations

import asyncio

from cluster.serving import ClosingStreamingResponse


def test_a_disconnect_that_cancels_a_send_still_closes_the_body():
    closed = []

    async def body():
        try:
            yield b"data: first\n\n"
            yield b"data: second\n\n"
        finally:
            closed.append(True)  # where the request path frees its workers

    async def main():
        sent = asyncio.Event()

        async def send(message):
            if message.get("more_body"):
                sent.set()
                await asyncio.sleep(3600)  # the client is gone: this send is cancelled

        async def receive():
            await asyncio.sleep(3600)

        scope = {"type": "http", "asgi": {"spec_version": "2.4"}}
        task = asyncio.ensure_future(
            ClosingStreamingResponse(body(), media_type="text/event-stream")(scope, receive, send)
        )
        await sent.wait()
        task.cancel()
        for _ in range(100):
            if closed:
                break
            await asyncio.sleep(0.01)
        return list(closed)  # before asyncio.run's own shutdown closes what is left

    assert asyncio.run(main()) == [True]
