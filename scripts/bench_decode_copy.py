#!/usr/bin/env python
"""What decoding in a child process costs: one 1080p video (32 frames kept at the default
sampling) decoded here in-process (limits.decode_in_process) vs in a warm decoding process
(cluster/media/procs.py), whose frames (~199 MB of RGB) come back over a socket. Reports
the median seconds of each, their ratio, and a plain in-process copy of the same array as
the floor of the transfer.
Usage: scripts/bench_decode_copy.py [--repeats 5] [--width 1920 --height 1080]
"""

from __future__ import annotations

import argparse
import base64
import statistics
import time

import numpy as np

from benchkit.media import encoded_video
from cluster.config import LimitsConfig
from cluster.media.load import load_media_item
from cluster.media.procs import shutdown_pools
from router.types import Modality


def median_s(fns: list, repeats: int) -> list[float]:
    """Median seconds of each of `fns`, run in turn (interleaved, so that the machine's load
    drifts for all alike)."""
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, spent in zip(fns, times):
            started = time.perf_counter()
            fn()
            spent.append(time.perf_counter() - started)
    return [statistics.median(spent) for spent in times]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--width", type=int, default=1920)
    parser.add_argument("--height", type=int, default=1080)
    args = parser.parse_args()
    # 16 s: 32 frames kept at the default 2 fps
    video = encoded_video(num_frames=64, fps=4, width=args.width, height=args.height)
    url = "data:video/mp4;base64," + base64.b64encode(video).decode()
    here, there = LimitsConfig(decode_in_process=True), LimitsConfig()
    load = lambda limits: (
        load_media_item(Modality.VIDEO, url, namespace="b", limits=limits, param="p").data
    )
    frames = load(there)  # starts the child
    assert np.array_equal(frames, load(here)), "the child decoded something else"
    in_process_s, child_s, copy_s = median_s(
        [lambda: load(here), lambda: load(there), frames.copy], args.repeats
    )
    shutdown_pools()
    print(
        f"video: {args.width}x{args.height}, {len(video) // 1024} KB mp4, frames {frames.shape} = "
        f"{frames.nbytes / 2**20:.0f} MiB; median of {args.repeats}"
    )
    print(f"in-process decode   {in_process_s:.3f} s")
    extra_ms = (child_s - in_process_s) * 1e3
    print(
        f"child-process decode {child_s:.3f} s  "
        f"(ratio {child_s / in_process_s:.2f}x, +{extra_ms:.0f} ms)"
    )
    print(f"plain copy of the array here {copy_s * 1e3:.0f} ms")


if __name__ == "__main__":
    main()
