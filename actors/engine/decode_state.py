"""The decode worker's bookkeeping, in plain Python: which sequences wait, which run,
and when one is finished. The KV tensors live beside it in `kv.BatchedKV`, row i of
which always belongs to `running[i]`."""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass, field

from actors.types import NO_HISTORY, DecodeRequest, FinishReason, TokenHistory


class SeqStatus(str, enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Sequence:
    request: DecodeRequest
    kv: object  # packed KV until the sequence joins the batch, then None
    token_ids: list[int] = field(default_factory=list)
    status: SeqStatus = SeqStatus.WAITING
    finish_reason: FinishReason | None = None
    aborted: bool = False
    failed: bool = False  # its row could not be sampled (non-finite logits): it ends alone
    kv_bytes: int = (
        0  # KV reserved for it in the batch: its prompt plus every token it may generate
    )
    waited_for_kv: bool = False  # it had a row but not KV room at some step
    matcher: object | None = None  # its grammar's matcher (xgrammar), set when it joins

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def next_position(self) -> int:
        """Index in the full sequence of the token the next step produces."""
        return self.request.num_prompt_tokens + len(self.token_ids)

    def generated_ids(self) -> tuple[int, ...]:
        """Every token the request generated: before this attempt (known when the request
        `needs_history`, as a grammar does), then here (the first one is prefill's)."""
        return self.request.history.output_ids + tuple(self.token_ids)

    def history(self) -> TokenHistory:
        """What the next token's penalties see: the prompt and every token generated so far."""
        if not self.request.sampling.needs_history:
            return NO_HISTORY
        past = self.request.history
        return TokenHistory(past.prompt_ids, past.output_ids + tuple(self.token_ids))


def finish_reason(seq: Sequence, max_model_len: int) -> FinishReason | None:
    sampling = seq.request.sampling
    if seq.aborted:
        return FinishReason.ABORT
    if seq.failed:
        return FinishReason.ERROR
    if seq.token_ids and seq.token_ids[-1] in sampling.stop_token_ids:
        return FinishReason.STOP
    if seq.matcher is not None and seq.matcher.is_terminated():
        return FinishReason.STOP  # its grammar is complete and took a stop token (ignore_eos)
    if len(seq.token_ids) >= sampling.max_tokens or seq.next_position >= max_model_len:
        return FinishReason.LENGTH
    return None


def finish_reason_of(
    num_prompt_tokens: int, sampling, token_ids: list[int], max_model_len: int
) -> FinishReason | None:
    """Whether `token_ids` (produced after a prompt of `num_prompt_tokens`) already end the
    request: for the first token, and for a request resumed after a worker died."""
    seq = Sequence(
        DecodeRequest("", num_prompt_tokens, token_ids[0], sampling), None, list(token_ids)
    )
    return finish_reason(seq, max_model_len)


class DecodeScheduler:
    """Which sequences run. A waiting sequence joins the batch while there is a row for it
    and its whole KV (`Sequence.kv_bytes`) fits what the running ones reserve within
    `kv_budget_bytes`; otherwise it waits, oldest first (nobody overtakes it, so none
    starves). A sequence alone is let in whatever its size: the ingress refuses any that
    could never fit, and a batch must never stall empty."""

    def __init__(self, max_batch_size: int, max_model_len: int, kv_budget_bytes: int | None = None):
        self.max_batch_size = max_batch_size
        self.max_model_len = max_model_len
        self.kv_budget_bytes = kv_budget_bytes  # None: rows are the only limit
        self.kv_reserved_bytes = 0
        self.num_waited_for_kv = (
            0  # sequences that had to wait for KV room (a burst beyond the budget)
        )
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        seq.token_ids = [seq.request.first_token_id]
        self.waiting.append(seq)

    def admit(self) -> list[Sequence]:
        """Sequences that join the batch before the next step, oldest first."""
        if any(
            seq.aborted for seq in self.waiting
        ):  # gone before they ran: they hold no place in line
            self.waiting = deque(seq for seq in self.waiting if not seq.aborted)
        joining = []
        while (
            self.waiting
            and len(self.running) + len(joining) < self.max_batch_size
            and self._fits(self.waiting[0], joining)
        ):
            seq = self.waiting.popleft()
            seq.status = SeqStatus.RUNNING
            self.kv_reserved_bytes += seq.kv_bytes
            joining.append(seq)
        self.running.extend(joining)
        return joining

    def _fits(self, seq: Sequence, joining: list[Sequence]) -> bool:
        if self.kv_budget_bytes is None or not (self.running or joining):
            return True
        if self.kv_reserved_bytes + seq.kv_bytes <= self.kv_budget_bytes:
            return True
        if not seq.waited_for_kv:
            seq.waited_for_kv = True
            self.num_waited_for_kv += 1
        return False

    def record(self, tokens: list[int | None]) -> list[Sequence]:
        """Append one token to every running sequence (None: that row failed); returns the
        ones that just finished."""
        for seq, token in zip(self.running, tokens, strict=True):
            if token is None:
                seq.failed = True
            else:
                seq.token_ids.append(token)
        return self.sweep()

    def sweep(self) -> list[Sequence]:
        """Mark finished (or aborted) running sequences; the caller drops their rows."""
        done = []
        for seq in self.running:
            reason = finish_reason(seq, self.max_model_len)
            if reason is not None:
                seq.status, seq.finish_reason = SeqStatus.FINISHED, reason
                done.append(seq)
        return done

    def finished_rows(self) -> list[int]:
        return [i for i, seq in enumerate(self.running) if seq.status == SeqStatus.FINISHED]

    def keep_rows(self, rows: list[int]) -> None:
        """Running becomes these sequences in this order (the batch's rows after a removal);
        the others, all finished, give their KV reservation back."""
        kept = [self.running[i] for i in rows]
        assert all(seq.status != SeqStatus.FINISHED for seq in kept), (
            "a finished sequence kept its row"
        )
        self.kv_reserved_bytes -= sum(seq.kv_bytes for seq in self.running) - sum(
            seq.kv_bytes for seq in kept
        )
        self.running = kept

    def clear(self) -> list[Sequence]:
        """Empty the scheduler (after a failed step); returns every sequence it had."""
        seqs = self.running + list(self.waiting)
        self.running, self.waiting, self.kv_reserved_bytes = [], deque(), 0
        return seqs

    def abort(self, request_id: str) -> None:
        for seq in list(self.waiting) + self.running:
            if seq.request_id == request_id:
                seq.aborted = True

    @property
    def num_active(self) -> int:
        return len(self.waiting) + len(self.running)
