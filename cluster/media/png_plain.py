"""Plain PNGs decoded by libspng: the same pixels as Pillow's, in about half its time.

Pillow unfilters a PNG's rows a byte at a time: a 343x325 screenshot-like PNG (every row
Paeth-filtered) took it 1.3-2.1 ms here, of which 0.46 inflating; libspng's SIMD took 0.7-0.9.
libspng comes inside pyspng's extension, whose own `load` skips every checksum (a corrupt
stream decodes to garbage that Pillow would refuse), so it is called here through ctypes with
the checksums on: CRCs of all chunks and the zlib stream's Adler-32, as strict as Pillow.

Only what both decode alike goes this way: 8-bit grey or truecolour PNGs and palette ones
without a tRNS chunk (transparency is composited onto white, in Pillow: cluster/media/image.py),
not interlaced, not animated. Anything else, and anything libspng refuses, is Pillow's, whose
checks and messages stand. (An RGBA screenshot gained 3-5% this way, opaque or not: left to
Pillow.) No torch here.
"""

from __future__ import annotations

import ctypes
import struct

import numpy as np

_SIGNATURE = b"\x89PNG\r\n\x1a\n"
_PALETTE = 3
_PLAIN_COLOUR_TYPES = (0, 2, _PALETTE)  # grey, truecolour, palette
_NOT_PLAIN = frozenset({b"tRNS", b"acTL"})  # transparency, animation: Pillow's
_FMT_RGB8 = 4  # libspng's enum spng_format
_CRC_ERROR = 0  # enum spng_crc_action: a bad checksum fails the decode
_CHUNK_LIMIT_BYTES = 64 << 20


def plain_png_size(data: bytes) -> tuple[int, int] | None:
    """(width, height) of a PNG that libspng decodes as Pillow does (above); None otherwise."""
    if not data.startswith(_SIGNATURE) or len(data) < 33 or data[12:16] != b"IHDR":
        return None
    width, height, depth, colour, _, _, interlace = struct.unpack_from(">IIBBBBB", data, 16)
    if colour not in _PLAIN_COLOUR_TYPES or interlace or depth != 8 and colour != _PALETTE:
        return None  # (a palette's indices may be 1-8 bits: its colours are 8-bit all the same)
    at = 33
    while at + 8 <= len(data):  # the chunks before the pixels: none that makes it not plain
        length, kind = struct.unpack_from(">I4s", data, at)
        if kind == b"IDAT":
            return width, height
        if kind in _NOT_PLAIN:
            return None
        at += 12 + length
    return None


def decode_plain_png(data: bytes, width: int, height: int) -> np.ndarray | None:
    """HxWx3 uint8 RGB of a PNG `plain_png_size` passed; None where libspng refuses it
    (Pillow's to decode, or to refuse)."""
    lib = _libspng()
    if lib is None:
        return None
    out = np.empty((height, width, 3), np.uint8)
    context = lib.spng_ctx_new(0)
    try:
        ok = (
            lib.spng_set_crc_action(context, _CRC_ERROR, _CRC_ERROR) == 0
            and lib.spng_set_chunk_limits(context, _CHUNK_LIMIT_BYTES, _CHUNK_LIMIT_BYTES) == 0
            and lib.spng_set_png_buffer(context, data, len(data)) == 0
            and lib.spng_decode_image(context, out.ctypes.data, out.nbytes, _FMT_RGB8, 0) == 0
        )
    finally:
        lib.spng_ctx_free(context)
    return out if ok else None


_LIB: ctypes.CDLL | None | bool = False  # False: not looked for yet


def _libspng() -> ctypes.CDLL | None:
    """libspng's C API, from pyspng's extension (which exports it); None without it."""
    global _LIB
    if _LIB is False:
        _LIB = _load()
    return _LIB


def _load() -> ctypes.CDLL | None:
    try:
        from pyspng import _pyspng_c

        lib = ctypes.CDLL(_pyspng_c.__file__)
        size, handle = ctypes.c_size_t, ctypes.c_void_p
        lib.spng_ctx_new.restype = handle
        lib.spng_ctx_new.argtypes = [ctypes.c_int]
        lib.spng_ctx_free.argtypes = [handle]
        lib.spng_set_crc_action.argtypes = [handle, ctypes.c_int, ctypes.c_int]
        lib.spng_set_chunk_limits.argtypes = [handle, size, size]
        lib.spng_set_png_buffer.argtypes = [handle, ctypes.c_char_p, size]
        lib.spng_decode_image.argtypes = [handle, handle, size, ctypes.c_int, ctypes.c_int]
        return lib
    except (ImportError, OSError, AttributeError):  # no pyspng, or one that hides libspng
        return None
