"""Router decision time: p50 / p99 of Router.route() per policy and cluster shape.

    # 16x16x16 and 256x256x256, every policy:
    .venv/bin/python scripts/bench_router.py
    .venv/bin/python scripts/bench_router.py --decisions 5000 --json out.json
    # encoders split by tower, some image + audio requests:
    .venv/bin/python scripts/bench_router.py --split

Columns: wall-clock p50 / p99 / mean / max, and CPU-time p50 / p99 (the thread's own CPU time,
which a busy machine inflates less). Requests are a seeded mix (text, one image, four images,
video, audio, with repeated media and shared system prompts); workers publish their caches every
500 requests, completions come back in FIFO order with timings that calibrate the cost model, so
the view, the caches and the fits are all live while route() is timed. Only route() itself is
inside the timer.
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import statistics
import sys
import time
from pathlib import Path

from tqdm import tqdm

from router.cost_model import CostPriors
from router.policies import POLICIES
from router.router import Router
from router.types import MediaJob, RequestProfile, RouteDecision, WorkerInfo, WorkerKind

E, P, D = WorkerKind.ENCODER, WorkerKind.PREFILL, WorkerKind.DECODE


PER_NODE = 2  # workers of each kind per node
# (modality, size, embeddings, how many) per request class, and the class mix
CLASSES = {
    "text": (None, 0, 0, 0),
    "image": ("image", 0.113, 576, 1),
    "images4": ("image", 0.113, 576, 4),
    "video": ("video", 30, 17_280, 1),
    "audio": ("audio", 30, 1_500, 1),
}
MIX = {"text": 0.3, "image": 0.4, "images4": 0.1, "video": 0.1, "audio": 0.1}
SPLIT_MIX = {
    "text": 0.3,
    "image": 0.3,
    "images4": 0.1,
    "video": 0.1,
    "audio": 0.1,
    "image+audio": 0.1,
}
BYTES_PER_EMBEDDING = 4096 * 2


def fleet(n: int, split: bool = False) -> list[WorkerInfo]:
    """n of each kind, PER_NODE per node; every 4th encoder has no audio tower (split: hosts only
    the audio tower, the others only the vision tower, so image + audio requests are split)."""
    vision, audio = frozenset({"image", "video"}), frozenset({"audio"})
    out = []
    for kind in WorkerKind:
        for i in range(n):
            if kind is not E:
                mods = frozenset()
            elif split:
                mods = audio if i % 4 == 3 else vision
            else:
                mods = vision if i % 4 == 3 else vision | audio
            out.append(WorkerInfo(kind, i, node=f"node-{i // PER_NODE}", modalities=mods))
    return out


class Workload:
    """Seeded request profiles with repeated media and shared system prompts."""

    def __init__(self, seed: int, mix: dict[str, float] = MIX):
        self.rng = random.Random(seed)
        self.mix = mix
        self.recent: dict[str, collections.deque] = collections.defaultdict(
            lambda: collections.deque(maxlen=200)
        )
        self.prompts = [
            tuple(f"sys{k}-{b}" for b in range(self.rng.randint(16, 64))) for k in range(8)
        ]
        self.count = 0

    def _items(self, cls: str) -> tuple[MediaJob, ...]:
        modality, size, n_emb, n = CLASSES[cls]
        items = []
        for _ in range(n):
            pool = self.recent[modality]
            if pool and self.rng.random() < 0.3:
                identifier = self.rng.choice(pool)
            else:
                identifier = f"{modality}-{self.count}-{len(items)}"
                pool.append(identifier)
            items.append(MediaJob(identifier, modality, size, n_emb, n_emb * BYTES_PER_EMBEDDING))
        return tuple(items)

    def next(self) -> RequestProfile:
        self.count += 1
        cls = self.rng.choices(list(self.mix), weights=list(self.mix.values()))[0]
        items = sum((self._items(part) for part in cls.split("+")), ())
        tokens = 1000 + sum(item.num_embeddings for item in items)
        shared = self.rng.choice(self.prompts) if self.rng.random() < 0.5 else ()
        own = tuple(f"r{self.count}-{b}" for b in range(tokens // 16 - len(shared)))
        return RequestProfile(tokens, items, shared + own, 16, 64)


def publish_all(
    router: Router, now_s: float, sent: dict[int, set[str]], prefixes: dict[int, set[str]]
) -> None:
    for e, ids in sent.items():
        router.publish(E, e, now_s=now_s, cached_identifiers=frozenset(ids))
    for p, hashes in prefixes.items():
        router.publish(P, p, now_s=now_s, prefix_hashes=frozenset(hashes))


def complete(router: Router, decision: RouteDecision, now_s: float, rng: random.Random) -> None:
    """Report the stages done with the estimate x noise as the 'measured' compute time."""
    router.encode_done(decision, now_s, decision.estimate.encode_ms * rng.uniform(0.8, 1.25))
    router.prefill_done(decision, now_s, decision.estimate.prefill_ms * rng.uniform(0.8, 1.25))
    router.decode_done(decision, now_s)


def bench(
    n: int,
    policy: str,
    decisions: int,
    warmup: int,
    seed: int,
    bar: tqdm,
    split: bool = False,
    chunk_tokens: int = 0,
) -> tuple[list[float], list[float]]:
    """Wall-clock and this thread's CPU time of each timed route() call, in microseconds."""
    router = Router(
        fleet(n, split), CostPriors(), policy, seed=seed, prefill_chunk_tokens=chunk_tokens
    )
    work, rng = Workload(seed, SPLIT_MIX if split else MIX), random.Random(seed)
    in_flight: collections.deque = collections.deque()
    sent: dict[int, set[str]] = collections.defaultdict(set)
    prefixes: dict[int, set[str]] = collections.defaultdict(set)
    wall_us: list[float] = []
    cpu_us: list[float] = []
    for k in range(warmup + decisions):
        now_s = k * 1e-3  # 1,000 requests per second
        if k % 500 == 0:
            publish_all(router, now_s, sent, prefixes)
        profile = work.next()
        c0, t0 = time.thread_time_ns(), time.perf_counter_ns()
        decision = router.route(profile, now_s)
        t1, c1 = time.perf_counter_ns(), time.thread_time_ns()
        if k >= warmup:
            wall_us.append((t1 - t0) / 1e3)
            cpu_us.append((c1 - c0) / 1e3)
        for item in profile.items:
            sent[decision.encoder_for(item.modality)].add(item.identifier)
        prefixes[decision.prefill].update(h for h in profile.prefix_hashes if h.startswith("sys"))
        in_flight.append(decision)
        if len(in_flight) > 4 * n:
            complete(router, in_flight.popleft(), now_s, rng)
        bar.update()
    return wall_us, cpu_us


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--shapes",
        type=int,
        nargs="+",
        default=[16, 256],
        help="workers of each kind (N means NxNxN)",
    )
    parser.add_argument("--policies", nargs="+", default=sorted(POLICIES), choices=sorted(POLICIES))
    parser.add_argument(
        "--decisions", type=int, default=20_000, help="timed decisions per (shape, policy)"
    )
    parser.add_argument("--warmup", type=int, default=2_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--split",
        action="store_true",
        help=(
            "encoders split by tower (every 4th audio only, the rest image + video) "
            "and 10%% image + audio requests"
        ),
    )
    parser.add_argument(
        "--prefill-chunk-tokens",
        type=int,
        default=0,
        help="the prefill workers' chunk, as the live router gets it (0: a prompt in one go; "
        "with chunks, queues are priced by shortest first: router/prefill_wait.py)",
    )
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    rows = []
    total = len(args.shapes) * len(args.policies) * (args.decisions + args.warmup)
    with tqdm(total=total, desc="route() calls", unit="call") as bar:
        for n in args.shapes:
            for policy in args.policies:
                wall, cpu = bench(
                    n,
                    policy,
                    args.decisions,
                    args.warmup,
                    args.seed,
                    bar,
                    args.split,
                    args.prefill_chunk_tokens,
                )
                rows.append(
                    {
                        "shape": f"{n}x{n}x{n}" + ("-split" if args.split else ""),
                        "policy": policy,
                        "decisions": len(wall),
                        "p50_us": round(percentile(wall, 0.5), 1),
                        "p99_us": round(percentile(wall, 0.99), 1),
                        "mean_us": round(statistics.fmean(wall), 1),
                        "max_us": round(max(wall), 1),
                        "cpu_p50_us": round(percentile(cpu, 0.5), 1),
                        "cpu_p99_us": round(percentile(cpu, 0.99), 1),
                    }
                )
    columns = {
        "p50_us": "p50 us",
        "p99_us": "p99 us",
        "mean_us": "mean us",
        "max_us": "max us",
        "cpu_p50_us": "cpu p50",
        "cpu_p99_us": "cpu p99",
    }
    print(f"\n{'shape':<18}{'policy':<14}" + "".join(f"{title:>9}" for title in columns.values()))
    for row in rows:
        print(
            f"{row['shape']:<18}{row['policy']:<14}" + "".join(f"{row[key]:>9}" for key in columns)
        )
    print(
        "wall: perf_counter around route(); "
        "cpu: this thread's CPU time (excludes time the OS ran other processes)"
    )
    if args.json:
        args.json.write_text(
            json.dumps({"python": sys.version.split()[0], "results": rows}, indent=2)
        )


if __name__ == "__main__":
    main()
