"""Two ingress replicas share one fleet, owned by the fleet controller: both serve exact
answers and /metrics on either reports both; killing one with requests in flight rebuilds no
worker, loses nothing that had not started on it, leaks nothing and takes nothing off the
app's counters (not even those a scrape on it showed just before); a redeploy that changes
only ingress settings keeps the fleet."""

from __future__ import annotations

import asyncio
import math
import os
import time

import httpx
import pytest
import ray
from prometheus_client.parser import text_string_to_metric_families

from cluster import controller
from cluster.metrics_share import PUSH_PERIOD_S
from tests.integration.conftest import cluster_config, deploy, png_data_url, random_image
from tests.integration.reference import reference_generate
from tests.integration.test_worker_failures import held, wait_until_idle

MAX_TOKENS = 24


def _messages(seed: int) -> list[dict]:
    if seed % 2:
        return [{"role": "user", "content": f"Tell me about the number {seed}, please."}]
    image = {"type": "image_url", "image_url": {"url": png_data_url(random_image(seed, 48, 40))}}
    return [{"role": "user", "content": [{"type": "text", "text": "Describe"}, image]}]


@pytest.fixture(scope="module")
def pair(ray_session):
    # Every request routes on the other replica's bookings as of now (router.sync_above_ms).
    # One replica first: going to two reconfigures it in place, where Serve's count lags.
    deploy(cluster_config(router={"sync_above_ms": 1e-3}))
    return deploy(cluster_config(server={"num_replicas": 2}, router={"sync_above_ms": 1e-3}))


def _verbose(app) -> dict:
    return app.http.get("/health", params={"verbose": 1}).json()


def _replicas(app, within_s: float = 60) -> dict[int, dict]:
    """pid -> /health's `ingress` of each replica, polled through the proxy until both answer."""
    seen, deadline = {}, time.monotonic() + within_s
    while len(seen) < 2:
        assert time.monotonic() < deadline, f"only replicas {sorted(seen)} answered"
        body = _verbose(app)
        if body["ingress"]["pid"] in seen:  # not both yet: leave the CPU to a replica starting
            time.sleep(0.2)
        seen[body["ingress"]["pid"]] = body["ingress"]
    return seen


async def _ask(client: httpx.AsyncClient, model: str, seed: int) -> tuple[int, str]:
    body = {"model": model, "messages": _messages(seed), "temperature": 0, "max_tokens": MAX_TOKENS}
    try:
        r = await client.post("/v1/chat/completions", json=body)
    except httpx.HTTPError as exc:  # the connection died with the replica
        return 0, repr(exc)
    return r.status_code, r.json()["choices"][0]["message"][
        "content"
    ] if r.status_code == 200 else r.text


async def _ask_again_if_dropped(client, model: str, seed: int) -> tuple[tuple[int, str], int]:
    """A new request, and whether HAProxy dropped it first: one sent over a kept-alive
    connection just as the replica behind it died is closed with no response at all (HAProxy
    then cannot know whether it ran; a client resends it, as the OpenAI SDK does)."""
    answer = await _ask(client, model, seed)
    if answer[0] == 0 and "without sending a response" in answer[1]:
        return await _ask(client, model, seed), 1
    return answer, 0


def test_both_replicas_serve_exact_answers(pair):
    checkpoint, model, seeds = (
        str(pair.config.model.checkpoint_path),
        pair.config.model.served_name,
        range(900, 916),
    )

    async def all_at_once():
        async with httpx.AsyncClient(base_url=pair.root, timeout=120) as client:
            return await asyncio.gather(*[_ask(client, model, s) for s in seeds])

    # Both in HAProxy's rotation (a new replica joins after its health checks), and each counts
    # the other from its start, also one reconfigured in place from a one-replica config (Serve's
    # count lags there): else its first requests route alone.
    replicas = _replicas(pair)
    assert all(r["num_replicas"] >= 2 for r in replicas.values()), replicas
    expected = [reference_generate(checkpoint, _messages(s), MAX_TOKENS)[1] for s in seeds]
    # A second burst where the first went to one replica only: on a loaded host a replica's
    # health check can time out, and HAProxy takes it out of rotation for a moment (one full
    # suite run, 2026-12-02). Both must have served by then.
    for num_bursts in (1, 2):
        results = asyncio.run(all_at_once())
        assert [text for _, text in results] == expected
        replicas = _replicas(pair)
        if all(r["served_ok"] > 0 for r in replicas.values()):
            break
    assert all(r["served_ok"] > 0 for r in replicas.values()), replicas  # both took part
    # Each request asked the controller for the others' bookings on its way (each replica
    # counts its own); on a busy host some answers miss the 50 ms wait (SHARE_TIMEOUT_S) and
    # route on the last share instead.
    syncs = [r["route_syncs"] for r in replicas.values()]
    assert sum(s["shared"] + s["unanswered"] for s in syncs) == num_bursts * len(seeds), replicas
    assert sum(s["shared"] for s in syncs) >= 1, replicas
    assert (
        len({str(_verbose(pair)["fleet"]) for _ in range(6)}) == 1
    )  # one fleet, seen alike from both


