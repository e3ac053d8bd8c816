"""Turns a request's token streams (one per choice) into OpenAI responses, chat or text
completion: SSE chunks or one JSON body, with logprobs, usage, finish reasons and timings,
and records the request-level metrics."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from pydantic import BaseModel

from actors.types import FinishReason, TokenChunk, TokenLogprob
from cluster.admitted import Admitted
from cluster.chat_tools import ToolMode, ToolReading
from cluster.completions import Completion, CompletionChoice
from cluster.detokenize import IncrementalText
from cluster.leftovers import close_soon
from cluster.logprobs import LogprobText
from cluster.metrics import Metrics
from cluster.protocol import ChatCompletionRequest
from cluster.request_path import RequestTimings
from cluster.response_models import (
    SSE_DONE,
    AssistantMessage,
    ChatCompletion,
    ChatCompletionChunk,
    Choice,
    ChunkChoice,
    DeltaMessage,
    Usage,
    sse_event,
)
from cluster.tool_chunks import ToolChunks, finish_reason


@dataclass
class Delta:
    text: str
    finish_reason: str | None
    logprobs: list[tuple[int, TokenLogprob]] = field(
        default_factory=list
    )  # the tokens behind `text`
    text_offset: int = 0  # where `text` starts in the choice's whole text


class Collector:
    """Follows one choice's tokens: text deltas, logprobs, token count, finish reason, timings."""

    def __init__(self, adm: Admitted, tokenizer, metrics: Metrics):
        self.adm, self.metrics = adm, metrics
        request = adm.request
        # The stop token that ended the request stays out of the text unless asked for (vLLM).
        hidden = () if request.include_stop_str_in_output else adm.sampling.stop_token_ids
        self.text = IncrementalText(
            tokenizer,
            tuple(request.stop or ()),
            hidden,
            skip_special_tokens=request.skip_special_tokens,
            include_stop=request.include_stop_str_in_output,
        )
        self.num_tokens = 0
        self.num_chars = 0
        self.trace = RequestTimings()
        self.finish_reason: str | None = None
        self._logprobs: list[tuple[int, TokenLogprob]] = []  # not yet sent with a delta
        self._last_chunk_s: float | None = None

    def _push(self, chunk: TokenChunk) -> str:
        """The chunk's text; a stop string cannot end in the first min_tokens - 1 tokens' text."""
        num_protected = max(0, self.adm.sampling.min_tokens - 1 - self.num_tokens)
        head, tail = chunk.token_ids[:num_protected], chunk.token_ids[num_protected:]
        text = self.text.push(head, protect=True) if head else ""
        if tail or not head or chunk.finished:
            text += self.text.push(tail, final=chunk.finished)
        self.num_tokens += len(chunk.token_ids)
        return text

    async def deltas(self, chunks: AsyncIterator[TokenChunk]) -> AsyncIterator[Delta]:
        async for chunk in chunks:
            self._tick()
            self._logprobs.extend(zip(chunk.token_ids, chunk.logprobs))
            text = self._push(chunk)
            if self.text.stopped:
                self.finish_reason = FinishReason.STOP.value
                yield self._delta(text, FinishReason.STOP.value)
                break  # leaving the stream aborts the decode upstream
            reason = chunk.finish_reason.value if chunk.finished else None
            self.finish_reason = reason or self.finish_reason
            if text or reason:
                yield self._delta(text, reason)

    def _delta(self, text: str, reason: str | None) -> Delta:
        delta = Delta(text, reason, self._logprobs, self.num_chars)
        self._logprobs, self.num_chars = [], self.num_chars + len(text)
        return delta

    def _tick(self) -> None:
        now_s = time.perf_counter()
        if self._last_chunk_s is not None:
            self.metrics.itl.observe(now_s - self._last_chunk_s)
        self._last_chunk_s = now_s

    def timings(self) -> dict[str, float]:
        """Every phase of the request's time to first token, in ms (RequestTimings.phases_ms),
        with the sums the router and the simulator read (encode, prefill call, prefill)."""
        t = self.trace
        return {
            "ttft_ms": t.ttft_ms or 0.0,
            "e2e_ms": (time.perf_counter() - self.adm.arrived_s) * 1e3,
            **t.phases_ms(self.adm.timings),
            "encode_ms": t.encode_ms,
            "prefill_call_ms": t.prefill_call_ms,
            "prefill_ms": t.prefill_ms,
            "estimated_ttft_ms": t.route.estimated_ttft_ms if t.route else 0.0,
        }


