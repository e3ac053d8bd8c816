"""The simulated cluster: worker pools with speeds and nodes, and the ground-truth cost
model the simulated workers follow (which the router does NOT see: it starts from
its priors and calibrates online from the durations the simulator reports).

Ground truth, at speed 1.0 (a worker's durations are divided by its speed):

- encode a batch of n same-modality items with total size S (cost units):
      fixed_ms + per_unit_ms * S * n ** (batch_exponent - 1)
  so one item costs fixed + per_unit * size (the cost model's linear form) and a batch
  is cheaper than its items one by one (exponent < 1). Defaults follow the seed
  encoding-cost table: a 336x336 image 5 ms, four of them 12 ms batched, 30 video
  frames 48 ms, 30 s of audio 85 ms.
- prefill (one request at a time, the queue in the engine's own order, `order_key` of
  router/prefill_schedule.py: shortest prompt first less `prefill.aging_tokens_per_s` for each
  second waited, or FIFO: `prefill_order`): prefill_fixed_ms + uncached_tokens /
  prefill_tokens_per_ms; with `prefill.max_chunk_tokens`, in chunks of that many tokens, the
  worker going on after each chunk with the request of fewest tokens left
- decode (continuous batching, approximated): a request admitted when b requests are
  active (itself included) takes max_tokens * (decode_step_ms + decode_step_per_seq_ms * b).
  The batch size is frozen at admission: requests leaving or joining later do not
  change it. Cheap (one event per request) and right on average under steady load.
- transfer: transfer_latency_ms + bytes / bandwidth(placement); encoder -> prefill
  carries the items' embedding bytes, prefill -> decode the KV cache
  (num_prompt_tokens * kv_bytes_per_token).

Shapes: "ExPxD" (e.g. "16x16x16"), "ExPxD-hetero" (the second half of the encoders and
of the prefill workers at 0.5x speed), "ExPxD-split" (the encoder pool split by tower:
image + video on the first ceil(E/2) encoders, audio on the rest; a request with items of
both is split across them, see router/split.py; combines with -hetero), or a YAML file:

    gpus_per_node: 8                 # optional (default 8)
    encoders:                        # a list of worker groups, or just a count
      - {count: 4, speed: 1.0, modalities: [image, video]}
      - {count: 4, speed: 0.5, modalities: [audio], node: node-9}
    prefill:
      - {count: 8}
      - {count: 8, speed: 0.5}
    decode: 16
    costs:                           # optional overrides of SimCosts
      prefill_tokens_per_ms: 40
      prefill: {max_chunk_tokens: 512, preempt_at_layers: true}   # the engine's settings
      encode: {image: {fixed_ms: 1.5, per_unit_ms: 30.0, batch_exponent: 0.8}}
      bandwidth_bytes_per_ms: {cross_node: 12.5e6}

Workers without a `node` are spread over nodes of `gpus_per_node` GPUs, round-robin
per pool, so every node holds a share of each pool.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

from router.prefill_schedule import Order
from router.sim.variability import Variability
from router.types import ALL_MODALITIES, Modality, Placement, RequestProfile, WorkerInfo, WorkerKind
from router.worker_settings import PrefillSettings


class ClusterShapeError(ValueError):
    """A cluster shape that cannot be parsed or cannot serve the workload."""


@dataclass(frozen=True)
class EncodeCost:
    fixed_ms: float
    per_unit_ms: float  # per megapixel / frame / second
    batch_exponent: float = 0.87

    def solo_ms(self, size: float) -> float:
        return self.fixed_ms + self.per_unit_ms * size

    def batch_ms(self, total_size: float, n: int) -> float:
        return self.fixed_ms + self.per_unit_ms * total_size * n ** (self.batch_exponent - 1.0)


def _default_encode() -> dict[str, EncodeCost]:
    mp336 = 336 * 336 / 1e6
    return {
        # 5 ms alone; 4 batched: 2 + 3 * 4**0.87 = 12 ms
        Modality.IMAGE.value: EncodeCost(2.0, 3.0 / mp336, 0.87),
        # 30 frames: 3 + 1.5 * 30 = 48 ms
        Modality.VIDEO.value: EncodeCost(3.0, 1.5, 0.87),
        # 30 s: 4 + 2.7 * 30 = 85 ms
        Modality.AUDIO.value: EncodeCost(4.0, 2.7, 0.87),
    }


def _default_bandwidth() -> dict[Placement, float]:
    # bytes per millisecond: same process ~ free, NVLink-class within a node, 200 Gb/s across
    return {Placement.SAME_PROCESS: 1e9, Placement.SAME_NODE: 300e6, Placement.CROSS_NODE: 25e6}


def _default_latency() -> dict[Placement, float]:
    return {Placement.SAME_PROCESS: 0.0, Placement.SAME_NODE: 0.05, Placement.CROSS_NODE: 0.2}


PREFILL_SHORTEST_FIRST, PREFILL_FIFO = "shortest_first", "fifo"  # SimCosts.prefill_order
PREFILL_ORDERS = {PREFILL_SHORTEST_FIRST: Order.SHORTEST_REMAINING, PREFILL_FIFO: Order.ARRIVAL}
# The engine's prefill settings the simulator models; max_chunk_tokens 0: a prompt in one go.
SIM_PREFILL_FIELDS = ("max_chunk_tokens", "aging_tokens_per_s")
SIM_PREFILL_SWITCHES = ("preempt_at_layers", "pack_prompts")  # and these, true or false


def _whole_prompts() -> PrefillSettings:
    return PrefillSettings(max_chunk_tokens=0)


@dataclass(frozen=True)
class SimCosts:
    """Ground-truth costs of the simulated workers at speed 1.0 (see module doc)."""

    encode: dict[str, EncodeCost] = field(default_factory=_default_encode)
    encode_max_batch: int = 16
    encoder_cache_bytes: int = 4 << 30  # LRU capacity (embedding bytes) of each encoder's cache
    prefill_fixed_ms: float = 5.0
    prefill_tokens_per_ms: float = 30.0
    prefix_cache_blocks: int = 4096  # LRU capacity (blocks) of each prefill worker's prefix cache
    prefill_order: str = (
        PREFILL_SHORTEST_FIRST  # a worker's queue: shortest prompt first (the engine's) or fifo
    )
    # The prefill workers' settings (the config's `prefill` section), of which SIM_PREFILL_FIELDS
    # count: max_chunk_tokens, the tokens a prefill runs before its worker looks at its queue again
    # (shortest first then means shortest remaining first, chunk by chunk; 0: a prompt in one go),
    # and aging_tokens_per_s (each second a prompt has waited counts as that many tokens fewer);
    # of SIM_PREFILL_SWITCHES, preempt_at_layers (a prompt that fits one chunk and goes first
    # runs at once, inside the job in service, which ends that much later) and pack_prompts
    # (whole prompts next in a worker's queue share one service, ending together).
    prefill: PrefillSettings = field(default_factory=_whole_prompts)
    decode_step_ms: float = 12.0
    decode_step_per_seq_ms: float = 0.15
    decode_max_batch: int = 64
    kv_bytes_per_token: int = 160 * 1024
    bandwidth_bytes_per_ms: dict[Placement, float] = field(default_factory=_default_bandwidth)
    transfer_latency_ms: dict[Placement, float] = field(default_factory=_default_latency)
    publish_interval_s: float = 2.0  # how often workers publish queues and cache contents
    # Ingress overhead per request (+ per request with media): admission, RPCs and hand-overs the
    # workers above do not model. It delays the request's routing and so its TTFT; no worker is
    # busy.
    ingress_ms: float = 0.0
    ingress_media_ms: float = 0.0
    variability: Variability = field(
        default_factory=Variability
    )  # off by default (router/sim/variability.py)

    def transfer_ms(self, placement: Placement, num_bytes: float) -> float:
        return (
            self.transfer_latency_ms[placement] + num_bytes / self.bandwidth_bytes_per_ms[placement]
        )

    def prefill_ms(self, uncached_tokens: int) -> float:
        return self.prefill_fixed_ms + uncached_tokens / self.prefill_tokens_per_ms

    def encode_solo_ms(self, modality: str, size: float) -> float:
        return self.encode[modality].solo_ms(size)


@dataclass(frozen=True)
class SimWorker:
    node: str
    speed: float = 1.0
    modalities: frozenset[str] = ALL_MODALITIES  # encoders only


@dataclass(frozen=True)
class SimCluster:
    encoders: tuple[SimWorker, ...]
    prefill: tuple[SimWorker, ...]
    decode: tuple[SimWorker, ...]
    costs: SimCosts = field(default_factory=SimCosts)
    name: str = "custom"

    # ------------------------------------------------------------------ construction

    @classmethod
    def build(
        cls,
        num_encoders: int,
        num_prefill: int,
        num_decode: int,
        *,
        gpus_per_node: int = 8,
        encoder_speeds: Sequence[float] | None = None,
        prefill_speeds: Sequence[float] | None = None,
        decode_speeds: Sequence[float] | None = None,
        costs: SimCosts | None = None,
        name: str | None = None,
        encoder_modalities: Sequence[frozenset[str]] | None = None,
    ) -> SimCluster:
        """Pools spread round-robin over ceil(total / gpus_per_node) nodes; encoders host every
        modality unless `encoder_modalities` (one set per encoder) says otherwise."""
        total = num_encoders + num_prefill + num_decode
        nodes = max(1, math.ceil(total / gpus_per_node))

        def pool(n: int, speeds: Sequence[float] | None) -> tuple[SimWorker, ...]:
            speeds = list(speeds) if speeds is not None else [1.0] * n
            if len(speeds) != n:
                raise ClusterShapeError(f"{len(speeds)} speeds given for a pool of {n}")
            return tuple(SimWorker(f"node-{i % nodes}", float(s)) for i, s in enumerate(speeds))

        encoders = pool(num_encoders, encoder_speeds)
        if encoder_modalities is not None:
            if len(encoder_modalities) != num_encoders:
                raise ClusterShapeError(
                    f"{len(encoder_modalities)} modality sets given for {num_encoders} encoders"
                )
            encoders = tuple(
                replace(w, modalities=frozenset(m)) for w, m in zip(encoders, encoder_modalities)
            )
        c = cls(
            encoders,
            pool(num_prefill, prefill_speeds),
            pool(num_decode, decode_speeds),
            costs or SimCosts(),
            name or f"{num_encoders}x{num_prefill}x{num_decode}",
        )
        c.validate()
        return c

    @classmethod
    def parse(cls, spec: str) -> SimCluster:
        """'ExPxD' with optional suffixes '-hetero' (half of E and P at 0.5x) and '-split' (the
        encoder pool split by tower: the first ceil(E/2) encoders host image + video, the rest
        audio), or a YAML file path."""
        spec = spec.strip()
        if spec.endswith((".yaml", ".yml")) or Path(spec).is_file():
            return cls.from_yaml(spec)
        m = re.fullmatch(r"(\d+)x(\d+)x(\d+)((?:-hetero|-split)*)", spec)
        suffixes = m.group(4).split("-")[1:] if m else []
        if not m or len(set(suffixes)) != len(suffixes):
            raise ClusterShapeError(
                f"cannot parse cluster shape {spec!r}: "
                "expected ENCxPREFILLxDECODE such as '16x16x16', "
                "optionally with '-hetero' (half the encoders and prefill workers at 0.5x) "
                "and/or '-split' "
                "(encoders split by tower: image + video on the first half, audio on the rest), "
                "or a .yaml file"
            )
        e, p, d = (int(g) for g in m.groups()[:3])
        half = lambda n: [1.0 if i < (n + 1) // 2 else 0.5 for i in range(n)]  # noqa: E731
        hetero = "hetero" in suffixes
        return cls.build(
            e,
            p,
            d,
            encoder_speeds=half(e) if hetero else None,
            prefill_speeds=half(p) if hetero else None,
            encoder_modalities=split_towers(e, spec) if "split" in suffixes else None,
            name=spec,
        )

    @classmethod
    def from_yaml(cls, path: str | Path) -> SimCluster:
        """See the module docstring for the format."""
        import yaml

        path = Path(path)
        try:
            raw = yaml.safe_load(path.read_text(encoding="utf-8"))
        except OSError as exc:
            raise ClusterShapeError(
                f"cannot read cluster file {path}: {exc.strerror or exc}"
            ) from None
        except yaml.YAMLError as exc:
            raise ClusterShapeError(f"{path}: not valid YAML: {exc}") from None
        if not isinstance(raw, dict):
            raise ClusterShapeError(f"{path}: expected a mapping with encoders / prefill / decode")
        allowed = {"gpus_per_node", "encoders", "prefill", "decode", "costs"}
        extra = sorted(set(raw) - allowed)
        if extra:
            raise ClusterShapeError(f"{path}: unknown key(s) {extra}; allowed: {sorted(allowed)}")
        gpn = raw.get("gpus_per_node", 8)
        if not isinstance(gpn, int) or gpn < 1:
            raise ClusterShapeError(f"{path}: gpus_per_node must be a positive integer")

        groups: dict[str, list[dict]] = {}
        for pool in ("encoders", "prefill", "decode"):
            entries = raw.get(pool, [])
            if isinstance(entries, int):
                entries = [{"count": entries}]
            if not isinstance(entries, list):
                raise ClusterShapeError(
                    f"{path}: {pool} must be a list of worker groups or a count"
                )
            for k, g in enumerate(entries):
                if not isinstance(g, dict):
                    raise ClusterShapeError(f"{path}: {pool}[{k}] must be a mapping")
                bad = sorted(set(g) - {"count", "speed", "node", "modalities"})
                if bad:
                    raise ClusterShapeError(f"{path}: {pool}[{k}] has unknown key(s) {bad}")
                if not isinstance(g.get("count", 1), int) or g.get("count", 1) < 0:
                    raise ClusterShapeError(f"{path}: {pool}[{k}].count must be an integer >= 0")
                sp = g.get("speed", 1.0)
                if not isinstance(sp, (int, float)) or isinstance(sp, bool) or not sp > 0:
                    raise ClusterShapeError(f"{path}: {pool}[{k}].speed must be a number > 0")
                mods = g.get("modalities")
                if mods is not None:
                    if pool != "encoders":
                        raise ClusterShapeError(
                            f"{path}: {pool}[{k}]: only encoders host modalities"
                        )
                    if not isinstance(mods, list) or not set(mods) <= ALL_MODALITIES:
                        raise ClusterShapeError(
                            f"{path}: {pool}[{k}].modalities must be a list drawn from "
                            f"{sorted(ALL_MODALITIES)}"
                        )
            groups[pool] = entries

        total = sum(g.get("count", 1) for es in groups.values() for g in es)
        nodes = max(1, math.ceil(total / gpn))

        def expand(entries: list[dict]) -> tuple[SimWorker, ...]:
            out = []
            for g in entries:
                for _ in range(g.get("count", 1)):
                    node = g.get("node") or f"node-{len(out) % nodes}"
                    mods = (
                        frozenset(g["modalities"])
                        if g.get("modalities") is not None
                        else ALL_MODALITIES
                    )
                    out.append(SimWorker(str(node), float(g.get("speed", 1.0)), mods))
            return tuple(out)

        costs = _costs_from_dict(raw.get("costs") or {}, path)
        c = cls(
            expand(groups["encoders"]),
            expand(groups["prefill"]),
            expand(groups["decode"]),
            costs,
            path.stem,
        )
        c.validate()
        return c

    # ------------------------------------------------------------------ checks & views

    def validate(self) -> None:
        if not self.prefill:
            raise ClusterShapeError(f"cluster {self.name!r} has no prefill worker")
        if not self.decode:
            raise ClusterShapeError(f"cluster {self.name!r} has no decode worker")
        for pool in (self.encoders, self.prefill, self.decode):
            for w in pool:
                if not (w.speed > 0 and math.isfinite(w.speed)):
                    raise ClusterShapeError(
                        f"cluster {self.name!r}: worker speed must be > 0, got {w.speed}"
                    )
        if self.costs.prefill_order not in PREFILL_ORDERS:
            raise ClusterShapeError(
                f"cluster {self.name!r}: costs.prefill_order must be "
                f"{PREFILL_SHORTEST_FIRST!r} or {PREFILL_FIFO!r}, "
                f"got {self.costs.prefill_order!r}"
            )
        for name in SIM_PREFILL_FIELDS:
            value = getattr(self.costs.prefill, name)
            if not (isinstance(value, (int, float)) and 0 <= value < math.inf):
                raise ClusterShapeError(
                    f"cluster {self.name!r}: "
                    f"costs.prefill.{name} must be a number >= 0, got {value!r}"
                )
        try:
            self.costs.variability.validate()
        except ValueError as exc:
            raise ClusterShapeError(f"cluster {self.name!r}: {exc}") from None

    def hosted_modalities(self) -> frozenset[str]:
        out: set[str] = set()
        for w in self.encoders:
            out |= w.modalities
        return frozenset(out)

    def check_workload(self, modalities: Iterable[str]) -> None:
        """Raise ClusterShapeError when no encoder hosts a modality the workload needs."""
        needed = frozenset(modalities)
        missing = sorted(needed - self.hosted_modalities())
        if missing:
            if not self.encoders:
                raise ClusterShapeError(
                    f"cluster {self.name!r} has no encoder, "
                    f"but the workload has {', '.join(missing)} items"
                )
            raise ClusterShapeError(
                f"cluster {self.name!r} cannot serve the workload: "
                f"no encoder hosts {', '.join(missing)}"
            )
        unknown = sorted(needed - set(self.costs.encode))
        if unknown:
            raise ClusterShapeError(f"no encode cost defined for modality {', '.join(unknown)}")

    def worker_infos(self) -> list[WorkerInfo]:
        out = []
        for kind, pool in (
            (WorkerKind.ENCODER, self.encoders),
            (WorkerKind.PREFILL, self.prefill),
            (WorkerKind.DECODE, self.decode),
        ):
            for i, w in enumerate(pool):
                out.append(
                    WorkerInfo(
                        kind, i, w.node, w.modalities if kind is WorkerKind.ENCODER else frozenset()
                    )
                )
        return out

    @staticmethod
    def placement(node_a: str, node_b: str) -> Placement:
        return Placement.SAME_NODE if node_a == node_b else Placement.CROSS_NODE

    def with_costs(self, **changes) -> SimCluster:
        """A copy with some costs changed, checked like a parsed cluster (a bad value is named)."""
        cluster = replace(self, costs=replace(self.costs, **changes))
        cluster.validate()
        return cluster

    def with_prefill(self, **changes) -> SimCluster:
        """A copy with some prefill settings changed (`costs.prefill`), checked as `with_costs`."""
        return self.with_costs(prefill=replace(self.costs.prefill, **changes))

    def describe(self) -> str:
        def pool(ws: tuple[SimWorker, ...]) -> str:
            speeds: dict[float, int] = {}
            for w in ws:
                speeds[w.speed] = speeds.get(w.speed, 0) + 1
            return "+".join(f"{n}@{s:g}x" for s, n in sorted(speeds.items(), reverse=True)) or "0"

        nodes = len({w.node for w in (*self.encoders, *self.prefill, *self.decode)})
        return (
            f"{self.name}: encoders {pool(self.encoders)}, prefill {pool(self.prefill)}, "
            f"decode {pool(self.decode)} on {nodes} node(s)"
        )


VISION, AUDIO = (
    frozenset({Modality.IMAGE.value, Modality.VIDEO.value}),
    frozenset({Modality.AUDIO.value}),
)


def split_towers(num_encoders: int, spec: str) -> list[frozenset[str]]:
    """The '-split' shape: the vision tower (image + video) on the first ceil(E/2) encoders, audio
    on the rest."""
    if num_encoders < 2:
        raise ClusterShapeError(
            f"cluster shape {spec!r}: '-split' needs at least 2 encoders (one per tower)"
        )
    vision = (num_encoders + 1) // 2
    return [VISION if i < vision else AUDIO for i in range(num_encoders)]


def _costs_from_dict(raw: dict, path) -> SimCosts:
    if not isinstance(raw, dict):
        raise ClusterShapeError(f"{path}: costs must be a mapping")
    base = SimCosts()
    known = {f.name for f in fields(SimCosts)}
    changes: dict = {}
    for key, value in raw.items():
        if key not in known:
            raise ClusterShapeError(f"{path}: unknown cost key {key!r}; known: {sorted(known)}")
        if key == "encode":
            if not isinstance(value, dict):
                raise ClusterShapeError(
                    f"{path}: costs.encode must map modality -> {{fixed_ms, per_unit_ms}}"
                )
            enc = dict(base.encode)
            for mod, spec in value.items():
                if mod not in ALL_MODALITIES or not isinstance(spec, dict):
                    raise ClusterShapeError(
                        f"{path}: costs.encode.{mod}: unknown modality or not a mapping"
                    )
                try:
                    enc[mod] = replace(enc[mod], **spec)
                except TypeError as exc:
                    raise ClusterShapeError(f"{path}: costs.encode.{mod}: {exc}") from None
            changes[key] = enc
        elif key == "variability":
            try:
                changes[key] = Variability(**value)
                changes[key].validate()
            except (TypeError, ValueError) as exc:
                raise ClusterShapeError(f"{path}: costs.variability: {exc}") from None
        elif key == "prefill_order":
            changes[key] = value  # SimCluster.validate names a bad one
        elif key == "prefill":
            changes[key] = _prefill_from_dict(value, base.prefill, path)
        elif key in ("bandwidth_bytes_per_ms", "transfer_latency_ms"):
            if not isinstance(value, dict):
                raise ClusterShapeError(f"{path}: costs.{key} must map placement -> number")
            cur = dict(getattr(base, key))
            for pl, v in value.items():
                try:
                    cur[Placement(pl)] = float(v)
                except ValueError:
                    raise ClusterShapeError(
                        f"{path}: costs.{key}: unknown placement {pl!r}"
                    ) from None
            changes[key] = cur
        else:
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
                raise ClusterShapeError(f"{path}: costs.{key} must be a number >= 0")
            changes[key] = type(getattr(base, key))(value)
    return replace(base, **changes)


def _prefill_from_dict(raw, base: PrefillSettings, path) -> PrefillSettings:
    """costs.prefill: those of the engine's settings that the simulator models."""
    if not isinstance(raw, dict) or not set(raw) <= {*SIM_PREFILL_FIELDS, *SIM_PREFILL_SWITCHES}:
        raise ClusterShapeError(
            f"{path}: costs.prefill must map some of {list(SIM_PREFILL_FIELDS)} to numbers "
            f"and of {list(SIM_PREFILL_SWITCHES)} to true or false"
        )
    for key, value in raw.items():
        if key in SIM_PREFILL_SWITCHES:
            if not isinstance(value, bool):
                raise ClusterShapeError(f"{path}: costs.prefill.{key} must be true or false")
        elif not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
            raise ClusterShapeError(f"{path}: costs.prefill.{key} must be a number >= 0")
    return replace(base, **{key: type(getattr(base, key))(value) for key, value in raw.items()})


