"""Node priority for short prompts (actors/engine/node_priority.py): boards in a temporary directory
stand for the workers of one node. The plain logic with a clock driven by the test; then the
real prefill engine (tiny checkpoint, no Ray) marks a whole prompt's forward urgent and pauses
a long chunk for a peer's, and the encoder worker's tower pauses between its linear layers."""

from __future__ import annotations

import contextlib
import threading
import time
import uuid

import pytest

from actors import idle_cores
from actors.engine.node_priority import NodePriority
from actors.idle_cores import BUSY, IDLE, URGENT, NodeBoard
from actors.thread_priority import NicenessBoost, thread_niceness
from tests.unit.test_idle_cores import live_pid  # noqa: F401 (a fixture)
from tests.unit.test_lm_runner import lm  # noqa: F401 (a fixture)
from tests.unit.test_thread_priority import in_thread_at


@pytest.fixture(autouse=True)
def rescan_every_time(monkeypatch):
    monkeypatch.setattr(idle_cores, "RESCAN_S", 0.0)


@pytest.fixture
def boards(tmp_path, live_pid):  # noqa: F811
    """This process's board and a peer's, on one node."""
    name = f"epd-cores-{uuid.uuid4().hex[:8]}"
    mine, peer = NodeBoard(name, tmp_path), NodeBoard(name, tmp_path, pid=live_pid())
    yield mine, peer
    mine.close()
    peer.close()


