"""The decode engine beside a concurrent prefill on the same device, as workers that share a
GPU run: a second process computes prompt forwards back to back while the engine steps `batch`
rows; the engine's step ms with that neighbour against the same steps alone, in one run. On a
GPU, run it once as is and once under MPS (`nvidia-cuda-mps-control -d` first: the processes'
kernels then share the GPU at once instead of taking turns); on a CPU host the two processes
share the cores instead.
"""

from __future__ import annotations

import multiprocessing as mp
import statistics
import time
from pathlib import Path

import torch

from actors.engine.lm_runner import LMRunner
from actors.models.adapter import Part, load_adapter
from benchkit.decode_engine import _prompt_kv, engine_step_ms
from router.worker_settings import CudaGraphs


def _prefill_loop(
    checkpoint: str, dtype: str, device: str, tokens: int, threads: int, ready, stop, done
):
    """The neighbour: `tokens`-token prompts through the language model until `stop`."""
    torch.set_num_threads(threads)
    runner = LMRunner(
        load_adapter(Path(checkpoint), part=Part.LANGUAGE_MODEL, dtype=dtype, device=device)
    )
    _prompt_kv(runner, tokens)  # warm
    ready.set()
    count = 0
    while not stop.is_set():
        _prompt_kv(runner, tokens)
        count += 1
    done.put(count)


def shared_table(
    checkpoint: Path,
    dtype: str,
    device: str,
    batch: int,
    steps: int,
    prompt_tokens: int,
    prefill_tokens: int = 512,
    threads: int = 1,
) -> dict:
    """Step p50 alone and beside the neighbour, eager and (on a GPU) graphed."""
    torch.set_num_threads(threads)
    runner = LMRunner(
        load_adapter(checkpoint, part=Part.LANGUAGE_MODEL, dtype=dtype, device=device)
    )
    packed, first = _prompt_kv(runner, prompt_tokens)
    modes = [CudaGraphs.OFF] + ([CudaGraphs.ON] if runner.device.type == "cuda" else [])
    measure = lambda mode: statistics.median(
        engine_step_ms(runner, packed, first, batch, steps, mode)[0]
    )
    alone = {mode.value: measure(mode) for mode in modes}
    ctx = mp.get_context("spawn")
    ready, stop, done = ctx.Event(), ctx.Event(), ctx.Queue()
    neighbour = ctx.Process(
        target=_prefill_loop,
        args=(str(checkpoint), dtype, device, prefill_tokens, threads, ready, stop, done),
    )
    neighbour.start()
    try:
        if not ready.wait(300):
            raise RuntimeError("the prefill neighbour did not start")
        started = time.perf_counter()
        shared = {mode.value: measure(mode) for mode in modes}
        elapsed = time.perf_counter() - started
    finally:
        stop.set()
        neighbour.join(60)
    forwards = done.get(timeout=5) if not done.empty() else None
    return {
        "batch": batch,
        "prefill_tokens": prefill_tokens,
        "step_ms_p50_alone": {k: round(v, 3) for k, v in alone.items()},
        "step_ms_p50_beside_prefill": {k: round(v, 3) for k, v in shared.items()},
        "slowdown": {k: round(shared[k] / alone[k], 3) for k in alone},
        "neighbour_forwards_per_s": round(forwards / elapsed, 2) if forwards else None,
    }
