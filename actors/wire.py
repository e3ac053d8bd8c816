"""Direct TCP links for control messages between an ingress replica and a worker.

A Ray actor call or streaming item costs about a millisecond of latency and a few hundred
microseconds of CPU on each side (its RPCs, its threads, cloudpickle); a decode step's
message or a prefill call's answer is a few kB of plain data. Over a link of its own it is a
length-prefixed pickle on an asyncio stream: tens of microseconds. Tensors travel here only
when small enough to inline (transport.inline_max_bytes: a small image's pixels in its encode
call, its embeddings in the encoder's push); the rest stay on the object store or RDT. A
call's buffers of 64 kB and more go beside its frame, through a ring of shared memory
(actors/shm_ring.py) that the caller offers on its first such call and uses once the worker,
on the same node, has attached. Ray still starts, places and watches the actors: a link is
only a faster road between two live ones.

The worker listens on its node's address (`LinkServer`); the ingress learns the address and
a one-time token through a Ray call, connects, and names what it wants in its first frame:
a stream of a worker's messages (`STREAM`) or calls (`CALL`, several in flight on one link).
A link that breaks ends its stream and fails its calls with `LinkClosed`, as a dead actor's
would; callers treat both alike.

Plain asyncio and pickle: no Ray, and torch only where a tensor is sent or received.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import pickle
import secrets
import struct
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from enum import Enum

from actors.shm_ring import Region, RingOffer, RingReader, RingWriter
from actors.wire_pickle import Pickled, dumps, loads

log = logging.getLogger(__name__)
_HEADER = struct.Struct("!II")  # a frame: its pickle's length, its number of ring regions
_REGION = struct.Struct("!QQ")  # then each region (start, length); then the pickle
MAX_REGIONS = 4096
TOKEN_CHARS = 32
MAX_FRAME_BYTES = 64 << 20  # a control message is kB; anything near this is a broken peer


class LinkKind(str, Enum):
    STREAM = "stream"  # the worker writes messages until the ingress goes away
    CALL = "call"  # the ingress sends (call id, method, args); the worker answers each


CANCEL = ""  # a call frame with this method: the caller stopped waiting for that call id
RING_OFFER = "\0ring"  # one with this: the caller's ring (actors/shm_ring.py); answered attached
RING_BYTES = 4 << 20  # a caller's ring: a few calls' pixels or KV in flight at once


class LinkClosed(ConnectionError):
    """The link broke: its worker died, or its connection was cut."""


@dataclass(frozen=True)
class LinkAddress:
    host: str
    port: int
    token: str  # proves the peer learnt the address from the worker (through Ray)


def write_frame(writer: asyncio.StreamWriter, message, ring: RingWriter | None = None) -> Pickled:
    """`message` on its way: a header (its pickle's length, its buffers in `ring`), the
    buffers' regions, the pickle."""
    pickled = dumps(message, ring)
    regions = b"".join(_REGION.pack(*region) for region in pickled.regions)
    writer.write(_HEADER.pack(len(pickled.data), len(pickled.regions)) + regions + pickled.data)
    return pickled


async def read_frame(reader: asyncio.StreamReader, ring: RingReader | None = None):
    try:
        size, num_regions = _HEADER.unpack(await reader.readexactly(_HEADER.size))
        if size > MAX_FRAME_BYTES or num_regions > MAX_REGIONS:
            raise LinkClosed(f"a frame of {size} bytes, {num_regions} regions: not a link peer")
        regions = await reader.readexactly(num_regions * _REGION.size) if num_regions else b""
        data = await reader.readexactly(size)
        return loads(data, [Region(*r) for r in _REGION.iter_unpack(regions)], ring)
    except (asyncio.IncompleteReadError, ConnectionError, OSError) as exc:
        raise LinkClosed(str(exc) or type(exc).__name__) from None


Streamer = Callable[[object], AsyncIterator]  # (hello argument) -> messages to write
Caller = Callable[[str, tuple], Awaitable]  # (method, args) -> its answer


class LinkServer:
    """A worker's end: accepts links on its node's address, serving streams and calls."""

    def __init__(self, host: str, streamer: Streamer | None = None, caller: Caller | None = None):
        self._host, self._streamer, self._caller = host, streamer, caller
        self._token = secrets.token_hex(TOKEN_CHARS // 2)
        self._server: asyncio.Server | None = None
        self._calls: dict[tuple[int, int], asyncio.Task] = {}  # (link, call id) -> its task
        self.num_sent = 0  # stream messages and call answers written, for the worker's stats
        self._rings: set[RingReader] = set()  # callers' rings attached on live links
        self._closed_ring_bytes = 0

    @property
    def num_ring_bytes(self) -> int:
        """Bytes callers handed over through shared-memory rings rather than in frames."""
        return self._closed_ring_bytes + sum(ring.num_taken_bytes for ring in self._rings)

    async def address(self) -> LinkAddress:
        """Listen (once) and say where."""
        if self._server is None:
            self._server = await asyncio.start_server(self._accept, self._host, 0)
        port = self._server.sockets[0].getsockname()[1]
        return LinkAddress(self._host, port, self._token)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            # The token comes first and raw: nothing from a peer is unpickled before it proves
            # it learnt the address from the worker.
            token = await asyncio.wait_for(reader.readexactly(TOKEN_CHARS), timeout=10)
            if not secrets.compare_digest(token, self._token.encode()):
                return
            kind, argument = await read_frame(reader)
            if kind == LinkKind.STREAM and self._streamer is not None:
                await self._serve_stream(self._streamer(argument), reader, writer)
            elif kind == LinkKind.CALL and self._caller is not None:
                await self._serve_calls(reader, writer)
        except (LinkClosed, ConnectionError, asyncio.TimeoutError, asyncio.IncompleteReadError):
            pass  # a peer that is gone, or one that never sent its token: nothing to answer
        except Exception:  # noqa: BLE001 - a peer with the token: ours to find out about
            log.exception("a link to this worker failed")
        finally:
            writer.close()

    async def _serve_calls(self, reader, writer) -> None:
        """Each call in a task of its own; a cancel frame cancels its call, as a cancelled Ray
        call would be; calls still running when the link breaks are cancelled too."""
        link, ring = id(writer), None
        try:
            while True:
                call_id, method, args = await read_frame(reader, ring)
                if method == CANCEL:
                    if (task := self._calls.get((link, call_id))) is not None:
                        task.cancel()
                elif method == RING_OFFER:  # the caller's ring, read here if on this node
                    offered = RingReader.attach(RingOffer(*args)) if ring is None else None
                    ring = ring or offered  # one a link: a second offer is declined
                    if offered is not None:
                        self._rings.add(offered)
                    write_frame(writer, (call_id, True, offered is not None))
                else:
                    task = asyncio.create_task(self._answer(writer, call_id, method, args))
                    self._calls[(link, call_id)] = task
                    task.add_done_callback(lambda _, k=(link, call_id): self._calls.pop(k, None))
        finally:
            if ring is not None:
                self._rings.discard(ring)
                self._closed_ring_bytes += ring.num_taken_bytes
                ring.close()
            for (owner, _), task in list(self._calls.items()):
                if owner == link:
                    task.cancel()

    async def _answer(self, writer, call_id: int, method: str, args: tuple) -> None:
        try:
            answer = (call_id, True, await self._caller(method, args))
        except Exception as exc:  # noqa: BLE001 - the caller's to raise, as Ray would
            answer = (call_id, False, _portable(exc))
        if not writer.is_closing():
            write_frame(writer, answer)
            self.num_sent += 1

    async def _serve_stream(self, messages: AsyncIterator, reader, writer) -> None:
        """Write `messages` until the peer leaves (its end reads as EOF), however idle."""
        gone = asyncio.ensure_future(reader.read(1))
        try:
            while True:
                following = asyncio.ensure_future(anext(messages))
                await asyncio.wait((following, gone), return_when=asyncio.FIRST_COMPLETED)
                if not following.done():
                    following.cancel()
                    return
                write_frame(writer, following.result())  # StopAsyncIteration ends it
                self.num_sent += 1
                await writer.drain()  # a reader that fell behind holds the next message
        except StopAsyncIteration:
            return
        finally:
            gone.cancel()


def _portable(exc: Exception) -> Exception:
    """`exc` if it pickles, else a RuntimeError that names it."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:  # noqa: BLE001 - whatever failed, the name still travels
        return RuntimeError(repr(exc))


async def _connect(address: LinkAddress, kind: LinkKind, argument=None):
    try:
        reader, writer = await asyncio.open_connection(address.host, address.port)
    except OSError as exc:
        raise LinkClosed(f"cannot reach {address.host}:{address.port}: {exc}") from None
    writer.write(address.token.encode())
    write_frame(writer, (kind, argument))
    return reader, writer


async def open_stream(address: LinkAddress, argument) -> AsyncIterator:
    """The worker's messages for `argument`, until the link breaks (`LinkClosed`); connected
    before it returns, so an unreachable worker raises here."""
    reader, writer = await _connect(address, LinkKind.STREAM, argument)
    return _frames(reader, writer)


async def _frames(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> AsyncIterator:
    try:
        while True:
            yield await read_frame(reader)
    finally:
        writer.close()


class CallLink:
    """The ingress's end of a link for calls: several in flight, answered in any order."""

    def __init__(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, ring: bool = True
    ):
        self._writer = writer
        self._ids = itertools.count()
        self._waiting: dict[int, asyncio.Future] = {}
        self.failure: LinkClosed | None = None
        self._reader = asyncio.create_task(self._read(reader))
        self._ring: RingWriter | None = None  # shared with the worker once it attached
        self._ring_offer: asyncio.Task | None = None  # made on the first large buffer
        self._offers_ring = ring  # False: large buffers stay in frames (transport.shared_memory)

    @classmethod
    async def open(cls, address: LinkAddress, ring: bool = True) -> CallLink:
        return cls(*await _connect(address, LinkKind.CALL), ring=ring)

    async def call(self, method: str, *args):
        """The worker's answer; its exception raised here; `LinkClosed` if the link broke."""
        if self.failure is not None:
            raise self.failure
        call_id = next(self._ids)
        future = self._waiting[call_id] = asyncio.get_running_loop().create_future()
        pickled = write_frame(self._writer, (call_id, method, args), self._ring)
        if pickled.wants_ring and self._offers_ring and self._ring_offer is None:
            self._ring_offer = asyncio.create_task(self._share_ring())
        try:
            return await future
        except asyncio.CancelledError:
            if not self._writer.is_closing():
                write_frame(self._writer, (call_id, CANCEL, ()))
            raise
        finally:
            self._waiting.pop(call_id, None)  # answered, or its caller stopped waiting

    async def _share_ring(self) -> None:
        """Offer the worker a ring for this link's large buffers; use it once it attached."""
        try:
            ring = RingWriter.where_room(RING_BYTES)
        except OSError as exc:
            log.info("no shared-memory ring for a link (%s): buffers stay in frames", exc)
            return
        try:
            attached = await self.call(RING_OFFER, *ring.offer)
        except LinkClosed:
            attached = False
        finally:
            ring.unlink()
        if attached and self.failure is None:
            self._ring = ring
        else:
            ring.close()

    async def _read(self, reader: asyncio.StreamReader) -> None:
        try:
            while True:
                call_id, ok, value = await read_frame(reader)
                future = self._waiting.get(call_id)
                if future is None or future.done():
                    continue  # its caller left
                future.set_result(value) if ok else future.set_exception(value)
        except LinkClosed as exc:
            self._fail(exc)
        except Exception as exc:  # noqa: BLE001 - a frame that is not an answer breaks the link
            self._fail(LinkClosed(f"a broken answer: {exc!r}"))

    def close(self) -> None:
        """Fail what waits and hang up (a replica retiring its fleet)."""
        self._reader.cancel()
        self._fail(LinkClosed("closed by this end"))

    def _fail(self, failure: LinkClosed) -> None:
        self.failure = self.failure or failure
        for future in self._waiting.values():
            if not future.done():
                future.set_exception(self.failure)
        self._writer.close()
        if self._ring is not None:
            self._ring.close()
            self._ring = None
