"""scripts/benchkit/live_server.py: a benchmark waits for the last run's front door to let go
of the port (its HAProxy outlives its Ray by a second or two), and says so if it never does."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from benchkit.live_server import wait_for_free_port


def _listening() -> socket.socket:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    return sock


def test_a_port_let_go_of_while_waiting_is_taken():
    sock = _listening()
    port = sock.getsockname()[1]
    threading.Timer(0.5, sock.close).start()
    started = time.monotonic()
    wait_for_free_port(port, within_s=5)
    assert 0.4 < time.monotonic() - started < 4


def test_a_port_held_past_the_wait_stops_the_benchmark_by_name():
    sock = _listening()
    try:
        with pytest.raises(SystemExit, match="still in use"):
            wait_for_free_port(sock.getsockname()[1], within_s=0.5)
    finally:
        sock.close()
