"""Image decoding: a `data:image/...` URL -> HxWx3 uint8 RGB, with the pixel limit enforced.

Everything a client sends is untrusted: each failure becomes a MediaError that names
the offending content part. Also home of the RGB conversion and the pixel-count check
that animated images in cluster/media/video.py reuse. No torch here.
"""

from __future__ import annotations

import base64
import io
import struct
import warnings
import zlib

import numpy as np
from PIL import Image, ImageFile

from cluster.media.budget import DecodeCost, PixelBudget
from cluster.media.errors import MediaError
from cluster.media.fetch import FetchPolicy
from cluster.media.payload import UrlKind, data_url_bytes
from cluster.media.png_plain import decode_plain_png, plain_png_size

# Formats we decode. MPO is what Pillow calls a JPEG with extra (multi-picture)
# frames, which phone cameras produce; its first frame is an ordinary JPEG.
_PIL_FORMATS = ("PNG", "JPEG", "WEBP")
_ACCEPTED_FORMATS = frozenset(_PIL_FORMATS) | {"MPO"}
IMAGE_URL = UrlKind(
    "image",
    frozenset({"image/png", "image/jpeg", "image/jpg", "image/webp"}),
    "image/png, image/jpeg or image/webp",
    "data:image/png;base64,...",
)
_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
# What Pillow raises on corrupt or truncated data (beyond its bomb errors).
PIL_ERRORS = (OSError, SyntaxError, ValueError, EOFError, struct.error, zlib.error)

# Magic numbers of formats we refuse, only so the error can name what was sent.
_OTHER_MAGIC = (
    (b"GIF87a", "GIF"),
    (b"GIF89a", "GIF"),
    (b"BM", "BMP"),
    (b"II*\x00", "TIFF"),
    (b"MM\x00*", "TIFF"),
    (b"\x00\x00\x01\x00", "ICO"),
    (b"8BPS", "PSD"),
)


def decode_image_url(
    url: str,
    *,
    max_pixels: int,
    remote: FetchPolicy | None,
    param: str,
    budget: PixelBudget | None = None,
) -> np.ndarray:
    """An image URL from a request -> HxWx3 uint8 RGB, exactly as the CLIP processor converts it.

    Raises MediaError for remote or unknown URLs, bad base64, non-images, formats other
    than PNG/JPEG/WebP, truncated data, zero-size images, images over `max_pixels`, and
    images the request's `budget` cannot pay for (charged before any pixel is decoded).
    """
    require_strict_pillow()  # refused whichever decodes it: a server so configured pads
    _, data = data_url_bytes(url, kind=IMAGE_URL, remote=remote, param=param)
    check_header_pixels(data, max_pixels=max_pixels, param=param)
    if (size := plain_png_size(data)) is not None:  # checked above: the header's size
        if budget is not None:
            budget.charge(DecodeCost(1, *size), param=param, noun="image")
        if (rgb := decode_plain_png(data, *size)) is not None:
            return rgb
        budget = None  # charged: Pillow's way (to decode it, or to say why not) pays nothing
    image = _open_and_load(data, max_pixels=max_pixels, param=param, budget=budget)
    return convert_to_rgb(image)


LOW_DETAIL_SIDE = 512  # image_url.detail "low": at most 512 x 512, as OpenAI's low detail


def low_detail(pixels: np.ndarray) -> np.ndarray:
    """The image shrunk (aspect kept) to fit LOW_DETAIL_SIDE square; a smaller one as it is.
    Fewer pixels mean fewer tokens for dynamic-resolution models (Qwen2.5-VL, LLaVA-NeXT)."""
    if max(pixels.shape[:2]) <= LOW_DETAIL_SIDE:
        return pixels
    image = Image.fromarray(pixels)
    image.thumbnail((LOW_DETAIL_SIDE, LOW_DETAIL_SIDE), Image.Resampling.BICUBIC)
    return np.asarray(image)


def header_size(data: bytes) -> tuple[int, int] | None:
    """(width, height) read from a PNG or WebP header without decoding, None if unknown.

    Why: Pillow's WebP opener allocates the whole canvas when it opens the file, and
    Pillow's own bomb limit (~179M pixels) is far above ours, so check first.
    JPEG needs no pre-check: Pillow reads its size without touching pixel data.
    """
    if data.startswith(_PNG_SIGNATURE) and len(data) >= 24 and data[12:16] == b"IHDR":
        return struct.unpack(">II", data[16:24])
    if not (data.startswith(b"RIFF") and data[8:12] == b"WEBP" and len(data) >= 30):
        return None
    chunk = data[12:16]
    if chunk == b"VP8 " and data[23:26] == b"\x9d\x01\x2a":
        width, height = struct.unpack("<HH", data[26:30])
        return width & 0x3FFF, height & 0x3FFF
    if chunk == b"VP8X":
        return int.from_bytes(data[24:27], "little") + 1, int.from_bytes(data[27:30], "little") + 1
    if chunk == b"VP8L" and data[20] == 0x2F:
        bits = int.from_bytes(data[21:25], "little")
        return (bits & 0x3FFF) + 1, ((bits >> 14) & 0x3FFF) + 1
    return None


def check_pixels(
    width: int, height: int, *, max_pixels: int, param: str, noun: str = "image"
) -> None:
    """MediaError unless 0 < width * height <= max_pixels; `noun` names the thing (e.g. "video
    frame")."""
    if width <= 0 or height <= 0:
        raise MediaError(f"{noun} has zero size ({width}x{height})", param)
    if width * height > max_pixels:
        raise MediaError(
            f"{noun} is {width}x{height} = {width * height} pixels, "
            f"over this server's limit of {max_pixels} pixels",
            param,
        )


