"""Fields agent and UI clients send, without Ray: stop_token_ids, skip_special_tokens and
include_stop_str_in_output from the body to SamplingParams and the text, usage's
prompt_tokens_details.cached_tokens, and /tokenize and /detokenize (cluster/token_endpoints.py)
on the tiny checkpoint's own tokenizer and chat template."""

from __future__ import annotations

import asyncio
import json
import types
from typing import Any

import pytest

from actors.types import FinishReason, SamplingParams, TokenChunk
from cluster.completions import CompletionRequest
from cluster.errors import RequestError
from cluster.metrics import Metrics
from cluster.prompt_plan import PromptPlanner
from cluster.protocol import ChatCompletionRequest, to_template_messages
from cluster.request_body import BodyError, parse_request
from cluster.request_path import RequestTimings
from cluster.response_models import Usage
from cluster.responses import Collector, _usage
from cluster.sampling_fields import ModelBounds, ParamError
from cluster.token_endpoints import TokenEndpoints

BOUNDS = ModelBounds(max_model_len=100, vocab_size=50, eos_token_ids=(2,))
USER = {"role": "user", "content": "hello"}


def chat(**fields: Any) -> ChatCompletionRequest:
    body = {"model": "m", "messages": [USER], **fields}
    return parse_request(json.dumps(body).encode(), ChatCompletionRequest)


def refused(model=ChatCompletionRequest, **fields: Any) -> str | None:
    base = {"model": "m", "messages": [USER]} if model is ChatCompletionRequest else {"model": "m"}
    with pytest.raises(BodyError) as info:
        parse_request(json.dumps({**base, **fields}).encode(), model)
    return info.value.param


# ----------------------------------------------------------------------------- the fields


def test_stop_token_ids_join_eos_once_and_survive_ignore_eos():
    assert chat().to_sampling_params(10, BOUNDS).stop_token_ids == (2,)
    assert chat(stop_token_ids=[7, 2, 7, 9]).to_sampling_params(10, BOUNDS).stop_token_ids == (
        2,
        7,
        9,
    )
    ignoring = chat(stop_token_ids=[7], ignore_eos=True).to_sampling_params(10, BOUNDS)
    assert ignoring.stop_token_ids == (7,), "ignore_eos drops EOS, not the request's own ids"
    assert chat(stop_token_ids=None).to_sampling_params(10, BOUNDS).stop_token_ids == (2,)
    text = parse_request(
        json.dumps({"model": "m", "prompt": "x", "stop_token_ids": [5]}).encode(),
        CompletionRequest,
    )
    assert text.to_sampling_params(1, BOUNDS).stop_token_ids == (2, 5)


def test_stop_token_ids_checked_against_the_vocabulary():
    with pytest.raises(ParamError) as info:
        chat(stop_token_ids=[3, 50]).to_sampling_params(10, BOUNDS)
    assert info.value.param == "stop_token_ids" and "token id 50" in info.value.message
    assert "'stop_token_ids'" in info.value.message
    assert chat(stop_token_ids=[49]).to_sampling_params(10, BOUNDS).stop_token_ids == (2, 49)


@pytest.mark.parametrize(
    "fields,param",
    [
        ({"stop_token_ids": [-1]}, "stop_token_ids[0]"),
        ({"stop_token_ids": ["3"]}, "stop_token_ids[0]"),  # strict: no coercion
        ({"stop_token_ids": [1.0]}, "stop_token_ids[0]"),
        ({"stop_token_ids": 3}, "stop_token_ids"),
        ({"stop_token_ids": list(range(1025))}, "stop_token_ids"),
        ({"skip_special_tokens": "no"}, "skip_special_tokens"),
        ({"include_stop_str_in_output": 1}, "include_stop_str_in_output"),
    ],
)
def test_bad_values_are_refused_by_name(fields, param):
    assert refused(**fields) == param
    assert refused(CompletionRequest, prompt="x", **fields) == param


def test_text_options_default_as_vllm():
    req = chat()
    assert req.skip_special_tokens is True and req.include_stop_str_in_output is False
    req = chat(skip_special_tokens=False, include_stop_str_in_output=True)
    assert req.skip_special_tokens is False and req.include_stop_str_in_output is True


# ----------------------------------------------------------------------------- text and usage


