"""The decode engine alone (actors/engine/decode.py, no Ray): what one batched step costs
beyond the model's own forward, and how many host syncs it makes.

The baseline is the forward `generate` runs each step: the language model over one token a
row on a plain `DynamicCache` of the same batch and length, then the LM head and an argmax.
Both sides time `steps` steps after a warm-up, on the same device and threads. On a GPU the
engine is timed twice: eager, and replaying CUDA graphs (actors/engine/step_graphs.py).
"""

from __future__ import annotations

import statistics
import time

import torch
from transformers.cache_utils import DynamicCache

from actors.engine import kv
from actors.engine.decode import DecodeEngine
from actors.engine.host_syncs import counting_syncs
from actors.engine.lm_runner import LMRunner
from actors.models.adapter import ModelAdapter
from actors.types import DecodeRequest, SamplingParams
from router.worker_settings import CudaGraphs, DecodeSettings

WARMUP_STEPS = 3


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _prompt_kv(runner: LMRunner, num_tokens: int) -> tuple[torch.Tensor, int]:
    """A packed KV cache of a `num_tokens` text prompt, and its first token."""
    ids = tuple(100 + (i * 37) % 900 for i in range(num_tokens))
    first, packed, _ = runner.prefill(ids, (), [], SamplingParams(temperature=0.0))
    return packed, first.token_id


def engine_step_ms(
    runner: LMRunner,
    packed: torch.Tensor,
    first: int,
    batch: int,
    steps: int,
    graphs: CudaGraphs = CudaGraphs.OFF,
) -> tuple[list[float], float]:
    """Wall ms of each of `steps` engine steps at `batch` rows, and host syncs per step (the
    warm-up captures the graphs, if any)."""
    engine = _engine(runner, packed, first, batch, WARMUP_STEPS + steps + 8, graphs)
    for _ in range(WARMUP_STEPS):
        engine.step()
    with counting_syncs() as counts:
        engine.step()
    times = []
    for _ in range(steps):
        _sync(runner.device)
        started = time.perf_counter()
        engine.step()
        _sync(runner.device)
        times.append((time.perf_counter() - started) * 1e3)
    return times, float(sum(counts.values()))


def _engine(
    runner: LMRunner,
    packed: torch.Tensor,
    first: int,
    batch: int,
    max_tokens: int,
    graphs: CudaGraphs = CudaGraphs.OFF,
) -> DecodeEngine:
    settings = DecodeSettings(max_batch_size=batch, cuda_graphs=graphs)
    engine = DecodeEngine(runner, settings, max_model_len=1 << 20)
    greedy = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    for i in range(batch):
        engine.add(DecodeRequest(f"r{i}", packed.shape[-2], first, greedy), packed)
    return engine


def batched_engine(
    runner: LMRunner, batch: int, prompt_tokens: int, max_tokens: int
) -> DecodeEngine:
    """An engine holding `batch` rows of one `prompt_tokens` text prompt, each to decode
    `max_tokens` greedy tokens."""
    packed, first = _prompt_kv(runner, prompt_tokens)
    return _engine(runner, packed, first, batch, max_tokens)


@torch.inference_mode()
def forward_step_ms(lm: ModelAdapter, packed: torch.Tensor, batch: int, steps: int) -> list[float]:
    """Wall ms of each of `steps` plain forwards (what `generate` does per token)."""
    cache = DynamicCache()
    for i, (k, v) in enumerate(kv.unpack(packed)):
        cache.update(k.expand(batch, -1, -1, -1).clone(), v.expand(batch, -1, -1, -1).clone(), i)
    device = torch.device(lm.device)
    ids = torch.zeros(batch, 1, dtype=torch.long, device=device)
    times = []
    for step in range(WARMUP_STEPS + steps):
        positions = torch.full((batch, 1), packed.shape[-2] + step, device=device)
        _sync(device)
        started = time.perf_counter()
        hidden = lm.forward(lm.embed_tokens(ids), lm.step_positions(positions), cache)
        ids = lm.logits(hidden[:, -1]).argmax(-1, keepdim=True)
        _sync(device)
        if step >= WARMUP_STEPS:
            times.append((time.perf_counter() - started) * 1e3)
    return times


def overhead_table(
    lm: ModelAdapter, batch_sizes: list[int], steps: int, prompt_tokens: int
) -> list[dict]:
    """Per batch size: median step and forward ms, their difference, syncs per step; on a
    GPU also the graphed step's."""
    runner = LMRunner(lm)
    packed, first = _prompt_kv(runner, prompt_tokens)
    rows = []
    for batch in batch_sizes:
        step, syncs = engine_step_ms(runner, packed, first, batch, steps)
        forward_ms = statistics.median(forward_step_ms(lm, packed, batch, steps))
        step_ms = statistics.median(step)
        row = {
            "batch": batch,
            "step_ms_p50": round(step_ms, 3),
            "forward_ms_p50": round(forward_ms, 3),
            "overhead_ms": round(step_ms - forward_ms, 3),
            "syncs_per_step": syncs,
        }
        if runner.device.type == "cuda":
            graphed, syncs = engine_step_ms(runner, packed, first, batch, steps, CudaGraphs.ON)
            row |= {
                "graphed_step_ms_p50": round(statistics.median(graphed), 3),
                "graphed_vs_forward": round(statistics.median(graphed) / forward_ms, 3),
                "graphed_syncs_per_step": syncs,
            }
        rows.append(row)
    return rows


@torch.inference_mode()
def profile_forward(lm: ModelAdapter, prompt_tokens: int, batch: int, steps: int = 5) -> str:
    """torch.profiler's table of `steps` plain forwards at `batch` rows: where a step's time
    goes (CPU ops, kernels, syncs) when it is far above what `generate` takes."""
    from torch.profiler import ProfilerActivity, profile

    runner = LMRunner(lm)
    packed, _ = _prompt_kv(runner, prompt_tokens)
    forward_step_ms(lm, packed, batch, 2)  # warm-up
    activities = [ProfilerActivity.CPU]
    if runner.device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        forward_step_ms(lm, packed, batch, steps)
    key = "self_cuda_time_total" if runner.device.type == "cuda" else "self_cpu_time_total"
    by_cpu = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
    return by_cpu + "\n" + prof.key_averages().table(sort_by=key, row_limit=15)
