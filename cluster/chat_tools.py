"""Structured outputs and tool calling on the wire: `response_format`, `tools`,
`tool_choice` and the tool calls of an answer.

- What the output must parse as: `grammar_for` turns a request into the engine's
  GrammarSpec (json_object, json_schema; a named tool choice is its function's parameters,
  `required` an array of {name, parameters} as vLLM constrains it), or None.
- What the model said: `ToolCalls.parse` reads a finished answer back as tool calls: the
  constrained JSON of a named or required choice, or, under `auto`, the chat template's own
  format (`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, Qwen2.5's and the
  built-in templates') with the text around it as content.
No torch here.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import Field, model_validator
from pydantic_core import PydanticCustomError

from actors.types import GrammarKind, GrammarSpec
from cluster.sampling_fields import Strict

MAX_TOOLS = 128  # as OpenAI
_NAME = r"^[a-zA-Z0-9_-]{1,64}$"  # OpenAI's function and schema names
_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


class JsonSchemaFormat(Strict):
    name: str = Field(pattern=_NAME)
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None  # output is valid by construction either way


class ResponseFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise PydanticCustomError(
                "json_schema_field", '"json_schema" is required with, and only with, that type'
            )
        return self


class FunctionDef(Strict):
    name: str = Field(pattern=_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # None: a function without parameters
    strict: bool | None = None

    @property
    def schema(self) -> dict[str, Any]:
        return self.parameters or {
            "type": "object",
            "properties": {},
            "additionalProperties": False,
        }


class Tool(Strict):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(Strict):
    name: str


class NamedToolChoice(Strict):
    type: Literal["function"]
    function: NamedFunction


class FunctionCall(Strict):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(Strict):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall

    def for_template(self) -> dict[str, Any]:
        """HF chat templates take arguments as a mapping (they render it with tojson)."""
        try:
            arguments = json.loads(self.function.arguments)
        except ValueError:
            arguments = self.function.arguments
        function = {"name": self.function.name, "arguments": arguments}
        return {"type": "function", "function": function}


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class ToolMode:
    """How an answer's text becomes tool calls: not at all, parsed, or constrained JSON."""

    NONE = "none"
    AUTO = "auto"
    REQUIRED = "required"
    NAMED = "named"


def tool_mode(tools: list[Tool] | None, choice: ToolChoice | None) -> str:
    if not tools or choice == "none":
        return ToolMode.NONE
    if isinstance(choice, NamedToolChoice):
        return ToolMode.NAMED
    return ToolMode.REQUIRED if choice == "required" else ToolMode.AUTO


def _required_schema(tools: list[Tool], parallel: bool) -> dict[str, Any]:
    calls = [
        {
            "type": "object",
            "properties": {
                "name": {"const": t.function.name},
                "parameters": t.function.schema,
            },
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for t in tools
    ]
    array: dict[str, Any] = {"type": "array", "items": {"anyOf": calls}, "minItems": 1}
    return array if parallel else {**array, "maxItems": 1}


def grammar_for(
    response_format: ResponseFormat | None,
    tools: list[Tool] | None,
    choice: ToolChoice | None,
    parallel_tool_calls: bool,
) -> GrammarSpec | None:
    """The grammar a request's output is held to; None: free text."""
    mode = tool_mode(tools, choice)
    if mode == ToolMode.NAMED:
        return GrammarSpec.of_schema(function_named(tools, choice.function.name).schema)
    if mode == ToolMode.REQUIRED:
        return GrammarSpec.of_schema(_required_schema(tools, parallel_tool_calls))
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        return GrammarSpec(GrammarKind.JSON_OBJECT)
    return GrammarSpec.of_schema(response_format.json_schema.schema_)


def function_named(tools: list[Tool], name: str) -> FunctionDef:
    for tool in tools:
        if tool.function.name == name:
            return tool.function
    raise KeyError(name)


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class ToolReading:
    """How a request's answer is read as tool calls: its mode, the named function (NAMED), and
    whether several calls may come (`parallel_tool_calls`)."""

    mode: str = ToolMode.NONE
    named: str | None = None
    parallel: bool = True

    def parse(self, text: str) -> ToolCalls:
        return ToolCalls.parse(text, self.mode, self.named, self.parallel)

    @property
    def streams_arguments(self) -> bool:
        """A named choice's answer is its arguments: they can stream as they come."""
        return self.mode == ToolMode.NAMED


@dataclass(frozen=True)
class ToolCalls:
    """An answer read as tool calls: what is left as content, and the calls in order."""

    content: str | None
    calls: tuple[ToolCall, ...]

    @classmethod
    def parse(
        cls, text: str, mode: str, named: str | None = None, parallel: bool = True
    ) -> ToolCalls:
        """`parallel` False: at most one call (the grammar holds `required` to one; under
        `auto` the first call is taken and later ones dropped)."""
        if mode == ToolMode.NAMED:
            return cls(None, (_call(named, text),))
        if mode == ToolMode.REQUIRED:
            return cls(None, _required_calls(text))
        if mode == ToolMode.AUTO:
            found = _auto_calls(text)
            return found if parallel else cls(found.content, found.calls[:1])
        return cls(text, ())


def _call(name: str, arguments: str) -> ToolCall:
    return ToolCall(id=new_call_id(), function=FunctionCall(name=name, arguments=arguments))


def _compact(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def _required_calls(text: str) -> tuple[ToolCall, ...]:
    """The constrained array; an answer cut short by max_tokens keeps what parsed (nothing)."""
    try:
        calls = json.loads(text)
    except ValueError:
        return ()
    return tuple(_call(c["name"], _compact(c["parameters"])) for c in calls)


def _auto_calls(text: str) -> ToolCalls:
    """`<tool_call>` blocks whose JSON names a function; anything else stays content."""
    calls, kept, last = [], [], 0
    for match in _TOOL_CALL.finditer(text):
        try:
            body = json.loads(match.group(1))
            call = _call(body["name"], _compact(body.get("arguments", {})))
        except (ValueError, KeyError, TypeError):
            continue  # not a call after all: it stays in the content
        calls.append(call)
        kept.append(text[last : match.start()])
        last = match.end()
    if not calls:
        return ToolCalls(text, ())
    content = ("".join(kept) + text[last:]).strip()
    return ToolCalls(content or None, tuple(calls))
