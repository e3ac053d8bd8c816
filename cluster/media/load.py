"""Where media enters the ingress: one content part -> a fingerprinted `MediaItem`.

Decodes in one of a few capped child processes (cluster/media/procs.py), or in a decode slot
of the ingress itself when `limits.decode_in_process`, then fingerprints the result. A small
still inline image (`limits.max_inline_decode_pixels`, checked from its header) is decoded
right here: a process round trip would cost more than its decoding.
"""

from __future__ import annotations

import contextlib

from actors.types import MediaItem
from cluster.media.budget import PixelBudget
from cluster.media.child import DecodeTask
from cluster.media.decoders import (
    DEFAULT_OPTIONS,
    Decoded,
    LimitsSnapshot,
    MediaLimits,
    MediaOptions,
    decode_media,
)
from cluster.media.identifiers import media_identifier
from cluster.media.image import small_still_image
from cluster.media.pool import decode_slot
from cluster.media.procs import PoolShape, decode_pool
from router.types import Modality


def load_media_item(
    modality: Modality,
    payload: str,
    *,
    namespace: str,
    limits: MediaLimits,
    param: str,
    format: str | None = None,
    options: MediaOptions = DEFAULT_OPTIONS,
    budget: PixelBudget | None = None,
) -> MediaItem:
    """Decode (in a decoding process, or a decode slot here when limits.decode_in_process) and
    fingerprint one item: what the ingress hands to the encoder stage."""
    here = modality == Modality.IMAGE and small_still_image(
        payload, min(limits.max_inline_decode_pixels, limits.max_image_pixels)
    )
    if here or limits.decode_in_process:
        # A small image needs no slot (nor the trim after it): its decode is bounded and brief.
        with contextlib.nullcontext() if here else decode_slot(limits.max_concurrent_decodes):
            decoded = decode_media(
                modality,
                payload,
                limits=limits,
                param=param,
                format=format,
                options=options,
                budget=budget,
            )
    else:
        decoded = _decode_in_child(
            modality,
            payload,
            limits=limits,
            param=param,
            format=format,
            options=options,
            budget=budget,
        )
    rate = decoded.sample_rate_hz if decoded.sample_rate_hz is not None else decoded.frames_per_s
    return MediaItem(
        modality=modality,
        identifier=media_identifier(namespace, modality, decoded.data, rate=rate),
        data=decoded.data,
        sample_rate_hz=decoded.sample_rate_hz,
        frames_per_s=decoded.frames_per_s,
    )


def _decode_in_child(
    modality: Modality,
    payload: str,
    *,
    limits: MediaLimits,
    param: str,
    format: str | None,
    options: MediaOptions,
    budget: PixelBudget | None,
) -> Decoded:
    """decode_media in one of this process's decoding processes; the request's budget is charged
    here as there, and its hook (the in-flight budget) answers the child before it decodes."""
    hold = budget.hold if budget is not None else None
    shape = PoolShape(
        limits.max_concurrent_decodes,
        limits.max_decode_memory_mb,
        limits.max_decodes_per_process,
        limits.max_decode_s,
    )
    task = DecodeTask(
        modality,
        payload,
        LimitsSnapshot.of(limits),
        param,
        format,
        options,
        budget.max_pixels if budget is not None else None,
        budget.spent_pixels if budget is not None else 0,
        asks_hold=hold is not None,
    )
    reply, data = decode_pool(shape).decode(task, hold)
    if budget is not None:
        budget.spent_pixels = reply.spent_pixels
    return Decoded(data, sample_rate_hz=reply.sample_rate_hz, frames_per_s=reply.frames_per_s)
