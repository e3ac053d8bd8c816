"""How long a new prompt waits at a prefill worker that serves the shortest remaining prompt
first, in chunks (actors/engine/prefill.py, router/prefill_schedule.py). Plain Python.

The work booked there counts only where it goes first: every booked prompt no longer than the
new one, and of the longer ones at most the chunk in service, after which the new prompt takes
the next step. Counted first-come-first-served instead, a text question looked as if it waited
for the whole of a video's prefill at the worker serving that video, and for a video still
being encoded at an idle one: the router sent it to the busy worker (the one whose job had
started, so less of it looked left), where it really waited for the video's chunks.
"""

from __future__ import annotations

from bisect import bisect_right


def shortest_first_wait_ms(booked_ms: list[float], own_ms: float, chunk_ms: float) -> float:
    """The wait of a prompt of `own_ms` at a worker holding prompts of `booked_ms` each, in
    ascending order: those no longer than it (they came first, or are shorter), and one chunk
    of a longer one."""
    shorter = bisect_right(booked_ms, own_ms)
    ahead = sum(booked_ms[:shorter])
    return ahead + chunk_ms if shorter < len(booked_ms) else ahead
