"""Video decoding: a `video_url` data URL -> frames sampled on a time grid, limits enforced.

Animated GIF and WebP go through Pillow (always installed); MP4 and WebM through PyAV,
imported on first use because it is the optional `video` extra. Which frames are kept
is decided from headers and timestamps alone (VideoSampling), and what keeping them will
decode is charged to the per-video and per-request pixel budgets, all before any frame
is rendered; only kept frames are converted to RGB. No torch here.
"""

from __future__ import annotations

import contextlib
import io
import math
import struct
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from PIL import Image

from cluster.media.budget import DecodeCost, PixelBudget, check_video_pixels
from cluster.media.errors import MediaError
from cluster.media.fetch import FetchPolicy
from cluster.media.image import (
    PIL_ERRORS,
    check_header_pixels,
    check_pixels,
    convert_to_rgb,
    require_strict_pillow,
)
from cluster.media.payload import UrlKind, data_url_bytes
from cluster.media.probe import probe_animation

VIDEO_URL = UrlKind(
    "video",
    frozenset({"video/mp4", "video/webm", "image/gif", "image/webp"}),
    "video/mp4, video/webm, image/gif or image/webp",
    "data:video/mp4;base64,...",
)
# MIME type -> (library, the format that library is forced to read). Forcing the demuxer
# matters for PyAV: left to probe, FFmpeg would also open playlists that name other files.
_READERS = {
    "image/gif": ("pillow", "GIF"),
    "image/webp": ("pillow", "WEBP"),
    "video/mp4": ("av", "mp4"),
    "video/webm": ("av", "webm"),
}

# Animated images: browsers show a frame of <= 10 ms for 100 ms, and so do we. Hence every
# frame lasts over 10 ms, which bounds the frame count of a clip within the limit.
_SHORTEST_SHOWN_MS = 10
_DEFAULT_FRAME_MS = 100
# Slack when matching grid times to frame start times, so float rounding cannot pick
# the frame before a boundary that a grid point lands on exactly.
_TIME_SLACK_S = 1e-6


@dataclass(frozen=True)
class VideoSampling:
    """Which frames to keep: about `fps` per second, evenly spaced, between min and max frames."""

    fps: float = 2.0
    max_frames: int = 32
    min_frames: int = 1

    def __post_init__(self) -> None:
        if not (self.fps > 0 and math.isfinite(self.fps)):
            raise ValueError(f"VideoSampling.fps must be a positive number, got {self.fps}")
        if not 1 <= self.min_frames <= self.max_frames:
            raise ValueError(
                "VideoSampling needs 1 <= min_frames <= max_frames, "
                f"got {self.min_frames} and {self.max_frames}"
            )


@dataclass(frozen=True)
class DecodedVideo:
    frames: np.ndarray = field(repr=False)  # T x H x W x 3 uint8 RGB
    frames_per_s: float  # num_frames / duration_s: the rate of the sampling grid
    duration_s: float  # of the whole clip
    timestamps_s: tuple[float, ...]  # start of each kept source frame, from the clip's start

    @property
    def num_frames(self) -> int:
        return int(self.frames.shape[0])


@dataclass(frozen=True)
class _Timeline:
    """When each source frame starts (s, ascending, first at 0) and how long the clip lasts."""

    starts_s: np.ndarray
    duration_s: float


