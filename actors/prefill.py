"""Prefill worker: the Ray actor around `PrefillEngine` (actors/engine/prefill.py). It keeps
the embeddings that arrive ahead of the prefill call, hands those that arrive after it to
the engine (encode/prefill overlap), and keeps each prompt's KV until the decode worker
pulls it."""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import ray

from actors.inbox import TensorInbox
from actors.runtime import ModelWorker, WorkerLoad, WorkerSpec
from actors.types import (
    EncodeStats,
    PrefillRequest,
    PrefillResult,
    WorkerRequestError,
    hop_ms,
)
from router.worker_settings import PrefillSettings

if TYPE_CHECKING:
    import torch

    from actors.engine.prefill import PrefillOutput


# A prefill step borrows idle cores only from this many prompt tokens: live on the 2-core CPU
# host a 30-token step took 43-62 ms on two threads against 38-40 on one, a 219-token step
# 108-129 against 145-150 (docs/BENCHMARKS.md, 2026-11-28).
MIN_BORROW_TOKENS = 128


@dataclass
class _InFlight:
    """A request in the engine: its items' encode stats so far (a prompt whose cached prefix
    covered an item finishes without it)."""

    num_items: int
    stats: dict[int, EncodeStats] = field(default_factory=dict)  # by slot

    @property
    def complete(self) -> bool:
        return len(self.stats) == self.num_items


