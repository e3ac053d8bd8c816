"""Process set-up shared by the three worker kinds.

The actor shells (this module, decode.py, prefill.py, encoder.py) import torch, transformers
and the engines only inside the worker, when it starts: the fleet controller imports the
shells to start actors, and a fleet change waits for its imports (tests/unit/test_layout.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import os
import time
import warnings
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

from actors.heap import keep_freed_memory
from actors.host_cpu import HostCpu, usable_cores
from actors.idle_cores import NodeBoard, ThreadPolicy
from actors.models.source import resolve_checkpoint
from actors.thread_priority import NicenessBoost, set_process_niceness, thread_niceness
from actors.wire import LinkAddress, LinkServer

if TYPE_CHECKING:
    from actors.models.adapter import ModelAdapter


@dataclass(frozen=True)
class WorkerSpec:
    """What every worker needs to load its part of the model."""

    checkpoint: str
    dtype: str  # `auto` is resolved by each worker for its own device (load_adapter)
    device: str
    torch_threads: int
    max_model_len: int
    slowdown: float = 1.0  # experiments: stretch device work by this factor
    revision: str | None = None  # of a Hub repo id `checkpoint` (pinned to a commit by the CLI)
    hub_cache_dir: str | None = None  # None: huggingface_hub's default cache
    idle_torch_threads: int | None = (
        None  # threads a step may borrow while the node's other workers are idle
    )
    board: str | None = None  # the fleet's name for its idle-core board (actors/idle_cores.py)
    niceness: int | None = None  # of the worker's threads (actors/thread_priority.py); None: Ray's
    shared_memory: bool = True  # its own links' large call buffers through a ring (actors/wire.py)


@dataclass(frozen=True)
class WorkerLoad:
    """A worker's self-reported load, for the router's cluster view."""

    queued: int
    running: int


class ModelWorker:
    """Base of the Ray actor classes: one torch thread pool, one model part, one executor
    thread so device work never blocks the actor's event loop."""

    LINKED_CALLS: frozenset[str] = frozenset()  # methods a peer may call over a link

    def __init__(self, spec: WorkerSpec, part: str):
        import torch

        from actors.engine.node_priority import NodePriority
        from actors.models.adapter import load_adapter

        keep_freed_memory()  # a step's large blocks are reused by the next, not faulted in anew
        torch.set_num_threads(spec.torch_threads)  # oversubscribed threads collapse on small hosts
        # Received tensors are only ever read (caches grow by concatenation into new
        # tensors), which is what zero-copy deserialisation requires.
        warnings.filterwarnings("ignore", message="Zero-copy tensor serialization")
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        self.spec = spec
        checkpoint = resolve_checkpoint(
            spec.checkpoint, spec.revision, spec.hub_cache_dir
        )  # on this worker's node
        self.adapter: ModelAdapter = load_adapter(
            checkpoint, part=part, dtype=spec.dtype, device=spec.device
        )
        set_process_niceness(spec.niceness)  # before the device thread, which inherits it
        self.step_niceness: int | None = None  # the device thread's, once it has started
        self._executor = ThreadPoolExecutor(max_workers=1, initializer=self._device_thread_starts)
        self._loop_task: asyncio.Task | None = None
        # Every worker posts whether it has work, also one that never borrows: the others must
        # see it.
        board = NodeBoard(spec.board) if spec.board else None
        borrows = board is not None and (spec.idle_torch_threads or 0) > spec.torch_threads
        host = HostCpu(peers=board.peer_pids).start() if borrows else None
        self.threads = ThreadPolicy(spec.torch_threads, spec.idle_torch_threads, board, host)
        # Short prompts first on the node; their forwards at a lower niceness (prefill).
        self.priority = NodePriority(board, usable_cores(), boost=NicenessBoost())
        self._num_threads = spec.torch_threads
        self.num_steps = self.num_borrowed_steps = 0  # device steps, those on borrowed cores
        self.busy_s = 0.0  # device time so far (slowdown included): autoscaling's measured load
        # Units of work that reached this worker and that it finished (embeddings, prompt
        # tokens): autoscaling prices what arrives at the device time a unit took.
        self.work_in = self.work_done = 0
        self._link: LinkServer | None = None
        self.num_linked_calls: Counter[str] = Counter()  # by method: what came over links

    async def link_address(self) -> LinkAddress:
        """Where an ingress replica reaches this worker over a direct link (actors/wire.py):
        its `link_stream` and its LINKED_CALLS, at a fraction of a Ray call's cost."""
        if self._link is None:
            import ray

            host = ray.util.get_node_ip_address()
            self._link = LinkServer(host, streamer=self.link_stream, caller=self._linked_call)
        return await self._link.address()

    def link_stats(self) -> dict[str, int]:
        """Messages this worker sent over links (stream messages, call answers), and the bytes
        its callers handed it through shared-memory rings beside them (same-node links)."""
        link = self._link
        return {
            "link_messages": link.num_sent if link is not None else 0,
            "link_ring_bytes": link.num_ring_bytes if link is not None else 0,
        }

    def link_stream(self, argument):
        raise ValueError(f"{type(self).__name__} streams nothing over a link")

    async def _linked_call(self, method: str, args: tuple):
        if method not in self.LINKED_CALLS:
            raise ValueError(f"{method!r} cannot be called over a link")
        self.num_linked_calls[method] += 1
        answer = getattr(self, method)(*args)
        return await answer if inspect.isawaitable(answer) else answer

    def reconfigure(self, settings, slowdown: float) -> None:
        """Take a redeploy's live settings in place (cluster/config.py LIVE_FIELDS); the
        others of `settings` are this worker's already. Steps under way finish as they began."""
        self.spec = dataclasses.replace(self.spec, slowdown=slowdown)
        self.settings = settings
        self.take_settings(settings)

    def take_settings(self, settings) -> None:
        """What a kind of worker changes for new live settings, beyond holding them."""

    def has_work(self) -> bool:
        """Whether work is left after a device step (the idle-core board's busy flag)."""
        engine = getattr(self, "engine", None)  # prefill and decode workers step an engine
        return bool(engine is not None and engine.has_work)

    def borrow_pays(self) -> bool:
        """Whether the next device step is big enough to gain from borrowed threads."""
        return True

    def priority_stats(self) -> dict[str, float]:
        """Long forwards of this worker paused for a peer's short prompts, and for how long."""
        return {
            "pauses_for_short": self.priority.num_pauses,
            "paused_for_short_ms": round(self.priority.total_paused_s * 1e3, 3),
        }

    def _device_thread_starts(self) -> None:
        self.step_niceness = thread_niceness()

    def device_thread_stats(self) -> dict[str, int | None]:
        """Torch threads of the latest device step (above torch_threads: borrowed idle cores),
        how many steps borrowed of how many, and the device thread's niceness (None before its
        first step)."""
        return {
            "step_threads": self._num_threads,
            "steps": self.num_steps,
            "borrowed_steps": self.num_borrowed_steps,
            "step_niceness": self.step_niceness,
        }

    async def run_device(self, fn, *args):
        try:
            return await asyncio.get_running_loop().run_in_executor(
                self._executor, self._stretched, fn, *args
            )
        finally:  # on the event loop, where the queues that has_work() reads change
            self.threads.step_done(self.has_work())

    def drive(
        self, engine, publish: Callable[[list], None], fail: Callable[[Exception], None]
    ) -> None:
        """Run `engine.step()` on the device thread while the engine has work (started if not
        running); each step's outputs go to `publish`, a step that raises to `fail`."""
        if self._loop_task is None or self._loop_task.done():
            self._loop_task = asyncio.create_task(self._drive(engine, publish, fail))

    async def _drive(self, engine, publish, fail) -> None:
        while engine.has_work:
            try:
                outputs = await self.run_device(engine.step)
            except Exception as exc:
                fail(exc)
                raise
            publish(outputs)
            await asyncio.sleep(0)  # let callers add and leave between steps

    def _stretched(self, fn, *args):
        if (
            threads := self.threads.for_step(self.borrow_pays())
        ) != self._num_threads:  # on the device thread: OpenMP's setting is per thread
            import torch

            torch.set_num_threads(threads)
            self._num_threads = threads
        self.num_steps += 1
        self.num_borrowed_steps += threads > self.spec.torch_threads
        started, paused_s = time.perf_counter(), self.priority.total_paused_s
        result = fn(*args)
        # Pauses for a short prompt elsewhere on the node are neither stretched nor load.
        compute_s = time.perf_counter() - started - (self.priority.total_paused_s - paused_s)
        if self.spec.slowdown > 1.0:  # sleep in the executor, so the worker really is slower
            time.sleep((self.spec.slowdown - 1.0) * compute_s)
        self.busy_s += compute_s * max(self.spec.slowdown, 1.0)
        return result

    def ready(self) -> bool:
        return True

    def node_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()

    def pid(self) -> int:
        return os.getpid()
