"""cluster/protocol.py: request validation, template conversion and OpenAI-compatible output."""

from __future__ import annotations

import json
from typing import Any

import pytest
from pydantic import ValidationError

from cluster.protocol import ChatCompletionRequest, to_template_messages, validation_error_message
from cluster.response_models import (
    SSE_DONE,
    AssistantMessage,
    ChatCompletion,
    ChatCompletionChunk,
    Choice,
    ChunkChoice,
    DeltaMessage,
    ModelCard,
    ModelList,
    Usage,
    error_body,
    sse_event,
)
from cluster.sampling_fields import ModelBounds, ParamError
from router.types import Modality

USER = {"role": "user", "content": "hello"}


def request(**fields: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "m", "messages": [USER], **fields})


def invalid(body: Any) -> tuple[str, str | None]:
    with pytest.raises(ValidationError) as info:
        ChatCompletionRequest.model_validate(body)
    return validation_error_message(info.value)


TOOL = {"type": "function", "function": {"name": "f"}}


def invalid_fields(**fields: Any) -> tuple[str, str | None]:
    return invalid({"model": "m", "messages": [USER], **fields})


# ----------------------------------------------------------------------------- valid requests

BOUNDS = ModelBounds(max_model_len=100, vocab_size=50, eos_token_ids=(2,))


def test_defaults() -> None:
    req = request(frequency_penalty=0.5, logit_bias={})
    assert (req.temperature, req.top_p, req.top_k, req.n, req.stream, req.stop) == (
        1.0,
        1.0,
        0,
        1,
        False,
        None,
    )
    assert not req.include_usage and req.effective_max_tokens(30, BOUNDS) == 70, (
        "the rest of the context"
    )
    assert req.effective_max_tokens(30, ModelBounds(100, 50, (2,), default_max_tokens=64)) == 64
    assert req.effective_max_tokens(60, ModelBounds(100, 50, (2,), default_max_tokens=64)) == 40


def test_sampling_params_carry_every_honoured_field() -> None:
    req = request(
        presence_penalty=0.5,
        frequency_penalty=-1,
        repetition_penalty=1.3,
        logit_bias={"7": -100, "3": 2.5},
        min_tokens=4,
        logprobs=True,
        top_logprobs=3,
        n=3,
        seed=9,
    )
    params = req.to_sampling_params(10, BOUNDS)
    assert (params.presence_penalty, params.frequency_penalty, params.repetition_penalty) == (
        0.5,
        -1.0,
        1.3,
    )
    assert (params.logit_bias, params.min_tokens, params.num_logprobs, params.stop_token_ids) == (
        ((7, -100.0), (3, 2.5)),
        4,
        3,
        (2,),
    )
    assert request(logprobs=True).to_sampling_params(10, BOUNDS).num_logprobs == 0
    assert request().to_sampling_params(10, BOUNDS).num_logprobs is None
    assert request(ignore_eos=True).to_sampling_params(10, BOUNDS).stop_token_ids == ()


@pytest.mark.parametrize(
    "fields,prompt_tokens,param,fragment",
    [
        ({"max_tokens": 10**12}, 10, "max_tokens", "context of 100 tokens"),
        ({"max_tokens": 91}, 10, "max_tokens", "max_tokens is 91"),
        ({"max_completion_tokens": 95, "max_tokens": 5}, 10, "max_completion_tokens", "context"),
        ({"top_k": 51}, 10, "top_k", "vocabulary of 50"),
        ({"logit_bias": {"50": 1}}, 10, "logit_bias", "token id 50"),
        ({"min_tokens": 5, "max_tokens": 4}, 10, "min_tokens", "more than the 4 tokens"),
    ],
)
def test_fields_checked_against_the_model(
    fields: dict, prompt_tokens: int, param: str, fragment: str
) -> None:
    with pytest.raises(ParamError) as info:
        request(**fields).to_sampling_params(prompt_tokens, BOUNDS)
    assert (
        info.value.param == param
        and fragment in info.value.message
        and f"'{param}'" in info.value.message
    )
    assert (
        request(max_tokens=90, top_k=50, logit_bias={"49": 1})
        .to_sampling_params(10, BOUNDS)
        .max_tokens
        == 90
    )