@pytest.fixture(scope="module")
def planner(ckpt) -> PromptPlanner:
    return PromptPlanner(ckpt)


def collect(planner, request: ChatCompletionRequest, chunks: list[TokenChunk]) -> tuple[str, str]:
    """The text and finish reason a Collector makes of `chunks`."""
    bounds = ModelBounds(100, len(planner.tokenizer), planner.eos_token_ids)
    sampling = request.to_sampling_params(5, bounds)
    adm = types.SimpleNamespace(request=request, sampling=sampling, arrived_s=0.0)
    collector = Collector(adm, planner.tokenizer, Metrics())

    async def run() -> str:
        async def feed():
            for chunk in chunks:
                yield chunk

        return "".join([d.text async for d in collector.deltas(feed())])

    return asyncio.run(run()), collector.finish_reason


def test_stop_token_is_not_in_the_text_unless_asked(planner):
    tok = planner.tokenizer
    ids = tok("a lake near the", add_special_tokens=False)["input_ids"]
    stop_id = ids[-1]  # a plain word: its text would show if it were not the stop token
    chunks = [TokenChunk(tuple(ids[:2])), TokenChunk(tuple(ids[2:]), FinishReason.STOP)]
    text, reason = collect(planner, chat(stop_token_ids=[stop_id]), chunks)
    assert (text, reason) == (tok.decode(ids[:-1]), "stop")
    text, _ = collect(
        planner, chat(stop_token_ids=[stop_id], include_stop_str_in_output=True), chunks
    )
    assert text == tok.decode(ids), "vLLM: include_stop_str_in_output keeps the stop token's text"


def test_special_tokens_in_the_text_when_asked(planner):
    tok = planner.tokenizer
    ids = tok("a lake", add_special_tokens=False)["input_ids"]
    chunks = [TokenChunk((tok.bos_token_id, *ids, tok.eos_token_id), FinishReason.STOP)]
    shown, _ = collect(planner, chat(skip_special_tokens=False), chunks)
    assert shown == tok.bos_token + tok.decode(ids), "EOS ends the request: not in the text"
    plain, _ = collect(planner, chat(), chunks)
    assert plain == tok.decode(ids)


def test_included_stop_string_ends_the_text(planner):
    ids = planner.tokenizer("a lake near the sea", add_special_tokens=False)["input_ids"]
    chunks = [TokenChunk((i,)) for i in ids]
    text, reason = collect(planner, chat(stop=[" near"], include_stop_str_in_output=True), chunks)
    assert (text, reason) == ("a lake near", "stop")
    text, _ = collect(planner, chat(stop=[" near"]), chunks)
    assert text == "a lake"


def test_usage_shape_and_cached_tokens_of_the_first_choice():
    from openai.types import CompletionUsage

    body = json.loads(Usage.of(5, 2, cached_tokens=3).model_dump_json())
    assert body["prompt_tokens_details"] == {"cached_tokens": 3}
    assert CompletionUsage.model_validate(body).prompt_tokens_details.cached_tokens == 3
    assert "prompt_tokens_details" not in Usage.of(5, 2).model_dump()

    def collector(cached: int | None, num_tokens: int):
        plan = types.SimpleNamespace(token_ids=tuple(range(40)))
        trace = RequestTimings(num_cached_tokens=cached)
        return types.SimpleNamespace(adm=types.SimpleNamespace(plan=plan), trace=trace,
                                     num_tokens=num_tokens)  # fmt: skip

    usage = _usage([collector(32, 4), collector(16, 5)])
    assert (usage.prompt_tokens, usage.completion_tokens) == (40, 9)
    assert usage.prompt_tokens_details.cached_tokens == 32, "the first choice's, not a sum"
    assert _usage([collector(None, 1)]).prompt_tokens_details.cached_tokens == 0
    assert _usage([collector(64, 1)]).prompt_tokens_details.cached_tokens == 40, "capped"


# ----------------------------------------------------------------------------- /tokenize


@pytest.fixture(scope="module")
def routes(planner) -> TokenEndpoints:
    return TokenEndpoints(planner, "m", 2048)


def ask(route, **body: Any) -> dict:
    return route(json.dumps(body).encode())


