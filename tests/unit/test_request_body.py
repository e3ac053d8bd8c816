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
