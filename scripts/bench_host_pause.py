#!/usr/bin/env python3
"""How much slower this host runs a few milliseconds of torch work right after a pause.

On the 2-core CI VM, work that follows a pause of 20 ms or more ran slower, up to several
times for a 100-300 ms pause, and spinning the CPU through the pause did not prevent it
(docs/BENCHMARKS.md, 2026-11-29). Every stage of a disaggregated request starts after such a
pause in its own process, while a one-process `generate` baseline never pauses, and the
emulated slowdown (`slowdown` in a pool's config) stretches what it measures. Run this before
reading idle-latency ratios on a new host.

Usage: scripts/bench_host_pause.py [--work-ms 3] [--repeats 7]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

PAUSES_MS = (0, 1, 5, 10, 20, 50, 100, 300, 1000)


def main(argv=None) -> int:
    import torch

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--work-ms", type=float, default=3.0, help="the work's length, hot")
    p.add_argument("--repeats", type=int, default=7)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    x = torch.randn(256, 256)

    def work(n: int) -> float:
        started = time.perf_counter()
        for _ in range(n):
            x.add(1.0)
        return (time.perf_counter() - started) * 1e3

    for _ in range(20):  # warm: allocator, dispatch
        work(200)
    n = max(1, round(200 * args.work_ms / statistics.median(work(200) for _ in range(9))))
    hot = statistics.median(work(n) for _ in range(args.repeats))
    print(f"{'pause ms':>9} {'work ms':>8} {'x hot':>6}")
    for pause_ms in PAUSES_MS:
        times = []
        for _ in range(args.repeats):
            time.sleep(pause_ms / 1e3)
            times.append(work(n))
        median = statistics.median(times)
        print(f"{pause_ms:>9} {median:>8.2f} {median / hot:>6.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
