"""Layer-boundary preemption in the prefill loop: a short prompt that arrives while a long
prompt's chunk is in its forward runs whole between two of that forward's decoder layers, and
its first token leaves at once instead of after the chunk.

Why: a prefill step is one chunk of the longest-waiting work, and a forward cannot be left
half way. Shortest-remaining-first scheduling (router/prefill_schedule.py) puts a text
question ahead of a video's next chunk, but not ahead of the chunk already in service: on the
2-core CPU host a 128-token chunk of a 2,197-token video prompt took 92-324 ms beside the
video's encode, and that chunk was the whole queue of the slowest text requests
(docs/BENCHMARKS.md). Between two layers the chunk's state is just its hidden states on the
Python stack, so another prompt's whole forward can run there, on its own cache, and the chunk
continues as if nothing had happened: both results are those of running them apart.

`gate_layers` calls the engine before every decoder layer (and the encoder worker before its
towers' linear layers, where a forward pauses for a short prompt elsewhere on the node:
actors/engine/node_priority.py); `jumpers` picks which of the newly arrived prompts may go ahead of
the chunk in service. Plain logic; the engine runs them.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import Protocol

from router.prefill_schedule import Order, PrefillState, media_tokens, order_key


class Waiting(Protocol):
    taken: bool  # run already, between layers: the intake skips it

    def state(self) -> PrefillState: ...


def gate_layers(layers: Iterable, owner: object) -> None:
    """Call `owner.between_layers()` before each of `layers`' forwards. The hooks hold the
    owner weakly and go with it, so engines built on one loaded model (tests) leave none
    behind."""
    ref = weakref.ref(owner)

    def hook(_module, _args) -> None:
        if (alive := ref()) is not None:
            alive.between_layers()

    handles = [layer.register_forward_pre_hook(hook) for layer in layers]
    weakref.finalize(owner, _remove_all, handles)


def _remove_all(handles: list) -> None:
    for handle in handles:
        handle.remove()


def jumpers(
    new: list[Waiting],
    aborted: set[str],
    in_service: PrefillState,
    max_tokens: int,
    max_media_tokens: int | None,
    key: Callable[[PrefillState], tuple[float, int]],
    cached: Callable[[Waiting], int] = lambda job: 0,
) -> list[Waiting]:
    """Of the prompts `new` to the worker since the step began (none aborted since: `aborted`),
    those that may run whole ahead of the chunk of `in_service`, in the order they would be
    served: each has every item's embeddings, fits one step's token and media budgets, and goes
    before `in_service` in the workers' order (`key`: order_key with the engine's order and
    aging). Each is judged by what is left past the prefix the cache holds for it now
    (`cached`, in tokens): a long conversation's new turn is a short prompt."""
    chosen = []
    for job in new:
        state = job.state()
        state = replace(state, num_computed=max(state.num_computed, cached(job)))
        if (
            not job.taken
            and state.request_id not in aborted
            and state.computable_end == state.num_tokens
            and 0 < state.remaining <= max_tokens
            and (
                max_media_tokens is None
                or media_tokens(state, state.num_computed, state.num_tokens) <= max_media_tokens
            )
            and key(state) < key(in_service)
        ):
            chosen.append((key(state), job))
    return [job for _, job in sorted(chosen, key=lambda pair: pair[0])]


def order_of(order: Order, aging_tokens_per_s: float) -> Callable[[PrefillState], tuple]:
    """The engine's order as a key over states."""
    return lambda s: order_key(s.remaining, s.added_s, s.arrival, order, aging_tokens_per_s)
