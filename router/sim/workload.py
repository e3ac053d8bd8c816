"""Workloads for the simulator: synthetic (Poisson / bursty) and recorded traces.

A `Workload` is a sequence of requests, each an arrival time (seconds) and the
`RequestProfile` the router sees. Synthetic workloads are generated with numpy from a
seed (same seed -> same requests) and build their profiles lazily, so a million
requests cost a few arrays, not a million objects held at once.

Request classes (the seed encoding-cost table; sizes in the cost model's units):

    text      1,000 text tokens, no media
    image     one 336x336 image   (0.113 MP, 576 embeddings; ~5 ms to encode alone)
    images4   four 336x336 images (2,304 embeddings; ~12 ms encoded as one batch)
    video     30 frames           (17,280 embeddings; ~48 ms)
    audio     30 s of audio       (1,500 embeddings; ~85 ms)

Every media request also carries the 1,000 text tokens, and `num_prompt_tokens`
counts the expanded prompt (text + one token per embedding), as the prompt plan does.

Repeated media: with probability `repeat_rate` a media request reuses the item(s) of a
recent request of its class (uniform over the last `repeat_pool` distinct ones), so
encoder caches and cache-aware routing have something to find.

Shared prefixes (optional): with probability `prefix_share` a request starts with one
of `num_prefixes` shared system prompts of `prefix_tokens` tokens; its
`prefix_hashes` then lists that prompt's block hashes. The request's own (unique)
blocks are not listed: they could never match another request, so leaving them out
changes no overlap count and saves a million tuples.

Recorded traces are read and written by router/sim/trace_file.py.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from router.types import MediaJob, Modality, RequestProfile

MODALITIES = tuple(m.value for m in Modality)


class WorkloadError(ValueError):
    """A workload that cannot be built or a trace that does not parse."""


@dataclass(frozen=True)
class RequestClass:
    name: str
    text_tokens: int
    modality: str | None = None
    num_items: int = 0
    item_size: float = 0.0  # per item, in the modality's cost unit
    embeddings_per_item: int = 0

    @property
    def num_prompt_tokens(self) -> int:
        return self.text_tokens + self.num_items * self.embeddings_per_item


_MP_336 = 336 * 336 / 1e6  # 0.112896 megapixels

REQUEST_CLASSES: dict[str, RequestClass] = {
    c.name: c
    for c in (
        RequestClass("text", 1000),
        RequestClass("image", 1000, Modality.IMAGE.value, 1, _MP_336, 576),
        RequestClass("images4", 1000, Modality.IMAGE.value, 4, _MP_336, 576),
        RequestClass("video", 1000, Modality.VIDEO.value, 1, 30.0, 17_280),
        RequestClass("audio", 1000, Modality.AUDIO.value, 1, 30.0, 1_500),
    )
}

# The default ("seed") mix: mostly text and single images, a tail of heavy video.
DEFAULT_MIX: dict[str, float] = {
    "text": 0.30,
    "image": 0.30,
    "images4": 0.15,
    "video": 0.10,
    "audio": 0.15,
}

# d_model 4096 in fp16: 8 KiB per embedding (the seed tables' convention).
DEFAULT_EMBEDDING_BYTES = 4096 * 2


@dataclass(frozen=True)
class BurstSpec:
    """On/off modulated Poisson: ON periods at `on_mult` x the mean rate, OFF periods at
    the rate that keeps the long-run mean; period lengths are exponential (seconds)."""

    on_s: float = 1.0
    off_s: float = 4.0
    on_mult: float = 2.5

    @property
    def on_fraction(self) -> float:
        return self.on_s / (self.on_s + self.off_s)

    @property
    def off_mult(self) -> float:
        return (1.0 - self.on_fraction * self.on_mult) / (1.0 - self.on_fraction)

    def validate(self) -> None:
        if self.on_s <= 0 or self.off_s <= 0 or self.on_mult < 1.0:
            raise WorkloadError(f"bad burst spec {self}: need on_s, off_s > 0 and on_mult >= 1")
        if self.on_fraction * self.on_mult > 1.0 + 1e-12:
            raise WorkloadError(
                f"bad burst spec {self}: ON periods alone exceed the mean rate "
                f"(on_mult x on fraction = {self.on_fraction * self.on_mult:.2f} > 1)"
            )


# ----------------------------------------------------------------------------- profiles


class SyntheticProfiles(Sequence):
    """Lazily built profiles of a synthetic workload (index -> RequestProfile)."""

    def __init__(
        self,
        classes: list[RequestClass],
        cls_idx: np.ndarray,
        media_id: np.ndarray,
        max_tokens: np.ndarray,
        prefix_idx: np.ndarray,
        prefixes: list[tuple[str, ...]],
        *,
        tag: str,
        embedding_bytes: int,
        block_size: int,
    ):
        self.classes = classes
        self.cls_idx = cls_idx
        self.media_id = media_id
        self.max_tokens = max_tokens
        self.prefix_idx = prefix_idx
        self.prefixes = prefixes
        self.tag = tag
        self.embedding_bytes = embedding_bytes
        self.block_size = block_size

    def __len__(self) -> int:
        return len(self.cls_idx)

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if i < 0:
            i += len(self)
        return next(self.iter_range(i, i + 1))

    def __iter__(self) -> Iterator[RequestProfile]:
        return self.iter_range(0, len(self))

    def take(self, indices: np.ndarray) -> SyntheticProfiles:
        """The profiles at `indices` (an index array), still lazy."""
        return SyntheticProfiles(
            self.classes,
            self.cls_idx[indices],
            self.media_id[indices],
            self.max_tokens[indices],
            self.prefix_idx[indices],
            self.prefixes,
            tag=self.tag,
            embedding_bytes=self.embedding_bytes,
            block_size=self.block_size,
        )

    def iter_range(self, start: int, stop: int) -> Iterator[RequestProfile]:
        """The fast path the engine uses: one profile per request, built on the fly."""
        classes = self.classes
        tokens = [c.num_prompt_tokens for c in classes]
        nitems = [c.num_items for c in classes]
        names = [f"{self.tag}{c.name}-" for c in classes]
        mods = [c.modality for c in classes]
        sizes = [c.item_size for c in classes]
        embs = [c.embeddings_per_item for c in classes]
        ebytes = [c.embeddings_per_item * self.embedding_bytes for c in classes]
        prefixes = self.prefixes
        bs = self.block_size
        empty: tuple[MediaJob, ...] = ()
        no_prefix: tuple[str, ...] = ()
        RP, MJ = RequestProfile.of, MediaJob.of
        for c, mid, mt, px in zip(
            self.cls_idx[start:stop].tolist(),
            self.media_id[start:stop].tolist(),
            self.max_tokens[start:stop].tolist(),
            self.prefix_idx[start:stop].tolist(),
        ):
            k = nitems[c]
            if k == 0:
                items = empty
            elif k == 1:
                items = (MJ(f"{names[c]}{mid}", mods[c], sizes[c], embs[c], ebytes[c]),)
            else:
                name, mod, size, e, eb = f"{names[c]}{mid}.", mods[c], sizes[c], embs[c], ebytes[c]
                items = tuple([MJ(f"{name}{j}", mod, size, e, eb) for j in range(k)])
            yield RP(tokens[c], items, prefixes[px] if px >= 0 else no_prefix, bs, mt)


# ----------------------------------------------------------------------------- workload


class Workload:
    """Requests in arrival order: `arrival_s[i]` and `profiles[i]`."""

    def __init__(
        self,
        name: str,
        profiles: Sequence[RequestProfile],
        arrival_s: np.ndarray,
        *,
        measured_ttft_ms: np.ndarray | None = None,
        units: np.ndarray | None = None,
        burst: BurstSpec | None = None,
        burst_seed: int = 0,
        rate_rps: float | None = None,
        mix: dict[str, float] | None = None,
    ):
        if len(profiles) != len(arrival_s):
            raise WorkloadError(
                f"{name}: {len(profiles)} profiles but {len(arrival_s)} arrival times"
            )
        self.name = name
        self.profiles = profiles
        self.arrival_s = np.asarray(arrival_s, dtype=np.float64)
        self.measured_ttft_ms = measured_ttft_ms
        self.mix = mix
        self._units = units  # unit-rate arrival "times" (synthetic workloads)
        self._burst = burst
        self._burst_seed = burst_seed
        self._rate = rate_rps

    def __len__(self) -> int:
        return len(self.arrival_s)

    @property
    def rate_rps(self) -> float:
        """Offered load: the generation rate, or requests / span for a trace."""
        if self._rate is not None:
            return self._rate
        n = len(self)
        span = float(self.arrival_s[-1] - self.arrival_s[0]) if n > 1 else 0.0
        return (n - 1) / span if span > 0 else float("inf")

    def at_rate(self, rps: float) -> Workload:
        """The same requests offered at `rps` requests/s (a trace is time-scaled)."""
        if not (rps > 0 and math.isfinite(rps)):
            raise WorkloadError(f"request rate must be a positive number, got {rps!r}")
        if self._units is not None:
            arrival = _retime(self._units, rps, self._burst, self._burst_seed)
        else:
            native = self.rate_rps
            if not math.isfinite(native):
                arrival = self.arrival_s.copy()
            else:
                t0 = self.arrival_s[0] if len(self) else 0.0
                arrival = (self.arrival_s - t0) * (native / rps)
        # measured TTFTs only describe the recorded pace: drop them once the trace is retimed
        return Workload(
            self.name,
            self.profiles,
            arrival,
            measured_ttft_ms=None,
            units=self._units,
            burst=self._burst,
            burst_seed=self._burst_seed,
            rate_rps=rps,
            mix=self.mix,
        )

    def head(self, n: int) -> Workload:
        """The first n requests (for quick runs)."""
        n = min(n, len(self))
        sub = _head_profiles(self.profiles, n)
        return Workload(
            self.name,
            sub,
            self.arrival_s[:n],
            measured_ttft_ms=None if self.measured_ttft_ms is None else self.measured_ttft_ms[:n],
            units=None if self._units is None else self._units[:n],
            burst=self._burst,
            burst_seed=self._burst_seed,
            rate_rps=self._rate,
            mix=self.mix,
        )

    def iter_requests(self) -> Iterator[tuple[float, RequestProfile]]:
        return zip(self.arrival_s.tolist(), iter(self.profiles))

    def modalities(self) -> frozenset[str]:
        """Modalities some request needs."""
        p = self.profiles
        if isinstance(p, SyntheticProfiles):
            present = np.unique(p.cls_idx).tolist()
            return frozenset(p.classes[c].modality for c in present if p.classes[c].modality)
        out: set[str] = set()
        for prof in p:
            for item in prof.items:
                out.add(item.modality)
        return frozenset(out)

    def sample(self, k: int = 20_000) -> list[RequestProfile]:
        """Up to k profiles spread evenly over the workload (for demand estimates)."""
        n = len(self)
        if n <= k:
            return list(self.profiles)
        idx = (np.arange(k) * (n / k)).astype(np.int64)
        if isinstance(self.profiles, SyntheticProfiles):
            return list(self.profiles.take(idx))
        return [self.profiles[i] for i in idx.tolist()]


def _head_profiles(profiles: Sequence[RequestProfile], n: int) -> Sequence[RequestProfile]:
    if isinstance(profiles, SyntheticProfiles):
        return profiles.take(slice(0, n))
    return list(profiles[:n])


def _retime(units: np.ndarray, rps: float, burst: BurstSpec | None, seed: int) -> np.ndarray:
    """Map unit-rate arrival points to seconds at mean rate `rps` (time change of a
    Poisson process: Lambda(t) = rps * integral of the rate multiplier)."""
    if burst is None or len(units) == 0:
        return units / rps
    rng = np.random.default_rng([seed, 0xB0B])
    need = float(units[-1])
    mults: list[np.ndarray] = []
    durs: list[np.ndarray] = []
    total = 0.0
    block = 1024
    while total < need:
        d = np.empty(block)
        d[0::2] = rng.exponential(burst.on_s, block // 2)
        d[1::2] = rng.exponential(burst.off_s, block // 2)
        m = np.empty(block)
        m[0::2] = burst.on_mult
        m[1::2] = burst.off_mult
        durs.append(d)
        mults.append(m)
        total += float((d * m).sum() * rps)
    dur = np.concatenate(durs)
    mult = np.concatenate(mults)
    lam_end = np.cumsum(dur * mult * rps)
    t_end = np.cumsum(dur)
    k = np.minimum(np.searchsorted(lam_end, units, side="left"), len(lam_end) - 1)
    lam_start = lam_end[k] - dur[k] * mult[k] * rps
    t_start = t_end[k] - dur[k]
    return t_start + (units - lam_start) / (mult[k] * rps)


def make_workload(
    kind: str,
    n: int,
    *,
    rate_rps: float = 1.0,
    mix: dict[str, float] | None = None,
    seed: int = 0,
    repeat_rate: float = 0.2,
    repeat_pool: int = 256,
    max_tokens: tuple[int, int] = (32, 256),
    prefix_share: float = 0.0,
    num_prefixes: int = 8,
    prefix_tokens: int = 512,
    block_size: int = 16,
    burst: BurstSpec | None = None,
    embedding_bytes: int = DEFAULT_EMBEDDING_BYTES,
) -> Workload:
    """A synthetic workload of `n` requests: `kind` is "poisson" or "bursty" (on/off
    modulated Poisson, `burst` or BurstSpec() by default), offered at `rate_rps`
    (change with `.at_rate`). `mix` weighs REQUEST_CLASSES (normalised)."""
    if kind not in ("poisson", "bursty"):
        raise WorkloadError(
            f"unknown synthetic workload {kind!r}; known: 'poisson', 'bursty' (or a .jsonl trace)"
        )
    if n < 1:
        raise WorkloadError(f"need at least one request, got {n}")
    mix = dict(DEFAULT_MIX if mix is None else mix)
    unknown = sorted(set(mix) - set(REQUEST_CLASSES))
    if unknown:
        raise WorkloadError(
            f"unknown request class(es) {unknown} in mix; known: {sorted(REQUEST_CLASSES)}"
        )
    if any(not (w >= 0 and math.isfinite(w)) for w in mix.values()) or sum(mix.values()) <= 0:
        raise WorkloadError(f"mix weights must be finite, >= 0 and not all zero: {mix}")
    if not 0.0 <= repeat_rate <= 1.0 or not 0.0 <= prefix_share <= 1.0:
        raise WorkloadError("repeat_rate and prefix_share are probabilities in [0, 1]")
    lo, hi = max_tokens
    if not 1 <= lo <= hi:
        raise WorkloadError(f"max_tokens range must satisfy 1 <= lo <= hi, got {max_tokens}")
    if kind == "bursty":
        burst = burst or BurstSpec()
        burst.validate()
    else:
        burst = None

    names = [k for k, w in mix.items() if w > 0]
    classes = [REQUEST_CLASSES[k] for k in names]
    weights = np.array([mix[k] for k in names], dtype=np.float64)
    weights /= weights.sum()

    rng = np.random.default_rng(seed)
    units = np.cumsum(rng.exponential(1.0, n))
    cls_idx = rng.choice(len(classes), size=n, p=weights).astype(np.int8)
    reuse = rng.random(n) < repeat_rate
    pick = rng.random(n)
    mt = rng.integers(lo, hi + 1, size=n, dtype=np.int32)
    if prefix_share > 0:
        has_prefix = rng.random(n) < prefix_share
        prefix_idx = np.where(has_prefix, rng.integers(0, num_prefixes, size=n), -1).astype(
            np.int32
        )
    else:
        prefix_idx = np.full(n, -1, dtype=np.int32)

    media_id = np.zeros(n, dtype=np.int64)
    for c, rc in enumerate(classes):
        if not rc.num_items:
            continue
        idx = np.nonzero(cls_idx == c)[0]
        if len(idx) == 0:
            continue
        r = reuse[idx].copy()
        r[0] = False
        new = ~r
        created_before = np.cumsum(new) - new  # distinct items created before this request
        window = np.minimum(created_before, repeat_pool)
        back = np.floor(pick[idx] * window).astype(np.int64)
        media_id[idx] = np.where(new, created_before, created_before - 1 - back)

    tag = f"s{seed}-"
    blocks = max(1, prefix_tokens // block_size)
    prefixes = (
        [tuple(f"p{seed}.{j}.{b}" for b in range(blocks)) for j in range(num_prefixes)]
        if prefix_share > 0
        else []
    )
    profiles = SyntheticProfiles(
        classes,
        cls_idx,
        media_id,
        mt,
        prefix_idx,
        prefixes,
        tag=tag,
        embedding_bytes=embedding_bytes,
        block_size=block_size,
    )
    arrival = _retime(units, rate_rps, burst, seed)
    norm_mix = {k: float(w) for k, w in zip(names, weights)}
    return Workload(
        kind,
        profiles,
        arrival,
        units=units,
        burst=burst,
        burst_seed=seed,
        rate_rps=rate_rps,
        mix=norm_mix,
    )
