"""Turns a request's token stream into OpenAI responses: SSE chunks or one JSON body,
with usage, finish reason and timings, and records the request-level metrics."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import AsyncIterator

from actors.types import FinishReason, TokenChunk
from cluster.detokenize import IncrementalText
from cluster.metrics import Metrics
from cluster.protocol import (
    SSE_DONE, AssistantMessage, ChatCompletion, ChatCompletionChunk, ChunkChoice, Choice, DeltaMessage, Usage, sse_event,
)
from cluster.request_path import Admitted, Trace, close_soon


@dataclass
class Delta:
    text: str
    finish_reason: str | None


class Collector:
    """Follows one request's tokens: text deltas, token counts, finish reason, timings."""

    def __init__(self, adm: Admitted, tokenizer, metrics: Metrics):
        self.adm, self.metrics = adm, metrics
        self.text = IncrementalText(tokenizer, tuple(adm.request.stop or ()), adm.sampling.stop_token_ids)
        self.num_tokens = 0
        self.trace = Trace()
        self.finish_reason: str | None = None
        self._last_chunk_s: float | None = None

    async def deltas(self, chunks: AsyncIterator[TokenChunk]) -> AsyncIterator[Delta]:
        async for chunk in chunks:
            self._tick()
            self.num_tokens += len(chunk.token_ids)
            text = self.text.push(chunk.token_ids, final=chunk.finished)
            if self.text.stopped:
                self.finish_reason = FinishReason.STOP.value
                yield Delta(text, FinishReason.STOP.value)
                break  # leaving the stream aborts the decode upstream
            reason = chunk.finish_reason.value if chunk.finished else None
            self.finish_reason = reason or self.finish_reason
            if text or reason:
                yield Delta(text, reason)
        self._record()

    def _tick(self) -> None:
        now_s = time.perf_counter()
        if self._last_chunk_s is not None:
            self.metrics.itl.observe(now_s - self._last_chunk_s)
        self._last_chunk_s = now_s

    def _record(self) -> None:
        m, t = self.metrics, self.trace
        e2e_s = time.perf_counter() - self.adm.arrived_s
        m.requests.labels("ok").inc()
        m.success.labels(self.finish_reason or FinishReason.STOP.value).inc()
        m.e2e.observe(e2e_s)
        m.completion_tokens.inc(self.num_tokens)
        m.request_prompt_tokens.observe(len(self.adm.plan.token_ids))
        m.request_generation_tokens.observe(self.num_tokens)
        if t.ttft_ms is not None:
            m.ttft.observe(t.ttft_ms / 1e3)
            m.decode_time.observe(max(0.0, e2e_s - t.ttft_ms / 1e3))
            if self.num_tokens > 1:
                m.tpot.observe((e2e_s - t.ttft_ms / 1e3) / (self.num_tokens - 1))

    @property
    def usage(self) -> Usage:
        return Usage.of(len(self.adm.plan.token_ids), self.num_tokens)

    def timings(self) -> dict[str, float]:
        t = self.trace
        return {
            "ttft_ms": t.ttft_ms or 0.0,
            "e2e_ms": (time.perf_counter() - self.adm.arrived_s) * 1e3,
            "encode_ms": t.encode_ms,
            "prefill_ms": t.prefill_ms,
            "prefill_queue_ms": t.prefill_queue_ms,
            "estimated_ttft_ms": t.route.estimated_ttft_ms if t.route else 0.0,
        }


async def complete(collector: Collector, chunks: AsyncIterator[TokenChunk]) -> ChatCompletion:
    parts, reason = [], None
    try:
        async for delta in collector.deltas(chunks):
            parts.append(delta.text)
            reason = delta.finish_reason or reason
    finally:
        close_soon(chunks)  # a stop string ends the request here: free its workers now
    adm = collector.adm
    return ChatCompletion(
        id=adm.request_id,
        model=adm.request.model,
        choices=[Choice(message=AssistantMessage(content="".join(parts)), finish_reason=reason)],
        usage=collector.usage,
        timings=collector.timings(),
    )


async def stream(collector: Collector, chunks: AsyncIterator[TokenChunk]) -> AsyncIterator[bytes]:
    adm = collector.adm

    def chunk(delta: DeltaMessage, reason: str | None = None, **extra) -> bytes:
        choices = [ChunkChoice(delta=delta, finish_reason=reason)] if delta is not None else []
        return sse_event(ChatCompletionChunk(id=adm.request_id, model=adm.request.model, choices=choices, **extra))

    yield chunk(DeltaMessage(role="assistant", content=""))
    async for delta in collector.deltas(chunks):
        yield chunk(DeltaMessage(content=delta.text or None), delta.finish_reason)
    if adm.request.include_usage:
        yield chunk(None, usage=collector.usage, timings=collector.timings())
    yield SSE_DONE
