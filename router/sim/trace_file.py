"""The simulator's trace files: the live cluster's request log, replayed as a `Workload`.

A trace file (JSONL, `load_trace` / `write_trace`) has: one JSON object per line, one line
per request, in any order (sorted by arrival on load); blank lines are skipped.

    {"arrival_s": 12.034,                # seconds since the trace began (float >= 0)
     "num_prompt_tokens": 1576,          # expanded prompt length (int >= 1)
     "max_tokens": 128,                  # generation limit (int >= 1)
     "items": [                          # media items in prompt order, [] for text-only
        {"identifier": "blake3:...",     # content hash (+ model namespace)
         "modality": "image",            # "image" | "video" | "audio"
         "size": 0.113,                  # megapixels | frames | seconds (float >= 0)
         "num_embeddings": 576,          # placeholder tokens it expands to (int >= 0)
         "embedding_bytes": 4718592}],   # bytes of its embeddings (int >= 0)
     "ttft_ms": 143.2,                   # optional: TTFT measured on the live cluster
     "encode_ms": 12.5,                  # optional, measured: the slowest item's encoder
                                         #   queue + encode,
     "prefill_queue_ms": 3.1,            #   the prefill worker's queue and prefill time
     "prefill_ms": 80.4,                 #   (router/sim/variability.py fits from these)
     "prefill_compute_ms": 61.0,         #   of prefill_ms, its own forwards (the rest:
                                         #   others' chunks)
     "decode_ms": 310.0,                 #   first token to last (in every record or none:
                                         #   the fit then counts decoding requests as
                                         #   sharing the host)
     "prefix_hashes": ["ab12", ...],     # optional: prompt block hashes, in order
     "block_size": 16}                   # optional: tokens per block (default 16)

Unknown keys are ignored (so the live cluster may log more: `estimated_ttft_ms`, its parts per
stage in `estimate_ms`, the chosen workers in `route`, and every phase of the measured TTFT
in `phases_ms`, as the response's `timings` name them); a line that is not valid
JSON or lacks / mistypes a field raises `WorkloadError` naming the file and line.

`fit_costs` fits the simulated stage costs to a trace's measured timings (`epd plan`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import numpy as np

from router.sim.cluster_model import SimCosts
from router.sim.variability import linear_fit
from router.sim.workload import MODALITIES, Workload, WorkloadError
from router.types import MediaJob, RequestProfile

_ITEM_FIELDS = {
    "identifier": str,
    "modality": str,
    "size": (int, float),
    "num_embeddings": int,
    "embedding_bytes": int,
}


def _fail(path, lineno: int, msg: str) -> WorkloadError:
    return WorkloadError(f"{path}:{lineno}: {msg}")


def _number(
    obj: dict, key: str, kind, path, lineno: int, *, required: bool = True, minimum: float = 0
):
    if key not in obj:
        if required:
            raise _fail(path, lineno, f"missing field {key!r}")
        return None
    v = obj[key]
    ok = isinstance(v, kind) and not isinstance(v, bool)
    if not ok or (isinstance(v, float) and not math.isfinite(v)) or v < minimum:
        want = "an integer" if kind is int else "a number"
        raise _fail(path, lineno, f"field {key!r} must be {want} >= {minimum}, got {v!r}")
    return v


def parse_trace_line(
    line: str, path="<trace>", lineno: int = 1
) -> tuple[float, RequestProfile, float | None]:
    """One JSONL line -> (arrival_s, profile, measured ttft_ms or None)."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise _fail(path, lineno, f"not valid JSON ({exc.msg} at column {exc.colno})") from None
    if not isinstance(obj, dict):
        raise _fail(path, lineno, f"expected a JSON object, got {type(obj).__name__}")
    arrival = float(_number(obj, "arrival_s", (int, float), path, lineno))
    tokens = _number(obj, "num_prompt_tokens", int, path, lineno, minimum=1)
    max_tokens = _number(obj, "max_tokens", int, path, lineno, minimum=1)
    ttft = _number(obj, "ttft_ms", (int, float), path, lineno, required=False)
    raw_items = obj.get("items", [])
    if not isinstance(raw_items, list):
        raise _fail(path, lineno, f"field 'items' must be a list, got {type(raw_items).__name__}")
    items = []
    for k, it in enumerate(raw_items):
        if not isinstance(it, dict):
            raise _fail(path, lineno, f"items[{k}] must be an object")
        for key, kind in _ITEM_FIELDS.items():
            if key not in it:
                raise _fail(path, lineno, f"items[{k}] lacks field {key!r}")
            if not isinstance(it[key], kind) or isinstance(it[key], bool):
                raise _fail(path, lineno, f"items[{k}].{key} has the wrong type: {it[key]!r}")
        if it["modality"] not in MODALITIES:
            raise _fail(
                path,
                lineno,
                f"items[{k}].modality {it['modality']!r} is not one of {list(MODALITIES)}",
            )
        if it["size"] < 0 or it["num_embeddings"] < 0 or it["embedding_bytes"] < 0:
            raise _fail(
                path, lineno, f"items[{k}] has a negative size, num_embeddings or embedding_bytes"
            )
        items.append(
            MediaJob(
                it["identifier"],
                it["modality"],
                float(it["size"]),
                it["num_embeddings"],
                it["embedding_bytes"],
            )
        )
    prefix = obj.get("prefix_hashes", [])
    if not isinstance(prefix, list) or not all(isinstance(h, str) for h in prefix):
        raise _fail(path, lineno, "field 'prefix_hashes' must be a list of strings")
    block_size = _number(obj, "block_size", int, path, lineno, required=False, minimum=1) or 16
    profile = RequestProfile(tokens, tuple(items), tuple(prefix), block_size, max_tokens)
    return arrival, profile, None if ttft is None else float(ttft)


