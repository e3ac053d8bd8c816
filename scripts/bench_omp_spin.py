#!/usr/bin/env python
"""What OpenMP's spin (`GOMP_SPINCOUNT`, set for every worker by cluster/fleet.py) does to a
stage that runs on two threads, each figure against one thread in the same process.

A worker borrows the node's idle core (`idle_torch_threads`) after waiting for work, so its
two-thread forward starts after a pause. OpenMP's idle threads spin that many times before
they sleep: too short a spin, and the second thread falls asleep between the forward's
parallel regions and is woken for each (on the CI VM a 2-thread encode at 10,000 took longer
than on one thread). Too long, and a worker that finished keeps a core spinning while the
next stage starts. For each spin value, in a fresh process (libgomp reads it at start):

- encode: the checkpoint's encoder on one image, ms on 1 and 2 threads, after `--pause-ms`;
- decode: one engine step of `--batch` rows, ms on 1 and 2 threads, after the same pause;
- tail: CPU ms the process burns in the 50 ms after a 2-thread step (the spin that outlives
  the work).

Usage: scripts/bench_omp_spin.py [--config configs/bench_cpu.yaml] [--spins 10000 100000]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from cluster.config import DEFAULT_CONFIG, load_config
from cluster.prepare import ensure_model

TAIL_S = 0.05


def _median_ms(fn, repeats: int, pause_s: float) -> float:
    fn()  # warm: allocator, dispatch, the OpenMP team
    times = []
    for _ in range(repeats):
        time.sleep(pause_s)
        started = time.perf_counter()
        fn()
        times.append((time.perf_counter() - started) * 1e3)
    return round(statistics.median(times), 2)


def _tail_cpu_ms(fn, repeats: int) -> float:
    burnt = []
    for _ in range(repeats):
        fn()
        started = time.process_time()
        time.sleep(TAIL_S)
        burnt.append((time.process_time() - started) * 1e3)
    return round(statistics.median(burnt), 2)


def measure(cfg, args) -> dict:
    """One spin value's figures (this process's GOMP_SPINCOUNT)."""
    import torch

    from actors.engine.lm_runner import LMRunner
    from actors.models.adapter import Part, load_adapter
    from actors.types import MediaItem, Modality
    from benchkit.decode_engine import batched_engine

    path, dtype = cfg.model.checkpoint_path, cfg.model.dtype
    encoder = load_adapter(path, part=Part.ENCODER, dtype=dtype, device="cpu")
    pixels = np.random.default_rng(0).integers(0, 256, (480, 640, 3), dtype=np.uint8)
    image = MediaItem(Modality.IMAGE, "spin", pixels)
    engine = batched_engine(
        LMRunner(load_adapter(path, part=Part.LANGUAGE_MODEL, dtype=dtype, device="cpu")),
        args.batch,
        prompt_tokens=64,
        max_tokens=4 * (args.repeats + 2),
    )
    work = {"encode": lambda: encoder.encode([image]), "decode": engine.step}
    out: dict = {"spin": os.environ.get("GOMP_SPINCOUNT", "libgomp default")}
    for threads in (1, 2):
        torch.set_num_threads(threads)
        for name, fn in work.items():
            out[f"{name}_{threads}t_ms"] = _median_ms(fn, args.repeats, args.pause_ms / 1e3)
    out["tail_cpu_ms"] = _tail_cpu_ms(engine.step, args.repeats)
    for name in work:
        out[f"{name}_2t_over_1t"] = round(out[f"{name}_2t_ms"] / out[f"{name}_1t_ms"], 2)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=str(DEFAULT_CONFIG))
    p.add_argument("--spins", nargs="+", default=["10000", "30000", "100000", "300000"])
    p.add_argument("--pause-ms", type=float, default=300.0, help="idle before each timed run")
    p.add_argument("--batch", type=int, default=32, help="decode rows")
    p.add_argument("--repeats", type=int, default=8)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", default="/tmp/bench_omp_spin.json")
    args = p.parse_args(argv)
    cfg = ensure_model(load_config(args.config))
    if args.child:
        print(json.dumps(measure(cfg, args)))
        return 0
    rows = []
    for spin in args.spins:
        cmd = [sys.executable, __file__, *(argv or sys.argv[1:]), "--child"]
        env = {**os.environ, "GOMP_SPINCOUNT": spin, "OMP_NUM_THREADS": "1"}
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
        print(json.dumps(rows[-1]), flush=True)
    Path(args.out).write_text(json.dumps({"config": args.config, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
