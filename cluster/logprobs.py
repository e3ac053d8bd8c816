"""Logprobs on the wire: the engine's TokenLogprob records in OpenAI's two shapes, chat
(`choices[].logprobs.content[]`: token, logprob, bytes, top_logprobs) and legacy
completions (`tokens`, `token_logprobs`, `top_logprobs`, `text_offset`). A token's text is
the tokenizer's decoding of that token alone, as vLLM returns it. No torch here."""

from __future__ import annotations

from collections.abc import Iterable
from functools import lru_cache

from pydantic import BaseModel

from actors.types import TokenLogprob

LOGPROB_FLOOR = (
    -9999.0
)  # as vLLM: a token the model gives no chance has -inf, which JSON cannot carry


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


def _finite(value: float) -> float:
    return max(value, LOGPROB_FLOOR)


class LogprobText:
    """Turns (token id, TokenLogprob) pairs into either wire shape with one tokenizer."""

    def __init__(self, tokenizer):
        self._token = lru_cache(maxsize=65536)(lambda token_id: tokenizer.decode([token_id]))

    def _top(self, token_id: int, logprob: float) -> TopLogprob:
        text = self._token(token_id)
        return TopLogprob(token=text, logprob=_finite(logprob), bytes=list(text.encode("utf-8")))

    def chat(self, pairs: Iterable[tuple[int, TokenLogprob]]) -> ChatLogprobs:
        content = [
            ChatTokenLogprob(
                **self._top(token_id, lp.logprob).model_dump(),
                top_logprobs=[self._top(t, v) for t, v in lp.top],
            )
            for token_id, lp in pairs
        ]
        return ChatLogprobs(content=content)

    def completion(
        self, pairs: Iterable[tuple[int, TokenLogprob]], text_offset: int = 0
    ) -> CompletionLogprobs:
        """`text_offset`: where the first token's text starts in the choice's text so far."""
        out = CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
        for token_id, lp in pairs:
            text = self._token(token_id)
            out.tokens.append(text)
            out.token_logprobs.append(_finite(lp.logprob))
            out.top_logprobs.append({self._token(t): _finite(v) for t, v in lp.top})
            out.text_offset.append(text_offset)
            text_offset += len(text)
        return out
