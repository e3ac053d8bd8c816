"""Content identifiers for decoded media: the key of the encoder's embedding cache.

Hashing the decoded array (not the request bytes) makes the same picture sent as PNG
and as lossless WebP share one identifier; hashing the namespace (the model id) keeps
two models from ever sharing an embedding. No torch here.
"""

from __future__ import annotations

import numpy as np
from blake3 import blake3

from router.types import Modality

_VERSION = b"epd-media-id-v1"


def _field(value: bytes) -> bytes:
    # Length-prefix each field so that no two different (namespace, modality, ...) tuples
    # concatenate alike.
    return len(value).to_bytes(8, "little") + value


def media_identifier(
    namespace: str, modality: Modality, data: np.ndarray, *, rate: float | None = None
) -> str:
    """blake3 hex digest over namespace, modality, dtype, shape, the raw decoded bytes and,
    when given, the rate of the time axis (audio samples or video frames per second).

    Why the rate: the same frames sampled on a coarser grid are a different input to a
    model whose positions follow time. Images pass no rate and keep their identifiers.
    """
    array = np.ascontiguousarray(data)
    if array.dtype.hasobject:
        raise ValueError("media_identifier needs a numeric array, not dtype=object")
    hasher = blake3()
    hasher.update(_field(_VERSION))
    hasher.update(_field(namespace.encode("utf-8")))
    hasher.update(_field(Modality(modality).value.encode("ascii")))
    hasher.update(_field(array.dtype.str.encode("ascii")))  # includes byte order, e.g. "<f4"
    hasher.update(_field(",".join(str(d) for d in array.shape).encode("ascii")))
    hasher.update(array.nbytes.to_bytes(8, "little"))
    hasher.update(memoryview(array.reshape(-1)).cast("B"))  # no copy of the pixels
    if rate is not None:
        hasher.update(_field(repr(float(rate)).encode("ascii")))  # repr: shortest exact round trip
    return hasher.hexdigest()