def _json(value) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def _record(metrics: Metrics, collectors: list[Collector]) -> None:
    """One finished request: its e2e and prompt, all choices' tokens, the first choice's
    TTFT, TPOT and finish reason."""
    first = collectors[0]
    e2e_s = time.perf_counter() - first.adm.arrived_s
    num_tokens = sum(c.num_tokens for c in collectors)
    metrics.requests.labels("ok").inc()
    metrics.success.labels(first.finish_reason or FinishReason.STOP.value).inc()
    metrics.e2e.observe(e2e_s)
    metrics.completion_tokens.inc(num_tokens)
    metrics.request_prompt_tokens.observe(len(first.adm.plan.token_ids))
    metrics.request_generation_tokens.observe(num_tokens)
    if first.trace.ttft_ms is not None:
        metrics.ttft.observe(first.trace.ttft_ms / 1e3)
        metrics.decode_time.observe(max(0.0, e2e_s - first.trace.ttft_ms / 1e3))
        if first.num_tokens > 1:
            metrics.tpot.observe((e2e_s - first.trace.ttft_ms / 1e3) / (first.num_tokens - 1))


def _usage(collectors: list[Collector]) -> Usage:
    """Prompt tokens once, every choice's tokens; the cached prompt tokens are the first
    choice's (as vLLM reports one sequence's, never a sum beyond the prompt)."""
    num_prompt = len(collectors[0].adm.plan.token_ids)
    cached = min(collectors[0].trace.num_cached_tokens or 0, num_prompt)
    return Usage.of(num_prompt, sum(c.num_tokens for c in collectors), cached_tokens=cached)


class Shape:
    """The wire shape of one endpoint's answers (chat.completion or text_completion)."""

    def __init__(self, adm: Admitted, tokenizer):
        self.adm, self.logprob_text = adm, LogprobText(tokenizer)
        self.is_chat = isinstance(adm.request, ChatCompletionRequest)
        self.wants_logprobs = adm.sampling.num_logprobs is not None
        self.tools = adm.request.tool_reading if self.is_chat else ToolReading()
        self.created = int(time.time())  # one value for every chunk of the answer, as OpenAI
        # A plain chat delta (the chunk of nearly every token) is written from a template: the
        # same bytes as the models below give (tests/unit/test_chunk_template.py), a fraction of the
        # CPU, which every streamed token pays.
        head = ChatCompletionChunk(
            id=adm.request_id, model=adm.request.model, created=self.created, choices=[]
        )
        self._chunk_head = head.model_dump_json().removesuffix('"choices":[]}')

    def _logprobs(self, delta: Delta):
        if not self.wants_logprobs:
            return None
        if self.is_chat:
            return self.logprob_text.chat(delta.logprobs)
        return self.logprob_text.completion(delta.logprobs, delta.text_offset)

    def whole(self, deltas: list[Delta], usage: Usage, timings: dict[str, float]) -> BaseModel:
        """One answer from each choice's text merged into one delta."""
        base = dict(
            id=self.adm.request_id, model=self.adm.request.model, usage=usage, timings=timings
        )
        if self.is_chat:
            return ChatCompletion(
                **base,
                choices=[
                    Choice(
                        index=i,
                        message=AssistantMessage(
                            content=calls.content, tool_calls=list(calls.calls) or None
                        ),
                        finish_reason=finish_reason(calls, d.finish_reason),
                        logprobs=self._logprobs(d),
                    )
                    for i, d in enumerate(deltas)
                    for calls in [self.tools.parse(d.text)]
                ],
            )
        return Completion(
            **base,
            choices=[
                CompletionChoice(
                    index=i, text=d.text, finish_reason=d.finish_reason, logprobs=self._logprobs(d)
                )
                for i, d in enumerate(deltas)
            ],
        )

    def tool_chunks(self, index: int) -> ToolChunks:
        base = dict(id=self.adm.request_id, model=self.adm.request.model, created=self.created)
        return ToolChunks(base, index, self.tools, self._logprobs)

    def chunk(self, index: int, delta: Delta | None, **extra) -> bytes:
        """An SSE event of one choice's delta; `delta` None: no choices (the usage chunk)."""
        if self.is_chat and delta is not None and not self.wants_logprobs and not extra:
            return self._plain_chat_chunk(index, delta)
        base = dict(
            id=self.adm.request_id, model=self.adm.request.model, created=self.created, **extra
        )
        if self.is_chat:
            choices = (
                []
                if delta is None
                else [
                    ChunkChoice(
                        index=index,
                        delta=DeltaMessage(content=delta.text or None),
                        finish_reason=delta.finish_reason,
                        logprobs=self._logprobs(delta),
                    )
                ]
            )
            return sse_event(ChatCompletionChunk(**base, choices=choices))
        choices = (
            []
            if delta is None
            else [
                CompletionChoice(
                    index=index,
                    text=delta.text,
                    finish_reason=delta.finish_reason,
                    logprobs=self._logprobs(delta),
                )
            ]
        )
        return sse_event(Completion(**base, choices=choices))

    def _plain_chat_chunk(self, index: int, delta: Delta) -> bytes:
        message = '{"content":' + _json(delta.text) + "}" if delta.text else "{}"
        choice = (
            f'{{"index":{index},"delta":{message},'
            f'"finish_reason":{_json(delta.finish_reason)},"logprobs":null}}'
        )
        return f'data: {self._chunk_head}"choices":[{choice}]}}\n\n'.encode()

    def role_chunk(self, index: int) -> bytes | None:
        if not self.is_chat:
            return None
        choice = ChunkChoice(index=index, delta=DeltaMessage(role="assistant", content=""))
        return sse_event(
            ChatCompletionChunk(
                id=self.adm.request_id,
                model=self.adm.request.model,
                created=self.created,
                choices=[choice],
            )
        )


