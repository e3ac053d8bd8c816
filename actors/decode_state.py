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

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def next_position(self) -> int:
        """Index in the full sequence of the token the next step produces."""
        return self.request.num_prompt_tokens + len(self.token_ids)

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
    if len(seq.token_ids) >= sampling.max_tokens or seq.next_position >= max_model_len:
        return FinishReason.LENGTH
    return None


def finish_reason_of(num_prompt_tokens: int, sampling, token_ids: list[int], max_model_len: int) -> FinishReason | None:
    """Whether `token_ids` (produced after a prompt of `num_prompt_tokens`) already end the
    request: for the first token, and for a request resumed after a worker died."""
    seq = Sequence(DecodeRequest("", num_prompt_tokens, token_ids[0], sampling), None, list(token_ids))
    return finish_reason(seq, max_model_len)


class DecodeScheduler:
    def __init__(self, max_batch_size: int, max_model_len: int):
        self.max_batch_size = max_batch_size
        self.max_model_len = max_model_len
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        seq.token_ids = [seq.request.first_token_id]
        self.waiting.append(seq)

    def admit(self) -> list[Sequence]:
        """Sequences that join the batch before the next step, oldest first."""
        joining = []
        while self.waiting and len(self.running) + len(joining) < self.max_batch_size:
            seq = self.waiting.popleft()
            if seq.aborted:
                continue
            seq.status = SeqStatus.RUNNING
            joining.append(seq)
        self.running.extend(joining)
        return joining

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

    def remove_finished(self) -> list[int]:
        """Drop finished sequences; returns the batch rows that remain, in order."""
        keep = [i for i, seq in enumerate(self.running) if seq.status != SeqStatus.FINISHED]
        self.running = [self.running[i] for i in keep]
        return keep

    def abort(self, request_id: str) -> None:
        for seq in list(self.waiting) + self.running:
            if seq.request_id == request_id:
                seq.aborted = True

    @property
    def num_active(self) -> int:
        return len(self.waiting) + len(self.running)
