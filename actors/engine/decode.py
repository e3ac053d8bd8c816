"""The decode loop as a plain object: continuous batching over requests whose KV arrived
from prefill. No Ray and no asyncio here, so tests drive the very loop the worker runs.

One `step()` admits waiting sequences into the batch, drops finished or aborted ones,
runs one batched decode step and returns what each request's caller should see. `add`
and `abort` may be called from another thread than `step` (the actor's event loop vs its
device thread): they only append to thread-safe intakes that `step` applies first.
"""

from __future__ import annotations

import logging
import time
from collections import deque

import torch

from actors.engine import kv, step_graphs
from actors.engine.decode_state import DecodeScheduler, Sequence
from actors.engine.grammar import GrammarError, ModelGrammars
from actors.engine.lm_runner import LMRunner
from actors.types import DecodeOutput, DecodeRequest, FinishReason, TokenChunk
from router.worker_settings import DecodeSettings

log = logging.getLogger(__name__)


class DecodeEngine:
    def __init__(self, runner: LMRunner, settings: DecodeSettings, max_model_len: int):
        self.runner, self.settings = runner, settings
        self.scheduler = DecodeScheduler(
            settings.max_batch_size, max_model_len, settings.kv_cache_bytes
        )
        self.fixed = step_graphs.for_settings(runner.adapter, settings)  # None: eager steps
        self.batch = self._new_batch()
        self._intake: deque[Sequence | str] = (
            deque()
        )  # new sequences and aborted ids, in the order they came
        self.max_batch_seen = 0
        self.num_steps = 0  # forwards run: a stream's messages are at most one a step
        self.grammars = ModelGrammars(runner.adapter)  # loads nothing until a grammar comes

    def add(self, request: DecodeRequest, packed_kv: torch.Tensor) -> None:
        total = kv.sequence_bytes(
            kv.packed_bytes_per_token(packed_kv),
            request.num_prompt_tokens,
            request.sampling.max_tokens,
            self.scheduler.max_model_len,
        )
        self._intake.append(Sequence(request, packed_kv, kv_bytes=total))

    def reconfigure(self, settings: DecodeSettings) -> None:
        """A new KV budget from the next join on (rows already running keep their room)."""
        if settings.max_batch_size != self.settings.max_batch_size:
            raise ValueError("max_batch_size cannot change while the worker runs")
        self.settings = settings
        self.scheduler.kv_budget_bytes = settings.kv_cache_bytes
        self.batch.max_kept_bytes = settings.kv_cache_bytes
        self.max_batch_seen = 0  # the stat tells what the new budget let in

    def abort(self, request_id: str) -> None:
        """No-op once the request finished; frees its row at the next step otherwise."""
        self._intake.append(request_id)

    @property
    def has_work(self) -> bool:
        return bool(self._intake or self.scheduler.num_active)

    def step(self) -> list[DecodeOutput]:
        """One iteration of the loop: join, sweep, one batched decode step, release."""
        self._apply_intake()
        out: list[DecodeOutput] = []
        joining = self.scheduler.admit()
        for seq in joining:
            self.batch.join(seq.kv.to(self.runner.device))
            seq.kv = None
            if seq.request.sampling.grammar is not None:
                self._attach_matcher(seq)
        self._release(self.scheduler.sweep(), out)  # aborted while waiting for the step
        running = self.scheduler.running
        if not running:
            return out
        matchers = [seq.matcher for seq in running]
        started = time.perf_counter()
        sampled = self.runner.decode_step(
            self.batch,
            [seq.token_ids[-1] for seq in running],
            [seq.request.sampling for seq in running],
            [seq.next_position for seq in running],
            [seq.request.rope_delta for seq in running],
            [seq.history() for seq in running],
            matchers if any(m is not None for m in matchers) else None,
            self.fixed,
        )
        step_ms = (time.perf_counter() - started) * 1e3
        self.max_batch_seen = max(self.max_batch_seen, len(sampled))
        self.num_steps += 1
        for seq, s in zip(running, sampled):
            if s is not None:  # a failed row ends alone, with ERROR, in _release
                logprobs = (s.logprob,) if s.logprob is not None else ()
                out.append(
                    DecodeOutput(seq.request_id, TokenChunk((s.token_id,), None, step_ms, logprobs))
                )
        self._release(
            self.scheduler.record([s.token_id if s is not None else None for s in sampled]),
            out,
            step_ms,
        )
        return out

    def _attach_matcher(self, seq: Sequence) -> None:
        """Its grammar's matcher, past every token it generated; a grammar that cannot be
        built fails the sequence alone (ERROR at the next sweep)."""
        try:
            seq.matcher = self.grammars.matcher(seq.request.sampling, seq.generated_ids())
        except GrammarError as exc:
            log.warning("request %s: grammar refused: %s", seq.request_id, exc)
            seq.failed = True

    def fail_all(self) -> list[DecodeOutput]:
        """After a step raised: every request ends with ERROR and the batch starts empty."""
        self._apply_intake()
        seqs = self.scheduler.clear()
        for seq in seqs:
            seq.aborted = True
        self.batch = self._new_batch()
        return [DecodeOutput(seq.request_id, TokenChunk((), FinishReason.ERROR)) for seq in seqs]

    def _new_batch(self) -> kv.BatchedKV:
        """The batch's buffers stay when it empties (within the KV budget): the next burst
        reuses them. A graphed step attends the slab's whole width, and its graphs hold the
        slab's memory: its slab grows by more columns at a time and always stays (each new
        slab means new captures)."""
        longest = self.scheduler.max_model_len + 1  # a row's tokens and the step's column
        if self.fixed is None:
            budget = self.settings.kv_cache_bytes
            return kv.BatchedKV(keep_when_empty=True, max_kept_bytes=budget, max_columns=longest)
        return kv.BatchedKV(step_graphs.SPARE_SLOTS, keep_when_empty=True, max_columns=longest)

    def _apply_intake(self) -> None:
        while self._intake:
            item = self._intake.popleft()
            if isinstance(item, str):
                self.scheduler.abort(item)
            else:
                self.scheduler.add(item)

    def _release(
        self, finished: list[Sequence], out: list[DecodeOutput], step_ms: float = 0.0
    ) -> None:
        if not finished:
            return
        out.extend(
            DecodeOutput(seq.request_id, TokenChunk((), seq.finish_reason, step_ms))
            for seq in finished
        )
        self.scheduler.keep_rows(
            self.batch.remove(self.scheduler.finished_rows())
        )  # the last rows fill the holes

    def stats(self) -> dict[str, int]:
        """`rows` counts KV rows held: zero when idle, or a request leaked its cache."""
        return {
            "queued": len(self.scheduler.waiting)
            + sum(1 for s in list(self._intake) if not isinstance(s, str)),
            "running": len(self.scheduler.running),
            "rows": self.batch.num_rows,
            "max_batch": self.max_batch_seen,
            "steps": self.num_steps,
            "kv_reserved_bytes": self.scheduler.kv_reserved_bytes,
            "kv_budget_bytes": self.scheduler.kv_budget_bytes or 0,
            "kv_buffer_bytes": self.batch.nbytes,  # held, also while idle (kv.py)
            "kv_regrowths": self.batch.num_regrowths,
            "kv_slides": self.batch.num_slides,
            "waited_for_kv": self.scheduler.num_waited_for_kv,
            **(self.fixed.stats() if self.fixed else {"cuda_graphs": 0}),
        }
