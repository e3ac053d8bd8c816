"""A worker process's niceness (Linux). Ray starts its Python workers at niceness 15 and leaves
its own threads (gRPC, the object store's) at 0, so each such thread on the node, and every
other stage's, preempts a decode step the moment it wakes, or the thread that holds the
step's GIL. Niceness is per thread on Linux: every thread of the process is set, and threads
started later inherit it from the one that starts them. Lowering it needs CAP_SYS_NICE (root,
or a raised RLIMIT_NICE); without it the threads keep what they had and the log says so once.
Plain os and threading, no torch."""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Iterator
from pathlib import Path

log = logging.getLogger(__name__)
TASKS = Path("/proc/self/task")


def thread_niceness() -> int | None:
    """The calling thread's niceness, or None where the OS does not tell."""
    if not hasattr(os, "getpriority"):
        return None
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


def set_process_niceness(niceness: int | None, tasks: Path = TASKS) -> int | None:
    """Give every thread of this process `niceness` (None: leave them); returns the calling
    thread's niceness then."""
    if niceness is None or not hasattr(os, "setpriority") or not tasks.is_dir():
        return thread_niceness()
    refused = None
    for tid in (int(name) for name in os.listdir(tasks)):
        try:
            os.setpriority(os.PRIO_PROCESS, tid, niceness)
        except ProcessLookupError:  # the thread ended meanwhile
            continue
        except OSError as exc:  # EPERM / EACCES: lowering it is privileged
            refused = exc
    if refused is not None:
        log.warning(
            "could not set this worker's niceness to %d (%s); its thread here stays at %s. "
            "Lowering niceness needs CAP_SYS_NICE or a raised RLIMIT_NICE.",
            niceness,
            refused.strerror or refused,
            thread_niceness(),
        )
    return thread_niceness()


class NicenessBoost:
    """The calling thread at a lower niceness for a while (a short prompt's forward), then back;
    or another thread of the process, lent that niceness while a short prompt waits behind its
    forward. Raising it back needs no privilege; lowering it does, and a refusal is logged
    once and not tried again."""

    def __init__(self) -> None:
        self.refused = False
        self.num_boosts = 0
        self.num_lent = 0  # long forwards lowered while a short prompt waited behind them

    @contextlib.contextmanager
    def at(self, niceness: int | None) -> Iterator[None]:
        before = thread_niceness()
        if self.refused or niceness is None or before is None or before <= niceness:
            yield  # nothing to lower (already there, or nested in a boost)
            return
        tid = threading.get_native_id()
        if not self._lower(tid, niceness, before):
            yield
            return
        self.num_boosts += 1
        try:
            yield
        finally:
            os.setpriority(os.PRIO_PROCESS, tid, before)

    def lend(self, tid: int, niceness: int | None) -> int | None:
        """Thread `tid` (of this process) lowered to `niceness` from another thread: a long
        forward that a short prompt waits behind. Returns its niceness before, to `give_back`;
        None if nothing was lowered."""
        if self.refused or niceness is None or not hasattr(os, "setpriority"):
            return None
        try:
            before = os.getpriority(os.PRIO_PROCESS, tid)
            if before <= niceness or not self._lower(tid, niceness, before):
                return None
        except ProcessLookupError:  # the thread ended meanwhile
            return None
        self.num_lent += 1
        return before

    def _lower(self, tid: int, niceness: int, before: int) -> bool:
        """Thread `tid` at `niceness`; False, logged once and never tried again, if refused."""
        try:
            os.setpriority(os.PRIO_PROCESS, tid, niceness)
            return True
        except PermissionError as exc:  # EPERM / EACCES
            self.refused = True
            log.warning(
                "could not lower this worker's niceness to %d for a short prompt (%s); it keeps "
                "%d. Lowering niceness needs CAP_SYS_NICE or a raised RLIMIT_NICE.",
                niceness,
                exc.strerror or exc,
                before,
            )
            return False

    def give_back(self, tid: int, niceness: int) -> None:
        """Thread `tid` back at the niceness `lend` found."""
        with contextlib.suppress(ProcessLookupError):
            os.setpriority(os.PRIO_PROCESS, tid, niceness)
