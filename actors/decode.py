"""Decode worker: the Ray actor around `DecodeEngine` (actors/engine/decode.py).

Requests join and leave the running batch between steps, which a device thread of its own
runs back to back while any row is active. Outputs go out as one message per step to each
ingress replica (`stream`), carrying every chunk of that replica's requests: no Ray object
per token or per request.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections import deque
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import ray

from actors.inbox import TensorInbox
from actors.runtime import ModelWorker, WorkerLoad, WorkerSpec
from actors.types import DecodeBatch, DecodeOutput, DecodeRequest, FinishReason, TokenChunk
from router.worker_settings import DecodeSettings

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)


class _Outbox:
    """One ingress replica's outputs, kept until its stream takes them."""

    def __init__(self) -> None:
        self.outputs: list[DecodeOutput] = []
        self.ready = asyncio.Event()
        self.reader = 0  # the newest stream's number: an older one stops reading

    def put(self, output: DecodeOutput) -> None:
        self.outputs.append(output)
        self.ready.set()

    def take(self) -> tuple[DecodeOutput, ...]:
        self.ready.clear()
        out, self.outputs = tuple(self.outputs), []
        return out


class DecodeWorker(ModelWorker):
    LINKED_CALLS = frozenset({"submit"})  # a small KV rides in the call (request_path.py)

    def __init__(self, spec: WorkerSpec, settings: DecodeSettings):
        from actors.engine.decode import DecodeEngine  # in the worker only (runtime.py)
        from actors.engine.lm_runner import LMRunner
        from actors.models.adapter import Part

        super().__init__(spec, Part.LANGUAGE_MODEL)
        self.settings = settings
        self.engine = DecodeEngine(LMRunner(self.adapter), settings, spec.max_model_len)
        self.inbox = TensorInbox()  # packed KV from prefill, until submit() claims it
        self._outboxes: dict[str, _Outbox] = {}  # by owner (ingress replica tag)
        self._owner_of: dict[str, str] = {}  # request id -> owner, while its stream is open
        self._done: deque[DecodeOutput] = deque()  # step outputs, until the event loop takes them
        self.num_messages = 0

    async def receive(self, request_id: str, slot: int, packed_kv: torch.Tensor) -> None:
        self.inbox.put(request_id, packed_kv)  # dropped at once if the request was aborted

    async def submit(
        self, request: DecodeRequest, packed_kv: torch.Tensor | None = None, owner: str = ""
    ) -> bool:
        """Queue a request whose first token prefill produced; its chunks go out on `owner`'s
        stream. False if it was aborted before it came (nothing is kept then).

        Over the object store the KV comes as this call's argument, so it lives only as
        long as the call. Over RDT it was `receive`d first (transfers into an actor must be
        ordered) and is claimed here."""
        if self.inbox.is_closed(request.request_id):
            return False
        self._owner_of[request.request_id] = owner
        self._outbox(owner)
        kv = packed_kv if packed_kv is not None else self.inbox.take(request.request_id)
        self.engine.add(request, kv)
        self._start_steps()
        return True

    async def stream(self, owner: str) -> AsyncIterator[DecodeBatch]:
        """`owner`'s messages, one per step that produced any of its chunks (or fewer, each
        holding more, when the reader fell behind), until the reader goes away. Read as a
        Ray streaming call, or over a direct link (`link_stream`)."""
        outbox = self._outbox(owner)
        outbox.reader += 1
        me = outbox.reader
        while outbox.reader == me:
            await outbox.ready.wait()
            if outbox.reader == me and (outputs := outbox.take()):
                self.num_messages += 1
                yield DecodeBatch(outputs)

    def link_stream(self, owner: str) -> AsyncIterator[DecodeBatch]:
        return self.stream(owner)

    def _outbox(self, owner: str) -> _Outbox:
        if owner not in self._outboxes:
            self._outboxes[owner] = _Outbox()
        return self._outboxes[owner]

    def abort(self, request_id: str) -> None:
        """Free the request's KV and row; its stream gets an ABORT chunk if it still listens
        (also when the request was still waiting for a row: no step reports those)."""
        self.inbox.close(request_id)
        self.engine.abort(request_id)
        if (owner := self._owner_of.pop(request_id, None)) is not None:
            self._outboxes[owner].put(DecodeOutput(request_id, TokenChunk((), FinishReason.ABORT)))

    def drop_owner(self, prefix: str) -> int:
        """An ingress replica died: abort all its requests (their ids start with `prefix`)."""
        mine = [request_id for request_id in self._owner_of if request_id.startswith(prefix)]
        for request_id in mine:
            self.engine.abort(request_id)
            del self._owner_of[request_id]
        if (outbox := self._outboxes.pop(prefix, None)) is not None:
            outbox.reader += 1  # its stream, if any, ends
            outbox.ready.set()
        return self.inbox.close_owner(prefix) + len(mine)

    # -- the device thread ------------------------------------------------------------------
    def _start_steps(self) -> None:
        if self._loop_task is None or self._loop_task.done():
            self._loop_task = asyncio.create_task(self._steps())

    async def _steps(self) -> None:
        """Keep a device thread stepping while there is work. The check runs here, on the
        event loop where `submit` adds work, so no request lands between a thread that just
        stopped and a task that still looks busy."""
        loop = asyncio.get_running_loop()
        self._publish()  # what a thread of a loop now closed (tests run several) left
        while self.engine.has_work:
            await loop.run_in_executor(self._executor, self._step_while_busy, loop)

    def _step_while_busy(self, loop: asyncio.AbstractEventLoop) -> None:
        """On the device thread: steps back to back; each step's outputs go to the event loop."""
        step_s = 0.0
        while self.engine.has_work and not loop.is_closed():
            if self.settings.make_way_for_short:  # a peer's short prompt has the cores first
                self.priority.between_steps(step_s)
            started_s = time.perf_counter()
            try:
                outputs = self._stretched(self.engine.step)
            except Exception:  # the batch's requests end with ERROR; the worker goes on
                log.exception("decode step failed")
                outputs = self.engine.fail_all()
            self.threads.step_done(self.engine.has_work)
            step_s = time.perf_counter() - started_s
            if outputs:
                self._done.extend(outputs)
                try:
                    loop.call_soon_threadsafe(self._publish)
                except RuntimeError:  # the loop closed: the next one's _steps publishes them
                    return

    def _publish(self) -> None:
        while self._done:
            out = self._done.popleft()
            owner = self._owner_of.get(out.request_id)
            if owner is None:
                continue  # aborted: its caller stopped listening
            if out.chunk.finished:
                del self._owner_of[out.request_id]
            if (outbox := self._outboxes.get(owner)) is not None:
                outbox.put(out)

    def load(self) -> WorkerLoad:
        stats = self.engine.stats()
        return WorkerLoad(queued=stats["queued"], running=stats["running"])

    def take_settings(self, settings: DecodeSettings) -> None:
        self.engine.reconfigure(settings)

    def stats(self) -> dict[str, int]:
        """`rows` counts KV rows held: zero when idle, or a request leaked its cache."""
        return {
            "pid": os.getpid(),
            **self.engine.stats(),
            "held_kv": len(self.inbox),
            "open_streams": len(self._owner_of),
            "messages": self.num_messages,
            **self.link_stats(),
            "submits_over_link": self.num_linked_calls["submit"],  # a small KV inside them
            **self.device_thread_stats(),
            **self.priority_stats(),  # waits between steps for a peer's short prompt
        }


# Tensor transport must be declared on the class: a per-handle option is not honoured.
DecodeActor = ray.remote(enable_tensor_transport=True)(DecodeWorker)
