"""Layer-boundary preemption in the real prefill engine (no Ray) on the tiny checkpoint: a short
prompt that arrives while a long prompt's chunk is in its forward runs whole between two of
that chunk's decoder layers, and leaves before the chunk ends; both prompts' first tokens and
KV are exactly those of running them apart. Which arrivals may jump is plain logic
(actors/engine/preempt.py `jumpers`), tested without a model."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

torch = pytest.importorskip("torch")

from actors.engine.lm_runner import LMRunner  # noqa: E402
from actors.engine.preempt import jumpers, order_of  # noqa: E402
from actors.engine.prefill import PrefillEngine, PrefillOutput, _Job  # noqa: E402
from actors.types import PrefillRequest  # noqa: E402
from router.prefill_schedule import Order, PrefillState, Span  # noqa: E402
from router.worker_settings import PrefillSettings  # noqa: E402
from tests.unit.test_lm_runner import GREEDY, lm  # noqa: E402, F401 (a fixture)

LONG = PrefillRequest("long", tuple(range(10, 170)), (), GREEDY)  # 160 tokens
SHORT = PrefillRequest("short", tuple(range(40, 52)), (), GREEDY)  # 12 tokens


def alone(lm, request: PrefillRequest, chunk: int) -> PrefillOutput:
    engine = PrefillEngine(LMRunner(lm, chunk), PrefillSettings(chunk))
    engine.add(request)
    while not (outs := engine.step()):
        pass
    return outs[0]


def arriving_mid_chunk(engine: PrefillEngine, *arrivals) -> list[str]:
    """Each of `arrivals` (a request to add, or an id to abort) reaches the engine during the
    first layer of the next forward, as from the worker's event loop while the device thread
    computes; returns what the engine's state was when they came."""
    seen: list[str] = []

    def arrive(_module, _args):
        handle.remove()  # once: the forwards run between layers must not add again
        seen.append(f"long computed {engine.jobs['long'].num_computed}")
        for arrival in arrivals:
            engine.abort(arrival) if isinstance(arrival, str) else engine.add(arrival)

    handle = engine.runner.adapter.decoder_layers()[0].register_forward_pre_hook(arrive)
    return seen


def same(a: PrefillOutput, b: PrefillOutput) -> bool:
    return a.first.token_id == b.first.token_id and torch.equal(a.packed_kv, b.packed_kv)


@pytest.mark.parametrize("with_callback", [False, True])
def test_a_short_prompt_runs_between_the_layers_of_a_long_chunk(lm, with_callback):
    assert len(lm.decoder_layers()) >= 2, "the tiny checkpoint needs a layer boundary"
    engine = PrefillEngine(LMRunner(lm, 64), PrefillSettings(64, preempt_at_layers=True))
    early: dict[str, tuple[PrefillOutput, int]] = {}
    if with_callback:  # as the worker: at once, from the thread that steps, mid-chunk
        engine.on_early = lambda outs: early.update(
            (o.request_id, (o, engine.jobs["long"].num_computed)) for o in outs
        )
    engine.add(LONG)
    seen = arriving_mid_chunk(engine, SHORT)
    first = engine.step()
    assert seen == ["long computed 0"], "the short prompt came during the long one's chunk"
    if with_callback:
        assert first == [] and early["short"][1] == 0, "it left before the chunk's end"
        short = early["short"][0]
    else:
        assert [o.request_id for o in first] == ["short"]
        short = first[0]
    assert engine.jobs["long"].num_computed == 64, "the chunk finished after it"
    outs = []
    while engine.has_work:
        outs += engine.step()
    assert [o.request_id for o in outs] == ["long"]
    assert same(outs[0], alone(lm, LONG, 64)), "the long prompt is as if alone"
    assert same(short, alone(lm, SHORT, 64)), "the short prompt is as if alone"
    assert short.queue_ms < outs[0].prefill_ms
    assert not engine.jobs and engine.stats()["queued"] == 0
    assert engine.stats()["prompts_between_layers"] == 1


def test_without_preemption_the_short_prompt_waits_for_the_chunk(lm):
    engine = PrefillEngine(LMRunner(lm, 64), PrefillSettings(64, preempt_at_layers=False))
    engine.add(LONG)
    arriving_mid_chunk(engine, SHORT)
    assert engine.step() == []
    assert [o.request_id for o in engine.step()] == ["short"]


def test_a_prompt_aborted_before_the_layer_boundary_does_not_run(lm):
    engine = PrefillEngine(LMRunner(lm, 64), PrefillSettings(64, preempt_at_layers=True))
    engine.add(LONG)
    arriving_mid_chunk(engine, SHORT, "short")
    assert engine.step() == []
    while engine.has_work:
        assert "short" not in {o.request_id for o in engine.step()}
    assert not engine.jobs and engine.pool.num_referenced() == 0


