"""One media decoding child process: the other end of cluster/media/procs.py.

Started as `python -m cluster.media.child --fd N --max-memory-mb M` (exec'd, never a
plain fork of the many-threaded ingress). It caps its own address space first, then
serves decode tasks from the socket on fd N until the ingress closes it or it has served
its share: each task is a pickled `DecodeTask`; the answer is a pickled `DecodeReply`
header, followed for a success by the array's raw bytes (no pickling of the pixels, so the
ingress receives them straight into the array it keeps). When the task `asks_hold`, the child
first sends a `HoldAsk` with the item's decoded bytes, from its headers, and decodes only if
the ingress answers True (its in-flight budget took them); on False it stops (`stopped`).
"""

from __future__ import annotations

import argparse
import functools
import os
import resource
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

MB = 2**20
# Decoding yields the CPU to the rest of the host: a text request's admission, prefill and decode
# must not queue behind a burst of large images on the cores. The lowest weight, below the
# model workers at Ray's 15, whatever the ingress's own niceness (server.ingress_niceness).
DECODE_NICENESS = 19


@dataclass(frozen=True)
class DecodeTask:
    """Everything decode_media takes; `spent_pixels` is what the request's budget had spent."""

    modality: Any  # actors.types.Modality
    payload: str
    limits: Any  # cluster.media.decoders.MediaLimits, pickled as a plain snapshot
    param: str
    format: str | None
    options: Any  # cluster.media.decoders.MediaOptions
    max_request_pixels: int | None  # None: no request budget
    spent_pixels: int
    asks_hold: bool = False  # ask the ingress (HoldAsk) before decoding


@dataclass(frozen=True)
class HoldAsk:
    """Sent mid-task: may the item decode `num_bytes`? The ingress answers True or False."""

    num_bytes: int
    param: str
    noun: str


@dataclass(frozen=True)
class DecodeReply:
    """A success (shape, dtype, rates, the budget's new spend) or a failure (the error)."""

    shape: tuple[int, ...] = ()
    dtype: str = ""
    sample_rate_hz: int | None = None
    frames_per_s: float | None = None
    spent_pixels: int = 0
    media_error: tuple[str, str | None] | None = (
        None  # (message, param): raised again as MediaError
    )
    error: BaseException | None = field(default=None)  # anything else, raised again as it is
    out_of_memory: bool = False  # the child hit its cap and exits after this reply
    stopped: bool = False  # the ingress refused a HoldAsk: nothing was decoded


class _Stopped(BaseException):
    """The ingress refused to hold the item (a BaseException: no decoder's handler takes it)."""


def cap_memory(max_memory_mb: int) -> None:
    """Cap this process's address space: an allocation beyond it fails (MemoryError)
    instead of growing the machine's memory use."""
    limit = max_memory_mb * MB
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def run_task(
    task: DecodeTask, ask: Callable[[HoldAsk], bool] | None = None
) -> tuple[DecodeReply, Any]:
    """Decode one task: (reply, the array or None). `ask` puts a HoldAsk to the ingress."""
    from cluster.media.decoders import decode_media
    from cluster.media.errors import MediaError

    budget = _budget(task, ask)
    try:
        decoded = decode_media(
            task.modality,
            task.payload,
            limits=task.limits,
            param=task.param,
            format=task.format,
            options=task.options,
            budget=budget,
        )
    except _Stopped:
        return DecodeReply(stopped=True), None
    except MediaError as exc:
        return DecodeReply(media_error=(exc.message, exc.param)), None
    except MemoryError:
        return DecodeReply(out_of_memory=True), None
    except Exception as exc:  # noqa: BLE001 - carried back to the ingress, raised there
        return DecodeReply(error=_picklable(exc)), None
    data = decoded.data
    reply = DecodeReply(
        shape=tuple(data.shape),
        dtype=data.dtype.str,
        sample_rate_hz=decoded.sample_rate_hz,
        frames_per_s=decoded.frames_per_s,
        spent_pixels=budget.spent_pixels if budget is not None else 0,
    )
    return reply, data


def _budget(task: DecodeTask, ask: Callable[[HoldAsk], bool] | None) -> Any:
    """The request's PixelBudget as the ingress left it, whose hook asks the ingress."""
    from cluster.media.budget import PixelBudget

    if task.max_request_pixels is None and not (task.asks_hold and ask):
        return None

    def hold(num_bytes: int, param: str, noun: str) -> None:
        if not ask(HoldAsk(num_bytes, param, noun)):
            raise _Stopped

    limit = task.max_request_pixels if task.max_request_pixels is not None else sys.maxsize
    budget = PixelBudget(limit, hold if task.asks_hold and ask else None)
    budget.spent_pixels = task.spent_pixels
    return budget


def _picklable(exc: Exception) -> BaseException:
    import pickle

    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:  # noqa: BLE001 - an exception that does not survive pickling
        return RuntimeError(
            f"media decoding failed in a worker process: {''.join(traceback.format_exception(exc))}"
        )


def serve(conn: Connection, *, max_tasks: int) -> None:
    """Answer tasks until the ingress hangs up, `max_tasks` are done, or memory ran out."""
    import numpy as np

    for _ in range(max_tasks):
        try:
            task = conn.recv()
        except (EOFError, OSError):
            return
        reply, data = run_task(task, functools.partial(_ask, conn))
        conn.send(reply)
        if data is not None:
            conn.send_bytes(
                memoryview(np.ascontiguousarray(data)).cast("B")
            )  # flat: send_bytes sizes by len()
        del data
        if reply.out_of_memory:
            return  # a heap that ran out is not worth keeping


def _ask(conn: Connection, message: HoldAsk) -> bool:
    conn.send(message)
    return conn.recv() is True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--fd", type=int, required=True, help="the socket to the ingress")
    parser.add_argument(
        "--max-memory-mb", type=int, required=True, help="address-space cap (RLIMIT_AS)"
    )
    parser.add_argument("--max-tasks", type=int, required=True, help="tasks served before exiting")
    args = parser.parse_args()
    conn = Connection(args.fd)
    # Load the decoders before the cap, so the cap measures decoding.
    import cluster.media.decoders  # noqa: F401

    cap_memory(args.max_memory_mb)
    os.setpriority(os.PRIO_PROCESS, 0, DECODE_NICENESS)  # raising it needs no privilege
    conn.send("ready")
    serve(conn, max_tasks=args.max_tasks)
    os._exit(0)  # skip interpreter teardown: nothing to flush, and it is the slow part


if __name__ == "__main__":
    from cluster.media.child import (
        main as _main,
    )  # replies must pickle as cluster.media.child's classes, not __main__'s

    _main()
