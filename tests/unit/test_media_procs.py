"""cluster/media/procs.py: media decoded in capped child processes, errors carried back intact,
dead or exhausted children replaced, and nothing of the decode left in this process."""

from __future__ import annotations

import base64
import io
import os
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from multiprocessing import Pipe

import numpy as np
import pytest
from PIL import Image

from cluster.config import LimitsConfig
from cluster.media.child import DecodeTask
from cluster.media.decoders import LimitsSnapshot, MediaOptions, decode_media
from cluster.media.errors import MediaError
from cluster.media.procs import DecodePool, PoolShape, _recv_array
from router.types import Modality
from tests.unit.test_media_budget import png

PARAM = "messages[0].content[1].image_url"


def task(url: str, limits: LimitsConfig = LimitsConfig()) -> DecodeTask:
    return DecodeTask(
        Modality.IMAGE, url, LimitsSnapshot.of(limits), PARAM, None, MediaOptions(), None, 0
    )


@pytest.fixture
def pool() -> Iterator[DecodePool]:
    pool = DecodePool(
        PoolShape(num_workers=1, max_memory_mb=1024, max_tasks_per_child=3, max_decode_s=60.0)
    )
    yield pool
    pool.shutdown()


def test_a_decode_runs_in_a_child_and_matches_decoding_here(pool: DecodePool) -> None:
    url = png(30, 20)
    reply, data = pool.decode(task(url))
    [pid] = pool.child_pids()
    assert pid != os.getpid()
    np.testing.assert_array_equal(
        data, decode_media(Modality.IMAGE, url, limits=LimitsConfig(), param=PARAM).data
    )
    assert data.flags.writeable and data.shape == (20, 30, 3)


def test_an_array_many_socket_buffers_long_arrives_whole_and_the_framing_stays_in_step() -> None:
    """The ingress reads a decoded array with os.readv, not Connection.recv_bytes_into (which
    copies it twice holding the GIL): the bytes and the next message must come through intact."""
    here, there = Pipe(duplex=True)
    data = np.random.default_rng(0).integers(0, 256, size=(2000, 1500, 3), dtype=np.uint8)
    with ThreadPoolExecutor(1) as sender:
        sent = sender.submit(lambda: (there.send_bytes(memoryview(data).cast("B")), there.send(7)))
        out = np.empty_like(data)
        _recv_array(here, memoryview(out).cast("B"))
        sent.result()
    assert np.array_equal(out, data) and here.recv() == 7
    there.send_bytes(b"x" * 10)
    with pytest.raises(OSError, match="10 bytes for a 12-byte array"):
        _recv_array(here, memoryview(bytearray(12)))


def test_a_media_error_in_the_child_arrives_as_the_same_media_error(pool: DecodePool) -> None:
    bad = "data:image/png;base64,AAAA"
    with pytest.raises(MediaError) as here:
        decode_media(Modality.IMAGE, bad, limits=LimitsConfig(), param=PARAM)
    with pytest.raises(MediaError) as there:
        pool.decode(task(bad))
    assert (there.value.message, there.value.param) == (here.value.message, here.value.param)
    big = LimitsConfig(max_image_pixels=100)
    with pytest.raises(MediaError, match="max_image_pixels|pixels") as limit:
        pool.decode(task(png(30, 20), big))
    assert limit.value.param == PARAM
    assert pool.decode(task(png(4, 4)))[1].shape == (4, 4, 3)  # the child survived its errors


def test_a_decode_over_the_memory_cap_is_refused_naming_the_limit_and_the_next_is_fine() -> None:
    small = DecodePool(
        PoolShape(num_workers=1, max_memory_mb=256, max_tasks_per_child=10, max_decode_s=60.0)
    )
    try:
        with pytest.raises(MediaError) as info:
            # 16 MP with an alpha band (Pillow's way, composited onto white): more than 256 MB
            # of address space to decode
            small.decode(task(rgba_png(4000, 4000)))
        assert "256 MB" in info.value.message and "max_decode_memory_mb" in info.value.message
        assert info.value.param == PARAM
        assert small.decode(task(png(8, 6)))[1].shape == (6, 8, 3)
    finally:
        small.shutdown()


def rgba_png(width: int, height: int) -> str:
    buffer = io.BytesIO()
    Image.new("RGBA", (width, height), (90, 20, 200, 128)).save(buffer, "PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def test_a_killed_child_fails_only_its_decode_and_is_replaced(pool: DecodePool) -> None:
    pool.decode(task(png(4, 4)))
    [victim] = pool.child_pids()
    os.kill(victim, signal.SIGKILL)
    with pytest.raises(MediaError, match="max_decode_memory_mb") as info:
        pool.decode(task(png(4, 4)))
    assert info.value.param == PARAM
    assert pool.decode(task(png(5, 4)))[1].shape == (4, 5, 3)
    assert victim not in pool.child_pids()


def test_children_are_recycled_after_their_share_of_tasks(pool: DecodePool) -> None:
    pool.decode(task(png(4, 4)))
    [first] = pool.child_pids()
    for _ in range(2):  # tasks 2 and 3: the third is its last
        pool.decode(task(png(4, 4)))
    [second] = pool.child_pids()
    assert second != first
    with pytest.raises(ProcessLookupError):
        os.kill(first, 0)


def test_shutdown_stops_the_children(pool: DecodePool) -> None:
    pool.decode(task(png(4, 4)))
    [pid] = pool.child_pids()
    pool.shutdown()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    with pytest.raises(RuntimeError, match="shut down"):
        pool.decode(task(png(4, 4)))


def test_a_hung_child_is_killed_at_the_deadline_naming_it_while_the_other_child_decodes() -> None:
    """A child stopped by SIGSTOP really hangs: its item fails at limits.max_decode_s, the
    child is killed and replaced, and the other child's decode is not held up by it."""
    deadline_s = 3.0
    two = DecodePool(
        PoolShape(
            num_workers=2, max_memory_mb=1024, max_tasks_per_child=10, max_decode_s=deadline_s
        )
    )
    try:
        with ThreadPoolExecutor(
            2
        ) as threads:  # both start a child before either finishes (a start takes a second)
            list(threads.map(lambda _: two.decode(task(png(4, 4))), range(2)))
        healthy, hung = (
            two.child_pids()
        )  # idle children are taken last first: one decode surely meets the hung one
        os.kill(hung, signal.SIGSTOP)
        started_s = time.monotonic()
        with ThreadPoolExecutor(2) as threads:
            futures = [threads.submit(_timed, two, started_s) for _ in range(2)]
            outcomes = sorted((f.result() for f in futures), key=lambda o: o[0])
        (ok_s, ok), (failed_s, failed) = outcomes
        assert isinstance(ok, tuple) and ok[1].shape == (4, 4, 3)
        assert ok_s < deadline_s <= failed_s < deadline_s + 10
        assert (
            isinstance(failed, MediaError)
            and "limits.max_decode_s" in failed.message
            and failed.param == PARAM
        )
        with pytest.raises(ProcessLookupError):  # killed, even though stopped
            os.kill(hung, 0)
        assert hung not in two.child_pids() and len(two.child_pids()) == 2  # replaced
        assert two.decode(task(png(5, 4)))[1].shape == (4, 5, 3)
    finally:
        two.shutdown()


def _timed(pool: DecodePool, started_s: float) -> tuple[float, object]:
    try:
        outcome: object = pool.decode(task(png(4, 4)))
    except MediaError as exc:
        outcome = exc
    return time.monotonic() - started_s, outcome
