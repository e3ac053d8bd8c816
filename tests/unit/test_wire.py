"""Direct links (actors/wire.py, actors/worker_links.py) on a real loopback socket, no Ray
cluster: streams end with their reader, calls answer out of order, a cancelled call is
cancelled in the worker, a broken link fails what waits on it, a stranger is refused."""

from __future__ import annotations

import asyncio
import dataclasses
import warnings
from collections import Counter
from types import SimpleNamespace

import numpy as np
import pytest
import ray
import ray.exceptions as rx

from actors import wire, wire_pickle
from actors.runtime import ModelWorker
from actors.worker_links import WorkerLinks
from tests.unit import test_shm_ring


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, timeout=10))


class Worker:
    """A worker's link end: a stream of what is put in `queue`, and a few calls."""

    def __init__(self):
        self.queue: asyncio.Queue = asyncio.Queue()
        self.stream_closed = asyncio.Event()
        self.cancelled = asyncio.Event()
        self.server = wire.LinkServer("127.0.0.1", self.stream, self.call)

    async def stream(self, argument):
        try:
            while True:
                yield (argument, await self.queue.get())
        finally:
            self.stream_closed.set()

    async def call(self, method: str, args: tuple):
        if method == "echo_after":
            delay_s, value = args
            await asyncio.sleep(delay_s)
            return value
        if method == "fail":
            raise ValueError("bad request: " + args[0])
        if method == "unpicklable":
            raise _Unpicklable()
        if method == "hang":
            try:
                await asyncio.sleep(60)
            except asyncio.CancelledError:
                self.cancelled.set()
                raise
        raise AssertionError(method)


class _Unpicklable(Exception):
    def __reduce__(self):
        raise TypeError("no pickling here")


def test_a_stream_carries_messages_in_order_and_ends_with_its_reader():
    async def main():
        worker = Worker()
        messages = await wire.open_stream(await worker.server.address(), "replica-a")
        for i in range(3):
            worker.queue.put_nowait(i)
        assert [await anext(messages) for _ in range(3)] == [("replica-a", i) for i in range(3)]
        await messages.aclose()  # the reader leaves while the worker's stream waits
        await asyncio.wait_for(worker.stream_closed.wait(), timeout=5)

    run(main())


def test_calls_are_answered_out_of_order_and_raise_the_workers_exception():
    async def main():
        worker = Worker()
        link = await wire.CallLink.open(await worker.server.address())
        slow = asyncio.ensure_future(link.call("echo_after", 0.2, "slow"))
        assert await link.call("echo_after", 0.0, "fast") == "fast"
        assert not slow.done()
        assert await slow == "slow"
        with pytest.raises(ValueError, match="bad request: x"):
            await link.call("fail", "x")
        with pytest.raises(RuntimeError, match="_Unpicklable"):
            await link.call("unpicklable")
        assert await link.call("echo_after", 0.0, 7) == 7  # the link survived them all
        link.close()

    run(main())


def test_tensors_cross_a_link_as_arrays_exact_and_writable():
    """A CPU tensor travels as its array (not through torch.save's archive), whatever its dtype
    (bfloat16 as its bits) or strides, and arrives equal, of its dtype, and writable."""
    import torch

    sent = [
        torch.randn(49, 64),
        torch.randn(3, 5, dtype=torch.float64).t(),
        torch.randn(4, 6).to(torch.bfloat16),
        torch.arange(12).view(3, 4)[:, 1:],
        torch.tensor(2.5, dtype=torch.float16),
        torch.zeros(0, 3, dtype=torch.bool),
        torch.randn(2, 2, requires_grad=True),
    ]

    async def main():
        worker = Worker()
        link = await wire.CallLink.open(await worker.server.address())
        back = await link.call("echo_after", 0.0, sent)
        link.close()
        return back

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch warns of a tensor over a read-only array
        received = run(main())
    for tensor, got in zip(sent, received, strict=True):
        assert got.dtype == tensor.dtype and got.shape == tensor.shape
        assert torch.equal(got, tensor.detach())
    frame = wire_pickle.dumps(sent).data
    assert b"_rebuild_tensor" not in frame and b"_tensor_of" in frame


