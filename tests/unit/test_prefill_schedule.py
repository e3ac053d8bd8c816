"""The prefill step planner, in plain Python (no torch, no Ray)."""

from __future__ import annotations

from router.prefill_schedule import Chunk, Order, PrefillState, Span, num_packed, plan_step


def state(
    request_id: str, num_tokens: int, num_computed: int = 0, spans=(), arrival: int = 0
) -> PrefillState:
    return PrefillState(request_id, num_tokens, num_computed, tuple(spans), arrival)


def test_short_prompts_go_first_and_the_long_one_takes_the_rest():
    states = [
        state("video", 2000, arrival=0),
        state("q1", 40, arrival=1),
        state("q2", 30, arrival=2),
    ]
    assert plan_step(states, 512) == [
        Chunk("q2", 0, 30),
        Chunk("q1", 0, 40),
        Chunk("video", 0, 442),
    ]
    assert plan_step(states, 512, order=Order.ARRIVAL) == [Chunk("video", 0, 512)], (
        "a queue: the short ones wait"
    )


def test_aging_lets_a_long_prompt_that_waited_go_ahead_of_a_newcomer():
    """remaining - aging x waited: 2,000 tokens that came 30 s before a 40-token question
    count as 2000 - 100 x 30 < 40 at 100 tokens/s; at 50 tokens/s they do not yet."""
    video = PrefillState("video", 2000, 0, arrival=0, added_s=1000.0)
    question = PrefillState("q", 40, 0, arrival=1, added_s=1030.0)
    assert plan_step([video, question], 512) == [Chunk("q", 0, 40), Chunk("video", 0, 472)], (
        "no aging: shortest first"
    )
    assert plan_step([video, question], 512, aging_tokens_per_s=50) == [
        Chunk("q", 0, 40),
        Chunk("video", 0, 472),
    ]
    assert plan_step([video, question], 512, aging_tokens_per_s=100) == [Chunk("video", 0, 512)]
    assert plan_step([video, question], 512, order=Order.ARRIVAL, aging_tokens_per_s=100) == [
        Chunk("video", 0, 512)
    ]


def test_long_prompt_advances_chunk_by_chunk():
    s, chunks = state("long", 1100), []
    while s.remaining:
        [chunk] = plan_step([s], 512)
        chunks.append(chunk)
        s = state("long", 1100, chunk.end)
    assert [(c.start, c.end) for c in chunks] == [(0, 512), (512, 1024), (1024, 1100)]


def test_chunk_stops_before_a_span_whose_embeddings_are_missing():
    s = state("r", 100, 0, [Span(10, 50, ready=False)])
    assert plan_step([s], 512) == [Chunk("r", 0, 10)], "the text before the item can go"
    assert plan_step([state("r", 100, 10, [Span(10, 50, ready=False)])], 512) == [], (
        "no progress until it arrives"
    )
    assert plan_step([state("r", 100, 10, [Span(10, 50)])], 20) == [Chunk("r", 10, 30)], (
        "ready: a chunk may end inside it"
    )


def test_overlap_chunks_stop_at_the_first_missing_item_and_waiting_costs_no_budget():
    """Encode/prefill overlap: item 0 is here, item 1 is not. The text before item 1 and item 0
    itself go; the chunk stops at item 1's span whatever the budget; a request waiting there
    leaves the whole budget to the others, even though it is the shortest."""
    spans = [Span(5, 20), Span(40, 30, ready=False), Span(80, 10, ready=False)]
    waiting = state("w", 100, 0, spans, arrival=0)
    assert waiting.computable_end == 40 and waiting.runnable
    assert plan_step([waiting], 512) == [Chunk("w", 0, 40)]
    assert plan_step([waiting], 16) == [Chunk("w", 0, 16)], "the budget still bounds it"
    blocked = state("w", 100, 40, spans, arrival=0)
    assert not blocked.runnable
    other = state("o", 300, 0, arrival=1)
    assert plan_step([blocked, other], 64) == [Chunk("o", 0, 64)], (
        "the waiting request takes none of the budget"
    )
    arrived = state("w", 100, 40, [spans[0], Span(40, 30), spans[2]], arrival=0)
    assert arrived.computable_end == 80, "next bound: the item after it"
    assert plan_step([arrived, other], 64) == [Chunk("w", 40, 80), Chunk("o", 0, 24)]
    past = state("w", 100, 90, spans)
    assert past.computable_end == 100, (
        "a missing item already behind the computed prefix (a prefix-cache hit) binds nothing"
    )


