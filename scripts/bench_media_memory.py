#!/usr/bin/env python
"""Ingress memory under large images: is it bounded while decoding, and does it come back?

Sends `--rounds` rounds of `--requests` concurrent requests, each of `--images` images of
`--megapixels`, through a thread pool as the ingress admits requests (asyncio.to_thread),
and reports this process's RSS before, at its peak and after each round, once decoding
as before any bound (unbounded, no trim), once through decode slots in this process
(limits.decode_in_process: `--slots` slots, then malloc_trim) and once through the
ingress's own path (load_media_item: `--slots` capped decoding processes; their RSS is
reported apart); each in a fresh subprocess so none inherits another's heap.
Usage: scripts/bench_media_memory.py [--rounds 3] [--requests 3] [--images 4] [--megapixels 16]
"""

from __future__ import annotations

import argparse
import base64
import json
import subprocess
import sys
import threading
import time

import psutil

from benchkit.media import photo

MIB = 2**20


def image_url(megapixels: float, fmt: str, seed: int) -> str:
    """A photo-like (smooth plus noise) image; PNG ones carry alpha, the costliest RGB path."""
    png = fmt == "png"
    data = photo(megapixels, seed, fmt.upper(), alpha=png, **({"compress_level": 1} if png else {}))
    return f"data:image/{fmt};base64," + base64.b64encode(data).decode()


class PeakRss:
    """RSS sampled every 2 ms on a thread: ru_maxrss would also count the payloads' making."""

    def __init__(self) -> None:
        self.process, self.peak, self._stop = psutil.Process(), 0, threading.Event()
        self.children_peak = 0  # the decoding processes', summed
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, self.process.memory_info().rss)
            self.children_peak = max(self.children_peak, children_rss(self.process))

    def __enter__(self) -> PeakRss:
        self.peak = self.process.memory_info().rss
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def children_rss(process: psutil.Process) -> int:
    total = 0
    for child in process.children():
        try:
            total += child.memory_info().rss
        except psutil.Error:  # recycled meanwhile
            pass
    return total


MODES = {
    "unbounded": "unbounded, no trim",
    "slots": "decode slots in-process + malloc_trim",
    "procs": "capped decoding processes",
}


def child(args: argparse.Namespace) -> dict:
    from concurrent.futures import ThreadPoolExecutor

    from cluster.config import LimitsConfig
    from cluster.media.decoders import decode_media
    from cluster.media.load import load_media_item
    from router.types import Modality

    limits = LimitsConfig(
        max_request_pixels=10**10,
        max_concurrent_decodes=args.slots,  # memory, not budgets
        decode_in_process=args.mode == "slots",
    )
    urls = [image_url(args.megapixels, args.format, seed) for seed in range(args.images)]
    rss = lambda: psutil.Process().memory_info().rss // MIB

    def request(_) -> int:  # one request's items, held until all are decoded
        if args.mode != "unbounded":
            items = [
                load_media_item(Modality.IMAGE, u, namespace="m", limits=limits, param="p").data
                for u in urls
            ]
        else:
            items = [decode_media(Modality.IMAGE, u, limits=limits, param="p").data for u in urls]
        return sum(i.nbytes for i in items)

    time.sleep(0.2)  # let the payloads' making settle
    out = {"mode": f"{MODES[args.mode]} ({args.slots})", "before_mib": rss()}
    started = time.perf_counter()
    with PeakRss() as peak, ThreadPoolExecutor(args.requests) as threads:
        for round_ in range(args.rounds):
            list(threads.map(request, range(args.requests)))
            time.sleep(0.2)
            out[f"after_round_{round_ + 1}_mib"] = rss()
    return {
        **out,
        "peak_mib": peak.peak // MIB,
        "decode_s": round(time.perf_counter() - started, 1),
        "children_peak_mib": peak.children_peak // MIB,
        "children_after_mib": children_rss(psutil.Process()) // MIB,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=3, help="concurrent requests per round")
    parser.add_argument("--images", type=int, default=4, help="images per request")
    parser.add_argument("--megapixels", type=float, default=16.0)
    parser.add_argument("--format", choices=["png", "jpeg"], default="png")
    parser.add_argument(
        "--slots", type=int, default=2, help="limits.max_concurrent_decodes for the ingress path"
    )
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--mode", choices=list(MODES), default=None, help=argparse.SUPPRESS)
    parser.add_argument(
        "--modes", default=",".join(MODES), help="which of unbounded, slots, procs to run, in order"
    )
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args)), flush=True)
        return
    common = [
        str(a)
        for a in (
            "--rounds",
            args.rounds,
            "--requests",
            args.requests,
            "--images",
            args.images,
            "--megapixels",
            args.megapixels,
            "--format",
            args.format,
            "--slots",
            args.slots,
        )
    ]
    for mode in args.modes.split(","):
        print(
            f"{args.rounds} rounds of {args.requests} requests x {args.images} "
            f"x {args.megapixels:g} MP {args.format}, {MODES[mode]} ...",
            file=sys.stderr,
            flush=True,
        )
        command = [sys.executable, __file__, "--child", *common, "--mode", mode]
        print(
            subprocess.run(command, check=True, capture_output=True, text=True).stdout.strip(),
            flush=True,
        )


if __name__ == "__main__":
    main()
