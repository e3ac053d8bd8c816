"""Encoder worker: batches items across requests and runs the model's towers on them.

Each item's embeddings stay in the encoder cache, referenced by the requests that asked
for them until the ingress says they reached the prefill worker (`drop`), then cached
for reuse and evicted under the byte budget (actors/engine/encoder_cache.py). An item's
pixels come as an object-store reference (MediaItem.data_ref), fetched only on a cache miss.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import time
from typing import TYPE_CHECKING

import ray

from actors.engine.batching import MicroBatcher
from actors.engine.encoder_cache import EncoderCache, EntryState
from actors.runtime import ModelWorker, WorkerLoad, WorkerSpec
from actors.store_pages import StorePages
from actors.types import Delivered, EncodeJob, EncodeStats, WorkerRequestError, hop_ms
from actors.worker_links import WorkerLinks, detached
from router.types import Modality
from router.worker_settings import EncoderSettings

if TYPE_CHECKING:
    import torch


class EncoderWorker(ModelWorker):
    # An item small enough to ride inside its call comes over the ingress's link, and its
    # release follows it there (so it never overtakes the call).
    LINKED_CALLS = frozenset({"encode", "drop"})

    def __init__(self, spec: WorkerSpec, settings: EncoderSettings):
        from actors.engine.preempt import gate_layers  # in the worker only (runtime.py)
        from actors.models.adapter import Part

        super().__init__(spec, Part.ENCODER)
        # A tower's forward makes way between its layers for a short prompt on the node.
        gate_layers(self.adapter.tower_linears(), self)
        self.settings = settings
        self.cache = EncoderCache(settings.cache_bytes)
        self.batcher = MicroBatcher(
            self._encode_batch,
            max_batch_size=settings.max_batch_size,
            max_wait_s=settings.max_wait_ms / 1e3,
            key=lambda job: job.item.modality,
        )
        self._running = 0
        # To prefill workers, for embeddings small enough to inline.
        self.links = WorkerLinks(ring=spec.shared_memory)
        self.store_pages = StorePages()

    def _encode(self, items: list) -> tuple[list[torch.Tensor], float]:
        """On the device thread: the items' embeddings, and the seconds the tower paused for
        a short prompt elsewhere on the node (not compute: the router's costs leave it out).
        Still images alone are urgent, as a short prompt is (settings.urgent_images): beside
        decode at niceness 0, the tower at Ray's 15 took 16 ms (median of 5) against 10 urgent."""
        if self.settings.urgent_images and all(i.modality == Modality.IMAGE for i in items):
            with self.priority.urgent(self.settings.urgent_niceness):
                return self.adapter.encode(items), 0.0
        with self.priority.yielding() as paused_s:
            return self.adapter.encode(items), paused_s()

    def between_layers(self) -> None:
        """Before each of the towers' linear layers (gate_layers)."""
        self.priority.pause()

    def take_settings(self, settings: EncoderSettings) -> None:
        self.batcher.max_wait_s = settings.max_wait_ms / 1e3

    async def _encode_batch(self, jobs: list[EncodeJob]) -> list[tuple[torch.Tensor, float]]:
        self._running += len(jobs)
        try:
            started = time.perf_counter()
            embeddings, paused_s = await self.run_device(self._encode, [job.item for job in jobs])
            encode_ms = (time.perf_counter() - started - paused_s) * 1e3
            if self.store_pages.due(sum(job.item.data.nbytes for job in jobs)):
                # The store's pages the pixels were read from, unmapped here: off the event
                # loop, and not a device step (neither compute nor load).
                await asyncio.to_thread(self.store_pages.release)
        finally:
            self._running -= len(jobs)
        for job, emb in zip(jobs, embeddings, strict=True):
            if emb.shape[0] != job.num_embeddings:
                raise ValueError(
                    f"item {job.item.identifier[:12]} gave {emb.shape[0]} embeddings, "
                    f"planned {job.num_embeddings}"
                )
        self.work_done += sum(job.num_embeddings for job in jobs)
        return [(emb, encode_ms) for emb in embeddings]

    async def encode(self, job: EncodeJob) -> tuple[torch.Tensor, EncodeStats] | Delivered:
        """The item's embeddings and how their encoding went; with `job.deliver_to`, handed to
        that prefill worker from here (one hop, not two through the ingress): then only the
        stats and when the embeddings arrived come back."""
        arrived_s = time.time()
        embedding, stats = await self._encoded(job)
        encoded = embedding, dataclasses.replace(stats, hop_in_ms=hop_ms(job.sent_at_s, arrived_s))
        if job.deliver_to is None:
            return encoded
        return Delivered(encoded[1], await self._deliver(job, encoded))

    async def _deliver(self, job: EncodeJob, encoded: tuple[torch.Tensor, EncodeStats]) -> float:
        """Hand the embeddings to the prefill worker: small ones inside a call on its link,
        others through the object store. Returns when they arrived (its wall clock)."""
        args = job.request_id, job.slot, encoded
        # In a context of its own: a client that leaves makes Ray cancel this call and its
        # children, and a call cancelled while Ray resolves its (large, stored) argument kills
        # the calling process (cluster/leftovers.py). A link's call (or its fallback to Ray,
        # should the link not connect) runs in a task of its own for the same reason.
        if encoded[0].numel() * encoded[0].element_size() <= job.inline_max_bytes:
            call = self.links.call(job.deliver_to, "receive", *args)
            return await detached(asyncio.ensure_future, call)
        return await detached(job.deliver_to.receive.remote, *args)

    async def _encoded(self, job: EncodeJob) -> tuple[torch.Tensor, EncodeStats]:
        identifier = job.item.identifier
        found = self.cache.lookup(identifier, job.request_id)
        if found is None:
            return await self._encode_missed(job)
        state, value = found
        if state is EntryState.ENCODING:  # another request's run of the tower: wait for it
            started = time.perf_counter()
            value = await asyncio.shield(value)
            return value, EncodeStats(
                identifier,
                (time.perf_counter() - started) * 1e3,
                0.0,
                0,
                cache_hit=True,
                finished_at_s=time.time(),
            )
        return value, EncodeStats(
            identifier, 0.0, 0.0, 0, cache_hit=True, finished_at_s=time.time()
        )

    async def _encode_missed(self, job: EncodeJob) -> tuple[torch.Tensor, EncodeStats]:
        identifier = job.item.identifier
        pending = asyncio.get_running_loop().create_future()
        self.cache.start(identifier, job.request_id, pending)
        self.work_in += job.num_embeddings
        try:
            fetching_s = time.perf_counter()
            job = await _with_pixels(job)
            fetch_ms = (time.perf_counter() - fetching_s) * 1e3
            (embedding, encode_ms), queue_ms, batch_size = await self.batcher.submit(job)
        except BaseException as exc:
            self.cache.fail(identifier)
            if isinstance(exc, asyncio.CancelledError):
                pending.cancel()
            else:
                pending.set_exception(exc)
                pending.exception()  # retrieved: no "never retrieved" warning when nobody waited
            raise
        self.cache.fill(identifier, embedding, embedding.numel() * embedding.element_size())
        pending.set_result(embedding)
        return embedding, EncodeStats(
            identifier,
            queue_ms,
            encode_ms,
            batch_size,
            finished_at_s=time.time(),
            fetch_ms=fetch_ms,
        )

    def drop(self, request_id: str) -> int:
        """The request's items reached its prefill worker, or it ended early: release them."""
        return self.cache.release(request_id)

    def drop_owner(self, prefix: str) -> int:
        """An ingress replica died: release what its requests (ids start with `prefix`) hold."""
        return self.cache.release_owner(prefix)

    def load(self) -> WorkerLoad:
        return WorkerLoad(queued=self.batcher.queue_depth, running=self._running)

    def has_work(self) -> bool:
        return self.batcher.queue_depth > 0

    def stats(self) -> dict[str, int]:
        """`cache_encoding_entries` and `cache_referenced_entries` are zero when idle, or a
        request leaked its reference."""
        return {
            "pid": os.getpid(),
            "queued": self.batcher.queue_depth,
            "running": self._running,
            "num_batches": self.batcher.num_batches,
            "max_batch": self.batcher.max_batch_seen,
            **self.device_thread_stats(),
            "busy_s": self.busy_s,
            **self.link_stats(),
            "work_in": self.work_in,
            "work_done": self.work_done,
            **self.priority_stats(),
            **self.cache.stats().as_flat_dict(),
        }

    def cached_identifiers(self) -> frozenset[str]:
        """What this encoder holds, for the router's cluster view."""
        return self.cache.identifiers()


async def _with_pixels(job: EncodeJob) -> EncodeJob:
    """`job` with its item's pixels here, fetched from the object store if they are there."""
    if job.item.data_ref is None:
        return job
    if (ref := job.item.data_ref.ref) is None:  # the ingress let them go: a bug, not the client's
        raise WorkerRequestError(f"request {job.request_id}: its pixels were already released")
    return dataclasses.replace(job, item=job.item.with_data(await ref))


# Tensor transport must be declared on the class: a per-handle option is not honoured.
EncoderActor = ray.remote(enable_tensor_transport=True)(EncoderWorker)
