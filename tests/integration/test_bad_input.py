"""Bad input gets a 4xx in OpenAI's error shape naming the problem, and harms nothing
else: good requests sent at the same time finish correctly and no memory is held."""

from __future__ import annotations

import asyncio
import base64
import io
import struct
import zlib

import httpx
import pytest
from PIL import Image

from tests.integration.conftest import png_data_url, random_image


def _image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def _huge_png_header(width: int, height: int) -> str:
    """A tiny PNG whose header declares a vast image (a decompression bomb's shape)."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    chunk = lambda kind, data: (
        struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    )
    raw = (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", ihdr)
        + chunk(b"IDAT", zlib.compress(b"\x00" * 64))
        + chunk(b"IEND", b"")
    )
    return "data:image/png;base64," + base64.b64encode(raw).decode()


def _truncated_png() -> str:
    buf = io.BytesIO()
    random_image(3, 64, 64).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()[:300]).decode()


def _user(*parts) -> list[dict]:
    return [{"role": "user", "content": list(parts)}]


TEXT = {"type": "text", "text": "hi"}
OK_IMAGE = _image_part(png_data_url(random_image(1, 32, 32)))

# (name, body overrides or raw bytes, expected status, words the message must contain,
#  expected param prefix)
CASES = [
    ("malformed json", b'{"model": "tiny-llava", "messages": [', 400, "JSON", None),
    ("unknown model", {"model": "gpt-17"}, 404, "gpt-17", "model"),
    ("no content", {"messages": [{"role": "user"}]}, 400, "content", "messages[0]"),
    (
        "empty content",
        {"messages": [{"role": "user", "content": []}]},
        400,
        "content",
        "messages[0]",
    ),
    (
        "not an image",
        {
            "messages": _user(
                TEXT,
                _image_part("data:image/png;base64," + base64.b64encode(b"hello world").decode()),
            )
        },
        400,
        "image",
        "messages[0].content[1]",
    ),
    (
        "truncated image",
        {"messages": _user(_image_part(_truncated_png()))},
        400,
        "truncated",
        "messages[0].content[0]",
    ),
    (
        "decompression bomb",
        {"messages": _user(_image_part(_huge_png_header(100_000, 100_000)))},
        400,
        "pixels",
        "messages[0].content[0]",
    ),
    (
        "over pixel limit",
        {"messages": _user(_image_part(png_data_url(Image.new("RGB", (4100, 4000)))))},
        400,
        "limit",
        "messages[0].content[0]",
    ),
    ("too many images", {"messages": _user(*[OK_IMAGE] * 5)}, 400, "limit is 4", "messages"),
    (
        "remote url",
        {"messages": _user(_image_part("https://example.com/cat.png"))},
        400,
        "remote",
        "messages[0].content[0]",
    ),
    (
        "audio to vision model",
        {
            "messages": _user(
                {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}
            )
        },
        400,
        "audio",
        "messages[0].content[0]",
    ),
    (
        "video to vision model",
        {
            "messages": _user(
                {"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}}
            )
        },
        400,
        "video",
        "messages[0].content[0]",
    ),
    ("temperature", {"temperature": 7}, 400, "temperature", "temperature"),
    ("top_p", {"top_p": 0}, 400, "top_p", "top_p"),
    ("max_tokens", {"max_tokens": 0}, 400, "max_tokens", "max_tokens"),
    ("n", {"n": 17}, 400, "n", "n"),
    # Each of these was once answered with a 200: a 400 naming the field now.
    (
        "duplicate key",
        b'{"model": "tiny-llava", "messages": [{"role": "user", "content": "hi"}], '
        b'"top_p": 0.5, "top_p": 1}',
        400,
        "more than once",
        "top_p",
    ),
    ("top_p 1e-45", {"top_p": 1e-45}, 400, "1e-05", "top_p"),
    ("top_k 1e12", {"top_k": 10**12}, 400, "vocabulary", "top_k"),
    ("max_tokens 1e12", {"max_tokens": 10**12}, 400, "context", "max_tokens"),
    ("100k-character stop", {"stop": "x" * 100_000}, 400, "256 characters", "stop[0]"),
    (
        "bad schema",
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "a", "schema": {"type": "x"}},
            }
        },
        400,
        "invalid JSON schema",
        "response_format",
    ),
    (
        "reserved token in text",
        {"messages": _user({"type": "text", "text": "look <image> here"})},
        400,
        "<image>",
        "messages",
    ),
    # Each of these was a plain-text 500 before: now a 400 in OpenAI's shape, naming the problem.
    (
        "json nested 100,000 deep",
        b'{"model": "tiny-llava", "messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
        400,
        "nested too deeply",
        None,
    ),
    (
        "max_tokens of 5,000 digits",
        b'{"model": "tiny-llava", "messages": [{"role": "user", "content": "hi"}], "max_tokens": '
        + b"9" * 5000
        + b"}",
        400,
        "5000 digits",
        "max_tokens",
    ),
    (
        "lone surrogate",
        b'{"model": "tiny-llava", "messages": [{"role": "user", "content": "a\\ud800b"}]}',
        400,
        "surrogate",
        "messages[0].content",
    ),
    ("temperature 1e-45", {"temperature": 1e-45, "seed": 1}, 400, "at least 0.01", "temperature"),
    ("temperature 1e-38", {"temperature": 1e-38, "seed": 1}, 400, "at least 0.01", "temperature"),
    (
        "NaN",
        b'{"model": "tiny-llava", "messages": [{"role": "user", "content": "hi"}], '
        b'"temperature": NaN}',
        400,
        "not a JSON number",
        "temperature",
    ),
    ("stream as a string", {"stream": "yes"}, 400, "boolean", "stream"),
    ("max_tokens as a string", {"max_tokens": "16"}, 400, "integer", "max_tokens"),
    (
        "utf-16 body",
        '{"model": "tiny-llava", "messages": [{"role": "user", "content": "hi"}]}'.encode("utf-16"),
        400,
        "not UTF-8",
        None,
    ),
]


async def _post(client: httpx.AsyncClient, model: str, case):
    _, body, *_ = case
    if isinstance(body, bytes):
        return await client.post(
            "/v1/chat/completions", content=body, headers={"content-type": "application/json"}
        )
    full = {"model": model, "messages": _user(TEXT, OK_IMAGE), "max_tokens": 8, **body}
    return await client.post("/v1/chat/completions", json=full)


async def _good(client: httpx.AsyncClient, model: str, seed: int):
    body = {
        "model": model,
        "messages": _user(TEXT, _image_part(png_data_url(random_image(seed, 40, 40)))),
        "temperature": 0,
        "max_tokens": 16,
    }
    return await client.post("/v1/chat/completions", json=body)


async def _storm(app):
    async with httpx.AsyncClient(base_url=app.root, timeout=120) as client:
        model = app.config.model.served_name
        good_before = [_good(client, model, s) for s in range(6)]
        bad = [_post(client, model, case) for case in CASES]
        good_after = [_good(client, model, s) for s in range(6)]
        results = await asyncio.gather(*good_before, *bad, *good_after)
    return results[:6] + results[-6:], results[6:-6]


def test_bad_input_is_rejected_and_harms_nothing_else(app):
    good, bad = asyncio.run(_storm(app))
    for case, response in zip(CASES, bad):
        name, _, status, words, param = case
        assert response.status_code == status, (name, response.text)
        error = response.json()["error"]
        assert words.lower() in error["message"].lower(), (name, error)
        assert error["type"] and "message" in error
        if param is not None:
            assert (error["param"] or "").startswith(param), (name, error)
    texts = [r.json()["choices"][0]["message"]["content"] for r in good]
    assert all(r.status_code == 200 for r in good)
    assert texts[:6] == texts[6:]  # same seeds, same answers, bad neighbours or not
    workers = app.http.get("/health", params={"verbose": 1}).json()["workers"]
    assert all(w["held_kv"] == 0 and w["held_embeddings"] == 0 for w in workers["prefill"]), workers
    assert all(w["rows"] == 0 and w["held_kv"] == 0 for w in workers["decode"]), workers


def test_oversized_body_is_413(app):
    limit = app.config.limits.max_request_bytes
    r = app.http.post(
        "/v1/chat/completions",
        content=b"x" * (limit + 1),
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 413 and "limit" in r.json()["error"]["message"]


@pytest.mark.parametrize(
    "sampling",
    [{"temperature": 0.8, "top_p": 0.9, "seed": 7}, {"temperature": 1.2, "top_k": 5, "seed": 11}],
)
def test_seeded_sampling_is_reproducible(app, sampling):
    body = {"messages": _user(TEXT, OK_IMAGE), "max_tokens": 12, **sampling}
    first, second = (app.chat(**body).json() for _ in range(2))
    assert first["choices"][0]["message"]["content"] == second["choices"][0]["message"]["content"]


def test_stop_string_ends_the_answer(app):
    greedy = app.chat(_user(TEXT, OK_IMAGE), temperature=0, max_tokens=16).json()["choices"][0][
        "message"
    ]["content"]
    stop = greedy[len(greedy) // 2 : len(greedy) // 2 + 2]
    r = app.chat(_user(TEXT, OK_IMAGE), temperature=0, max_tokens=16, stop=[stop]).json()
    assert r["choices"][0]["message"]["content"] == greedy[: greedy.find(stop)]
    assert r["choices"][0]["finish_reason"] == "stop"
