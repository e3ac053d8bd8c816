"""Idle-core borrowing (actors/idle_cores.py): boards in a temporary directory stand for the
workers of one node (each board names a live process, as each worker is one); then the
prefill worker class itself borrows only while its peer is idle."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
import uuid

import pytest

from actors import idle_cores
from actors.host_cpu import NUM_MARKS, TICK_S, HostCpu
from actors.idle_cores import NodeBoard, ThreadPolicy


@pytest.fixture(autouse=True)
def rescan_every_time(monkeypatch):
    monkeypatch.setattr(idle_cores, "RESCAN_S", 0.0)


@pytest.fixture
def live_pid():
    """Makes another live process than this one (a peer board must name a live worker)."""
    children = []

    def make() -> int:
        children.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]))
        return children[-1].pid

    yield make
    for child in children:
        child.kill()
        child.wait()


def test_a_worker_borrows_only_while_every_peer_is_idle(tmp_path, live_pid):
    mine = ThreadPolicy(1, 2, NodeBoard("fleet", tmp_path))
    peer_board = NodeBoard("fleet", tmp_path, pid=live_pid())
    peer = ThreadPolicy(1, 2, peer_board)
    assert mine.for_step() == 2, "nobody else has work: both cores"
    mine.step_done(more_work=False)
    assert peer.for_step() == 2
    peer.step_done(more_work=True)  # a decode loop between steps still has work
    assert mine.for_step() == 1, "the peer has work: own threads only"
    mine.step_done(more_work=True)
    peer_board.set_busy(False)
    assert peer.for_step() == 1, "and the peer, starting now, sees this one busy"
    peer.step_done(more_work=False)
    mine.step_done(more_work=False)
    assert mine.for_step() == 2, "all idle again"


def test_two_workers_starting_together_do_not_both_borrow(tmp_path, live_pid):
    a, b = (
        ThreadPolicy(1, 2, NodeBoard("fleet", tmp_path)),
        ThreadPolicy(1, 2, NodeBoard("fleet", tmp_path, pid=live_pid())),
    )
    assert a.for_step() == 2
    assert b.for_step() == 1, "a marked itself busy before it looked, so b sees it"


def dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_boards_of_fleets_whose_workers_are_all_dead_are_swept_when_a_worker_starts(
    tmp_path, live_pid
):
    NodeBoard(f"{idle_cores.BOARD_PREFIX}gone", tmp_path, pid=dead_pid())  # killed: never closed
    NodeBoard(f"{idle_cores.BOARD_PREFIX}half", tmp_path, pid=dead_pid())
    NodeBoard(f"{idle_cores.BOARD_PREFIX}half", tmp_path, pid=live_pid())
    (tmp_path / f"{idle_cores.BOARD_PREFIX}starting").mkdir()  # a worker between mkdir and its file
    mine = NodeBoard(f"{idle_cores.BOARD_PREFIX}new", tmp_path)
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == [f"{idle_cores.BOARD_PREFIX}{n}" for n in ("half", "new", "starting")], left
    half = NodeBoard(f"{idle_cores.BOARD_PREFIX}half", tmp_path)
    half.others_busy()  # its rescan drops the dead peer's file, idle flag or not
    assert len(list((tmp_path / f"{idle_cores.BOARD_PREFIX}half").iterdir())) == 2
    mine.close()


def test_a_dead_workers_busy_flag_is_ignored_and_its_file_removed(tmp_path):
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    dead = NodeBoard("fleet", tmp_path, pid=child.pid)
    dead.set_busy(True)  # died in a step
    mine = NodeBoard("fleet", tmp_path)
    assert not mine.others_busy()
    assert not (tmp_path / "fleet" / str(child.pid)).exists()


def test_boards_of_other_fleets_and_a_closed_board_do_not_count(tmp_path, live_pid):
    mine = NodeBoard("fleet-a", tmp_path)
    other_fleet = NodeBoard("fleet-b", tmp_path, pid=live_pid())
    other_fleet.set_busy(True)
    assert not mine.others_busy()
    peer = NodeBoard("fleet-a", tmp_path, pid=live_pid())
    peer.set_busy(True)
    assert mine.others_busy()
    peer.close()
    assert not mine.others_busy()
    mine.close()
    assert not (tmp_path / "fleet-a").exists(), "the last worker of the fleet removes the directory"


def test_no_board_or_nothing_to_borrow_means_own_threads(tmp_path, live_pid):
    assert ThreadPolicy(1, 2, None).for_step() == 1
    assert ThreadPolicy(2, None, None).for_step() == 2
    lender = ThreadPolicy(1, 2, NodeBoard("fleet", tmp_path))
    non_borrower = ThreadPolicy(1, None, NodeBoard("fleet", tmp_path, pid=live_pid()))
    assert non_borrower.for_step() == 1
    assert lender.for_step() == 1, (
        "a worker that never borrows still posts its work (a decode loop)"
    )


class FakeHost:
    """A host's /proc counters that the test moves: CPU seconds of the host and of this process."""

    def __init__(self):
        self.now_s, self.host_s, self.own_s = 0.0, 0.0, 0.0

    def spend(self, seconds: float, others_cores: float, own_cores: float) -> None:
        self.now_s += seconds
        self.host_s += seconds * (others_cores + own_cores)
        self.own_s += seconds * own_cores


