"""Plain PNGs through libspng (cluster/media/png_plain.py): the same pixels as Pillow's, the
same verdict on a corrupt stream, charged once to the request's pixel budget; everything that
is not plain left to Pillow."""

from __future__ import annotations

import io
import struct
import zlib

import numpy as np
import pytest
from PIL import Image

from cluster.media import image as media_image
from cluster.media import png_plain
from cluster.media.budget import PixelBudget
from cluster.media.errors import MediaError
from tests.unit.test_media import LIMIT, data_url, encode, pixels


def pillow(data: bytes) -> np.ndarray:
    return media_image.convert_to_rgb(Image.open(io.BytesIO(data)))


def decode(data: bytes, budget: PixelBudget | None = None) -> np.ndarray:
    url, param = data_url(data), "p"
    return media_image.decode_image_url(
        url, max_pixels=LIMIT, remote=None, param=param, budget=budget
    )


def plain_pngs() -> dict[str, bytes]:
    rgb, gradient = pixels(37, 53, seed=1), np.tile(np.arange(64, dtype=np.uint8)[:, None], (1, 3))
    gradient = np.repeat(gradient[None], 21, axis=0)  # every row Paeth-filtered, as UIs are
    return {
        "rgb": encode(Image.fromarray(rgb), "PNG"),
        "rgb_level0": encode(Image.fromarray(rgb), "PNG", compress_level=0),
        "rgb_optimized": encode(Image.fromarray(rgb), "PNG", optimize=True),
        "gradient": encode(Image.fromarray(gradient), "PNG"),
        "one_pixel": encode(Image.fromarray(rgb[:1, :1]), "PNG"),
        "grey": encode(Image.fromarray(rgb[..., 0], "L"), "PNG"),
        "palette_4_bit": encode(Image.fromarray(rgb).quantize(colors=7), "PNG"),
        "palette_8_bit": encode(Image.fromarray(rgb).quantize(colors=200), "PNG"),
    }


def test_libspng_is_reached_through_the_installed_pyspng():
    assert png_plain._libspng() is not None  # else every PNG silently takes Pillow's time


@pytest.mark.parametrize("name", list(plain_pngs()))
def test_a_plain_png_decodes_to_pillows_pixels(name: str):
    data = plain_pngs()[name]
    assert png_plain.plain_png_size(data) == Image.open(io.BytesIO(data)).size
    assert png_plain.decode_plain_png(data, *png_plain.plain_png_size(data)) is not None
    got = decode(data)
    assert got.dtype == np.uint8 and got.flags.writeable
    np.testing.assert_array_equal(got, pillow(data))


def _not_plain() -> dict[str, bytes]:
    rgb = pixels(12, 10, seed=2)
    frames = [Image.fromarray(rgb), Image.fromarray(255 - rgb)]
    palette = Image.fromarray(rgb).quantize(colors=4)
    return {
        "rgba": encode(Image.fromarray(pixels(12, 10, 4)), "PNG"),
        "grey_alpha": encode(Image.fromarray(pixels(12, 10, 2), "LA"), "PNG"),
        "sixteen_bit": encode(Image.fromarray(rgb[..., 0].astype(np.uint16) << 8), "PNG"),
        "palette_trns": encode(palette, "PNG", transparency=1),
        "rgb_trns": encode(Image.fromarray(rgb), "PNG", transparency=(1, 2, 3)),
        "animated": encode(frames[0], "PNG", save_all=True, append_images=frames[1:]),
        "jpeg": encode(Image.fromarray(rgb), "JPEG"),
    }


@pytest.mark.parametrize("name", list(_not_plain()))
def test_what_is_not_plain_is_left_to_pillow(name: str):
    assert png_plain.plain_png_size(_not_plain()[name]) is None


def _chunks(data: bytes):
    at = 8
    while at < len(data):
        length, kind = struct.unpack_from(">I4s", data, at)
        yield kind, at, length
        at += 12 + length


def _corrupted(seed: int) -> bytes:
    """A plain PNG with one byte of its pixel stream changed and, for odd seeds, its chunk's
    CRC made to match (only the zlib stream's own checksum can tell then)."""
    rng = np.random.default_rng(seed)
    data = bytearray(plain_pngs()["gradient" if seed % 3 else "rgb"])
    _, at, length = next(chunk for chunk in _chunks(bytes(data)) if chunk[0] == b"IDAT")
    data[at + 8 + int(rng.integers(0, length))] ^= int(rng.integers(1, 256))
    if seed % 2:
        crc = zlib.crc32(bytes(data[at + 4 : at + 8 + length]))
        data[at + 8 + length : at + 12 + length] = struct.pack(">I", crc)
    return bytes(data)


def test_a_corrupt_stream_gets_pillows_verdict_and_pixels():
    verdicts = set()
    for seed in range(60):
        data = _corrupted(seed)
        try:
            expected = pillow(data)
        except (OSError, SyntaxError, ValueError, EOFError, zlib.error):
            expected = None
        if expected is None:
            with pytest.raises(MediaError, match="corrupt or truncated|invalid or truncated"):
                decode(data)
        else:
            np.testing.assert_array_equal(decode(data), expected)
        verdicts.add(expected is None)
    assert verdicts == {True, False}  # both kinds were met


@pytest.mark.parametrize("corrupt", [False, True])
def test_the_budget_is_charged_once_whichever_decodes(corrupt: bool):
    data = _corrupted(3) if corrupt else plain_pngs()["rgb"]
    width, height = Image.open(io.BytesIO(data)).size
    assert (png_plain.decode_plain_png(data, width, height) is None) == corrupt  # Pillow's then
    budget = PixelBudget(LIMIT)
    try:
        decode(data, budget)
    except MediaError:
        pass
    assert budget.spent_pixels == width * height
