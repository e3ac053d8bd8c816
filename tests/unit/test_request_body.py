"""The raw-body checks (cluster/request_body.py): what would otherwise be a plain-text 500
or a silent coercion is a BodyError naming the parameter."""

from __future__ import annotations

import json

import pytest

from cluster.completions import CompletionRequest
from cluster.request_body import MAX_JSON_DEPTH, BodyError, parse_chat_request, parse_request

OK = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def body(**fields) -> bytes:
    return json.dumps({**OK, **fields}).encode()


@pytest.mark.parametrize(
    "raw, words, param",
    [
        (
            b'{"model": "m", "messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
            "nested too deeply",
            None,
        ),
        (
            b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": '
            + b"7" * 5000
            + b"}",
            "5000 digits",
            "max_tokens",
        ),
        (
            b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "seed": -'
            + b"7" * 30
            + b"}",
            "30 digits",
            "seed",
        ),
        (
            b'{"model": "m", "messages": [{"role": "user", "content": "x\\udc80"}]}',
            "surrogate",
            "messages[0].content",
        ),
        (
            b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "top_p": Infinity}',
            "not a JSON number",
            "top_p",
        ),
        (
            b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "top_p": 1e999}',
            "overflows",
            "top_p",
        ),
        (json.dumps(OK).encode("utf-16"), "not UTF-8", None),
        (body(stream="yes"), "boolean", "stream"),
        (body(max_tokens="16"), "integer", "max_tokens"),
        (body(max_tokens=16.0), "integer", "max_tokens"),
        (body(temperature=1e-38), "at least 0.01", "temperature"),
        (
            b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], '
            b'"temperature": 0, "temperature": 2}',
            "more than once",
            "temperature",
        ),
        (
            b'{"model": "m", "messages": [{"role": "user", "content": "hi", "content": "ho"}]}',
            "more than once",
            "content",
        ),
        (body(top_p=1e-45), "must be in [1e-05, 1]", "top_p"),
        (body(stop="x" * 100_000), "at most 256 characters", "stop[0]"),
        (body(tools=[{"type": "function"}]), "Missing required parameter", "tools[0].function"),
    ],
)
def test_refused_naming_the_problem(raw, words, param):
    with pytest.raises(BodyError) as caught:
        parse_chat_request(raw)
    assert words in caught.value.message and caught.value.param == param


def test_depth_limit_is_checked_after_parsing_too():
    nested: object = "x"
    for _ in range(MAX_JSON_DEPTH + 2):
        nested = [nested]
    with pytest.raises(BodyError, match="nested too deeply"):
        parse_chat_request(body(user=nested))


def test_ordinary_requests_pass_unchanged():
    request = parse_chat_request(
        body(temperature=0, max_tokens=16, seed=2**62, top_p=0.5, stop="x", stream=True)
    )
    assert (
        request.temperature,
        request.max_tokens,
        request.seed,
        request.stop,
        request.stream,
    ) == (0.0, 16, 2**62, ["x"], True)
    assert (
        parse_chat_request(body(temperature=1)).temperature == 1.0
    )  # an int where a number goes is a number


def completion(**fields) -> bytes:
    return json.dumps({"model": "m", "prompt": "hi", **fields}).encode()


@pytest.mark.parametrize(
    "fields, words, param",
    [
        ({"prompt": ["a", "b"]}, "a batch of prompts is not supported", "prompt"),
        ({"prompt": [[1, 2], [3]]}, "a batch of prompts is not supported", "prompt"),
        ({"prompt": ""}, "empty", "prompt"),
        ({"prompt": [1, "a"]}, "a batch of prompts", "prompt"),
        ({"echo": True}, "echoing the prompt is not built", "echo"),
        ({"suffix": "x"}, "suffix after the completion", "suffix"),
        ({"best_of": 2}, "best_of > 1 is not built", "best_of"),
        ({"logprobs": 21}, "less than or equal to 20", "logprobs"),
        ({"messages": []}, "Unrecognized request argument", "messages"),
    ],
)
def test_completions_refused_naming_the_field(fields, words, param):
    with pytest.raises(BodyError) as caught:
        parse_request(completion(**fields), CompletionRequest)
    assert words in caught.value.message and caught.value.param == param


