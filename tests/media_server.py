"""A local HTTP server of media files and misbehaving endpoints, for the fetching tests
(unit and integration): images, audio and video as a real server would send them, plus an
oversize body, a slow body, redirects, and a redirect to a private address."""

from __future__ import annotations

import io
import threading
import time
import wave
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
from PIL import Image


def png_bytes(seed: int = 3, size: int = 40) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def wav_bytes(seconds: float = 0.5, rate_hz: int = 16000) -> bytes:
    t = np.arange(int(seconds * rate_hz)) / rate_hz
    samples = (np.sin(2 * np.pi * 440 * t) * 12000).astype("<i2")
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1), w.setsampwidth(2), w.setframerate(rate_hz)
        w.writeframes(samples.tobytes())
    return buf.getvalue()


def gif_bytes(num_frames: int = 4, size: int = 32) -> bytes:
    rng = np.random.default_rng(5)
    frames = [
        Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8))
        for _ in range(num_frames)
    ]
    buf = io.BytesIO()
    frames[0].save(buf, format="GIF", save_all=True, append_images=frames[1:], duration=250, loop=0)
    return buf.getvalue()


FILES = {
    "/cat.png": ("image/png", png_bytes()),
    "/tone.wav": ("audio/wav", wav_bytes()),
    "/clip.gif": ("image/gif", gif_bytes()),
    "/page.html": ("text/html", b"<html></html>"),
}


class MediaServer:
    """Serves FILES on 127.0.0.1 and: /big (declares 50 MB), /endless (no length, never ends),
    /slow (a byte every 0.2 s), /to/<path> (302 to path), /private (302 to 127.0.0.2), /loop."""

    def __init__(self):
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _handler())
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def url(self, path: str, host: str = "127.0.0.1") -> str:
        return f"http://{host}:{self.port}{path}"

    def __enter__(self) -> MediaServer:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()


def _handler():
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.0"

        def log_message(self, *args) -> None:  # quiet
            pass

        def do_GET(self) -> None:
            port = self.server.server_address[1]
            path = self.path
            if path in FILES:
                mime, body = FILES[path]
                return self._send(200, body, mime)
            if path.startswith("/to/"):
                return self._redirect("/" + path[4:])
            if path == "/private":
                return self._redirect(f"http://127.0.0.2:{port}/cat.png")
            if path == "/loop":
                return self._redirect("/loop")
            if path == "/big":
                self.send_response(200)
                (
                    self.send_header("Content-Type", "image/png"),
                    self.send_header("Content-Length", str(50 << 20)),
                )
                self.end_headers()
                return self._drip(b"\0" * 65536, 0, 1 << 20)
            if path == "/endless":
                self.send_response(200)
                self.send_header("Content-Type", "image/png")
                self.end_headers()
                return self._drip(b"\0" * 65536, 0, 1 << 16)
            if path == "/slow":
                self.send_response(200)
                self.send_header("Content-Type", "image/png")
                self.end_headers()
                return self._drip(b"x", 0.2, 100)
            self._send(404, b"not found", "text/plain")

        def _send(self, status: int, body: bytes, mime: str) -> None:
            self.send_response(status)
            (
                self.send_header("Content-Type", mime),
                self.send_header("Content-Length", str(len(body))),
            )
            self.end_headers()
            self.wfile.write(body)

        def _redirect(self, location: str) -> None:
            self.send_response(302)
            self.send_header("Location", location), self.send_header("Content-Length", "0")
            self.end_headers()

        def _drip(self, piece: bytes, pause_s: float, times: int) -> None:
            try:
                for _ in range(times):
                    self.wfile.write(piece)
                    self.wfile.flush()
                    time.sleep(pause_s)
            except OSError:  # the client gave up: that is the point
                pass

    return Handler