async def _whole_choice(collector: Collector, chunks: AsyncIterator[TokenChunk]) -> Delta:
    merged = Delta("", None)
    try:
        async for delta in collector.deltas(chunks):
            merged.text += delta.text
            merged.logprobs.extend(delta.logprobs)
            merged.finish_reason = delta.finish_reason or merged.finish_reason
    finally:
        close_soon(chunks)  # a stop string ends the choice here: free its workers now
    return merged


async def _tool_events(tools: ToolChunks, collector: Collector, chunks) -> AsyncIterator[bytes]:
    """A named choice's arguments as they come; other tool answers once complete."""
    if not tools.reading.streams_arguments:
        yield tools.whole(await _whole_choice(collector, chunks))
        return
    yield tools.named_head()
    try:
        async for delta in collector.deltas(chunks):
            yield tools.named_delta(delta)
    finally:
        close_soon(chunks)


async def complete(
    shape: Shape,
    collectors: list[Collector],
    streams: list[AsyncIterator[TokenChunk]],
    metrics: Metrics,
) -> BaseModel:
    """The whole answer. Choices are read one after another: all are generating already,
    and a later one's tokens wait in its stream meanwhile."""
    try:
        deltas = [await _whole_choice(c, s) for c, s in zip(collectors, streams)]
    finally:
        for s in streams:
            close_soon(s)
    _record(metrics, collectors)
    return shape.whole(deltas, _usage(collectors), collectors[0].timings())


async def stream(
    shape: Shape,
    collectors: list[Collector],
    streams: list[AsyncIterator[TokenChunk]],
    metrics: Metrics,
) -> AsyncIterator[bytes]:
    """SSE events: each choice's role chunk, then each choice's deltas in turn, then usage.
    The role chunks go out in one write with the first delta: one trip through Serve's proxy
    before the first token, not two."""
    roles = (shape.role_chunk(index) for index in range(len(collectors)))
    pending = b"".join(event for event in roles if event is not None)
    try:
        for index, (collector, chunks) in enumerate(zip(collectors, streams)):
            if shape.tools.mode != ToolMode.NONE:
                async for event in _tool_events(shape.tool_chunks(index), collector, chunks):
                    event, pending = pending + event, b""
                    yield event
                continue
            async for delta in collector.deltas(chunks):
                event, pending = pending + shape.chunk(index, delta), b""
                yield event
            close_soon(chunks)  # a stop string ended it early: free its workers before the next
    finally:
        for s in streams:
            close_soon(s)
    _record(metrics, collectors)
    if shape.adm.request.include_usage:
        pending += shape.chunk(0, None, usage=_usage(collectors), timings=collectors[0].timings())
    yield pending + SSE_DONE
