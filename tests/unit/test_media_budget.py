"""Pixel budgets and header probes (cluster/media/budget.py, media_probe.py): media that would
decode too much is refused from its headers, before any frame is rendered, with a 400
naming the limit and the part."""

from __future__ import annotations

import base64
import io
import struct
import time
import tracemalloc

import numpy as np
import pytest
from PIL import Image, ImageSequence

from cluster.config import LimitsConfig
from cluster.media.budget import PixelBudget
from cluster.media.decoders import MediaOptions
from cluster.media.errors import MediaError
from cluster.media.load import load_media_item
from cluster.media.probe import probe_animation
from cluster.media.video import VideoSampling
from cluster.protocol import MediaPart
from router.types import Modality
from tests.unit.test_media_video import (
    animated,
    data_url,
    encoded_video,
    gif_with_partial_frames,
    red_frames,
)
from tests.unit.test_request_path_media import path, request_path

PARAM = "messages[0].content[1].video_url"
MB = 2**20


def gif(canvas: tuple[int, int], frames: list[tuple[int, int, int]]) -> bytes:
    """A GIF written by hand: a two-colour `canvas` and 1x1 frames at (left, top), each
    shown `delay_cs` centiseconds. Pillow will not write a canvas larger than its frames."""
    head = b"GIF89a" + struct.pack("<HHBBB", *canvas, 0x80, 0, 0) + b"\x00\x00\x00\xff\xff\xff"
    body = b"".join(
        b"\x21\xf9\x04\x00"
        + struct.pack("<H", delay_cs)
        + b"\x00\x00"  # graphic control
        + b"\x2c"
        + struct.pack("<HHHHB", left, top, 1, 1, 0)  # image descriptor
        + b"\x02\x02\x44\x01\x00"  # LZW data of one pixel
        for left, top, delay_cs in frames
    )
    return head + body + b"\x3b"


def load(
    url: str,
    *,
    limits: LimitsConfig = LimitsConfig(),
    modality: Modality = Modality.VIDEO,
    sampling: VideoSampling = VideoSampling(),
    budget: PixelBudget | None = None,
):
    return load_media_item(
        modality,
        url,
        namespace="m",
        limits=limits,
        param=PARAM,
        budget=budget,
        options=MediaOptions(video_sampling=sampling),
    )


def refused(url: str, *fragments: str, **kwargs) -> MediaError:
    with pytest.raises(MediaError) as info:
        load(url, **kwargs)
    assert info.value.param == PARAM
    for fragment in fragments:
        assert fragment in info.value.message, info.value.message
    return info.value


def png(width: int, height: int) -> str:
    buf = io.BytesIO()
    Image.new("RGB", (width, height), (90, 20, 200)).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


# ----------------------------------------------------------------------------- per video


def test_66_byte_gif_bomb_is_refused_from_its_headers(monkeypatch: pytest.MonkeyPatch) -> None:
    """4000x4000 canvas, two 1x1 frames of 10 s: 32 sampled frames would be 1.5 GB of RGB."""
    bomb = gif((4000, 4000), [(0, 0, 1000), (0, 0, 1000)])
    assert len(bomb) == 66
    monkeypatch.setattr(Image, "open", lambda *a, **k: pytest.fail("Pillow opened the bomb"))
    in_process = LimitsConfig(
        decode_in_process=True
    )  # the patch, the clock and tracemalloc see this process only
    tracemalloc.start()
    started = time.perf_counter()
    try:
        error = refused(
            data_url(bomb, "image/gif"),
            "32 frames of 4000x4000",
            "max_video_pixels",
            limits=in_process,
        )
        elapsed_s = time.perf_counter() - started
        _, peak_bytes = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # Decoding 32 such frames takes seconds; the bound only has to tell that apart, with room
    # for a busy host (0.1 s failed once beside the integration clusters, under tracemalloc).
    assert elapsed_s < 1.0, elapsed_s
    assert peak_bytes < 1 * MB, peak_bytes  # nothing decoded
    assert "limit of 96000000 pixels per video" in error.message


def test_many_frames_on_a_big_canvas_are_refused_by_the_video_budget() -> None:
    frames = [
        Image.fromarray(np.full((300, 400, 3), (i * 8, 255 - i * 8, 0), np.uint8))
        for i in range(30)
    ]
    url = data_url(animated(frames, "GIF", 100), "image/gif")  # 3 s: 6 frames kept at 2 fps
    limits = LimitsConfig(max_video_pixels=25 * 120_000)
    refused(
        url,
        "video decodes to 26 frames of 400x300",
        "limit of 3000000 pixels per video",
        limits=limits,
    )
    assert load(url, limits=LimitsConfig(max_video_pixels=26 * 120_000)).data.shape == (
        6,
        300,
        400,
        3,
    )


