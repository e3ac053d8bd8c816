"""Raw HTTP body -> validated request model, refusing what would otherwise reach
the engine half-understood: bodies that are not UTF-8, JSON nested deeper than any
request needs, a key given twice (which one would win?), numbers too long to be meant,
NaN and infinities, lone UTF-16 surrogates (no tokenizer can encode them), and values of
the wrong JSON type (no coercion: `"stream": "yes"` is an error, not True). Every refusal
names the offending parameter where it has one. No torch here.
"""

from __future__ import annotations

import json
import math
import secrets
from typing import Any, TypeVar

import numpy as np
from pydantic import BaseModel, ValidationError

from cluster.protocol import ChatCompletionRequest, format_param, validation_error_message

Request = TypeVar("Request", bound=BaseModel)

# Data URL payloads at least this long are lifted out of the body before json parses it (_load).
_LIFT_MIN_B = 64 * 1024
_DATA_URL_MARK = b";base64,"
_MAX_PREFIX_B = 256  # "data:<media type>;<params>" before the mark, at most
_NONCE = secrets.token_hex(8)  # a client cannot write a marker it cannot guess

MAX_JSON_DEPTH = 32  # a chat request nests about 6 deep
MAX_INT_DIGITS = (
    19  # an int64; longer numbers are mistakes or attacks (int() of 5,000 digits raises)
)


class BodyError(ValueError):
    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.message, self.param = message, param


class _BadNumber:
    """A number JSON allows but a request must not carry, kept until its path is known."""

    def __init__(self, text: str, why: str):
        self.text, self.why = text, why


def _parse_int(text: str) -> int | _BadNumber:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        return _BadNumber(
            text, f"an integer of {len(text.lstrip('-'))} digits (at most {MAX_INT_DIGITS})"
        )
    return int(text)


def _parse_float(text: str) -> float | _BadNumber:
    value = float(text)
    return value if math.isfinite(value) else _BadNumber(text, f"{text[:20]} overflows to infinity")


def _parse_constant(text: str) -> _BadNumber:
    return _BadNumber(text, f"{text} is not a JSON number")


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise BodyError(
                f"Invalid '{key}': the key appears more than once in its JSON object", key
            )
        out[key] = value
    return out


def _load(body: bytes) -> Any:
    """The parsed body. Big base64 payloads of data URLs are lifted out first (_lift): json
    scans its strings a character at a time holding the GIL, 15 ms for four 16 MP JPEGs here,
    and every other request of the ingress waits meanwhile. Any surprise: the plain parse."""
    skeleton, texts = _lift(body)
    if texts:
        try:
            parsed = _parse(skeleton)
        except BodyError:
            return _parse(body)  # the error as the body itself has it (offsets, messages)
        if _restore(parsed, texts) == len(texts):  # else one was a key: parse it as it is
            return parsed
    return _parse(body)


def _lift(body: bytes) -> tuple[bytes, dict[str, str]]:
    """`body` with each long `;base64,` data URL string's text replaced by a marker only this
    process can write, and the texts by marker. Only strings json would read as exactly their
    own bytes lift (_literal); the quotes stay where they were, so the skeleton is valid JSON
    exactly when the body is, and each text is made once, straight from the body's bytes."""
    view, pieces, texts, start = memoryview(body), [], {}, 0  # views: no copy unless lifting
    while (mark := body.find(_DATA_URL_MARK, start)) >= 0:
        opening = body.rfind(b'"', max(start, mark - _MAX_PREFIX_B), mark)
        end = body.find(b'"', mark)
        if end < 0:
            break
        if opening >= 0 and end - mark >= _LIFT_MIN_B and _literal(body, opening + 1, end):
            key = f"\x00{_NONCE}:{len(texts)}"  # what json makes of the marker
            pieces += (view[start : opening + 1], key.replace("\x00", "\\u0000").encode())
            texts[key] = str(view[opening + 1 : end], "ascii")
        else:
            pieces.append(view[start:end])
        start = end
    return (b"".join([*pieces, view[start:]]) if texts else body), texts