def _scrape(app) -> dict[str, float]:
    """requests_total by status, and the e2e latency histogram's count, from one /metrics
    through the proxy."""
    r = app.http.get("/metrics")
    assert r.status_code == 200
    samples = [s for f in text_string_to_metric_families(r.text) for s in f.samples]
    found = {s.labels["status"]: s.value for s in samples if s.name == "epd:requests_total"}
    found["e2e_count"] = sum(
        s.value for s in samples if s.name == "epd:e2e_request_latency_seconds_count"
    )
    found["in_progress"] = sum(
        s.value
        for s in samples
        if s.name in ("epd:num_requests_running", "epd:num_requests_waiting")
    )
    return found


def _settled_scrapes(
    app, num_scrapes: int = 8, since: float | None = None
) -> list[dict[str, float]]:
    """`since`: when the last request was answered (time.monotonic()), if it was not just now."""
    waited = 0.0 if since is None else time.monotonic() - since
    time.sleep(max(0.0, 3 * PUSH_PERIOD_S - waited))  # every replica has pushed what it counted
    return [_scrape(app) for _ in range(num_scrapes)]


def test_metrics_on_either_replica_count_both(pair):
    """The proxy round-robins scrapes over both replicas; each must report every request."""
    before = _settled_scrapes(pair)
    assert all(s == before[0] for s in before), before
    own = _replicas(pair)
    # Each replica's own count, added, and what replicas of earlier configs on this fleet counted
    # (an ingress-only redeploy keeps the fleet and its totals).
    assert before[0].get("ok", 0) >= sum(r["served_ok"] for r in own.values())
    model, seeds, num_bad = pair.config.model.served_name, range(1100, 1112), 3

    async def send():
        async with httpx.AsyncClient(base_url=pair.root, timeout=120) as client:
            ok = await asyncio.gather(*[_ask(client, model, s) for s in seeds])
            bad = [
                await client.post("/v1/chat/completions", json={"model": "nope", "messages": []})
                for _ in range(num_bad)
            ]
            return ok, bad

    ok, bad = asyncio.run(send())
    [bad_status] = {str(r.status_code) for r in bad}
    assert [status for status, _ in ok] == [200] * len(seeds) and bad_status.startswith("4")
    assert all(r["served_ok"] > own[pid]["served_ok"] for pid, r in _replicas(pair).items()), (
        own
    )  # both served some
    for scrape in _settled_scrapes(pair):
        assert scrape.get("ok", 0) - before[0].get("ok", 0) == len(seeds), scrape
        assert scrape.get(bad_status, 0) - before[0].get(bad_status, 0) == num_bad, scrape
        assert scrape["e2e_count"] - before[0]["e2e_count"] == len(seeds), scrape


def _serve_replica_actors() -> dict[int, object]:
    """pid -> handle of each live ingress replica actor."""
    names = [
        a["name"]
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["namespace"] == "serve"
        and "Ingress" in a["name"]
        and a["name"].startswith("SERVE_REPLICA")
    ]
    handles = [ray.get_actor(n, namespace="serve") for n in names]
    return {
        ray.get(h.__ray_call__.remote(lambda self: os.getpid()), timeout=10): h for h in handles
    }


async def _answers_alone(app, model: str, seeds: list[int]) -> list[tuple[int, str]]:
    """Each seed's answer with nothing killed (greedy: the same under any batching)."""
    async with httpx.AsyncClient(base_url=app.root, timeout=120) as client:
        answers = await asyncio.gather(*[_ask(client, model, s) for s in seeds])
    assert all(status == 200 for status, _ in answers), answers
    return [(s, text) for s, (_, text) in zip(seeds, answers)]


