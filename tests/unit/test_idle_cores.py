"""Idle-core borrowing (actors/idle_cores.py): boards in a temporary directory stand for the
workers of one node (each board names a live process, as each worker is one); then the
prefill worker class itself borrows only while its peer is idle."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import uuid

import pytest

from actors import idle_cores
from actors.host_cpu import HostCpu
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
    host = HostCpu(4, read=lambda: (fake.host_s, fake.own_s), clock=lambda: fake.now_s)
    policy = ThreadPolicy(1, 4, NodeBoard("fleet", tmp_path), host)
    fake.spend(1.0, others_cores=0.2, own_cores=0.0)  # Ray's daemons on an idle host
    assert policy.for_step() == 4, "an idle host: every core"
    fake.spend(0.1, others_cores=1.8, own_cores=4.0)  # an ingress streaming beside the step
    assert policy.for_step() == 2, "its own 4 threads do not count against it; the others' 2 do"
    fake.spend(0.01, others_cores=4.0, own_cores=0.0)
    assert policy.for_step() == 2, "within the 50 ms window the last answer stands"
    fake.spend(0.1, others_cores=3.9, own_cores=0.1)
    assert policy.for_step() == 1, "a saturated host: own threads only, never fewer"


def test_a_host_without_proc_lends_what_the_board_allows(tmp_path):
    host = HostCpu(2, read=lambda: None)
    assert host.spare_cores() == 2.0
    assert ThreadPolicy(1, 2, NodeBoard("fleet", tmp_path), host).for_step() == 2


def test_this_host_reports_its_own_counters():
    from actors.host_cpu import read_proc

    first = read_proc()
    assert first is not None, "Linux: /proc is there"
    sum(range(3_000_000))  # some CPU of this process's own
    second = read_proc()
    assert second[1] > first[1] or second[0] > first[0], "the counters move"
    assert second[0] >= second[1], "the host's busy time includes this process's"


def test_the_prefill_worker_steps_with_borrowed_threads_only_while_its_peer_is_idle(
    ckpt, tmp_path, monkeypatch, live_pid
):
    torch = pytest.importorskip("torch")
    from actors import runtime
    from actors.prefill import PrefillWorker
    from actors.runtime import WorkerSpec
    from actors.types import PrefillRequest, SamplingParams
    from router.worker_settings import PrefillSettings

    monkeypatch.setattr(idle_cores, "default_root", lambda: tmp_path)
    # the suite's other processes must not decide it: a host they leave idle
    monkeypatch.setattr(runtime, "HostCpu", lambda: HostCpu(2, read=lambda: (0.0, 0.0)))
    board = f"epd-cores-{uuid.uuid4().hex[:8]}"
    spec = WorkerSpec(str(ckpt), "float32", "cpu", 1, 256, idle_torch_threads=2, board=board)
    worker = PrefillWorker(spec, PrefillSettings(max_chunk_tokens=64))
    peer = NodeBoard(board, tmp_path, pid=live_pid())
    greedy = SamplingParams(temperature=0.0, max_tokens=1)
    try:
        asyncio.run(worker.prefill(PrefillRequest("a", tuple(range(10, 40)), (), greedy)))
        assert worker.stats()["step_threads"] == 2, "an idle node: the step borrowed the idle core"
        peer.set_busy(True)
        asyncio.run(worker.prefill(PrefillRequest("b", tuple(range(10, 40)), (), greedy)))
        assert worker.stats()["step_threads"] == 1, "a busy peer: own thread only"
        assert (tmp_path / board / str(worker.pid())).read_bytes() == idle_cores.IDLE, (
            "nothing left to do: marked idle"
        )
    finally:
        torch.set_num_threads(1)
