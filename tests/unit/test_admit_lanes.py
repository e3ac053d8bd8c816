"""Admission lanes: a text request is admitted while every media thread is stuck decoding,
and a full lane refuses at once instead of queueing."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest

from cluster.admit_lanes import (
    INLINE_TEXT_BYTES,
    MEDIA_THREADS,
    AdmitLanes,
    Deferred,
    Lane,
    admitting_on_loop,
    lane_of,
)
from cluster.backpressure import Overloaded

TEXT = json.dumps({"messages": [{"role": "user", "content": "hi"}]}).encode()
IMAGE = json.dumps(
    {
        "messages": [
            {
                "role": "user",
                "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,"}}],
            }
        ]
    }
).encode()


@pytest.mark.parametrize("part", ["image_url", "input_audio", "audio_url", "video_url"])
def test_a_body_with_any_media_part_goes_to_the_media_lane(part):
    body = json.dumps({"messages": [{"role": "user", "content": [{"type": part}]}]}).encode()
    assert lane_of(body) == Lane.MEDIA and lane_of(TEXT) == Lane.TEXT


def test_text_is_admitted_while_every_media_thread_waits():
    release = threading.Event()

    def admit(body: bytes) -> str:
        if lane_of(body) == Lane.MEDIA:
            release.wait(10)  # a decode slot that does not come
        return "admitted"

    async def main():
        lanes = AdmitLanes(max_text=8, max_media=MEDIA_THREADS + 8)
        media = [asyncio.ensure_future(lanes.run(IMAGE, admit)) for _ in range(MEDIA_THREADS + 8)]
        await asyncio.sleep(0.05)
        started = time.perf_counter()
        text = await asyncio.wait_for(lanes.run(TEXT, admit), 5)
        waited_s = time.perf_counter() - started
        release.set()
        await asyncio.gather(*media)
        return text, waited_s, lanes.pending

    text, waited_s, pending = asyncio.run(main())
    assert text == "admitted" and waited_s < 1.0
    assert pending == {Lane.TEXT: 0, Lane.MEDIA: 0}


def test_a_short_text_body_is_admitted_on_the_loop_and_the_rest_in_lanes():
    long_text = json.dumps({"messages": [{"role": "user", "content": "x" * INLINE_TEXT_BYTES}]})

    async def main():
        lanes = AdmitLanes(max_text=2, max_media=2)
        where = lambda body: threading.get_ident()  # noqa: E731
        try:
            bodies = (TEXT, long_text.encode(), IMAGE)
            return threading.get_ident(), [await lanes.run(body, where) for body in bodies]
        finally:
            lanes.close()

    loop_thread, (short, long, media) = asyncio.run(main())
    assert short == loop_thread  # no thread hop: the work is less than the hop
    assert long != loop_thread and media != loop_thread  # bounded work only on the loop


def test_work_on_the_loop_that_defers_is_finished_on_its_lane_from_where_it_stopped():
    steps = []

    def admit(body: bytes, request_id: str):
        steps.append(("parse", request_id, admitting_on_loop(), threading.get_ident()))

        def finish():
            steps.append(("plan", request_id, admitting_on_loop(), threading.get_ident()))
            return "admitted"

        if admitting_on_loop():  # a grammar to compile after all: off the loop
            raise Deferred(finish)
        return finish()

    async def main():
        lanes = AdmitLanes(max_text=2, max_media=2)
        try:
            answer = await lanes.run(TEXT, admit, "r1")
            return threading.get_ident(), answer, dict(lanes.pending)
        finally:
            lanes.close()

    loop_thread, answer, pending = asyncio.run(main())
    (parse, *_, on_loop, parse_thread), (plan, *_, off_loop, plan_thread) = steps
    assert answer == "admitted" and (parse, plan) == ("parse", "plan")  # parsed once
    assert on_loop and parse_thread == loop_thread
    assert not off_loop and plan_thread != loop_thread
    assert pending == {Lane.TEXT: 0, Lane.MEDIA: 0} and not admitting_on_loop()


def test_a_short_text_body_in_a_burst_goes_to_its_lane():
    async def main():
        lanes = AdmitLanes(max_text=2, max_media=2)
        where = lambda body: threading.get_ident()  # noqa: E731
        try:
            with lanes.arriving():
                alone = await lanes.run(TEXT, where)
                with lanes.arriving():  # another request is being read meanwhile
                    in_burst = await lanes.run(TEXT, where)
            return threading.get_ident(), alone, in_burst
        finally:
            lanes.close()

    loop_thread, alone, in_burst = asyncio.run(main())
    assert alone == loop_thread and in_burst != loop_thread


def test_a_short_text_body_goes_to_its_lane_while_more_are_on_their_way():
    unreached = [3]  # let through at the HTTP server, not yet reached by the handler

    async def main():
        lanes = AdmitLanes(max_text=2, max_media=2, num_unreached=lambda: unreached[0])
        where = lambda body: threading.get_ident()  # noqa: E731
        try:
            with lanes.arriving():
                in_burst = await lanes.run(TEXT, where)
                unreached[0] = 0
                alone = await lanes.run(TEXT, where)
            return threading.get_ident(), in_burst, alone
        finally:
            lanes.close()

    loop_thread, in_burst, alone = asyncio.run(main())
    assert in_burst != loop_thread and alone == loop_thread


def test_an_inline_admission_raises_as_a_lane_would():
    def refuse(body: bytes):
        raise ValueError("bad body")

    with pytest.raises(ValueError, match="bad body"):
        asyncio.run(AdmitLanes(max_text=1, max_media=1).run(TEXT, refuse))


def test_a_full_lane_refuses_at_once_and_the_other_lane_goes_on():
    release = threading.Event()

    async def main():
        lanes = AdmitLanes(max_text=8, max_media=2)
        held = [asyncio.ensure_future(lanes.run(IMAGE, lambda b: release.wait(10))) for _ in "ab"]
        await asyncio.sleep(0.05)
        started = time.perf_counter()
        with pytest.raises(Overloaded, match="limits.max_admitting_media = 2"):
            await lanes.run(IMAGE, lambda b: None)
        refused_s = time.perf_counter() - started
        text = await lanes.run(TEXT, lambda b: "text")
        release.set()
        await asyncio.gather(*held)
        return refused_s, text

    refused_s, text = asyncio.run(main())
    assert refused_s < 1.0 and text == "text"  # at once: waiting would take the 10 s hold


def test_arrivals_beyond_both_lanes_are_refused_before_their_bodies_are_read():
    lanes = AdmitLanes(max_text=2, max_media=1)
    with lanes.arriving(), lanes.arriving(), lanes.arriving():
        with pytest.raises(Overloaded, match="max_admitting_text \\+ limits.max_admitting_media"):
            with lanes.arriving():
                pass
    assert lanes.num_arriving == 0
    with lanes.arriving():  # places come back however the request ended
        assert lanes.num_arriving == 1
