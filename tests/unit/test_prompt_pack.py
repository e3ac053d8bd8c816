"""Whole prompts in one forward (actors/engine/prompt_pack.py) in the real prefill engine (no
Ray) on the tiny checkpoint: prompts planned into one step share a forward and leave together,
each with the first token and KV it has alone; a prompt with a cached prefix, or with packing
off, runs on its own."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from actors.engine.lm_runner import LMRunner  # noqa: E402
from actors.engine.prefill import PrefillEngine, PrefillOutput  # noqa: E402
from actors.engine.prompt_kv import PromptKV  # noqa: E402
from actors.engine.prompt_pack import PackPart, pack_mask  # noqa: E402
from actors.types import PrefillRequest  # noqa: E402
from router.worker_settings import PrefillSettings  # noqa: E402
from tests.unit.test_engine_preempt import alone  # noqa: E402
from tests.unit.test_lm_runner import GREEDY, lm  # noqa: E402, F401 (a fixture)

PROMPTS = [
    PrefillRequest(f"p{n}", tuple(range(7 * n + 3, 7 * n + 3 + n)), (), GREEDY)
    for n in (5, 17, 9, 40)
]


def test_the_mask_lets_each_new_token_see_its_own_prompts_past_and_earlier_tokens():
    hidden, past = torch.zeros(1, 2, 4), PromptKV(1, 3)
    past.extend([torch.zeros(1, 2, 1, 1, 4)])
    parts = [
        PackPart(hidden, torch.zeros(1, 2), PromptKV(1, 2)),
        PackPart(hidden, torch.zeros(1, 2), past),
    ]
    # slots: prompt 0's two new tokens, then prompt 1's past token and its two new tokens
    want = torch.tensor(
        [
            [1, 0, 0, 0, 0],
            [1, 1, 0, 0, 0],
            [0, 0, 1, 1, 0],
            [0, 0, 1, 1, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(pack_mask(parts, torch.device("cpu"))[0, 0], want)


def steps_of(engine: PrefillEngine) -> list[list[str]]:
    steps = []
    while engine.has_work:
        steps.append([o.request_id for o in engine.step()])
    return steps


def as_alone(lm, out: PrefillOutput, request: PrefillRequest) -> None:
    ref = alone(lm, request, 64)
    assert out.first.token_id == ref.first.token_id, request.request_id
    assert out.packed_kv.shape == ref.packed_kv.shape and out.packed_kv.is_contiguous()
    torch.testing.assert_close(out.packed_kv, ref.packed_kv, rtol=1e-4, atol=1e-5)


def test_prompts_planned_together_share_one_forward_and_leave_as_if_alone(lm):
    engine = PrefillEngine(LMRunner(lm, 64), PrefillSettings(64, pack_prompts=True))
    forwards = []
    handle = lm.decoder_layers()[0].register_forward_pre_hook(lambda *_: forwards.append(1))
    try:
        for request in PROMPTS:
            engine.add(request)
        outs = engine.step()
    finally:
        handle.remove()
    # Shortest first within the 64-token budget: 5 + 9 + 17 in one forward; 40 would not fit.
    assert [o.request_id for o in outs] == ["p5", "p9", "p17"] and len(forwards) == 1
    assert steps_of(engine) == [["p40"]]
    stats = engine.stats()
    assert (stats["packed_forwards"], stats["packed_prompts"]) == (1, 3)
    by_id = {r.request_id: r for r in PROMPTS}
    for out in outs:
        as_alone(lm, out, by_id[out.request_id])
        assert out.compute_ms > 0


def test_without_packing_each_prompt_has_its_own_step(lm):
    engine = PrefillEngine(LMRunner(lm, 64), PrefillSettings(64, pack_prompts=False))
    for request in PROMPTS:
        engine.add(request)
    assert steps_of(engine) == [["p5"], ["p9"], ["p17"], ["p40"]]


def one_step_packs(engine: PrefillEngine, lm) -> list[PrefillOutput]:
    """The next step's outputs, checking it ran one forward."""
    forwards = []
    handle = lm.decoder_layers()[0].register_forward_pre_hook(lambda *_: forwards.append(1))
    try:
        outs = engine.step()
    finally:
        handle.remove()
    assert len(forwards) == 1
    return outs


def test_a_prompt_with_a_cached_prefix_packs_after_its_prefix(lm):
    settings = PrefillSettings(64, prefix_block_tokens=4, prefix_cache_mb=8, pack_prompts=True)
    engine = PrefillEngine(LMRunner(lm, 64), settings)
    base = PROMPTS[1]
    engine.add(base)
    assert steps_of(engine) == [["p17"], []], "its blocks are kept at the step after"
    again = PrefillRequest("again", base.prompt_token_ids + (50, 51), (), GREEDY)
    engine.add(again)
    engine.add(PROMPTS[0])
    outs = one_step_packs(engine, lm)
    # "again" has 3 tokens left after its 16 cached ones: first.
    assert [o.request_id for o in outs] == ["again", "p5"] and outs[0].num_cached_tokens == 16
    as_alone(lm, outs[0], again)
    as_alone(lm, outs[1], PROMPTS[0])


def test_a_long_prompts_last_chunk_runs_alone(lm):
    """Its earlier chunks would fill the pack's KV buffer: at most a step's tokens of slots."""
    engine = PrefillEngine(LMRunner(lm, 64), PrefillSettings(64, pack_prompts=True))
    long = PrefillRequest("long", tuple(range(200, 280)), (), GREEDY)  # 80 tokens
    engine.add(long)
    assert engine.step() == [] and engine.jobs["long"].num_computed == 64
    engine.add(PROMPTS[0])
    engine.add(PROMPTS[2])
    assert steps_of(engine) == [["p5", "p9"], ["long"]]


def test_a_short_prompt_does_not_wait_for_a_much_longer_ones_forward(lm):
    engine = PrefillEngine(LMRunner(lm, 64), PrefillSettings(64, pack_prompts=True))
    for request in (PROMPTS[0], PROMPTS[2], PROMPTS[1], PROMPTS[3]):
        engine.add(request)
    # 5 + 9 (at most twice 5) + 17 (at most twice 14); 40 does not fit the step's 64 tokens
    assert steps_of(engine) == [["p5", "p9", "p17"], ["p40"]]
    engine.add(PrefillRequest("short", (5, 6, 7), (), GREEDY))
    engine.add(PrefillRequest("long", tuple(range(300, 340)), (), GREEDY))
    assert steps_of(engine) == [["short"], ["long"]]