def test_accepted_values_of_refusable_fields() -> None:
    req = request(
        tool_choice="none",
        response_format={"type": "text"},
        tools=None,
        user="u",
        messages=[
            USER,
            {"role": "assistant", "content": "ok", "tool_calls": None, "refusal": None},
        ],
    )
    assert req.tool_choice == "none" and req.response_format.type == "text"


def test_null_means_default() -> None:
    req = request(temperature=None, top_p=None, n=None, stream=None, top_k=None)
    assert (req.temperature, req.top_p, req.n, req.stream, req.top_k) == (1.0, 1.0, 1, False, 0)


def test_max_completion_tokens_wins_and_sampling_params() -> None:
    req = request(
        max_tokens=10,
        max_completion_tokens=20,
        temperature=0,
        top_k=-1,
        seed=5,
        stream=True,
        stream_options={"include_usage": True},
    )
    params = req.to_sampling_params(10, BOUNDS)
    assert (params.max_tokens, params.top_k, params.seed, params.greedy, params.stop_token_ids) == (
        20,
        0,
        5,
        True,
        (2,),
    )
    assert req.include_usage
    assert request(max_tokens=10).effective_max_tokens(10, BOUNDS) == 10
    assert isinstance(request().to_sampling_params(10, BOUNDS).seed, int)


def test_stop_string_becomes_list() -> None:
    assert request(stop="###").stop == ["###"]
    assert request(stop=["a", "b", "c", "d"]).stop == ["a", "b", "c", "d"]


def test_content_parts_and_template_messages() -> None:
    req = request(
        messages=[
            {"role": "developer", "content": "be brief"},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "compare"},
                    {
                        "type": "image_url",
                        "image_url": {"url": "data:image/png;base64,AAAA", "detail": "low"},
                    },
                    {"type": "text", "text": "with"},
                    {
                        "type": "image_url",
                        "image_url": "data:image/jpeg;base64,BBBB",
                    },  # bare-string form
                ],
            },
            {"role": "assistant", "content": "ok"},
            {
                "role": "user",
                "content": [
                    {"type": "input_audio", "input_audio": {"data": "CCCC", "format": "wav"}},
                    {"type": "video_url", "video_url": "data:video/mp4;base64,DDDD"},
                ],
            },
        ]
    )
    template, media = to_template_messages(req.messages)
    assert template == [
        {"role": "system", "content": [{"type": "text", "text": "be brief"}]},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "compare"},
                {"type": "image"},
                {"type": "text", "text": "with"},
                {"type": "image"},
            ],
        },
        {"role": "assistant", "content": [{"type": "text", "text": "ok"}]},
        {"role": "user", "content": [{"type": "audio"}, {"type": "video"}]},
    ]
    assert [(m.modality, m.payload, m.param) for m in media] == [
        (Modality.IMAGE, "data:image/png;base64,AAAA", "messages[1].content[1].image_url"),
        (Modality.IMAGE, "data:image/jpeg;base64,BBBB", "messages[1].content[3].image_url"),
        (Modality.AUDIO, "CCCC", "messages[3].content[0].input_audio"),
        (Modality.VIDEO, "data:video/mp4;base64,DDDD", "messages[3].content[1].video_url"),
    ]
    assert media[0].detail == "low" and media[2].format == "wav"


def test_input_audio_format_reaches_the_media_part() -> None:
    req = request(
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "mp3"}},
                    {"type": "input_audio", "input_audio": {"data": "ZkxhQw==", "format": "FLAC"}},
                    {"type": "video_url", "video_url": {"url": "data:image/gif;base64,R0lG"}},
                    {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
                ],
            }
        ]
    )
    _, media = to_template_messages(req.messages)
    assert [(m.modality, m.payload, m.format) for m in media] == [
        (Modality.AUDIO, "UklGRg==", "mp3"),
        (Modality.AUDIO, "ZkxhQw==", "FLAC"),  # as sent: the decoder compares case-insensitively
        (Modality.VIDEO, "data:image/gif;base64,R0lG", None),
        (Modality.IMAGE, "data:image/png;base64,AAAA", None),
    ]
    message, param = invalid(
        {
            "model": "m",
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "input_audio", "input_audio": {"data": "UklGRg=="}}],
                }
            ],
        }
    )
    assert param == "messages[0].content[0].input_audio.format" and "Missing" in message


