"""What an operator sets up around the endpoint: an API key on /v1 (probes and scrapes stay
open), and one log line per request that names its id, outcome, tokens and times."""

from __future__ import annotations

import glob
import os
import time

import openai
import pytest
import ray

from tests.integration.conftest import cluster_config, deploy

KEY = "sk-test-epd"


@pytest.fixture(scope="module")
def keyed(ray_session):
    return deploy(cluster_config(server={"api_key": KEY, "log_prompts": True}))


def test_api_key_guards_v1_only(keyed):
    body = {
        "model": keyed.config.model.served_name,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 2,
    }
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        r = keyed.http.post("/v1/chat/completions", json=body, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", r.text
    assert keyed.http.get("/v1/models").status_code == 401
    assert (
        keyed.http.get("/health").status_code == 200
        and keyed.http.get("/metrics").status_code == 200
    )
    client = openai.OpenAI(base_url=keyed.base_url, api_key=KEY, max_retries=0)
    answer = client.chat.completions.create(
        model=keyed.config.model.served_name, messages=body["messages"], max_tokens=2
    )
    assert answer.usage.completion_tokens >= 1
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=keyed.base_url, api_key="nope", max_retries=0).models.list()


def test_one_log_line_per_request(keyed):
    headers = {"Authorization": f"Bearer {KEY}"}
    body = {
        "model": keyed.config.model.served_name,
        "messages": [{"role": "user", "content": "log me please"}],
        "max_tokens": 3,
        "temperature": 0,
    }
    ok = keyed.http.post("/v1/chat/completions", json=body, headers=headers)
    bad = keyed.http.post("/v1/chat/completions", json={**body, "temperature": 9}, headers=headers)
    assert "," not in ok.headers["x-request-id"]  # one id, Serve's
    lines = _log_lines_naming(ok.headers["x-request-id"], bad.headers["x-request-id"])
    assert f"request {ok.json()['id']} " in lines[0]
    assert (
        "status=ok" in lines[0]
        and "prompt_tokens=" in lines[0]
        and "completion_tokens=3" in lines[0]
    )
    assert (
        "ttft_ms=" in lines[0] and "e2e_ms=" in lines[0] and "log me please" in lines[0]
    )  # log_prompts is on
    assert "status=400" in lines[1]


def _log_lines_naming(*request_ids: str, within_s: float = 20) -> list[str]:
    """The replica log line of each request id (Serve writes the ingress's log to its session
    dir)."""
    logs = ray._private.worker._global_node.get_logs_dir_path()
    deadline = time.monotonic() + within_s
    while True:
        text = "".join(
            open(p, errors="replace").read()
            for p in glob.glob(os.path.join(logs, "serve", "replica_*Ingress*.log"))
        )
        found = [
            next((ln for ln in text.splitlines() if f"x_request_id={rid} " in ln), None)
            for rid in request_ids
        ]
        if all(found) or time.monotonic() > deadline:
            assert all(found), f"no log line for {request_ids} in {logs}/serve"
            return found
        time.sleep(0.5)