def fails(route, **body: Any) -> RequestError:
    with pytest.raises(RequestError) as info:
        ask(route, **body)
    return info.value


def test_tokenize_a_prompt_as_the_tokenizer_does(routes, planner):
    want = planner.tokenizer("a lake near the sea")["input_ids"]
    got = ask(routes.tokenize, model="m", prompt="a lake near the sea")
    assert got == {"count": len(want), "max_model_len": 2048, "tokens": want}
    bare = ask(routes.tokenize, prompt="a lake near the sea", add_special_tokens=False)
    plain = planner.tokenizer("a lake near the sea", add_special_tokens=False)["input_ids"]
    assert bare["tokens"] == plain, "model may be left out (vLLM)"


def test_tokenize_messages_as_the_chat_path_plans_them(routes, planner):
    messages = [{"role": "system", "content": "Be brief."}, USER]
    request = chat(messages=messages)
    hf_messages, _ = to_template_messages(request.messages)
    want = list(planner.plan(hf_messages, []).token_ids)
    got = ask(routes.tokenize, model="m", messages=messages)
    assert got["tokens"] == want and got["count"] == len(want)
    bare = ask(routes.tokenize, messages=messages, add_generation_prompt=False)["tokens"]
    assert len(bare) < len(want) and want[: len(bare)] == bare
    assert planner.tokenizer.decode(want[len(bare) :]).strip() == "ASSISTANT:"


@pytest.mark.parametrize(
    "body,status,param",
    [
        ({"prompt": "x", "messages": [USER]}, 400, "messages"),
        ({"model": "m"}, 400, "messages"),
        ({"prompt": "x", "add_generation_prompt": True}, 400, "add_generation_prompt"),
        ({"messages": [USER], "add_special_tokens": True}, 400, "add_special_tokens"),
        ({"prompt": "x", "return_token_strs": True}, 400, "return_token_strs"),
        ({"prompt": "x", "tools": []}, 400, "tools"),
        ({"prompt": 5}, 400, "prompt"),
        ({"model": "other", "prompt": "x"}, 404, "model"),
        ({"messages": [{"role": "user", "content": "a <image> b"}]}, 400, "messages"),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "text", "text": "what?"},
                            {"type": "image_url", "image_url": {"url": "data:image/png;base64,"}},
                        ],
                    }
                ]
            },
            400,
            "messages[0].content[1].image_url",
        ),
    ],
)
def test_tokenize_refusals_name_the_field(routes, body, status, param):
    error = fails(routes.tokenize, **body)
    assert (error.status, error.param) == (status, param), error.message
    assert param.split("[")[0] in error.message


# ----------------------------------------------------------------------------- /detokenize


def test_detokenize_is_tokenize_inverted(routes, planner):
    ids = ask(routes.tokenize, prompt="a lake near the sea")["tokens"]
    got = ask(routes.detokenize, model="m", tokens=ids)
    assert got == {"prompt": planner.tokenizer.decode(ids)}
    bos = planner.tokenizer.bos_token_id
    kept = ask(routes.detokenize, tokens=[bos, *ids])["prompt"]
    assert kept == planner.tokenizer.bos_token + got["prompt"], "specials kept, as vLLM"
    assert ask(routes.detokenize, tokens=[]) == {"prompt": ""}


@pytest.mark.parametrize(
    "body,param",
    [
        ({"tokens": [1, 10**6]}, "tokens"),
        ({"tokens": [-1]}, "tokens[0]"),
        ({"tokens": ["1"]}, "tokens[0]"),
        ({"tokens": [1], "skip_special_tokens": True}, "skip_special_tokens"),
        ({}, "tokens"),
    ],
)
def test_detokenize_refusals_name_the_field(routes, body, param):
    error = fails(routes.detokenize, **body)
    assert (error.status, error.param) == (400, param), error.message
    assert param.split("[")[0] in error.message


def test_sampling_params_untouched_by_the_text_options():
    """skip_special_tokens and include_stop_str_in_output are the ingress's: the engine's
    record is the same with or without them."""
    plain = chat(seed=1).to_sampling_params(10, BOUNDS)
    other = chat(seed=1, skip_special_tokens=False, include_stop_str_in_output=True)
    assert other.to_sampling_params(10, BOUNDS) == plain
    assert isinstance(plain, SamplingParams)
