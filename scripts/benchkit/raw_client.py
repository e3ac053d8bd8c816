"""A bare-socket streaming chat client for latency benchmarks. The client shares this host's
cores with the server, so it parses nothing per event: httpx and a JSON parse an event cost
about 0.15 ms of CPU a token here, and 0.5-1 ms of a request's measured time to first token.
One kept-alive connection, one request at a time."""

from __future__ import annotations

import json
import socket
import time
from urllib.parse import urlsplit

from benchkit.http_client import Result

TOKEN_MARKS = (b'"content":"', b'"finish_reason":"')  # an event that carries a token
_END = b"0\r\n\r\n"  # the last chunk of a chunked body


class ConnectionClosed(Exception):
    """The server closed the connection before answering."""


class RawChat:
    def __init__(self, url: str):
        parts = urlsplit(url)
        self.path, self.netloc = parts.path, parts.netloc
        self.address = (parts.hostname, parts.port)
        self.sock = self._connect()

    def _connect(self) -> socket.socket:
        sock = socket.create_connection(self.address)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock

    def close(self) -> None:
        self.sock.close()

    def stream(self, body: bytes) -> Result:
        """POST one streaming chat; times from the send to the first and last reads that
        carried a token; the usage and the server's timings from its last events. A kept-alive
        connection the server closed meanwhile (HAProxy's reload does) is opened again, once,
        as HTTP clients do."""
        try:
            return self._stream(body)
        except ConnectionClosed:
            self.sock.close()
            self.sock = self._connect()
            return self._stream(body)

    def _stream(self, body: bytes) -> Result:
        head = (
            f"POST {self.path} HTTP/1.1\r\nHost: {self.netloc}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        )
        started = time.perf_counter()
        self.sock.sendall(head.encode() + body)
        data, first, last = bytearray(), None, None
        while not (b"[DONE]" in data[-96:] and data.endswith(_END)):
            try:
                block = self.sock.recv(65536)
            except ConnectionResetError:
                block = b""
            if not block and not data:
                raise ConnectionClosed
            if not block:
                raise RuntimeError(f"the server closed the connection: {bytes(data[-300:])!r}")
            data += block
            if not data.startswith(b"HTTP/1.1 200"):
                raise RuntimeError(f"the server answered {bytes(data[:300])!r}")
            if any(mark in block for mark in TOKEN_MARKS):
                last = time.perf_counter()
                first = first or last
        usage, timings = _last_event_with(data, b'"usage":{'), _last_event_with(data, b'"timings"')
        n = (usage.get("usage") or {}).get("completion_tokens", 0)
        if first is None or not n:
            raise RuntimeError(f"no tokens in the stream: {bytes(data[-300:])!r}")
        tpot = (last - first) / (n - 1) if n > 1 else None
        return Result(
            first - started, tpot, n, first - started, last - started, timings.get("timings")
        )


def _last_event_with(data: bytes, needle: bytes) -> dict:
    lines = [ln for ln in bytes(data).split(b"\n") if ln.startswith(b"data: {") and needle in ln]
    return json.loads(lines[-1][6:]) if lines else {}
