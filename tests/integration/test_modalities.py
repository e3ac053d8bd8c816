"""Audio and video through HTTP on a real local Ray cluster, for the audio family (Qwen2-Audio)
and the all-modality family (Qwen2.5-Omni in the published layout: thinker + talker +
token2wav in one repo, the thinker served and the talker never loaded; encoders split into a
vision and an audio pool): greedy output equals the model's own `generate`, with many mixed
requests in flight;
bad audio/video gets a 4xx naming the problem while other requests finish; a long video's
encoding does not hold up text-only requests."""

from __future__ import annotations

import asyncio
import base64
import io

import httpx
import numpy as np
import pytest
import soundfile
from PIL import Image

from cluster.config import REPO_ROOT, load_config
from cluster.prepare import ensure_model
from tests.integration.conftest import TEST_PORT, TRACE_PATH, deploy, png_data_url, random_image
from tests.integration.reference import reference_generate

MAX_TOKENS = 12
RATE_HZ = 16000


def app_config(name: str, **sections):
    config = load_config(REPO_ROOT / "configs" / f"{name}_cpu.yaml")
    ensure_model(config)
    return config.replace(server={"port": TEST_PORT, "trace_path": str(TRACE_PATH)}, **sections)


def wav(seconds: float, hz: float, seed: int = 0, rate: int = RATE_HZ, fmt: str = "WAV") -> str:
    t = np.arange(int(seconds * rate)) / rate
    noise = np.random.default_rng(seed).standard_normal(t.size)
    samples = (0.5 * np.sin(2 * np.pi * hz * t) + 0.05 * noise).astype(np.float32)
    buf = io.BytesIO()
    soundfile.write(buf, samples, rate, format=fmt, subtype="FLOAT" if fmt == "WAV" else None)
    return base64.b64encode(buf.getvalue()).decode()


def audio(seconds: float, hz: float, seed: int = 0) -> dict:
    return {"type": "input_audio", "input_audio": {"data": wav(seconds, hz, seed), "format": "wav"}}


def gif_url(num_frames: int, width: int, height: int, seed: int, frame_ms: int = 500) -> str:
    rng = np.random.default_rng(seed)
    frames = [
        Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))
        for _ in range(num_frames)
    ]
    buf = io.BytesIO()
    frames[0].save(
        buf, format="GIF", save_all=True, append_images=frames[1:], duration=frame_ms, loop=0
    )
    return "data:image/gif;base64," + base64.b64encode(buf.getvalue()).decode()


def video(num_frames: int, width: int, height: int, seed: int) -> dict:
    return {"type": "video_url", "video_url": {"url": gif_url(num_frames, width, height, seed)}}


def image(seed: int, width: int, height: int) -> dict:
    return {
        "type": "image_url",
        "image_url": {"url": png_data_url(random_image(seed, width, height))},
    }


def text(t: str) -> dict:
    return {"type": "text", "text": t}


def user(*parts) -> list[dict]:
    return [{"role": "user", "content": list(parts)}]


OMNI_REQUESTS = [
    user(audio(1.5, 440, 1), text("What do you hear?")),  # audio only
    user(text("Watch:"), video(4, 40, 56, 2)),  # video only
    user(
        text("See"), image(3, 50, 40), text("and hear"), audio(2.0, 880, 3), text("now.")
    ),  # interleaved
    user(video(4, 30, 30, 4), text("versus"), video(6, 56, 40, 5)),  # two videos
    user(text("Long clip:"), audio(9.0, 330, 6)),  # longer than one window
    [{"role": "user", "content": "Just text, no media at all."}],
]
AUDIO_REQUESTS = [
    user(audio(2.5, 440, 11), text("What is this?")),
    user(text("First"), audio(1.0, 300, 12), text("second"), audio(3.0, 600, 13)),
    user(audio(10.5, 500, 14), text("Summarise.")),
    [{"role": "user", "content": "Only words here."}],
]


