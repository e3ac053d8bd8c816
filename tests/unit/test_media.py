"""cluster/media/decoders.py and media_image.py: every rejection names the problem and the part;
RGB matches transformers."""

from __future__ import annotations

import base64
import io
import struct
import time
import zlib

import numpy as np
import pytest
from PIL import Image, ImageFile

from actors.types import MediaItem
from cluster.config import LimitsConfig
from cluster.media import decoders as media
from cluster.media import image as media_image
from cluster.media.decoders import decode_media
from cluster.media.errors import MediaError
from cluster.media.fetch import FetchPolicy
from cluster.media.image import decode_image_url
from cluster.media.load import load_media_item
from cluster.media.payload import decode_base64
from router.types import Modality

PARAM = "messages[1].content[2].image_url"
LIMIT = 1_000_000


def encode(image: Image.Image, fmt: str, **kwargs) -> bytes:
    buf = io.BytesIO()
    image.save(buf, fmt, **kwargs)
    return buf.getvalue()


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def decode(url: str, max_pixels: int = LIMIT, remote=None) -> np.ndarray:
    return decode_image_url(url, max_pixels=max_pixels, remote=remote, param=PARAM)


def rejects(url: str, *fragments: str, max_pixels: int = LIMIT, remote=None) -> MediaError:
    with pytest.raises(MediaError) as info:
        decode(url, max_pixels=max_pixels, remote=remote)
    assert info.value.param == PARAM
    for fragment in fragments:
        assert fragment in info.value.message, info.value.message
    return info.value


def pixels(h: int = 20, w: int = 30, channels: int = 3, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (h, w, channels), dtype=np.uint8)


