"""Unit tests for actors.engine.batching.MicroBatcher (plain asyncio, no Ray, no torch)."""

from __future__ import annotations

import asyncio
import time

import pytest

from actors.engine.batching import MicroBatcher


class Recorder:
    """A run_batch that records every batch it gets and echoes (job, batch index)."""

    def __init__(self, delay_s: float = 0.0, bad: set = frozenset()):
        self.batches: list[list] = []
        self.delay_s = delay_s
        self.bad = set(bad)

    async def __call__(self, jobs: list) -> list:
        self.batches.append(list(jobs))
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        if any(j in self.bad for j in jobs):
            raise RuntimeError(f"bad job in {jobs}")
        return [("done", j) for j in jobs]


def _key_of(job):
    return job[0] if isinstance(job, tuple) else "k"


def test_full_batches_leave_at_max_batch_size_without_waiting():
    async def main():
        run = Recorder()
        # A long max_wait: only a full batch can leave early.
        mb = MicroBatcher(run, max_batch_size=4, max_wait_s=5.0, key=_key_of)
        started = time.monotonic()
        results = await asyncio.gather(*(mb.submit(i) for i in range(8)))
        return run, mb, results, time.monotonic() - started

    run, mb, results, elapsed = asyncio.run(main())
    assert elapsed < 2.0, "full batches must not wait for max_wait_s"
    assert [len(b) for b in run.batches] == [4, 4]
    assert sorted(j for b in run.batches for j in b) == list(range(8))
    # FIFO: the first batch holds the first four jobs
    assert run.batches[0] == [0, 1, 2, 3]
    for i, (result, queue_ms, size) in enumerate(results):
        assert result == ("done", i)
        assert size == 4
        assert queue_ms >= 0.0
    assert mb.queue_depth == 0


def test_never_exceeds_max_batch_size():
    async def main():
        run = Recorder()
        mb = MicroBatcher(run, max_batch_size=3, max_wait_s=0.01, key=_key_of)
        results = await asyncio.gather(*(mb.submit(i) for i in range(10)))
        return run, mb, results

    run, mb, results = asyncio.run(main())
    assert all(1 <= len(b) <= 3 for b in run.batches)
    assert sum(len(b) for b in run.batches) == 10
    assert [r[0] for r in results] == [("done", i) for i in range(10)]
    assert mb.queue_depth == 0


def test_a_lone_job_on_an_idle_batcher_runs_at_once():
    async def main():
        run = Recorder()
        mb = MicroBatcher(run, max_batch_size=8, max_wait_s=5.0, key=_key_of)
        started = time.monotonic()
        first = await mb.submit(1)
        return run, first, time.monotonic() - started

    run, first, elapsed = asyncio.run(main())
    assert run.batches == [[1]] and elapsed < 1.0, "no max_wait_s for a lone job"


def test_partial_batch_leaves_after_max_wait():
    async def main():
        run = Recorder()
        mb = MicroBatcher(run, max_batch_size=8, max_wait_s=0.05, key=_key_of)
        started = time.monotonic()
        results = await asyncio.gather(mb.submit(1), mb.submit(2))
        return run, mb, results, time.monotonic() - started

    run, mb, results, elapsed = asyncio.run(main())
    assert run.batches == [[1, 2]]
    assert 0.04 <= elapsed < 2.0
    for result, queue_ms, size in results:
        assert size == 2
        # they waited (about) max_wait_s before their batch ran
        assert 40.0 <= queue_ms < 2000.0
    assert mb.queue_depth == 0


def test_late_job_joins_waiting_partial_batch():
    async def main():
        # "busy" runs long enough that a loaded host's stall cannot end it before "a" comes
        run = Recorder(delay_s=0.3)
        mb = MicroBatcher(run, max_batch_size=8, max_wait_s=0.4, key=_key_of)
        busy = asyncio.create_task(mb.submit("busy"))  # a lone job on an idle batcher: runs at once
        await asyncio.sleep(0.005)
        first = asyncio.create_task(
            mb.submit("a")
        )  # the batcher is busy now: "a" waits for company
        await asyncio.sleep(0.15)
        second = asyncio.create_task(mb.submit("b"))
        await busy
        return run, await first, await second

    run, first, second = asyncio.run(main())
    assert run.batches == [["busy"], ["a", "b"]]
    assert first[2] == second[2] == 2
    assert first[1] > second[1], "the earlier job queued longer"