async def send_all(app, requests: list[list[dict]], copies: int) -> list[httpx.Response]:
    async with httpx.AsyncClient(base_url=app.root, timeout=300) as client:
        body = lambda msgs: {
            "model": app.config.model.served_name,
            "messages": msgs,
            "temperature": 0,
            "max_tokens": MAX_TOKENS,
        }
        return await asyncio.gather(
            *[client.post("/v1/chat/completions", json=body(m)) for m in requests * copies]
        )


def check_token_exact(app, requests: list[list[dict]], copies: int = 3) -> None:
    checkpoint = str(app.config.model.checkpoint_path)
    want = [reference_generate(checkpoint, m, MAX_TOKENS) for m in requests]
    assert len({text for _, text, _ in want}) == len(want), (
        "the cases should give different answers"
    )
    for i, response in enumerate(asyncio.run(send_all(app, requests, copies))):
        assert response.status_code == 200, response.text
        ids, text_, finish = want[i % len(requests)]
        body = response.json()
        assert body["choices"][0]["message"]["content"] == text_, f"request {i % len(requests)}"
        assert body["usage"]["completion_tokens"] == len(ids)
        assert body["choices"][0]["finish_reason"] == finish


# Media URLs on the local test server may be fetched; 127.0.0.2 is an allowed name whose address
# is not.
FETCH_LIMITS = {
    "remote_media": {
        "allowed_hosts": ["127.0.0.1", "127.0.0.2"],
        "allowed_networks": ["127.0.0.1/32"],
        "max_bytes": 1 << 20,
        "timeout_s": 2.0,
        "max_redirects": 2,
    }
}


@pytest.fixture
def omni(ray_session):
    """The omni app (redeployed only if another app was deployed since: tests keep omni first)."""
    return deploy(app_config("qwen2_5_omni", limits=FETCH_LIMITS))


def test_omni_equals_generate_with_mixed_requests_in_flight(omni):
    check_token_exact(omni, OMNI_REQUESTS)
    workers = omni.http.get("/health", params={"verbose": 1}).json()["workers"]["encoder"]
    assert len(workers) == 2 and all(w["num_batches"] > 0 for w in workers), (
        workers
    )  # vision and audio pools both worked
    assert max(w["max_batch"] for w in workers) > 1, workers


def _audio_bytes(data: bytes, fmt: str = "wav") -> dict:
    return {
        "type": "input_audio",
        "input_audio": {"data": base64.b64encode(data).decode(), "format": fmt},
    }


def _pcm_wav(seconds: float, rate: int = 8000) -> bytes:
    buf = io.BytesIO()
    soundfile.write(
        buf, np.zeros(int(seconds * rate), np.int16), rate, format="WAV", subtype="PCM_16"
    )
    return buf.getvalue()


# A 4000x4000 canvas with two 1x1 frames of 10 s each: 66 bytes that would decode to 1.5 GB.
_GIF_BOMB = (
    b"GIF89a\xa0\x0f\xa0\x0f\x80\x00\x00"
    + b"\x00\x00\x00\xff\xff\xff"
    + (
        b"\x21\xf9\x04\x00\xe8\x03\x00\x00"
        b"\x2c\x00\x00\x00\x00\x01\x00\x01\x00\x00\x02\x02\x44\x01\x00"
    )
    * 2
    + b"\x3b"
)

