"""cluster/media/inflight.py: the ingress's budget for decoded media in flight. Items are charged
from their headers before they decode; one that does not fit waits in a queue bounded by count
and time, or is refused (429 with Retry-After; a 400 naming the limit when it could never fit);
every charge comes back however admission ends; text never waits for it."""

from __future__ import annotations

import asyncio
import base64
import gc
import io
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import numpy as np
import pytest
from PIL import Image
from pydantic import ValidationError

from actors.types import PixelRef
from cluster.admit_lanes import AdmitLanes, request_ended
from cluster.backpressure import Overloaded
from cluster.config import ClusterConfig, LimitsConfig
from cluster.errors import RequestError
from cluster.intake import Intake
from cluster.media.budget import PixelBudget
from cluster.media.child import DecodeTask
from cluster.media.decoders import LimitsSnapshot, MediaOptions, decode_media
from cluster.media.errors import MediaError
from cluster.media.inflight import MB, InFlightBudget, Ledger, MediaBusy, RequestGone
from cluster.media.procs import DecodePool, PoolShape
from cluster.prepare import ensure_model
from cluster.prompt_plan import PromptPlan, PromptPlanner
from cluster.protocol import MediaPart
from router.types import Modality
from tests.unit.test_media_budget import png
from tests.unit.test_request_path_media import wav

PARAM = "messages[0].content[0].image_url"


def wait_until(condition, within_s: float = 5.0) -> None:
    deadline = time.monotonic() + within_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


@pytest.fixture
def threads():
    with ThreadPoolExecutor(4) as pool:
        yield pool


def full(budget: InFlightBudget) -> Ledger:
    """A ledger holding the whole budget."""
    ledger = Ledger(budget)
    ledger.hold(budget.max_bytes, PARAM, "image")
    return ledger


# -- the budget's plain logic -------------------------------------------------------------------


def test_a_ledger_charges_and_gives_everything_back():
    budget = InFlightBudget(10 * MB, 4, 2.0)
    with Ledger(budget) as ledger:
        ledger.hold(3 * MB, PARAM, "image")
        ledger.hold(4 * MB, PARAM, "image")
        assert budget.in_flight == ledger.held == 7 * MB
        ledger.release_to(3 * MB)  # the second item is in the object store
        assert budget.in_flight == 3 * MB
    assert budget.in_flight == ledger.held == 0


def test_an_item_that_does_not_fit_waits_its_turn_first_come_first_served(threads):
    budget = InFlightBudget(10 * MB, 4, 5.0)
    holder = Ledger(budget)
    holder.hold(8 * MB, PARAM, "image")
    big, small = Ledger(budget), Ledger(budget)
    waiting_big = threads.submit(big.hold, 5 * MB, PARAM, "image")
    wait_until(lambda: budget.num_waiting == 1)
    waiting_small = threads.submit(small.hold, 1 * MB, PARAM, "image")
    wait_until(lambda: budget.num_waiting == 2)
    time.sleep(0.1)
    assert not waiting_small.done()  # it would fit, but it came after `big`
    holder.close()
    waiting_big.result(2)
    waiting_small.result(2)
    assert budget.in_flight == 6 * MB and budget.num_waiting == 0
    big.close()
    small.close()
    assert budget.in_flight == 0


def test_a_full_queue_refuses_at_once_naming_its_limit(threads):
    budget = InFlightBudget(10 * MB, 1, 5.0)
    holder = full(budget)
    waiter = Ledger(budget)
    waiting = threads.submit(waiter.hold, 1 * MB, PARAM, "image")
    wait_until(lambda: budget.num_waiting == 1)
    started = time.perf_counter()
    with pytest.raises(MediaBusy, match="limits.max_waiting_for_decoded_media"):
        Ledger(budget).hold(1 * MB, PARAM, "image")
    assert time.perf_counter() - started < 0.5
    no_queue = InFlightBudget(1 * MB, 0, 5.0)
    no_queue_holder = full(no_queue)
    with pytest.raises(MediaBusy):  # no queue at all: refused at once too
        Ledger(no_queue).hold(1, PARAM, "image")
    no_queue_holder.close()
    holder.close()
    waiting.result(2)
    waiter.close()
    assert budget.in_flight == 0


