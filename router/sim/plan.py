"""Capacity planning with the simulator: the cheapest E:P:D shape (numbers of encoder, prefill
and decode workers) whose simulated TTFT at a percentile meets an SLO at a request rate.

Owns the search (`Planner`), what it finds (`Plan`, `Outcome`) and the bounds the cost model
gives (`min_shape`, `ttft_floor_ms`). `epd plan` (router/sim/cli.py) is its command line; it
calibrates the costs from a live trace with `trace_file.fit_costs`.

Every shape is simulated once (cached) on the same requests (a fixed number, one seed):

1. start from the fewest workers per stage that keep up with the rate by the cost model's
   per-item costs (utilisation 1, encoders at their best batching): below it a stage falls behind;
2. grow while the shape misses: decode by one while its pool keeps requests waiting for a slot;
   encoders or prefill by one, whichever lowers the TTFT percentile most per unit of price;
3. trim: take a worker off a stage (dearest first) while the shape still meets the target.

The plan meets the target and each shape one worker smaller misses it (a local minimum of cost;
cheaper shapes farther away are not searched). TTFT ends with the first token, which decode never
delays, so the decode pool has a target of its own: at the percentile, a request's KV waits at
most `decode_wait_ms` for a decode slot (its stream stalls that long after the first token).
Each run starts with empty queues: near a stage's capacity a longer run (more requests) may queue
more, so a plan close to capacity is worth checking with more requests.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from router.sim.cluster_model import SimCluster, SimCosts
from router.sim.loop import simulate
from router.sim.workload import Workload
from router.types import RequestProfile

STAGES = ("encoders", "prefill", "decode")
PERCENTILES = (50.0, 90.0, 99.0)
MIN_GAIN = 2e-3  # growth stops when a worker more lowers the TTFT percentile by less (a fraction)


class NoShape(Exception):
    """No shape within the bounds meets the target; `closest`: the best shape tried, if any."""

    def __init__(self, message: str, closest: Outcome | None = None):
        super().__init__(message)
        self.closest = closest


@dataclass(frozen=True)
class Shape:
    encoders: int
    prefill: int
    decode: int

    def cost(self, prices: Mapping[str, float]) -> float:
        return sum(getattr(self, s) * prices[s] for s in STAGES)

    def add(self, stage: str, n: int = 1) -> Shape:
        return replace(self, **{stage: getattr(self, stage) + n})

    def __str__(self) -> str:
        return f"{self.encoders}:{self.prefill}:{self.decode}"


@dataclass(frozen=True)
class Target:
    slo_ms: float
    percentile: float = 99.0
    decode_wait_ms: float = 100.0


@dataclass(frozen=True)
class Outcome:
    """One simulated shape held to a target."""

    shape: Shape
    cost: float
    ttft_ms: dict[str, float]  # p50, p90, p99 and the target's percentile
    ttft_at_ms: float  # TTFT at the target's percentile
    decode_wait_ms: float  # wait for a decode slot at the target's percentile
    utilisation: dict[str, float]
    target: Target

    @property
    def ttft_ok(self) -> bool:
        return self.ttft_at_ms <= self.target.slo_ms

    @property
    def decode_ok(self) -> bool:
        return self.decode_wait_ms <= self.target.decode_wait_ms

    @property
    def meets(self) -> bool:
        return self.ttft_ok and self.decode_ok

    def misses(self) -> list[str]:
        p, t = pkey(self.target.percentile), self.target
        out = [] if self.ttft_ok else [f"TTFT {p} {self.ttft_at_ms:.0f} ms > {t.slo_ms:g} ms"]
        if not self.decode_ok:
            out.append(f"decode wait {p} {self.decode_wait_ms:.0f} ms > {t.decode_wait_ms:g} ms")
        return out

    def to_dict(self) -> dict:
        return {
            **{s: getattr(self.shape, s) for s in STAGES},
            "cost": self.cost,
            "ttft_ms": self.ttft_ms,
            "decode_wait_ms": round(self.decode_wait_ms, 1),
            "utilisation": self.utilisation,
            "meets": self.meets,
            "misses": self.misses(),
        }


@dataclass
class Plan:
    best: Outcome
    cheaper: list[Outcome]  # one worker fewer in one stage: each misses the target
    rate_rps: float
    simulations: int
    extra: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        t = self.best.target
        return {
            **self.best.to_dict(),
            "rate_rps": self.rate_rps,
            "slo_ms": t.slo_ms,
            "percentile": t.percentile,
            "decode_wait_slo_ms": t.decode_wait_ms,
            "cheaper_misses": [o.to_dict() for o in self.cheaper],
            "simulations": self.simulations,
            **self.extra,
        }


def pkey(percentile: float) -> str:
    return f"p{percentile:g}"


def _uncached_tokens(p: RequestProfile) -> int:
    """The fewest prompt tokens a prefill of p may compute (its listed blocks all cached)."""
    return max(p.num_prompt_tokens - len(p.prefix_hashes) * p.block_size, 1)


def min_shape(costs: SimCosts, profiles: Sequence[RequestProfile], rate_rps: float) -> Shape:
    """The fewest workers per stage that keep up with `rate_rps` by the cost model: a stage's
    mean work per request times the rate, over one worker's time, must stay below 1 (encoders
    at their best batching, prefill with every listed prefix block cached, decode at full batch).
    """
    n, b = len(profiles), costs.encode_max_batch
    encode = sum(
        costs.encode[it.modality].batch_ms(it.size * b, b) / b for p in profiles for it in p.items
    )
    prefill = sum(costs.prefill_ms(_uncached_tokens(p)) for p in profiles)
    step = costs.decode_step_ms + costs.decode_step_per_seq_ms * costs.decode_max_batch
    decode = sum(p.max_tokens for p in profiles) * step / costs.decode_max_batch

    def need(total_ms: float) -> int:
        return math.floor(rate_rps * total_ms / n / 1000.0) + 1 if total_ms > 0 else 0

    return Shape(need(encode), max(1, need(prefill)), max(1, need(decode)))


def ttft_floor_ms(costs: SimCosts, profiles: Sequence[RequestProfile], percentile: float) -> float:
    """TTFT at `percentile` with no queue anywhere and all media cached: the prefill alone."""
    return float(
        np.percentile([costs.prefill_ms(_uncached_tokens(p)) for p in profiles], percentile)
    )


@dataclass(frozen=True)
class _Stats:
    ttft_ms: np.ndarray
    decode_wait_ms: np.ndarray
    utilisation: dict[str, float]


class Planner:
    """Shapes simulated on one workload at one rate (each once); `search(target)` plans."""

    def __init__(
        self,
        workload: Workload,
        rate_rps: float,
        *,
        costs: SimCosts | None = None,
        prices: Mapping[str, float] | None = None,
        seed: int = 0,
        max_workers: int = 32,
        policy: str = "joint",
        progress: bool = False,
    ):
        self.workload = workload.at_rate(rate_rps)
        self.rate_rps, self.seed, self.policy = rate_rps, seed, policy
        self.costs = costs or SimCosts()
        self.prices = {s: 1.0 for s in STAGES} | dict(prices or {})
        if any(not (0 < p < math.inf) for p in self.prices.values()):
            raise ValueError(f"prices must be positive numbers, got {self.prices}")
        self.max_workers = max_workers
        self.fewest = Shape(1 if workload.modalities() else 0, 1, 1)
        self.profiles = self.workload.sample()
        self.cache: dict[Shape, _Stats] = {}
        self.bar = _bar(rate_rps) if progress else None

    def stats(self, shape: Shape) -> _Stats:
        if shape not in self.cache:
            cluster = SimCluster.build(*(getattr(shape, s) for s in STAGES), costs=self.costs)
            r = simulate(cluster, self.workload, self.policy, seed=self.seed)
            self.cache[shape] = _Stats(r.ttft_ms, r.decode_wait_ms, r.utilisation)
            if self.bar is not None:
                self.bar.set_postfix_str(f"{shape} p99 {np.percentile(r.ttft_ms, 99):.0f} ms")
                self.bar.update(1)
        return self.cache[shape]

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()

    def evaluate(self, shape: Shape, target: Target) -> Outcome:
        s = self.stats(shape)
        qs = sorted({*PERCENTILES, float(target.percentile)})
        ttft = dict(zip(map(pkey, qs), np.percentile(s.ttft_ms, qs).round(1).tolist()))
        return Outcome(
            shape,
            round(shape.cost(self.prices), 6),
            ttft,
            float(np.percentile(s.ttft_ms, target.percentile)),
            float(np.percentile(s.decode_wait_ms, target.percentile)),
            {k: round(v, 3) for k, v in s.utilisation.items()},
            target,
        )

    def search(self, target: Target) -> Plan:
        """The cheapest shape found that meets `target` (module doc); NoShape if none can."""
        floor = ttft_floor_ms(self.costs, self.profiles, target.percentile)
        if floor > target.slo_ms:
            raise NoShape(
                f"no shape meets TTFT {pkey(target.percentile)} <= {target.slo_ms:g} ms: the "
                f"prefill alone, with no queue, takes {floor:.0f} ms at that percentile"
            )
        start = min_shape(self.costs, self.profiles, self.rate_rps)
        start = Shape(*(max(getattr(start, s), getattr(self.fewest, s)) for s in STAGES))
        best = self._trim(self._grow(start, target))
        cheaper = [self.evaluate(best.shape.add(s, -1), target) for s in self._removable(best)]
        return Plan(best, sorted(cheaper, key=lambda o: o.cost), self.rate_rps, len(self.cache))

    def _within(self, shape: Shape) -> bool:
        return all(getattr(shape, s) <= self.max_workers for s in STAGES)

    def _grow(self, shape: Shape, target: Target) -> Outcome:
        if not self._within(shape):
            raise NoShape(
                f"{self.rate_rps:g} req/s needs at least {shape} (E:P:D) by the cost model, "
                f"over --max-workers {self.max_workers} per stage"
            )
        cur = self.evaluate(shape, target)
        while not cur.meets:
            cur = self._step(cur, target)
        return cur

    def _step(self, cur: Outcome, target: Target) -> Outcome:
        """The next shape while `cur` misses (module doc, 2.)."""
        shape = cur.shape.add("decode") if not cur.decode_ok else cur.shape
        options = [shape]
        if not cur.ttft_ok:
            stages = ("encoders", "prefill") if self.fewest.encoders else ("prefill",)
            options = [shape.add(s) for s in stages]
        options = [o for o in options if self._within(o)]
        if not options:
            raise NoShape(self._none_within(target), cur)
        tried = [self.evaluate(o, target) for o in options]
        lower = [cur.ttft_at_ms - o.ttft_at_ms for o in tried]
        if cur.ttft_ok or max(lower) > MIN_GAIN * cur.ttft_at_ms:
            return tried[int(np.argmax([x / (o.cost - cur.cost) for x, o in zip(lower, tried)]))]
        raise NoShape(
            self._none_within(target) + f": adding a worker to {cur.shape} no longer lowers TTFT "
            f"{pkey(target.percentile)} ({cur.ttft_at_ms:.0f} ms)",
            cur,
        )

    def _none_within(self, target: Target) -> str:
        return (
            f"no shape of at most {self.max_workers} workers per stage meets TTFT "
            f"{pkey(target.percentile)} <= {target.slo_ms:g} ms (and decode-slot wait <= "
            f"{target.decode_wait_ms:g} ms) at {self.rate_rps:g} req/s"
        )

    def _removable(self, best: Outcome) -> list[str]:
        return [s for s in STAGES if getattr(best.shape, s) > getattr(self.fewest, s)]

    def _trim(self, best: Outcome) -> Outcome:
        """Fewer workers while the target still holds, the dearest stage first (module doc, 3.)."""
        changed = True
        while changed:
            changed = False
            for stage in sorted(self._removable(best), key=lambda s: -self.prices[s]):
                while getattr(best.shape, stage) > getattr(self.fewest, stage):
                    smaller = self.evaluate(best.shape.add(stage, -1), best.target)
                    if not smaller.meets:
                        break
                    best, changed = smaller, True
        return best


def _bar(rate_rps: float):
    from tqdm import tqdm

    return tqdm(desc=f"plan {rate_rps:g} req/s", unit="sim", disable=None, leave=False)