def _large_calls(worker: Worker, num_calls: int, ring: bool = True):
    """`num_calls` calls together (more than a ring holds at once), each echoing a tensor and
    an array too large for a frame's inside, after one that makes the link offer its ring
    (unless `ring` is off): what was sent, what came back, and how far the link's ring was
    written (None: no ring)."""
    import torch

    async def main():
        link = await wire.CallLink.open(await worker.server.address(), ring=ring)
        await link.call("echo_after", 0.0, torch.zeros(1 << 15))
        if link._ring_offer is not None:
            await link._ring_offer
        assert (link._ring_offer is not None) == ring  # off: never offered
        sent = [(torch.randn(300, 300), np.arange(n * 10_000)) for n in range(1, num_calls + 1)]
        got = await asyncio.gather(*(link.call("echo_after", 0.01, value) for value in sent))
        written = link._ring._head if link._ring is not None else None
        link.close()
        assert link._ring is None
        return sent, got, written

    return run(main())


def test_large_buffers_cross_a_same_node_link_through_its_ring_exact_and_writable():
    import torch

    before, worker = test_shm_ring.epd_segments(), Worker()
    sent, got, written = _large_calls(worker, 12)
    assert written  # the calls' buffers went through the ring, as the worker counts them
    assert 360_000 <= worker.server.num_ring_bytes <= written
    assert test_shm_ring.epd_segments() == before  # named only until the worker attached
    for (tensor, array), (got_tensor, got_array) in zip(sent, got, strict=True):
        assert torch.equal(got_tensor, tensor) and np.array_equal(got_array, array)
        assert got_array.flags.writeable


@pytest.mark.parametrize("why", ["a worker on another node", "transport.shared_memory off"])
def test_buffers_stay_in_the_frames_where_no_ring_is_shared(why, monkeypatch):
    before = test_shm_ring.epd_segments()
    elsewhere = why == "a worker on another node"
    if elsewhere:  # the worker cannot attach the offered segment
        monkeypatch.setattr(wire.RingReader, "attach", classmethod(lambda cls, offer: None))
    worker = Worker()
    sent, got, written = _large_calls(worker, 3, ring=elsewhere)
    assert written is None and test_shm_ring.epd_segments() == before
    assert worker.server.num_ring_bytes == 0
    assert all(np.array_equal(g[1], s[1]) for s, g in zip(sent, got, strict=True))


async def _hanging(worker: Worker):
    """A link to `worker` and a call on it that runs until cancelled."""
    link = await wire.CallLink.open(await worker.server.address())
    waiting = asyncio.ensure_future(link.call("hang"))
    await asyncio.sleep(0.05)
    return link, waiting


def test_a_call_its_caller_stops_waiting_for_is_cancelled_in_the_worker():
    async def main():
        worker = Worker()
        link, waiting = await _hanging(worker)
        waiting.cancel()
        await asyncio.wait_for(worker.cancelled.wait(), timeout=5)
        link.close()

    run(main())


def test_a_broken_link_fails_every_waiting_call_and_every_later_one():
    async def main():
        worker = Worker()
        link, waiting = await _hanging(worker)
        link._writer.transport.abort()  # the connection is cut, as when the worker dies
        with pytest.raises(wire.LinkClosed):
            await waiting
        with pytest.raises(wire.LinkClosed):
            await link.call("echo_after", 0.0, 1)

    run(main())


def test_a_peer_without_the_token_is_not_served():
    async def main():
        worker = Worker()
        address = await worker.server.address()
        stranger = dataclasses.replace(address, token="0" * 32)
        messages = await wire.open_stream(stranger, "replica-a")
        worker.queue.put_nowait(1)
        with pytest.raises(wire.LinkClosed):
            await anext(messages)

    run(main())


def test_a_stranger_sending_a_pickle_first_is_never_unpickled():
    async def main():
        worker = Worker()
        address = await worker.server.address()
        reader, writer = await asyncio.open_connection(address.host, address.port)
        wire.write_frame(writer, (address.token, wire.LinkKind.CALL, None))  # no raw token
        assert await asyncio.wait_for(reader.read(), timeout=5) == b""  # hung up on
        assert worker.server._calls == {}

    run(main())


