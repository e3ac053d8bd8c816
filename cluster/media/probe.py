"""Animated GIF and WebP headers: canvas size and per-frame durations, with no pixel decoded.

Why not Pillow: it reads a GIF frame's duration only when it seeks there with the frame
before it rendered on the full canvas, and libwebp (behind Pillow's WebP opener) allocates
the canvas up front; a 66-byte GIF declaring 4000x4000 and two long frames became
gigabytes that way. These walkers read only block and chunk headers, skip image data,
and stop after `max_frames` frames (the caller knows that many already last too long), so
their cost is bounded whatever the file declares.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from cluster.media.errors import MediaError
from cluster.media.image import header_size

_GIF_TRAILER, _GIF_EXTENSION, _GIF_IMAGE, _GIF_CONTROL = 0x3B, 0x21, 0x2C, 0xF9


@dataclass(frozen=True)
class AnimationHeader:
    width: (
        int  # the canvas: the largest any frame needs (a GIF frame may reach past the declared one)
    )
    height: int
    durations_ms: tuple[
        float | None, ...
    ]  # per frame as declared; None where a GIF frame gives none

    @property
    def num_frames(self) -> int:
        return len(self.durations_ms)


class _Truncated(Exception):
    pass


def probe_animation(data: bytes, fmt: str, *, max_frames: int, param: str) -> AnimationHeader:
    """Header of an animated (or still) GIF or WEBP; MediaError if `data` is not one or is cut
    short."""
    probe = _probe_gif if fmt == "GIF" else _probe_webp
    try:
        return probe(data, max_frames, param)
    except (_Truncated, struct.error, IndexError):
        raise MediaError(
            f"corrupt or truncated {fmt} data: a block runs past the end of the file", param
        ) from None


def _probe_gif(data: bytes, max_frames: int, param: str) -> AnimationHeader:
    if data[:6] not in (b"GIF87a", b"GIF89a"):
        raise MediaError("data is not a GIF image (or it is corrupt)", param)
    width, height, flags = struct.unpack_from("<HHB", data, 6)
    pos = 13 + _color_table_bytes(flags)
    durations: list[float | None] = []
    delay_ms = None
    while (
        pos < len(data) and len(durations) < max_frames
    ):  # no trailer: Pillow stops at the end too
        kind, pos = data[pos], pos + 1
        if kind == _GIF_TRAILER:
            break
        if kind == _GIF_EXTENSION:
            label, first, pos = (
                data[pos],
                _sub_block(data, pos + 1),
                _skip_sub_blocks(data, pos + 1),
            )
            if label == _GIF_CONTROL and len(first) >= 3:  # applies to the next image, as in Pillow
                delay_ms = struct.unpack_from("<H", first, 1)[0] * 10
        elif kind == _GIF_IMAGE:
            left, top, w, h, image_flags = struct.unpack_from("<HHHHB", data, pos)
            pos += 9 + _color_table_bytes(image_flags) + 1  # + LZW minimum code size
            pos = _skip_sub_blocks(data, pos)
            width, height = max(width, left + w), max(height, top + h)
            durations.append(delay_ms)
            delay_ms = None
        # any other byte is skipped, as Pillow skips it
    if not durations:
        raise MediaError("GIF has no frames", param)
    return AnimationHeader(width, height, tuple(durations))


def _color_table_bytes(flags: int) -> int:
    return 3 << ((flags & 7) + 1) if flags & 0x80 else 0


def _sub_block(data: bytes, pos: int) -> bytes:
    return data[pos + 1 : pos + 1 + data[pos]]


def _skip_sub_blocks(data: bytes, pos: int) -> int:
    """The position after a run of sub-blocks and its zero terminator."""
    while True:
        size = data[pos]  # IndexError past the end: truncated
        pos += 1 + size
        if size == 0:
            return pos
        if pos > len(data):
            raise _Truncated


def _probe_webp(data: bytes, max_frames: int, param: str) -> AnimationHeader:
    if not (data.startswith(b"RIFF") and data[8:12] == b"WEBP"):
        raise MediaError("data is not a WEBP image (or it is corrupt)", param)
    size = header_size(data)
    if size is None:
        raise MediaError("WEBP header declares no image size (corrupt data)", param)
    end = min(
        len(data), 8 + struct.unpack_from("<I", data, 4)[0]
    )  # libwebp ignores bytes past the RIFF size
    pos, durations = 12, []
    while pos + 8 <= end and len(durations) < max_frames:
        fourcc, chunk_bytes = data[pos : pos + 4], struct.unpack_from("<I", data, pos + 4)[0]
        if pos + 8 + chunk_bytes > end:
            raise _Truncated
        if fourcc == b"ANMF":
            durations.append(float(int.from_bytes(data[pos + 20 : pos + 23], "little")))
        pos += 8 + chunk_bytes + (chunk_bytes & 1)  # chunks are padded to even sizes
    return AnimationHeader(*size, tuple(durations) or (None,))
