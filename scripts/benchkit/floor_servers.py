"""Servers that do the least an HTTP answer can be, for the floors of scripts/bench_floors.py:
a bare asyncio protocol (no HTTP framework, no ASGI, no Serve) and the HAProxy binary Serve
ships. What they reach on this host's cores bounds what any server here can.

- `refuser`: every request gets a 429 (OpenAI's error shape, Retry-After) once its body is in;
- `chat`: /v1/models names model `m`; a body over 1 MB gets that 429 once read whole (as
  epd's media budget refuses an upload it cannot take), any other a one-token chat completion;
- `haproxy_refuser`: HAProxy answering 429 itself, by an `http-request return` rule;
- `haproxy_front`: HAProxy forwarding to a backend on another port, as Serve's front door does.
"""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

ERROR = b'{"error":{"message":"busy","type":"rate_limit_error","param":null,"code":429}}'
CHAT = json.dumps(
    {
        "id": "floor",
        "object": "chat.completion",
        "created": 0,
        "model": "m",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "hi"},
                "finish_reason": "length",
            }
        ],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
    }
).encode()
MODELS = json.dumps({"object": "list", "data": [{"id": "m", "object": "model"}]}).encode()
BIG_BODY = 1 << 20


def answer(status: int, body: bytes, close: bool = False) -> bytes:
    head = (
        f"HTTP/1.1 {status} X\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
    )
    head += "Retry-After: 1\r\n" if status == 429 else ""
    head += "Connection: close\r\n" if close else ""
    return head.encode() + b"\r\n" + body


class Bare(asyncio.Protocol):
    """Requests one after another on a connection: headers, then Content-Length bytes."""

    refuse_all = False

    def connection_made(self, transport) -> None:
        self.transport, self.buf, self.need, self.line = transport, bytearray(), None, b""

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while self._one():
            pass

    def _one(self) -> bool:
        if self.need is None:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return False
            head = bytes(self.buf[:end]).split(b"\r\n")
            del self.buf[: end + 4]
            self.line, self.need = head[0], 0
            for field in head[1:]:
                name, _, value = field.partition(b":")
                if name.strip().lower() == b"content-length":
                    self.need = int(value)
        if len(self.buf) < self.need:
            return False
        size, self.need = self.need, None
        del self.buf[:size]
        self.transport.write(self._reply(size))
        if self.refuse_all:  # Connection: close
            self.transport.close()
            return False
        return True

    def _reply(self, size: int) -> bytes:
        if self.refuse_all:
            return answer(429, ERROR, close=True)
        if b"/v1/models" in self.line:
            return answer(200, MODELS)
        return answer(429, ERROR) if size > BIG_BODY else answer(200, CHAT)


class Refuser(Bare):
    refuse_all = True


def serve_bare(kind: str, port: int) -> None:
    protocol = Refuser if kind == "refuser" else Bare
    loop = asyncio.new_event_loop()
    server = loop.run_until_complete(
        loop.create_server(protocol, "127.0.0.1", port, backlog=4096, reuse_address=True)
    )
    loop.run_until_complete(server.serve_forever())


def haproxy_config(port: int, backend_port: int | None) -> str:
    head = f"""global
    maxconn 8192
    nbthread 2
defaults
    mode http
    timeout client 300s
    timeout connect 5s
    timeout server 300s
    option http-no-delay
frontend floor
    bind 127.0.0.1:{port}
"""
    if backend_port is None:
        body = ERROR.decode().replace('"', '\\"')
        return head + (
            "    http-request return status 429 content-type application/json "
            f'hdr Retry-After 1 string "{body}"\n'
        )
    backend = f"backend bare\n    http-reuse always\n    server s1 127.0.0.1:{backend_port}\n"
    return head + "    default_backend bare\n" + backend


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(port: int, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise RuntimeError(f"nothing listens on {port}")


def _bare(kind: str, port: int) -> subprocess.Popen:
    code = f"import sys; sys.path.insert(0, {str(Path(__file__).parent.parent)!r}); "
    code += f"from benchkit.floor_servers import serve_bare; serve_bare({kind!r}, {port})"
    return subprocess.Popen([sys.executable, "-c", code])


def _haproxy(port: int, backend_port: int | None, workdir: Path) -> subprocess.Popen:
    from ray.serve._private.haproxy import get_haproxy_binary

    cfg = workdir / f"floor-{port}.cfg"
    cfg.write_text(haproxy_config(port, backend_port))
    return subprocess.Popen([get_haproxy_binary(), "-db", "-f", str(cfg)])


@contextmanager
def running(kind: str, workdir: Path):
    """The port of a floor server of `kind` (module doc), stopped on exit."""
    port, procs = free_port(), []
    try:
        if kind in ("refuser", "chat"):
            procs.append(_bare(kind, port))
        elif kind == "haproxy_refuser":
            procs.append(_haproxy(port, None, workdir))
        else:  # haproxy_front: HAProxy before a bare chat server
            backend = free_port()
            procs.append(_bare("chat", backend))
            wait_for(backend)
            procs.append(_haproxy(port, backend, workdir))
        wait_for(port)
        yield port
    finally:
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
            proc.wait(10)
