"""The app's /metrics out of its ingress replicas' own: merging Prometheus expositions
(plain Python, no Ray: the controller keeps the book, each replica merges at scrape time).

Each replica counts only what it served, and a scrape through Serve's front door lands on one of
them; so every replica pushes its exposition text to the fleet controller (MetricsBook) and
answers /metrics with its own live registry merged with the others' latest pushes.

Merge rule, per metric kind (a series is a sample name and its label set):
- counter: summed over replicas;
- histogram: each bucket, `_sum` and `_count` summed (replicas of one config share buckets;
  a bucket only some replicas have is summed over those);
- gauge: summed. epd's gauges count things (requests running and waiting, outstanding jobs
  per worker kind as each replica booked them), so the app's value is the sum;
- `_created` (the series' start time, which prometheus_client exports as a gauge family of
  its own): the earliest.
A replica that died keeps its counters and histograms in a "retired" sum, so totals never go
backwards when a replica goes; its gauges are dropped (a dead replica runs nothing).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

_CREATED = "_created"

SeriesKey = tuple[str, tuple[tuple[str, str], ...]]  # sample name, sorted labels


@dataclass
class _Family:
    name: str
    documentation: str
    type: str
    values: dict[SeriesKey, float] = field(default_factory=dict)  # insertion order: bucket order

    def add(self, key: SeriesKey, value: float) -> None:
        old = self.values.get(key)
        self.values[key] = (
            value
            if old is None
            else (min(old, value) if key[0].endswith(_CREATED) else old + value)
        )


class Merged:
    """Expositions merged so far, by the rule above."""

    def __init__(self) -> None:
        self._families: dict[str, _Family] = {}

    def add(self, exposition: str | bytes, *, keep_gauges: bool = True) -> Merged:
        """Add one replica's exposition; `keep_gauges=False` (a retired replica) adds only
        what must not go backwards: counters, histograms and their start times."""
        text = exposition.decode() if isinstance(exposition, bytes) else exposition
        for parsed in text_string_to_metric_families(text):
            if not keep_gauges and parsed.type == "gauge" and not parsed.name.endswith(_CREATED):
                continue
            family = self._families.get(parsed.name)
            if family is None:
                family = self._families[parsed.name] = _Family(
                    parsed.name, parsed.documentation, parsed.type
                )
            for sample in parsed.samples:
                family.add((sample.name, tuple(sorted(sample.labels.items()))), sample.value)
        return self

    def value(self, sample_name: str, labels: dict[str, str] | None = None) -> float | None:
        key = (sample_name, tuple(sorted((labels or {}).items())))
        return next((f.values[key] for f in self._families.values() if key in f.values), None)

    def collect(self) -> Iterator[Metric]:
        for family in self._families.values():
            metric = Metric(family.name, family.documentation, family.type)
            for (name, labels), value in family.values.items():
                metric.add_sample(name, dict(labels), value)
            yield metric

    def exposition(self) -> bytes:
        registry = CollectorRegistry(auto_describe=False)
        registry.register(self)
        return generate_latest(registry)


def merge(expositions: Iterable[str | bytes]) -> bytes:
    """The exposition of several live replicas together."""
    merged = Merged()
    for exposition in expositions:
        merged.add(exposition)
    return merged.exposition()


class MetricsBook:
    """The controller's record of every replica's latest exposition (by owner tag), and the
    retired sum of the replicas that died. Thread-safe: the controller is threaded.

    An exposition comes with the replica's sequence number of its rendering: one rendered
    earlier but delivered later (a push overtaken by a scrape's exchange) is ignored, so the
    book never goes back on counts a scrape has already shown."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._latest: dict[str, tuple[int, str]] = {}  # owner -> (sequence number, exposition)
        self._retired: bytes | None = None

    def report(self, owner: str, exposition: str | bytes, seq: int = 0) -> None:
        text = exposition.decode() if isinstance(exposition, bytes) else exposition
        with self._lock:
            if seq >= self._latest.get(owner, (seq, ""))[0]:
                self._latest[owner] = (seq, text)

    def exchange(self, owner: str, exposition: str | bytes, seq: int = 0) -> list[str | bytes]:
        """A scrape on `owner`'s replica: record what it is about to show, return the others."""
        self.report(owner, exposition, seq)
        return self.others(owner)

    def retire(self, owner: str) -> None:
        """`owner`'s replica died: its counters and histograms join the retired sum."""
        with self._lock:
            last = self._latest.pop(owner, None)
            if last is None:
                return
            merged = Merged().add(last[1], keep_gauges=False)
            if self._retired is not None:
                merged.add(self._retired)
            self._retired = merged.exposition()

    def others(self, owner: str) -> list[str | bytes]:
        """What a scrape on `owner`'s replica adds to its own live registry."""
        with self._lock:
            found: list[str | bytes] = [
                text for other, (_, text) in self._latest.items() if other != owner
            ]
            return found + ([self._retired] if self._retired is not None else [])

    def owners(self) -> list[str]:
        with self._lock:
            return sorted(self._latest)
