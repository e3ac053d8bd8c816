"""cluster/metrics_merge.py: replicas' real registries merged by the rule per metric kind,
and the controller's book keeping a dead replica's counters so totals never go backwards."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from cluster.metrics import Metrics
from cluster.metrics_merge import Merged, MetricsBook, merge

LABELS = {"model_name": "m"}


def _replica(ok: int, bad: int, ttfts_s: list[float], waiting: int, running: int) -> Metrics:
    metrics = Metrics("m", 30)
    metrics.requests.labels("ok").inc(ok)
    if bad:
        metrics.requests.labels("400").inc(bad)
    for ttft_s in ttfts_s:
        metrics.ttft.observe(ttft_s)
    metrics.track_load(lambda: waiting, lambda: running)
    metrics.queue_depth.labels("decode").set(running)
    return metrics


def _values(exposition: bytes) -> dict[tuple[str, tuple], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(exposition.decode())
        for s in f.samples
    }


def _value(exposition: bytes, name: str, **labels: str) -> float | None:
    return _values(exposition).get((name, tuple(sorted({**LABELS, **labels}.items()))))


def test_counters_histograms_and_gauges_are_summed_and_created_is_the_earliest():
    a = _replica(ok=3, bad=0, ttfts_s=[0.2, 0.3], waiting=1, running=2)
    b = _replica(ok=5, bad=2, ttfts_s=[4.0], waiting=3, running=1)
    merged = merge([a.exposition(), b.exposition()])
    assert _value(merged, "epd:requests_total", status="ok") == 8
    assert _value(merged, "epd:requests_total", status="400") == 2  # a series only one replica has
    assert _value(merged, "epd:time_to_first_token_seconds_count") == 3
    assert abs(_value(merged, "epd:time_to_first_token_seconds_sum") - 4.5) < 1e-9
    assert _value(merged, "epd:time_to_first_token_seconds_bucket", le="0.25") == 1
    assert _value(merged, "epd:time_to_first_token_seconds_bucket", le="0.5") == 2
    assert _value(merged, "epd:time_to_first_token_seconds_bucket", le="5.0") == 3
    assert _value(merged, "epd:time_to_first_token_seconds_bucket", le="+Inf") == 3
    assert (
        _value(merged, "epd:num_requests_waiting") == 4
        and _value(merged, "epd:num_requests_running") == 3
    )
    assert _value(merged, "epd:queue_depth", kind="decode") == 3
    created = [_value(r.exposition(), "epd:requests_created", status="ok") for r in (a, b)]
    assert _value(merged, "epd:requests_created", status="ok") == min(created)


def test_one_exposition_merged_alone_is_itself():
    a = _replica(ok=2, bad=1, ttfts_s=[0.01, 9.0], waiting=0, running=4)
    assert _values(merge([a.exposition()])) == _values(a.exposition())
    merged = Merged().add(a.exposition())
    assert merged.value("epd:requests_total", {**LABELS, "status": "ok"}) == 2


def test_a_scrape_adds_the_others_latest_and_a_dead_replicas_counts_stay():
    book = MetricsBook()
    a, b, c = (_replica(ok=n, bad=0, ttfts_s=[0.1] * n, waiting=n, running=n) for n in (1, 10, 100))
    for owner, replica in (("a:", a), ("b:", b), ("c:", c)):
        book.report(owner, replica.exposition())
    assert sorted(map(_as_bytes, book.others("a:"))) == sorted([b.exposition(), c.exposition()])

    def scrape_on_a() -> bytes:
        return merge([a.exposition(), *book.others("a:")])

    assert _value(scrape_on_a(), "epd:requests_total", status="ok") == 111
    book.retire("b:")
    book.retire("b:")  # its death seen twice: counted once
    book.retire("nobody:")
    after = scrape_on_a()
    assert _value(after, "epd:requests_total", status="ok") == 111  # b's counts kept
    assert _value(after, "epd:time_to_first_token_seconds_count") == 111
    assert (
        _value(after, "epd:num_requests_running") == 101
    )  # b's gauges gone: a dead replica runs nothing
    book.retire("c:")
    a.requests.labels("ok").inc()
    assert (
        _value(scrape_on_a(), "epd:requests_total", status="ok") == 112
    )  # two retired, summed, plus a's live
    assert _value(scrape_on_a(), "epd:num_requests_waiting") == 1
    assert book.owners() == ["a:"] and book.others("a:")  # only the retired sum
    book.report(
        "d:", _replica(ok=7, bad=0, ttfts_s=[], waiting=0, running=0).exposition()
    )  # a new replica
    assert _value(scrape_on_a(), "epd:requests_total", status="ok") == 119


def _as_bytes(exposition: str | bytes) -> bytes:
    return exposition.encode() if isinstance(exposition, str) else exposition


def test_what_a_scrape_showed_stays_in_the_book_and_a_late_older_push_does_not_undo_it():
    """A replica answering a scrape records its exposition first (exchange): if it dies right
    after, the retired sum holds what the scrape showed. A push rendered before that scrape but
    delivered after it is ignored: otherwise the book, and a later scrape, would read less."""
    book = MetricsBook()
    a, b = (
        _replica(ok=5, bad=0, ttfts_s=[], waiting=0, running=0),
        _replica(ok=1, bad=0, ttfts_s=[], waiting=0, running=0),
    )
    book.report("b:", b.exposition(), seq=1)
    pushed = a.exposition()  # rendered for a push: 5 ok
    a.requests.labels("ok").inc(4)
    shown = merge(
        [a.exposition(), *book.exchange("a:", a.exposition(), seq=2)]
    )  # a scrape on a: 9 + 1
    book.report("a:", pushed, seq=1)  # the push lands after the scrape's exchange
    book.retire("a:")  # a dies; b answers the next scrape
    after = merge([b.exposition(), *book.others("b:")])
    assert _value(shown, "epd:requests_total", status="ok") == 10
    assert _value(after, "epd:requests_total", status="ok") == 10
