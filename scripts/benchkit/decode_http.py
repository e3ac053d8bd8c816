"""Decode over HTTP against the checkpoint's own `generate`: TPOT of N concurrent streams
through the served app, and of `generate` stepping a batch of N in one process,
`(t(n + 1 new) - t(1 new)) / n`; plus the ingress's and Serve proxy's CPU per token."""

from __future__ import annotations

import asyncio
import json
import re
import statistics
import time
from urllib.parse import urlsplit

import psutil

from benchkit.cpu import CpuWatch
from benchkit.http_client import Result, streaming_chat_body
from benchkit.raw_client import TOKEN_MARKS
from benchkit.rss import decode_steps, ingress_pid
from benchkit.stats import pct

PROMPT = "Describe the picture of a red circle next to a blue square in a few sentences."


def generate_tpot_ms(cfg, batch: int, new_tokens: int, threads: int, repeats: int = 3) -> float:
    """ms per token of the checkpoint's `generate` over `batch` copies of the prompt (greedy,
    eos ignored), from the difference between `new_tokens + 1` and 1 new tokens."""
    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor

    torch.set_num_threads(threads)
    path = cfg.model.checkpoint_path
    device = cfg.model.device
    model = (
        AutoModelForImageTextToText.from_pretrained(
            path, dtype=getattr(torch, cfg.model.resolved_dtype)
        )
        .to(device)
        .eval()
    )
    processor = AutoProcessor.from_pretrained(path)
    text = processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "text", "text": PROMPT}]}],
        add_generation_prompt=True,
    )
    ids = processor(text=[text] * batch, return_tensors="pt").to(device)

    def seconds(n: int) -> float:
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            with torch.inference_mode():
                model.generate(**ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            times.append(time.perf_counter() - started)
        return statistics.median(times)

    seconds(2)  # warm-up
    return (seconds(new_tokens + 1) - seconds(1)) / new_tokens * 1e3


def _body(model: str, max_tokens: int) -> bytes:
    """The bench's streaming chat request, generating on past the end-of-sequence token."""
    body = json.loads(streaming_chat_body(model, [{"type": "text", "text": PROMPT}], max_tokens))
    return json.dumps(body | {"ignore_eos": True}).encode()


async def _stream_raw(host: str, port: int, request: bytes, t0: float) -> Result:
    """One streaming chat over a bare socket: the times of the first and the last read that
    carried a token, and the completion tokens from the usage chunk. The client shares this
    host's cores with the server, so it parses nothing per token (httpx and a JSON parse per
    event cost about 0.15 ms of CPU a token here)."""
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(request)
    first = last = None
    data = await reader.read(65536)
    if not data.startswith(b"HTTP/1.1 200"):
        raise RuntimeError(f"the server answered {data[:300]!r}")
    block = data
    while True:
        if any(mark in block for mark in TOKEN_MARKS):
            now = time.perf_counter()
            first, last = first or now, now
        if b"[DONE]" in data[-64:] or not (block := await reader.read(65536)):
            break
        data = data[-4096:] + block
    writer.close()
    match = re.search(rb'"completion_tokens":(\d+)', data)
    n = int(match.group(1)) if match else 0
    if first is None or not n:
        raise RuntimeError(f"no tokens in the stream: {data[-300:]!r}")
    return Result(first - t0, (last - first) / (n - 1) if n > 1 else None, n, first - t0, last - t0)


async def run_streams(url: str, model: str, streams: int, max_tokens: int) -> list:
    parts = urlsplit(url)
    body = _body(model, max_tokens)
    head = f"POST {parts.path} HTTP/1.1\r\nHost: {parts.netloc}\r\n"
    request = (
        f"{head}Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode() + body
    t0 = time.perf_counter()
    return await asyncio.gather(
        *(_stream_raw(parts.hostname, parts.port, request, t0) for _ in range(streams))
    )


def _serve_pids(base: str) -> dict[str, int]:
    """The ingress replica and, beside it under the same raylet, the front door: Serve's HTTP
    proxy actor (idle behind HAProxy: the head's fallback), or the HAProxy process that the
    HAProxy manager runs."""
    ingress = ingress_pid(base.removesuffix("/v1"))
    if not ingress:
        return {}
    out, parent = {"ingress": ingress}, psutil.Process(ingress).ppid()
    for proc in psutil.process_iter(["ppid", "cmdline"]):
        cmdline = " ".join(proc.info["cmdline"] or []) if proc.info["ppid"] == parent else ""
        if "ProxyActor" in cmdline:
            out["proxy"] = proc.pid
        elif "HAProxyManager" in cmdline:
            haproxy = [c.pid for c in proc.children() if "haproxy" in c.name()]
            out |= {"haproxy": haproxy[-1]} if haproxy else {}
    return out


def cluster_tpot(base: str, model: str, streams: int, max_tokens: int, rounds: int) -> dict:
    """TPOT p50 of `streams` concurrent streams (after one warm-up round) and the ingress's
    and proxy's CPU ms per streamed token over the measured rounds."""
    url = f"{base}/chat/completions"
    asyncio.run(run_streams(url, model, streams, max_tokens))
    procs = {name: psutil.Process(pid) for name, pid in _serve_pids(base).items()}
    cpu = lambda: {n: sum(p.cpu_times()[:2]) for n, p in procs.items()}
    server = base.removesuffix("/v1")
    before, steps_before, results = cpu(), decode_steps(server), []
    with CpuWatch() as watch:
        for _ in range(rounds):
            results += asyncio.run(run_streams(url, model, streams, max_tokens))
    used = {n: s - before[n] for n, s in cpu().items()}
    steps, borrowed, regrowths, slides = (
        a - b for a, b in zip(decode_steps(server), steps_before, strict=True)
    )
    tokens = sum(r.tokens for r in results)
    tpots = [r.tpot_s * 1e3 for r in results if r.tpot_s is not None]
    ttfts = [r.ttft_s * 1e3 for r in results]  # all streams sent at once: a burst's first tokens
    return {
        "tpot_ms_p50": round(pct(tpots, 50), 3),
        "tpot_ms_p90": round(pct(tpots, 90), 3),
        "burst_ttft_ms_p50": round(pct(ttfts, 50), 1),
        "burst_ttft_ms_p99": round(pct(ttfts, 99), 1),
        "tokens": tokens,
        "decode_steps": steps,
        "decode_borrowed_share": round(borrowed / steps, 3) if steps else None,
        "decode_kv_regrowths": regrowths,  # the batch's buffers grown (fresh memory)
        "decode_kv_slides": slides,
        **{f"{n}_cpu_ms_per_token": round(s * 1e3 / tokens, 4) for n, s in used.items()},
        "cpu_ms_per_token_by_process": {
            n: round(s * 1e3 / tokens, 4) for n, s in watch.by_process.items() if s > 0
        },
        "other_cpu_ms_per_token": round(watch.other_cpu_s * 1e3 / tokens, 4),
    }