def test_frames_rendered_only_to_reach_a_kept_one_count_too() -> None:
    """Pillow renders every GIF frame on the full canvas to reach the next kept one."""
    url = data_url(gif((100, 100), [(0, 0, 2)] * 20 + [(0, 0, 1000)]), "image/gif")
    sparse = VideoSampling(fps=0.2, max_frames=2)  # keeps frames 0 and 20 only
    refused(
        url,
        "21 frames of 100x100",
        limits=LimitsConfig(max_video_pixels=20 * 10_000),
        sampling=sparse,
    )
    assert (
        load(url, limits=LimitsConfig(max_video_pixels=21 * 10_000), sampling=sparse).data.shape[0]
        == 2
    )


def test_mp4_is_charged_its_kept_frames_at_the_header_size() -> None:
    url = data_url(encoded_video(), "video/mp4")  # 2 s of 48x32 at 10 fps: 4 frames kept at 2 fps
    refused(url, "4 frames of 48x32 = 6144 pixels", limits=LimitsConfig(max_video_pixels=6143))
    assert load(url, limits=LimitsConfig(max_video_pixels=6144)).data.shape == (4, 32, 48, 3)


def test_a_gif_frame_past_the_declared_canvas_is_counted_and_still_decodes() -> None:
    url = data_url(gif((4, 4), [(0, 0, 10), (9, 9, 10)]), "image/gif")  # frame 2 reaches 10x10
    refused(url, "video frame is 10x10 = 100 pixels", limits=LimitsConfig(max_image_pixels=99))
    refused(url, "video decodes to 10x10 = 100 pixels", limits=LimitsConfig(max_video_pixels=99))
    assert load(url, sampling=VideoSampling(fps=10)).data.shape == (
        2,
        4,
        4,
        3,
    )  # cropped as browsers do


# ----------------------------------------------------------------------------- per request


def test_large_images_together_are_refused_by_the_request_budget() -> None:
    rp = path()
    rp.config = rp.config.replace(limits={"max_request_pixels": 2_500_000, "max_audio_s": 5})
    parts = [
        MediaPart(Modality.IMAGE, png(1000, 1000), f"messages[0].content[{i}].image_url")
        for i in range(3)
    ]
    assert len(rp._decode_media(parts[:2])) == 2
    with pytest.raises(request_path.RequestError) as info:
        rp._decode_media(parts)
    error = info.value
    assert error.status == 400 and error.param == parts[2].param
    assert (
        "image decodes to 1000x1000 = 1000000 pixels (with the request's other media, 3000000)"
        in error.message
    )
    assert "limit of 2500000 pixels per request (max_request_pixels)" in error.message


def test_images_and_video_share_the_request_budget() -> None:
    video = data_url(animated(red_frames(4, (100, 100)), "GIF", 500), "image/gif")  # 2 s: 4 frames
    budget = PixelBudget(50_000)
    load(png(200, 100), modality=Modality.IMAGE, budget=budget)
    assert budget.spent_pixels == 20_000
    refused(video, "4 frames of 100x100", "max_request_pixels", budget=budget)
    assert budget.spent_pixels == 20_000  # a refused item spends nothing
    assert load(video, budget=PixelBudget(60_000)).data.shape == (4, 100, 100, 3)


# ----------------------------------------------------------------------------- header probes


@pytest.mark.parametrize("fmt", ["GIF", "WEBP"])
def test_probe_reads_what_pillow_shows(fmt: str) -> None:
    data = (
        gif_with_partial_frames()
        if fmt == "GIF"
        else animated(red_frames(5), "WEBP", [100, 250, 0, 40, 7], lossless=True)
    )
    header = probe_animation(data, fmt, max_frames=1000, param=PARAM)
    image = Image.open(io.BytesIO(data))
    assert (header.width, header.height) == image.size
    durations_ms = []
    for frame in ImageSequence.Iterator(image):
        frame.load()  # WebP reports a frame's duration once it is decoded
        durations_ms.append(frame.info.get("duration"))
    assert list(header.durations_ms) == durations_ms


def test_probe_stops_at_max_frames_and_refuses_truncation() -> None:
    data = gif((8, 8), [(0, 0, 2)] * 50)
    assert probe_animation(data, "GIF", max_frames=10, param=PARAM).num_frames == 10
    refused(
        data_url(data, "image/gif"),
        "video has 50 frames or more",
        limits=LimitsConfig(max_video_s=0.5),
    )
    for cut in (20, 40, len(data) - 3):
        with pytest.raises(MediaError, match="corrupt or truncated GIF data"):
            probe_animation(data[:cut], "GIF", max_frames=1000, param=PARAM)
    webp = animated(red_frames(3), "WEBP", 100, lossless=True)
    with pytest.raises(MediaError, match="corrupt or truncated WEBP data"):
        probe_animation(webp[:-10], "WEBP", max_frames=1000, param=PARAM)
