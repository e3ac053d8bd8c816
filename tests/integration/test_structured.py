"""Structured outputs and tool calls over HTTP on the default app (random-weight tiny-llava,
the shipped template with a tool format): output valid by construction whatever the
weights, through the raw API, the openai client and LangChain; free requests beside
constrained ones stay token-exact."""

from __future__ import annotations

import asyncio
import json
from typing import Literal

import httpx
import jsonschema
import pytest
from pydantic import BaseModel, Field

from tests.integration.reference import reference_generate

MAX_TOKENS = 48
SCHEMA = {
    "type": "object",
    "properties": {
        "colour": {"type": "string", "enum": ["red", "green", "blue"]},
        "count": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["colour", "count"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}  # no parameters
ASK = [{"role": "user", "content": "Describe the weather as JSON."}]


def _schema_format(schema=SCHEMA) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 1.0, "seed": 7}])
def test_json_schema_output_validates(app, sampling):
    r = app.chat(ASK, response_format=_schema_format(), max_tokens=MAX_TOKENS, **sampling)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop", choice
    jsonschema.validate(json.loads(choice["message"]["content"]), SCHEMA)


def test_json_object_streamed_is_one_object(app):
    body = {
        "model": app.config.model.served_name,
        "messages": ASK,
        "response_format": {"type": "json_object"},
        "max_tokens": 200,
        "temperature": 0,
        "stream": True,
    }
    with app.http.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        events = [json.loads(x[6:]) for x in r.iter_lines() if x and x != "data: [DONE]"]
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events)
    if events[-1]["choices"][0]["finish_reason"] == "stop":
        assert isinstance(json.loads(text), dict)
    else:  # cut by max_tokens: a valid beginning of one
        assert text.startswith("{")


def test_a_schema_that_cannot_compile_is_a_400_naming_it(app):
    bad = _schema_format({"type": "objec"})
    r = app.chat(ASK, response_format=bad, max_tokens=4)
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "response_format"
    assert "objec" in r.json()["error"]["message"]
    assert app.chat(ASK, max_tokens=2).status_code == 200  # nothing else harmed


def test_openai_client_parse_gives_the_pydantic_model(app):
    from openai import OpenAI

    class Answer(BaseModel):  # bounded values: a random model's output ends
        colour: Literal["red", "green", "blue"]
        count: int = Field(ge=0, le=99)

    client = OpenAI(base_url=f"{app.root}/v1", api_key="none")
    completion = client.chat.completions.parse(
        model=app.config.model.served_name,
        messages=ASK,
        response_format=Answer,
        temperature=0,
        max_tokens=MAX_TOKENS,
    )
    parsed = completion.choices[0].message.parsed
    assert isinstance(parsed, Answer)


