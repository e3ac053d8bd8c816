"""Each pool's worker settings as one frozen record, under the config's names and units.

- What: the fields of a pool's config section that its workers and engines read (threads and
  Ray resources are process set-up: `WorkerSpec` and the actor options).
- Built: once, by `settings()` on each pool of cluster/config.py.
- Path: fleet -> actor -> engine, the record unchanged; the simulator takes `PrefillSettings`.
- Units: as configured (`_mb`); converted where used (`prefix_cache_bytes`).
- Defaults: none where a field has no "off" value; else off (tests, simulator). A deployment's
  defaults are the config's.
- Plain Python: nothing of ours, no torch, no ray.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

MIB = 2**20


class CudaGraphs(str, enum.Enum):
    """Whether a decode worker replays its step as CUDA graphs (actors/engine/step_graphs.py)."""

    AUTO = "auto"  # on a CUDA device, for a model whose layers all attend the full window
    ON = "on"  # as auto, and a worker that cannot refuses to start
    OFF = "off"  # eager steps


def _bytes(mb: float) -> int:
    return int(mb * MIB)


@dataclass(frozen=True)
class EncoderSettings:
    """An encoder worker's: the `encoder` section (one pool of it)."""

    max_batch_size: int  # most items one tower forward pass takes
    max_wait_ms: float = 0.0  # how long a partial batch waits for more items
    cache_mb: float = 0.0  # encoder cache budget; 0: nothing kept once handed over
    urgent_images: bool = False  # a batch of still images runs as a short prompt's forward does
    urgent_niceness: int | None = None  # its device thread's niceness meanwhile; None: its own

    @property
    def cache_bytes(self) -> int:
        return _bytes(self.cache_mb)


@dataclass(frozen=True)
class PrefillSettings:
    """A prefill worker's: the `prefill` section."""

    max_chunk_tokens: int  # prompt tokens per step, shared by the worker's requests
    max_media_tokens_per_step: int | None = None  # embedding tokens one step splices; None: any
    overlap_min_tokens: int = 0  # the shortest text worth prefilling ahead of a missing item
    aging_tokens_per_s: float = 0.0  # shortest remaining first, less this per second waited
    prefix_block_tokens: int = 16  # tokens per prefix-cache block
    prefix_cache_mb: float = 0.0  # prefix cache budget; 0: no prefix caching
    preempt_at_layers: bool = False  # short prompts run between a longer chunk's layers
    node_priority: bool = False  # short prompts' forwards make the node's long ones pause
    urgent_niceness: int | None = None  # of the device thread in a short prompt's forward
    pack_prompts: bool = False  # prompts whose last chunks one step plans share one forward

    @property
    def prefix_cache_bytes(self) -> int:
        return _bytes(self.prefix_cache_mb)


@dataclass(frozen=True)
class DecodeSettings:
    """A decode worker's: the `decode` section."""

    max_batch_size: int  # most requests in one decode step
    kv_cache_mb: float | None = None  # KV budget; None: rows are the only limit
    cuda_graphs: CudaGraphs = CudaGraphs.OFF  # the step replayed as CUDA graphs
    make_way_for_short: bool = False  # wait between steps for a peer's short prompt

    @property
    def kv_cache_bytes(self) -> int | None:
        return None if self.kv_cache_mb is None else _bytes(self.kv_cache_mb)
