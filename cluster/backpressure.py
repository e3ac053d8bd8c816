"""Bounded admission: the back-pressure an overloaded cluster gives instead of a queue
that only grows.

Two budgets, each per worker of the stage it protects:
- prompt tokens of requests that have not had their first token (they wait for encode
  and prefill), per prefill worker;
- requests in the cluster, waiting for their first token or generating, per decode worker:
  each holds a decode slot, now or once its prompt is prefilled.
A request that would overrun either is refused at once with 429 and a Retry-After,
right after its prompt is planned and before any worker is asked; one that arrives while a
budget is already full, counting the requests that arrived before it and are still being
read or admitted, is refused before its body is read: a burst beyond the budget is refused
as it arrives, not after waiting behind the admission of the requests that fill it. Plain
Python, no Ray.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


def cluster_budgets(config) -> tuple[int, int]:
    """The whole cluster's budgets under `config` (a ClusterConfig): prompt tokens waiting for
    prefill, and requests in it. An autoscaled pool admits for the workers it may grow to: its
    load is what grows it."""
    limits = config.limits
    return (
        limits.max_waiting_tokens_per_prefill_worker * config.prefill.num_slots,
        limits.max_generating_per_decode_worker * config.decode.num_slots,
    )


class Stage(str, enum.Enum):
    WAITING = "waiting"  # admitted, no first token yet
    GENERATING = "generating"  # first token sent, decoding
    DONE = "done"


class Overloaded(Exception):
    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


@dataclass
class Ticket:
    """One admitted request's claim on the budgets; moves forward, released once."""

    admission: Admission
    prompt_tokens: int
    stage: Stage = Stage.WAITING

    def first_token(self) -> None:
        if self.stage is Stage.WAITING:
            self.admission.waiting_tokens -= self.prompt_tokens
            self.admission.waiting -= 1
            self.admission.generating += 1
            self.stage = Stage.GENERATING

    def release(self) -> None:
        if self.stage is Stage.WAITING:
            self.admission.waiting_tokens -= self.prompt_tokens
            self.admission.waiting -= 1
        elif self.stage is Stage.GENERATING:
            self.admission.generating -= 1
        self.stage = Stage.DONE


class Admission:
    def __init__(self, max_waiting_tokens: int, max_generating: int):
        self.max_waiting_tokens, self.max_generating = max_waiting_tokens, max_generating
        self.waiting_tokens = 0
        self.waiting = 0  # requests behind waiting_tokens
        self.generating = 0

    def resize(self, max_waiting_tokens: int, max_generating: int) -> None:
        """New budgets (the replica count changed): tickets out keep what they hold, and
        requests beyond the new budgets wait for room as any would."""
        self.max_waiting_tokens, self.max_generating = max_waiting_tokens, max_generating

    def check_room(self, num_admitting: int = 0) -> None:
        """At arrival, before the body is read: Overloaded at once if a budget is already
        full, counting `num_admitting` requests that came before and hold no ticket yet (their
        bodies read or admitted), so a burst's refusals come in milliseconds, not after its
        parsing."""
        self._check(0 if self.waiting else None, num_admitting)

    def admit(self, prompt_tokens: int) -> Ticket:
        """A ticket for a request of `prompt_tokens`; Overloaded if a budget is full. A lone
        request larger than the whole token budget is still let in when nothing waits, so
        the budget never refuses a prompt the model could take."""
        self._check(prompt_tokens if self.waiting_tokens else None)
        self.waiting_tokens += prompt_tokens
        self.waiting += 1
        return Ticket(self, prompt_tokens)

    def _check(self, more_tokens: int | None, num_admitting: int = 0) -> None:
        """Overloaded if `more_tokens` waiting would pass the token budget (None: not checked;
        0: the budget is already full) or the requests budget is full, `num_admitting` on
        their way in counted."""
        if more_tokens is not None and (
            self.waiting_tokens + max(more_tokens, 1) > self.max_waiting_tokens
        ):
            raise Overloaded(
                f"the cluster is at capacity: {self.waiting_tokens} prompt tokens are waiting for "
                f"prefill (the limit is {self.max_waiting_tokens}); retry later"
            )
        if (held := self.generating + self.waiting + num_admitting) >= self.max_generating:
            raise Overloaded(
                f"the cluster is at capacity: {held} requests are generating or on their way "
                f"({self.generating} generating, {self.waiting} waiting for their first token, "
                f"{num_admitting} being admitted; the limit is {self.max_generating}); retry later"
            )
