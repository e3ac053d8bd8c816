"""Counting device-to-host syncs on any device, CPU included: the calls that make the host
wait for the device's result (`.item()`, `bool(t)`, `.tolist()`, `nonzero`, copies to the
host). On a GPU each one stalls the launch queue, so the decode step may make one (its
sampled tokens); tests and benchmarks count them here, where no GPU is needed.
"""

from __future__ import annotations

import contextlib
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# Ops whose result the host must read before it can go on (output shape or value).
_SYNC_OPS = {
    "aten._local_scalar_dense",  # item(), bool(t), int(t), float(t)
    "aten.nonzero",
    "aten.masked_select",
    "aten._unique2",
    "aten.unique_consecutive",
    "aten.unique_dim",
}


class _DispatchCounter(TorchDispatchMode):
    def __init__(self, counts: Counter):
        super().__init__()
        self.counts = counts

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket)
        if name in _SYNC_OPS:
            self.counts[name] += 1
        elif name in ("aten._to_copy", "aten.copy_") and _to_host(func, args, kwargs or {}):
            self.counts["to_host"] += 1
        return func(*args, **(kwargs or {}))


def _to_host(func, args, kwargs) -> bool:
    """A copy from a non-CPU tensor into host memory."""
    if str(func.overloadpacket) == "aten.copy_":
        src, dst = args[1], args[0].device
    else:
        src, dst = args[0], kwargs.get("device")
    return src.device.type != "cpu" and dst is not None and torch.device(dst).type == "cpu"


@contextlib.contextmanager
def counting_syncs():
    """Yields a Counter of host syncs by kind, filled while the block runs (`tolist` and
    `numpy` are counted by name: they read memory without a dispatched op on CPU)."""
    counts: Counter = Counter()
    originals = {name: getattr(torch.Tensor, name) for name in ("tolist", "numpy")}

    def counted(name):
        def call(self, *args, **kwargs):
            counts[name] += 1
            return originals[name](self, *args, **kwargs)

        return call

    for name in originals:
        setattr(torch.Tensor, name, counted(name))
    try:
        with _DispatchCounter(counts):
            yield counts
    finally:
        for name, fn in originals.items():
            setattr(torch.Tensor, name, fn)