# ----------------------------------------------------------------------------- invalid requests


def test_strict_functions_are_refused_where_nothing_holds_calls_to_them() -> None:
    strict = {"type": "function", "function": {"name": "f", "strict": True}}
    message, _ = invalid_fields(tools=[strict])  # auto: calls are parsed, not constrained
    assert "strict: true needs tool_choice" in message
    named = {"type": "function", "function": {"name": "f"}}
    for choice in ("required", named):
        ChatCompletionRequest.model_validate(
            {"model": "m", "messages": [USER], "tools": [strict], "tool_choice": choice}
        )


@pytest.mark.parametrize(
    "fields,param,fragment",
    [
        ({"n": 0}, "n", "greater than or equal to 1"),
        ({"n": 17}, "n", "less than or equal to 16"),
        ({"top_p": 1e-45}, "top_p", "must be in [1e-05, 1]"),
        ({"stop": "x" * 257}, "stop[0]", "at most 256 characters"),
        ({"presence_penalty": 2.5}, "presence_penalty", "less than or equal to 2"),
        ({"frequency_penalty": -3}, "frequency_penalty", "greater than or equal to -2"),
        ({"repetition_penalty": 0}, "repetition_penalty", "greater than 0"),
        ({"logit_bias": {"5": 101}}, "logit_bias.5", "less than or equal to 100"),
        ({"logit_bias": {"a": 1}}, "logit_bias", "keys must be token ids"),
        ({"min_tokens": -1}, "min_tokens", "greater than or equal to 0"),
        ({"top_logprobs": 2}, "top_logprobs", 'needs "logprobs": true'),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", "less than or equal to 20"),
        (
            {"tools": [{"type": "function", "function": {"name": "f g"}}]},
            "tools[0].function.name",
            "should match pattern",
        ),
        ({"functions": [{"name": "f"}]}, "functions", "deprecated: send tools"),
        ({"function_call": "auto"}, "function_call", "deprecated: send tools"),
        ({"tool_choice": "auto"}, "tool_choice", "tool_choice needs tools"),
        (
            {"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "g"}}},
            "tool_choice",
            "'g', which is not among the tools: f",
        ),
        ({"response_format": {"type": "json_schema"}}, "response_format", '"json_schema" is'),
        ({"response_format": {"type": "xml"}}, "response_format.type", "'json_schema'"),
        ({"metadata": {"x": "1"}}, "metadata", "Unrecognized request argument"),
        ({"store": True}, "store", "Unrecognized request argument"),
        ({"min_p": 1.5}, "min_p", "less than or equal to 1"),
        (
            {"messages": [{"role": "user", "content": "x", "name": 5}]},
            "messages[0].name",
            "valid string",
        ),
        (
            {
                "messages": [
                    {"role": "user", "content": [{"type": "text", "text": "x", "cache": 1}]}
                ]
            },
            "messages[0].content[0].cache",
            "Unrecognized",
        ),
        ({"temperature": 3}, "temperature", "less than or equal to 2"),
        ({"temperature": -0.1}, "temperature", "greater than or equal to 0"),
        ({"top_p": 0}, "top_p", "greater than 0"),
        ({"top_p": 1.5}, "top_p", "less than or equal to 1"),
        ({"top_k": -2}, "top_k", "greater than or equal to -1"),
        ({"max_tokens": 0}, "max_tokens", "greater than or equal to 1"),
        ({"max_completion_tokens": 0}, "max_completion_tokens", "greater than or equal to 1"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop", "at most 4"),
        ({"stop": ["a", ""]}, "stop[1]", "at least 1 character"),
        ({"stop": ""}, "stop[0]", "at least 1 character"),
        ({"messages": []}, "messages", "at least 1 item"),
        ({"seed": "x"}, "seed", "valid integer"),
    ],
)
def test_invalid_fields(fields: dict, param: str, fragment: str) -> None:
    message, got_param = invalid_fields(**fields)
    assert got_param == param
    assert fragment in message and f"'{param}'" in message


@pytest.mark.parametrize(
    "message",
    [
        {"role": "user"},
        {"role": "user", "content": None},
        {"role": "user", "content": ""},
        {"role": "user", "content": []},
    ],
)
def test_message_without_content_names_the_message(message: dict) -> None:
    text, param = invalid_fields(messages=[{"role": "system", "content": "s"}, message])
    assert param == "messages[1].content" and "has no content" in text


@pytest.mark.parametrize("role", ["assistant", "system", "developer"])
def test_media_only_in_user_messages(role: str) -> None:
    text, param = invalid_fields(
        messages=[
            USER,
            {
                "role": role,
                "content": [
                    {"type": "text", "text": "x"},
                    {"type": "image_url", "image_url": {"url": "data:,"}},
                ],
            },
        ]
    )
    assert param == "messages[1]"
    assert "content[1]" in text and "only allowed in user messages" in text


@pytest.mark.parametrize(
    "messages,param,fragment",
    [
        ([{"role": "tool", "content": "x"}], "messages[0]", "need a tool_call_id"),
        ([{"role": "user", "content": "x", "tool_call_id": "c"}], "messages[0]", "only they"),
        ([{"role": "narrator", "content": "x"}], "messages[0].role", "'user'"),
        (
            [{"role": "user", "content": 5}],
            "messages[0].content",
            "string or a list of content parts",
        ),
        (
            [{"role": "user", "content": [{"type": "audio"}]}],
            "messages[0].content[0].type",
            "'image_url'",
        ),
        (
            [{"role": "user", "content": [{"type": "image_url"}]}],
            "messages[0].content[0]",
            "needs a 'image_url' field",
        ),
        (
            [{"role": "user", "content": [{"type": "text"}]}],
            "messages[0].content[0]",
            "needs a 'text' field",
        ),
        (
            [{"role": "user", "content": [{"type": "image_url", "image_url": {"detail": "low"}}]}],
            "messages[0].content[0].image_url.url",
            "Missing required parameter",
        ),
        (
            [
                {
                    "role": "user",
                    "content": [{"type": "image_url", "image_url": {"url": "u", "detail": "max"}}],
                }
            ],
            "messages[0].content[0].image_url.detail",
            "'auto', 'low' or 'high'",
        ),
    ],
)
def test_invalid_messages(messages: list, param: str, fragment: str) -> None:
    text, got_param = invalid_fields(messages=messages)
    assert got_param == param and fragment in text


def test_missing_model_and_non_object_body() -> None:
    assert invalid({"messages": [USER]}) == ("Missing required parameter: 'model'.", "model")
    text, param = invalid([1, 2])
    assert param is None and "valid dictionary" in text
    with pytest.raises(ValidationError) as info:
        ChatCompletionRequest.model_validate_json(b"{not json")
    text, param = validation_error_message(info.value)
    assert param is None and text.startswith("Request body is not valid JSON")


# ----------------------------------------------------------------------------- responses


def completion(**extra: Any) -> ChatCompletion:
    return ChatCompletion(
        model="m",
        choices=[Choice(message=AssistantMessage(content="hi"), finish_reason="stop")],
        usage=Usage.of(5, 2),
        **extra,
    )


def test_completion_shape_and_openai_client_parses_it() -> None:
    from openai.types.chat import ChatCompletion as OpenAIChatCompletion

    body = json.loads(completion(timings={"ttft_ms": 12.5, "encode_ms": 3.0}).model_dump_json())
    assert body["id"].startswith("chatcmpl-") and body["object"] == "chat.completion"
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}
    assert body["choices"][0]["logprobs"] is None and body["timings"]["ttft_ms"] == 12.5
    parsed = OpenAIChatCompletion.model_validate(body)
    assert parsed.choices[0].message.content == "hi" and parsed.usage.total_tokens == 7
    assert "timings" not in json.loads(completion().model_dump_json())


def test_chunks_and_sse_and_openai_client_parses_them() -> None:
    from openai.types.chat import ChatCompletionChunk as OpenAIChunk

    first = ChatCompletionChunk(
        id="chatcmpl-1",
        model="m",
        choices=[ChunkChoice(delta=DeltaMessage(role="assistant", content=""))],
    )
    middle = ChatCompletionChunk(
        id="chatcmpl-1", model="m", choices=[ChunkChoice(delta=DeltaMessage(content="he"))]
    )
    last = ChatCompletionChunk(
        id="chatcmpl-1",
        model="m",
        choices=[ChunkChoice(delta=DeltaMessage(), finish_reason="length")],
    )
    usage = ChatCompletionChunk(id="chatcmpl-1", model="m", choices=[], usage=Usage.of(5, 2))
    events = [sse_event(c) for c in (first, middle, last, usage)]
    for event in events:
        assert event.startswith(b"data: {") and event.endswith(b"}\n\n")
    bodies = [json.loads(e[len(b"data: ") :]) for e in events]
    assert bodies[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert bodies[1]["choices"][0]["delta"] == {"content": "he"}
    assert (
        bodies[2]["choices"][0]["delta"] == {}
        and bodies[2]["choices"][0]["finish_reason"] == "length"
    )
    assert "usage" not in bodies[0] and bodies[3]["usage"]["total_tokens"] == 7
    for body in bodies:
        assert body["object"] == "chat.completion.chunk"
        OpenAIChunk.model_validate(body)
    assert SSE_DONE == b"data: [DONE]\n\n"
    assert sse_event({"a": 1}) == b'data: {"a":1}\n\n'


def test_model_list() -> None:
    from openai.types import Model

    body = json.loads(ModelList(data=[ModelCard(id="llava", root="/ckpt/llava")]).model_dump_json())
    assert body["object"] == "list"
    card = body["data"][0]
    assert (card["id"], card["object"], card["owned_by"], card["root"]) == (
        "llava",
        "model",
        "epd",
        "/ckpt/llava",
    )
    assert Model.model_validate(card).id == "llava"


def test_error_body() -> None:
    assert error_body("bad temperature", param="temperature") == {
        "error": {
            "message": "bad temperature",
            "type": "invalid_request_error",
            "param": "temperature",
            "code": None,
        }
    }
    assert error_body("boom", type="server_error", code="internal")["error"]["code"] == "internal"


def test_logprob_shapes_parse_with_the_openai_client() -> None:
    from openai.types import Completion as OpenAICompletion
    from openai.types.chat import ChatCompletion as OpenAIChat

    from actors.types import TokenLogprob
    from cluster.completions import Completion, CompletionChoice
    from cluster.logprobs import LogprobText

    class Tokenizer:
        def decode(self, ids: list[int]) -> str:
            return {1: "a", 2: "é", 3: "cd"}[ids[0]]

    pairs = [
        (1, TokenLogprob(-0.5, ((1, -0.5), (3, -1.0)))),
        (2, TokenLogprob(float("-inf"), ((1, -0.1),))),
    ]
    text = LogprobText(Tokenizer())
    chat = text.chat(pairs)
    parsed = OpenAIChat.model_validate(
        ChatCompletion(
            model="m",
            usage=Usage.of(1, 2),
            choices=[
                Choice(message=AssistantMessage(content="aé"), finish_reason="stop", logprobs=chat)
            ],
        ).model_dump()
    )
    first, second = parsed.choices[0].logprobs.content
    assert (first.token, first.logprob, first.bytes, [t.token for t in first.top_logprobs]) == (
        "a",
        -0.5,
        [97],
        ["a", "cd"],
    )
    assert second.bytes == list("é".encode()) and second.logprob == -9999.0, (
        "-inf is not JSON: floored as vLLM"
    )
    legacy = text.completion(pairs, text_offset=4)
    assert (legacy.tokens, legacy.text_offset, legacy.top_logprobs[0]) == (
        ["a", "é"],
        [4, 5],
        {"a": -0.5, "cd": -1.0},
    )
    done = OpenAICompletion.model_validate(
        Completion(
            model="m",
            choices=[CompletionChoice(text="aé", logprobs=legacy, finish_reason="length")],
            usage=Usage.of(1, 2),
        ).model_dump()
    )
    assert done.choices[0].logprobs.token_logprobs == [-0.5, -9999.0]


def test_stream_options_need_stream():
    message, param = invalid_fields(stream_options={"include_usage": True})
    assert param == "stream_options" and "only allowed when `stream` is true" in message
    assert request(stream=True, stream_options={"include_usage": True}).include_usage
