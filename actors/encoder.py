"""Encoder worker: batches items across requests and runs the model's towers on them."""

from __future__ import annotations

import os
import time

import ray
import torch

from actors.adapters import Part
from actors.batching import MicroBatcher
from actors.encoder_cache import EncoderCache
from actors.runtime import ModelWorker, WorkerLoad, WorkerSpec
from actors.types import EncodeJob, EncodeStats


class EncoderWorker(ModelWorker):
    def __init__(self, spec: WorkerSpec, max_batch_size: int, max_wait_ms: float, cache_mb: float):
        super().__init__(spec, Part.ENCODER)
        self.cache = EncoderCache(int(cache_mb * 2**20))
        self.batcher = MicroBatcher(
            self._encode_batch,
            max_batch_size=max_batch_size,
            max_wait_s=max_wait_ms / 1e3,
            key=lambda job: job.item.modality,
        )
        self._running = 0

    async def _encode_batch(self, jobs: list[EncodeJob]) -> list[tuple[torch.Tensor, float]]:
        self._running += len(jobs)
        try:
            started = time.perf_counter()
            embeddings = await self.run_device(self.adapter.encode, [job.item for job in jobs])
            encode_ms = (time.perf_counter() - started) * 1e3
        finally:
            self._running -= len(jobs)
        for job, emb in zip(jobs, embeddings, strict=True):
            if emb.shape[0] != job.num_embeddings:
                raise ValueError(f"item {job.item.identifier[:12]} gave {emb.shape[0]} embeddings, planned {job.num_embeddings}")
        return [(emb, encode_ms) for emb in embeddings]

    async def encode(self, job: EncodeJob) -> tuple[torch.Tensor, EncodeStats]:
        identifier = job.item.identifier
        cached = self.cache.get(identifier)
        if cached is not None:
            return cached, EncodeStats(identifier, 0.0, 0.0, 0, cache_hit=True, finished_at_s=time.time())
        (embedding, encode_ms), queue_ms, batch_size = await self.batcher.submit(job)
        self.cache.put(identifier, embedding, embedding.numel() * embedding.element_size())
        return embedding, EncodeStats(identifier, queue_ms, encode_ms, batch_size, finished_at_s=time.time())

    def load(self) -> WorkerLoad:
        return WorkerLoad(queued=self.batcher.queue_depth, running=self._running)

    def stats(self) -> dict[str, int]:
        return {
            "pid": os.getpid(),
            "queued": self.batcher.queue_depth,
            "running": self._running,
            "num_batches": self.batcher.num_batches,
            "max_batch": self.batcher.max_batch_seen,
            "cache_hits": self.cache.hits,
            "cache_entries": len(self.cache),
        }

    def cached_identifiers(self) -> frozenset[str]:
        """What this encoder holds, for the router's cluster view."""
        return self.cache.identifiers()


# Tensor transport must be declared on the class: a per-handle option is not honoured.
EncoderActor = ray.remote(enable_tensor_transport=True)(EncoderWorker)
