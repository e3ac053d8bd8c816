"""Small still images decode in the ingress's admission thread (no decoding-process round
trip), chosen from their headers alone: anything large, animated, odd or unreadable still goes
to a decoding process, and both paths give the same pixels and identifier (no Ray)."""

from __future__ import annotations

import base64
import io
import struct
import zlib

import numpy as np
import pytest
from PIL import Image

from cluster.config import LimitsConfig
from cluster.media import load
from cluster.media.image import declared_size, small_still_image
from router.types import Modality

LIMIT = 1 << 20


def _url(image: Image.Image, fmt: str, **save) -> str:
    buf = io.BytesIO()
    image.save(buf, fmt, **save)
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(buf.getvalue()).decode()


def _noise(width: int, height: int, seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def _png_bomb(width: int, height: int) -> str:
    """A PNG whose header declares width x height, with one tiny compressed row."""
    head = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    chunks = [
        (b"IHDR", head),
        (b"IDAT", zlib.compress(b"\0" * 16)),
        (b"IEND", b""),
    ]
    body = b"".join(
        struct.pack(">I", len(d)) + t + d + struct.pack(">I", zlib.crc32(t + d)) for t, d in chunks
    )
    return "data:image/png;base64," + base64.b64encode(b"\x89PNG\r\n\x1a\n" + body).decode()


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP"])
def test_small_still_images_are_small(fmt):
    assert small_still_image(_url(_noise(64, 48), fmt), LIMIT)
    assert not small_still_image(_url(_noise(64, 48), fmt), 64 * 48 - 1)  # over the limit
    assert not small_still_image(_url(_noise(64, 48), fmt), 0)  # inline decoding off


def test_large_animated_odd_and_remote_images_go_to_a_process():
    frames = [_noise(32, 32, seed) for seed in range(2)]
    animated = _url(frames[0], "WEBP", save_all=True, append_images=frames[1:])
    gif = _url(_noise(32, 32), "GIF")
    assert not small_still_image(animated, LIMIT)
    assert not small_still_image(gif.replace("image/gif", "image/png"), LIMIT)  # lies its type
    assert not small_still_image(gif, LIMIT)
    assert not small_still_image(_png_bomb(100_000, 100_000), LIMIT)  # a header bomb
    assert not small_still_image("data:image/png;base64,@@not base64@@", LIMIT)
    assert not small_still_image("https://example.com/cat.png", LIMIT)


def _load(url: str, limits: LimitsConfig):
    return load.load_media_item(Modality.IMAGE, url, namespace="m", limits=limits, param="p")


def test_a_small_image_never_reaches_a_process_and_decodes_as_there(monkeypatch):
    url = _url(_noise(80, 60), "PNG")
    in_a_process = _load(url, LimitsConfig(max_inline_decode_pixels=0))

    def no_process(shape):
        raise AssertionError("a small still image went to a decoding process")

    monkeypatch.setattr(load, "decode_pool", no_process)
    here = _load(url, LimitsConfig())
    assert here.identifier == in_a_process.identifier
    assert np.array_equal(here.data, in_a_process.data)
    with pytest.raises(AssertionError, match="decoding process"):
        _load(_url(_noise(80, 60), "PNG"), LimitsConfig(max_inline_decode_pixels=80 * 60 - 1))


def test_a_jpeg_is_sized_from_its_head_whatever_its_length():
    """Only the first 64 KiB are decoded to find a JPEG's size: a 550 KB one is still read."""
    url = _url(_noise(800, 600), "JPEG", quality=95)
    assert len(url) > 4 * 87_380
    assert small_still_image(url, 800 * 600) and not small_still_image(url, 800 * 600 - 1)


def test_a_jpeg_header_past_its_first_4_kib_is_still_found():
    """The first 4 KiB are read first; a frame header behind a large comment or EXIF block is
    found in the first 64 KiB, and a still image's declared size is what it decodes to."""
    late = _url(Image.new("RGB", (123, 45)), "JPEG", comment=b"x" * 20_000)
    early = _url(_noise(300, 200), "JPEG")
    assert declared_size(late) == (123, 45) and declared_size(early) == (300, 200)
    assert declared_size(_url(_noise(30, 20), "PNG")) == (30, 20)
    assert declared_size(_url(_noise(30, 20), "GIF")) is None  # may animate: not declared
