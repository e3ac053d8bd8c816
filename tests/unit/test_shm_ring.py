"""The shared-memory ring beside a link (actors/shm_ring.py, actors/wire_pickle.py): what goes in
comes out once, in order, never overwritten before it is read; a full ring refuses rather than
overwrites; a reader attaches only to the segment it was offered; nothing is left in /dev/shm."""

from __future__ import annotations

import os
import pickle

import numpy as np
import pytest

from actors import shm_ring, wire_pickle
from actors.shm_ring import Region, RingOffer, RingReader, RingWriter


def epd_segments() -> set[str]:
    return {name for name in os.listdir(shm_ring.SHM_DIR) if name.startswith("epd_")}


@pytest.fixture()
def ring_pair():
    before = epd_segments()
    writer = RingWriter(1000)
    reader = RingReader.attach(writer.offer)
    assert epd_segments() == before  # the reader removed the name; both ends map the segment
    writer.unlink()  # as a link does once its offer is answered: harmless now
    yield writer, reader
    writer.close()
    reader.close()


def test_buffers_come_out_as_they_went_in_across_the_wrap(ring_pair):
    writer, reader = ring_pair
    rng = np.random.default_rng(0)
    for size in [300, 300, 300, 250, 999, 1, 700, 1000, 420, 420]:  # wraps several times
        sent = rng.integers(0, 256, size, dtype=np.uint8).tobytes()
        region = writer.put(memoryview(sent))
        assert region is not None and region.start % 1000 + size <= 1000
        got = reader.take(region)
        assert got == sent and isinstance(got, bytearray)


def test_a_full_ring_refuses_until_the_reader_takes(ring_pair):
    writer, reader = ring_pair
    first = writer.put(memoryview(b"a" * 600))
    assert writer.put(memoryview(b"b" * 500)) is None  # would overwrite what is unread
    assert writer.put(memoryview(b"c" * 1001)) is None  # larger than the ring
    second = writer.put(memoryview(b"d" * 400))
    assert reader.take(first) == b"a" * 600
    third = writer.put(memoryview(b"e" * 500))  # wraps into the room the take gave back
    assert third is not None and third.start % 1000 == 0
    assert reader.take(second) == b"d" * 400 and reader.take(third) == b"e" * 500


def test_a_region_the_writer_cannot_have_written_is_refused(ring_pair):
    writer, reader = ring_pair
    first, second = (writer.put(memoryview(bytes(300))) for _ in range(2))
    with pytest.raises(ValueError, match="cannot have written"):
        reader.take(Region(first.start, 1001))  # beyond the ring
    assert reader.take(second) == bytes(300)  # skipping ahead is allowed: its room is freed
    with pytest.raises(ValueError, match="cannot have written"):
        reader.take(first)  # behind the tail: already given back


def test_a_reader_attaches_only_to_the_segment_it_was_offered():
    writer = RingWriter(100)
    try:
        name, nonce = writer.offer
        assert RingReader.attach(RingOffer(name, bytes(16))) is None  # another's nonce
        assert RingReader.attach(RingOffer("epd_" + "0" * 16, nonce)) is None  # not here
        assert RingReader.attach(RingOffer("../etc/passwd", nonce)) is None  # not a ring's name
        assert RingReader.attach(RingOffer(name, nonce)) is not None
    finally:
        writer.unlink()
        writer.close()


def test_no_ring_where_dev_shm_lacks_room(monkeypatch):
    before = epd_segments()
    monkeypatch.setattr(shm_ring, "SHM_MIN_FREE_BYTES", 1 << 60)
    with pytest.raises(OSError, match="free in"):
        RingWriter.where_room(1000)
    assert epd_segments() == before


def test_large_buffers_go_beside_the_pickle_while_the_ring_has_room():
    writer = RingWriter(5 * wire_pickle.RING_MIN_BYTES // 2)
    reader = RingReader.attach(writer.offer)
    writer.unlink()
    big = np.arange(wire_pickle.RING_MIN_BYTES // 8, dtype=np.int64)  # exactly the threshold
    message = {"small": np.ones(10), "big": [big, big + 1], "more": big + 2}
    pickled = wire_pickle.dumps(message, writer)
    assert pickled.wants_ring and len(pickled.regions) == 2  # the third found no room
    assert len(pickled.data) < 2 * big.nbytes
    got = wire_pickle.loads(pickled.data, pickled.regions, reader)
    assert all(np.array_equal(a, b) for a, b in zip(got["big"], message["big"], strict=True))
    assert np.array_equal(got["more"], message["more"]) and got["big"][0].flags.writeable
    with pytest.raises(ValueError, match="does not have"):
        wire_pickle.loads(pickled.data, pickled.regions, None)
    alone = wire_pickle.dumps(message)  # no ring: everything inside, as before rings
    assert alone.wants_ring and alone.regions == ()
    assert np.array_equal(pickle.loads(alone.data)["more"], message["more"])
    assert not wire_pickle.dumps({"small": np.ones(10)}).wants_ring
    writer.close()
    reader.close()
