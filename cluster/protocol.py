"""OpenAI chat-completions wire format: request validation, responses, errors and SSE.

Requests are lenient where OpenAI clients are sloppy (unknown fields, null for a
default, image_url as a bare string) and strict where a silent fallback would
surprise (n != 1, out-of-range sampling values, empty messages). No torch here.
"""
from __future__ import annotations

import json
import secrets
import time
import uuid
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (BaseModel, ConfigDict, Field, ValidationError, ValidationInfo,
                      field_validator, model_serializer, model_validator)
from pydantic_core import PydanticCustomError

from actors.types import Modality, SamplingParams

SSE_DONE = b"data: [DONE]\n\n"
MIN_TEMPERATURE = 0.01  # as vLLM: below it, sampling is numerically unsafe and barely differs from greedy

# Content-part type -> modality; a modality's value is also its HF chat-template placeholder type.
MEDIA_PART_TYPES: dict[str, Modality] = {
    "image_url": Modality.IMAGE, "input_audio": Modality.AUDIO, "audio_url": Modality.AUDIO, "video_url": Modality.VIDEO}


class _Lenient(BaseModel):
    # OpenAI clients send fields we do not model (name, refusal, logit_bias, ...): ignore them.
    model_config = ConfigDict(extra="ignore")


# ----------------------------------------------------------------------------- request

class ImageURL(_Lenient):
    url: str
    detail: Literal["auto", "low", "high"] | None = None


class VideoURL(_Lenient):
    url: str


class AudioURL(_Lenient):  # vLLM's extension: a data URL or an http(s) URL, the MIME type names the format
    url: str


class InputAudio(_Lenient):
    data: str = Field(description="base64 audio")
    format: str = Field(description="wav, mp3, ...")


class ContentPart(_Lenient):
    """One content part; `type` names the payload field that must be present.
    One model, not a pydantic union, so error locations stay clean JSON paths."""

    type: Literal["text", "image_url", "input_audio", "audio_url", "video_url"]
    text: str | None = None
    image_url: ImageURL | None = None
    input_audio: InputAudio | None = None
    video_url: VideoURL | None = None
    audio_url: AudioURL | None = None

    @field_validator("image_url", "video_url", "audio_url", mode="before")
    @classmethod
    def _bare_url(cls, value: Any) -> Any:
        # Some clients send {"image_url": "data:..."} instead of {"image_url": {"url": "data:..."}}.
        return {"url": value} if isinstance(value, str) else value

    @model_validator(mode="after")
    def _payload_present(self) -> "ContentPart":
        if getattr(self, self.type) is None:
            raise PydanticCustomError("missing_payload", "content part of type '{t}' needs a '{t}' field",
                                      {"t": self.type})
        return self

    @property
    def is_media(self) -> bool:
        return self.type in MEDIA_PART_TYPES


class ChatMessage(_Lenient):
    role: Literal["system", "user", "assistant", "developer"]
    # A string arrives as one text part; validate_default so a missing content is checked too.
    content: list[ContentPart] | None = Field(None, validate_default=True)

    @field_validator("content", mode="before")
    @classmethod
    def _string_to_parts(cls, value: Any) -> Any:
        if isinstance(value, str):
            return [{"type": "text", "text": value}] if value else []
        if value is not None and not isinstance(value, list):
            raise PydanticCustomError("content_type", "content must be a string or a list of content parts")
        return value

    @field_validator("content")
    @classmethod
    def _not_empty(cls, value: list[ContentPart] | None) -> list[ContentPart]:
        if not value:
            raise PydanticCustomError("empty_content", "message has no content (missing, null or empty)")
        return value

    @model_validator(mode="after")
    def _media_only_from_users(self) -> "ChatMessage":
        if self.role != "user":
            for index, part in enumerate(self.content or ()):
                if part.is_media:
                    raise PydanticCustomError(
                        "media_not_allowed",
                        "content[{i}] is an '{t}' part, but media is only allowed in user messages",
                        {"i": index, "t": part.type})
        return self

    @property
    def template_role(self) -> str:
        return "system" if self.role == "developer" else self.role


class StreamOptions(_Lenient):
    include_usage: bool = False