def test_killing_one_replica_rebuilds_nothing_and_loses_nothing_new(pair):
    model, seeds = pair.config.model.served_name, list(range(1000, 1020))
    before = _verbose(pair)["fleet"]
    expected = dict(asyncio.run(_answers_alone(pair, model, seeds)))
    counted = _settled_scrapes(pair, num_scrapes=2)[-1]["ok"]
    victim_pid, victim = next(iter(_serve_replica_actors().items()))

    async def under_fire():
        async with httpx.AsyncClient(base_url=pair.root, timeout=120) as client:
            in_flight = [asyncio.create_task(_ask(client, model, s)) for s in seeds]
            await asyncio.sleep(0.5)
            shown = max(
                _scrape(pair).get("ok", 0) for _ in range(4)
            )  # some land on the victim, with counts it has not pushed
            ray.kill(victim, no_restart=False)
            killed_at = time.monotonic()
            after = [await _ask_again_if_dropped(client, model, seeds[0])]  # one after another
            first_s = time.monotonic() - killed_at
            after += [await _ask_again_if_dropped(client, model, s) for s in seeds[1:6]]
            return (
                await asyncio.gather(*in_flight),
                [answer for answer, _ in after],
                sum(dropped for _, dropped in after),
                first_s,
                time.monotonic() - killed_at,
                shown,
            )

    results, after, dropped, first_s, all_s, shown = asyncio.run(under_fire())
    answered = time.monotonic()
    lost = [s for s, (status, _) in zip(seeds, results) if status != 200]
    print(
        f"\nkill one of 2 replicas: {len(seeds)} in flight, "
        f"{len(lost)} lost (on the killed replica), {dropped} of the new ones dropped and resent, "
        f"first new request answered {first_s:.2f} s after the kill, 6 in {all_s:.2f} s"
    )
    assert len(lost) < len(seeds), "no request survived on the other replica"
    assert all(text == expected[s] for s, (status, text) in zip(seeds, results) if status == 200)
    assert [(status, text) for status, text in after] == [
        (200, expected[s]) for s in seeds[:6]
    ]  # none lost, at once
    assert dropped <= 1, dropped  # at most the one that raced the death, and it was safe to resend
    assert _verbose(pair)["fleet"] == before  # no worker rebuilt, no generation bumped
    assert not any(wait_until_idle(pair, within_s=10).values()), held(pair)
    replicas = _replicas(pair, within_s=90)  # Serve brought the killed one back, on the same fleet
    assert victim_pid not in replicas
    assert _verbose(pair)["fleet"] == before
    survived = sum(status == 200 for status, _ in results)
    for scrape in _settled_scrapes(
        pair, num_scrapes=4, since=answered
    ):  # the dead replica's counts stayed (retired), all a scrape showed
        assert scrape["ok"] >= max(counted, shown) + len(after), (counted, shown, survived, scrape)
        assert scrape["in_progress"] == 0, scrape  # the dead replica's gauges went with it


def _shares_settle(app, pids: set[int], share: int, within_s: float = 30) -> None:
    """Until every replica in `pids` answers with `share` as its max_generating."""
    deadline = time.monotonic() + within_s
    seen: dict[int, int] = {}
    while set(seen) != pids or set(seen.values()) != {share}:
        assert time.monotonic() < deadline, f"replica shares {seen}, wanted {share} on {pids}"
        ingress = _verbose(app)["ingress"]
        seen[ingress["pid"]] = ingress["max_generating"]
        seen = {pid: s for pid, s in seen.items() if pid in pids}


def _sole_replica(app, within_s: float = 60) -> int:
    """The one replica's pid, once 8 answers in a row come from it (the other has stopped)."""
    deadline, last = time.monotonic() + within_s, []
    while len(last) < 8 or len(set(last[-8:])) > 1:
        assert time.monotonic() < deadline, f"replicas still answering: {set(last[-8:])}"
        last.append(_verbose(app)["ingress"]["pid"])
    return last[-1]


def test_back_to_one_replica_keeps_the_fleet_and_its_whole_budget(pair):
    """Only the replica count changes: the controller and its workers stay, and each replica
    admits its share of the budget, as many as are registered: the one left, all of it."""
    name = controller.controller_name("epd", pair.config)
    assert controller.running("epd") == [name]
    before = _verbose(pair)["fleet"]
    limits, decode = pair.config.limits, pair.config.decode
    whole = limits.max_generating_per_decode_worker * decode.num_workers
    pair_pids = set(_replicas(pair))
    _shares_settle(pair, pair_pids, math.ceil(whole / 2))
    single = deploy(cluster_config())  # the default config: the modules after this one reuse it
    assert single.config.fingerprint() != pair.config.fingerprint()
    assert controller.running("epd") == [name]
    _shares_settle(single, {_sole_replica(single)}, whole)
    assert _verbose(single)["fleet"]["actor_ids"] == before["actor_ids"]  # no worker rebuilt
    assert single.chat(_messages(1), temperature=0, max_tokens=4).status_code == 200
