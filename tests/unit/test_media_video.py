"""cluster/media/video.py: frames sampled on a time grid, from GIF, WebP, MP4 and WebM; limits
hold."""

from __future__ import annotations

import base64
import io
import sys

import numpy as np
import pytest
from PIL import Image, ImageSequence

from benchkit import media
from cluster.config import LimitsConfig
from cluster.media import video as media_video
from cluster.media.decoders import MediaOptions
from cluster.media.errors import MediaError
from cluster.media.fetch import FetchPolicy
from cluster.media.load import load_media_item
from cluster.media.video import (
    VideoSampling,
    _Timeline,
    decode_video_url,
    sample_times,
    select_frames,
)
from router.types import Modality

PARAM = "messages[0].content[1].video_url"
LIMIT = 1_000_000
STEP = 12  # animated images: red channel of source frame i is i * STEP
BITS = media.STRIPE_BITS  # encoded videos: source frame i shows i in binary as stripes


def data_url(data: bytes, mime: str) -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def decode(
    url: str,
    sampling: VideoSampling = VideoSampling(),
    *,
    max_pixels: int = LIMIT,
    max_s: float = 600.0,
    max_frames: int = 256,
    remote=None,
):
    return decode_video_url(
        url,
        sampling=sampling,
        max_pixels=max_pixels,
        max_duration_s=max_s,
        max_frames=max_frames,
        remote=remote,
        param=PARAM,
    )


def rejects(url: str, *fragments: str, **kwargs) -> MediaError:
    with pytest.raises(MediaError) as info:
        decode(url, **kwargs)
    assert info.value.param == PARAM
    for fragment in fragments:
        assert fragment in info.value.message, info.value.message
    return info.value


def source_index(frames: np.ndarray) -> list[int]:
    """Which source frame each decoded animated-image frame is, read back from its red channel."""
    return [int(round(float(frame[..., 0].mean()) / STEP)) for frame in frames]