def png_chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def png_declaring(width: int, height: int) -> bytes:
    """A tiny, valid-looking PNG whose IHDR declares width x height RGB pixels."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + png_chunk(b"IHDR", ihdr)
        + png_chunk(b"IDAT", zlib.compress(b"\0" * 64))
        + png_chunk(b"IEND", b"")
    )


def webp_vp8x_declaring(width: int, height: int) -> bytes:
    body = (
        b"\x00\x00\x00\x00" + (width - 1).to_bytes(3, "little") + (height - 1).to_bytes(3, "little")
    )
    chunk = b"VP8X" + struct.pack("<I", len(body)) + body
    return b"RIFF" + struct.pack("<I", 4 + len(chunk)) + b"WEBP" + chunk


# ----------------------------------------------------------------------------- accepted inputs


@pytest.mark.parametrize(
    "fmt,mime,kwargs",
    [
        ("PNG", "image/png", {}),
        ("WEBP", "image/webp", {"lossless": True}),
    ],
)
def test_lossless_formats_round_trip_exactly(fmt: str, mime: str, kwargs: dict) -> None:
    array = pixels()
    out = decode(data_url(encode(Image.fromarray(array), fmt, **kwargs), mime))
    assert out.dtype == np.uint8 and out.shape == (20, 30, 3)
    np.testing.assert_array_equal(out, array)


@pytest.mark.parametrize("mime", ["image/jpeg", "image/jpg", "IMAGE/JPEG"])
def test_jpeg_decodes(mime: str) -> None:
    out = decode(data_url(encode(Image.fromarray(pixels()), "JPEG"), mime))
    assert out.shape == (20, 30, 3) and out.dtype == np.uint8


def test_wrapped_base64_and_mismatched_but_allowed_mime_are_accepted() -> None:
    raw = base64.b64encode(encode(Image.fromarray(pixels()), "PNG")).decode()
    wrapped = "\n".join(raw[i : i + 76] for i in range(0, len(raw), 76))
    out = decode(f"data:image/jpeg;base64,{wrapped}")  # declared JPEG, actually PNG
    np.testing.assert_array_equal(out, pixels())


def test_base64_decodes_as_the_standard_library_does() -> None:
    """The fast decoder and its fallback together accept and refuse what the strict standard
    decoder (after line breaks are dropped) does, with the same bytes."""
    rng = np.random.default_rng(0)
    payloads = ["", "=", "YQ", "YQ=", "YQ==", "YQ===", "YWJj=", "YWJjZA==", "Y W", "é", "YQ==YQ=="]
    for n in range(40):
        raw = base64.b64encode(rng.bytes(n)).decode()
        payloads += [raw, raw[:-1], raw + "=", raw.replace("A", "-"), "\n".join(raw)]
    for payload in payloads:
        try:
            expected = base64.b64decode(
                payload.encode("ascii").translate(None, b" \n"), validate=True
            )
        except (ValueError, UnicodeEncodeError):
            expected = None
        if not expected:
            with pytest.raises(MediaError, match="base64|empty"):
                payload_of(payload)
        else:
            assert payload_of(payload) == expected, payload


def payload_of(payload: str) -> bytes:
    return decode_base64(payload, noun="image", where="data URL", param=PARAM)


# ----------------------------------------------------------------------- URL and payload rejections


def test_remote_urls_are_refused() -> None:
    rejects("https://example.com/cat.png", "fetching remote media is disabled")
    rejects("http://example.com/cat.png", "fetching remote media is disabled")
    others_only = FetchPolicy.of(
        ["media.internal"], [], max_bytes=1000, timeout_s=1, max_redirects=0
    )
    rejects("https://example.com/cat.png", "host 'example.com' is not allowed", remote=others_only)


@pytest.mark.parametrize("url", ["file:///etc/passwd", "ftp://host/x.png", "cat.png", ""])
def test_other_schemes_are_refused(url: str) -> None:
    rejects(url, "unsupported image URL")


def test_data_url_shape_rejections() -> None:
    png = encode(Image.fromarray(pixels()), "PNG")
    rejects("data:image/png;base64", "malformed data URL")
    rejects(data_url(png, "image/gif"), "unsupported image type 'image/gif'")
    rejects(data_url(png, "text/plain"), "unsupported image type 'text/plain'")
    rejects("data:image/png," + png.hex(), "only base64 data URLs")
    rejects("data:image/png;base64,@@@not*base64", "invalid base64")
    rejects("data:image/png;base64,abc", "invalid base64")  # bad padding
    rejects("data:image/png;base64,", "empty image data")


def test_non_image_data_is_refused() -> None:
    rejects(data_url(b"hello, this is not an image at all"), "not a PNG, JPEG or WebP image")


@pytest.mark.parametrize("fmt,name", [("GIF", "GIF"), ("BMP", "BMP"), ("TIFF", "TIFF")])
def test_other_image_formats_are_refused_by_content(fmt: str, name: str) -> None:
    # Declared as PNG: the decoded format decides, not the MIME type.
    data = encode(Image.fromarray(pixels()), fmt)
    rejects(data_url(data, "image/png"), f"unsupported image format {name}")


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP"])
def test_truncated_images_raise_instead_of_padding(fmt: str) -> None:
    data = encode(Image.fromarray(pixels(64, 64)), fmt)
    err = rejects(data_url(data[: len(data) // 2], "image/png"))
    assert "truncated" in err.message


def test_load_truncated_images_flag_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ImageFile, "LOAD_TRUNCATED_IMAGES", True)
    with pytest.raises(RuntimeError, match="LOAD_TRUNCATED_IMAGES"):
        decode(data_url(encode(Image.fromarray(pixels()), "PNG")))


# ----------------------------------------------------------------------------- size limits


def test_png_bomb_is_rejected_from_the_header_without_opening(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def never(*args, **kwargs):
        raise AssertionError("Pillow must not see a bomb")

    monkeypatch.setattr(media_image.Image, "open", never)
    start = time.perf_counter()
    rejects(
        data_url(png_declaring(100_000, 100_000)), "100000x100000", "10000000000 pixels", str(LIMIT)
    )
    assert time.perf_counter() - start < 0.5


def test_webp_bomb_is_rejected_from_the_header_without_opening(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(
        media_image.Image, "open", lambda *a, **k: pytest.fail("Pillow must not see a bomb")
    )
    rejects(
        data_url(webp_vp8x_declaring(16_000, 16_000), "image/webp"),
        "16000x16000",
        "over this server's limit",
    )


def test_real_images_over_the_limit_are_rejected() -> None:
    array = pixels(40, 50)
    for fmt, kwargs in [("PNG", {}), ("JPEG", {}), ("WEBP", {}), ("WEBP", {"lossless": True})]:
        rejects(
            data_url(encode(Image.fromarray(array), fmt, **kwargs)),
            "40 = 2000 pixels",
            max_pixels=1999,
        )
        assert decode(
            data_url(encode(Image.fromarray(array), fmt, **kwargs)), max_pixels=2000
        ).shape == (40, 50, 3)


def test_jpeg_over_the_limit_is_rejected_before_decoding(monkeypatch: pytest.MonkeyPatch) -> None:
    from PIL import JpegImagePlugin

    monkeypatch.setattr(
        JpegImagePlugin.JpegImageFile, "load", lambda self: pytest.fail("decoded pixels")
    )
    rejects(
        data_url(encode(Image.fromarray(pixels(40, 50)), "JPEG"), "image/jpeg"),
        "over this server's limit",
        max_pixels=100,
    )


def test_zero_size_is_rejected() -> None:
    rejects(data_url(png_declaring(0, 10)), "zero size")


@pytest.mark.parametrize("pillow_limit", [300, 1500])  # error (> 2x) and warning (> 1x) branches
def test_pillow_bomb_guard_becomes_media_error(
    monkeypatch: pytest.MonkeyPatch, pillow_limit: int
) -> None:
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", pillow_limit)
    jpeg = encode(Image.fromarray(pixels(40, 50)), "JPEG")  # 2000 pixels; our limit is far above
    rejects(data_url(jpeg, "image/jpeg"), "image too large", "decompression bomb")


# ------------------------------------------------------------------- RGB conversion = transformers'


def _images() -> dict[str, tuple[bytes, str]]:
    rgba = Image.fromarray(pixels(24, 40, 4, seed=1), "RGBA")
    la = Image.fromarray(pixels(24, 40, 2, seed=2), "LA")
    palette = Image.fromarray(pixels(24, 40, seed=3)).quantize(colors=16)
    palette_t = palette.copy()
    palette_t.info["transparency"] = 3
    gray = Image.fromarray(pixels(24, 40, seed=4)[..., 0], "L")
    cmyk = Image.fromarray(pixels(24, 40, 4, seed=5), "CMYK")
    return {
        "rgba_png": (encode(rgba, "PNG"), "image/png"),
        "la_png": (encode(la, "PNG"), "image/png"),
        "palette_png": (encode(palette, "PNG"), "image/png"),
        "palette_trns_png": (encode(palette_t, "PNG", transparency=3), "image/png"),
        "gray_jpeg": (encode(gray, "JPEG"), "image/jpeg"),
        "gray_png": (encode(gray, "PNG"), "image/png"),
        "cmyk_jpeg": (encode(cmyk, "JPEG"), "image/jpeg"),
        "rgba_webp": (encode(rgba, "WEBP", lossless=True), "image/webp"),
    }


@pytest.fixture(scope="module")
def clip_processor():
    transformers = pytest.importorskip("transformers")
    return transformers.CLIPImageProcessorPil(
        size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}
    )


@pytest.mark.parametrize("name", list(_images()))
def test_rgb_conversion_matches_clip_processor(name: str, clip_processor) -> None:
    data, mime = _images()[name]
    original = Image.open(io.BytesIO(data))
    ours = decode(data_url(data, mime))
    reference = clip_processor(images=original, return_tensors="np")["pixel_values"]
    via_us = clip_processor(images=Image.fromarray(ours), return_tensors="np")["pixel_values"]
    np.testing.assert_array_equal(via_us, reference)


@pytest.mark.parametrize("name", list(_images()))
def test_rgb_conversion_matches_transformers_convert_to_rgb(name: str) -> None:
    image_transforms = pytest.importorskip("transformers.image_transforms")
    data, mime = _images()[name]
    expected = image_transforms.convert_to_rgb(Image.open(io.BytesIO(data)), return_numpy=True)
    np.testing.assert_array_equal(decode(data_url(data, mime)), expected)


# ----------------------------------------------------------------------------- dispatch


def Limits(**overrides) -> LimitsConfig:
    """The real limits config, with this module's pixel limit."""
    return LimitsConfig(**{"max_image_pixels": LIMIT, **overrides})