def test_a_short_prefix_waits_for_its_item_and_a_long_one_goes_early():
    """overlap_min_tokens: text before a missing item goes early only when at least that long;
    a shorter run waits and goes in one chunk with the item; nothing missing ahead: no floor."""
    spans = [Span(7, 50, ready=False)]
    short = PrefillState("s", 100, 0, tuple(spans), overlap_min_tokens=64)
    assert not short.runnable and plan_step([short], 512) == [], (
        "7 tokens of `USER: ` wait for the image"
    )
    assert PrefillState("s", 100, 0, tuple(spans)).runnable, "without the floor they go early"
    long = PrefillState("l", 400, 0, (Span(200, 50, ready=False),), overlap_min_tokens=64)
    assert plan_step([long], 512) == [Chunk("l", 0, 200)]
    assert not PrefillState(
        "l", 400, 150, (Span(200, 50, ready=False),), overlap_min_tokens=64
    ).runnable, "50 left before it: wait"
    arrived = PrefillState("s", 100, 0, (Span(7, 50),), overlap_min_tokens=64)
    assert plan_step([arrived], 512) == [Chunk("s", 0, 100)], (
        "the item came: the whole prompt in one chunk"
    )
    tail = PrefillState("t", 100, 90, (Span(7, 50),), overlap_min_tokens=64)
    assert plan_step([tail], 512) == [Chunk("t", 90, 100)], "the last tokens of a prompt always go"


def test_media_budget_per_step_is_shared():
    a = state("a", 100, 0, [Span(0, 80)], arrival=0)
    b = state("b", 120, 0, [Span(10, 80)], arrival=1)
    chunks = plan_step([a, b], 512, max_media_tokens_per_step=100)
    assert chunks == [Chunk("a", 0, 100), Chunk("b", 0, 30)], (
        "b keeps its text and 20 of its 80 media tokens"
    )


def test_short_prompt_latency_figures_srf_vs_queue():
    """The figure behind shortest-remaining-first: steps until each short prompt finishes
    when it arrives behind one 2,000-token prompt (budget 512 a step)."""

    def steps_to_finish(order: Order) -> dict[str, int]:
        states = {
            "video": state("video", 2000, arrival=0),
            **{f"q{i}": state(f"q{i}", 40, arrival=i + 1) for i in range(4)},
        }
        done, step = {}, 0
        while states:
            step += 1
            for c in plan_step(list(states.values()), 512, order=order):
                s = states[c.request_id]
                states[c.request_id] = state(s.request_id, s.num_tokens, c.end, s.spans, s.arrival)
                if c.end == s.num_tokens:
                    done[c.request_id] = step
                    del states[c.request_id]
        return done

    srf, queue = steps_to_finish(Order.SHORTEST_REMAINING), steps_to_finish(Order.ARRIVAL)
    assert all(srf[f"q{i}"] == 1 for i in range(4)) and srf["video"] == 5
    assert queue == {"video": 4, "q0": 4, "q1": 5, "q2": 5, "q3": 5}, (
        "a queue: 4-5 steps for each short prompt"
    )
    # the long prompt pays one step (5 vs 4) for the short ones' 1 instead of 4.75 on average


def _chunks(*spans: tuple[int, int]) -> list[Chunk]:
    return [Chunk(f"r{i}", start, end) for i, (start, end) in enumerate(spans)]


def test_a_burst_of_equal_prompts_packs_whole():
    assert num_packed(_chunks(*[(0, 30)] * 17), [30] * 17, 512) == 17
    assert num_packed(_chunks(*[(0, 30)] * 17), [30] * 17, 500) == 16, "at most 500 slots"


def test_a_pack_takes_the_leading_chunks_that_finish_and_grow_it_at_most_twofold():
    # 5, then 9 (at most 2 x 5), 17 (at most 2 x 14); 70 is above 2 x 31
    assert num_packed(_chunks((0, 5), (0, 9), (0, 17), (0, 70)), [5, 9, 17, 70], 512) == 3
    # a prompt's last chunk after its cached prefix or earlier chunks grows it by its new
    # tokens, and fills the pack's slots with its whole prompt
    assert num_packed(_chunks((0, 10), (64, 80)), [10, 80], 512) == 2
    assert num_packed(_chunks((0, 10), (64, 80)), [10, 80], 64) == 0, "its past would not fit"
    # a chunk that leaves its prompt unfinished ends the pack
    assert num_packed(_chunks((0, 10), (0, 10), (0, 12)), [10, 20, 12], 512) == 0


def test_a_short_prompt_and_a_much_longer_one_do_not_pack():
    assert num_packed(_chunks((0, 30), (0, 400)), [30, 400], 512) == 0
    assert num_packed(_chunks((0, 30)), [30], 512) == 0, "one prompt alone is no pack"
