"""Bad-input cases and media builders for the hardening probe (scripts/probe_server.py).

Every case is a raw request body (bytes), so it can be exactly the defect it names: a JSON
library or Pillow would refuse to write most of them. Media that must lie about itself
(a PNG header claiming 20000x20000 pixels, a GIF with a 4000x4000 canvas) is built by hand.
"""

from __future__ import annotations

import base64
import io
import json
import struct
import wave
import zlib
from dataclasses import dataclass

import numpy as np
from PIL import Image

from benchkit.media import photo

# The default limits.max_request_bytes; the oversize case goes just past it.
LIMIT_BYTES = 32 * 1024 * 1024


@dataclass(frozen=True)
class Case:
    name: str
    body: bytes
    content_type: str = "application/json"
    modality: str | None = None  # the media it is about: meaningful only if the model takes it


# ----------------------------------------------------------------------------- request bodies


def chat(model: str, content=None, **extra) -> dict:
    """A small, valid, greedy chat request; `extra` overrides or adds fields."""
    content = "Say hi." if content is None else content
    return {
        "model": model,
        "messages": [{"role": "user", "content": content}],
        "temperature": 0,
        "max_tokens": 4,
        **extra,
    }


def enc(obj) -> bytes:
    return json.dumps(obj).encode()


def media_chat(model: str, *parts: dict) -> bytes:
    return enc(chat(model, [*parts, {"type": "text", "text": "Describe it."}]))


def image_part(data: bytes, mime: str = "image/png") -> dict:
    return {"type": "image_url", "image_url": {"url": data_url(data, mime)}}


def video_part(data: bytes, mime: str = "image/gif") -> dict:
    return {"type": "video_url", "video_url": {"url": data_url(data, mime)}}


def audio_part(data: str, fmt: str = "wav") -> dict:
    return {"type": "input_audio", "input_audio": {"data": data, "format": fmt}}


def data_url(data: bytes, mime: str) -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


# ----------------------------------------------------------------------------- media


def png(width: int, height: int, seed: int = 0) -> bytes:
    """Noise, so that no two seeds share an encoder cache entry."""
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def photo_jpeg(megapixels: float, seed: int = 0) -> bytes:
    """A large photo-like JPEG: megabytes to send, tens of MB to decode."""
    return photo(megapixels, seed, "JPEG", quality=85)


