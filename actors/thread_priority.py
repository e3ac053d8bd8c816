"""A worker process's niceness (Linux). Ray starts its Python workers at niceness 15 and leaves
its own threads (gRPC, the object store's) at 0, so each such thread on the node, and every
other stage's, preempts a decode step the moment it wakes, or the thread that holds the
step's GIL. Niceness is per thread on Linux: every thread of the process is set, and threads
started later inherit it from the one that starts them. Lowering it needs CAP_SYS_NICE (root,
or a raised RLIMIT_NICE); without it the threads keep what they had and the log says so once.
Plain os and threading, no torch."""

from __future__ import annotations

import logging
import os
import threading
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