class FakeTime:
    """A clock that moves only when told: `work(s)` as compute, `sleep(s)` as a pause."""

    def __init__(self):
        self.now, self.sleeps = 0.0, 0
        self.on_sleep = lambda: None

    def clock(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.now += s
        self.sleeps += 1
        self.on_sleep()


def test_an_urgent_flag_is_busy_to_borrowers_and_restores_what_was_there(boards, tmp_path):
    mine, peer = boards
    flag = lambda: (mine.dir / str(peer.pid)).read_bytes()  # noqa: E731
    peer.set_busy(True)
    peer.set_urgent(True)
    assert flag() == URGENT and mine.others_busy() and mine.others_urgent()
    peer.set_busy(False)  # a step's end inside an urgent forward does not clear it
    assert flag() == URGENT
    peer.set_urgent(False)
    assert flag() == IDLE and not mine.others_busy() and not mine.others_urgent()
    peer.set_busy(True)
    with NodePriority(peer, 1).urgent():
        assert mine.others_urgent()
    assert flag() == BUSY, "back to busy: the step goes on"


def test_a_long_forward_pauses_while_a_peer_is_urgent_and_resumes_when_it_ends(boards):
    mine, peer = boards
    t = FakeTime()
    priority = NodePriority(mine, 1, clock=t.clock, sleep=t.sleep)
    priority.pause()
    assert t.sleeps == 0, "outside a long forward: never"
    peer.set_urgent(True)
    t.on_sleep = lambda: t.sleeps == 3 and peer.set_urgent(False)
    with priority.yielding() as paused_s:
        t.now += 1.0  # a second of compute, then a layer boundary
        priority.pause()
        assert t.sleeps == 3, "it waited until the peer's short prompt was done"
        assert paused_s() == pytest.approx(3 * 0.0005)
        priority.pause()
        assert t.sleeps == 3, "nobody urgent: no wait"
    assert priority.num_pauses == 1 and priority.total_paused_s == pytest.approx(paused_s())


def test_a_forward_pauses_at_most_as_long_as_it_has_computed(boards):
    mine, peer = boards
    t = FakeTime()
    priority = NodePriority(mine, 1, clock=t.clock, sleep=t.sleep)
    peer.set_urgent(True)  # and it stays so: a stream of short prompts
    with priority.yielding() as paused_s:
        t.now += 0.2
        priority.pause()
        assert paused_s() == pytest.approx(0.2), "as long as its compute so far"
        priority.pause()
        assert paused_s() == pytest.approx(0.2), "then not again before it computes more"
        t.now += 0.05
        priority.pause()
        assert paused_s() == pytest.approx(0.25)
    with priority.urgent():  # a short prompt of this process's own runs: it never pauses
        priority.pause()
    assert paused_s() == pytest.approx(0.25)


def test_a_forward_pauses_only_while_the_busy_workers_outnumber_the_cores(
    tmp_path,
    boards,
    live_pid,  # noqa: F811
):
    mine, peer = boards
    t = FakeTime()
    priority = NodePriority(mine, 2, clock=t.clock, sleep=t.sleep)
    peer.set_urgent(True)
    with priority.yielding() as paused_s:
        t.now += 1.0
        priority.pause()
        assert paused_s() == 0.0, "two workers on two cores: each has one"
        third = NodeBoard(mine.dir.name, tmp_path, pid=live_pid())
        third.set_busy(True)
        t.on_sleep = lambda: t.sleeps == 2 and third.set_busy(False)
        priority.pause()
        assert t.sleeps == 2, "three on two: it made way until a core was free again"
    third.close()


def test_a_waiting_short_prompt_makes_its_worker_urgent_and_its_own_chunk_go_on(boards):
    mine, peer = boards
    t = FakeTime()
    waiter = NodePriority(peer, 1, clock=t.clock, sleep=t.sleep)
    waiter.wait_begins("a")
    waiter.wait_begins("b")
    assert mine.others_urgent(), "urgent from its arrival, before its forward"
    with waiter.urgent():  # "a" starts; an urgent forward in progress, "b" still waits
        waiter.wait_ends("a")
    assert mine.others_urgent()
    waiter.wait_ends("b")
    assert not mine.others_urgent(), "nothing short waits or runs: no longer urgent"
    waiter.wait_begins("c")
    mine.set_urgent(True)  # a peer's short prompt runs too
    with waiter.yielding() as paused_s:  # this worker's own long chunk, "c" behind it
        t.now += 1.0
        waiter.pause()
        assert paused_s() == 0.0, "it goes on to the layer boundary where its own prompt runs"


def test_a_short_prompt_that_arrives_during_a_pause_ends_it(boards):
    mine, peer = boards
    t = FakeTime()
    priority = NodePriority(mine, 1, clock=t.clock, sleep=t.sleep)
    peer.set_urgent(True)  # and it stays so
    t.on_sleep = lambda: t.sleeps == 2 and priority.wait_begins("text")  # from the caller's thread
    with priority.yielding() as paused_s:
        t.now += 1.0
        priority.pause()
    assert t.sleeps == 2 and paused_s() == pytest.approx(2 * 0.0005), (
        "it went on to the layer boundary where its own prompt runs, not after the peer's"
    )


class LendingLog:
    """A boost that records what it is asked to lend and give back (no niceness changes)."""

    num_boosts = 0

    def __init__(self):
        self.calls: list[tuple] = []

    def at(self, niceness):
        return contextlib.nullcontext()

    def lend(self, tid, niceness):
        self.calls.append(("lend", tid, niceness))
        return 15

    def give_back(self, tid, niceness):
        self.calls.append(("back", tid, niceness))


def test_a_long_forward_is_lent_the_waits_niceness_until_no_short_prompt_waits(boards):
    mine, _ = boards
    log = LendingLog()
    priority = NodePriority(mine, 1, boost=log)
    priority.wait_begins("early", 0)
    priority.wait_ends("early")
    assert log.calls == [], "no long forward in progress: nothing to lend"
    me = threading.get_native_id()
    with priority.yielding():
        priority.wait_begins("a", 0)
        priority.wait_begins("b", 0)
        assert log.calls == [("lend", me, 0)], "lent once, to the thread in the forward"
        priority.wait_ends("a")
        assert len(log.calls) == 1, "b still waits"
        priority.wait_ends("b")
        assert log.calls[-1] == ("back", me, 15)
        priority.wait_begins("c", 0)
    assert log.calls[-2:] == [("lend", me, 0), ("back", me, 15)], "given back as it ends"
    priority.wait_ends("c")
    with priority.yielding():  # a prompt already waiting as a forward begins
        priority.wait_begins("d", 0)
    assert log.calls[-2:] == [("lend", me, 0), ("back", me, 15)]


def test_a_waiting_prompt_lowers_the_forwards_thread_itself(boards):
    mine, _ = boards
    priority = NodePriority(mine, 1, boost=NicenessBoost())
    in_forward, release, seen = threading.Event(), threading.Event(), {}

    def forward(base):
        with priority.yielding():
            in_forward.set()
            release.wait(10)
            seen["lent"] = thread_niceness()
            priority.wait_ends("text")  # it starts: the forward is its own again
            seen["after"] = thread_niceness()
        return base

    out = {}
    device = threading.Thread(target=lambda: out.update(base=in_thread_at(6, forward)))
    device.start()
    in_forward.wait(10)
    priority.wait_begins("text", thread_niceness())  # from the caller's thread
    release.set()
    device.join(30)
    base = out["base"]
    if priority.boost.refused:  # no CAP_SYS_NICE here: lending is refused (and logged)
        assert seen["lent"] == base + 6
    else:
        assert seen["lent"] == thread_niceness() and priority.boost.num_lent == 1
    assert seen["after"] == base + 6


def test_a_decode_loop_waits_between_steps_at_most_its_credit(boards):
    from actors.engine.node_priority import MAX_STEP_CREDIT_S

    mine, peer = boards
    t = FakeTime()
    decode = NodePriority(mine, 1, clock=t.clock, sleep=t.sleep)
    decode.between_steps(0.02)
    assert t.sleeps == 0, "nobody urgent: no wait"
    peer.set_urgent(True)  # and stays so
    decode.between_steps(0.01)
    assert decode.total_paused_s == pytest.approx(0.03), "as long as its steps since computed"
    decode.between_steps(0.0)
    assert decode.total_paused_s == pytest.approx(0.03), "then not before it steps again"
    decode.between_steps(5.0)  # a long step: the wait is capped
    assert decode.total_paused_s == pytest.approx(0.03 + MAX_STEP_CREDIT_S)
    t.on_sleep = lambda: peer.set_urgent(False)
    decode.between_steps(5.0)
    assert decode.num_pauses == 3 and t.now < 5.0, "the peer's prompt ended: it stepped at once"


def test_a_sleep_the_os_stretched_is_not_owed_by_the_next_steps(boards):
    mine, peer = boards
    t = FakeTime()
    stretched = lambda s: t.sleep(s + 0.05)  # noqa: E731 (a loaded host oversleeps)
    decode = NodePriority(mine, 1, clock=t.clock, sleep=stretched)
    peer.set_urgent(True)  # and stays so
    for _ in range(5):
        decode.between_steps(0.002)
    assert decode.num_pauses == 5, "each step earns a wait of its own again"


def test_a_peer_that_died_urgent_is_forgotten_at_the_next_listing(tmp_path):
    import subprocess
    import sys

    name = f"epd-cores-{uuid.uuid4().hex[:8]}"
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    mine, peer = NodeBoard(name, tmp_path), NodeBoard(name, tmp_path, pid=child.pid)
    peer.set_urgent(True)
    assert mine.others_urgent()
    child.kill()
    child.wait()  # reaped, as Ray's raylet reaps its workers
    assert not mine.others_urgent(), "a dead worker's flag stops no one"
    mine.close()


def test_no_board_no_priority():
    priority = NodePriority(None, 1)
    with priority.urgent(), priority.yielding():
        priority.pause()
    assert priority.num_pauses == 0


def test_the_prefill_engine_marks_whole_prompts_urgent_and_pauses_long_chunks(lm, boards):  # noqa: F811
    pytest.importorskip("torch")
    from actors.engine.lm_runner import LMRunner
    from actors.engine.prefill import PrefillEngine
    from router.worker_settings import PrefillSettings
    from tests.unit.test_engine_preempt import LONG, SHORT, alone, same

    mine, peer = boards
    engine = PrefillEngine(LMRunner(lm, 64), PrefillSettings(64, node_priority=True))
    engine.priority = NodePriority(mine, 1)
    seen: list[bool] = []
    layers = lm.decoder_layers()
    spy = layers[0].register_forward_pre_hook(lambda *_: seen.append(peer.others_urgent()))
    try:
        engine.add(SHORT)
        [short] = engine.step()
        assert seen == [True], "a whole prompt in one forward: the node makes way"
        assert same(short, alone(lm, SHORT, 64))
        seen.clear()
        engine.add(LONG)
        engine.step()
        assert seen == [False], "a chunk of a longer prompt is not urgent"
    finally:
        spy.remove()
    slow = layers[0].register_forward_pre_hook(lambda *_: time.sleep(0.3))  # as compute
    peer.set_urgent(True)  # and stays so: the chunk pauses as long as it computed
    try:
        outs = []
        while engine.has_work:
            outs += engine.step()
    finally:
        slow.remove()
    paused_s = engine.priority.total_paused_s
    assert 0.5 <= paused_s <= 0.8, "each of the two chunks left paused about as long as it ran"
    [long] = outs
    assert same(long, alone(lm, LONG, 64)), "the output is as if it never paused"
    assert 600 <= long.compute_ms < 600 + 250, "pauses are not compute"


def test_the_encoder_tower_pauses_between_its_linear_layers_for_an_urgent_peer(
    ckpt,
    tmp_path,
    monkeypatch,
    live_pid,  # noqa: F811
):
    np = pytest.importorskip("numpy")
    from actors.encoder import EncoderWorker
    from actors.runtime import WorkerSpec
    from actors.types import MediaItem
    from router.types import Modality
    from router.worker_settings import EncoderSettings

    monkeypatch.setattr(idle_cores, "default_root", lambda: tmp_path)
    board = f"epd-cores-{uuid.uuid4().hex[:8]}"
    worker = EncoderWorker(
        WorkerSpec(str(ckpt), "float32", "cpu", 1, 256, board=board), EncoderSettings(1)
    )
    peer = NodeBoard(board, tmp_path, pid=live_pid())
    worker.priority.num_cores = 1  # the two of them oversubscribe it
    pixels = np.random.default_rng(0).integers(0, 256, (32, 32, 3), dtype=np.uint8)
    item = MediaItem(Modality.IMAGE, "a" * 64, data=pixels)
    [alone], paused_s = worker._encode([item])
    assert paused_s == 0.0, "nobody urgent: no pause"
    busy_before_s = worker.busy_s
    peer.set_urgent(True)
    started = time.perf_counter()
    [beside], paused_s = worker._stretched(worker._encode, [item])  # as on the device thread
    wall_s = time.perf_counter() - started
    assert worker.busy_s <= busy_before_s + wall_s - paused_s + 1e-6, "a pause is not load"
    stats = worker.stats()
    assert stats["pauses_for_short"] >= 1 and paused_s > 0, "the tower made way"
    assert stats["paused_for_short_ms"] == pytest.approx(paused_s * 1e3, abs=1e-3)
    assert (beside == alone).all(), "and its output is the same"
    peer.close()


class NicenessLog(LendingLog):
    """A boost that records the niceness each urgent forward asks for."""

    def at(self, niceness):
        self.calls.append(("at", niceness))
        return contextlib.nullcontext()


@pytest.mark.parametrize("urgent_images", [True, False])
def test_a_batch_of_still_images_encodes_urgent_and_other_media_make_way(
    ckpt,
    tmp_path,
    monkeypatch,
    live_pid,  # noqa: F811
    urgent_images,
):
    np = pytest.importorskip("numpy")
    from actors.encoder import EncoderWorker
    from actors.runtime import WorkerSpec
    from actors.types import MediaItem
    from router.types import Modality
    from router.worker_settings import EncoderSettings

    monkeypatch.setattr(idle_cores, "default_root", lambda: tmp_path)
    board = f"epd-cores-{uuid.uuid4().hex[:8]}"
    settings = EncoderSettings(1, urgent_images=urgent_images, urgent_niceness=0)
    worker = EncoderWorker(WorkerSpec(str(ckpt), "float32", "cpu", 1, 256, board=board), settings)
    peer = NodeBoard(board, tmp_path, pid=live_pid())
    worker.priority.boost = log = NicenessLog()
    seen = []  # whether the peer saw this worker urgent while it encoded
    encode = worker.adapter.encode
    monkeypatch.setattr(
        worker.adapter, "encode", lambda items: seen.append(peer.others_urgent()) or encode(items)
    )
    pixels = np.random.default_rng(0).integers(0, 256, (32, 32, 3), dtype=np.uint8)
    [embedding], _ = worker._encode([MediaItem(Modality.IMAGE, "a" * 64, data=pixels)])
    assert seen == [urgent_images] and embedding.shape[0] > 0
    assert log.calls == ([("at", 0)] if urgent_images else []), "at the urgent niceness"
    assert not peer.others_urgent(), "and no longer once it is done"
    monkeypatch.setattr(worker.adapter, "encode", lambda items: seen.append(peer.others_urgent()))
    worker._encode([MediaItem(Modality.VIDEO, "v" * 64, data=np.stack([pixels] * 4))])
    assert seen[-1] is False, "a video's tower is a long forward: it makes way, never urgent"
    peer.close()


def test_a_nodes_cores_are_capped_by_a_containers_cpu_limit(tmp_path):
    from actors.host_cpu import usable_cores

    host = usable_cores(str(tmp_path / "none"))  # no cgroup files: the affinity alone
    assert host >= 1
    (tmp_path / "cpu.max").write_text("100000 100000\n")  # v2: one core's worth
    assert usable_cores(str(tmp_path)) == 1
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert usable_cores(str(tmp_path)) == host, "no limit"
    (tmp_path / "cpu.max").unlink()
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("50000\n")  # v1: half a core
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert usable_cores(str(tmp_path)) == 1, "at least one"
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    assert usable_cores(str(tmp_path)) == host
