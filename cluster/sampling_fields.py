"""The request fields chat and text completions share: sampling, penalties, stops, n,
streaming, and their conversion to the engine's SamplingParams once the prompt is known.

Strict: a field no model here declares is refused by name (never silently dropped), and a
value that only the served model can judge (a token id, a length against the context) is
checked in `to_sampling_params`. No torch here.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator
from pydantic_core import PydanticCustomError

from actors.types import SamplingParams

# Seeds of unseeded requests: not secrets, so no os.urandom call per request (a syscall on the
# request's thread, which hands the GIL to the replica's other loop); seeded from it once.
_SEEDS = random.Random()

MIN_TEMPERATURE = (
    0.01  # as vLLM: below it, sampling is numerically unsafe and barely differs from greedy
)
MIN_TOP_P = (
    1e-5  # vLLM's sampling epsilon: a smaller nucleus is the top token alone (use temperature 0)
)
MAX_N = 16  # choices per request: each is a sequence of its own on the workers
MAX_LOGPROBS = 20  # as OpenAI's top_logprobs and vLLM's default max_logprobs
MAX_STOPS = 4  # as OpenAI
MAX_STOP_CHARS = 256  # each stop string is matched against the text's tail at every token
MAX_LOGIT_BIAS = 1024  # entries; each is one indexed add per step
MAX_STOP_TOKEN_IDS = 1024  # each is masked per step until min_tokens, and checked at every token
MAX_BIAS = 100.0  # as OpenAI: -100 bans a token, 100 forces it


class ParamError(ValueError):
    """A field's value does not fit the served model (its vocabulary or its context)."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.message, self.param = message, param


class Strict(BaseModel):
    # A field we do not declare is refused by name: OpenAI's "Unrecognized request argument".
    model_config = ConfigDict(extra="forbid")


class StreamOptions(Strict):
    include_usage: bool = False


@dataclass(frozen=True)
class ModelBounds:
    """What a request's sampling is checked against: the served model's shape."""

    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    default_max_tokens: int | None = None  # None: the rest of the context