def test_a_named_tool_choice_calls_it_with_valid_arguments(app):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    r = app.chat(
        ASK, tools=[WEATHER, TIME], tool_choice=choice, temperature=0, max_tokens=MAX_TOKENS
    )
    assert r.status_code == 200, r.text
    out = r.json()["choices"][0]
    assert out["finish_reason"] == "tool_calls"
    assert out["message"]["content"] is None
    [call] = out["message"]["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] == "get_weather"
    jsonschema.validate(
        json.loads(call["function"]["arguments"]), WEATHER["function"]["parameters"]
    )


def _events(app, body: dict) -> list[dict]:
    with app.http.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        return [json.loads(x[6:]) for x in r.iter_lines() if x and x != "data: [DONE]"]


def test_a_named_tool_choice_streams_its_arguments_as_they_come(app):
    body = {
        "model": app.config.model.served_name,
        "messages": ASK,
        "tools": [WEATHER],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "stream": True,
    }
    parts = [
        p for e in _events(app, body) for p in e["choices"][0]["delta"].get("tool_calls") or ()
    ]
    head, *arguments = parts
    assert head["id"].startswith("call_") and head["function"]["name"] == "get_weather"
    assert len(arguments) > 1  # several chunks: not held back until the end
    text = "".join(p["function"]["arguments"] for p in arguments)
    jsonschema.validate(json.loads(text), WEATHER["function"]["parameters"])


def test_required_tool_choice_streams_calls_to_known_functions(app):
    body = {
        "model": app.config.model.served_name,
        "messages": ASK,
        "tools": [WEATHER, TIME],
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "max_tokens": 200,
        "temperature": 0,
        "stream": True,
    }
    events = _events(app, body)
    calls: dict[int, dict] = {}
    for e in events:
        for part in e["choices"][0]["delta"].get("tool_calls") or ():
            call = calls.setdefault(part["index"], {"name": "", "arguments": ""})
            call["name"] += part.get("function", {}).get("name", "")
            call["arguments"] += part.get("function", {}).get("arguments", "")
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"
    assert len(calls) == 1  # parallel_tool_calls false: one call
    assert calls[0]["name"] in ("get_weather", "get_time")
    assert isinstance(json.loads(calls[0]["arguments"]), dict)


def test_auto_tool_choice_streams_text_or_calls(app):
    body = {
        "model": app.config.model.served_name,
        "messages": ASK,
        "tools": [WEATHER],
        "max_tokens": 12,
        "temperature": 0,
        "stream": True,
    }
    events = _events(app, body)
    deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
    text = "".join(d.get("content") or "" for d in deltas)
    calls = [p for d in deltas for p in d.get("tool_calls") or ()]
    whole = app.chat(ASK, tools=[WEATHER], temperature=0, max_tokens=12).json()["choices"][0]
    assert text == (whole["message"]["content"] or "")  # the same answer, streamed
    assert len(calls) == 2 * len(whole["message"].get("tool_calls") or ())


def test_an_agent_replays_calls_and_results(app):
    history = [
        {"role": "system", "content": "You help with weather."},
        {"role": "user", "content": "Weather in Paris?", "name": "ann"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
    ]
    r = app.chat(history, tools=[WEATHER], temperature=0, max_tokens=8)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] in ("stop", "length", "tool_calls")
    bad = [*history[:3], {"role": "tool", "content": "no id"}]
    r = app.chat(bad, tools=[WEATHER], max_tokens=2)
    assert r.status_code == 400 and "tool_call_id" in r.json()["error"]["message"]


def test_tool_choice_naming_an_unknown_function_is_a_400(app):
    choice = {"type": "function", "function": {"name": "nope"}}
    r = app.chat(ASK, tools=[WEATHER], tool_choice=choice, max_tokens=4)
    assert r.status_code == 400 and "'nope'" in r.json()["error"]["message"]
    assert r.json()["error"]["param"] == "tool_choice"


def test_free_requests_beside_constrained_ones_stay_token_exact(app):
    free = [[{"role": "user", "content": f"Tell me about the number {i}."}] for i in range(4)]
    want = [reference_generate(str(app.config.model.checkpoint_path), m, 12) for m in free]

    async def run():
        async with httpx.AsyncClient(base_url=app.root, timeout=120) as client:
            post = lambda **b: client.post(  # noqa: E731
                "/v1/chat/completions",
                json={"model": app.config.model.served_name, "temperature": 0, **b},
            )
            constrained = [
                post(messages=ASK, response_format=_schema_format(), max_tokens=MAX_TOKENS)
                for _ in range(4)
            ]
            return await asyncio.gather(
                *[post(messages=m, max_tokens=12) for m in free], *constrained
            )

    responses = asyncio.run(run())
    assert all(r.status_code == 200 for r in responses), [r.text for r in responses]
    for r, (_, text, _) in zip(responses[:4], want):
        assert r.json()["choices"][0]["message"]["content"] == text
    for r in responses[4:]:
        jsonschema.validate(json.loads(r.json()["choices"][0]["message"]["content"]), SCHEMA)


def test_langchain_structured_output_and_bound_tools(app):
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    class Answer(BaseModel):  # bounded values: a random model's output ends
        colour: Literal["red", "green", "blue"]
        count: int = Field(ge=0, le=99)

    @tool
    def get_weather(city: Literal["Paris", "Oslo"]) -> str:
        """The weather in a city."""
        return "sunny"

    llm = ChatOpenAI(
        base_url=f"{app.root}/v1",
        api_key="none",
        model=app.config.model.served_name,
        temperature=0,
        max_tokens=MAX_TOKENS,
    )
    assert isinstance(llm.with_structured_output(Answer).invoke("Describe it."), Answer)
    message = llm.bind_tools([get_weather], tool_choice="get_weather").invoke("Paris?")
    [call] = message.tool_calls
    assert call["name"] == "get_weather" and call["args"]["city"] in ("Paris", "Oslo")
