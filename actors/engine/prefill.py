"""The prefill loop as a plain object: a step-wise scheduler over the requests in the
worker, with a prefix cache. No Ray and no asyncio, so tests drive the very loop the
worker runs.

Each `step()` starts newly added requests (splice the embeddings that are here, take the
longest cached prefix), lets `plan_step` share the step's token budget among them, runs each
chunk on top of its request's cache and returns the request that finished: its first token
and packed KV. A step ends with the chunk that finishes a prompt (the chunks planned after it
are planned again next step), so a first token never waits for the forwards planned after its
own; where the leading chunks each finish their prompt, they share one forward and leave
together (`pack_prompts`; prompt_pack.py), a chunk joining only while it is at most twice the
pack so far.
Finished prompts leave their full blocks in the prefix cache at the start of the next step,
after their first tokens have left (a finished prompt keeps the worker's loop stepping).
A prompt that arrives during a chunk's forward and goes before it runs whole between two of
the chunk's decoder layers, its output out at once (`on_early`; preempt.py). A forward that
computes whole prompts marks the node urgent, and one that does not pauses between layers
while another worker's is (`priority`; actors/engine/node_priority.py).

Encode/prefill overlap: a request may be added before its items' embeddings; the text
before its first missing item is prefilled meanwhile, and `add_item` splices each item in
when it comes (a request waiting for one takes no step budget and keeps no loop busy).
`add` / `add_item` / `abort` may come from another thread than `step`: they only fill the
intake, which `step` applies in order.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field, replace

import torch
from transformers.cache_utils import DynamicCache

from actors.engine import kv
from actors.engine.grammar import GrammarError, ModelGrammars
from actors.engine.lm_runner import LMRunner
from actors.engine.node_priority import NodePriority
from actors.engine.preempt import gate_layers, jumpers, order_of
from actors.engine.prefix_cache import BlockPool, MediaKey, block_hashes
from actors.engine.prompt_pack import PackPart, forward_packed
from actors.engine.sampling import Sampled
from actors.types import PrefillRequest, TokenHistory
from router.prefill_schedule import Order, PrefillState, Span, num_packed, plan_step
from router.worker_settings import PrefillSettings


@dataclass(frozen=True)
class PrefillOutput:
    request_id: str
    first: Sampled | None  # None: it could not be sampled (non-finite logits)
    packed_kv: torch.Tensor
    rope_delta: int
    num_cached_tokens: int
    queue_ms: float  # added -> first chunk
    prefill_ms: float  # first chunk -> done, less the time spent waiting for items meanwhile
    item_wait_ms: float = 0.0  # how long it could not advance for want of an item's embeddings
    # its own forwards and finish: its service time (prefill_ms also counts those sharing its steps)
    compute_ms: float = 0.0
    error: str | None = (
        None  # the request failed alone (e.g. an item that does not fit its placeholders)
    )
    finished_s: float = (
        0.0  # perf_counter() at done: the worker adds what passes until it hands the result on
    )


@dataclass(frozen=True)
class _Item:
    """An item's embeddings that came after its request (`add_item`)."""

    request_id: str
    slot: int
    embeddings: torch.Tensor


@dataclass
class _Job:
    request: PrefillRequest
    items: dict[int, torch.Tensor]  # by slot, until spliced
    arrival: int
    added_s: float
    overlap_min_tokens: int = 0  # PrefillState.overlap_min_tokens
    embeds: torch.Tensor | None = None
    positions: torch.Tensor | None = None
    rope_delta: int = 0
    cache: DynamicCache = field(default_factory=DynamicCache)
    hashes: list[str] = field(default_factory=list)
    held: list[str] = field(default_factory=list)  # blocks referenced while this job runs
    num_cached: int = 0
    num_computed: int = 0
    started_s: float | None = None
    hidden: torch.Tensor | None = None
    ready: set[int] = field(default_factory=set)  # slots whose embeddings are spliced in
    blocked_s: float | None = None  # since when it waits for an item
    waited_s: float = 0.0  # waiting for items in all
    waited_running_s: float = 0.0  # of which after its first chunk
    compute_s: float = 0.0  # in its own forwards
    matcher: object | None = None  # the first token's grammar matcher (a constrained request)
    taken: bool = False  # run between another chunk's layers while in the intake (preempt.py)

    def state(self) -> PrefillState:
        here = self.ready | self.items.keys()  # spliced, or given and not started yet
        spans = tuple(
            Span(r.offset, r.length, i in here) for i, r in enumerate(self.request.placeholders)
        )
        return PrefillState(
            self.request.request_id,
            len(self.request.prompt_token_ids),
            self.num_computed,
            spans,
            self.arrival,
            self.added_s,
            self.overlap_min_tokens,
        )

    def note_wait(self, now: float) -> None:
        """Start or end a wait for an item, as the job's state now says."""
        runnable = self.state().runnable or self.num_computed == len(self.request.prompt_token_ids)
        if not runnable and self.blocked_s is None:
            self.blocked_s = now
        elif runnable and self.blocked_s is not None:
            self.waited_s += now - self.blocked_s
            self.waited_running_s += now - self.blocked_s if self.started_s is not None else 0.0
            self.blocked_s = None