class SamplingFields(Strict):
    """Fields of /v1/chat/completions and /v1/completions alike (OpenAI's and vLLM's names)."""

    model: str
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(
        0, ge=-1, description="-1 or 0: off (vLLM extension); at most the vocabulary"
    )
    seed: int | None = None
    stop: list[Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]] | None = Field(
        None, max_length=MAX_STOPS
    )
    n: int = Field(1, ge=1, le=MAX_N)
    user: str | None = None  # an end-user id for the caller's own bookkeeping; no effect on output
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(
        1.0, gt=0.0, description="vLLM/HF: over prompt and output; 1 = off"
    )
    logit_bias: dict[str, Annotated[float, Field(ge=-MAX_BIAS, le=MAX_BIAS)]] | None = Field(
        None, max_length=MAX_LOGIT_BIAS
    )
    min_tokens: int = Field(0, ge=0, description="vLLM: no stop token before this many tokens")
    min_p: float = Field(
        0.0, ge=0.0, le=1.0, description="vLLM: drop tokens below min_p x the top token's chance"
    )
    ignore_eos: bool = Field(False, description="vLLM: generate on past the end-of-sequence token")
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = Field(
        None,
        max_length=MAX_STOP_TOKEN_IDS,
        description="vLLM: token ids that end the request as EOS does (also with ignore_eos)",
    )
    skip_special_tokens: bool = Field(True, description="vLLM: special tokens left out of the text")
    include_stop_str_in_output: bool = Field(
        False, description="vLLM: the matched stop string (or stop token) stays in the text"
    )

    @field_validator("*", mode="before")
    @classmethod
    def _null_means_default(cls, value: Any, info: ValidationInfo) -> Any:
        # Clients send "temperature": null to mean "default"; required fields have none.
        if value is None and info.field_name is not None:
            field = cls.model_fields[info.field_name]
            if not field.is_required():
                return field.get_default(call_default_factory=True)
        return value

    @field_validator("stream_options")
    @classmethod
    def _only_when_streaming(
        cls, value: StreamOptions | None, info: ValidationInfo
    ) -> StreamOptions | None:
        # Accepting it without `stream` would silently drop it (OpenAI and vLLM refuse it too).
        if value is not None and not info.data.get("stream"):
            raise PydanticCustomError(
                "stream_options_without_stream", "only allowed when `stream` is true"
            )
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
            raise PydanticCustomError(
                "temperature_too_small",
                "must be 0 (greedy) or at least {m}, got {t}",
                {"m": MIN_TEMPERATURE, "t": value},
            )
        return value

    @field_validator("top_p")
    @classmethod
    def _numerically_safe_top_p(cls, value: float) -> float:
        if value < MIN_TOP_P:
            raise PydanticCustomError(
                "top_p_too_small",
                "must be in [{m}, 1] (temperature 0 for greedy), got {p}",
                {"m": MIN_TOP_P, "p": value},
            )
        return value

    @field_validator("logit_bias")
    @classmethod
    def _token_ids_as_keys(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key in value or {}:
            if not key.isdigit() or len(key) > 10:
                raise PydanticCustomError(
                    "logit_bias_key",
                    "keys must be token ids (non-negative integers), got '{k}'",
                    {"k": key[:20]},
                )
        return value

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def max_tokens_param(self) -> str:
        """The field a max_tokens error names (chat's max_completion_tokens may win)."""
        return "max_tokens"

    @property
    def num_logprobs(self) -> int | None:
        """None: no logprobs; k: the chosen token's and the k most likely."""
        return None

    def default_max_tokens(self, bounds: ModelBounds) -> int | None:
        """max_tokens when the request gives none; None: the rest of the context."""
        return bounds.default_max_tokens

    def effective_max_tokens(self, num_prompt_tokens: int, bounds: ModelBounds) -> int:
        """The request's max_tokens, else the configured default, else the rest of the context;
        a prompt plus max_tokens beyond the context is refused, as vLLM does."""
        room = bounds.max_model_len - num_prompt_tokens
        asked = self.requested_max_tokens
        if asked is None:
            return min(self.default_max_tokens(bounds) or room, room)
        if asked > room:
            raise ParamError(
                f"Invalid '{self.max_tokens_param}': the prompt is {num_prompt_tokens} tokens and "
                f"{self.max_tokens_param} is {asked}, more than this model's context of "
                f"{bounds.max_model_len} tokens",
                self.max_tokens_param,
            )
        return asked

    def _checked_bias(self, vocab_size: int) -> tuple[tuple[int, float], ...]:
        bias = tuple((int(k), v) for k, v in (self.logit_bias or {}).items())
        check_token_ids((token_id for token_id, _ in bias), vocab_size, "logit_bias")
        return bias

    def _stop_token_ids(self, bounds: ModelBounds) -> tuple[int, ...]:
        """EOS (unless ignore_eos) and the request's own stop ids, each once, in that order."""
        extra = tuple(self.stop_token_ids or ())
        check_token_ids(extra, bounds.vocab_size, "stop_token_ids")
        return tuple(dict.fromkeys((() if self.ignore_eos else bounds.eos_token_ids) + extra))

    def to_sampling_params(self, num_prompt_tokens: int, bounds: ModelBounds) -> SamplingParams:
        """Sampling settings for the engine. A missing seed gets a random one (no seed = not
        reproducible); ParamError names a field the served model cannot take."""
        max_tokens = self.effective_max_tokens(num_prompt_tokens, bounds)
        if self.min_tokens > max_tokens:
            raise ParamError(
                f"Invalid 'min_tokens': {self.min_tokens} is more than the {max_tokens} tokens "
                f"this request may generate ({self.max_tokens_param} or the rest of the context)",
                "min_tokens",
            )
        if self.top_k > bounds.vocab_size:
            raise ParamError(
                f"Invalid 'top_k': {self.top_k} is more than this model's vocabulary of "
                f"{bounds.vocab_size} tokens (-1 or 0: off)",
                "top_k",
            )
        return SamplingParams(
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=max(self.top_k, 0),
            seed=self.seed if self.seed is not None else _SEEDS.getrandbits(63),
            max_tokens=max_tokens,
            stop_token_ids=self._stop_token_ids(bounds),
            min_tokens=self.min_tokens,
            min_p=self.min_p,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            logit_bias=self._checked_bias(bounds.vocab_size),
            num_logprobs=self.num_logprobs,
        )


def check_token_ids(token_ids, vocab_size: int, param: str) -> None:
    """ParamError naming `param` for the first id outside the served model's vocabulary."""
    for token_id in token_ids:
        if token_id >= vocab_size:
            raise ParamError(
                f"Invalid '{param}': token id {token_id} is not in this model's "
                f"vocabulary of {vocab_size} tokens",
                param,
            )


def refuse_unless(value: Any, allowed: tuple[Any, ...], why: str) -> Any:
    """For an OpenAI field this server does not build: any value but `allowed` is refused."""
    if value is not None and value not in allowed:
        raise PydanticCustomError(
            "unsupported_field", "not supported by this server: {why}", {"why": why}
        )
    return value