def test_a_worker_borrows_only_the_cores_the_rest_of_the_host_leaves_idle(tmp_path):
    fake = FakeHost()
    host = HostCpu(4, read=lambda peers: (fake.host_s, fake.own_s), clock=lambda: fake.now_s)
    policy = ThreadPolicy(1, 4, NodeBoard("fleet", tmp_path), host)
    fake.spend(1.0, others_cores=0.2, own_cores=0.0)  # Ray's daemons on an idle host
    assert policy.for_step() == 4, "an idle host: every core"
    for _ in range(NUM_MARKS):  # the sampler's ticks: the idle second leaves the window
        fake.spend(TICK_S, others_cores=1.8, own_cores=4.0)  # an ingress streaming beside
        host.tick()
    assert policy.for_step() == 2, "its own 4 threads do not count against it; the others' 2 do"
    fake.spend(TICK_S / 5, others_cores=4.0, own_cores=0.0)
    assert policy.for_step() == 2, "within a tick the last answer stands"
    for _ in range(NUM_MARKS):
        fake.spend(TICK_S, others_cores=3.9, own_cores=0.1)
        host.tick()
    assert policy.for_step() == 1, "a saturated host: own threads only, never fewer"


def test_the_window_is_the_last_ticks_not_the_gap_since_the_last_step():
    """At idle a worker steps once a request; a reading over the whole gap held the request's
    own earlier work (the client, the ingress). The sampler's window ends at the step."""
    fake = FakeHost()
    host = HostCpu(2, read=lambda peers: (fake.host_s, fake.own_s), clock=lambda: fake.now_s)
    for _ in range(4):  # a busy second, read once a tick
        fake.spend(0.25, others_cores=1.5, own_cores=0.0)
        host.tick()
    assert host.spare_cores() == pytest.approx(0.5)
    for _ in range(NUM_MARKS):  # then quiet ticks
        fake.spend(TICK_S, others_cores=0.1, own_cores=0.0)
        host.tick()
    assert host.spare_cores() == pytest.approx(1.9), "only the last ticks count"


def test_a_peer_that_was_busy_in_the_window_does_not_count_against_borrowing():
    """One request after another: the encoder's work of the last request is in the prefill
    worker's window, but the board says the encoder is idle now; only the rest counts."""
    fake, peer_s, peers = FakeHost(), [0.0], [frozenset({4242})]
    host = HostCpu(
        2,
        peers=lambda: peers[0],
        read=lambda pids: (fake.host_s, fake.own_s + (peer_s[0] if 4242 in pids else 0.0)),
        clock=lambda: fake.now_s,
    )
    fake.spend(0.4, others_cores=1.3, own_cores=0.0)  # the peer 1.0 of it, Ray's daemons 0.3
    peer_s[0] += 0.4 * 1.0
    assert host.spare_cores() == pytest.approx(1.7), "only the daemons' 0.3 core counts"
    peers[0] = frozenset()
    fake.spend(0.4, others_cores=1.3, own_cores=0.0)
    assert host.spare_cores() == pytest.approx(1.7), "the peer left: a new baseline"
    fake.spend(0.4, others_cores=1.3, own_cores=0.0)
    assert host.spare_cores() == pytest.approx(0.7), "a process not a peer counts"


def test_a_worker_that_does_not_borrow_still_lists_its_peers_for_the_host_reading(
    tmp_path, live_pid
):
    """The host reading leaves out the peers the board lists; a worker whose reading said
    "no spare core" must still list them, or their CPU keeps its reading low for ever."""
    board = NodeBoard("fleet", tmp_path)
    host = HostCpu(2, peers=board.peer_pids, read=lambda pids: None)
    host._spare = 0.4  # a reading that says no core is spare
    peer = live_pid()
    NodeBoard("fleet", tmp_path, pid=peer)
    assert ThreadPolicy(1, 2, board, host).for_step() == 1
    assert board.peer_pids() == {peer}, "listed although the step did not borrow"


