"""The endpoints a user and their monitoring meet: the official openai client, model list,
health, a real Prometheus scrape, and recovery from a worker that dies."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import openai
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.integration.conftest import (
    png_data_url,
    random_image,
    replica_log_lines,
    replica_log_text,
)

IMAGE = {"type": "image_url", "image_url": {"url": png_data_url(random_image(21, 48, 48))}}
MESSAGES = [
    {
        "role": "user",
        "content": [{"type": "text", "text": "What is in"}, IMAGE, {"type": "text", "text": "?"}],
    }
]


@pytest.fixture(scope="module")
def client(app) -> openai.OpenAI:
    return openai.OpenAI(base_url=app.base_url, api_key="unused", max_retries=0)


def test_openai_client_whole_and_streamed(app, client):
    whole = client.chat.completions.create(
        model=app.config.model.served_name, messages=MESSAGES, temperature=0, max_tokens=10
    )
    assert whole.object == "chat.completion" and whole.choices[0].finish_reason in (
        "stop",
        "length",
    )
    assert (
        whole.usage.prompt_tokens > 16
        and whole.usage.completion_tokens == 10
        or whole.choices[0].finish_reason == "stop"
    )
    chunks = list(
        client.chat.completions.create(
            model=app.config.model.served_name,
            messages=MESSAGES,
            temperature=0,
            max_tokens=10,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=MESSAGES)


def test_models_lists_the_checkpoint(app, client):
    models = client.models.list().data
    assert [m.id for m in models] == [app.config.model.served_name]
    assert app.http.get("/v1/models").json()["data"][0]["root"] == str(
        app.config.model.checkpoint_path
    )


def _scrape(app) -> dict:
    """Every epd sample by (name, labels other than model_name); each names the served model."""
    families = [
        f
        for f in text_string_to_metric_families(app.http.get("/metrics").text)
        if f.name.startswith("epd:")
    ]
    samples = [s for f in families for s in f.samples]
    assert samples and all(s.labels["model_name"] == app.config.model.served_name for s in samples)
    return {
        (s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))): s.value
        for s in samples
    }


def test_metrics_scrape(app):
    before = _scrape(app)
    fresh = [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": png_data_url(random_image(77, 30, 30))}}
            ],
        }
    ]
    assert (
        app.chat(fresh, temperature=0, max_tokens=6).status_code == 200
    )  # a new image: no cache hit
    assert app.chat([{"role": "user", "content": "x"}], temperature=9).status_code == 400
    after = _scrape(app)
    grew = lambda key: after.get(key, 0) - before.get(key, 0)
    assert grew(("epd:requests_total", (("status", "ok"),))) == 1
    assert grew(("epd:requests_total", (("status", "400"),))) == 1
    assert grew(("epd:request_success_total", (("finished_reason", "length"),))) == 1
    for name in (
        "time_to_first_token",
        "request_time_per_output_token",
        "e2e_request_latency",
        "request_queue_time",
        "request_prefill_time",
        "request_decode_time",
    ):
        assert grew((f"epd:{name}_seconds_count", ())) == 1, name
    assert grew(("epd:inter_token_latency_seconds_count", ())) >= 1
    assert grew(("epd:request_generation_tokens_sum", ())) == 6
    assert grew(("epd:generation_tokens_total", ())) == 6
    assert grew(("epd:prompt_tokens_total", ())) == grew(("epd:request_prompt_tokens_sum", ())) > 16
    assert (
        grew(("epd:mm_cache_queries_total", ())) == 1 and grew(("epd:mm_cache_hits_total", ())) == 0
    )
    for stage in ("encode", "prefill", "prefill_item_wait", "decode_step"):
        assert grew(("epd:stage_latency_seconds_count", (("stage", stage),))) >= 1, stage
    assert grew(("epd:encoder_batch_size_count", ())) == 1
    for kind in ("encoder", "prefill", "decode"):
        assert after[("epd:queue_depth", (("kind", kind),))] == 0
    assert after[("epd:num_requests_running", ())] == after[("epd:num_requests_waiting", ())] == 0
    top = max(
        float(dict(k[1])["le"])
        for k in after
        if k[0] == "epd:time_to_first_token_seconds_bucket" and dict(k[1])["le"] != "+Inf"
    )
    assert top == app.config.limits.request_timeout_s  # buckets reach the timeout, no further


def test_metrics_answer_a_head_probe(app):
    """Benchmark clients (AIPerf) look for /metrics with HEAD before they scrape it."""
    r = app.http.head("/metrics")
    assert (
        r.status_code == 200
        and r.headers["content-type"].startswith("text/plain")
        and r.content == b""
    )


def test_health(app):
    body = app.http.get("/health").json()
    assert (
        body["status"] == "ok"
        and body["healthy_workers"]["encoder"] == app.config.encoder.num_workers
    )


def _may_lower_niceness() -> bool:
    """Whether a process here may lower its niceness (root with CAP_SYS_NICE, or RLIMIT_NICE)."""
    code = "import os; os.nice(1); os.setpriority(os.PRIO_PROCESS, 0, 0)"
    return subprocess.run([sys.executable, "-c", code], capture_output=True).returncode == 0


def test_decode_workers_run_at_their_niceness_and_the_other_stages_at_rays(app, client):
    client.chat.completions.create(
        model=app.config.model.served_name, messages=MESSAGES, temperature=0, max_tokens=3
    )
    workers = app.http.get("/health", params={"verbose": 1}).json()["workers"]
    rays = int(os.environ.get("RAY_worker_niceness", "15"))
    decode = {w["step_niceness"] for w in workers["decode"]} - {None}
    others = {w["step_niceness"] for w in workers["encoder"] + workers["prefill"]} - {None}
    assert decode == {app.config.decode.niceness if _may_lower_niceness() else rays}, workers
    assert others == {rays}, "encoder and prefill keep Ray's"
    ingress = app.http.get("/health", params={"verbose": 1}).json()["ingress"]["niceness"]
    assert ingress == (app.config.server.ingress_niceness if _may_lower_niceness() else rays)


def test_the_port_is_haproxys_and_it_hands_connections_to_the_replica(app):
    """The default front door: no Serve proxy actor relays the request; HAProxy owns the port
    and the ingress replica answers on a port of its own."""
    port = int(app.base_url.rsplit(":", 1)[1].split("/")[0])
    owners = {
        psutil.Process(c.pid).name()
        for c in psutil.net_connections("tcp")
        if c.status == psutil.CONN_LISTEN and c.laddr.port == port and c.pid
    }
    assert owners == {"haproxy"}, owners
    replicas = [
        c.laddr.port
        for c in psutil.net_connections("tcp")
        if c.status == psutil.CONN_LISTEN and c.pid == _ingress_pid(app)
    ]
    assert any(30000 <= p < 31000 for p in replicas), replicas
    assert app.http.get("/health").status_code == 200


def _ingress_pid(app) -> int:
    return app.http.get("/health", params={"verbose": 1}).json()["ingress"]["pid"]


def test_dead_worker_is_replaced_and_service_resumes(app):
    workers = app.http.get("/health", params={"verbose": 1}).json()
    pid = _decode_pid(app)
    import os
    import signal

    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        r = app.chat(MESSAGES, temperature=0, max_tokens=4)
        assert r.status_code in (200, 503), r.text  # fails cleanly, never hangs
        if r.status_code == 200 and _decode_pid(app) != pid:
            break
        time.sleep(1)
    else:
        pytest.fail("the decode worker was not replaced within 90 s")
    assert workers["workers"]["decode"]
    assert app.http.get("/health").json()["status"] == "ok"


def _decode_pid(app) -> int:
    return app.http.get("/health", params={"verbose": 1}).json()["workers"]["decode"][0]["pid"]


def test_a_small_kv_goes_to_decode_inside_the_link_calls(app):
    """A prompt's KV of at most transport.inline_max_bytes is popped from the prefill worker
    and submitted to decode over their links, not through two Ray calls and the store."""

    def submitted() -> int:
        workers = app.http.get("/health", params={"verbose": 1}).json()["workers"]
        return sum(w["submits_over_link"] for w in workers["decode"])

    before = submitted()
    r = app.chat(MESSAGES, temperature=0, max_tokens=4)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text
    assert submitted() == before + 1
    workers = app.http.get("/health", params={"verbose": 1}).json()["workers"]
    assert all(w["held_kv"] == 0 for w in workers["prefill"] + workers["decode"]), workers


def test_repeated_image_hits_the_encoder_cache(app):
    image = {"type": "image_url", "image_url": {"url": png_data_url(random_image(404, 36, 36))}}
    messages = [{"role": "user", "content": [image, {"type": "text", "text": "again"}]}]
    before = _scrape(app)
    bodies = [app.chat(messages, temperature=0, max_tokens=8).json() for _ in range(3)]
    answers = [body["choices"][0]["message"]["content"] for body in bodies]
    # the repeats' prefix, image included, is cached: they never waited for its embeddings
    assert [body["timings"]["item_wait_ms"] for body in bodies[1:]] == [0.0, 0.0], bodies
    after = _scrape(app)
    hits = after[("epd:mm_cache_hits_total", ())] - before.get(("epd:mm_cache_hits_total", ()), 0)
    misses = (
        after[("epd:mm_cache_queries_total", ())]
        - before.get(("epd:mm_cache_queries_total", ()), 0)
        - hits
    )
    assert len(set(answers)) == 1
    assert (
        misses >= 1 and hits >= 1 and hits + misses == 3
    )  # two encoders: the least-loaded pick may alternate; each lookup counted, used or not
    workers = app.http.get("/health", params={"verbose": 1}).json()["workers"]
    assert all(w["held_embeddings"] == 0 for w in workers["prefill"]), workers["prefill"]


def test_estimated_ttft_is_reported_and_requests_are_traced(app):
    from router.sim.trace_file import load_trace, parse_trace_line
    from tests.integration.conftest import TRACE_PATH

    image = {"type": "image_url", "image_url": {"url": png_data_url(random_image(505, 40, 40))}}
    body = app.chat(
        [{"role": "user", "content": [image, {"type": "text", "text": "trace me"}]}],
        temperature=0,
        max_tokens=4,
    ).json()
    timings = body["timings"]
    assert timings["estimated_ttft_ms"] > 0 and timings["ttft_ms"] > 0
    # every phase of the TTFT is there, the image's decode and encode included, and they add up
    for phase in ("admit", "parse", "media", "plan", "encode_compute", "prefill_compute"):
        assert timings[f"{phase}_ms"] > 0, (phase, timings)
    parts = ("admit", "route", "prefill_call", "first_token")
    assert sum(timings[f"{p}_ms"] for p in parts) == pytest.approx(timings["ttft_ms"], abs=0.01)
    assert timings["parse_ms"] + timings["media_ms"] + timings["plan_ms"] <= timings["admit_ms"]
    assert 0 < timings["handover_ms"] < timings["e2e_ms"]  # the HTTP server to epd's handler
    assert timings["prefill_ms"] <= timings["prefill_call_ms"]
    hops = timings["prefill_hop_in_ms"] + timings["prefill_hop_out_ms"]
    assert 0 < hops < timings["prefill_call_ms"] - timings["prefill_ms"] + 0.5, timings
    # inside the call, its parts in turn: none overlaps another, the first token's hand-back too
    inside = ("hop_in", "queue", "compute", "publish", "hop_out")
    assert timings["prefill_publish_ms"] > 0, timings
    inner_ms = sum(timings[f"prefill_{p}_ms"] for p in inside) + timings["item_wait_ms"]
    assert inner_ms <= timings["prefill_call_ms"] + 0.5, timings
    assert _scrape(app)[("epd:estimated_ttft_seconds_count", ())] >= 1
    workload = load_trace(TRACE_PATH)  # the simulator's own loader reads what the cluster wrote
    assert len(workload) >= 1
    # The file's last line is this request; the loader orders by arrival, and each app
    # deployed in this session counts arrivals from its own start, so its last may be older.
    lines = TRACE_PATH.read_text().splitlines()
    last = parse_trace_line(lines[-1], TRACE_PATH, len(lines))[1]
    assert last.items and last.items[0].modality == "image" and last.items[0].num_embeddings == 16
    assert last.num_prompt_tokens == body["usage"]["prompt_tokens"]
    record = json.loads(TRACE_PATH.read_text().splitlines()[-1])  # the estimate's parts, per stage
    assert set(record["estimate_ms"]) == {
        "encoder_queue_ms",
        "encode_ms",
        "transfer_ms",
        "prefill_queue_ms",
        "prefill_ms",
    }
    assert sum(record["estimate_ms"].values()) == pytest.approx(
        record["estimated_ttft_ms"], abs=0.01
    )
    assert record["estimate_ms"]["encode_ms"] > 0 and record["estimate_ms"]["prefill_ms"] > 0
    # and every measured phase, as the response named it
    phases = record["phases_ms"]
    assert list(phases)[0] == "handover_ms" and list(phases)[-1] == "first_token_ms"
    for name, ms in phases.items():
        assert ms == pytest.approx(timings[name], abs=1e-3), name


def test_one_access_line_a_request_epds_not_serves_too(app):
    """Serve's own access line repeats epd's request line and cost the ingress about 8% of
    its CPU a streamed token; it is written only with `server.serve_access_log: true`
    (tests/integration/test_operations.py runs with it)."""
    rid = f"one-line-{time.monotonic_ns()}"
    body = {"model": app.config.model.served_name, "messages": [{"role": "user", "content": "hi"}]}
    r = app.http.post(
        "/v1/chat/completions", json=body | {"max_tokens": 2}, headers={"x-request-id": rid}
    )
    assert r.status_code == 200, r.text
    [line] = replica_log_lines(rid)  # epd's line: status, tokens, times
    assert "status=ok" in line and "completion_tokens=" in line
    time.sleep(1.0)  # Serve's line, were it written, goes out with the same flush
    assert f"{rid} -- POST" not in replica_log_text()
