"""The hardening probe's fault phases (scripts/probe_server.py): SIGKILL a worker (or the
ingress) mid-traffic and time the recovery; clients drop their streams and the workers'
state must drain. `ctx` is the probe's context: args, url, model, timeout, client."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from dataclasses import asdict

import httpx

from benchkit import probe_cases as pc
from benchkit.probe_client import Outcome, chat_body, gather_bar, run_chat
from benchkit.probe_report import PhaseResult, count
from benchkit.rss import ingress_pid, worker_pids

DRAIN_FIELDS = (
    "held_kv",
    "held_embeddings",
    "rows",
    "open_streams",
    "running",
    "queued",
    "kv_reserved_bytes",
    "cache_encoding_entries",
    "cache_referenced_entries",
)


async def phase_kill(ctx, kind: str) -> PhaseResult:
    result = PhaseResult(f"kill:{kind}")
    pids = (
        [await asyncio.to_thread(ingress_pid, ctx.url)]
        if kind == "ingress"
        else (await asyncio.to_thread(worker_pids, ctx.url)).get(kind, [])
    )
    pid = next((p for p in pids if p), None)
    if pid is None:
        result.note = f"no {kind} pid found; skipped"
        return result
    images = (
        [pc.png(96, 96, seed=1000 + i) for i in range(20)] if kind == "encoder" else [None] * 20
    )
    bodies = [
        chat_body(ctx.model, words=24, max_tokens=32, stream=i % 2 == 0, image=img, seed=i)
        for i, img in enumerate(images)
    ]
    requests = [
        asyncio.ensure_future(staggered(ctx, b, i * ctx.args.kill_spread / len(bodies)))
        for i, b in enumerate(bodies)
    ]
    await asyncio.sleep(ctx.args.kill_delay)
    os.kill(pid, signal.SIGKILL)
    killed_at = time.monotonic()
    recovery = asyncio.ensure_future(wait_recovered(ctx, kind, pid, killed_at))
    outcomes = await gather_bar(requests, f"kill {kind} (pid {pid})")
    count(result, outcomes)
    result.recover_s, result.rows = await recovery, [asdict(o) for o in outcomes]
    broken = [o for o in outcomes if o.broken]
    result.note = (
        f"killed pid {pid}; ok={sum(o.ok for o in outcomes)} lost={result.lost} "
        f"broken_mid_stream={len(broken)} "
        f"(clean error event {sum(o.clean_error for o in broken)}) hung={result.hangs}"
    )
    return result


async def staggered(ctx, body: dict, delay: float) -> Outcome:
    # A tiny model answers 20 requests in about a second: spreading the arrivals keeps some
    # in flight at the kill and sends others to the dead worker before anyone noticed.
    await asyncio.sleep(delay)
    return await run_chat(ctx.client, ctx.url, body, ctx.timeout)


async def wait_recovered(ctx, kind: str, pid: int, since: float) -> float | None:
    """Seconds from the kill until /health is 200 without the killed pid and a fresh chat
    succeeds (health alone can still say 200 before the supervisor notices the death)."""
    deadline = since + ctx.args.recover_timeout
    while time.monotonic() < deadline:
        await asyncio.sleep(0.25)
        try:
            resp = await ctx.client.get(f"{ctx.url}/health", params={"verbose": 1}, timeout=5)
        except httpx.HTTPError:
            continue
        if resp.status_code != 200:
            continue
        pids = {w.get("pid") for ws in (resp.json().get("workers") or {}).values() for w in ws}
        if kind == "ingress":
            pids = {await asyncio.to_thread(ingress_pid, ctx.url)}
        if pid not in pids and (await run_chat(ctx.client, ctx.url, chat_body(ctx.model), 10)).ok:
            return round(time.monotonic() - since, 2)
    return None


async def phase_disconnect(ctx) -> PhaseResult:
    result = PhaseResult("disconnect")
    bodies = [
        chat_body(ctx.model, words=400, max_tokens=64, stream=True, seed=i) for i in range(30)
    ]

    async def drop(body, n):  # own client per stream: closing it surely closes the socket
        async with httpx.AsyncClient(timeout=ctx.timeout) as client:
            return await run_chat(client, ctx.url, body, ctx.timeout, stop_after=n)

    outcomes = await gather_bar([drop(b, 1 + i % 2) for i, b in enumerate(bodies)], "disconnect")
    count(result, outcomes)
    closed_at = time.monotonic()
    leaked, drained_s = await wait_drained(ctx, closed_at + ctx.args.drain_s)
    result.rows = [{"worker": w, "field": f, "value": v} for w, f, v in leaked]
    drained = (
        f"drained in {drained_s - closed_at:.1f}s"
        if drained_s
        else f"NOT drained after {ctx.args.drain_s:.0f}s"
    )
    result.note = f"{drained}; leaked: " + (
        ", ".join(f"{w}.{f}={v}" for w, f, v in leaked) or "none"
    )
    return result


async def wait_drained(ctx, deadline: float) -> tuple[list, float | None]:
    leaked = [("health", "unreachable", 1)]
    while True:
        try:
            resp = await ctx.client.get(f"{ctx.url}/health", params={"verbose": 1}, timeout=5)
            workers = resp.json().get("workers") or {}
            leaked = [
                (f"{kind}{i}", f, w[f])
                for kind, ws in workers.items()
                for i, w in enumerate(ws)
                for f in DRAIN_FIELDS
                if w.get(f)
            ]
            if resp.status_code == 200 and not leaked:
                return [], time.monotonic()
        except (httpx.HTTPError, ValueError):
            pass
        if time.monotonic() >= deadline:
            return leaked, None
        await asyncio.sleep(0.5)
