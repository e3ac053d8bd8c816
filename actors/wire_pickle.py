"""How a link's message becomes bytes (actors/wire.py): pickle protocol 5, CPU tensors as NumPy
arrays, and large buffers beside the frame in a shared-memory ring where the link has one.

Plain pickle: no Ray, and torch only where a tensor is sent or received.
"""

from __future__ import annotations

import copyreg
import io
import pickle
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from actors.shm_ring import Region, RingReader, RingWriter

RING_MIN_BYTES = 64 << 10  # below this a buffer costs the socket no more than the ring's copies


@dataclass(frozen=True)
class Pickled:
    data: bytes
    regions: tuple[Region, ...]  # where its out-of-band buffers lie in the ring, in order
    wants_ring: bool  # it carried a buffer the ring would have taken, had there been one


def dumps(message, ring: RingWriter | None = None) -> Pickled:
    """`message` pickled, its CPU tensors as NumPy arrays: torch's own reduction writes each
    through torch.save (a zip archive), 0.2 ms a small tensor there and back and 3 ms for 2 MB
    here, against 0.02 and 1.2 this way (an encoder's embeddings, a small KV). Buffers of at
    least RING_MIN_BYTES go into `ring` while it has room."""
    regions: list[Region] = []
    wanted = False

    def inside(buffer: pickle.PickleBuffer) -> bool:
        nonlocal wanted
        raw = buffer.raw()
        if raw.nbytes < RING_MIN_BYTES:
            return True
        wanted = True
        region = ring.put(raw) if ring is not None else None
        if region is None:
            return True
        regions.append(region)
        return False  # out of band: the reader finds it at `region`

    out = io.BytesIO()
    pickler = pickle.Pickler(out, protocol=5, buffer_callback=inside)
    if (table := _tensor_table()) is not None:
        pickler.dispatch_table = table
    pickler.dump(message)
    return Pickled(out.getvalue(), tuple(regions), wanted)


def loads(data: bytes, regions: Sequence[Region] = (), ring: RingReader | None = None):
    """The message `dumps` wrote; its buffers copied out of `ring` (ValueError when a frame
    names regions and the link has no ring)."""
    if regions and ring is None:
        raise ValueError("a frame with buffers in a ring this link does not have")
    return pickle.loads(data, buffers=[ring.take(region) for region in regions])


_TABLE: dict | None = None


def _tensor_table() -> dict | None:
    """copyreg's reductions and a CPU tensor's as an array, once torch is loaded."""
    global _TABLE
    if _TABLE is None and (torch := sys.modules.get("torch")) is not None:
        _TABLE = {**copyreg.dispatch_table, torch.Tensor: _reduce_tensor}
    return _TABLE


def _reduce_tensor(tensor):
    import torch

    if tensor.device.type != "cpu" or tensor.layout != torch.strided or tensor.is_quantized:
        return tensor.__reduce_ex__(5)
    tensor = tensor.detach().resolve_conj().resolve_neg()
    try:
        return _tensor_of, (tensor.numpy(), None)
    except TypeError:  # a dtype NumPy lacks (bfloat16, float8): its bits as integers
        bits = _SAME_SIZE_INTS[tensor.element_size()]
        return _tensor_of, (tensor.view(getattr(torch, bits)).numpy(), str(tensor.dtype)[6:])


_SAME_SIZE_INTS = {1: "uint8", 2: "int16", 4: "int32", 8: "int64"}


def _tensor_of(array, dtype: str | None):
    """The tensor `_reduce_tensor` sent (unpickled as a writable array of the frame's copy)."""
    import torch

    tensor = torch.from_numpy(array)
    return tensor if dtype is None else tensor.view(getattr(torch, dtype))
