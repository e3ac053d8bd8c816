"""Decoding of media from request content, with the cluster's limits enforced.

Everything a client sends is untrusted: each failure becomes a MediaError that
names the offending content part, so the HTTP layer can answer 400 instead of 500.
No torch here: this runs in the ingress, before any model is involved.
"""
from __future__ import annotations

import base64
import binascii
import io
import re
import struct
import warnings
import zlib
from typing import Callable, Protocol

import numpy as np
from PIL import Image, ImageFile

from actors.identifiers import media_identifier
from actors.types import MediaItem, Modality

# Formats we decode. MPO is what Pillow calls a JPEG with extra (multi-picture)
# frames, which phone cameras produce; its first frame is an ordinary JPEG.
_PIL_FORMATS = ("PNG", "JPEG", "WEBP")
_ACCEPTED_FORMATS = frozenset(_PIL_FORMATS) | {"MPO"}
_IMAGE_MIME_TYPES = frozenset({"image/png", "image/jpeg", "image/jpg", "image/webp"})
_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"

# Magic numbers of formats we refuse, only so the error can name what was sent.
_OTHER_MAGIC = (
    (b"GIF87a", "GIF"), (b"GIF89a", "GIF"), (b"BM", "BMP"), (b"II*\x00", "TIFF"),
    (b"MM\x00*", "TIFF"), (b"\x00\x00\x01\x00", "ICO"), (b"8BPS", "PSD"),
)
_WHITESPACE = re.compile(rb"\s+")


class MediaError(ValueError):
    """A content part the server cannot use; `param` is its JSON path in the request."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class MediaLimits(Protocol):
    """The fields of cluster.config.LimitsConfig that decoding needs (no import of cluster/)."""

    max_image_pixels: int
    allow_remote_media: bool


# ----------------------------------------------------------------------------- dispatch

# One decoder per modality: (url or payload, limits, param) -> decoded array.
# Audio and video decoders register here beside the image one.
Decoder = Callable[[str, MediaLimits, str], np.ndarray]


def _image_decoder(url: str, limits: MediaLimits, param: str) -> np.ndarray:
    return decode_image_url(url, max_pixels=limits.max_image_pixels,
                            allow_remote=limits.allow_remote_media, param=param)


DECODERS: dict[Modality, Decoder] = {Modality.IMAGE: _image_decoder}


def decode_media(modality: Modality, payload: str, *, limits: MediaLimits, param: str) -> np.ndarray:
    """Decode one item of `modality`; MediaError if the modality has no decoder or the data is bad."""
    decoder = DECODERS.get(modality)
    if decoder is None:
        raise MediaError(f"{modality.value} input is not supported by this server", param)
    return decoder(payload, limits, param)


def load_media_item(modality: Modality, payload: str, *, namespace: str,
                    limits: MediaLimits, param: str) -> MediaItem:
    """Decode and fingerprint one item: what the ingress hands to the encoder stage."""
    data = decode_media(modality, payload, limits=limits, param=param)
    return MediaItem(modality=modality, identifier=media_identifier(namespace, modality, data), data=data)


# ----------------------------------------------------------------------------- images

def decode_image_url(url: str, *, max_pixels: int, allow_remote: bool, param: str) -> np.ndarray:
    """An image URL from a request -> HxWx3 uint8 RGB, exactly as the CLIP processor converts it.

    Raises MediaError for remote or unknown URLs, bad base64, non-images, formats other
    than PNG/JPEG/WebP, truncated data, zero-size images and images over `max_pixels`.
    """
    data = _data_url_bytes(url, param=param, allow_remote=allow_remote)
    _check_header_size(data, max_pixels=max_pixels, param=param)
    image = _open_and_load(data, max_pixels=max_pixels, param=param)
    return convert_to_rgb(image)


def _data_url_bytes(url: str, *, param: str, allow_remote: bool) -> bytes:
    """The bytes of a `data:image/...;base64,` URL; remote and other schemes are refused."""
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme in ("http", "https"):
        if not allow_remote:
            raise MediaError("fetching remote media is disabled on this server; "
                             "send the image inline as a base64 data URL", param)
        raise MediaError("fetching remote media is not implemented yet; "
                         "send the image inline as a base64 data URL", param)
    if scheme != "data":
        shown = f"'{scheme}' URLs" if scheme else "this URL"
        raise MediaError(f"unsupported image URL: {shown} cannot be used; "
                         "send a base64 data URL (data:image/png;base64,...)", param)
    header, sep, payload = url[5:].partition(",")
    if not sep:
        raise MediaError("malformed data URL: no ',' between header and data", param)
    fields = [f.strip().lower() for f in header.split(";")]
    mime = fields[0]
    if mime not in _IMAGE_MIME_TYPES:
        raise MediaError(f"unsupported image type '{mime or '(none)'}'; "
                         "send image/png, image/jpeg or image/webp", param)
    if "base64" not in fields[1:]:
        raise MediaError("only base64 data URLs are supported (data:image/png;base64,...)", param)
    return _b64decode(payload, param=param)


def _b64decode(payload: str, *, param: str) -> bytes:
    # Line breaks inside the payload are common (MIME-style wrapping); anything else is an error.
    try:
        raw = _WHITESPACE.sub(b"", payload.encode("ascii"))
        data = base64.b64decode(raw, validate=True)
    except (UnicodeEncodeError, binascii.Error, ValueError) as exc:
        raise MediaError(f"invalid base64 in data URL: {exc}", param) from None
    if not data:
        raise MediaError("empty image data in data URL", param)
    return data


def _header_size(data: bytes) -> tuple[int, int] | None:
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


def _check_size(width: int, height: int, *, max_pixels: int, param: str) -> None:
    if width <= 0 or height <= 0:
        raise MediaError(f"image has zero size ({width}x{height})", param)
    if width * height > max_pixels:
        raise MediaError(f"image is {width}x{height} = {width * height} pixels, over this "
                         f"server's limit of {max_pixels} pixels", param)


def _check_header_size(data: bytes, *, max_pixels: int, param: str) -> None:
    size = _header_size(data)
    if size is not None:
        _check_size(*size, max_pixels=max_pixels, param=param)


def _open_and_load(data: bytes, *, max_pixels: int, param: str) -> Image.Image:
    """Open (header only), check format and size, then decode every pixel."""
    if ImageFile.LOAD_TRUNCATED_IMAGES:
        # Someone flipped Pillow's global; decoding now would zero-pad truncated images.
        raise RuntimeError("PIL.ImageFile.LOAD_TRUNCATED_IMAGES is True; refusing to decode media")
    # Why catch_warnings: Pillow only warns between MAX_IMAGE_PIXELS and twice that; make it an error.
    with warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        try:
            image = Image.open(io.BytesIO(data), formats=_PIL_FORMATS)
        except Image.UnidentifiedImageError:
            raise _not_an_image(data, param) from None
        except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
            raise MediaError(f"image too large: {exc}", param) from None
        except (OSError, SyntaxError, ValueError, EOFError, struct.error, zlib.error) as exc:
            raise MediaError(f"invalid or truncated image data: {exc}", param) from None
        if image.format not in _ACCEPTED_FORMATS:  # defensive: formats= already restricts this
            raise MediaError(f"unsupported image format {image.format}; send PNG, JPEG or WebP", param)
        _check_size(*image.size, max_pixels=max_pixels, param=param)
        try:
            image.load()  # decode now, so truncation raises here instead of being padded
        except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
            raise MediaError(f"image too large: {exc}", param) from None
        except (OSError, SyntaxError, ValueError, EOFError, struct.error, zlib.error) as exc:
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
