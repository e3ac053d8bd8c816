"""The decode step over fixed buffers, captured as one CUDA graph per bucket of batch sizes.

On a GPU a small model's decode step is mostly the launching of some hundreds of kernels; a
CUDA graph replays them with no host work per kernel. What a graph replays must keep every
shape and address, so this step reads and writes fixed buffers only: per bucket, the ids, the
positions and the window's bounds; the batch's K/V slab in place (the step's column written at
an index held on the device); attention over the slab's whole width under a mask that keeps
each row's window. The host copies this step's values in (one transfer), replays and hands the
logits to the sampler, which stays eager (its work depends on each row's settings).

Rows past the batch up to the bucket's size compute on stale ids in free rows of the slab and
are never read. A graph belongs to the slab it was captured on: when the batch's buffers grow
(kv.py) each bucket is captured again at its next use. Without `capture` (CPU) the very same
body runs eagerly, which is how its arithmetic is tested on a host with no GPU.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

from actors.engine import kv
from actors.engine.sampling import on_device
from actors.models.adapter import ModelAdapter
from router.worker_settings import CudaGraphs, DecodeSettings

log = logging.getLogger(__name__)

SPARE_SLOTS = 256  # columns a graphed batch's slab grows by: fewer regrowths, fewer captures


def bucket_sizes(max_batch_size: int) -> tuple[int, ...]:
    """The batch sizes captured: 1, 2, 4, then every multiple of 8, up to the largest batch."""
    sizes = {1, 2, 4, *range(8, max_batch_size + 8, 8)}
    return tuple(sorted(s for s in sizes if s < max_batch_size)) + (max_batch_size,)


def for_settings(adapter: ModelAdapter, settings: DecodeSettings) -> FixedStep | None:
    """The graphed step `settings.cuda_graphs` asks for on this model and device, or None
    (eager steps); `on` where graphs cannot run is an error naming why."""
    if settings.cuda_graphs is CudaGraphs.OFF:
        return None
    if torch.device(adapter.device).type != "cuda":
        why = f"the model runs on {adapter.device}, and CUDA graphs need a CUDA device"
    elif not adapter.full_window_layers:
        why = "the language model has a sliding-window layer or no SDPA attention"
    else:
        return FixedStep(adapter, settings.max_batch_size, capture=True)
    if settings.cuda_graphs is CudaGraphs.ON:
        raise ValueError(f"decode.cuda_graphs is on, but {why}")
    return None


class _FixedLayer(DynamicLayer):
    """One layer of the slab as attention sees it in a fixed step: every column of the first
    `rows` rows, the step's key and value written at the column `index` (on the device)."""

    def __init__(self, slab: kv.Slab, layer: int, rows: int, index: torch.Tensor):
        super().__init__()
        self.k, self.v = slab.k[layer][:rows], slab.v[layer][:rows]
        self.index, self.columns = index, slab.columns
        self.dtype, self.device, self.is_initialized = slab.dtype, slab.device, True
        self.keys, self.values = self.k, self.v

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        self.k.index_copy_(2, self.index, key_states)
        self.v.index_copy_(2, self.index, value_states)
        return self.k, self.v

    def get_seq_length(self) -> int:
        return self.columns


@dataclass
class _Bucket:
    """One batch size's fixed inputs and output on one slab, and its graph once captured."""

    rows: int
    slab: kv.Slab
    ids: torch.Tensor  # [rows, 1] each row's last token
    positions: torch.Tensor  # [rows, 1] plain positions (the adapter makes 3-D ones)
    window: torch.Tensor  # [2] the batch's first column and the step's column
    columns: torch.Tensor  # [columns] 0, 1, ... (the mask compares the window with it)
    logits: torch.Tensor | None = None  # the body's output (a graph rewrites its own)
    graph: object | None = None  # torch.cuda.CUDAGraph


