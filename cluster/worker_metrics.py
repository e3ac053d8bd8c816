"""Metrics read from the workers' own stats at scrape time: the encoder cache by state, its
hits, misses and evictions, and the decode KV budget in use. The supervisor polls every
worker's `stats()` a few times a second; this collector turns its latest answers into
series labelled `model_name` and the worker's index (no worker is asked at scrape time).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from actors.engine.encoder_cache import EntryState

WorkerStats = Mapping[str, list[dict]]  # worker kind -> each worker's stats (or {"error": ...})


class WorkerStatsCollector:
    def __init__(self, prefix: str, model_name: str, latest: Callable[[], WorkerStats]):
        self.prefix, self.model_name, self.latest = prefix, model_name, latest

    def describe(
        self,
    ) -> list:  # nothing until the first scrape: the workers' answers decide the series
        return []

    def collect(self) -> Iterator[Metric]:
        stats = self.latest()
        yield from self._pool_workers(stats)
        yield from self._encoder_cache(stats.get("encoder", []))
        yield from self._decode_kv(stats.get("decode", []))

    def _pool_workers(self, stats: WorkerStats) -> Iterator[Metric]:
        """Worker slots of each kind by state: serving (routed, or restarting), starting
        (autoscaling: not placed or not ready yet), draining, empty."""
        family = self._family(
            GaugeMetricFamily,
            "pool_workers",
            "Worker slots by kind and state (serving, starting, draining, empty).",
            "kind",
            "state",
        )
        for kind, workers in stats.items():
            states = [_slot_state(w) for w in workers]
            for state in ("serving", "starting", "draining", "empty"):
                family.add_metric([self.model_name, kind, state], states.count(state))
        yield family

    def _family(self, kind, name: str, doc: str, *labels: str):
        return kind(self.prefix + name, doc, labels=["model_name", *labels])

    def _encoder_cache(self, encoders: list[dict]) -> Iterator[Metric]:
        entries = self._family(
            GaugeMetricFamily,
            "encoder_cache_entries",
            "Encoder cache entries by state.",
            "encoder",
            "state",
        )
        held = self._family(
            GaugeMetricFamily,
            "encoder_cache_bytes",
            "Encoder cache bytes by state.",
            "encoder",
            "state",
        )
        capacity = self._family(
            GaugeMetricFamily,
            "encoder_cache_capacity_bytes",
            "Encoder cache budget (encoder.cache_mb).",
            "encoder",
        )
        counters = {
            name: self._family(CounterMetricFamily, f"encoder_cache_{name}", doc, "encoder")
            for name, doc in (
                (
                    "hits",
                    "Encoder cache lookups served without a new tower pass "
                    "(since the worker started).",
                ),
                ("misses", "Encoder cache lookups that ran the tower."),
                ("evictions", "Unreferenced encoder cache entries evicted under the budget."),
            )
        }
        for index, worker in enumerate(encoders):
            if "cache_capacity_bytes" not in worker:  # restarting, or no answer this round
                continue
            labels = [self.model_name, str(index)]
            for state in EntryState:
                entries.add_metric([*labels, state.value], worker[f"cache_{state.value}_entries"])
                held.add_metric([*labels, state.value], worker[f"cache_{state.value}_bytes"])
            capacity.add_metric(labels, worker["cache_capacity_bytes"])
            for name, family in counters.items():
                family.add_metric(labels, worker[f"cache_{name}"])
        yield from (entries, held, capacity, *counters.values())

    def _decode_kv(self, decoders: list[dict]) -> Iterator[Metric]:
        usage = self._family(
            GaugeMetricFamily,
            "kv_cache_usage_perc",
            "Share of the decode KV budget (decode.kv_cache_mb) reserved by running sequences.",
            "decode",
        )
        for index, worker in enumerate(decoders):
            if worker.get("kv_budget_bytes"):
                usage.add_metric(
                    [self.model_name, str(index)],
                    worker["kv_reserved_bytes"] / worker["kv_budget_bytes"],
                )
        yield usage


def _slot_state(worker: dict) -> str:
    if "slot" in worker:
        return worker["slot"]
    return "draining" if worker.get("draining") else "serving"
