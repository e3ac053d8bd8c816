"""Tool calls read back from answers, and the grammar each request shape is held to (no Ray,
no torch)."""

from __future__ import annotations

import json

from actors.types import GrammarKind
from cluster.chat_tools import (
    NamedToolChoice,
    ResponseFormat,
    Tool,
    ToolCalls,
    ToolMode,
    ToolReading,
    grammar_for,
)

WEATHER = Tool.model_validate(
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
)
TIME = Tool.model_validate({"type": "function", "function": {"name": "get_time"}})
NAMED = NamedToolChoice.model_validate({"type": "function", "function": {"name": "get_time"}})


def test_auto_reads_tool_call_blocks_and_keeps_the_rest_as_content():
    text = (
        'Let me look. <tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}'
        '</tool_call> and <tool_call>{"name": "get_time"}</tool_call>'
    )
    calls = ToolCalls.parse(text, ToolMode.AUTO)
    assert [c.function.name for c in calls.calls] == ["get_weather", "get_time"]
    assert json.loads(calls.calls[0].function.arguments) == {"city": "Oslo"}
    assert calls.calls[1].function.arguments == "{}"
    assert calls.content == "Let me look.  and"
    assert len({c.id for c in calls.calls}) == 2


def test_auto_without_parallel_calls_takes_the_first_call_only():
    text = '<tool_call>{"name": "a"}</tool_call><tool_call>{"name": "b"}</tool_call>'
    reading = ToolReading(ToolMode.AUTO, parallel=False)
    assert [c.function.name for c in reading.parse(text).calls] == ["a"]
    assert len(ToolReading(ToolMode.AUTO).parse(text).calls) == 2


def test_auto_leaves_text_without_a_well_formed_call_alone():
    for text in ("plain answer", "<tool_call>not json</tool_call>", '<tool_call>{"x": 1}'):
        assert ToolCalls.parse(text, ToolMode.AUTO) == ToolCalls(text, ())


def test_required_and_named_answers_become_calls():
    required = ToolCalls.parse('[{"name": "get_time", "parameters": {}}]', ToolMode.REQUIRED)
    assert [c.function.name for c in required.calls] == ["get_time"] and required.content is None
    assert ToolCalls.parse('[{"name": "get_t', ToolMode.REQUIRED).calls == ()  # cut short
    named = ToolCalls.parse('{"city": "Oslo"}', ToolMode.NAMED, "get_weather")
    assert named.calls[0].function.arguments == '{"city": "Oslo"}'


def test_each_request_shape_gets_its_grammar():
    schema = ResponseFormat.model_validate(
        {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "integer"}}}
    )
    assert grammar_for(None, None, None, True) is None
    assert grammar_for(ResponseFormat(type="text"), [WEATHER], "auto", True) is None
    assert grammar_for(ResponseFormat(type="json_object"), None, None, True).kind == (
        GrammarKind.JSON_OBJECT
    )
    assert json.loads(grammar_for(schema, None, None, True).schema) == {"type": "integer"}
    named = json.loads(grammar_for(None, [WEATHER, TIME], NAMED, True).schema)
    assert named["additionalProperties"] is False  # a function without parameters takes none
    one = json.loads(grammar_for(None, [WEATHER, TIME], "required", False).schema)
    assert one["maxItems"] == 1 and len(one["items"]["anyOf"]) == 2
    assert "maxItems" not in json.loads(grammar_for(None, [TIME], "required", True).schema)
