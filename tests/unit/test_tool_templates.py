"""Tools reach the chat template only where it has a tool format: the shipped LLaVA template
renders them (and nothing else changes without them); a checkpoint's template without one
refuses tools by name (no Ray)."""

from __future__ import annotations

import json

import pytest

from cluster.config import ClusterConfig, load_config
from cluster.errors import RequestError
from cluster.intake import Intake
from cluster.prepare import ensure_model
from cluster.prompt_plan import PromptPlanner

WEATHER = {"type": "function", "function": {"name": "get_weather"}}
USER = [{"role": "user", "content": "Weather?"}]


def _intake(ckpt, template) -> Intake:
    config = ClusterConfig.model_validate(
        {"model": {"checkpoint": str(ckpt), "served_name": "m", "chat_template": template}}
    )
    config = ensure_model(config)  # as the server does: max_model_len from the checkpoint
    return Intake(config, PromptPlanner(ckpt, template=config.model.chat_template_file))


def _body(**fields) -> bytes:
    return json.dumps({"model": "m", "messages": USER, "max_tokens": 4, **fields}).encode()


def test_a_template_without_a_tool_format_refuses_tools_by_name(ckpt):
    intake = _intake(ckpt, None)  # tiny-llava's own template
    assert intake.admit(_body(), "a", 0.0).plan.token_ids  # no tools: fine
    with pytest.raises(RequestError) as info:
        intake.admit(_body(tools=[WEATHER]), "b", 0.0)
    assert info.value.status == 400 and info.value.param == "tools"
    assert "has no tool format" in info.value.message


def test_the_shipped_template_renders_tools_and_is_the_checkpoints_without(ckpt):
    shipped = load_config().model.chat_template
    own, tooled = _intake(ckpt, None), _intake(ckpt, shipped)
    assert (
        own.admit(_body(), "a", 0.0).plan.token_ids
        == tooled.admit(_body(), "b", 0.0).plan.token_ids
    )
    plan = tooled.admit(_body(tools=[WEATHER], tool_choice="required"), "c", 0.0)
    text = tooled.planner.tokenizer.decode(plan.plan.token_ids)
    assert '"name": "get_weather"' in text and "<tool_call>" in text
    assert plan.sampling.grammar is not None  # required: held to the tools' calls


def test_chat_template_kwargs_reach_the_template(ckpt, tmp_path):
    own = (ckpt / "chat_template.jinja").read_text()
    marked = tmp_path / "marked.jinja"
    marked.write_text("{%- if thinking is defined and thinking -%}THINK {% endif -%}" + own)
    intake = _intake(ckpt, str(marked))
    decode = intake.planner.tokenizer.decode
    plain = decode(intake.admit(_body(), "a", 0.0).plan.token_ids)
    thinking = decode(
        intake.admit(_body(chat_template_kwargs={"thinking": True}), "b", 0.0).plan.token_ids
    )
    assert "THINK" not in plain and thinking.startswith("THINK")
