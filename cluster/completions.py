"""OpenAI's legacy text completions (/v1/completions): the request, one prompt (text or
token ids) without a chat template, and the `text_completion` response and stream chunks.
Sampling fields are chat's (SamplingFields). No torch here."""

from __future__ import annotations

import time
import uuid
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, Field, field_validator
from pydantic_core import PydanticCustomError

from cluster.logprobs import CompletionLogprobs
from cluster.response_models import OmitNone, Usage
from cluster.sampling_fields import MAX_LOGPROBS, ModelBounds, SamplingFields, refuse_unless

DEFAULT_MAX_TOKENS = (
    16  # OpenAI's and vLLM's default for completions (chat's is the rest of the context)
)


class CompletionRequest(SamplingFields):
    prompt: str | list[int] = Field(description="one prompt: text, or token ids")
    logprobs: int | None = Field(
        None, ge=0, le=MAX_LOGPROBS, description="the chosen token's logprob and the top k"
    )
    echo: bool = False
    suffix: None = None
    best_of: int | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, value: Any) -> Any:
        # OpenAI also takes a batch ([str, ...] or [[int, ...], ...]); one of one is one prompt.
        if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
            value = value[0]
        if isinstance(value, list) and any(isinstance(v, (str, list)) for v in value):
            raise PydanticCustomError(
                "prompt_batch", "a batch of prompts is not supported: send one request per prompt"
            )
        if value in ("", []):
            raise PydanticCustomError("empty_prompt", "the prompt is empty")
        return value

    @field_validator("echo", mode="before")
    @classmethod
    def _no_echo(cls, value: Any) -> Any:
        return refuse_unless(value, (False,), "echoing the prompt is not built")

    @field_validator("suffix", mode="before")
    @classmethod
    def _no_suffix(cls, value: Any) -> Any:
        return refuse_unless(value, (), "insertion (a suffix after the completion) is not built")

    @field_validator("best_of", mode="before")
    @classmethod
    def _no_best_of(cls, value: Any) -> Any:
        return refuse_unless(value, (1,), "best_of > 1 is not built (n gives several choices)")

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs

    def default_max_tokens(self, bounds: ModelBounds) -> int:
        return bounds.default_max_tokens or DEFAULT_MAX_TOKENS


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class Completion(OmitNone):
    """A whole completion, and (with `usage` None until the last) each streamed chunk."""

    _omit_if_none: ClassVar[frozenset[str]] = frozenset({"usage", "timings"})
    id: str = Field(default_factory=lambda: f"cmpl-{uuid.uuid4().hex}")
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    timings: dict[str, float] | None = None
