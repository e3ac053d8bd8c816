"""actors/thread_priority.py: a worker's threads at the niceness its pool asks for."""

from __future__ import annotations

import errno
import json
import logging
import os
import subprocess
import sys
import textwrap
import threading

import pytest

from actors import thread_priority
from actors.thread_priority import NicenessBoost, set_process_niceness, thread_niceness
from cluster.config import DecodePoolConfig, EncoderPoolConfig, PrefillPoolConfig

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice")

_CHILD = textwrap.dedent(
    """
    import json, os, threading
    from actors.thread_priority import set_process_niceness

    def nice_of(tid):
        stat = open(f"/proc/self/task/{tid}/stat").read()
        return int(stat[stat.rindex(")") + 2:].split()[16])

    before = threading.Thread(target=threading.Event().wait, args=(5,), daemon=True)
    before.start()
    here = set_process_niceness(os.nice(0) + 3)
    after = threading.Thread(target=threading.Event().wait, args=(5,), daemon=True)
    after.start()
    print(json.dumps({"here": here, "base": os.nice(0) - 3,
                      "threads": [nice_of(t) for t in os.listdir("/proc/self/task")]}))
    """
)


def test_every_thread_takes_the_niceness_and_threads_started_later_inherit_it():
    # a child process: niceness raised here could not be lowered back without privilege
    done = subprocess.run(
        [sys.executable, "-c", _CHILD], capture_output=True, text=True, check=True, timeout=30
    )
    out = json.loads(done.stdout)
    assert out["here"] == out["base"] + 3
    assert len(out["threads"]) >= 3, "the main thread, one started before, one after"
    assert set(out["threads"]) == {out["base"] + 3}, out


def test_a_refused_lowering_is_logged_and_leaves_the_threads_as_they_were(monkeypatch, caplog):
    def refuse(which, who, niceness):
        raise PermissionError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(thread_priority.os, "setpriority", refuse)
    with caplog.at_level(logging.WARNING, logger=thread_priority.__name__):
        assert set_process_niceness(-5) == thread_niceness()
    assert "CAP_SYS_NICE" in caplog.text and "Operation not permitted" in caplog.text
    assert len(caplog.records) == 1, "one line for the process, not one per thread"


def test_unset_leaves_every_thread_alone(monkeypatch):
    def must_not_run(*args):
        raise AssertionError("setpriority called")

    monkeypatch.setattr(thread_priority.os, "setpriority", must_not_run)
    assert set_process_niceness(None) == os.getpriority(os.PRIO_PROCESS, 0)


def test_decode_runs_at_niceness_zero_by_default_and_the_other_stages_at_rays():
    assert DecodePoolConfig().niceness == 0
    assert EncoderPoolConfig().niceness is None and PrefillPoolConfig().niceness is None
    with pytest.raises(ValueError, match="niceness"):
        DecodePoolConfig(niceness=20)


def in_thread_at(raise_by: int, body):
    """`body(base)` on a fresh thread whose niceness is `raise_by` above the process's (raising
    needs no privilege, and only that thread changes); returns what it returned."""
    out = {}

    def run():
        base = thread_niceness()
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), base + raise_by)
        out["value"] = body(base)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(30)
    return out["value"]


def test_a_boost_lowers_the_thread_while_it_lasts_and_gives_it_back():
    def body(base):
        boost, seen = NicenessBoost(), {}
        with boost.at(base + 1):
            seen["inside"] = thread_niceness()
            with boost.at(base + 1):  # nested: nothing to lower
                seen["nested"] = thread_niceness()
        seen["after"] = thread_niceness()
        with boost.at(None):
            seen["unset"] = thread_niceness()
        return base, boost, seen

    base, boost, seen = in_thread_at(6, body)
    assert seen["after"] == seen["unset"] == base + 6, "back to the thread's own"
    if boost.refused:  # no CAP_SYS_NICE here: it keeps its niceness
        assert seen["inside"] == seen["nested"] == base + 6 and boost.num_boosts == 0
    else:
        assert seen["inside"] == seen["nested"] == base + 1 and boost.num_boosts == 1


def test_a_refused_boost_is_logged_once_and_not_tried_again(monkeypatch, caplog):
    calls = []

    def refuse(which, who, niceness):
        calls.append(niceness)
        raise PermissionError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(thread_priority.os, "setpriority", refuse)
    boost, before = NicenessBoost(), thread_niceness()
    with caplog.at_level(logging.WARNING, logger=thread_priority.__name__):
        for _ in range(3):
            with boost.at(before - 1):
                assert thread_niceness() == before
    assert boost.refused and calls == [before - 1], "tried once"
    assert len(caplog.records) == 1 and "CAP_SYS_NICE" in caplog.text


def test_a_refused_lending_is_logged_once_and_nothing_is_tried_again(monkeypatch, caplog):
    calls = []

    def refuse(which, who, niceness):
        calls.append(niceness)
        raise PermissionError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(thread_priority.os, "setpriority", refuse)
    boost, before = NicenessBoost(), thread_niceness()
    tid = threading.get_native_id()
    with caplog.at_level(logging.WARNING, logger=thread_priority.__name__):
        assert boost.lend(tid, before - 1) is None and boost.lend(tid, before - 1) is None
        with boost.at(before - 1):
            pass
    assert boost.refused and calls == [before - 1] and boost.num_lent == 0
    assert len(caplog.records) == 1 and "CAP_SYS_NICE" in caplog.text


def test_prefill_boosts_short_forwards_to_niceness_zero_by_default():
    assert PrefillPoolConfig().urgent_niceness == 0
    assert PrefillPoolConfig().settings().urgent_niceness == 0
    assert PrefillPoolConfig(urgent_niceness=None).settings().urgent_niceness is None
