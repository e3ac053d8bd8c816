"""Process discovery and RSS sampling for the hardening probe (scripts/probe_server.py).

Worker pids come from the server itself (`GET /health?verbose=1`), so only this server's
processes are ever sampled or killed. The ingress replica's pid comes from the health body
when it carries one, else from a process scan narrowed to the workers' Ray node.
"""

from __future__ import annotations

import threading
import time

import httpx
import psutil

KINDS = ("encoder", "prefill", "decode")  # worker kinds
# Of the ingress's RSS: its heap (RssAnon), and the object store's shared pages it wrote pixels
# into (RssShmem: they stay mapped after the objects go); the rest is code and mapped files.
HEAP, STORE_PAGES = "ingress, heap", "ingress, store pages"
_STATUS_FIELDS = {HEAP: "RssAnon:", STORE_PAGES: "RssShmem:"}
GROUPS = ("ingress", HEAP, STORE_PAGES, *KINDS)
PERIOD_S = 0.2
REFRESH_S = 2.0  # pids change when a worker is restarted


def _health(url: str) -> dict:
    resp = httpx.get(f"{url}/health", params={"verbose": 1}, timeout=3)
    return (
        resp.json() if resp.headers.get("content-type", "").startswith("application/json") else {}
    )


def worker_pids(url: str) -> dict[str, list[int]]:
    try:
        workers = _health(url).get("workers") or {}
    except (httpx.HTTPError, ValueError):
        return {}
    return {
        kind: [w["pid"] for w in ws if isinstance(w, dict) and w.get("pid")]
        for kind, ws in workers.items()
    }


DECODE_COUNTERS = ("steps", "borrowed_steps", "kv_regrowths", "kv_slides")


def decode_steps(url: str) -> tuple[int, ...]:
    """The decode workers' DECODE_COUNTERS so far, summed: device steps, those on borrowed
    cores, and how often the batch's KV buffers grew or slid."""
    workers = (_health(url).get("workers") or {}).get("decode") or []
    stats = [w for w in workers if isinstance(w, dict)]
    return tuple(sum(w.get(key, 0) for w in stats) for key in DECODE_COUNTERS)


def ingress_pid(url: str, known_workers: list[int] | None = None) -> int | None:
    try:
        body = _health(url)
    except (httpx.HTTPError, ValueError):
        body = {}
    if isinstance(body.get("ingress"), dict) and body["ingress"].get("pid"):
        return body["ingress"]["pid"]
    workers = known_workers or [
        p for ws in (body.get("workers") or {}).values() for p in (w.get("pid") for w in ws) if p
    ]
    return _scan_ingress(workers)


def _scan_ingress(workers: list[int]) -> int | None:
    """The 'ServeReplica...Ingress' process; with several Ray clusters on the host, the one
    that shares a parent (the raylet) with this server's workers."""
    parents = set()
    for pid in workers:
        try:
            parents.add(psutil.Process(pid).ppid())
        except psutil.Error:
            pass
    found = []
    for proc in psutil.process_iter(["pid", "ppid", "name", "cmdline"]):
        text = " ".join(proc.info["cmdline"] or []) + " " + (proc.info["name"] or "")
        if "ServeReplica" in text and "Ingress" in text:
            found.append(proc.info)
    mine = [p for p in found if p["ppid"] in parents] if parents else found
    return mine[0]["pid"] if len(mine) == 1 else None


def _rss(pid: int) -> int:
    return psutil.Process(pid).memory_info().rss


def _status_bytes(pid: int, field: str) -> int:
    """A kB field of /proc/<pid>/status (RssAnon:, RssShmem:), in bytes (Linux)."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    return 0


class RssSampler(threading.Thread):
    """Sums RSS per group every PERIOD_S in the background; phases read windows of it."""

    def __init__(self, url: str):
        super().__init__(daemon=True)
        self.url, self._halt = url, threading.Event()
        self.pids: dict[str, list[int]] = {}
        self.samples: list[tuple[float, dict[str, float]]] = []
        self._refresh()

    def _refresh(self) -> None:
        workers = worker_pids(self.url)
        if workers:  # keep the last known pids while the server cannot say
            flat = [p for ws in workers.values() for p in ws]
            ingress = ingress_pid(self.url, flat)
            self.pids = {
                **workers,
                "ingress": [ingress] if ingress else self.pids.get("ingress", []),
            }

    def sample(self) -> dict[str, float]:
        out = {}
        for group in GROUPS:
            total = 0
            field = _STATUS_FIELDS.get(group)
            for pid in self.pids.get("ingress" if field else group, []):
                try:
                    total += _status_bytes(pid, field) if field else _rss(pid)
                except (psutil.Error, OSError):  # killed or restarted: it no longer counts
                    pass
            out[group] = total / 2**20
        return out

    def snapshot(self) -> tuple[float, dict[str, float]]:
        entry = (time.monotonic(), self.sample())
        self.samples.append(entry)
        return entry

    def run(self) -> None:
        last_refresh = time.monotonic()
        while not self._halt.wait(PERIOD_S):
            if time.monotonic() - last_refresh > REFRESH_S:
                try:
                    self._refresh()
                except Exception:  # a sampler must not end the probe
                    pass
                last_refresh = time.monotonic()
            self.snapshot()

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=5)

    def window(self, t0: float, before, after) -> dict[str, list[float]]:
        """group -> [before, peak, after] MB over [t0, after's time]."""
        inside = [s for t, s in self.samples if t0 <= t <= after[0]] + [before[1], after[1]]
        return {g: [before[1][g], max(s[g] for s in inside), after[1][g]] for g in GROUPS}
