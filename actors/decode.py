"""Decode worker: the Ray actor around `DecodeEngine` (actors/engine/decode.py).

Requests join and leave the running batch between steps; each request's tokens stream
back to its caller as they are produced.
"""

from __future__ import annotations

import asyncio
import os

import ray
import torch

from actors.engine.decode import DecodeEngine, DecodeOutput
from actors.engine.lm_runner import LMRunner
from actors.inbox import TensorInbox
from actors.models.adapter import Part
from actors.runtime import ModelWorker, WorkerLoad, WorkerSpec
from actors.types import DecodeRequest, FinishReason, TokenChunk
from router.worker_settings import DecodeSettings


class DecodeWorker(ModelWorker):
    def __init__(self, spec: WorkerSpec, settings: DecodeSettings):
        super().__init__(spec, Part.LANGUAGE_MODEL)
        self.settings = settings
        self.engine = DecodeEngine(LMRunner(self.adapter), settings, spec.max_model_len)
        self.inbox = TensorInbox()  # packed KV from prefill, until generate() claims it
        self._outboxes: dict[str, asyncio.Queue] = {}

    async def receive(self, request_id: str, slot: int, packed_kv: torch.Tensor) -> None:
        self.inbox.put(
            request_id, packed_kv
        )  # dropped at once if the request was aborted meanwhile

    async def generate(self, request: DecodeRequest, packed_kv: torch.Tensor | None = None):
        """Stream of TokenChunk for the tokens after the first (which prefill produced).

        Over the object store the KV comes as this call's argument, so it lives only as
        long as the call: nothing is left behind whatever the caller does next. Over RDT
        it was `receive`d first (transfers into an actor must be ordered) and is claimed here."""
        if self.inbox.is_closed(request.request_id):
            return  # aborted before it started: nobody is listening
        outbox: asyncio.Queue = asyncio.Queue()
        self._outboxes[request.request_id] = outbox
        self.engine.add(
            request, packed_kv if packed_kv is not None else self.inbox.take(request.request_id)
        )
        self.drive(self.engine, self._publish, lambda exc: self._publish(self.engine.fail_all()))
        try:
            while True:
                chunk = await self._gather(outbox)
                yield chunk
                if chunk.finished:
                    return
        finally:
            self._outboxes.pop(request.request_id, None)
            self.engine.abort(
                request.request_id
            )  # no-op once finished; frees the row if the caller left

    async def _gather(self, outbox: asyncio.Queue) -> TokenChunk:
        """The request's next chunk: everything its outbox holds, and at least `stream_interval`
        tokens unless it finished (a caller that fell behind gets all it missed at once)."""
        tokens, logprobs, last = [], [], None
        while last is None or not (
            last.finished or (outbox.empty() and len(tokens) >= self.settings.stream_interval)
        ):
            last = outbox.get_nowait() if not outbox.empty() else await outbox.get()
            tokens.extend(last.token_ids)
            logprobs.extend(last.logprobs)
        return TokenChunk(tuple(tokens), last.finish_reason, last.step_ms, tuple(logprobs))

    def abort(self, request_id: str) -> None:
        self.inbox.close(request_id)
        self.engine.abort(request_id)
        outbox = self._outboxes.get(request_id)
        if (
            outbox is not None
        ):  # its stream ends now, also if it was still waiting for a row (no step reports those)
            outbox.put_nowait(TokenChunk((), FinishReason.ABORT))

    def drop_owner(self, prefix: str) -> int:
        """An ingress replica died: abort() all its requests (their ids start with `prefix`)."""
        mine = [request_id for request_id in self._outboxes if request_id.startswith(prefix)]
        for request_id in mine:
            self.engine.abort(request_id)
        return self.inbox.close_owner(prefix) + len(mine)

    def _publish(self, outputs: list[DecodeOutput]) -> None:
        for out in outputs:
            outbox = self._outboxes.get(out.request_id)
            if outbox is not None:
                outbox.put_nowait(out.chunk)

    def load(self) -> WorkerLoad:
        stats = self.engine.stats()
        return WorkerLoad(queued=stats["queued"], running=stats["running"])

    def stats(self) -> dict[str, int]:
        """`rows` counts KV rows held: zero when idle, or a request leaked its cache."""
        return {
            "pid": os.getpid(),
            **self.engine.stats(),
            "held_kv": len(self.inbox),
            "step_threads": self.step_threads,
        }


# Tensor transport must be declared on the class: a per-handle option is not honoured.
DecodeActor = ray.remote(enable_tensor_transport=True)(DecodeWorker)
