"""POST /tokenize and POST /detokenize in vLLM's shapes: a prompt (tokenized as
/v1/completions does) or chat messages (templated as /v1/chat/completions does) -> token ids,
and token ids -> text. Strict bodies: an unknown field is refused by name, and so is a field
of the other form; ids are checked against the vocabulary. Media parts are refused by name:
their placeholder count depends on the decoded media, which this route does not decode.
No Ray, no torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any

from jinja2 import TemplateError
from pydantic import Field, ValidationInfo, field_validator
from pydantic_core import PydanticCustomError

from cluster.errors import RequestError
from cluster.protocol import ChatMessage, to_template_messages
from cluster.request_body import BodyError, parse_request
from cluster.sampling_fields import ParamError, Strict, check_token_ids

if TYPE_CHECKING:
    from cluster.prompt_plan import PromptPlanner


class TokenizeRequest(Strict):
    """vLLM's two forms in one model: `prompt` (with `add_special_tokens`) or `messages`
    (with `add_generation_prompt`)."""

    model: str | None = None  # as vLLM: optional, checked when given
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1, validate_default=True)
    add_generation_prompt: bool = Field(True, description="messages: the assistant turn opened")
    add_special_tokens: bool = Field(True, description="prompt: BOS etc. as the tokenizer adds")

    @field_validator("messages")
    @classmethod
    def _one_form(cls, value: Any, info: ValidationInfo) -> Any:
        has_prompt = info.data.get("prompt") is not None
        if value is not None and has_prompt:
            raise PydanticCustomError("tokenize_form", "give 'prompt' or 'messages', not both")
        if value is None and not has_prompt:
            raise PydanticCustomError(
                "tokenize_form", "missing: give 'prompt' (text) or 'messages' (chat)"
            )
        return value

    @field_validator("add_generation_prompt")
    @classmethod
    def _chat_only(cls, value: bool, info: ValidationInfo) -> bool:
        if info.data.get("messages") is None:
            raise PydanticCustomError("chat_only", "only with 'messages'")
        return value

    @field_validator("add_special_tokens")
    @classmethod
    def _prompt_only(cls, value: bool, info: ValidationInfo) -> bool:
        if info.data.get("prompt") is None:
            raise PydanticCustomError(
                "prompt_only", "only with 'prompt' (messages get the chat template's own tokens)"
            )
        return value


class DetokenizeRequest(Strict):
    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0)]]


class TokenEndpoints:
    """Both routes' work on the ingress's own tokenizer and chat template. Each method takes
    the raw body and returns the answer's JSON, or raises RequestError (a 4xx)."""

    def __init__(self, planner: PromptPlanner, served_name: str, max_model_len: int):
        self.planner, self.served_name, self.max_model_len = planner, served_name, max_model_len

    def tokenize(self, body: bytes) -> dict[str, Any]:
        request = self._parse(body, TokenizeRequest)
        if request.messages is None:
            tokenized = self.planner.tokenizer(
                request.prompt, add_special_tokens=request.add_special_tokens
            )
            ids = list(tokenized["input_ids"])
        else:
            ids = self._chat_ids(request)
        return {"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids}

    def detokenize(self, body: bytes) -> dict[str, Any]:
        request = self._parse(body, DetokenizeRequest)
        try:
            check_token_ids(request.tokens, len(self.planner.tokenizer), "tokens")
        except ParamError as exc:
            raise RequestError(400, exc.message, exc.param) from None
        # Special tokens stay in the text, as vLLM's /detokenize (tokenize's inverse).
        return {"prompt": self.planner.tokenizer.decode(request.tokens)}

    def _chat_ids(self, request: TokenizeRequest) -> list[int]:
        """The chat path's own prompt (planner.plan) when the generation prompt is added;
        without it, the same template rendered without it and checked the same way."""
        hf_messages, media = to_template_messages(request.messages)
        if media:
            raise RequestError(
                400,
                f"Invalid '{media[0].param}': /tokenize takes text messages only (a media part's "
                "placeholder count depends on the decoded media); /v1/chat/completions reports "
                "the whole prompt's count in usage.prompt_tokens",
                media[0].param,
            )
        planner = self.planner
        try:
            if request.add_generation_prompt:
                return list(planner.plan(hf_messages, []).token_ids)
            template = {"chat_template": planner.template} if planner.template else {}
            text = planner.processor.apply_chat_template(
                hf_messages, add_generation_prompt=False, tokenize=False, **template
            )
            ids = planner.text_ids(text)
            return list(planner.plan_text(list(ids)).token_ids)  # no reserved media tokens
        except (ValueError, TemplateError) as exc:  # PromptError, or the template refused
            raise RequestError(400, f"Invalid 'messages': {exc}", "messages") from None

    def _parse(self, body: bytes, model: type[TokenizeRequest] | type[DetokenizeRequest]):
        try:
            request = parse_request(body, model)
        except BodyError as exc:
            raise RequestError(400, exc.message, exc.param) from None
        if request.model is not None and request.model != self.served_name:
            raise RequestError(
                404,
                f"model {request.model!r} does not exist; this server serves {self.served_name!r}",
                "model",
                code="model_not_found",
            )
        return request
