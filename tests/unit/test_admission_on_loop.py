"""A lone short text body's admission on the event loop: only what is brief runs there. A
grammar to compile, tools, or media whose part types were escaped past the lane's byte scan
are finished on a lane thread from where the loop stopped, parsed once."""

from __future__ import annotations

import asyncio
import json
import threading

import pytest

from cluster.admit_lanes import AdmitLanes, Lane, lane_of
from cluster.config import ClusterConfig
from cluster.errors import RequestError
from cluster.intake import Intake
from cluster.prepare import ensure_model
from cluster.prompt_plan import PromptPlanner
from tests.unit.test_media_budget import png


@pytest.fixture(scope="module")
def intake(ckpt) -> Intake:
    config = ensure_model(
        ClusterConfig.model_validate({"model": {"checkpoint": str(ckpt), "served_name": "m"}})
    )
    return Intake(config, PromptPlanner(ckpt))


def body(intake: Intake, content, **fields) -> bytes:
    message = {"role": "user", "content": content}
    payload = {"model": intake.config.model.served_name, "messages": [message], **fields}
    return json.dumps(payload).encode()


def admitted(intake: Intake, payload: bytes, monkeypatch) -> tuple[int, int, int, object]:
    """(the loop's thread, the thread the plan was made on, times parsed, the admission)."""
    planned_on, parses = [], []
    plan, parse = intake._admit_parsed, intake.admit.__globals__["parse_request"]
    monkeypatch.setattr(
        intake, "_admit_parsed", lambda *a: planned_on.append(threading.get_ident()) or plan(*a)
    )
    monkeypatch.setitem(
        intake.admit.__globals__, "parse_request", lambda *a: parses.append(1) or parse(*a)
    )

    async def main():
        lanes = AdmitLanes(max_text=2, max_media=2)
        try:
            return threading.get_ident(), await lanes.run(payload, intake.admit, "r", 0.0)
        finally:
            lanes.close()

    loop_thread, adm = asyncio.run(main())
    return loop_thread, planned_on[0], len(parses), adm


def test_plain_text_is_admitted_on_the_loop(intake, monkeypatch):
    loop_thread, planned_on, parses, adm = admitted(intake, body(intake, "hi"), monkeypatch)
    assert planned_on == loop_thread and parses == 1 and adm.timings.parse_ms > 0


@pytest.mark.parametrize(
    "fields",
    [
        {"response_format": {"type": "json_object"}},  # a grammar to compile
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "s", "schema": {"type": "object"}},
            }
        },
    ],
)
def test_text_with_a_grammar_is_finished_on_a_lane_parsed_once(intake, monkeypatch, fields):
    payload = body(intake, "hi", **fields)
    loop_thread, planned_on, parses, adm = admitted(intake, payload, monkeypatch)
    assert planned_on != loop_thread and parses == 1 and adm.sampling.grammar is not None


def test_an_image_whose_part_type_is_escaped_is_decoded_on_a_lane(intake, monkeypatch):
    content = [
        {"type": "image_url", "image_url": {"url": png(40, 30)}},
        {"type": "text", "text": "what?"},
    ]
    payload = body(intake, content).replace(b'"image_url"', b'"image\\u005furl"')
    assert lane_of(payload) is Lane.TEXT  # the byte scan misses it: the text lane has it
    loop_thread, planned_on, parses, adm = admitted(intake, payload, monkeypatch)
    assert planned_on != loop_thread and parses == 1
    assert adm.plan.items[0].data.shape == (30, 40, 3)
    for choice in adm.choices():
        choice.release_media()


def test_a_refusal_found_on_the_loop_is_the_same_4xx(intake, monkeypatch):
    payload = body(intake, "hi").replace(b'"model": "m"', b'"model": "other"')
    with pytest.raises(RequestError, match="does not exist") as wrong:
        admitted(intake, payload, monkeypatch)
    assert wrong.value.status == 404
