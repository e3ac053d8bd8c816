"""The streamed chat chunk of a plain delta is written from a template (every token pays for
it): its bytes must be exactly what the response models give, for any text."""

from __future__ import annotations

import json
import random
import types

import pytest

from actors.types import SamplingParams
from cluster.protocol import ChatCompletionRequest
from cluster.request_body import parse_request
from cluster.response_models import ChatCompletionChunk, ChunkChoice, DeltaMessage, sse_event
from cluster.responses import Delta, Shape

ODD_TEXT = ['say "hi"', "back\\slash", "é中😀", "\x00\x01\x1f\x7f", "\u2028\u2029", "</s>", " "]


def _shape(request_id: str = "chatcmpl-1", model: str = 'm"odel') -> Shape:
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "x"}]}).encode()
    request = parse_request(body, ChatCompletionRequest)
    adm = types.SimpleNamespace(request_id=request_id, request=request, sampling=SamplingParams())
    return Shape(adm, tokenizer=None)


def _by_models(shape: Shape, index: int, delta: Delta) -> bytes:
    choice = ChunkChoice(
        index=index,
        delta=DeltaMessage(content=delta.text or None),
        finish_reason=delta.finish_reason,
    )
    chunk = ChatCompletionChunk(
        id=shape.adm.request_id,
        model=shape.adm.request.model,
        created=shape.created,
        choices=[choice],
    )
    return sse_event(chunk)


@pytest.mark.parametrize("reason", [None, "stop", "length"])
def test_the_template_gives_the_models_bytes(reason):
    shape, rng = _shape(), random.Random(3)
    texts = ODD_TEXT + [
        "".join(chr(rng.randrange(0x20, 0x3000)) for _ in range(12)) for _ in range(200)
    ]
    for i, text in enumerate(texts + [""]):
        delta = Delta(text, reason)
        assert shape.chunk(i % 3, delta) == _by_models(shape, i % 3, delta), repr(text)


def test_every_chunk_of_an_answer_has_one_created_time():
    shape = _shape()
    first = json.loads(shape.chunk(0, Delta("a", None))[6:])
    usage = json.loads(shape.chunk(0, None, timings={"ttft_ms": 1.0})[6:])
    assert first["created"] == usage["created"] == shape.created
