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
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cluster.config import LimitsConfig  # noqa: E402
from cluster.media.load import load_media_item  # noqa: E402
from cluster.media.procs import shutdown_pools  # noqa: E402
from router.types import Modality  # noqa: E402
from tests.unit.test_media_video import encoded_video  # noqa: E402


def median_s(fns: list, repeats: int) -> list[float]:
    """Median seconds of each of `fns`, run in turn (interleaved, so that the machine's load drifts for all alike)."""
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
    video = encoded_video(
        num_frames=64, fps=4, width=args.width, height=args.height
    )  # 16 s: 32 frames at 2 fps
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
    print(
        f"child-process decode {child_s:.3f} s  (ratio {child_s / in_process_s:.2f}x, +{(child_s - in_process_s) * 1e3:.0f} ms)"
    )
    print(f"plain copy of the array here {copy_s * 1e3:.0f} ms")


if __name__ == "__main__":
    main()