def test_a_longer_arrival_waits_for_the_chunk_in_service(lm):
    """Shortest remaining first: a 100-token prompt does not go ahead of a chunk whose prompt
    has 40 tokens left."""
    engine = PrefillEngine(LMRunner(lm, 128), PrefillSettings(128, preempt_at_layers=True))
    engine.add(PrefillRequest("long", tuple(range(10, 50)), (), GREEDY))
    arriving_mid_chunk(engine, PrefillRequest("longer", tuple(range(10, 110)), (), GREEDY))
    assert [o.request_id for o in engine.step()] == ["long"]


def test_a_new_turn_of_a_cached_conversation_jumps_as_the_short_prompt_it_is(lm):
    """150 tokens, 144 of them in the prefix cache: what is left (6) goes ahead of a chunk of
    a 160-token prompt, though the whole prompt is longer than a step's 64 tokens; its first
    token and KV are those of running it alone."""
    settings = PrefillSettings(64, prefix_cache_mb=4.0, preempt_at_layers=True)
    engine = PrefillEngine(LMRunner(lm, 64), settings)
    history = tuple(range(300, 444))  # 144 tokens: 9 blocks of 16
    engine.add(PrefillRequest("earlier", history + (7, 8), (), GREEDY))
    while engine.has_work:
        engine.step()
    engine.step()  # the finished prompt's blocks go into the cache at the next step
    turn = PrefillRequest("turn", history + tuple(range(60, 66)), (), GREEDY)
    assert engine._cached_tokens(_Job(turn, {}, 0, 0.0)) == 144
    engine.add(LONG)
    arriving_mid_chunk(engine, turn)
    first = engine.step()
    assert [o.request_id for o in first] == ["turn"] and engine.jobs["long"].num_computed == 64
    assert first[0].num_cached_tokens == 144
    alone_settings = PrefillSettings(64)
    lone = PrefillEngine(LMRunner(lm, 64), alone_settings)
    lone.add(turn)
    while not (outs := lone.step()):
        pass
    assert first[0].first.token_id == outs[0].first.token_id, "as if alone"
    torch.testing.assert_close(first[0].packed_kv, outs[0].packed_kv, rtol=1e-5, atol=1e-5)
    while engine.has_work:
        engine.step()
    assert not engine.jobs and engine.pool.num_referenced() == 0


@dataclass
class _Waiting:
    state_: PrefillState
    taken: bool = False

    def state(self) -> PrefillState:
        return self.state_


def waiting(request_id: str, num_tokens: int, arrival: int, spans=()) -> _Waiting:
    return _Waiting(PrefillState(request_id, num_tokens, 0, tuple(spans), arrival))


def test_jumpers_are_whole_shorter_complete_and_not_aborted_in_the_order_served():
    in_service = PrefillState("video", 2000, 512, (), arrival=0)
    new = [
        waiting("b", 30, 2),
        waiting("a", 10, 3),
        waiting("too_long", 200, 4),  # over one step's budget
        waiting("missing_item", 40, 5, [Span(5, 20, ready=False)]),
        waiting("aborted", 5, 6),
        waiting("media_heavy", 100, 7, [Span(0, 90)]),  # over the step's media budget
    ]
    new.append(_Waiting(new[0].state_, taken=True))  # run already
    key = order_of(Order.SHORTEST_REMAINING, 0.0)
    chosen = jumpers(new, {"aborted"}, in_service, 128, 64, key)
    assert [j.state().request_id for j in chosen] == ["a", "b"]
    short_service = PrefillState("text", 20, 0, (), arrival=1)
    chosen = jumpers(new, set(), short_service, 128, None, key)
    assert [j.state().request_id for j in chosen] == ["aborted", "a"]


def test_jumpers_judge_what_is_left_past_the_cached_prefix():
    in_service = PrefillState("video", 2000, 512, (), arrival=0)
    turn = waiting("turn", 200, 2)  # over one step's 128 tokens, unless mostly cached
    pictured = waiting("pictured", 120, 3, [Span(0, 90)])  # its image in the cached prefix
    key = order_of(Order.SHORTEST_REMAINING, 0.0)
    assert jumpers([turn, pictured], set(), in_service, 128, 64, key) == []
    cached = {"turn": 192, "pictured": 96}
    chosen = jumpers(
        [turn, pictured], set(), in_service, 128, 64, key, lambda j: cached[j.state().request_id]
    )
    assert [j.state().request_id for j in chosen] == ["turn", "pictured"]
