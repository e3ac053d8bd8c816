"""What a request leaves behind is finished in the background: close_soon frees a stream's
workers even when the stream is mid-step in another task."""

from __future__ import annotations

import asyncio

from cluster.leftovers import close_soon


def test_a_stream_running_a_step_elsewhere_is_closed_once_the_step_ends():
    cleaned = []

    async def stream():
        try:
            await asyncio.sleep(0.1)  # a step in flight, e.g. the first token's wait_for task
            yield 1
            yield 2
        finally:
            cleaned.append("freed")

    async def main():
        gen = stream()
        step = asyncio.ensure_future(anext(gen))
        await asyncio.sleep(0.01)
        close_soon(gen)  # aclose() is refused while the step runs
        assert await step == 1
        for _ in range(100):
            if cleaned:
                break
            await asyncio.sleep(0.01)
        return list(cleaned), gen.ag_frame  # before asyncio.run's own shutdown closes what is left

    assert asyncio.run(main()) == (["freed"], None)


def test_a_finished_stream_is_left_alone():
    async def stream():
        yield 1

    async def main():
        gen = stream()
        assert [x async for x in gen] == [1]
        close_soon(gen)
        await asyncio.sleep(0.05)

    asyncio.run(main())


async def _settle(for_s: float) -> None:
    await asyncio.sleep(for_s)
