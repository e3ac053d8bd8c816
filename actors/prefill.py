"""Prefill worker: splices embeddings into the prompt, runs the LM over it, keeps the KV
until the decode worker pulls it."""
from __future__ import annotations

import time

import ray
import torch

from actors.adapters import Part
from actors.lm_runner import LMRunner
from actors.runtime import ModelWorker, WorkerLoad, WorkerSpec
from actors.types import EncodeStats, PrefillRequest, PrefillResult

KV_TTL_S = 120.0  # a KV nobody pulled by then belongs to a request that died upstream


class PrefillWorker(ModelWorker):
    def __init__(self, spec: WorkerSpec, max_chunk_tokens: int):
        super().__init__(spec, Part.LANGUAGE_MODEL)
        self.runner = LMRunner(self.adapter, max_chunk_tokens)
        self._kv: dict[str, tuple[float, torch.Tensor]] = {}
        self._queued = 0

    async def prefill(self, request: PrefillRequest, *encoded: tuple[torch.Tensor, EncodeStats]) -> PrefillResult:
        self._expire_kv()
        arrived = time.perf_counter()
        self._queued += 1
        try:
            items = [embedding for embedding, _ in encoded]
            token, packed, started = await self.run_device(self._timed_prefill, request, items)
        finally:
            self._queued -= 1
        finished = time.perf_counter()
        self._kv[request.request_id] = (time.monotonic(), packed)
        return PrefillResult(
            request_id=request.request_id,
            first_token_id=token,
            num_prompt_tokens=len(request.prompt_token_ids),
            queue_ms=(started - arrived) * 1e3,
            prefill_ms=(finished - started) * 1e3,
            encode_stats=tuple(stats for _, stats in encoded),
        )

    def _timed_prefill(self, request: PrefillRequest, items: list[torch.Tensor]):
        started = time.perf_counter()
        token, packed = self.runner.prefill(request.prompt_token_ids, request.placeholders, items, request.sampling)
        return token, packed, started

    async def pop_kv(self, request_id: str) -> torch.Tensor:
        """The request's packed KV, handed over once (the caller picks the transport)."""
        return self._kv.pop(request_id)[1]

    def drop_kv(self, request_id: str) -> bool:
        return self._kv.pop(request_id, None) is not None

    def num_held_kv(self) -> int:
        return len(self._kv)

    def _expire_kv(self) -> None:
        cutoff = time.monotonic() - KV_TTL_S
        for rid in [rid for rid, (t, _) in self._kv.items() if t < cutoff]:
            del self._kv[rid]

    def load(self) -> WorkerLoad:
        return WorkerLoad(queued=self._queued, running=0)


# Tensor transport must be declared on the class: a per-handle option is not honoured.
PrefillActor = ray.remote(enable_tensor_transport=True)(PrefillWorker)
