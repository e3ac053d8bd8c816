"""OpenAI response shapes: chat completions and their SSE chunks, usage, the model list,
the error body, and server-sent events (the request side: cluster/protocol.py). No torch."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, Field, model_serializer

from cluster.chat_tools import ToolCall
from cluster.logprobs import ChatLogprobs

SSE_DONE = b"data: [DONE]\n\n"


class OmitNone(BaseModel):
    """Drops the fields named in _omit_if_none when they are None (OpenAI omits them)."""

    _omit_if_none: ClassVar[frozenset[str]] = frozenset()

    @model_serializer(mode="wrap")
    def _omit(self, handler: Any) -> dict[str, Any]:
        data = handler(self)
        return {k: v for k, v in data.items() if not (k in self._omit_if_none and v is None)}


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens whose KV the prefix cache supplied


class Usage(OmitNone):
    _omit_if_none: ClassVar[frozenset[str]] = frozenset({"prompt_tokens_details"})
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None

    @classmethod
    def of(
        cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None
    ) -> Usage:
        """`cached_tokens` None: no prompt_tokens_details at all."""
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
            prompt_tokens_details=None
            if cached_tokens is None
            else PromptTokensDetails(cached_tokens=cached_tokens),
        )


class AssistantMessage(OmitNone):
    _omit_if_none: ClassVar[frozenset[str]] = frozenset({"tool_calls"})
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    tool_calls: list[ToolCall] | None = None


class Choice(BaseModel):
    index: int = 0
    message: AssistantMessage
    finish_reason: str | None = None
    logprobs: ChatLogprobs | None = None


class ChatCompletion(OmitNone):
    _omit_if_none: ClassVar[frozenset[str]] = frozenset({"timings"})
    id: str = Field(default_factory=lambda: f"chatcmpl-{uuid.uuid4().hex}")
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[Choice]
    usage: Usage
    timings: dict[str, float] | None = (
        None  # ttft_ms, estimated_ttft_ms, encode_ms, ... (extension)
    )


class DeltaMessage(OmitNone):
    _omit_if_none: ClassVar[frozenset[str]] = frozenset({"role", "content", "tool_calls"})
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # OpenAI's deltas: index, then parts of a call


class ChunkChoice(BaseModel):
    index: int = 0
    delta: DeltaMessage
    finish_reason: str | None = None
    logprobs: ChatLogprobs | None = None


class ChatCompletionChunk(OmitNone):
    _omit_if_none: ClassVar[frozenset[str]] = frozenset({"usage", "timings"})
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None  # only on the final chunk when stream_options.include_usage
    timings: dict[str, float] | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "epd"
    root: str | None = None  # the checkpoint directory
    max_model_len: int | None = None  # prompt plus generated tokens, as vLLM reports it


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


def error_body(
    message: str,
    *,
    type: str = "invalid_request_error",
    param: str | None = None,
    code: str | None = None,
) -> dict[str, Any]:
    """OpenAI's error shape: {"error": {"message", "type", "param", "code"}}."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def sse_event(obj: BaseModel | dict[str, Any]) -> bytes:
    """One server-sent event: `data: {json}\\n\\n`."""
    body = (
        obj.model_dump_json()
        if isinstance(obj, BaseModel)
        else json.dumps(obj, separators=(",", ":"))
    )
    return f"data: {body}\n\n".encode()
