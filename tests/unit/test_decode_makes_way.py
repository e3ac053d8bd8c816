"""The node makes way for a short prompt from its arrival (actors/engine/node_priority.py):
the real prefill engine marks its worker urgent while such a prompt waits, and the real decode
worker (tiny checkpoint, no Ray) waits between its steps meanwhile, with the same tokens."""

from __future__ import annotations

import dataclasses
import uuid

import pytest

pytest.importorskip("torch")

from actors import idle_cores  # noqa: E402
from actors.decode import DecodeWorker  # noqa: E402
from actors.engine.node_priority import NodePriority  # noqa: E402
from actors.idle_cores import NodeBoard  # noqa: E402
from actors.prefill import PrefillWorker  # noqa: E402
from actors.runtime import WorkerSpec  # noqa: E402
from actors.thread_priority import NicenessBoost, thread_niceness  # noqa: E402
from router.worker_settings import DecodeSettings, PrefillSettings  # noqa: E402
from tests.unit.test_engine_preempt import LONG, SHORT  # noqa: E402
from tests.unit.test_idle_cores import live_pid  # noqa: E402, F401 (a fixture)
from tests.unit.test_row_isolation import GREEDY, PROMPTS, _alone  # noqa: E402
from tests.unit.test_thread_priority import in_thread_at  # noqa: E402


@pytest.fixture
def boards(tmp_path, live_pid, monkeypatch):  # noqa: F811
    """A worker's board and a peer's, on one node of one core."""
    monkeypatch.setattr(idle_cores, "RESCAN_S", 0.0)
    name = f"epd-cores-{uuid.uuid4().hex[:8]}"
    mine, peer = NodeBoard(name, tmp_path), NodeBoard(name, tmp_path, pid=live_pid())
    yield mine, peer
    mine.close()
    peer.close()


@pytest.fixture(scope="module")
def spec(ckpt):
    return WorkerSpec(str(ckpt), "float32", "cpu", 1, 256)


def test_a_short_prompt_is_urgent_from_its_arrival_until_it_runs(spec, boards):
    mine, peer = boards
    engine = PrefillWorker(spec, PrefillSettings(64, node_priority=True)).engine
    engine.priority = NodePriority(mine, 1)
    engine.add(LONG)  # 160 tokens: chunks of 64, never urgent
    assert not peer.others_urgent()
    engine.add(SHORT)
    assert peer.others_urgent(), "waiting: the node's long forwards make way already"
    while engine.has_work:
        engine.step()
    assert not peer.others_urgent(), "it ran and left"
    engine.add(dataclasses.replace(SHORT, request_id="gone"))
    engine.abort("gone")
    engine.step()
    assert not peer.others_urgent(), "an aborted prompt waits no more"
    off = PrefillWorker(spec, PrefillSettings(64, node_priority=False)).engine
    off.priority = NodePriority(mine, 1)
    off.add(SHORT)
    assert not peer.others_urgent(), "node_priority off: nobody makes way"


@pytest.mark.parametrize("make_way", [True, False])
def test_decode_waits_between_steps_for_a_peers_short_prompt_with_the_same_tokens(
    spec, boards, make_way
):
    mine, peer = boards
    prefill = PrefillWorker(spec, PrefillSettings(64))
    settings = DecodeSettings(8, make_way_for_short=make_way)
    alone = _alone(prefill, DecodeWorker(spec, settings), "alone", PROMPTS[1], GREEDY)
    decode = DecodeWorker(spec, settings)
    decode.priority = NodePriority(mine, 1)
    peer.set_urgent(True)  # a short prompt's forward on the node's one core, all along
    beside = _alone(prefill, decode, "beside", PROMPTS[1], GREEDY)
    assert beside == alone, "a wait changes no token"
    stats = decode.stats()  # as /health?verbose=1 shows it
    if make_way:
        # not before a loop's first step (no credit yet): the loop may stop and start again
        assert stats["pauses_for_short"] >= GREEDY.max_tokens // 2, "it waited between steps"
        assert stats["paused_for_short_ms"] > 0
    else:
        assert stats["pauses_for_short"] == 0


@pytest.mark.parametrize("node_priority", [True, False])
def test_a_short_prompts_forward_runs_at_urgent_niceness_and_a_chunk_at_the_workers(
    spec, boards, node_priority
):
    mine, _ = boards
    settings = PrefillSettings(64, node_priority=node_priority, urgent_niceness=None)

    def body(base):
        engine = PrefillWorker(spec, dataclasses.replace(settings, urgent_niceness=base)).engine
        engine.priority = NodePriority(mine, 1, boost=NicenessBoost())
        forward, seen = engine.runner.forward_chunk, []

        def watched(*args):
            seen.append((args[4] - args[3], thread_niceness()))  # tokens, niceness
            return forward(*args)

        engine.runner.forward_chunk = watched
        for request in (LONG, SHORT):
            engine.add(request)
            while engine.has_work:
                engine.step()
        return base, engine.priority.boost, seen, thread_niceness()

    base, boost, seen, after = in_thread_at(5, body)
    assert after == base + 5, "back to the worker's own after each short forward"
    chunks, short = seen[:-1], seen[-1]
    assert short[0] == len(SHORT.prompt_token_ids) and all(n == 64 or n == 32 for n, _ in chunks)
    assert {nice for _, nice in chunks} == {base + 5}, "a long prompt's chunks: the worker's"
    boosted = node_priority and not boost.refused  # lowering needs CAP_SYS_NICE
    assert short[1] == (base if boosted else base + 5)


@pytest.mark.parametrize("short_waits", [True, False])
def test_a_waiting_short_prompt_goes_before_a_finished_prompts_blocks_are_kept(
    spec, boards, short_waits
):
    mine, _ = boards
    settings = PrefillSettings(64, prefix_cache_mb=4.0, node_priority=True)
    engine = PrefillWorker(spec, settings).engine
    engine.priority = NodePriority(mine, 1)
    engine.add(LONG)
    while not any(out.request_id == LONG.request_id for out in engine.step()):
        pass
    assert not engine.pool.blocks, "kept at the next step, not before the first token leaves"
    forward, blocks_seen = engine.runner.forward_chunk, []

    def watched(*args):
        blocks_seen.append(len(engine.pool.blocks))
        return forward(*args)

    engine.runner.forward_chunk = watched
    if short_waits:
        engine.add(SHORT)
    engine.step()
    num_blocks = len(LONG.prompt_token_ids) // settings.prefix_block_tokens
    if short_waits:
        assert blocks_seen == [0], "the short prompt ran first"
        assert not engine.pool.blocks and engine.has_work, "the blocks wait for the next step"
        engine.step()
    assert len(engine.pool.blocks) == num_blocks and not engine.has_work