def decode_video_url(
    url: str,
    *,
    sampling: VideoSampling,
    max_pixels: int,
    max_duration_s: float,
    max_frames: int,
    remote: FetchPolicy | None,
    param: str,
    max_video_pixels: int | None = None,
    budget: PixelBudget | None = None,
) -> DecodedVideo:
    """A video URL from a request -> the frames `sampling` keeps, at most `max_frames` of them.

    Raises MediaError for remote or unknown URLs, bad base64, unsupported MIME types, data
    that does not decode as the declared type, clips with no frames, clips longer than
    `max_duration_s`, frames over `max_pixels`, clips that would decode more than
    `max_video_pixels` (None: no such limit) or than the request's `budget` has left;
    for MP4/WebM when PyAV is missing too. Every limit is checked before any frame is rendered.
    """
    mime, data = data_url_bytes(url, kind=VIDEO_URL, remote=remote, param=param)
    library, fmt = _READERS[mime]
    reader = _AnimatedImage if library == "pillow" else _AvVideo
    clip = reader(data, fmt, max_pixels=max_pixels, param=param)
    timeline = clip.timeline(max_duration_s)
    if timeline.duration_s > max_duration_s:
        raise MediaError(
            f"video is {timeline.duration_s:.1f} s long, "
            f"over this server's limit of {max_duration_s:g} s",
            param,
        )
    indices, frames_per_s = select_frames(timeline, sampling, max_frames=max_frames)
    cost = clip.cost(indices)
    check_video_pixels(cost, max_pixels=max_video_pixels, param=param)
    if budget is not None:
        budget.charge(cost, param=param, noun="video")
    frames = clip.frames(sorted(set(indices.tolist())))
    return DecodedVideo(
        np.stack([frames[i] for i in indices.tolist()]),
        frames_per_s,
        timeline.duration_s,
        tuple(float(timeline.starts_s[i]) for i in indices),
    )


def sample_times(duration_s: float, sampling: VideoSampling, *, max_frames: int) -> np.ndarray:
    """n evenly spaced times from 0 over the clip: n = duration x fps (rounded), clamped.

    Evenly spaced over the whole clip, so n / duration_s is exactly the grid's rate, which
    time-aligned position encodings need; when the cap binds, the grid just gets coarser.
    """
    cap = max(1, min(sampling.max_frames, max_frames))
    wanted = math.floor(duration_s * sampling.fps + 0.5)
    count = max(1, min(max(wanted, sampling.min_frames), cap))
    return np.arange(count) * (duration_s / count)


def select_frames(
    timeline: _Timeline, sampling: VideoSampling, *, max_frames: int
) -> tuple[np.ndarray, float]:
    """(index of the source frame on screen at each grid time, the grid's frames per second)."""
    times = sample_times(timeline.duration_s, sampling, max_frames=max_frames)
    indices = np.searchsorted(timeline.starts_s, times + _TIME_SLACK_S, side="right") - 1
    return np.clip(indices, 0, len(timeline.starts_s) - 1), len(times) / timeline.duration_s


# ----------------------------------------------------------------------------- GIF, WebP (Pillow)


