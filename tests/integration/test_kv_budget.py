"""Memory under pressure, over HTTP: a request whose KV could never fit the decode budget
gets a 400 naming `decode.kv_cache_mb`; a burst larger than the budget queues in the
decode worker and every request finishes token-exact; afterwards nothing is held (decode
rows and reservations, referenced or encoding encoder-cache entries), as `/health?verbose=1`
and `/metrics` show."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from transformers import AutoConfig

from actors.engine import kv
from tests.integration.conftest import cluster_config, deploy, png_data_url, random_image
from tests.integration.reference import reference_generate
from tests.integration.test_worker_failures import held, wait_until_idle

BUDGET_TOKENS = 150  # the decode KV budget, in tokens of this model: two of the burst's requests
MAX_TOKENS = 24
SEEDS = (
    710,
    711,
    712,
    713,
    710,
    714,
)  # one image twice: the second joins or hits the first's encoding


def _messages(seed: int) -> list[dict]:
    image = {"type": "image_url", "image_url": {"url": png_data_url(random_image(seed, 40, 40))}}
    return [
        {"role": "user", "content": [{"type": "text", "text": "What is in this picture?"}, image]}
    ]


@pytest.fixture(scope="module")
def per_token(ray_session) -> int:
    config = cluster_config()
    return kv.bytes_per_token(
        AutoConfig.from_pretrained(config.model.checkpoint_path).get_text_config(), 4
    )  # float32


@pytest.fixture(scope="module")
def tight(per_token):
    return deploy(cluster_config(decode={"kv_cache_mb": BUDGET_TOKENS * per_token / 2**20}))


def test_a_request_that_could_never_fit_gets_400_naming_the_limit(tight):
    r = tight.chat(_messages(700), temperature=0, max_tokens=BUDGET_TOKENS)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert "decode.kv_cache_mb" in error["message"] and error["param"] == "max_tokens", error
    assert (
        tight.chat(_messages(700), temperature=0, max_tokens=4).status_code == 200
    )  # the same prompt, a smaller budget


def test_a_burst_beyond_the_budget_queues_finishes_exact_and_frees_everything(tight, per_token):
    async def burst():
        async with httpx.AsyncClient(base_url=tight.root, timeout=120) as client:
            body = {
                "model": tight.config.model.served_name,
                "temperature": 0,
                "max_tokens": MAX_TOKENS,
            }
            return await asyncio.gather(
                *[
                    client.post("/v1/chat/completions", json={**body, "messages": _messages(s)})
                    for s in SEEDS
                ]
            )

    responses = asyncio.run(burst())
    assert [r.status_code for r in responses] == [200] * len(SEEDS), [
        r.text for r in responses if r.status_code != 200
    ]
    checkpoint = str(tight.config.model.checkpoint_path)
    want = [reference_generate(checkpoint, _messages(s), MAX_TOKENS)[1] for s in SEEDS]
    assert [r.json()["choices"][0]["message"]["content"] for r in responses] == want

    smallest = min(r.json()["usage"]["prompt_tokens"] for r in responses) + MAX_TOKENS
    fit = BUDGET_TOKENS // smallest
    assert 1 <= fit < len(SEEDS), "the budget must hold some of the burst, not all of it"
    decoders = tight.http.get("/health", params={"verbose": 1}).json()["workers"]["decode"]
    assert 1 <= max(w["max_batch"] for w in decoders) <= fit, decoders
    assert sum(w["waited_for_kv"] for w in decoders) > 0, decoders  # the rest waited for room

    assert not any(wait_until_idle(tight, within_s=10).values()), held(tight)
    encoders = tight.http.get("/health", params={"verbose": 1}).json()["workers"]["encoder"]
    assert sum(e["cache_cached_entries"] for e in encoders) >= len(set(SEEDS)), (
        encoders
    )  # kept for reuse, unpinned
    assert sum(e["cache_referenced_bytes"] for e in encoders) == 0
    assert all(
        w["kv_reserved_bytes"] == 0
        for w in tight.http.get("/health", params={"verbose": 1}).json()["workers"]["decode"]
    )
    _metrics_show_nothing_held(tight)


def _metrics_show_nothing_held(app) -> None:
    samples = [
        s for f in text_string_to_metric_families(app.http.get("/metrics").text) for s in f.samples
    ]
    by_state: dict[str, float] = {}
    for s in samples:
        if s.name == "epd:encoder_cache_entries":
            by_state[s.labels["state"]] = by_state.get(s.labels["state"], 0) + s.value
    assert (
        by_state.get("referenced") == 0
        and by_state.get("encoding") == 0
        and by_state.get("cached", 0) > 0
    ), by_state
    usage = [s.value for s in samples if s.name == "epd:kv_cache_usage_perc"]
    assert usage and all(u == 0 for u in usage), usage


def test_clients_that_leave_before_their_first_token_pin_no_encoder_entry(tight):
    """Requests cut off while encoding or handing embeddings over release what they held."""

    async def leave_early(client: httpx.AsyncClient, seed: int, after_s: float) -> None:
        body = {
            "model": tight.config.model.served_name,
            "messages": _messages(seed),
            "temperature": 0,
            "max_tokens": 4,
        }
        try:
            await client.post("/v1/chat/completions", json=body, timeout=after_s)
        except httpx.TimeoutException:
            pass  # the connection closes: the ingress aborts the request wherever it is

    async def storm():
        async with httpx.AsyncClient(base_url=tight.root) as client:
            await asyncio.gather(
                *[leave_early(client, 800 + i, 0.02 * (1 + i % 5)) for i in range(10)]
            )

    asyncio.run(storm())
    assert not any(wait_until_idle(tight, within_s=10).values()), held(tight)
    assert tight.chat(_messages(800), temperature=0, max_tokens=4).status_code == 200