def stripe_index(frames: np.ndarray) -> list[int]:
    """Which source frame each decoded video frame is, read back from the stripes' centres."""
    stripe = frames.shape[2] // BITS
    centres = frames[:, :, [bit * stripe + stripe // 2 for bit in range(BITS)]].mean(axis=(1, 3))
    return [int(sum(1 << bit for bit in range(BITS) if row[bit] > 128)) for row in centres]


# ----------------------------------------------------------------------------- inputs built here


def encoded_video(fmt: str = "mp4", **shape) -> bytes:
    """benchkit's encoded video, or a skip where PyAV or its encoder for `fmt` is missing."""
    pytest.importorskip("av")
    try:
        return media.encoded_video(fmt, **shape)
    except RuntimeError as exc:  # no encoder for fmt in this PyAV build
        pytest.skip(str(exc))


def red_frames(count: int, size: tuple[int, int] = (30, 20)) -> list[Image.Image]:
    return [Image.new("RGB", size, (i * STEP, 0, 0)) for i in range(count)]


def animated(frames: list[Image.Image], fmt: str, durations_ms: list[int] | int, **kwargs) -> bytes:
    buf = io.BytesIO()
    frames[0].save(
        buf, fmt, save_all=True, append_images=frames[1:], duration=durations_ms, loop=0, **kwargs
    )
    return buf.getvalue()


def gif_with_partial_frames() -> bytes:
    """Frames that change only a patch (Pillow writes them as sub-rectangles), every disposal."""
    frames = []
    for i in range(6):
        rgb = np.full((20, 30, 3), (10, 20, 30), np.uint8)
        rgb[2 + i : 6 + i, 3 * i : 3 * i + 5] = (200, 40 * i, 0)
        frames.append(Image.fromarray(rgb))
    return animated(frames, "GIF", [100, 200, 300, 400, 100, 100], disposal=[0, 1, 2, 1, 2, 0])


# ----------------------------------------------------------------------------- the sampling grid


def test_sampling_grid() -> None:
    np.testing.assert_allclose(
        sample_times(2.0, VideoSampling(fps=2), max_frames=256), [0, 0.5, 1, 1.5]
    )
    np.testing.assert_allclose(
        sample_times(2.1, VideoSampling(fps=2), max_frames=256), np.arange(4) * 2.1 / 4
    )
    # over max_frames: max_frames evenly over the whole clip, from either cap
    np.testing.assert_allclose(
        sample_times(10.0, VideoSampling(fps=2, max_frames=4), max_frames=256), [0, 2.5, 5, 7.5]
    )
    assert len(sample_times(10.0, VideoSampling(fps=2, max_frames=32), max_frames=3)) == 3
    # under min_frames, and never fewer than one
    assert (
        len(sample_times(1.0, VideoSampling(fps=1, min_frames=3, max_frames=8), max_frames=256))
        == 3
    )
    np.testing.assert_allclose(sample_times(0.2, VideoSampling(fps=2), max_frames=256), [0.0])


def test_select_frames_picks_the_frame_on_screen() -> None:
    timeline = _Timeline(np.array([0.0, 0.1, 0.3, 0.6]), 1.0)
    indices, frames_per_s = select_frames(timeline, VideoSampling(fps=4), max_frames=256)
    assert indices.tolist() == [0, 1, 2, 3] and frames_per_s == 4.0  # grid 0, .25, .5, .75
    indices, frames_per_s = select_frames(timeline, VideoSampling(fps=10), max_frames=256)
    assert indices.tolist() == [0, 1, 1, 2, 2, 2, 3, 3, 3, 3] and frames_per_s == 10.0
    # A grid point on a boundary (0.3 = 3 * 0.1 in floats) picks the frame that starts there.
    indices, _ = select_frames(
        _Timeline(np.arange(10) * 0.1, 1.0), VideoSampling(fps=10), max_frames=256
    )
    assert indices.tolist() == list(range(10))


@pytest.mark.parametrize(
    "kwargs",
    [{"fps": 0}, {"fps": float("nan")}, {"min_frames": 0}, {"min_frames": 5, "max_frames": 4}],
)
def test_sampling_policy_is_validated(kwargs: dict) -> None:
    with pytest.raises(ValueError, match="VideoSampling"):
        VideoSampling(**kwargs)


# ----------------------------------------------------------------------------- MP4 / WebM (PyAV)


def test_mp4_fps_sampling() -> None:
    video = decode(data_url(encoded_video(), "video/mp4"), VideoSampling(fps=2))
    assert video.frames.dtype == np.uint8 and video.frames.shape == (4, 32, 48, 3)
    assert (
        video.num_frames == 4
        and video.frames_per_s == 2.0
        and video.duration_s == pytest.approx(2.0)
    )
    assert video.timestamps_s == pytest.approx((0.0, 0.5, 1.0, 1.5))
    assert stripe_index(video.frames) == [0, 5, 10, 15]


def test_mp4_max_frames_cap_samples_evenly() -> None:
    url = data_url(encoded_video(), "video/mp4")
    video = decode(url, VideoSampling(fps=10, max_frames=5))
    assert (
        video.timestamps_s == pytest.approx((0.0, 0.4, 0.8, 1.2, 1.6)) and video.frames_per_s == 2.5
    )
    assert stripe_index(video.frames) == [0, 4, 8, 12, 16]
    assert (
        decode(url, VideoSampling(fps=10, max_frames=32), max_frames=3).num_frames == 3
    )  # the limit caps too
    every = decode(url, VideoSampling(fps=10, max_frames=32))
    assert stripe_index(every.frames) == list(range(20)) and every.frames_per_s == 10.0


@pytest.mark.parametrize(
    "fmt,mime,codec", [("mp4", "video/mp4", "libx264"), ("webm", "video/webm", None)]
)
def test_other_codecs(fmt: str, mime: str, codec: str | None) -> None:
    av = pytest.importorskip("av")
    if codec and codec not in av.codecs_available:
        pytest.skip(f"no {codec}")
    # libx264 reorders frames (B-frames): frames are matched by timestamp, not by decode order.
    video = decode(data_url(encoded_video(fmt, codec=codec), mime), VideoSampling(fps=4))
    assert video.num_frames == 8 and video.frames_per_s == 4.0
    assert stripe_index(video.frames) == [0, 2, 5, 7, 10, 12, 15, 17]


def test_only_kept_frames_are_converted(monkeypatch: pytest.MonkeyPatch) -> None:
    av = pytest.importorskip("av")
    url = data_url(encoded_video(num_frames=30), "video/mp4")
    converted, original = [], av.VideoFrame.to_ndarray

    def counting(self, *args, **kwargs):
        converted.append(self.pts)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(av.VideoFrame, "to_ndarray", counting)
    assert decode(url, VideoSampling(fps=1)).num_frames == 3  # 3 s at 10 fps: frames 0, 10, 20
    assert len(converted) == 3


def test_mp4_limits() -> None:
    url = data_url(encoded_video(), "video/mp4")
    rejects(url, "video is 2.0 s long", "limit of 1.5 s", max_s=1.5)
    rejects(url, "video frame is 48x32 = 1536 pixels", "limit of 1535 pixels", max_pixels=1535)


def test_mp4_undecodable_and_mismatched_data() -> None:
    mp4 = encoded_video()
    rejects(data_url(b"not a video at all" * 20, "video/mp4"), "data does not decode as mp4 video")
    rejects(data_url(mp4, "video/webm"), "data does not decode as webm video")
    rejects(data_url(mp4[: len(mp4) // 2], "video/mp4"), "mp4")
    rejects(data_url(animated(red_frames(3), "GIF", 100), "video/mp4"), "does not decode as mp4")


def test_video_with_no_frames(monkeypatch: pytest.MonkeyPatch) -> None:
    av = pytest.importorskip("av")
    url = data_url(encoded_video(), "video/mp4")
    monkeypatch.setattr(av.container.InputContainer, "demux", lambda self, *a, **k: iter(()))
    rejects(url, "video has no frames")


def test_missing_pyav_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    url = data_url(encoded_video(), "video/mp4")
    monkeypatch.setitem(sys.modules, "av", None)  # import av now raises ImportError
    rejects(url, "need PyAV", "'video' extra", "epd[video]")
    rejects(data_url(b"\x1a\x45\xdf\xa3", "video/webm"), "need PyAV")
    assert (
        decode(data_url(animated(red_frames(3), "GIF", 100), "image/gif")).num_frames == 1
    )  # Pillow's


# ----------------------------------------------------------------------------- GIF / WebP (Pillow)


def test_gif_frames_equal_what_pillow_shows_and_follow_durations() -> None:
    gif = gif_with_partial_frames()
    video = decode(data_url(gif, "image/gif"), VideoSampling(fps=10, max_frames=100))
    assert video.duration_s == pytest.approx(1.2) and video.frames_per_s == 10.0
    assert video.timestamps_s == pytest.approx(
        (0, 0.1, 0.1, 0.3, 0.3, 0.3, 0.6, 0.6, 0.6, 0.6, 1.0, 1.1)
    )
    shown = [
        np.array(f.convert("RGB")) for f in ImageSequence.Iterator(Image.open(io.BytesIO(gif)))
    ]
    for frame, index in zip(video.frames, [0, 1, 1, 2, 2, 2, 3, 3, 3, 3, 4, 5]):
        np.testing.assert_array_equal(frame, shown[index])


def test_gif_durations_of_zero_show_for_100_ms() -> None:
    video = decode(data_url(animated(red_frames(5), "GIF", 0), "image/gif"), VideoSampling(fps=10))
    assert video.duration_s == pytest.approx(0.5) and source_index(video.frames) == [0, 1, 2, 3, 4]


def test_gif_transparency_is_composited_on_white_like_images() -> None:
    first = np.zeros((8, 8, 4), np.uint8)
    first[..., 0], first[..., 3] = 255, 255
    first[:, :4, 3] = 0  # left half transparent (its colour stays red underneath)
    frames = [Image.fromarray(first, "RGBA"), Image.new("RGBA", (8, 8), (0, 255, 0, 255))]
    video = decode(data_url(animated(frames, "GIF", 100), "image/gif"), VideoSampling(fps=10))
    assert video.frames[0, 0, [0, 7]].tolist() == [[255, 255, 255], [255, 0, 0]]
    assert video.frames[1, 0, [0, 7]].tolist() == [[0, 255, 0], [0, 255, 0]]


def test_animated_webp_lossless_is_exact() -> None:
    frames = [
        Image.fromarray(np.random.default_rng(i).integers(0, 256, (20, 30, 3), dtype=np.uint8))
        for i in range(4)
    ]
    webp = animated(frames, "WEBP", [100, 200, 300, 400], lossless=True)
    video = decode(data_url(webp, "image/webp"), VideoSampling(fps=4))
    assert video.timestamps_s == pytest.approx(
        (0.0, 0.1, 0.3, 0.6)
    ) and video.duration_s == pytest.approx(1.0)
    for frame, original in zip(video.frames, frames):
        np.testing.assert_array_equal(frame, np.array(original))


def test_still_gif_and_webp_are_one_frame_videos() -> None:
    for fmt, mime in [("GIF", "image/gif"), ("WEBP", "image/webp")]:
        buf = io.BytesIO()
        red_frames(1)[0].save(buf, fmt)
        video = decode(data_url(buf.getvalue(), mime))
        assert video.num_frames == 1 and video.duration_s == pytest.approx(0.1)


def test_animated_image_limits() -> None:
    gif = data_url(animated(red_frames(4), "GIF", 100), "image/gif")
    rejects(gif, "video frame is 30x20 = 600 pixels", "limit of 599 pixels", max_pixels=599)
    rejects(gif, "video is 0.4 s long", "limit of 0.3 s", max_s=0.3)
    webp = data_url(animated(red_frames(4), "WEBP", 100, lossless=True), "image/webp")
    rejects(webp, "video frame is 30x20", max_pixels=599)


def test_many_frames_are_refused_before_decoding(monkeypatch: pytest.MonkeyPatch) -> None:
    distinct = [
        Image.new("RGB", (4, 4), (i, 255 - i, 0)) for i in range(200)
    ]  # Pillow merges repeats
    url = data_url(animated(distinct, "GIF", 20), "image/gif")
    monkeypatch.setattr(media_video, "convert_to_rgb", lambda *a: pytest.fail("decoded frames"))
    rejects(url, "video has 200 frames", "limit of 2 s", max_s=2.0)


def test_animated_image_undecodable_data() -> None:
    rejects(data_url(b"not a gif" * 20, "image/gif"), "data is not a GIF image")
    rejects(data_url(b"not a webp" * 20, "image/webp"), "data is not a WEBP image")
    png = io.BytesIO()
    red_frames(1)[0].save(png, "PNG")
    rejects(data_url(png.getvalue(), "image/gif"), "data is not a GIF image")
    gif = animated(red_frames(6, (64, 64)), "GIF", 100)
    rejects(data_url(gif[: len(gif) * 2 // 3], "image/gif"), "GIF")


# ----------------------------------------------------------------------------- URLs


def test_url_rejections() -> None:
    rejects(
        "https://example.com/clip.mp4", "fetching remote media is disabled", "send the video inline"
    )
    others_only = FetchPolicy.of(
        ["media.internal"], [], max_bytes=1000, timeout_s=1, max_redirects=0
    )
    rejects("https://example.com/clip.mp4", "host 'example.com' is not allowed", remote=others_only)
    rejects("file:///etc/passwd", "unsupported video URL")
    rejects(
        data_url(b"x", "video/quicktime"),
        "unsupported video type 'video/quicktime'",
        "video/mp4, video/webm, image/gif or image/webp",
    )
    rejects("data:video/mp4,abc", "only base64 data URLs")
    rejects("data:video/mp4;base64,@@", "invalid base64")
    rejects("data:video/mp4;base64,", "empty video data")


# ------------------------------------------------------------------------------ through the front d


def Limits(**overrides) -> LimitsConfig:
    """The real limits config, with this module's pixel limit."""
    return LimitsConfig(**{"max_image_pixels": LIMIT, **overrides})


def test_load_media_item_video() -> None:
    url = data_url(animated(red_frames(10), "GIF", 100), "image/gif")

    def load(fps: float, limits: Limits = Limits()):
        return load_media_item(
            Modality.VIDEO,
            url,
            namespace="m",
            limits=limits,
            param=PARAM,
            options=MediaOptions(video_sampling=VideoSampling(fps=fps)),
        )

    item = load(5)
    assert item.modality == Modality.VIDEO and item.data.shape == (5, 20, 30, 3)
    assert (
        item.frames_per_s == 5.0 and item.duration_s == pytest.approx(1.0) and item.size == 5 * 600
    )
    assert item.sample_rate_hz is None
    assert load(5).identifier == item.identifier and load(10).identifier != item.identifier
    assert (
        load(10, Limits(max_video_frames=5)).identifier == item.identifier
    )  # same frames, same grid
    with pytest.raises(MediaError, match="limit of 0.5 s"):
        load(5, Limits(max_video_s=0.5))