class PrefillWorker(ModelWorker):
    LINKED_CALLS = frozenset({"prefill", "receive", "pop_kv"})

    def __init__(self, spec: WorkerSpec, settings: PrefillSettings):
        from actors.engine.lm_runner import LMRunner  # in the worker only (runtime.py)
        from actors.engine.prefill import PrefillEngine
        from actors.models.adapter import Part

        super().__init__(spec, Part.LANGUAGE_MODEL)
        self.settings = settings
        self.engine = PrefillEngine(LMRunner(self.adapter, settings.max_chunk_tokens), settings)
        self.engine.priority = self.priority
        self.embeddings = TensorInbox()  # from encoders, until the prefill call
        self.kv = TensorInbox()  # for the decode worker, until it pulls it
        self._waiters: dict[str, asyncio.Future] = {}
        self._in_flight: dict[str, _InFlight] = {}  # requests with a prefill call, until it returns

    def borrow_pays(self) -> bool:
        return self.engine.next_step_tokens >= MIN_BORROW_TOKENS

    def take_settings(self, settings: PrefillSettings) -> None:
        self.engine.reconfigure(settings)

    async def receive(
        self, request_id: str, slot: int, encoded: tuple[torch.Tensor, EncodeStats]
    ) -> float:
        """One item's embeddings: to the engine if its prefill call came first (overlap), else
        kept for that call. Returns the wall clock of arrival, so the ingress can time the
        hand-over against the encoder's finish time."""
        if request_id in self._waiters:  # prefilling already: the engine splices it in
            self._in_flight[request_id].stats[slot] = encoded[1]
            self.engine.add_item(request_id, slot, encoded[0])
            self.drive(self.engine, self._publish, self._fail_all)
        else:  # refused if the request is over (closed); freed by drop() if it ends later
            self.embeddings.put(request_id, encoded, slot)
        return time.time()

    async def prefill(self, request: PrefillRequest) -> PrefillResult:
        """The request's first token, once its prompt is prefilled. Items not received yet
        follow through `receive`; the text before them is prefilled meanwhile."""
        called_at_s = time.time()
        if self.embeddings.is_closed(request.request_id):
            # Its drop came first (the drop goes over Ray, this call over a link): queued now,
            # it would be prefilled for nobody.
            raise WorkerRequestError(f"request {request.request_id} was dropped before its prefill")
        if self.engine.on_early is None:  # prompts run between a chunk's layers: from that thread
            loop = asyncio.get_running_loop()
            self.engine.on_early = lambda outs: loop.call_soon_threadsafe(self._publish, outs)
        self.work_in += len(request.prompt_token_ids)
        encoded = self.embeddings.take_all(request.request_id)
        done = asyncio.get_running_loop().create_future()
        self._waiters[request.request_id] = done
        self._in_flight[request.request_id] = _InFlight(
            len(request.placeholders), {slot: stats for slot, (_, stats) in encoded.items()}
        )
        self.engine.add(request, {slot: embedding for slot, (embedding, _) in encoded.items()})
        self.drive(self.engine, self._publish, self._fail_all)
        try:
            out: PrefillOutput = await done
        finally:
            flight = self._in_flight.pop(request.request_id)
            if not flight.complete:  # items its cached prefix covered may still come: refused
                self.embeddings.close(request.request_id)
            stats = flight.stats
            if self._waiters.pop(request.request_id, None) is not None:
                self.engine.abort(
                    request.request_id
                )  # the caller left before the end: free its slot
                self.drive(
                    self.engine, self._publish, self._fail_all
                )  # it may be waiting for items: free it now
        if out.first is None:  # nothing to hand to decode; this request alone fails
            raise WorkerRequestError(
                f"the first token of request {request.request_id} could not be sampled "
                "(the model gave non-finite logits)"
            )
        self.kv.put(
            request.request_id, out.packed_kv
        )  # dropped at once if the request was closed meanwhile
        self.work_done += len(request.prompt_token_ids)
        return PrefillResult(
            request_id=request.request_id,
            first_token_id=out.first.token_id,
            num_prompt_tokens=len(request.prompt_token_ids),
            queue_ms=out.queue_ms,
            prefill_ms=out.prefill_ms,
            encode_stats=tuple(stats[slot] for slot in sorted(stats)),
            rope_delta=out.rope_delta,
            first_logprob=out.first.logprob,
            num_cached_tokens=out.num_cached_tokens,
            item_wait_ms=out.item_wait_ms,
            compute_ms=out.compute_ms
            * self.spec.slowdown,  # the emulated slower device sleeps after each step
            call_in_ms=hop_ms(request.sent_at_s, called_at_s),
            returned_at_s=time.time(),
            publish_ms=(time.perf_counter() - out.finished_s) * 1e3 if out.finished_s else 0.0,
        )

    def _publish(self, outputs: list[PrefillOutput]) -> None:
        handed_s = (
            time.perf_counter()
        )  # after the step's end, and an emulated slower device's sleep after it
        for out in outputs:
            if out.finished_s:  # its first token leaves now: prefill_ms counts until then
                out = replace(out, prefill_ms=out.prefill_ms + (handed_s - out.finished_s) * 1e3)
            if out.error is not None:
                self._settle(
                    out.request_id, exc=WorkerRequestError(f"request {out.request_id}: {out.error}")
                )
            else:  # also before an item its cached prefix covered: the request needs none
                self._settle(out.request_id, out)

    def _fail_all(self, exc: Exception) -> None:
        for request_id in self.engine.fail_all():
            self._settle(request_id, exc=exc)

    def _settle(
        self, request_id: str, out: PrefillOutput | None = None, exc: Exception | None = None
    ) -> None:
        done = self._waiters.pop(request_id, None)
        if done is None or done.done():
            return
        if exc is not None:
            done.set_exception(exc)
        else:
            done.set_result(out)

    async def pop_kv(self, request_id: str) -> torch.Tensor:
        """The request's packed KV, handed over once (the caller picks the transport)."""
        return self.kv.take(request_id)

    def drop(self, request_id: str) -> None:
        """The request is over here: free what it holds, refuse what still arrives for it."""
        self.kv.close(request_id)
        self.embeddings.close(request_id)
        if request_id in self._waiters:  # still prefilling: stop, and end the call waiting on it
            self.engine.abort(request_id)
            self.drive(
                self.engine, self._publish, self._fail_all
            )  # a job waiting for items: freed now, not at the next request
            self._settle(
                request_id,
                exc=WorkerRequestError(f"request {request_id} was dropped during its prefill"),
            )

    def prefix_hashes(self) -> frozenset[str]:
        """Block hashes this worker's prefix cache holds (the router's prefix index)."""
        return self.engine.held_hashes()

    def drop_owner(self, prefix: str) -> int:
        """An ingress replica died: drop() all its requests (their ids start with `prefix`)."""
        mine = [request_id for request_id in self._waiters if request_id.startswith(prefix)]
        for request_id in mine:  # still prefilling: stop, and end the calls waiting on them
            self.drop(request_id)
        return self.kv.close_owner(prefix) + self.embeddings.close_owner(prefix) + len(mine)

    def stats(self) -> dict[str, int]:
        return {
            "pid": os.getpid(),
            **self.engine.stats(),
            "held_kv": len(self.kv),
            "held_embeddings": len(self.embeddings),
            **self.device_thread_stats(),
            "busy_s": self.busy_s,
            "work_in": self.work_in,
            "work_done": self.work_done,
            **self.link_stats(),
            **self.priority_stats(),
        }

    def load(self) -> WorkerLoad:
        stats = self.engine.stats()
        return WorkerLoad(queued=stats["queued"], running=stats["running"])


# Tensor transport must be declared on the class: a per-handle option is not honoured.
PrefillActor = ray.remote(enable_tensor_transport=True)(PrefillWorker)