class _AnimatedImage:
    """Headers first (canvas, frame durations: nothing rendered); then Pillow renders frames
    in order up to the last kept one, and only kept ones are converted."""

    def __init__(self, data: bytes, fmt: str, *, max_pixels: int, param: str) -> None:
        require_strict_pillow()
        self.data, self.fmt, self.max_pixels, self.param = data, fmt, max_pixels, param
        # The canvas the first bytes declare, before any walk: a zero or vast one ends here.
        check_header_pixels(data, max_pixels=max_pixels, param=param, noun="video frame")
        if data[:6] in (b"GIF87a", b"GIF89a") and len(data) >= 10:
            self._check_size(struct.unpack("<HH", data[6:10]))
        self.canvas = (0, 0)

    def timeline(self, max_duration_s: float) -> _Timeline:
        # Every frame shows over 10 ms, so this many frames already last too long.
        too_many = max(1, math.ceil(max_duration_s * 1e3 / _SHORTEST_SHOWN_MS))
        header = probe_animation(self.data, self.fmt, max_frames=too_many, param=self.param)
        if header.num_frames >= too_many:
            raise MediaError(
                f"video has {header.num_frames} frames or more, each shown over "
                f"{_SHORTEST_SHOWN_MS} ms, so it lasts longer than this server's limit of "
                f"{max_duration_s:g} s",
                self.param,
            )
        self.canvas = (header.width, header.height)
        self._check_size(self.canvas)  # a GIF frame may enlarge the canvas
        ends_s = np.cumsum([_shown_ms(ms) for ms in header.durations_ms]) / 1e3
        return _Timeline(np.concatenate([[0.0], ends_s[:-1]]), float(ends_s[-1]))

    def cost(self, indices: np.ndarray) -> DecodeCost:
        """Each frame up to the last kept one is rendered on the full canvas; kept ones
        (repeats included) are stacked at canvas size."""
        return DecodeCost(max(len(indices), int(indices.max()) + 1), *self.canvas)

    def frames(self, indices: list[int]) -> dict[int, np.ndarray]:
        out = {}
        with self._pillow_errors("corrupt or truncated"):
            try:
                image = Image.open(io.BytesIO(self.data), formats=(self.fmt,))
            except Image.UnidentifiedImageError:
                raise MediaError(
                    f"data is not a {self.fmt} image (or it is corrupt)", self.param
                ) from None
            width, height = image.size  # frames are cropped to this, as browsers do
            for index in indices:  # ascending: Pillow composites GIF frames in order anyway
                image.seek(index)
                self._check_canvas(image.size)
                out[index] = convert_to_rgb(image)[:height, :width]
        return out

    def _check_size(self, size: tuple[int, int]) -> None:
        check_pixels(*size, max_pixels=self.max_pixels, param=self.param, noun="video frame")

    def _check_canvas(self, size: tuple[int, int]) -> None:
        """Pillow must not render more than the headers said (and the budgets paid for)."""
        if size[0] > self.canvas[0] or size[1] > self.canvas[1]:
            raise MediaError(
                f"corrupt {self.fmt} data: a frame is {size[0]}x{size[1]}, larger than the "
                f"{self.canvas[0]}x{self.canvas[1]} canvas its headers declare",
                self.param,
            )

    def _pillow_errors(self, what: str) -> contextlib.AbstractContextManager[None]:
        return _pillow_errors(f"{what} {self.fmt} data", self.param)