# (name, content parts, words the message must contain, param prefix)
BAD_MEDIA = [
    (
        "audio that does not decode",
        [_audio_bytes(b"RIFF....WAVEfmt nonsense" * 10)],
        "decode",
        "messages[0].content[0]",
    ),
    (
        "unsupported audio format",
        [_audio_bytes(_pcm_wav(1.0), "aac")],
        "aac",
        "messages[0].content[0]",
    ),
    ("zero-length audio", [_audio_bytes(_pcm_wav(0.0))], "no samples", "messages[0].content[0]"),
    (
        "audio over the duration limit",
        [_audio_bytes(_pcm_wav(601.0))],
        "600",
        "messages[0].content[0]",
    ),
    (
        "video that does not decode",
        [
            {
                "type": "video_url",
                "video_url": {
                    "url": "data:video/mp4;base64,"
                    + base64.b64encode(b"\x00\x00\x00\x18ftypmp42" + b"junk" * 50).decode()
                },
            }
        ],
        "video",
        "messages[0].content[0]",
    ),
    (
        "video over the duration limit",
        [{"type": "video_url", "video_url": {"url": gif_url(11, 8, 8, 0, frame_ms=60_000)}}],
        "600",
        "messages[0].content[0]",
    ),
    (
        "gif of zero size",
        [
            {
                "type": "video_url",
                "video_url": {
                    "url": "data:image/gif;base64,"
                    + base64.b64encode(b"GIF89a" + b"\x00" * 20).decode()
                },
            }
        ],
        "zero size",
        "messages[0].content[0]",
    ),
    (
        "gif declaring a vast canvas",
        [
            {
                "type": "video_url",
                "video_url": {
                    "url": "data:image/gif;base64," + base64.b64encode(_GIF_BOMB).decode()
                },
            }
        ],
        "max_video_pixels",
        "messages[0].content[0]",
    ),
]


async def _bad_and_good(app) -> tuple[list[httpx.Response], list[httpx.Response]]:
    model = app.config.model.served_name
    good = lambda i: {
        "model": model,
        "messages": OMNI_REQUESTS[i % len(OMNI_REQUESTS)],
        "temperature": 0,
        "max_tokens": 8,
    }
    async with httpx.AsyncClient(base_url=app.root, timeout=300) as client:
        calls = [client.post("/v1/chat/completions", json=good(i)) for i in range(4)]
        calls += [
            client.post("/v1/chat/completions", json={"model": model, "messages": user(*parts)})
            for _, parts, _, _ in BAD_MEDIA
        ]
        calls += [client.post("/v1/chat/completions", json=good(i)) for i in range(4)]
        results = await asyncio.gather(*calls)
    return results[4:-4], results[:4] + results[-4:]


def test_bad_audio_and_video_are_named_and_harm_nothing_else(omni):
    bad, good = asyncio.run(_bad_and_good(omni))
    for (name, _, words, param), response in zip(BAD_MEDIA, bad):
        assert response.status_code == 400, (name, response.text)
        error = response.json()["error"]
        assert words.lower() in error["message"].lower(), (name, error)
        assert (error["param"] or "").startswith(param), (name, error)
    assert all(r.status_code == 200 for r in good), [r.text for r in good]
    texts = [r.json()["choices"][0]["message"]["content"] for r in good]
    assert texts[:4] == texts[4:]


def test_one_pixel_video_is_encoded_as_planned(omni):
    """A 1x1 GIF once ended in a 500: the encoder misread its frames' layout (140 embeddings,
    144 planned)."""
    response = omni.chat(user(video(2, 1, 1, 7), text("What is it?")), temperature=0, max_tokens=4)
    assert response.status_code == 200, response.text


