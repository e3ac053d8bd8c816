"""Decode worker: continuous batching over requests whose KV arrived from prefill.

Requests join and leave the running batch between steps; each request's tokens stream
back to its caller as they are produced.
"""
from __future__ import annotations

import asyncio
import os
import time

import ray
import torch

from actors import kv
from actors.adapters import Part
from actors.decode_state import DecodeScheduler, Sequence
from actors.inbox import TensorInbox
from actors.lm_runner import LMRunner
from actors.sampling import Sampled
from actors.runtime import ModelWorker, WorkerLoad, WorkerSpec
from actors.types import DecodeRequest, FinishReason, TokenChunk


class DecodeWorker(ModelWorker):
    def __init__(self, spec: WorkerSpec, max_batch_size: int):
        super().__init__(spec, Part.LANGUAGE_MODEL)
        self.runner = LMRunner(self.adapter)
        self.scheduler = DecodeScheduler(max_batch_size, spec.max_model_len)
        self.batch = kv.BatchedKV()
        self.inbox = TensorInbox()  # packed KV from prefill, until generate() claims it
        self._outboxes: dict[str, asyncio.Queue] = {}
        self._loop_task: asyncio.Task | None = None
        self.max_batch_seen = 0

    async def receive(self, request_id: str, slot: int, packed_kv: torch.Tensor) -> None:
        self.inbox.put(request_id, packed_kv)  # dropped at once if the request was aborted meanwhile

    async def generate(self, request: DecodeRequest):
        """Stream of TokenChunk for the tokens after the first (which prefill produced)."""
        outbox: asyncio.Queue = asyncio.Queue()
        self._outboxes[request.request_id] = outbox
        self.scheduler.add(Sequence(request, self.inbox.take(request.request_id)))
        self._ensure_loop()
        try:
            while True:
                chunk = self._drain(await outbox.get(), outbox)
                yield chunk
                if chunk.finished:
                    return
        finally:
            self._outboxes.pop(request.request_id, None)
            self.scheduler.abort(request.request_id)  # no-op once finished; frees the row if the caller left

    @staticmethod
    def _drain(first: TokenChunk, outbox: asyncio.Queue) -> TokenChunk:
        tokens, logprobs, last = list(first.token_ids), list(first.logprobs), first
        while not last.finished and not outbox.empty():
            last = outbox.get_nowait()
            tokens.extend(last.token_ids)
            logprobs.extend(last.logprobs)
        return TokenChunk(tuple(tokens), last.finish_reason, last.step_ms, tuple(logprobs))

    def abort(self, request_id: str) -> None:
        self.inbox.close(request_id)
        self.scheduler.abort(request_id)

    def drop_owner(self, prefix: str) -> int:
        """An ingress replica died: abort() all its requests (their ids start with `prefix`)."""
        mine = {seq.request_id for seq in [*self.scheduler.waiting, *self.scheduler.running] if seq.request_id.startswith(prefix)}
        for request_id in mine:
            self.scheduler.abort(request_id)
        return self.inbox.close_owner(prefix) + len(mine)

    def _ensure_loop(self) -> None:
        if self._loop_task is None or self._loop_task.done():
            self._loop_task = asyncio.create_task(self._loop())

    async def _loop(self) -> None:
        while self.scheduler.num_active:
            joining = self.scheduler.admit()
            if joining:
                await self.run_device(self._join, joining)
            self._release(self.scheduler.sweep())  # aborted while waiting for the step
            if not self.scheduler.running:
                await asyncio.sleep(0)
                continue
            started = time.perf_counter()
            try:
                tokens = await self.run_device(self._step)
            except Exception:
                self._fail_all()
                raise
            step_ms = (time.perf_counter() - started) * 1e3
            self.max_batch_seen = max(self.max_batch_seen, len(tokens))
            for seq, sampled in zip(self.scheduler.running, tokens):
                if sampled is not None:  # a failed row ends alone, with ERROR, in _release
                    logprobs = (sampled.logprob,) if sampled.logprob is not None else ()
                    self._publish(seq, TokenChunk((sampled.token_id,), None, step_ms, logprobs))
            self._release(self.scheduler.record([s.token_id if s is not None else None for s in tokens]), step_ms)

    def _join(self, joining: list[Sequence]) -> None:
        for seq in joining:
            self.batch.join(seq.kv.to(self.runner.device))
            seq.kv = None

    def _step(self) -> list[Sampled | None]:
        running = self.scheduler.running
        return self.runner.decode_step(
            self.batch,
            [seq.token_ids[-1] for seq in running],
            [seq.request.sampling for seq in running],
            [seq.next_position for seq in running],
            [seq.request.rope_delta for seq in running],
            [seq.history() for seq in running],
        )

    def _release(self, finished: list[Sequence], step_ms: float = 0.0) -> None:
        if not finished:
            return
        for seq in finished:
            self._publish(seq, TokenChunk((), seq.finish_reason, step_ms))
        self.batch.keep(self.scheduler.remove_finished())

    def _publish(self, seq: Sequence, chunk: TokenChunk) -> None:
        outbox = self._outboxes.get(seq.request_id)
        if outbox is not None:
            outbox.put_nowait(chunk)

    def _fail_all(self) -> None:
        for seq in self.scheduler.running + list(self.scheduler.waiting):
            seq.aborted = True
            self._publish(seq, TokenChunk((), FinishReason.ERROR))
        self.scheduler.running, self.scheduler.waiting = [], type(self.scheduler.waiting)()
        self.batch = kv.BatchedKV()

    def load(self) -> WorkerLoad:
        return WorkerLoad(queued=len(self.scheduler.waiting), running=len(self.scheduler.running))

    def stats(self) -> dict[str, int]:
        """`rows` counts KV rows held: zero when idle, or a request leaked its cache."""
        return {"pid": os.getpid(), "queued": len(self.scheduler.waiting), "running": len(self.scheduler.running),
                "rows": self.batch.num_rows, "held_kv": len(self.inbox), "max_batch": self.max_batch_seen}


# Tensor transport must be declared on the class: a per-handle option is not honoured.
DecodeActor = ray.remote(enable_tensor_transport=True)(DecodeWorker)
