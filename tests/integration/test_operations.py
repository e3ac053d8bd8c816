"""What an operator sets up around the endpoint: an API key on /v1 (probes and scrapes stay
open), and one log line per request that names its id, outcome, tokens and times. Rotating the
key and changing limits is a redeploy that keeps every worker and the replica itself (it
reconfigures in place): requests in flight finish."""

from __future__ import annotations

import json
import math
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import ray

from cluster import controller
from cluster.admitted import AdmissionTimings
from cluster.request_log import MIN_PHASE_MS
from cluster.request_path import RequestTimings
from tests.integration.conftest import cluster_config, deploy, replica_log_lines

KEY = "sk-test-epd"
LIMITS = {"max_generating_per_decode_worker": 40, "max_waiting_tokens_per_prefill_worker": 9000}


SLOW = {"slowdown": [8.0]}  # decode steps stretched: streams long enough to span a redeploy


def _keyed_config():
    server = {"api_key": KEY, "log_prompts": True, "serve_access_log": True}
    return cluster_config(server=server, limits=LIMITS, decode=SLOW)


@pytest.fixture(scope="module")
def keyed(ray_session):
    return deploy(_keyed_config())


def _fleet(app) -> dict:
    return app.http.get("/health", params={"verbose": 1}).json()["fleet"]


def _ingress(app) -> dict:
    return app.http.get("/health", params={"verbose": 1}).json()["ingress"]


def _max_generating(app) -> int:
    """The generating requests the replica answering admits (its share of the budget)."""
    return _ingress(app)["max_generating"]


def _stream(root: str, body: dict) -> tuple[int, int, float]:
    """Status, completion tokens and the monotonic time of the stream's last byte."""
    with httpx.stream("POST", f"{root}/v1/chat/completions", json=body, timeout=120) as r:
        events = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: {")]
        usage = [json.loads(e)["usage"] for e in events if '"usage":{' in e]
        return r.status_code, usage[-1]["completion_tokens"] if usage else 0, time.monotonic()


def _seconds_per_token(app) -> float:
    """Decode time per token of one stream now (two lengths: the first token's time cancels)."""
    times = []
    for num_tokens in (2, 12):
        started = time.monotonic()
        app.chat(_COUNT, max_tokens=num_tokens, ignore_eos=True, temperature=0)
        times.append(time.monotonic() - started)
    return max((times[1] - times[0]) / 10, 1e-3)


_COUNT = [{"role": "user", "content": "Count slowly"}]


def test_rotating_the_key_and_limits_keeps_workers_and_requests_in_flight(ray_session):
    """A redeploy that changes the API key and the back-pressure limits (ingress settings)
    starts no process: the fleet's actors and the replica stay (it reconfigures in place),
    streams that began under the old config run to their last token, and the new key and
    limits hold."""
    old = deploy(cluster_config())
    fleet = ray.get_actor(controller.controller_name("epd", old.config), controller.NAMESPACE)
    ray.get(fleet.apply_live.remote(cluster_config(decode=SLOW).model_dump(mode="json")))
    before = _fleet(old)["actor_ids"]
    pid = _ingress(old)["pid"]
    num_tokens = min(max(math.ceil(6 / _seconds_per_token(old)), 24), 1500)  # ~6 s a stream
    body = {
        "model": old.config.model.served_name,
        "messages": _COUNT,
        "max_tokens": num_tokens,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with ThreadPoolExecutor(3) as pool:
        streams = [pool.submit(_stream, old.root, body) for _ in range(3)]
        redeployed = time.monotonic()
        new = deploy(_keyed_config())
        results = [s.result() for s in streams]
    assert [(status, tokens) for status, tokens, _ in results] == [(200, num_tokens)] * 3
    assert min(ended for *_, ended in results) > redeployed + 3  # in flight through the switch
    assert _fleet(new)["actor_ids"] == before  # no worker restarted
    assert _ingress(new)["pid"] == pid  # nor the replica
    ask = {"model": body["model"], "messages": _COUNT, "max_tokens": 2}
    assert new.http.post("/v1/chat/completions", json=ask).status_code == 401  # the new key
    auth = {"Authorization": f"Bearer {KEY}"}
    assert new.http.post("/v1/chat/completions", json=ask, headers=auth).status_code == 200
    # The new limits, whole once the old config's requests have ended and it has unregistered:
    # until then the controller counts two owners, and the new one admits half the budget.
    whole = LIMITS["max_generating_per_decode_worker"] * new.config.decode.num_workers
    seen, deadline = [_max_generating(new)], time.monotonic() + 30
    while seen[-1] != whole and time.monotonic() < deadline:
        time.sleep(0.2)
        seen.append(_max_generating(new))
    assert seen[-1] == whole and set(seen) <= {whole, whole // 2}, seen


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
    lines = replica_log_lines(ok.headers["x-request-id"], bad.headers["x-request-id"])
    assert f"request {ok.json()['id']} " in lines[0]
    assert (
        "status=ok" in lines[0]
        and "prompt_tokens=" in lines[0]
        and "completion_tokens=3" in lines[0]
    )
    assert (
        "ttft_ms=" in lines[0] and "e2e_ms=" in lines[0] and "log me please" in lines[0]
    )  # log_prompts is on
    # the TTFT's phases as the response has them, but those that print as 0.0 (a text
    # request's encode phases)
    timings = ok.json()["timings"]
    for name in RequestTimings().phases_ms(AdmissionTimings()):
        shown = f" {name}={timings[name]:.1f}" in lines[0]
        assert shown == (timings[name] >= MIN_PHASE_MS), (name, timings[name], lines[0])
    assert "prefill_compute_ms=" in lines[0] and "encode_compute_ms=" not in lines[0]
    assert "status=400" in lines[1] and "_ms=" not in lines[1]  # refused: no TTFT, no phases


def test_serve_logs_a_streamed_answer_as_200(keyed):
    """A streamed answer goes out from the replica's HTTP loop (cluster/stream_relay.py); once
    it is complete the server reports a disconnect, which Serve took for a client that left:
    about 40% of served streams were logged (and counted by Serve) as 499."""
    body = {
        "model": keyed.config.model.served_name,
        "messages": [{"role": "user", "content": "count"}],
        "max_tokens": 2,
        "stream": True,
    }
    ids = [f"stream-log-{i}-{time.monotonic_ns()}" for i in range(12)]
    for rid in ids:
        headers = {"authorization": f"Bearer {KEY}", "x-request-id": rid}
        with keyed.http.stream("POST", "/v1/chat/completions", json=body, headers=headers) as r:
            assert r.status_code == 200 and "[DONE]" in r.read().decode()
    lines = replica_log_lines(*ids, line="{} -- POST ")  # Serve's access line
    assert all(" /v1/chat/completions 200 " in ln for ln in lines), lines