def history_of(request: PrefillRequest) -> TokenHistory | None:
    """What the first token's penalties see; a resumed request's generated tokens are output."""
    if not request.sampling.needs_history:
        return None
    split = len(request.prompt_token_ids) - request.num_output_tokens
    return TokenHistory(request.prompt_token_ids[:split], request.prompt_token_ids[split:])


def media_keys(request: PrefillRequest) -> tuple[MediaKey, ...]:
    ids = (
        request.media_identifiers
        if len(request.media_identifiers) == len(request.placeholders)
        else None
    )
    return tuple(
        MediaKey(r.offset, r.length, ids[i] if ids else None)
        for i, r in enumerate(request.placeholders)
    )


class PrefillEngine:
    def __init__(
        self,
        runner: LMRunner,
        settings: PrefillSettings,
        *,
        order: Order = Order.SHORTEST_REMAINING,  # benchmarks compare it with arrival order
    ):
        self.runner, self.settings, self.order = runner, settings, order
        self.pool = BlockPool(settings.prefix_cache_bytes)
        self.jobs: dict[str, _Job] = {}
        self._failed: list[PrefillOutput] = []  # requests that failed alone since the last step
        # Finished prompts' packed KV and block hashes, for the prefix cache at the next step:
        # their first tokens leave first.
        self._unkept: list[tuple[list[str], torch.Tensor]] = []
        self._intake: deque[_Job | _Item | str] = (
            deque()
        )  # new jobs, late items and aborted ids, in the order they came
        self._parked: dict[
            str, _Job
        ] = {}  # added, but no chunk can run before an item comes (caller's thread only)
        self._num_runnable = 0  # jobs that can advance, as of the end of the last step
        self._arrivals = itertools.count()
        self._held_version = -1
        self.grammars = ModelGrammars(runner.adapter)  # loads nothing until a grammar comes
        # Layer-boundary preemption (preempt.py): outputs of prompts run between a chunk's
        # layers go to `on_early` at once (from the stepping thread), or with the step's own.
        self.on_early: Callable[[list[PrefillOutput]], None] | None = None
        self._early: list[PrefillOutput] = []
        self._in_service: _Job | None = None  # the job whose chunk may be preempted now
        self._intake_seen = 0  # intake entries judged for preemption in this chunk
        self._nested_s = 0.0  # in preempting prompts or paused for a peer's, during this chunk
        self._num_between_layers = 0  # prompts run so, since the worker started
        self._num_packs = self._num_packed = 0  # packed forwards, and the prompts they finished
        self.priority = NodePriority(None, 1)  # the worker's, on its node's board
        gate_layers(runner.adapter.decoder_layers(), self)
        self._snapshot()

    def reconfigure(self, settings: PrefillSettings) -> None:
        """New scheduling settings (chunk and media budgets, overlap, aging) from the next
        step on; the prefix cache keeps its block size and budget."""
        kept = ("prefix_block_tokens", "prefix_cache_mb")
        if any(getattr(settings, k) != getattr(self.settings, k) for k in kept):
            raise ValueError(f"{' and '.join(kept)} cannot change while the worker runs")
        self.settings = settings
        self.runner.max_chunk_tokens = settings.max_chunk_tokens

    def add(
        self,
        request: PrefillRequest,
        items: Sequence[torch.Tensor] | Mapping[int, torch.Tensor] = (),
    ) -> None:
        """`items`: the embeddings already here (a sequence: slots 0, 1, ...; a mapping: by
        slot); the others follow through `add_item`. A request that cannot compute a chunk
        before an item comes is held aside until one does: it costs no step (and so keeps
        this worker idle on the node's idle-core board while its encoder runs)."""
        given = dict(items) if isinstance(items, Mapping) else dict(enumerate(items))
        arrival, min_tokens = next(self._arrivals), self.settings.overlap_min_tokens
        job = _Job(request, given, arrival, time.perf_counter(), min_tokens)
        self._admit(job)

    def add_item(self, request_id: str, slot: int, embeddings: torch.Tensor) -> None:
        """Item `slot`'s embeddings for a request added before they came; spliced at the next
        step. Dropped there if the request is gone (aborted, failed or already done)."""
        if (job := self._parked.pop(request_id, None)) is not None:
            job.items[slot] = embeddings
            self._admit(job)
        else:
            self._intake.append(_Item(request_id, slot, embeddings))

    def abort(self, request_id: str) -> None:
        """Drop the request at the next step (no-op for one not added yet or already done)."""
        if self._parked.pop(request_id, None) is None:  # a parked request holds nothing yet
            self._intake.append(request_id)

    def _admit(self, job: _Job) -> None:
        """To the intake, or held aside while no chunk of it could run (its wait is item wait).
        A prompt whose missing items all lie in its cached prefix runs now: a new turn about
        the same image needs none of its embeddings, and waited for the encoder's round trip."""
        if job.state().runnable or self._runs_from_cache(job):
            if self._is_short(job.request):  # the node makes way from now (node_priority.py)
                self.priority.wait_begins(job.request.request_id, self.settings.urgent_niceness)
            self._intake.append(job)
        else:
            job.blocked_s = job.blocked_s or job.added_s
            self._parked[job.request.request_id] = job

    def _runs_from_cache(self, job: _Job) -> bool:
        """Whether `job` could run from the prefix the cache holds now. A peek from the
        caller's thread: nothing is taken, and blocks evicted before its start leave it
        waiting for its items in the engine, as a started prompt does."""
        cached = self._cached_tokens(job)
        return cached > job.num_computed and replace(job.state(), num_computed=cached).runnable

    def _is_short(self, request: PrefillRequest) -> bool:
        """A prompt whose forward is one whole step: urgent on the node while it waits."""
        s = self.settings
        return s.node_priority and len(request.prompt_token_ids) <= s.max_chunk_tokens

    @property
    def has_work(self) -> bool:
        """Something a step would do. Requests that all wait for items are no work: their
        `add_item` refills the intake."""
        return bool(self._intake) or self._num_runnable > 0 or bool(self._unkept)

    @property
    def next_step_tokens(self) -> int:
        """About how many prompt tokens the next step computes (before any prefix cache hit of
        the requests not started yet)."""
        waiting = (e for e in list(self._intake) if isinstance(e, _Job) and not e.taken)
        jobs = [*self.jobs.values(), *waiting]
        remaining = sum(len(j.request.prompt_token_ids) - j.num_computed for j in jobs)
        return min(self.settings.max_chunk_tokens, remaining)

    def step(self) -> list[PrefillOutput]:
        try:
            return self._step()
        finally:
            self._snapshot()

    def _step(self) -> list[PrefillOutput]:
        unkept, self._unkept = self._unkept, []
        if unkept and self.priority.short_waiting:
            # A short prompt goes first (a long prompt's blocks took 25-33 ms to keep); it
            # looks for its prefix without them, and the next step keeps them.
            self._unkept = unkept
        else:
            for hashes, packed in unkept:  # before any new request looks for its prefix
                self._keep_blocks(hashes, packed)
        self._apply_intake()
        failed, self._failed = self._failed, []
        if not self.jobs:
            return failed
        states = [job.state() for job in self.jobs.values()]
        s = self.settings
        chunks = plan_step(
            states,
            s.max_chunk_tokens,
            s.max_media_tokens_per_step,
            self.order,
            s.aging_tokens_per_s,
        )
        now, done = time.perf_counter(), []
        if pack := self._packable(chunks):
            self._forward_pack(pack)
            now, done, chunks = time.perf_counter(), [job for job, _ in pack], []
        for chunk in chunks:
            job = self.jobs[chunk.request_id]
            job.started_s = job.started_s or now
            job.hidden = self._forward(job, chunk.start, chunk.end)
            job.num_computed = chunk.end
            job.compute_s += time.perf_counter() - now - self._nested_s
            now = time.perf_counter()
            if chunk.end == len(job.request.prompt_token_ids):
                # Its first token leaves now, not after the chunks planned behind it (a short
                # prompt would wait for a video's chunk); the next step plans those again.
                done.append(job)
                break
        for job in self.jobs.values():
            job.note_wait(now)
        early, self._early = self._early, []
        return failed + early + [self._finish(job) for job in done]

    def _forward(self, job: _Job, start: int, end: int) -> torch.Tensor:
        """One chunk of `job`; prompts that arrive meanwhile may run between its layers."""
        self._in_service = job if self.settings.preempt_at_layers else None
        self._intake_seen, self._nested_s = 0, 0.0
        args = job.embeds, job.positions, job.cache, start, end
        try:
            if start == job.num_cached and end == len(job.request.prompt_token_ids):
                with self._urgent():  # the whole prompt in this one forward
                    return self.runner.forward_chunk(*args)
            with self.priority.yielding() as paused_s:
                try:
                    return self.runner.forward_chunk(*args)
                finally:
                    self._nested_s += paused_s()  # not this chunk's compute
        finally:
            self._in_service = None

    def _packable(self, chunks: list) -> list[tuple[_Job, int]]:
        """The leading chunks that share one forward (`num_packed`), with where each starts."""
        if not self.settings.pack_prompts or not self.runner.adapter.full_window_layers:
            return []
        jobs = [self.jobs[chunk.request_id] for chunk in chunks]
        lengths = [len(job.request.prompt_token_ids) for job in jobs]
        num = num_packed(chunks, lengths, self.settings.max_chunk_tokens)
        return [(job, chunk.start) for job, chunk in zip(jobs[:num], chunks)]

    def _forward_pack(self, pack: list[tuple[_Job, int]]) -> None:
        """Prompts' last chunks in one forward; each one's compute is its share of the tokens.
        A prompt that goes before the first of them may still run between the layers."""
        started = time.perf_counter()
        self._in_service = pack[0][0] if self.settings.preempt_at_layers else None
        self._intake_seen, self._nested_s = 0, 0.0
        parts = [
            PackPart(job.embeds[:, start:], job.positions[..., start:], job.cache)
            for job, start in pack
        ]
        try:
            with self._urgent():
                hidden = forward_packed(self.runner.adapter, parts)
        finally:
            self._in_service = None
        compute_s = time.perf_counter() - started - self._nested_s
        num_tokens = sum(part.num_new for part in parts)
        self._num_packs, self._num_packed = self._num_packs + 1, self._num_packed + len(pack)
        for (job, _), part, last in zip(pack, parts, hidden, strict=True):
            job.started_s = job.started_s or started
            job.hidden, job.num_computed = last, len(job.request.prompt_token_ids)
            job.compute_s += compute_s * part.num_new / num_tokens

    def _urgent(self):
        """Around a short prompt's forward: the node's long forwards pause, and this thread
        runs at `urgent_niceness` (a decode step at 0 would otherwise take its core)."""
        if not self.settings.node_priority:
            return nullcontext()
        return self.priority.urgent(self.settings.urgent_niceness)

    def between_layers(self) -> None:
        """Before each decoder layer (gate_layers): run whole, here, the prompts new to the intake
        that go before the chunk in service. One level deep: they are not preempted in turn."""
        self.priority.pause()  # a no-op unless in a long forward and a peer is urgent
        outer = self._in_service
        if outer is None or len(self._intake) == self._intake_seen:
            return
        entries = list(self._intake)  # appended to from the caller's thread; a copy to judge
        self._intake_seen, self._in_service = len(entries), None
        began = time.perf_counter()
        try:
            s = self.settings
            new = [e for e in entries if isinstance(e, _Job)]
            aborted = {e for e in entries if isinstance(e, str)}
            key = order_of(self.order, s.aging_tokens_per_s)
            args = (s.max_chunk_tokens, s.max_media_tokens_per_step, key, self._cached_tokens)
            for job in jumpers(new, aborted, outer.state(), *args):
                self._run_whole(job)
        finally:
            self._in_service = outer
            self._nested_s += time.perf_counter() - began

    def _run_whole(self, job: _Job) -> None:
        """A prompt from the intake, started, computed in one forward and finished now."""
        job.taken = True
        self._num_between_layers += 1
        self.jobs[job.request.request_id] = job
        self._start(job)
        finished = []
        if job.request.request_id in self.jobs:  # else it failed alone as it started
            now = job.started_s = time.perf_counter()
            end = len(job.request.prompt_token_ids)
            with self._urgent():
                job.hidden = self.runner.forward_chunk(
                    job.embeds, job.positions, job.cache, job.num_computed, end
                )
            job.num_computed = end
            job.compute_s += time.perf_counter() - now
            finished.append(self._finish(job))
        outputs, self._failed = [*self._failed, *finished], []
        if self.on_early is None:
            self._early.extend(outputs)
        else:
            self.on_early(outputs)

    def fail_all(self) -> list[str]:
        """After a step raised: every request in the worker is dropped; their ids."""
        self._apply_intake()
        ids = list(self.jobs)
        for request_id in ids:
            self._drop(request_id)
        self._snapshot()
        return ids

    def _apply_intake(self) -> None:
        while self._intake:
            entry = self._intake.popleft()
            if isinstance(entry, str):
                self._drop(entry)
            elif isinstance(entry, _Item):
                self._splice(entry)
            elif not entry.taken:
                self.jobs[entry.request.request_id] = entry
                self._start(entry)

    def _start(self, job: _Job) -> None:
        """Build the prompt's inputs, splice the items that are here and continue from the
        longest cached prefix."""
        req = job.request
        self.priority.wait_ends(req.request_id)
        if req.sampling.grammar is not None and not self._attach_matcher(job):
            return
        job.embeds, job.positions, job.rope_delta = self.runner.text_inputs(
            req.prompt_token_ids, req.placeholders
        )
        items, job.items = job.items, {}  # spliced: the embeddings are not needed any more
        for slot, embeddings in items.items():
            self._splice(_Item(req.request_id, slot, embeddings))
        job.cache = self.runner.prompt_cache(len(req.prompt_token_ids))
        self._reuse_prefix(job)
        job.note_wait(time.perf_counter())

    def _attach_matcher(self, job: _Job) -> bool:
        """The first token's matcher, past a resumed request's earlier output; False when the
        grammar cannot be built: the request fails alone, before any compute."""
        req = job.request
        try:
            generated = req.prompt_token_ids[len(req.prompt_token_ids) - req.num_output_tokens :]
            job.matcher = self.grammars.matcher(req.sampling, generated)
        except GrammarError as exc:
            self._drop(req.request_id)
            self._failed.append(
                PrefillOutput(req.request_id, None, torch.empty(0), 0, 0, 0.0, 0.0, error=str(exc))
            )
            return False
        return True

    def _splice(self, item: _Item) -> None:
        job = self.jobs.get(item.request_id)
        if (
            job is None or item.slot in job.ready
        ):  # the request is gone: the embeddings are freed here
            return
        if error := self._misfit(job.request, item):  # fails this request alone, not the whole step
            self._drop(job.request.request_id)
            self._failed.append(
                PrefillOutput(item.request_id, None, torch.empty(0), 0, 0, 0.0, 0.0, error=error)
            )
            return
        r = job.request.placeholders[item.slot]
        if r.offset + r.length > job.num_computed:  # else its span came from the prefix cache
            self.runner.splice_item(job.embeds, r, item.embeddings)
        job.ready.add(item.slot)
        job.note_wait(time.perf_counter())

    @staticmethod
    def _misfit(request: PrefillRequest, item: _Item) -> str | None:
        if not 0 <= item.slot < len(request.placeholders):
            return (
                f"item slot {item.slot} is out of range: "
                f"the prompt has {len(request.placeholders)} media items"
            )
        r = request.placeholders[item.slot]
        if item.embeddings.shape[0] != r.length:
            return (
                f"item {item.slot} has {item.embeddings.shape[0]} embeddings "
                f"for its {r.length} placeholders"
            )

        return None

    def _reuse_prefix(self, job: _Job) -> None:
        """Continue from the longest cached prefix (whose media spans need no embeddings)."""
        if self.pool.capacity_bytes <= 0:
            return
        payloads = self.pool.acquire(usable := self._usable_blocks(job))
        job.held = usable[: len(payloads)]
        if payloads:
            job.cache = self.runner.prompt_cache(len(job.request.prompt_token_ids), payloads)
            job.num_cached = job.num_computed = len(payloads) * self.settings.prefix_block_tokens

    def _cached_tokens(self, job: _Job) -> int:
        """Tokens of `job`'s prompt the prefix cache holds now (nothing is taken)."""
        if self.pool.capacity_bytes <= 0:
            return 0
        return self.pool.match(self._usable_blocks(job)) * self.settings.prefix_block_tokens

    def _usable_blocks(self, job: _Job) -> list[str]:
        """The block hashes of `job`'s prompt (made once) that a cached prefix may cover: at
        least the last prompt token is computed, its hidden state gives the first token."""
        req, bs = job.request, self.settings.prefix_block_tokens
        job.hashes = job.hashes or block_hashes(req.prompt_token_ids, bs, media_keys(req))
        return job.hashes[: (len(req.prompt_token_ids) - 1) // bs]

    def _finish(self, job: _Job) -> PrefillOutput:
        req, finishing_s = job.request, time.perf_counter()
        first = self.runner.first_token(
            job.hidden, req.sampling, len(req.prompt_token_ids), history_of(req), job.matcher
        )
        packed = kv.pack(job.cache)
        if job.hashes:
            self._unkept.append((job.hashes, packed))
        self._drop(req.request_id)
        done = time.perf_counter()
        waited_before_s = (
            job.waited_s - job.waited_running_s
        )  # for its items, before its first chunk: not queueing
        queue_ms = (job.started_s - job.added_s - waited_before_s) * 1e3
        prefill_ms = (done - job.started_s - job.waited_running_s) * 1e3
        compute_ms = (job.compute_s + done - finishing_s) * 1e3
        return PrefillOutput(
            req.request_id,
            first,
            packed,
            job.rope_delta,
            job.num_cached,
            queue_ms,
            prefill_ms,
            job.waited_s * 1e3,
            compute_ms,
            finished_s=done,
        )

    def _keep_blocks(self, hashes: list[str], packed: torch.Tensor) -> None:
        bs = self.settings.prefix_block_tokens
        for i, block_hash in enumerate(hashes):
            if block_hash not in self.pool.blocks:
                block = packed[
                    :, :, :, i * bs : (i + 1) * bs
                ].clone()  # its own storage: the packed KV leaves
                if not self.pool.insert(block_hash, block, block.numel() * block.element_size()):
                    break  # no room even after evicting: the later blocks would be orphans
        self.pool.touch(hashes)

    def _drop(self, request_id: str) -> None:
        self.priority.wait_ends(request_id)
        job = self.jobs.pop(request_id, None)
        if job is not None:
            self.pool.release(job.held)
            job.held = []

    def held_hashes(self) -> frozenset[str]:
        """As of the end of the last step (safe to read from another thread than `step`)."""
        return self._held

    def stats(self) -> dict[str, int]:
        """As of the end of the last step, plus requests added since."""
        parked = len(
            self._parked
        )  # queued for this worker and waiting for items, as a started job that waits
        queued = (
            self._stats["queued"]
            + parked
            + sum(1 for j in list(self._intake) if isinstance(j, _Job) and not j.taken)
        )
        return {
            **self._stats,
            "queued": queued,
            "waiting_for_items": self._stats["waiting_for_items"] + parked,
        }

    def _snapshot(self) -> None:
        s, jobs = self.pool.stats, list(self.jobs.values())
        if (
            self._held_version != self.pool.version
        ):  # one frozenset per change, not per step: the router compares by identity
            self._held, self._held_version = self.pool.held(), self.pool.version
        self._num_runnable = sum(1 for j in jobs if j.state().runnable)
        self._stats = {
            "queued": sum(1 for j in jobs if j.started_s is None),
            "running": sum(1 for j in jobs if j.started_s is not None),
            "waiting_for_items": sum(1 for j in jobs if j.blocked_s is not None),
            "prefix_hit_blocks": s.hit_blocks,
            "prefix_miss_blocks": s.miss_blocks,
            "prefix_evictions": s.evictions,
            "prefix_bytes": self.pool.num_bytes,
            "prefix_blocks": len(self.pool.blocks),
            "prefix_referenced_blocks": self.pool.num_referenced(),
            "prompts_between_layers": self._num_between_layers,
            "packed_forwards": self._num_packs,
            "packed_prompts": self._num_packed,
            "urgent_boosts": self.priority.num_boosts,  # short forwards at urgent_niceness
        }