def _png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def png_header_bomb(width: int = 20000, height: int = 20000) -> bytes:
    """A valid-looking PNG whose IHDR claims width x height RGB pixels; the IDAT is one row."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    idat = zlib.compress(b"\x00" + b"\x00" * 3 * 16)
    return (
        b"\x89PNG\r\n\x1a\n"
        + _png_chunk(b"IHDR", ihdr)
        + _png_chunk(b"IDAT", idat)
        + _png_chunk(b"IEND", b"")
    )


def gif(
    width: int, height: int, frames: int, delay_cs: int, canvas: tuple[int, int] | None = None
) -> bytes:
    """GIF89a by hand: `frames` frames of width x height on a `canvas` (default: the frame
    size). A 1x1 frame is the classic smallest LZW stream; larger frames repeat colour 0
    uncompressed-ish."""
    cw, ch = canvas or (width, height)
    out = bytearray(
        b"GIF89a" + struct.pack("<HHBBB", cw, ch, 0x80, 0, 0) + b"\x00\x00\x00\xff\xff\xff"
    )
    out += b"!\xff\x0bNETSCAPE2.0\x03\x01\x00\x00\x00"  # loop forever, as real animated GIFs do
    for _ in range(frames):
        out += b"!\xf9\x04\x00" + struct.pack("<H", delay_cs) + b"\x00\x00"  # its delay
        out += b"," + struct.pack("<HHHHB", 0, 0, width, height, 0)
        out += _lzw_zeros(width * height)
    return bytes(out + b";")


def _lzw_zeros(count: int) -> bytes:
    """LZW data for `count` pixels of colour 0, min code size 2, emitting a clear code every
    few pixels so the code width stays 3 bits (simple, valid, not compact)."""
    codes, bits, nbits = [4], 0, 0
    for i in range(count):
        codes.append(0)
        if i % 2 == 1:
            codes.append(4)
    codes.append(5)
    for n, code in enumerate(codes):
        bits |= code << nbits
        nbits += 3
    data = bits.to_bytes((nbits + 7) // 8, "little")
    blocks = b"".join(
        bytes([len(data[i : i + 255])]) + data[i : i + 255] for i in range(0, len(data), 255)
    )
    return b"\x02" + blocks + b"\x00"


def wav(seconds: float = 0.5, rate: int = 16000) -> bytes:
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(1), w.setsampwidth(2), w.setframerate(rate)
        w.writeframes((np.sin(np.arange(int(seconds * rate)) / 8) * 3000).astype("<i2").tobytes())
    return out.getvalue()


def valid_media_cases(model: str) -> dict[str, bytes]:
    """One well-formed request per modality: a 200 means the served model takes it."""
    return {
        "image": media_chat(model, image_part(png(32, 32, seed=1))),
        "video": media_chat(model, video_part(gif(16, 16, frames=2, delay_cs=25))),
        "audio": media_chat(model, audio_part(base64.b64encode(wav()).decode())),
    }


# ----------------------------------------------------------------------------- the cases


def _raw(model: str, tail: bytes) -> bytes:
    """A request whose last field is written by hand (JSON a serializer would not emit)."""
    head = json.dumps({"model": model, "messages": [{"role": "user", "content": "hi"}]})[
        :-1
    ].encode()
    return head + b", " + tail + b"}"


def parsing_cases(model: str) -> list[Case]:
    ok = chat(model)
    msgs = json.dumps(ok["messages"]).encode()
    return [
        Case("malformed_json", b'{"model": "' + model.encode() + b'", "messages": ['),
        Case("not_json", b"hello there"),
        Case("empty_body", b""),
        Case("json_array", b"[]"),
        Case("json_null", b"null"),
        Case(
            "nested_100k_lists",
            b'{"model": "m", "messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
        ),
        Case(
            "nested_100k_objects",
            b'{"model": "m", "x": ' + b'{"a":' * 100_000 + b"1" + b"}" * 100_000 + b"}",
        ),
        Case("max_tokens_5000_digits", _raw(model, b'"max_tokens": ' + b"7" * 5000)),
        Case(
            "lone_surrogate",
            b'{"model": "'
            + model.encode()
            + b'", "messages": [{"role": "user", "content": "\\ud800"}]}',
        ),
        Case(
            "invalid_utf8",
            b'{"model": "'
            + model.encode()
            + b'", "messages": [{"role": "user", "content": "\xff\xfe"}]}',
        ),
        Case("utf16_body", json.dumps(ok).encode("utf-16")),
        Case("temperature_NaN", _raw(model, b'"temperature": NaN')),
        Case("temperature_Infinity", _raw(model, b'"temperature": Infinity')),
        Case(
            "duplicate_keys",
            b'{"model": "x", "model": "' + model.encode() + b'", "messages": ' + msgs + b"}",
        ),
    ]


def sampling_cases(model: str) -> list[Case]:
    fields = [
        ("temperature_1e-38", {"temperature": 1e-38}),
        ("temperature_1e-45", {"temperature": 1e-45}),
        ("temperature_-1", {"temperature": -1}),
        ("temperature_3", {"temperature": 3}),
        ("top_p_0", {"top_p": 0}),
        ("top_p_1e-45", {"top_p": 1e-45, "temperature": 1}),
        ("top_k_1e12", {"top_k": 10**12, "temperature": 1}),
        ("seed_2^70", {"seed": 2**70, "temperature": 1}),
        ("max_tokens_0", {"max_tokens": 0}),
        ("max_tokens_1e12", {"max_tokens": 10**12}),
        ("stream_'yes'", {"stream": "yes"}),
        ("max_tokens_'16'", {"max_tokens": "16"}),
        ("temperature_'hot'", {"temperature": "hot"}),
        ("n_2", {"n": 2}),
        ("stop_5_items", {"stop": ["a", "b", "c", "d", "e"]}),
        ("stop_empty_string", {"stop": [""]}),
        ("stop_not_string", {"stop": [1]}),
        ("stop_100k_chars", {"stop": "x" * 100_000}),
    ]
    return [Case(name, enc(chat(model, **extra))) for name, extra in fields]


def message_cases(model: str) -> list[Case]:
    ok = chat(model)
    return [
        Case("unknown_model", enc(chat("no-such-model"))),
        Case("missing_model", enc({"messages": ok["messages"]})),
        Case("empty_messages", enc({**ok, "messages": []})),
        Case("missing_messages", enc({"model": model})),
        Case("messages_not_list", enc({**ok, "messages": "hi"})),
        Case("bad_role", enc({**ok, "messages": [{"role": "robot", "content": "hi"}]})),
        Case("missing_role", enc({**ok, "messages": [{"content": "hi"}]})),
        Case("empty_content", enc(chat(model, ""))),
        Case("content_number", enc(chat(model, 42))),
        Case("unknown_part_type", enc(chat(model, [{"type": "image", "image": "x"}]))),
        Case("part_without_payload", enc(chat(model, [{"type": "image_url"}]))),
        Case("prompt_over_max_len", enc(chat(model, "word " * 20_000))),
    ]


def media_cases(model: str) -> list[Case]:
    small = png(8, 8)
    audio = base64.b64encode(wav()).decode()
    assistant_image = {
        **chat(model),
        "messages": [
            {"role": "assistant", "content": [image_part(small)]},
            {"role": "user", "content": "hi"},
        ],
    }
    url = lambda u: {"type": "image_url", "image_url": {"url": u}}  # noqa: E731
    return [
        Case(
            "image_not_an_image",
            media_chat(model, image_part(b"hello, not a png")),
            modality="image",
        ),
        Case(
            "image_bad_base64",
            media_chat(model, url("data:image/png;base64,!!!not base64!!!")),
            modality="image",
        ),
        Case(
            "image_text_mime", media_chat(model, image_part(small, "text/plain")), modality="image"
        ),
        Case(
            "image_truncated_png",
            media_chat(model, image_part(png(64, 64)[:200])),
            modality="image",
        ),
        Case(
            "image_20000x20000_header",
            media_chat(model, image_part(png_header_bomb())),
            modality="image",
        ),
        Case("image_file_url", media_chat(model, url("file:///etc/passwd")), modality="image"),
        Case(
            "image_metadata_url",
            media_chat(model, url("http://169.254.169.254/latest/meta-data/")),
            modality="image",
        ),
        Case(
            "image_too_many",
            media_chat(model, *[image_part(png(8, 8, seed=s)) for s in range(9)]),
            modality="image",
        ),
        Case("image_in_assistant_msg", enc(assistant_image), modality="image"),
        Case(
            "video_1x1_gif",
            media_chat(model, video_part(gif(1, 1, frames=1, delay_cs=10))),
            modality="video",
        ),
        Case(
            "video_gif_4000x4000_canvas_20s",
            media_chat(model, video_part(gif(1, 1, frames=2, delay_cs=1000, canvas=(4000, 4000)))),
            modality="video",
        ),
        Case(
            "audio_not_base64",
            media_chat(model, audio_part("%%% not base64 %%%")),
            modality="audio",
        ),
        Case("audio_wrong_format", media_chat(model, audio_part(audio, "aiff")), modality="audio"),
        Case(
            "audio_png_as_wav",
            media_chat(model, audio_part(base64.b64encode(small).decode())),
            modality="audio",
        ),
        Case("audio_empty", media_chat(model, audio_part("")), modality="audio"),
    ]


def size_cases(model: str) -> list[Case]:
    # Just over the limit: the filler is one text part, so only the size is wrong.
    filler = "a" * (LIMIT_BYTES + 1024)
    return [Case("body_over_limit", enc(chat(model, filler)))]


def all_cases(model: str) -> list[Case]:
    return (
        parsing_cases(model)
        + sampling_cases(model)
        + message_cases(model)
        + media_cases(model)
        + size_cases(model)
    )