def test_completions_accept_one_prompt_as_text_or_token_ids():
    assert parse_request(completion(prompt=["hi"]), CompletionRequest).prompt == "hi"
    assert parse_request(completion(prompt=[5, 6]), CompletionRequest).prompt == [5, 6]
    assert parse_request(
        completion(prompt=[[5, 6]], echo=False, best_of=1, logprobs=2), CompletionRequest
    ).prompt == [5, 6]


# -- big data URLs: lifted out before json parses the rest (request_body._lift) -------------

PAYLOAD = "QUJD" * 40_000  # 160 kB of base64: long enough to lift


def _image(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def _with_parts(*parts) -> bytes:
    content = [*parts, {"type": "text", "text": "Describe"}]
    return json.dumps({**OK, "messages": [{"role": "user", "content": content}]}).encode()


def _plain(raw: bytes) -> object:
    from cluster.request_body import _parse

    return _parse(raw)


@pytest.mark.parametrize(
    "raw",
    [
        _with_parts(_image(f"data:image/png;base64,{PAYLOAD}")),
        _with_parts(*(_image(f"data:image/jpeg;base64,{PAYLOAD}{i}A==") for i in range(3))),
        # escaped: json must read it, not the lift
        _with_parts(_image(f"data:image/png;base64,{PAYLOAD}")).replace(b"/png", b"\\/png"),
        _with_parts(
            _image(f"data:image/png;base64,{PAYLOAD}"), _image("data:image/png;base64,QQ==")
        ),
        # a marker a client made up is its text, nothing else
        _with_parts(_image(f"data:image/png;base64,{PAYLOAD}"), _image("\u0000beef:0")),
        # a data URL as an object key is not lifted (an unknown field, refused by name later)
        json.dumps({**OK, f"data:x;base64,{PAYLOAD}": 1}).encode(),
    ],
)
def test_big_data_urls_parse_exactly_as_json_reads_them(raw):
    from cluster.request_body import _load

    assert _load(raw) == _plain(raw)


def test_a_big_data_url_is_lifted_before_json_scans_it():
    from cluster.request_body import _lift

    raw = _with_parts(_image(f"data:image/png;base64,{PAYLOAD}"))
    skeleton, texts = _lift(raw)
    assert len(skeleton) < 500 and list(texts.values()) == [f"data:image/png;base64,{PAYLOAD}"]
    request = parse_chat_request(raw)
    assert request.messages[0].content[0].image_url.url == f"data:image/png;base64,{PAYLOAD}"


@pytest.mark.parametrize(
    "raw, words",
    [
        # a raw control character inside the string: invalid JSON, as without the lift
        (
            _with_parts(_image(f"data:image/png;base64,{PAYLOAD}")).replace(b"QUJD", b"QU\nJ", 1),
            "Invalid control character",
        ),
        # the string never closes
        (
            _with_parts(_image(f"data:image/png;base64,{PAYLOAD}")).split(b'"}}')[0],
            "not valid JSON",
        ),
        # a lone surrogate in a small part beside a big image: still found and named
        (
            _with_parts(
                _image(f"data:image/png;base64,{PAYLOAD}"), {"type": "text", "text": "\ud800"}
            ),
            "surrogate",
        ),
    ],
)
def test_bodies_json_refuses_are_refused_the_same_with_big_data_urls(raw, words):
    with pytest.raises(BodyError) as caught:
        parse_chat_request(raw)
    assert words in caught.value.message


def test_a_held_body_is_let_go_by_its_parse_and_scanned_for_its_lane_before():
    """Admission's parse takes the body from its holder: while the request waits to decode,
    only the parsed request holds the media's text (one copy, not two)."""
    import sys

    from cluster.admit_lanes import Lane, lane_of
    from cluster.request_body import HeldBody

    url = "data:image/png;base64," + "A" * (128 * 1024)
    part = {"type": "image_url", "image_url": {"url": url}}
    raw = json.dumps({"model": "m", "messages": [{"role": "user", "content": [part]}]}).encode()
    refs = sys.getrefcount(raw)
    held = HeldBody(raw)
    assert sys.getrefcount(raw) == refs + 1 and lane_of(held) is Lane.MEDIA
    request = parse_chat_request(held)
    assert sys.getrefcount(raw) == refs  # the holder let go: the bytes die with the caller's
    assert request.messages[0].content[0].image_url.url == url
    with pytest.raises(RuntimeError, match="parsed already"):
        held.take()
    assert lane_of(held) is Lane.TEXT  # nothing left to scan