def _literal(body: bytes, begin: int, end: int) -> bool:
    """Whether json would read body[begin:end], inside a string, as exactly its own bytes:
    printable ASCII without a backslash (numpy scans megabytes in a tenth of a millisecond)."""
    if body.find(b"\\", begin, end) >= 0:
        return False
    view = np.frombuffer(body, np.uint8, end - begin, begin)
    return bool(view.min() >= 0x20 and view.max() < 0x80)


def _restore(value: Any, texts: dict[str, str], depth: int = 0) -> int:
    """Put the lifted texts back into the strings of `value` that are their markers (list items
    and object values, no deeper than _check allows); returns how many it put back."""
    if isinstance(value, dict):
        items = list(value.items())
    elif isinstance(value, list):
        items = list(enumerate(value))
    else:
        return 0
    restored = 0
    for key, item in items:
        if isinstance(item, str):
            if item[:1] == "\x00" and (text := texts.get(item)) is not None:
                value[key] = text
                restored += 1
        elif depth < MAX_JSON_DEPTH:
            restored += _restore(item, texts, depth + 1)
    return restored


def _parse(body: bytes) -> Any:
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BodyError(f"request body is not UTF-8: {exc.reason} at byte {exc.start}") from None
    try:
        return json.loads(
            text,
            object_pairs_hook=_unique_keys,
            parse_int=_parse_int,
            parse_float=_parse_float,
            parse_constant=_parse_constant,
        )
    except json.JSONDecodeError as exc:
        raise BodyError(f"request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise BodyError(
            f"request JSON is nested too deeply (the limit is {MAX_JSON_DEPTH} levels)"
        ) from None


def _check(value: Any, path: tuple[int | str, ...] = ()) -> None:
    """Depth, numbers and strings of the parsed body, each error naming its JSON path."""
    if len(path) > MAX_JSON_DEPTH:
        raise BodyError(
            f"request JSON is nested too deeply (the limit is {MAX_JSON_DEPTH} levels)",
            format_param(path[:4]),
        )
    if isinstance(value, _BadNumber):
        raise BodyError(f"Invalid '{format_param(path)}': {value.why}", format_param(path))
    if isinstance(value, str):
        _check_text(value, path)
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_text(key, path)
            _check(item, (*path, key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            _check(item, (*path, index))


def _check_text(text: str, path: tuple[int | str, ...]) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        where = format_param(path) or "request"
        raise BodyError(
            f"Invalid '{where}': lone UTF-16 surrogate {text[exc.start]!r} "
            f"at character {exc.start} is not valid Unicode",
            format_param(path),
        ) from None


class HeldBody:
    """A request's body on its way to admission, let go by its parse (`parse_request`): from
    then on only the parsed request holds its media's text, one copy instead of two while
    admission waits to decode them. `in` looks into the bytes (the lane's scan)."""

    __slots__ = ("_data",)

    def __init__(self, data: bytes):
        self._data: bytes | None = data

    def __contains__(self, part: bytes) -> bool:
        return self._data is not None and part in self._data

    def __len__(self) -> int:
        return len(self._data) if self._data is not None else 0

    def take(self) -> bytes:
        data, self._data = self._data, None
        if data is None:
            raise RuntimeError("the body was parsed already")
        return data


def parse_request(body: bytes | HeldBody, model: type[Request]) -> Request:
    raw = _load(body.take() if isinstance(body, HeldBody) else body)
    _check(raw)
    try:
        return model.model_validate(raw, strict=True)
    except ValidationError as exc:
        message, param = validation_error_message(exc)
        raise BodyError(message, param) from None


def parse_chat_request(body: bytes) -> ChatCompletionRequest:
    return parse_request(body, ChatCompletionRequest)
