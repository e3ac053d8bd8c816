"""Batch formation for the encoder pool, in plain asyncio (no Ray, no torch).

Jobs are grouped by a key (the tower that runs them); a batch leaves when it is full or when its
oldest job has waited `max_wait_s`, except that a lone job reaching an idle batcher runs at once:
waiting only pays while jobs keep coming, and would add `max_wait_s` to an idle request's latency
(jobs arriving meanwhile form the next batch). If a batch fails, its jobs are retried one by one so
a single bad item fails alone and the rest of the batch still finishes.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

RunBatch = Callable[[list[Any]], Awaitable[list[Any]]]


@dataclass
class _Pending:
    job: Any
    future: asyncio.Future
    enqueued_s: float = field(default_factory=time.monotonic)


class MicroBatcher:
    def __init__(
        self,
        run_batch: RunBatch,
        *,
        max_batch_size: int,
        max_wait_s: float,
        key: Callable[[Any], Hashable],
    ):
        self._run_batch = run_batch
        self.max_batch_size = max_batch_size
        self.max_wait_s = max_wait_s
        self._key = key
        self._queues: OrderedDict[Hashable, deque[_Pending]] = OrderedDict()
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task | None = None
        self.num_batches = 0
        self.max_batch_seen = 0

    @property
    def queue_depth(self) -> int:
        return sum(len(q) for q in self._queues.values())

    async def submit(self, job: Any) -> tuple[Any, float, int]:
        """Result for `job`, with the ms it queued and the size of the batch it ran in."""
        pending = _Pending(job, asyncio.get_running_loop().create_future())
        self._queues.setdefault(self._key(job), deque()).append(pending)
        self._wakeup.set()
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._loop())
        return await pending.future

    def _oldest_key(self) -> Hashable | None:
        heads = [(q[0].enqueued_s, k) for k, q in self._queues.items() if q]
        return min(heads)[1] if heads else None

    async def _loop(self) -> None:
        idle = True  # the loop (re)starts only when a job reached an idle batcher
        while (key := self._oldest_key()) is not None:
            queue = self._queues[key]
            deadline = (
                -1.0 if idle and self.queue_depth == 1 else queue[0].enqueued_s + self.max_wait_s
            )
            idle = False
            while len(queue) < self.max_batch_size and (left := deadline - time.monotonic()) > 0:
                self._wakeup.clear()
                try:
                    await asyncio.wait_for(self._wakeup.wait(), timeout=left)
                except asyncio.TimeoutError:
                    break
            batch = [queue.popleft() for _ in range(min(len(queue), self.max_batch_size))]
            await self._run(batch)

    async def _run(self, batch: list[_Pending]) -> None:
        started = time.monotonic()
        self.num_batches += 1
        self.max_batch_seen = max(self.max_batch_seen, len(batch))
        try:
            results = await self._run_batch([p.job for p in batch])
            if len(results) != len(batch):
                raise RuntimeError(f"batch of {len(batch)} jobs returned {len(results)} results")
        except asyncio.CancelledError:
            for pending in batch:  # never leave a caller waiting forever
                pending.future.cancel()
            raise
        except Exception as exc:
            if len(batch) == 1:
                if not batch[0].future.done():
                    batch[0].future.set_exception(exc)
                return
            for pending in batch:  # isolate the bad item
                await self._run([pending])
            return
        for pending, result in zip(batch, results, strict=True):
            queue_ms = (started - pending.enqueued_s) * 1e3
            if not pending.future.done():
                pending.future.set_result((result, queue_ms, len(batch)))
