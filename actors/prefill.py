"""Prefill worker: splices embeddings into the prompt, runs the LM over it, keeps the KV
until the decode worker pulls it."""
from __future__ import annotations

import os
import time

import ray
import torch

from actors.adapters import Part
from actors.inbox import TensorInbox
from actors.lm_runner import LMRunner
from actors.runtime import ModelWorker, WorkerLoad, WorkerSpec
from actors.types import EncodeStats, PrefillRequest, PrefillResult, TokenHistory, WorkerRequestError


def history_of(request: PrefillRequest) -> TokenHistory | None:
    """What the first token's penalties see; a resumed request's generated tokens are output."""
    if not request.sampling.needs_history:
        return None
    split = len(request.prompt_token_ids) - request.num_output_tokens
    return TokenHistory(request.prompt_token_ids[:split], request.prompt_token_ids[split:])


class PrefillWorker(ModelWorker):
    def __init__(self, spec: WorkerSpec, max_chunk_tokens: int):
        super().__init__(spec, Part.LANGUAGE_MODEL)
        self.runner = LMRunner(self.adapter, max_chunk_tokens)
        self.embeddings = TensorInbox()  # from encoders, until the prefill call
        self.kv = TensorInbox()  # for the decode worker, until it pulls it
        self._queued = 0

    async def receive(self, request_id: str, slot: int, encoded: tuple[torch.Tensor, EncodeStats]) -> float:
        """Keep one item's embeddings for the prefill call; returns the wall clock of arrival,
        so the ingress can time the hand-over against the encoder's finish time."""
        self.embeddings.put(request_id, encoded, slot)
        return time.time()

    async def prefill(self, request: PrefillRequest) -> PrefillResult:
        encoded = [self.embeddings.take(request.request_id, i) for i in range(len(request.placeholders))]
        arrived = time.perf_counter()
        self._queued += 1
        try:
            items = [embedding for embedding, _ in encoded]
            token, packed, rope_delta, started = await self.run_device(self._timed_prefill, request, items)
        finally:
            self._queued -= 1
        finished = time.perf_counter()
        if token is None:  # nothing to hand to decode; this request alone fails
            raise WorkerRequestError(f"the first token of request {request.request_id} could not be sampled "
                                     "(the model gave non-finite logits)")
        self.kv.put(request.request_id, packed)  # dropped at once if the request was closed meanwhile
        return PrefillResult(
            request_id=request.request_id,
            first_token_id=token.token_id,
            num_prompt_tokens=len(request.prompt_token_ids),
            queue_ms=(started - arrived) * 1e3,
            prefill_ms=(finished - started) * 1e3,
            encode_stats=tuple(stats for _, stats in encoded),
            rope_delta=rope_delta,
            first_logprob=token.logprob,
        )

    def _timed_prefill(self, request: PrefillRequest, items: list[torch.Tensor]):
        started = time.perf_counter()
        token, packed, rope_delta = self.runner.prefill(request.prompt_token_ids, request.placeholders, items,
                                                        request.sampling, history_of(request))
        return token, packed, rope_delta, started

    async def pop_kv(self, request_id: str) -> torch.Tensor:
        """The request's packed KV, handed over once (the caller picks the transport)."""
        return self.kv.take(request_id)

    def drop(self, request_id: str) -> None:
        """The request is over here: free what it holds, refuse what still arrives for it."""
        self.kv.close(request_id)
        self.embeddings.close(request_id)

    def drop_owner(self, prefix: str) -> int:
        """An ingress replica died: drop() all its requests (their ids start with `prefix`)."""
        return self.kv.close_owner(prefix) + self.embeddings.close_owner(prefix)

    def stats(self) -> dict[str, int]:
        return {"pid": os.getpid(), "queued": self._queued, "held_kv": len(self.kv), "held_embeddings": len(self.embeddings)}

    def load(self) -> WorkerLoad:
        return WorkerLoad(queued=self._queued, running=0)


# Tensor transport must be declared on the class: a per-handle option is not honoured.
PrefillActor = ray.remote(enable_tensor_transport=True)(PrefillWorker)