@contextlib.contextmanager
def _pillow_errors(what: str, param: str) -> Iterator[None]:
    """Pillow's exceptions, and its bomb warnings made errors, -> MediaError."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        try:
            yield
        except MediaError:
            raise
        except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
            raise MediaError(f"video frame too large: {exc}", param) from None
        except PIL_ERRORS as exc:
            raise MediaError(f"{what}: {exc}", param) from None


def _shown_ms(duration: Any) -> float:
    ms = float(duration) if isinstance(duration, (int, float)) else 0.0
    return ms if ms > _SHORTEST_SHOWN_MS else _DEFAULT_FRAME_MS


# ----------------------------------------------------------------------------- MP4, WebM (PyAV)


class _AvVideo:
    """Two passes: packet timestamps (demux only, nothing decoded), then a decode that
    converts only the kept frames, at the size the stream header declares, and stops
    after the last of them."""

    def __init__(self, data: bytes, fmt: str, *, max_pixels: int, param: str) -> None:
        self.av = _import_av(param)
        self.data, self.fmt, self.max_pixels, self.param = data, fmt, max_pixels, param
        self._pts: np.ndarray = np.zeros(0, dtype=np.int64)
        self.frame_size = (0, 0)

    def timeline(self, max_duration_s: float) -> _Timeline:
        with self._open() as container:
            stream = self._stream(container)
            if container.duration is not None and container.duration / 1e6 > max_duration_s:
                raise MediaError(
                    f"video is {container.duration / 1e6:.1f} s long, "
                    f"over this server's limit of {max_duration_s:g} s",
                    self.param,
                )
            codec = stream.codec_context
            if codec is None:  # PyAV found no decoder for it, or the header is cut short
                raise MediaError(
                    f"{self.fmt} video stream cannot be decoded (unknown codec or corrupt header)",
                    self.param,
                )
            if not (codec.width and codec.height):  # the budgets need it before decoding
                raise MediaError(
                    f"{self.fmt} video stream does not declare its frame size (corrupt header)",
                    self.param,
                )
            check_pixels(
                codec.width,
                codec.height,
                max_pixels=self.max_pixels,
                param=self.param,
                noun="video frame",
            )
            self.frame_size = (codec.width, codec.height)
            return self._scan(container, stream, max_duration_s)

    def _scan(self, container: Any, stream: Any, max_duration_s: float) -> _Timeline:
        time_base = float(stream.time_base)
        pts: list[int] = []
        latest, last_ticks = None, 0
        with self._av_errors():
            for packet in container.demux(stream):
                if packet.pts is None or packet.size == 0 or getattr(packet, "is_discard", False):
                    continue  # the end-of-stream flush packet, or one the edit list drops
                if pts and (packet.pts - pts[0]) * time_base > max_duration_s:
                    raise MediaError(
                        f"video is longer than this server's limit of {max_duration_s:g} s",
                        self.param,
                    )
                pts.append(packet.pts)
                if latest is None or packet.pts >= latest:  # the last frame shown, for its duration
                    latest, last_ticks = packet.pts, packet.duration or 0
        if not pts:
            raise MediaError("video has no frames", self.param)
        self._pts = np.unique(np.asarray(pts, dtype=np.int64))  # presentation order
        starts_s = (self._pts - self._pts[0]) * time_base
        gaps_s = np.diff(starts_s)
        last_s = last_ticks * time_base or (float(np.median(gaps_s)) if len(gaps_s) else 0.0)
        if last_s <= 0 and stream.average_rate:
            last_s = 1.0 / float(stream.average_rate)
        return _Timeline(starts_s, float(starts_s[-1] + (last_s or _DEFAULT_FRAME_MS / 1e3)))

    def cost(self, indices: np.ndarray) -> DecodeCost:
        """Kept frames (repeats included) at the header's size. Frames decoded only to reach
        them are not counted: the decoder reuses one frame's memory for them."""
        return DecodeCost(len(indices), *self.frame_size)

    def frames(self, indices: list[int]) -> dict[int, np.ndarray]:
        wanted = {int(self._pts[i]): i for i in indices}
        out: dict[int, np.ndarray] = {}
        width, height = self.frame_size  # every kept frame is scaled to it, as the budgets counted
        with self._open() as container, self._av_errors():
            for frame in container.decode(self._stream(container)):
                index = wanted.get(frame.pts)
                if index is None or index in out:
                    continue
                check_pixels(
                    frame.width,
                    frame.height,
                    max_pixels=self.max_pixels,
                    param=self.param,
                    noun="video frame",
                )
                out[index] = frame.to_ndarray(format="rgb24", width=width, height=height)
                if len(out) == len(wanted):
                    break  # nothing after the last kept frame is needed
        if len(out) < len(wanted):
            raise MediaError(
                f"corrupt {self.fmt} video: {len(wanted) - len(out)} of the sampled frames "
                "could not be decoded",
                self.param,
            )
        return out

    def _open(self) -> Any:
        with self._av_errors("data does not decode as"):
            return self.av.open(io.BytesIO(self.data), mode="r", format=self.fmt)

    def _stream(self, container: Any) -> Any:
        if not container.streams.video:
            raise MediaError(f"{self.fmt} data has no video stream", self.param)
        return container.streams.video[0]

    def _av_errors(self, what: str = "corrupt") -> contextlib.AbstractContextManager[None]:
        return _av_errors(self.av, f"{what} {self.fmt} video", self.param)


@contextlib.contextmanager
def _av_errors(av: Any, what: str, param: str) -> Iterator[None]:
    """FFmpeg's exceptions -> MediaError."""
    try:
        yield
    except MediaError:
        raise
    except (av.error.FFmpegError, EOFError, ValueError) as exc:
        # FFmpegError's str() adds an errno and a '<none>' file name; strerror is the message.
        raise MediaError(f"{what}: {getattr(exc, 'strerror', None) or exc}", param) from None


def _import_av(param: str) -> Any:
    try:
        import av  # optional: the `video` extra
    except ImportError:
        raise MediaError(
            "MP4 and WebM video need PyAV, which this server does not have; "
            "install epd's optional 'video' extra (pip install 'epd[video]'), "
            "or send an animated GIF or WebP",
            param,
        ) from None
    return av
