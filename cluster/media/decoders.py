"""Decoding of one content part, whatever its modality: the dispatch a decoding process runs.

Sends a content part to the image, audio or video decoder with the cluster's limits, the request's
pixel budget and the model's input options (cluster/media/load.py decides in which process).
Everything a client sends is untrusted: each failure becomes a MediaError that names the offending
content part, so the HTTP layer can answer 400 instead of 500. No torch here: this runs in the
ingress, before any model is involved.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from cluster.media.audio import decode_audio, decode_audio_url
from cluster.media.budget import PixelBudget
from cluster.media.errors import MediaError
from cluster.media.fetch import FetchPolicy
from cluster.media.image import convert_to_rgb, decode_image_url
from cluster.media.video import VideoSampling, decode_video_url
from router.types import Modality

__all__ = [
    "DECODERS",
    "Decoded",
    "MediaError",
    "MediaLimits",
    "MediaOptions",
    "PixelBudget",
    "VideoSampling",
    "convert_to_rgb",
    "decode_image_url",
    "decode_media",
]


class RemoteMediaLimits(Protocol):
    """cluster.config.RemoteMediaConfig as fetching needs it."""

    allowed_hosts: list[str]  # empty: fetching is off
    allowed_networks: list[str]
    max_bytes: int
    timeout_s: float
    max_redirects: int


class MediaLimits(Protocol):
    """The fields of cluster.config.LimitsConfig that decoding needs (no import of cluster/)."""

    max_image_pixels: int  # per image, and per video frame
    remote_media: RemoteMediaLimits
    max_audio_s: float
    max_video_s: float
    max_video_frames: int  # hard cap on the frames kept from one video
    max_video_pixels: int  # decoded pixels of one video
    max_request_pixels: int  # decoded pixels of one request: the size of its PixelBudget
    max_concurrent_decodes: int  # also the number of decoding processes
    max_decode_memory_mb: int  # each decoding process's address-space cap
    max_decodes_per_process: int  # then it is replaced
    max_decode_s: float  # a decoding process silent longer than this on one item is killed
    decode_in_process: bool  # debugging: decode in this process's threads instead
    max_inline_decode_pixels: int  # small still inline images: decoded here, not in a process


@dataclass(frozen=True)
class RemoteSnapshot:
    allowed_hosts: list[str]
    allowed_networks: list[str]
    max_bytes: int
    timeout_s: float
    max_redirects: int


@dataclass(frozen=True)
class LimitsSnapshot:
    """The MediaLimits a decoding process needs, as plain data (whatever class the caller's limits
    are)."""

    max_image_pixels: int
    remote_media: RemoteSnapshot
    max_audio_s: float
    max_video_s: float
    max_video_frames: int
    max_video_pixels: int

    @classmethod
    def of(cls, limits: MediaLimits) -> LimitsSnapshot:
        r = limits.remote_media
        return cls(
            limits.max_image_pixels,
            RemoteSnapshot(
                list(r.allowed_hosts),
                list(r.allowed_networks),
                r.max_bytes,
                r.timeout_s,
                r.max_redirects,
            ),
            limits.max_audio_s,
            limits.max_video_s,
            limits.max_video_frames,
            limits.max_video_pixels,
        )


@dataclass(frozen=True)
class MediaOptions:
    """What the served model wants its inputs to look like (the limits say what is allowed)."""

    audio_sample_rate_hz: int = 16_000
    video_sampling: VideoSampling = VideoSampling()


@dataclass(frozen=True)
class Decoded:
    """A decoder's answer: the array, and the rate of its time axis for audio and video."""

    data: np.ndarray = field(repr=False)
    sample_rate_hz: int | None = None
    frames_per_s: float | None = None


@dataclass(frozen=True)
class _Part:
    """One content part as a decoder sees it."""

    payload: str  # the URL (image, video) or the base64 data (audio)
    format: str | None  # input_audio.format
    param: str


# ----------------------------------------------------------------------------- dispatch


def fetch_policy(limits: MediaLimits) -> FetchPolicy | None:
    """How http(s) media URLs may be fetched; None when no host is allowed."""
    r = limits.remote_media
    if not r.allowed_hosts:
        return None
    return FetchPolicy.of(
        r.allowed_hosts,
        r.allowed_networks,
        max_bytes=r.max_bytes,
        timeout_s=r.timeout_s,
        max_redirects=r.max_redirects,
    )


Decoder = Callable[[_Part, MediaLimits, MediaOptions, PixelBudget | None], Decoded]


def _image_decoder(
    part: _Part, limits: MediaLimits, options: MediaOptions, budget: PixelBudget | None
) -> Decoded:
    return Decoded(
        decode_image_url(
            part.payload,
            max_pixels=limits.max_image_pixels,
            remote=fetch_policy(limits),
            param=part.param,
            budget=budget,
        )
    )


def _audio_decoder(
    part: _Part, limits: MediaLimits, options: MediaOptions, budget: PixelBudget | None
) -> Decoded:
    rate_hz = options.audio_sample_rate_hz
    if (
        part.format is None
    ):  # an audio_url part: a data or http(s) URL whose MIME type names the format
        samples = decode_audio_url(
            part.payload,
            remote=fetch_policy(limits),
            sample_rate_hz=rate_hz,
            max_duration_s=limits.max_audio_s,
            param=part.param,
            budget=budget,
        )
    else:
        samples = decode_audio(
            part.payload,
            part.format,
            sample_rate_hz=rate_hz,
            max_duration_s=limits.max_audio_s,
            param=part.param,
            budget=budget,
        )
    return Decoded(samples, sample_rate_hz=rate_hz)


def _video_decoder(
    part: _Part, limits: MediaLimits, options: MediaOptions, budget: PixelBudget | None
) -> Decoded:
    video = decode_video_url(
        part.payload,
        sampling=options.video_sampling,
        max_pixels=limits.max_image_pixels,
        max_duration_s=limits.max_video_s,
        max_frames=limits.max_video_frames,
        max_video_pixels=limits.max_video_pixels,
        remote=fetch_policy(limits),
        param=part.param,
        budget=budget,
    )
    return Decoded(video.frames, frames_per_s=video.frames_per_s)


DECODERS: dict[Modality, Decoder] = {
    Modality.IMAGE: _image_decoder,
    Modality.AUDIO: _audio_decoder,
    Modality.VIDEO: _video_decoder,
}

DEFAULT_OPTIONS = MediaOptions()


def decode_media(
    modality: Modality,
    payload: str,
    *,
    limits: MediaLimits,
    param: str,
    format: str | None = None,
    options: MediaOptions = DEFAULT_OPTIONS,
    budget: PixelBudget | None = None,
) -> Decoded:
    """Decode one item of `modality`; MediaError if the modality has no decoder or the data is bad.

    `format` is input_audio.format (audio only); `options` the served model's input format;
    `budget` the decoded pixels the item's request has left (None: only the per-item limits).
    """
    decoder = DECODERS.get(modality)
    if decoder is None:
        raise MediaError(f"{modality.value} input is not supported by this server", param)
    return decoder(_Part(payload, format, param), limits, options, budget)
