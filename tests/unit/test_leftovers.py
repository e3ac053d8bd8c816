"""What a request leaves behind is finished in the background: close_soon frees a stream's
workers even when the stream is mid-step in another task; drain_soon reads a Ray stream to its
end (never dropping it unfinished) and gives up on one that does not end."""

from __future__ import annotations

import asyncio

from cluster.leftovers import close_soon, drain_soon


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


def test_drain_reads_every_item_to_the_end_errors_included():
    awaited, ended = [], []

    async def item(i: int) -> int:
        awaited.append(i)
        if i == 1:
            raise RuntimeError("an error chunk")  # the stream goes on past it
        return i

    async def stream():
        try:
            for i in range(4):
                yield item(i)
        finally:
            ended.append(True)

    async def main():
        drain_soon(stream())
        await _settle(0.05)

    asyncio.run(main())
    assert awaited == [0, 1, 2, 3] and ended == [True]


def test_drain_gives_up_on_a_stream_that_never_ends():
    dropped = []

    async def stuck():
        try:
            yield asyncio.sleep(0)
            await asyncio.sleep(3600)
            yield asyncio.sleep(0)
        finally:
            dropped.append(True)

    async def main():
        drain_soon(stuck(), within_s=0.05)
        await _settle(0.2)
        return list(dropped)

    assert asyncio.run(main()) == [True]