def test_omni_fetches_image_audio_and_video_urls_and_refuses_bad_ones(omni):
    """Media by http URL answers exactly as the same bytes sent inline; a private address, an
    oversize or slow body and a redirect to a private address are 400s naming the part, and
    a request in flight beside them finishes."""
    from tests.media_server import FILES, MediaServer

    def inline(path: str) -> str:
        mime, data = FILES[path]
        return f"data:{mime};base64," + base64.b64encode(data).decode()

    def parts(url) -> list[dict]:
        return user(
            text("Look"),
            {"type": "image_url", "image_url": {"url": url("/cat.png")}},
            {"type": "audio_url", "audio_url": {"url": url("/tone.wav")}},
            {"type": "video_url", "video_url": {"url": url("/clip.gif")}},
            text("now."),
        )

    with MediaServer() as server:
        by_url = omni.chat(parts(server.url), temperature=0, max_tokens=MAX_TOKENS)
        by_value = omni.chat(parts(inline), temperature=0, max_tokens=MAX_TOKENS)
        assert by_url.status_code == 200, by_url.text
        assert by_url.json()["choices"][0]["message"] == by_value.json()["choices"][0]["message"]
        bad = {
            "/cat.png?x": (server.url("/cat.png", host="127.0.0.2"), "private or reserved address"),
            "/private": (server.url("/private"), "private or reserved address"),
            "/big": (server.url("/big"), "the limit is 1048576"),
            "/slow": (server.url("/slow"), "took longer than 2 s"),
        }
        bystander = asyncio.run(
            _chat_beside(
                omni,
                [user(text("Fine"), image(9, 20, 20))]
                + [
                    user({"type": "image_url", "image_url": {"url": url}})
                    for url, _ in bad.values()
                ],
            )
        )
        assert bystander[0].status_code == 200, bystander[0].text
        for response, (name, (_, fragment)) in zip(bystander[1:], bad.items()):
            assert response.status_code == 400, (name, response.text)
            error = response.json()["error"]
            assert (
                fragment in error["message"]
                and error["param"] == "messages[0].content[0].image_url"
            ), (name, error)


def _greedy(app, messages: list[dict], max_tokens: int) -> dict:
    return {
        "model": app.config.model.served_name,
        "messages": messages,
        "temperature": 0,
        "max_tokens": max_tokens,
    }


async def _chat_beside(app, requests: list[list[dict]]) -> list[httpx.Response]:
    async with httpx.AsyncClient(base_url=app.root, timeout=60) as client:
        return await asyncio.gather(
            *[client.post("/v1/chat/completions", json=_greedy(app, m, 4)) for m in requests]
        )


def test_long_video_encoding_does_not_hold_up_text(ray_session):
    """The vision encoder is slowed 15x: while a video encodes (2-6 s, several times the text
    requests' whole run), text-only requests (and the audio pool) go on; every text answer is
    complete before the video's first token."""
    config = app_config("qwen2_5_omni")
    pools = [
        dict(pool, slowdown=[15.0]) if "video" in pool["modalities"] else pool
        for pool in config.model_dump(mode="json")["encoder"]
    ]
    app = deploy(config.replace(encoder=pools))

    async def run():
        async with httpx.AsyncClient(base_url=app.root, timeout=300) as client:
            body = lambda msgs: _greedy(app, msgs, 8)  # noqa: E731
            slow = asyncio.create_task(
                client.post(
                    "/v1/chat/completions",
                    json=body(user(video(8, 160, 120, 9), text("What happens?"))),
                )
            )
            await asyncio.sleep(0.3)
            fast = [
                await client.post("/v1/chat/completions", json=body(m))
                for m in ([{"role": "user", "content": f"Question {i}?"}] for i in range(3))
            ]
            fast.append(
                await client.post("/v1/chat/completions", json=body(user(audio(1.0, 500, 9))))
            )
            done_before_video = not slow.done()
            return fast, await slow, done_before_video

    fast, slow, done_before_video = asyncio.run(run())
    assert all(r.status_code == 200 for r in fast) and slow.status_code == 200
    assert done_before_video, "text and audio requests waited for the video"
    slowest_fast = max(r.json()["timings"]["ttft_ms"] for r in fast)
    assert slowest_fast < slow.json()["timings"]["encode_ms"], (
        slowest_fast,
        slow.json()["timings"],
    )


def test_qwen2_audio_equals_generate(ray_session):
    check_token_exact(deploy(app_config("audio")), AUDIO_REQUESTS)


def test_image_sent_to_an_audio_model_is_refused(ray_session):
    app = deploy(app_config("audio"))
    response = app.chat(user(image(1, 20, 20), text("hi")))
    assert response.status_code == 400
    assert "does not take image input" in response.json()["error"]["message"]