def test_dispatch_by_modality(monkeypatch: pytest.MonkeyPatch) -> None:
    url = data_url(encode(Image.fromarray(pixels()), "PNG"))
    decoded = decode_media(Modality.IMAGE, url, limits=Limits(), param=PARAM)
    np.testing.assert_array_equal(decoded.data, pixels())
    assert decoded.sample_rate_hz is None and decoded.frames_per_s is None
    with pytest.raises(MediaError, match="unsupported audio format 'aiff'") as info:
        decode_media(
            Modality.AUDIO,
            "AAAA",
            limits=Limits(),
            param="messages[0].content[0].input_audio",
            format="aiff",
        )
    assert info.value.param == "messages[0].content[0].input_audio"
    monkeypatch.delitem(media.DECODERS, Modality.AUDIO)
    with pytest.raises(MediaError, match="audio input is not supported"):
        decode_media(Modality.AUDIO, "AAAA", limits=Limits(), param=PARAM)
    with pytest.raises(MediaError, match="over this server's limit"):
        decode_media(Modality.IMAGE, url, limits=Limits(max_image_pixels=10), param=PARAM)


def test_load_media_item_fingerprints_the_decoded_pixels() -> None:
    png = data_url(encode(Image.fromarray(pixels()), "PNG"))
    item = load_media_item(Modality.IMAGE, png, namespace="model-a", limits=Limits(), param=PARAM)
    assert isinstance(item, MediaItem) and item.modality == Modality.IMAGE and item.size == 600
    assert item.duration_s == 0.0 and item.sample_rate_hz is None and item.frames_per_s is None
    webp = data_url(encode(Image.fromarray(pixels()), "WEBP", lossless=True), "image/webp")
    assert (
        load_media_item(
            Modality.IMAGE, webp, namespace="model-a", limits=Limits(), param=PARAM
        ).identifier
        == item.identifier
    )


def test_limits_config_satisfies_media_limits() -> None:

    url = data_url(encode(Image.fromarray(pixels()), "PNG"))
    assert decode_media(Modality.IMAGE, url, limits=LimitsConfig(), param=PARAM).data.shape == (
        20,
        30,
        3,
    )
    with pytest.raises(MediaError, match="remote media is disabled"):
        decode_media(Modality.IMAGE, "https://x/y.png", limits=LimitsConfig(), param=PARAM)


def test_media_error_is_a_value_error() -> None:
    err = MediaError("bad", "messages[0].content[0].image_url")
    assert isinstance(err, ValueError) and str(err) == "bad" and err.param.endswith("image_url")