def test_a_wait_ends_after_its_time_with_nothing_charged():
    budget = InFlightBudget(10 * MB, 4, 0.2)
    holder = full(budget)
    ledger = Ledger(budget)
    started = time.perf_counter()
    with pytest.raises(MediaBusy, match=r"within 0.2 s \(limits.decoded_media_wait_s\)"):
        ledger.hold(1 * MB, PARAM, "image")
    assert 0.2 <= time.perf_counter() - started < 1.0
    assert budget.num_waiting == 0 and ledger.held == 0 and budget.in_flight == 10 * MB
    holder.close()


def test_an_item_larger_than_the_whole_budget_is_refused_by_name():
    budget = InFlightBudget(10 * MB, 4, 1.0)
    with pytest.raises(MediaError, match="limits.max_decoded_media_mb") as alone:
        Ledger(budget).hold(11 * MB, PARAM, "image")
    assert alone.value.param == PARAM and "11.0 MB" in alone.value.message
    ledger = Ledger(budget)
    ledger.hold(6 * MB, PARAM, "audio")
    with pytest.raises(MediaError, match="with the request's other media, 11.0 MB"):
        ledger.hold(5 * MB, PARAM, "video")
    ledger.close()
    assert budget.in_flight == 0


def test_a_request_that_holds_some_waits_for_more_only_first_in_line():
    # Requests that each held some and waited for more could wait on each other; one alone
    # waits, and keeps the items it already decoded.
    budget = InFlightBudget(10 * MB, 4, 5.0)
    other, ledger, second = Ledger(budget), Ledger(budget), Ledger(budget)
    other.hold(5 * MB, PARAM, "image")
    ledger.hold(3 * MB, PARAM, "audio")
    second.hold(1 * MB, PARAM, "image")
    with ThreadPoolExecutor(1) as pool:
        more = pool.submit(ledger.hold, 4 * MB, PARAM, "image")
        while budget.num_waiting == 0:
            time.sleep(0.01)
        started = time.perf_counter()
        with pytest.raises(MediaBusy):  # holds some, and one waits already: refused at once
            second.hold(1 * MB, PARAM, "image")
        assert time.perf_counter() - started < 0.5 and not more.done()
        other.close()  # room: the first in line gets it
        more.result(timeout=2)
    assert ledger.held == 7 * MB and budget.num_waiting == 0
    ledger.close()
    second.close()
    assert budget.in_flight == 0


def test_a_request_that_ends_while_waiting_stops_waiting(threads):
    budget = InFlightBudget(10 * MB, 4, 30.0)
    holder = full(budget)
    ended = threading.Event()
    ledger = Ledger(budget, ended)
    waiting = threads.submit(ledger.hold, 1 * MB, PARAM, "image")
    wait_until(lambda: budget.num_waiting == 1)
    ended.set()
    with pytest.raises(RequestGone):
        waiting.result(2)
    assert budget.num_waiting == 0 and ledger.held == 0
    with pytest.raises(RequestGone):  # and charges nothing more
        ledger.hold(1, PARAM, "image")
    holder.close()
    assert budget.in_flight == 0