class FixedStep:
    """Decode forwards on fixed buffers for one language model; `capture` records each bucket
    as a CUDA graph at its first use on a slab and replays it after."""

    def __init__(self, adapter: ModelAdapter, max_batch_size: int, capture: bool):
        if not adapter.full_window_layers:
            raise ValueError(
                "a fixed decode step needs every layer to attend the full window with SDPA "
                "(no sliding-window layer)"
            )
        self.adapter, self.capture = adapter, capture
        self.sizes = bucket_sizes(max_batch_size)
        self._buckets: dict[int, _Bucket] = {}
        self._pool = None  # the graphs' shared memory pool, one per slab
        self.num_captures = self.num_replays = 0
        self.failed = False  # a capture failed: the body runs eagerly

    def bucket(self, num_rows: int) -> int:
        return next(s for s in self.sizes if s >= num_rows)

    @torch.inference_mode()
    def logits(
        self, batch: kv.BatchedKV, last_tokens: list[int], rope_deltas: list[int] | None
    ) -> torch.Tensor:
        """[rows, vocab] next-token logits of the batch's rows; the step's column is written
        to the slab (the caller absorbs it)."""
        n = len(last_tokens)
        rows = self.bucket(n)
        slab = batch.open_fixed_step(rows)
        b = self._buckets.get(rows)
        if b is None or b.slab is not slab:
            b = self._buckets[rows] = self._new_bucket(rows, slab)
        host = [slab.start, slab.end, *last_tokens, *(rope_deltas or [0] * n)]
        values = on_device(slab.device, host, torch.long)  # one transfer a step
        b.window.copy_(values[:2])
        b.ids[:n, 0].copy_(values[2 : 2 + n])
        torch.add(slab.length[:n], values[2 + n :], out=b.positions[:n, 0])
        self._run(b)
        return b.logits[:n]

    def _new_bucket(self, rows: int, slab: kv.Slab) -> _Bucket:
        if any(b.slab is not slab for b in self._buckets.values()):
            self._buckets, self._pool = {}, None  # the graphs read the old slab's memory
        zeros = lambda *shape: torch.zeros(*shape, dtype=torch.long, device=slab.device)
        return _Bucket(
            rows,
            slab,
            zeros(rows, 1),
            zeros(rows, 1),
            zeros(2),
            torch.arange(slab.columns, device=slab.device),
        )

    def _body(self, b: _Bucket) -> None:
        """The step as recorded: mask, forward over the slab, logits of the fed token."""
        start, index = b.window[0], b.window[1:]
        held = b.slab.valid[: b.rows].bool() & (b.columns >= start) & (b.columns < index)
        mask = (held | (b.columns == index))[:, None, None, :]  # a pad row sees its own token
        layers = [_FixedLayer(b.slab, i, b.rows, index) for i in range(len(b.slab.k))]
        cache = DynamicCache()
        cache.layers = layers
        positions = self.adapter.step_positions(b.positions)
        hidden = self.adapter.forward(self.adapter.embed_tokens(b.ids), positions, cache, mask)
        b.logits = self.adapter.logits(hidden[:, -1])  # captured: the graph's own output

    def _run(self, b: _Bucket) -> None:
        if not self.capture:
            self._body(b)
        elif b.graph is None:
            try:
                self._capture(b)
            except Exception:  # the same body, eager from now on: correct, only slower
                log.exception("decode step: CUDA graph capture failed; steps run eagerly")
                self.capture, self.failed, b.graph = False, True, None
                self._body(b)
                return
            b.graph.replay()
        else:
            b.graph.replay()
        self.num_replays += b.graph is not None

    def _capture(self, b: _Bucket) -> None:
        """Warm up on a side stream (lazy inits stay out of the graph), then record the body;
        its logits are the graph's output. Writing the step's column twice is harmless: both
        runs write the same values."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self._body(b)
        torch.cuda.current_stream().wait_stream(side)
        self._pool = self._pool or torch.cuda.graph_pool_handle()
        b.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(b.graph, pool=self._pool, capture_error_mode="thread_local"):
            self._body(b)
        self.num_captures += 1

    def stats(self) -> dict[str, int]:
        return {
            "cuda_graphs": int(self.capture),
            "graph_captures": self.num_captures,
            "graph_replays": self.num_replays,
            "graph_capture_failed": int(self.failed),
        }