# ----------------------------------------------------------------------------- capacity


def pool_demand_ms(cluster: SimCluster, profiles: Iterable[RequestProfile]) -> dict[str, float]:
    """Mean work per request, in ms at speed 1.0, for each pool (and per modality for
    the encoders, keyed 'encoder:<modality>'). Conservative: encodes items one by one
    (no batching discount), ignores encoder and prefix cache hits, and counts decode at
    the full batch."""
    c = cluster.costs
    enc_total = 0.0
    enc_mod: dict[str, float] = {}
    prefill = 0.0
    decode = 0.0
    n = 0
    b = c.decode_max_batch
    step = c.decode_step_ms + c.decode_step_per_seq_ms * b
    solo = {m: ec for m, ec in c.encode.items()}
    for prof in profiles:
        n += 1
        for it in prof.items:
            ms = solo[it.modality].solo_ms(it.size)
            enc_total += ms
            enc_mod[it.modality] = enc_mod.get(it.modality, 0.0) + ms
        prefill += c.prefill_ms(prof.num_prompt_tokens)
        decode += prof.max_tokens * step / b
    if n == 0:
        raise ValueError("no requests to estimate demand from")
    out = {"encoder": enc_total / n, "prefill": prefill / n, "decode": decode / n}
    for m, v in enc_mod.items():
        out[f"encoder:{m}"] = v / n
    return out


def capacity_rps(cluster: SimCluster, workload_or_profiles) -> float:
    """Requests/s the cluster sustains for this request mix: the bottleneck pool's total
    speed over its mean work per request (see `pool_demand_ms` for the assumptions).
    Offer `load * capacity_rps(...)` to run at a given fraction of capacity."""
    if hasattr(workload_or_profiles, "sample"):
        profiles = workload_or_profiles.sample()
    else:
        profiles = workload_or_profiles
    demand = pool_demand_ms(cluster, profiles)
    per_req_ms = [
        demand["prefill"] / sum(w.speed for w in cluster.prefill),
        demand["decode"] / sum(w.speed for w in cluster.decode),
    ]
    if demand["encoder"] > 0:
        if not cluster.encoders:
            return 0.0
        per_req_ms.append(demand["encoder"] / sum(w.speed for w in cluster.encoders))
        for key, ms in demand.items():
            if key.startswith("encoder:"):
                hosts = sum(w.speed for w in cluster.encoders if key[8:] in w.modalities)
                if hosts == 0:
                    return 0.0
                per_req_ms.append(ms / hosts)
    return 1000.0 / max(per_req_ms)