def test_a_cancelled_admission_tells_its_thread():
    seen: list[bool] = []
    started = threading.Event()

    def admit(body: bytes) -> None:
        ended = request_ended()
        started.set()
        seen.append(ended.wait(5))

    async def main():
        lanes = AdmitLanes(max_text=4, max_media=4)
        task = asyncio.ensure_future(lanes.run(b'"image_url"', admit))
        await asyncio.get_running_loop().run_in_executor(None, started.wait, 5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    wait_until(lambda: seen)
    assert seen == [True] and request_ended() is None  # outside a lane: nobody to tell


# -- charged from the headers, in a decoding process or here --------------------------------------


def test_a_decoding_process_asks_before_it_decodes_and_stops_when_refused():
    pool = DecodePool(PoolShape(1, 1024, 8, 60.0))
    task = DecodeTask(
        Modality.IMAGE,
        png(30, 20),
        LimitsSnapshot.of(LimitsConfig()),
        PARAM,
        None,
        MediaOptions(),
        None,
        0,
        asks_hold=True,
    )
    try:
        asked = []
        _, data = pool.decode(task, lambda n, param, noun: asked.append((n, param, noun)))
        assert asked == [(30 * 20 * 3, PARAM, "image")] and data.shape == (20, 30, 3)
        [pid] = pool.child_pids()

        def refuse(n, param, noun):
            raise MediaBusy("no room")

        with pytest.raises(MediaBusy, match="no room"):
            pool.decode(task, refuse)
        assert pool.child_pids() == [pid]  # it stopped before decoding, and serves on
        assert pool.decode(task, lambda *a: None)[1].shape == (20, 30, 3)
    finally:
        pool.shutdown()


def test_audio_is_charged_its_samples_at_the_model_rate():
    asked = []
    budget = PixelBudget(1, lambda n, param, noun: asked.append((n, noun)))
    limits = LimitsConfig()
    decode_media(Modality.AUDIO, wav(1.0), limits=limits, param=PARAM, format="wav", budget=budget)
    assert asked == [(16_000 * 4, "audio")]  # 1 s at 16 kHz, float32


# -- the ingress's admission ---------------------------------------------------------------------


def intake(store=None, transport=None, **limits) -> Intake:
    config = ClusterConfig.model_validate(
        {
            "model": {"checkpoint": "/tmp/x", "served_name": "m"},
            "limits": limits,
            "transport": transport or {"inline_max_bytes": 0},  # every item stored
        }
    )
    planner = SimpleNamespace(
        spec=SimpleNamespace(
            modalities={Modality.IMAGE, Modality.AUDIO}, audio_sample_rate_hz=16_000
        ),
        check_item=lambda item: None,
    )
    return Intake(config, planner, store=store)


def image(width: int, height: int) -> MediaPart:
    return MediaPart(Modality.IMAGE, png(width, height), PARAM)


def test_images_go_to_the_store_as_they_decode_and_audio_after_the_plan():
    stored: list[np.ndarray] = []
    store = lambda array: stored.append(array) or f"ref-{len(stored)}"  # noqa: E731
    ingress = intake(store)
    held_at_each_charge = []
    with Ledger(ingress.media_budget) as ledger:
        charge = ledger.hold
        ledger.hold = lambda *a: held_at_each_charge.append(ledger.held) or charge(*a)
        parts = [image(40, 30), MediaPart(Modality.AUDIO, wav(), PARAM, format="wav"), image(8, 8)]
        first, audio, last = ingress._decode_media(parts, ledger)
        # the images' declared bytes first, then each item (images draw on that); stored items
        # stay charged: until prefill, the budget bounds the object store too
        images = 40 * 30 * 3 + 8 * 8 * 3
        assert held_at_each_charge == [0, images, images, images + 16_000 * 4]
        assert ledger.held == ingress.media_budget.in_flight == 3600 + 64_000 + 8 * 8 * 3
        assert (first.data_ref.ref, last.data_ref.ref, audio.data_ref) == ("ref-1", "ref-2", None)
        assert first.data.shape == (30, 40, 3) and first.data.strides == (0, 0, 0)  # no bytes
        assert stored[0].shape == (30, 40, 3) and stored[0].any()
        plan = ingress._stored(PromptPlan((1,), (), (), (first, audio, last)))
        assert [item.data_ref.ref for item in plan.items] == ["ref-1", "ref-3", "ref-2"]
    assert ingress.media_budget.in_flight == 0


@pytest.mark.parametrize(
    "transport, stored_sizes",
    [
        ({"inline_max_bytes": 3600}, [(30, 41, 3)]),  # the one above the bound is stored
        ({"inline_max_bytes": 3690}, []),  # both ride inside their encode calls
        ({"direct_links": False}, [(30, 40, 3), (30, 41, 3)]),  # the default bound, not in force
        ({"embeddings": "gloo"}, [(30, 40, 3), (30, 41, 3)]),
    ],
)
def test_items_small_enough_to_ride_in_their_call_skip_the_store(transport, stored_sizes):
    stored: list[np.ndarray] = []
    ingress = intake(lambda array: stored.append(array) or "ref", transport)
    with Ledger(ingress.media_budget) as ledger:
        small, large = ingress._decode_media([image(40, 30), image(41, 30)], ledger)
        assert ledger.held == 3600 + 3690  # inline or stored, charged alike until prefill
    assert [array.shape for array in stored] == stored_sizes
    for item in (small, large):
        if item.data_ref is None:  # the pixels stay in the item, whole (not a stand-in)
            assert item.data.strides[0] > 0 and item.data.any(), item.data.strides


@pytest.mark.parametrize(
    "transport", [{"direct_links": False}, {"embeddings": "gloo", "kv": "gloo"}]
)
def test_an_inline_bound_where_nothing_inlines_is_refused_by_name(transport):
    """With embeddings over gloo but KV over the object store the bound still applies (to the
    KV's way to decode), so only where neither rides the links is it refused."""
    with pytest.raises(ValidationError, match="inline_max_bytes"):
        intake(transport={**transport, "inline_max_bytes": 4096})
    intake(transport={**transport, "inline_max_bytes": 0})  # never inline: says what happens


def test_stored_media_stays_charged_until_every_choice_released_then_lets_its_pixels_go():
    budget = InFlightBudget(100, 0, 1.0)
    refs = [PixelRef("a"), PixelRef("b")]
    with Ledger(budget) as ledger:
        ledger.hold(60, PARAM, "image")
        kept = ledger.keep(refs, range(2))
    assert budget.in_flight == 60 and not kept.released  # admission ended; the charge did not
    kept.release(0)
    kept.release(0)  # a choice's second prefill (a retry) is not another choice's
    assert budget.in_flight == 60 and [r.ref for r in refs] == ["a", "b"]
    kept.release(1)
    assert budget.in_flight == 0 and kept.released and [r.ref for r in refs] == [None, None]
    kept.release(1)
    assert budget.in_flight == 0


def test_stored_media_of_a_request_that_never_ran_comes_back_when_it_is_collected():
    budget = InFlightBudget(100, 0, 1.0)
    with Ledger(budget) as ledger:
        ledger.hold(40, PARAM, "image")
        kept = ledger.keep([PixelRef("a")], range(1))
    assert budget.in_flight == 40
    del kept
    gc.collect()
    assert budget.in_flight == 0


def test_a_retry_after_the_release_decodes_and_stores_the_media_again(ckpt):
    stored: list[np.ndarray] = []
    store = lambda array: stored.append(array) or f"ref-{len(stored)}"  # noqa: E731
    config = {"model": {"checkpoint": str(ckpt), "served_name": "m"}}
    config["transport"] = {"inline_max_bytes": 0}  # stored, however small
    ingress = Intake(ensure_model(ClusterConfig.model_validate(config)), PromptPlanner(ckpt), store)
    content = [{"type": "image_url", "image_url": {"url": png(40, 30)}}]
    content.append({"type": "text", "text": "what?"})
    body = {"model": "m", "messages": [{"role": "user", "content": content}], "n": 2}
    adm = ingress.admit(json.dumps(body).encode(), "r", 0.0)
    first, second = adm.choices()
    assert ingress.media_budget.in_flight == 40 * 30 * 3 and len(stored) == 1
    first.release_media()
    assert not second.media_released  # the other choice still needs them
    second.release_media()
    assert first.media_released and ingress.media_budget.in_flight == 0
    again = ingress.reload_media(first)
    assert len(stored) == 2 and np.array_equal(stored[0], stored[1])
    assert again.plan.token_ids == first.plan.token_ids
    assert [i.identifier for i in again.plan.items] == [i.identifier for i in first.plan.items]
    assert again.plan.items[0].data_ref.ref == "ref-2" and not again.media_released
    assert ingress.media_budget.in_flight == 40 * 30 * 3
    again.release_media()
    assert ingress.media_budget.in_flight == 0


def test_a_request_whose_images_do_not_fit_is_refused_before_any_decodes():
    ingress = intake(lambda array: "ref", max_waiting_for_decoded_media=0)
    holder = Ledger(ingress.media_budget)
    holder.hold(ingress.media_budget.max_bytes - 5000, PARAM, "image")  # room for one 40x40
    charged = []
    with pytest.raises(Overloaded):
        with Ledger(ingress.media_budget) as ledger:
            hold = ledger.hold
            ledger.hold = lambda *a: charged.append(a[0]) or hold(*a)
            ingress._decode_media([image(40, 40), image(40, 40)], ledger)
    assert charged == [2 * 40 * 40 * 3]  # the declared bytes alone: no item began to decode
    holder.close()
    assert ingress.media_budget.in_flight == 0


@pytest.mark.parametrize("where", ["decoding", "storing"])
def test_a_failed_admission_gives_its_charges_back(where):
    def store(array):
        raise OSError("object store full")

    noise = np.random.default_rng(3).integers(0, 256, (64, 64, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(noise).save(buf, "PNG")
    broken = "data:image/png;base64," + base64.b64encode(buf.getvalue()[:300]).decode()
    if where == "decoding":  # no store: the first item is held too when the second fails
        ingress, parts = intake(), [image(16, 16), MediaPart(Modality.IMAGE, broken, PARAM)]
    else:
        ingress, parts = intake(store), [image(16, 16)]
    charged = []
    with pytest.raises((RequestError, OSError)):
        with Ledger(ingress.media_budget) as ledger:
            hold = ledger.hold
            ledger.hold = lambda *a: charged.append(a[0]) or hold(*a)
            ingress._decode_media(parts, ledger)
    # the images' declared bytes, then each item: all given back
    assert len(charged) == len(parts) + 1 and ingress.media_budget.in_flight == 0


def test_an_overfull_budget_is_a_429_with_retry_after_and_an_oversize_item_a_400():
    from cluster.errors import error_response
    from cluster.serving import Serving

    ingress = intake(
        max_decoded_media_mb=1, max_image_pixels=300_000, max_waiting_for_decoded_media=0
    )
    holder = Ledger(ingress.media_budget)
    holder.hold(MB - 100, PARAM, "image")
    with pytest.raises(Overloaded) as busy:
        with Ledger(ingress.media_budget) as ledger:
            ingress._decode_media([image(20, 20)], ledger)
    response = error_response(Serving.overloaded(ingress, busy.value))
    body = json.loads(response.body)
    assert response.status_code == 429 and response.headers["retry-after"] == "1"
    assert "limits.max_decoded_media_mb" in body["error"]["message"]
    holder.close()
    clip = MediaPart(Modality.AUDIO, wav(20.0), PARAM, format="wav")  # 20 s: 1.2 MB at 16 kHz
    with pytest.raises(RequestError) as oversize:
        with Ledger(ingress.media_budget) as ledger:
            ingress._decode_media([clip], ledger)
    assert oversize.value.status == 400 and "limits.max_decoded_media_mb" in oversize.value.message
    assert ingress.media_budget.in_flight == 0