def test_different_keys_never_share_a_batch():
    async def main():
        run = Recorder()
        mb = MicroBatcher(run, max_batch_size=4, max_wait_s=0.02, key=_key_of)
        jobs = [
            ("x", 0),
            ("y", 1),
            ("x", 2),
            ("z", 3),
            ("y", 4),
            ("x", 5),
            ("x", 6),
            ("y", 7),
            ("x", 8),
        ]
        results = await asyncio.gather(*(mb.submit(j) for j in jobs))
        return run, mb, jobs, results

    run, mb, jobs, results = asyncio.run(main())
    for batch in run.batches:
        assert len({_key_of(j) for j in batch}) == 1, f"mixed keys in {batch}"
        assert len(batch) <= 4
    assert sorted(j for b in run.batches for j in b) == sorted(jobs)
    for job, (result, _, size) in zip(jobs, results):
        assert result == ("done", job)
        assert size == next(len(b) for b in run.batches if job in b)
    # within one key, FIFO order is kept
    xs = [j for b in run.batches for j in b if j[0] == "x"]
    assert xs == [j for j in jobs if j[0] == "x"]
    assert mb.queue_depth == 0


def test_one_bad_job_fails_alone():
    async def main():
        run = Recorder(bad={3})
        mb = MicroBatcher(run, max_batch_size=5, max_wait_s=0.02, key=_key_of)
        results = await asyncio.gather(*(mb.submit(i) for i in range(5)), return_exceptions=True)
        return run, mb, results

    run, mb, results = asyncio.run(main())
    assert isinstance(results[3], RuntimeError)
    assert "bad job" in str(results[3])
    for i in (0, 1, 2, 4):
        result, queue_ms, size = results[i]
        assert result == ("done", i)
        assert size == 1  # re-run alone after the batch failed
        assert queue_ms >= 0.0
    assert run.batches[0] == [0, 1, 2, 3, 4]
    assert [len(b) for b in run.batches] == [5, 1, 1, 1, 1, 1]
    assert mb.queue_depth == 0


def test_bad_job_does_not_poison_later_batches():
    async def main():
        run = Recorder(bad={"bad"})
        mb = MicroBatcher(run, max_batch_size=2, max_wait_s=0.01, key=_key_of)
        with pytest.raises(RuntimeError):
            await mb.submit("bad")
        return run, await mb.submit("good"), mb

    run, good, mb = asyncio.run(main())
    assert good[0] == ("done", "good")
    assert mb.queue_depth == 0


def test_queue_depth_counts_waiting_jobs_and_returns_to_zero():
    async def main():
        run = Recorder(delay_s=0.2)
        mb = MicroBatcher(run, max_batch_size=2, max_wait_s=0.5, key=_key_of)
        tasks = [asyncio.create_task(mb.submit(i)) for i in range(5)]
        await asyncio.sleep(0)  # all five enqueued, the loop has not popped anything yet
        depth_at_start = mb.queue_depth
        await asyncio.sleep(0.01)  # first batch of 2 running
        depth_mid = mb.queue_depth
        results = await asyncio.gather(*tasks)
        return depth_at_start, depth_mid, mb.queue_depth, results, run

    start, mid, end, results, run = asyncio.run(main())
    assert start == 5
    assert mid == 3
    assert end == 0
    assert [r[0] for r in results] == [("done", i) for i in range(5)]
    assert [len(b) for b in run.batches] == [2, 2, 1]
    assert [r[2] for r in results] == [2, 2, 2, 2, 1]


def test_batcher_restarts_after_going_idle():
    async def main():
        run = Recorder()
        mb = MicroBatcher(run, max_batch_size=4, max_wait_s=0.01, key=_key_of)
        first = await mb.submit(1)
        await asyncio.sleep(0.02)  # loop task has finished
        second = await mb.submit(2)
        return run, first, second

    run, first, second = asyncio.run(main())
    assert first[0] == ("done", 1) and second[0] == ("done", 2)
    assert run.batches == [[1], [2]]