def load_trace(path: str | Path) -> Workload:
    """Replay a JSONL trace recorded from the live cluster (schema: module docstring)."""
    path = Path(path)
    try:
        fh = path.open("r", encoding="utf-8")
    except OSError as exc:
        raise WorkloadError(f"cannot read workload file {path}: {exc.strerror or exc}") from None
    rows = []
    with fh:
        for lineno, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            rows.append(parse_trace_line(line, path, lineno))
    if not rows:
        raise WorkloadError(f"{path}: the trace holds no requests")
    rows.sort(key=lambda r: r[0])
    arrival = np.array([r[0] for r in rows])
    profiles = [r[1] for r in rows]
    ttfts = [r[2] for r in rows]
    measured = (
        np.array([np.nan if t is None else t for t in ttfts])
        if any(t is not None for t in ttfts)
        else None
    )
    return Workload(path.name, profiles, arrival, measured_ttft_ms=measured)


MEASURED_STAGES = (
    "encode_ms",
    "prefill_queue_ms",
    "prefill_ms",
    "prefill_compute_ms",
)  # optional measured timings of a trace record


def profile_to_record(
    arrival_s: float,
    profile: RequestProfile,
    ttft_ms: float | None = None,
    measured: dict[str, float] | None = None,
) -> dict:
    """The trace record of one request (what the live cluster should write per line);
    `measured`: its stage timings (MEASURED_STAGES), which variability fits need."""
    rec = {
        "arrival_s": round(float(arrival_s), 6),
        "num_prompt_tokens": profile.num_prompt_tokens,
        "max_tokens": profile.max_tokens,
        "items": [
            {
                "identifier": it.identifier,
                "modality": it.modality,
                "size": it.size,
                "num_embeddings": it.num_embeddings,
                "embedding_bytes": it.embedding_bytes,
            }
            for it in profile.items
        ],
    }
    if profile.prefix_hashes:
        rec["prefix_hashes"] = list(profile.prefix_hashes)
        rec["block_size"] = profile.block_size
    if ttft_ms is not None and math.isfinite(ttft_ms):
        rec["ttft_ms"] = round(float(ttft_ms), 3)
    for key, value in (measured or {}).items():
        if value is not None and math.isfinite(value):
            rec[key] = round(float(value), 3)
    return rec


def write_trace(
    path: str | Path, workload: Workload, ttft_ms: Sequence[float] | None = None
) -> None:
    """Write `workload` (optionally with TTFTs, e.g. simulated ones) as a JSONL trace."""
    with Path(path).open("w", encoding="utf-8") as fh:
        for i, (t, prof) in enumerate(workload.iter_requests()):
            rec = profile_to_record(t, prof, None if ttft_ms is None else ttft_ms[i])
            fh.write(json.dumps(rec, separators=(",", ":")) + "\n")


def fit_costs(path: str | Path, costs: SimCosts) -> tuple[SimCosts, dict]:
    """`costs` with a live trace's measured stage times fitted in (fixed + per unit, least
    squares; the format: module doc): prefill from its own compute time
    (prefill_compute_ms, else prefill_ms) per prompt token; each modality's encode from the
    encode_ms of requests with items of that modality only (queue included: an upper bound at
    load). A stage with under 3 timed records keeps `costs`. Returns (costs, what was fitted)."""
    records = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    fitted: dict = {}
    timed = [r for r in records if (r.get("prefill_compute_ms") or r.get("prefill_ms") or 0) > 0]
    if len(timed) >= 3:
        x = np.array([r["num_prompt_tokens"] for r in timed], dtype=float)
        y = np.array([r.get("prefill_compute_ms") or r["prefill_ms"] for r in timed], dtype=float)
        fixed, per_token = linear_fit(x, y)
        if per_token > 0:
            costs = replace(costs, prefill_fixed_ms=fixed, prefill_tokens_per_ms=1.0 / per_token)
            fitted["prefill"] = {"fixed_ms": round(fixed, 3), "tokens_per_ms": 1.0 / per_token}
            fitted["prefill"] |= {"records": len(timed)}
    encode = dict(costs.encode)
    for mod in encode:
        mine = [
            r
            for r in records
            if r.get("items") and {it["modality"] for it in r["items"]} == {mod}
            if r.get("encode_ms", 0) > 0
        ]
        if len(mine) >= 3:
            x = np.array([sum(it["size"] for it in r["items"]) for r in mine], dtype=float)
            fixed, per_unit = linear_fit(x, np.array([r["encode_ms"] for r in mine], dtype=float))
            encode[mod] = replace(encode[mod], fixed_ms=fixed, per_unit_ms=per_unit)
            fitted[f"encode:{mod}"] = {"fixed_ms": round(fixed, 3), "per_unit_ms": per_unit}
            fitted[f"encode:{mod}"] |= {"records": len(mine)}
    return replace(costs, encode=encode), fitted
