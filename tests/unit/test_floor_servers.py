"""The floors' servers and the C burst client (scripts/bench_floors.py): each server answers
as its floor says, and the C client times and classifies every answer of a burst."""

from __future__ import annotations

import http.client
import json

import pytest

from benchkit import c_burst
from benchkit.floor_servers import BIG_BODY, running
from benchkit.raw_burst import report, request_bytes


@pytest.mark.parametrize("kind", ["refuser", "haproxy_refuser"])
def test_a_burst_from_c_gets_every_refusal_openai_shaped(tmp_path, kind):
    with running(kind, tmp_path) as port:
        outcomes = c_burst.burst(port, request_bytes("m", 0), 60)
    done = report(outcomes)
    assert done["429"] == 60 and done["no_answer"] == 0
    assert done["429_with_retry_after"] == done["429_openai_shaped"] == 60
    assert all(o.first_byte_ms >= 0 for o in outcomes)


def _post(port: int, path: str, body: bytes) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("POST", path, body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    return resp.status, json.loads(resp.read())


def test_the_chat_floor_behind_haproxy_answers_text_and_refuses_uploads(tmp_path):
    with running("haproxy_front", tmp_path) as port:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        conn.request("GET", "/v1/models")
        assert json.loads(conn.getresponse().read())["data"][0]["id"] == "m"
        status, answer = _post(port, "/v1/chat/completions", b'{"model": "m"}')
        assert status == 200 and answer["choices"][0]["message"]["content"]
        status, answer = _post(port, "/v1/chat/completions", b"x" * (BIG_BODY + 1))
        assert status == 429 and "message" in answer["error"]
