"""Untrusted media payloads -> bytes: base64 and `data:` URLs, inline or fetched.

Shared by the image, audio and video decoders so that a bad payload reads the same way
whatever the modality. No torch, no decoding of pixels or samples here.
"""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass

import pybase64

from cluster.media.errors import MediaError
from cluster.media.fetch import FetchPolicy, fetch

_WHITESPACE = b" \t\n\r\f\v"  # what a MIME-wrapped payload may hold between its characters


@dataclass(frozen=True)
class UrlKind:
    """What one kind of media URL may carry, and how its errors name it."""

    noun: str  # "image", "video": used in every message
    mime_types: frozenset[str]  # accepted MIME types, lower case
    # the accepted types as a client should read them, e.g. "image/png, image/jpeg or image/webp"
    advice: str
    example: str  # e.g. "data:image/png;base64,..."


def data_url_bytes(
    url: str, *, kind: UrlKind, remote: FetchPolicy | None, param: str
) -> tuple[str, bytes]:
    """(MIME type, bytes) of a base64 `data:` URL of `kind`, or of an http(s) URL fetched
    under `remote` (None: fetching is off); other schemes are refused."""
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme in ("http", "https"):
        if remote is None:
            raise MediaError(
                "fetching remote media is disabled on this server; "
                f"send the {kind.noun} inline as a base64 data URL",
                param,
            )
        return _fetched(url, kind, remote, param)
    if scheme != "data":
        shown = f"'{scheme}' URLs" if scheme else "this URL"
        raise MediaError(
            f"unsupported {kind.noun} URL: {shown} cannot be used; "
            f"send a base64 data URL ({kind.example})",
            param,
        )
    header, sep, payload = url[5:].partition(",")
    if not sep:
        raise MediaError("malformed data URL: no ',' between header and data", param)
    fields = [f.strip().lower() for f in header.split(";")]
    mime = fields[0]
    if mime not in kind.mime_types:
        raise MediaError(
            f"unsupported {kind.noun} type '{mime or '(none)'}'; send {kind.advice}", param
        )
    if "base64" not in fields[1:]:
        raise MediaError(f"only base64 data URLs are supported ({kind.example})", param)
    return mime, decode_base64(payload, noun=kind.noun, where="data URL", param=param)


def _fetched(url: str, kind: UrlKind, remote: FetchPolicy, param: str) -> tuple[str, bytes]:
    mime, data = fetch(url, remote, noun=kind.noun, param=param)
    if mime not in kind.mime_types:
        raise MediaError(
            f"the {kind.noun} URL served type '{mime or '(none)'}'; {kind.advice} are accepted",
            param,
        )
    if not data:
        raise MediaError(f"the {kind.noun} URL served no data", param)
    return mime, data


def decode_base64(payload: str, *, noun: str, where: str, param: str) -> bytes:
    """Strict base64 -> non-empty bytes. `where` names the field in errors ("data URL", ...)."""
    try:
        data = _strict_base64(payload)
    except (UnicodeEncodeError, binascii.Error, ValueError) as exc:
        raise MediaError(f"invalid base64 in {where}: {exc}", param) from None
    if not data:
        raise MediaError(f"empty {noun} data in {where}", param)
    return data


def _strict_base64(payload: str) -> bytes:
    """pybase64's SIMD decoder first (0.03 ms for a 600 kB image's payload here, against 2.3 for
    the standard library's validated decode, most of it a regex). What it refuses goes the
    standard library's way, which decides and names the problem as before: line breaks inside
    the payload (MIME-style wrapping) are dropped; anything else is an error."""
    try:
        return pybase64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        # bytes.translate, not a regex: 1.5 against 20 ms for a 400 kB payload here
        raw = payload.encode("ascii").translate(None, _WHITESPACE)
        return base64.b64decode(raw, validate=True)
