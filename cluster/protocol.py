"""OpenAI chat-completions requests: validation, error messages, and the chat-template
messages and media parts they become (the response side: cluster/response_models.py).

Requests are lenient where OpenAI clients are sloppy (null for a default, image_url as
a bare string, an echoed assistant message's null tool_calls) and strict where a silent
fallback would surprise: a field this server does not honour is refused by name, as are
out-of-range sampling values and empty messages. No torch here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pydantic import (
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from cluster.chat_tools import (
    MAX_TOOLS,
    NamedToolChoice,
    ResponseFormat,
    Tool,
    ToolCall,
    ToolChoice,
    ToolMode,
    ToolReading,
    tool_mode,
)
from cluster.sampling_fields import MAX_LOGPROBS, SamplingFields, Strict, refuse_unless
from router.types import Modality

# Content-part type -> modality; a modality's value is also its HF chat-template placeholder type.
MEDIA_PART_TYPES: dict[str, Modality] = {
    "image_url": Modality.IMAGE,
    "input_audio": Modality.AUDIO,
    "audio_url": Modality.AUDIO,
    "video_url": Modality.VIDEO,
}


# ----------------------------------------------------------------------------- request


class ImageURL(Strict):
    url: str
    # "low": shrunk to fit 512 x 512 (cluster/media/image.py); "auto" and "high": as sent.
    detail: Literal["auto", "low", "high"] | None = None


class VideoURL(Strict):
    url: str


class AudioURL(
    Strict
):  # vLLM's extension: a data URL or an http(s) URL, the MIME type names the format
    url: str


class InputAudio(Strict):
    data: str = Field(description="base64 audio")
    format: str = Field(description="wav, mp3, ...")


class ContentPart(Strict):
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
    def _payload_present(self) -> ContentPart:
        if getattr(self, self.type) is None:
            raise PydanticCustomError(
                "missing_payload",
                "content part of type '{t}' needs a '{t}' field",
                {"t": self.type},
            )
        return self

    @property
    def is_media(self) -> bool:
        return self.type in MEDIA_PART_TYPES


class ChatMessage(Strict):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    tool_calls: list[ToolCall] | None = None  # an assistant turn's calls, replayed by agents
    # A string arrives as one text part; validate_default so a missing content is checked too.
    content: list[ContentPart] | None = Field(None, validate_default=True)
    name: str | None = None  # passed to the chat template, as vLLM does
    tool_call_id: str | None = None  # a tool result: the call it answers
    # What the openai client echoes back from an earlier assistant message: null only.
    refusal: None = None
    function_call: None = None
    audio: None = None
    annotations: None = None

    @field_validator("function_call", mode="before")
    @classmethod
    def _no_function_call(cls, value: Any) -> Any:
        return refuse_unless(value, (), "function_call is deprecated: send tool_calls")

    @field_validator("refusal", "audio", "annotations", mode="before")
    @classmethod
    def _unused(cls, value: Any) -> Any:
        return refuse_unless(value, (), "the chat template is not given this field")

    @field_validator("content", mode="before")
    @classmethod
    def _string_to_parts(cls, value: Any) -> Any:
        if isinstance(value, str):
            return [{"type": "text", "text": value}] if value else []
        if value is not None and not isinstance(value, list):
            raise PydanticCustomError(
                "content_type", "content must be a string or a list of content parts"
            )
        return value

    @model_validator(mode="after")
    def _content_or_calls(self) -> ChatMessage:
        if self.tool_calls is not None and self.role != "assistant":
            raise PydanticCustomError("tool_calls_role", "only assistant messages carry tool_calls")
        if (self.role == "tool") != (self.tool_call_id is not None):
            raise PydanticCustomError(
                "tool_call_id", "tool messages need a tool_call_id, and only they take one"
            )
        return self

    @field_validator("content")
    @classmethod
    def _not_empty(cls, value: list[ContentPart] | None, info: ValidationInfo) -> Any:
        if not value and not info.data.get("tool_calls"):  # calls alone: an assistant turn
            raise PydanticCustomError(
                "empty_content", "message has no content (missing, null or empty)"
            )
        return value

    @model_validator(mode="after")
    def _media_only_from_users(self) -> ChatMessage:
        if self.role != "user":
            for index, part in enumerate(self.content or ()):
                if part.is_media:
                    raise PydanticCustomError(
                        "media_not_allowed",
                        "content[{i}] is an '{t}' part, but media is only allowed in user messages",
                        {"i": index, "t": part.type},
                    )
        return self

    @property
    def template_role(self) -> str:
        return "system" if self.role == "developer" else self.role


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(
        None, ge=1, description="OpenAI's newer name for max_tokens; wins over it"
    )
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: ToolChoice | None = None  # default: "auto" with tools, else "none"
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict[str, Any] | None = None  # extra template variables (vLLM)
    # The deprecated function-calling API, refused by name.
    functions: None = None
    function_call: None = None

    @field_validator("functions", "function_call", mode="before")
    @classmethod
    def _no_functions(cls, value: Any) -> Any:
        return refuse_unless(value, (), "the functions API is deprecated: send tools")

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice_names_a_tool(cls, choice: Any, info: ValidationInfo) -> Any:
        tools = info.data.get("tools")
        if choice not in (None, "none") and not tools:
            raise PydanticCustomError("tool_choice_without_tools", "tool_choice needs tools")
        if isinstance(choice, NamedToolChoice):
            names = [t.function.name for t in tools]
            if choice.function.name not in names:
                raise PydanticCustomError(
                    "unknown_tool",
                    "tool_choice names function '{n}', which is not among the tools: {t}",
                    {"n": choice.function.name, "t": ", ".join(names)},
                )
        return choice

    @model_validator(mode="after")
    def _one_shape_of_output(self) -> ChatCompletionRequest:
        choice = self.tool_choice
        mode = tool_mode(self.tools, choice)
        if mode == ToolMode.AUTO and any(t.function.strict for t in self.tools):
            raise PydanticCustomError(
                "strict_under_auto",
                'a function with strict: true needs tool_choice "required" or that function '
                'by name: under "auto" the model\'s calls are parsed, not held to the schema',
            )
        constrained = mode in (ToolMode.NAMED, ToolMode.REQUIRED)
        if constrained and self.response_format and self.response_format.type != "text":
            raise PydanticCustomError(
                "format_and_tools",
                "response_format and a required or named tool_choice both shape the output: "
                "send one",
            )
        return self

    @property
    def tool_mode(self) -> str:
        return tool_mode(self.tools, self.tool_choice)

    @property
    def tool_reading(self) -> ToolReading:
        choice = self.tool_choice
        named = choice.function.name if isinstance(choice, NamedToolChoice) else None
        return ToolReading(self.tool_mode, named, self.parallel_tool_calls)

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_needs_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value and not info.data.get("logprobs"):
            raise PydanticCustomError(
                "top_logprobs_without_logprobs", 'top_logprobs needs "logprobs": true'
            )
        return value

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def max_tokens_param(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens else "max_tokens"

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


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
    if error["type"] == "extra_forbidden":
        return (
            f"Unrecognized request argument supplied: '{param}' (this server does not honour it)",
            param,
        )
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
    body = getattr(
        part, part.type
    )  # ImageURL, InputAudio, AudioURL or VideoURL; the validator ensured it is set
    return MediaPart(
        MEDIA_PART_TYPES[part.type],
        body.data if part.type == "input_audio" else body.url,
        param,
        format=getattr(body, "format", None),
        detail=getattr(body, "detail", None),
    )


def to_template_messages(
    messages: list[ChatMessage],
) -> tuple[list[dict[str, Any]], list[MediaPart]]:
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
        template.append(_template_message(message, content))
    return template, media


def _template_message(message: ChatMessage, content: list[dict[str, Any]]) -> dict[str, Any]:
    """A tool result's content is a string (templates print it as is); `name`, `tool_calls`
    and `tool_call_id` reach the template only when set."""
    entry: dict[str, Any] = {"role": message.template_role, "content": content}
    if message.role == "tool":
        entry["content"] = "".join(part["text"] for part in content)
        entry["tool_call_id"] = message.tool_call_id
    if message.tool_calls:
        entry["tool_calls"] = [call.for_template() for call in message.tool_calls]
    if message.name is not None:
        entry["name"] = message.name
    return entry
