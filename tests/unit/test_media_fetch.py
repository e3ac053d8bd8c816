"""Fetching http(s) media under the allow-list, against a real local HTTP server."""

from __future__ import annotations

import time

import pytest

from cluster.media.audio import decode_audio_url
from cluster.media.errors import MediaError
from cluster.media.fetch import FetchPolicy, fetch
from cluster.media.image import decode_image_url
from cluster.media.video import VideoSampling, decode_video_url
from tests.media_server import FILES, MediaServer

LOCAL = FetchPolicy.of(["*"], ["127.0.0.1/32"], max_bytes=1 << 20, timeout_s=1.0, max_redirects=2)


@pytest.fixture(scope="module")
def server():
    with MediaServer() as s:
        yield s


def refused(url: str, fragment: str, policy: FetchPolicy = LOCAL) -> None:
    with pytest.raises(MediaError, match=fragment) as info:
        fetch(url, policy, noun="image", param="messages[0].content[0].image_url")
    assert info.value.param == "messages[0].content[0].image_url"


def test_allowed_host_serves_image_audio_and_video(server):
    assert fetch(server.url("/cat.png"), LOCAL, noun="image", param="p") == FILES["/cat.png"]
    image = decode_image_url(server.url("/cat.png"), max_pixels=10**6, remote=LOCAL, param="p")
    assert image.shape == (40, 40, 3)
    audio = decode_audio_url(
        server.url("/tone.wav"), remote=LOCAL, sample_rate_hz=16000, max_duration_s=10, param="p"
    )
    assert audio.shape == (8000,)
    video = decode_video_url(
        server.url("/clip.gif"),
        sampling=VideoSampling(),
        max_pixels=10**6,
        max_duration_s=10,
        max_frames=8,
        remote=LOCAL,
        param="p",
    )
    assert video.frames.shape[1:] == (32, 32, 3)


def test_redirects_are_followed_and_bounded(server):
    assert (
        fetch(server.url("/to/cat.png"), LOCAL, noun="image", param="p")[1] == FILES["/cat.png"][1]
    )
    refused(server.url("/loop"), "more than 2 redirects")


def test_private_addresses_are_refused_unless_allowed(server):
    public_only = FetchPolicy.of(["*"], [], max_bytes=1 << 20, timeout_s=1.0, max_redirects=2)
    refused(server.url("/cat.png"), "private or reserved address", public_only)
    refused("http://10.1.2.3/cat.png", "private or reserved address")
    refused("http://169.254.169.254/latest/meta-data", "private or reserved address")
    refused("http://[::1]:80/cat.png", "private or reserved address")
    refused(server.url("/private"), r"private or reserved address \(127.0.0.2\)")  # via a redirect


def test_hosts_outside_the_allow_list_are_never_contacted(server):
    named = FetchPolicy.of(
        ["media.example.com", "*.cdn.example"],
        ["127.0.0.1/32"],
        max_bytes=100,
        timeout_s=1,
        max_redirects=0,
    )
    refused(server.url("/cat.png"), "host '127.0.0.1' is not allowed", named)
    assert named.host_allowed("a.cdn.example") and not named.host_allowed("cdn.example.evil")


def test_size_time_and_type_limits(server):
    small = FetchPolicy.of(["*"], ["127.0.0.1/32"], max_bytes=1000, timeout_s=1.0, max_redirects=0)
    refused(server.url("/big"), "52428800 bytes; the limit is 1000", small)
    refused(server.url("/endless"), "over the limit of 1000 bytes", small)
    started = time.monotonic()
    refused(server.url("/slow"), "took longer than 1 s")
    assert time.monotonic() - started < 2.5
    with pytest.raises(MediaError, match="served type 'text/html'"):
        decode_image_url(server.url("/page.html"), max_pixels=10**6, remote=LOCAL, param="p")
    refused(server.url("/missing"), "HTTP 404")
    refused("ftp://127.0.0.1/x", "only http")