def test_an_address_nobody_listens_on_is_refused_at_once():
    async def main():
        worker = Worker()
        address = await worker.server.address()
        worker.server._server.close()
        await worker.server._server.wait_closed()
        with pytest.raises(wire.LinkClosed, match="cannot reach"):
            await wire.open_stream(address, "replica-a")

    run(main())


def test_only_a_workers_declared_methods_can_be_called_over_a_link():
    async def prefill(value):
        return value

    worker = SimpleNamespace(
        LINKED_CALLS=frozenset({"prefill"}),
        prefill=prefill,
        drop=prefill,
        num_linked_calls=Counter(),
    )
    assert run(ModelWorker._linked_call(worker, "prefill", (3,))) == 3
    with pytest.raises(ValueError, match="'drop' cannot be called"):
        run(ModelWorker._linked_call(worker, "drop", (3,)))
    assert worker.num_linked_calls == {"prefill": 1}  # what came over links, by method


class Handle:
    """What WorkerLinks needs of a Ray actor handle, without Ray: its id, the address call,
    and the Ray path for the fallback."""

    def __init__(self, address):
        self._actor_id = ray.ActorID.from_random()
        self.address, self.ray_calls = address, []
        self.link_address = SimpleNamespace(remote=self._address)
        self.echo_after = SimpleNamespace(remote=self._over_ray)

    async def _address(self):
        return self.address

    async def _over_ray(self, *args):
        self.ray_calls.append(args)
        return args[-1]


def test_worker_links_answer_as_ray_would_and_reopen_after_a_break():
    async def main():
        worker = Worker()
        handle = Handle(await worker.server.address())
        links = WorkerLinks()
        assert await links.call(handle, "echo_after", 0.0, "a") == "a"
        with pytest.raises(rx.RayTaskError) as failed:
            await links.call(handle, "fail", "y")
        assert isinstance(failed.value.cause, ValueError)
        link = await links._links[handle._actor_id.hex()]
        link._writer.transport.abort()
        await asyncio.sleep(0.05)
        assert link.failure is not None
        assert await links.call(handle, "echo_after", 0.0, "b") == "b"  # a new link
        assert handle.ray_calls == []
        links.close()

    run(main())


@pytest.mark.parametrize("ring", [True, False], ids=["shared_memory", "frames_only"])
def test_worker_links_pass_the_shared_memory_setting_to_each_link(ring):
    """transport.shared_memory reaches the links an ingress or an encoder opens: the worker
    counts ring bytes only where it is on."""
    big = np.arange(1 << 15)  # 256 kB: a buffer the ring takes

    async def main():
        worker = Worker()
        handle = Handle(await worker.server.address())
        links = WorkerLinks(ring=ring)
        await links.call(handle, "echo_after", 0.0, big)  # offers the ring where it is on
        if (offer := (await links._links[handle._actor_id.hex()])._ring_offer) is not None:
            await offer
        assert np.array_equal(await links.call(handle, "echo_after", 0.0, big), big)
        links.close()
        return worker.server.num_ring_bytes

    assert (run(main()) > 0) == ring


def test_a_broken_link_under_a_call_names_the_actor():
    async def main():
        worker = Worker()
        handle = Handle(await worker.server.address())
        links = WorkerLinks()
        waiting = asyncio.ensure_future(links.call(handle, "hang"))
        await asyncio.sleep(0.05)
        (await links._links[handle._actor_id.hex()])._writer.transport.abort()
        with pytest.raises(rx.ActorUnavailableError) as lost:
            await waiting
        assert lost.value.actor_id == handle._actor_id.hex()

    run(main())


def test_a_worker_whose_link_cannot_connect_is_called_over_ray():
    async def main():
        worker = Worker()
        handle = Handle(await worker.server.address())
        worker.server._server.close()
        await worker.server._server.wait_closed()
        links = WorkerLinks()
        assert await links.call(handle, "echo_after", 0.0, "c") == "c"
        assert handle.ray_calls == [(0.0, "c")]
        assert await WorkerLinks(direct=False).call(handle, "echo_after", 0.0, "d") == "d"

    run(main())