def test_the_sampler_thread_keeps_the_reading_fresh():
    reads = []
    host = HostCpu(2, read=lambda peers: reads.append(peers) or (0.0, 0.0)).start()
    time.sleep(TICK_S * 6)
    assert len(reads) >= 3, "it reads on its own, once a tick"
    assert host.spare_cores() == 2.0


def test_the_reader_adds_the_peers_cpu_and_skips_one_that_is_gone():
    from actors.host_cpu import ProcReader

    reader = ProcReader()
    busy = "import time; sum(range(20_000_000)); time.sleep(60)"
    child = subprocess.Popen([sys.executable, "-c", busy])
    try:
        deadline = time.monotonic() + 20  # its busy part, however long a loaded host takes
        while True:
            alone, with_peer = reader()[1], reader([child.pid, 2**22 + 1])[1]
            if with_peer - alone > 0.1 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert with_peer - alone > 0.1, "the peer's CPU seconds are in the second reading"
    finally:
        child.kill()
        child.wait()
        reader.close()


def test_a_host_without_proc_lends_what_the_board_allows(tmp_path):
    host = HostCpu(2, read=lambda peers: None)
    assert host.spare_cores() == 2.0
    assert ThreadPolicy(1, 2, NodeBoard("fleet", tmp_path), host).for_step() == 2


def test_this_host_reports_its_own_counters():
    from actors.host_cpu import ProcReader

    reader = ProcReader()
    first = reader()
    assert first is not None, "Linux: /proc is there"
    sum(range(3_000_000))  # some CPU of this process's own
    second = reader()
    assert second[1] > first[1] or second[0] > first[0], "the counters move"
    assert second[0] >= second[1], "the host's busy time includes this process's"


def test_the_prefill_worker_borrows_for_a_big_step_only_while_its_peer_is_idle(
    ckpt, tmp_path, monkeypatch, live_pid
):
    torch = pytest.importorskip("torch")
    from actors import runtime
    from actors.prefill import MIN_BORROW_TOKENS, PrefillWorker
    from actors.runtime import WorkerSpec
    from actors.types import PrefillRequest, SamplingParams
    from router.worker_settings import PrefillSettings

    monkeypatch.setattr(idle_cores, "default_root", lambda: tmp_path)
    # the suite's other processes must not decide it: a host they leave idle
    monkeypatch.setattr(
        runtime, "HostCpu", lambda peers: HostCpu(2, peers, read=lambda pids: (0.0, 0.0))
    )
    board = f"epd-cores-{uuid.uuid4().hex[:8]}"
    spec = WorkerSpec(str(ckpt), "float32", "cpu", 1, 256, idle_torch_threads=2, board=board)
    worker = PrefillWorker(spec, PrefillSettings(max_chunk_tokens=MIN_BORROW_TOKENS + 16))
    peer = NodeBoard(board, tmp_path, pid=live_pid())
    greedy = SamplingParams(temperature=0.0, max_tokens=1)

    def prefill(request_id: str, num_tokens: int) -> int:
        prompt = tuple(range(10, 10 + num_tokens))
        asyncio.run(worker.prefill(PrefillRequest(request_id, prompt, (), greedy)))
        return worker.stats()["step_threads"]

    try:
        assert prefill("a", MIN_BORROW_TOKENS) == 2, "an idle node: the step borrowed the core"
        assert prefill("b", 30) == 1, "a small step: waking a second thread costs more"
        peer.set_busy(True)
        assert prefill("c", MIN_BORROW_TOKENS + 8) == 1, "a busy peer: own thread only"
        assert (tmp_path / board / str(worker.pid())).read_bytes() == idle_cores.IDLE, (
            "nothing left to do: marked idle"
        )
        stats = worker.stats()
        assert (stats["steps"], stats["borrowed_steps"]) == (3, 1), "one step of three borrowed"
    finally:
        torch.set_num_threads(1)


def test_a_kept_reader_reads_fresh_counters_and_lets_go_of_peers_that_leave():
    from actors.host_cpu import ProcReader

    reader = ProcReader()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        first = reader([child.pid])
        assert len(reader._fds) == 3, "the host's, this process's and the peer's files, kept"
        sum(range(5_000_000))  # some CPU of this process's own
        second = reader([child.pid])
        assert second[1] > first[1], "a kept file read again is generated anew"
        reader([])
        assert len(reader._fds) == 2, "a peer that left the list is let go"
        child.kill()
        child.wait()
        assert reader([child.pid]) is not None, "a peer that is gone counts nothing"
        assert len(reader._fds) == 2, "nor is its file kept"
    finally:
        child.kill()
        reader.close()
    assert reader._fds == {}
