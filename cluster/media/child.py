"""One media decoding child process: the other end of cluster/media/procs.py.

Started as `python -m cluster.media.child --fd N --max-memory-mb M` (exec'd, never a
plain fork of the many-threaded ingress). It caps its own address space first, then
serves decode tasks from the socket on fd N until the ingress closes it or it has served
its share: each task is a pickled `DecodeTask`; the answer is a pickled `DecodeReply`
header, followed for a success by the array's raw bytes (no pickling of the pixels, so the
ingress receives them straight into the array it keeps).
"""

from __future__ import annotations

import argparse
import os
import resource
import traceback
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

MB = 2**20


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


def cap_memory(max_memory_mb: int) -> None:
    """Cap this process's address space: an allocation beyond it fails (MemoryError)
    instead of growing the machine's memory use."""
    limit = max_memory_mb * MB
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def run_task(task: DecodeTask) -> tuple[DecodeReply, Any]:
    """Decode one task: (reply, the array or None)."""
    from cluster.media.budget import PixelBudget
    from cluster.media.decoders import decode_media
    from cluster.media.errors import MediaError

    budget = None
    if task.max_request_pixels is not None:
        budget = PixelBudget(task.max_request_pixels)
        budget.spent_pixels = task.spent_pixels
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
        reply, data = run_task(task)
        conn.send(reply)
        if data is not None:
            conn.send_bytes(
                memoryview(np.ascontiguousarray(data)).cast("B")
            )  # flat: send_bytes sizes by len()
        del data
        if reply.out_of_memory:
            return  # a heap that ran out is not worth keeping


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
    conn.send("ready")
    serve(conn, max_tasks=args.max_tasks)
    os._exit(0)  # skip interpreter teardown: nothing to flush, and it is the slow part


if __name__ == "__main__":
    from cluster.media.child import (
        main as _main,
    )  # replies must pickle as cluster.media.child's classes, not __main__'s

    _main()