class ChatCompletionRequest(_Lenient):
    model: str
    messages: list[ChatMessage] = Field(min_length=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1, description="-1 or 0: off (vLLM extension)")
    seed: int | None = None
    stop: list[Annotated[str, Field(min_length=1)]] | None = Field(None, max_length=4)
    n: int = 1
    user: str | None = None

    @field_validator("*", mode="before")
    @classmethod
    def _null_means_default(cls, value: Any, info: ValidationInfo) -> Any:
        # Clients send "temperature": null to mean "default"; only `model`/`messages` have none.
        if value is None and info.field_name is not None:
            field = cls.model_fields[info.field_name]
            if not field.is_required():
                return field.get_default(call_default_factory=True)
        return value

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_as_list(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value

    @field_validator("temperature")
    @classmethod
    def _numerically_safe_temperature(cls, value: float) -> float:
        # logits / t overflows float32 for tiny t, and one row's NaN must not reach a batch.
        if 0.0 < value < MIN_TEMPERATURE:
            raise PydanticCustomError("temperature_too_small", "must be 0 (greedy) or at least {m}, got {t}",
                                      {"m": MIN_TEMPERATURE, "t": value})
        return value

    @field_validator("n")
    @classmethod
    def _only_one_choice(cls, value: int) -> int:
        if value != 1:
            raise PydanticCustomError("unsupported_n", "only n=1 is supported, got {n}", {"n": value})
        return value

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def effective_max_tokens(self, default: int) -> int:
        """max_completion_tokens wins over the deprecated max_tokens; `default` when neither."""
        return self.max_completion_tokens or self.max_tokens or default

    def to_sampling_params(self, *, default_max_tokens: int,
                           stop_token_ids: tuple[int, ...] = ()) -> SamplingParams:
        """Sampling settings for the engine. A missing seed gets a random one (no seed = not reproducible)."""
        return SamplingParams(
            temperature=self.temperature, top_p=self.top_p, top_k=max(self.top_k, 0),
            seed=self.seed if self.seed is not None else secrets.randbits(63),
            max_tokens=self.effective_max_tokens(default_max_tokens), stop_token_ids=stop_token_ids)


def format_param(loc: tuple[int | str, ...]) -> str | None:
    path = ""
    for part in loc:
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
    return path or None


def validation_error_message(exc: ValidationError) -> tuple[str, str | None]:
    """(human-readable message, param path such as 'messages[0].content') from the first error."""
    error = exc.errors(include_url=False)[0]
    param = format_param(tuple(error["loc"]))
    msg = error["msg"].removeprefix("Value error, ")
    if error["type"] == "missing" and param:
        return f"Missing required parameter: '{param}'.", param
    if error["type"] == "json_invalid":
        return f"Request body is not valid JSON: {error.get('ctx', {}).get('error', msg)}", None
    return (f"Invalid '{param}': {msg}" if param else f"Invalid request: {msg}"), param


# ----------------------------------------------------------------------------- media extraction

@dataclass(frozen=True)
class MediaPart:
    """One media part of a validated request, in prompt order, with its JSON path for errors."""

    modality: Modality
    payload: str  # the URL (image/video) or the base64 data (audio)
    param: str  # e.g. "messages[1].content[2].image_url"
    format: str | None = None  # input_audio's declared format
    detail: str | None = None  # image_url's detail hint


def _media_part(part: ContentPart, param: str) -> MediaPart:
    body = getattr(part, part.type)  # ImageURL, InputAudio, AudioURL or VideoURL; the validator ensured it is set
    return MediaPart(MEDIA_PART_TYPES[part.type], body.data if part.type == "input_audio" else body.url,
                     param, format=getattr(body, "format", None), detail=getattr(body, "detail", None))


def to_template_messages(messages: list[ChatMessage]) -> tuple[list[dict[str, Any]], list[MediaPart]]:
    """(HF chat-template messages, media parts), both in the client's order so placeholders line up.

    Every content becomes a list of {"type": "text", "text": ...} / {"type": "image"} / ... entries.
    """
    template: list[dict[str, Any]] = []
    media: list[MediaPart] = []
    for m_index, message in enumerate(messages):
        content: list[dict[str, Any]] = []
        for p_index, part in enumerate(message.content or ()):
            if part.type == "text":
                content.append({"type": "text", "text": part.text})
                continue
            content.append({"type": MEDIA_PART_TYPES[part.type].value})
            media.append(_media_part(part, f"messages[{m_index}].content[{p_index}].{part.type}"))
        template.append({"role": message.template_role, "content": content})
    return template, media


# ----------------------------------------------------------------------------- responses

class _OmitNone(BaseModel):
    """Drops the fields named in _omit_if_none when they are None (OpenAI omits them)."""

    _omit_if_none: ClassVar[frozenset[str]] = frozenset()

    @model_serializer(mode="wrap")
    def _omit(self, handler: Any) -> dict[str, Any]:
        data = handler(self)
        return {k: v for k, v in data.items() if not (k in self._omit_if_none and v is None)}


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int) -> "Usage":
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens)


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None


class Choice(BaseModel):
    index: int = 0
    message: AssistantMessage
    finish_reason: str | None = None
    logprobs: None = None


class ChatCompletion(_OmitNone):
    _omit_if_none: ClassVar[frozenset[str]] = frozenset({"timings"})
    id: str = Field(default_factory=lambda: f"chatcmpl-{uuid.uuid4().hex}")
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[Choice]
    usage: Usage
    timings: dict[str, float] | None = None  # ttft_ms, estimated_ttft_ms, encode_ms, ... (extension)


class DeltaMessage(_OmitNone):
    _omit_if_none: ClassVar[frozenset[str]] = frozenset({"role", "content"})
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChunkChoice(BaseModel):
    index: int = 0
    delta: DeltaMessage
    finish_reason: str | None = None
    logprobs: None = None


class ChatCompletionChunk(_OmitNone):
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


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


def error_body(message: str, *, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    """OpenAI's error shape: {"error": {"message", "type", "param", "code"}}."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def sse_event(obj: BaseModel | dict[str, Any]) -> bytes:
    """One server-sent event: `data: {json}\\n\\n`."""
    body = obj.model_dump_json() if isinstance(obj, BaseModel) else json.dumps(obj, separators=(",", ":"))
    return f"data: {body}\n\n".encode("utf-8")
