"""Tool calls as OpenAI streams them: per call a chunk with its id and name, then chunks of
its arguments, then the finish reason. A named tool choice's answer is its arguments, so they
stream as the tokens come; `required` and `auto` answers are read as calls once complete."""

from __future__ import annotations

from collections.abc import Callable

from cluster.chat_tools import ToolCalls, ToolReading, new_call_id
from cluster.response_models import ChatCompletionChunk, ChunkChoice, DeltaMessage, sse_event


def finish_reason(calls: ToolCalls, reason: str | None) -> str | None:
    """An answer that ended by itself ("stop") with tool calls ends with "tool_calls"."""
    return "tool_calls" if calls.calls and reason == "stop" else reason


class ToolChunks:
    """One choice's tool-call chunks; `base` holds the chunk's id, model and created."""

    def __init__(self, base: dict, index: int, reading: ToolReading, logprobs: Callable):
        self.base, self.index, self.reading = base, index, reading
        self._logprobs = logprobs  # Delta -> the choice's logprobs field
        self._call_id = new_call_id()

    def _event(self, delta: DeltaMessage, reason: str | None = None, logprobs=None) -> bytes:
        choice = ChunkChoice(index=self.index, delta=delta, finish_reason=reason, logprobs=logprobs)
        return sse_event(ChatCompletionChunk(**self.base, choices=[choice]))

    def _head(self, i: int, call_id: str, name: str) -> bytes:
        part = {"index": i, "id": call_id, "type": "function"}
        return self._event(
            DeltaMessage(tool_calls=[{**part, "function": {"name": name, "arguments": ""}}])
        )

    def _arguments(self, i: int, text: str) -> bytes:
        return self._event(DeltaMessage(tool_calls=[{"index": i, "function": {"arguments": text}}]))

    def named_head(self) -> bytes:
        return self._head(0, self._call_id, self.reading.named)

    def named_delta(self, delta) -> bytes:
        """A named choice's next arguments; with its finish reason once the answer ends."""
        out = self._arguments(0, delta.text) if delta.text else b""
        if delta.finish_reason is None:
            return out
        reason = "tool_calls" if delta.finish_reason == "stop" else delta.finish_reason
        return out + self._event(DeltaMessage(), reason, self._logprobs(delta))

    def whole(self, delta) -> bytes:
        """A complete answer read as calls: any content, each call, then the finish reason."""
        calls = self.reading.parse(delta.text)
        out = self._event(DeltaMessage(content=calls.content)) if calls.content else b""
        for i, call in enumerate(calls.calls):
            out += self._head(i, call.id, call.function.name)
            out += self._arguments(i, call.function.arguments)
        reason = finish_reason(calls, delta.finish_reason)
        return out + self._event(DeltaMessage(), reason, self._logprobs(delta))