def check_header_pixels(data: bytes, *, max_pixels: int, param: str, noun: str = "image") -> None:
    """check_pixels on the size a PNG or WebP header declares, before Pillow allocates anything."""
    size = header_size(data)
    if size is not None:
        check_pixels(*size, max_pixels=max_pixels, param=param, noun=noun)


def require_strict_pillow() -> None:
    """RuntimeError if someone flipped Pillow's global: decoding would zero-pad truncated images."""
    if ImageFile.LOAD_TRUNCATED_IMAGES:
        raise RuntimeError("PIL.ImageFile.LOAD_TRUNCATED_IMAGES is True; refusing to decode media")


def _open_and_load(
    data: bytes, *, max_pixels: int, param: str, budget: PixelBudget | None
) -> Image.Image:
    """Open (header only), check format and size, then decode every pixel (Pillow's global
    truncation flag already checked by the caller)."""
    # Why catch_warnings: Pillow only warns between MAX_IMAGE_PIXELS and twice that; make it an
    # error.
    with warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        try:
            image = Image.open(io.BytesIO(data), formats=_PIL_FORMATS)
        except Image.UnidentifiedImageError:
            raise _not_an_image(data, param) from None
        except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
            raise MediaError(f"image too large: {exc}", param) from None
        except PIL_ERRORS as exc:
            raise MediaError(f"invalid or truncated image data: {exc}", param) from None
        if image.format not in _ACCEPTED_FORMATS:  # defensive: formats= already restricts this
            raise MediaError(
                f"unsupported image format {image.format}; send PNG, JPEG or WebP", param
            )
        check_pixels(*image.size, max_pixels=max_pixels, param=param)
        if budget is not None:
            budget.charge(DecodeCost(1, *image.size), param=param, noun="image")
        try:
            image.load()  # decode now, so truncation raises here instead of being padded
        except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
            raise MediaError(f"image too large: {exc}", param) from None
        except PIL_ERRORS as exc:
            raise MediaError(f"corrupt or truncated {image.format} image: {exc}", param) from None
    return image


def _not_an_image(data: bytes, param: str) -> MediaError:
    for magic, name in _OTHER_MAGIC:
        if data.startswith(magic):
            return MediaError(f"unsupported image format {name}; send PNG, JPEG or WebP", param)
    return MediaError("data is not a PNG, JPEG or WebP image (or it is corrupt)", param)


def convert_to_rgb(image: Image.Image) -> np.ndarray:
    """HxWx3 uint8 RGB; a mirror of transformers.image_transforms.convert_to_rgb (PIL branch).

    Why mirror rather than import: that module imports torch, and the ingress must not.
    Transparency (an alpha band or a tRNS colour) is composited onto white; every other
    mode goes through Pillow's convert("RGB"). tests/unit/test_media.py pins the equivalence.
    """
    has_alpha = "A" in image.getbands() or image.info.get("transparency") is not None
    if has_alpha:
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        rgb = Image.alpha_composite(background, rgba).convert("RGB")
    else:
        rgb = image.convert("RGB")
    return np.array(rgb)


_HEAD_B64 = 64  # base64 characters of a PNG's or WebP's first 48 bytes: their size is there
# A JPEG's first 4 KiB, then its first 64 KiB: its frame header follows EXIF and the tables,
# which most photos keep within the first (the header read runs twice per JPEG: a budget
# reservation, then the choice of where it decodes)
_JPEG_HEAD_B64 = (5_464, 87_380)


def small_still_image(url: str, max_pixels: int) -> bool:
    """Whether `url` is an inline still PNG, JPEG or WebP whose header declares at most
    `max_pixels` pixels: cheap to decode anywhere."""
    if max_pixels <= 0 or (inline := _inline_image(url)) is None:
        return False
    if len(url) - inline[1] > max_pixels * 4:
        return False  # more bytes than raw pixels would take
    size = declared_size(url)
    return size is not None and size[0] * size[1] <= max_pixels


def declared_size(url: str) -> tuple[int, int] | None:
    """(width, height) as an inline still PNG, JPEG or WebP declares them: headers only, a PNG's
    or WebP's from its first bytes, a JPEG's through Pillow's open of its first 64 KiB (which
    allocates no pixels). None for anything odd, animated or unreadable (its decoding names it)."""
    if (inline := _inline_image(url)) is None:
        return None
    kind, start = inline
    try:
        if kind == "jpeg":  # its size is in the first 64 KiB but for odd files
            return _jpeg_declared(url, start)
        head = base64.b64decode(url[start : start + _HEAD_B64])
        animated = head[12:16] == b"VP8X" and head[20] & 0x02  # the WebP animation flag
        return None if animated else header_size(head)
    except (ValueError, TypeError, IndexError):
        return None


def _inline_image(url: str) -> tuple[str, int] | None:
    """(format, where the base64 payload starts) of a data URL of a PNG, JPEG or WebP; read from
    a slice, never a copy of the payload: this runs holding the GIL."""
    if not url.startswith("data:image/"):
        return None
    kind, sep, _ = url[len("data:image/") : len("data:image/") + 16].partition(";base64,")
    if not sep or kind not in ("png", "jpeg", "webp"):
        return None  # a format that may animate
    return kind, len("data:image/") + len(kind) + len(sep)


def _jpeg_declared(url: str, start: int) -> tuple[int, int] | None:
    for head_b64 in _JPEG_HEAD_B64:
        size = _jpeg_size(base64.b64decode(url[start : start + head_b64]))
        if size is not None or len(url) <= start + head_b64:
            return size
    return None


def _jpeg_size(data: bytes) -> tuple[int, int] | None:
    try:
        with Image.open(io.BytesIO(data), formats=("JPEG",)) as image:
            return image.size
    except Exception:  # noqa: BLE001 - not a readable JPEG: the decoding process names it
        return None
