#!/usr/bin/env python
"""One way over a worker link (actors/wire.py) between two processes, a payload's size against
its time, with the same-node shared-memory ring and without it (its threshold raised), each
size alternating between the two. Usage: scripts/bench_link_payload.py [--repeats 60]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import statistics
import time

import numpy as np
from tqdm import tqdm

from actors import wire, wire_pickle

SIZES_BYTES = (0, 50_000, 100_000, 380_000, 750_000)  # an empty call to a 512 px image's pixels


def serve(queue) -> None:
    async def main():
        server = wire.LinkServer("127.0.0.1", None, lambda method, args: _arrived())
        queue.put(await server.address())
        await asyncio.sleep(3600)

    asyncio.run(main())


async def _arrived() -> float:
    return time.time()


async def one_way_ms(link: wire.CallLink, payload: np.ndarray, ring: bool) -> float:
    wire_pickle.RING_MIN_BYTES = 64 << 10 if ring else 1 << 62  # this process is the writer
    sent_s = time.time()
    arrived_s = await link.call("x", payload)
    await asyncio.sleep(0.005)  # idle between calls, as single requests are
    return (arrived_s - sent_s) * 1e3


async def measure(address, repeats: int) -> dict:
    link = await wire.CallLink.open(address)
    await link.call("x", np.zeros(1 << 20, np.uint8))  # offers the ring
    await link._ring_offer
    rows = {}
    for size in tqdm(SIZES_BYTES, desc="payload sizes"):
        payload = np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8)
        times = {True: [], False: []}
        for _ in range(repeats):
            for ring in (True, False):
                times[ring].append(await one_way_ms(link, payload, ring))
        ring_ms, frame_ms = (statistics.median(times[r]) for r in (True, False))
        rows[size] = {"ring_ms": round(ring_ms, 3), "frame_ms": round(frame_ms, 3)}
        rows[size]["ratio"] = round(ring_ms / frame_ms, 2)
    link.close()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=60)
    args = parser.parse_args()
    queue = mp.Queue()
    worker = mp.Process(target=serve, args=(queue,), daemon=True)
    worker.start()
    rows = asyncio.run(measure(queue.get(), args.repeats))
    worker.kill()
    for size, row in rows.items():
        print(f"{size:>8} bytes  ring {row['ring_ms']:.3f} ms  frame {row['frame_ms']:.3f} ms")
    print(json.dumps({"one_way_ms_by_bytes": rows}))


if __name__ == "__main__":
    main()
