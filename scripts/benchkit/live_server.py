"""A served app for a benchmark: started on a Ray of this process's own (never a shared one)
and shut down afterwards, however the benchmark ends."""

from __future__ import annotations

import socket
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

from benchkit.cpu import ray_running


@contextmanager
def served(cfg) -> Iterator[str]:
    """The model made ready, the app started for `cfg`; yields its /v1 base URL, then shuts
    Serve and Ray down. Refuses a host where a Ray cluster already runs (it would share it)."""
    import ray
    from ray import serve

    from cluster.cli import start
    from cluster.prepare import ensure_model

    ensure_model(cfg)
    if ray_running():
        sys.exit(
            "a Ray cluster is already running on this host; wait for it to stop before benchmarking"
        )
    # the last run's HAProxy may hold the port for a second or two after its Ray stopped
    wait_for_free_port(cfg.server.port, within_s=15.0)
    base = start(cfg)
    try:
        yield base
    finally:
        serve.shutdown()
        ray.shutdown()


def add_front_door_flag(parser) -> None:
    """`--front-door`: which front door the served app gets (cluster/front_door.py)."""
    from cluster.front_door import FrontDoor

    parser.add_argument(
        "--front-door",
        choices=[door.value for door in FrontDoor],
        help="server.front_door for the served app (default: the config's)",
    )


def with_front_door(cfg, door: str | None):
    return cfg.replace(server={"front_door": door}) if door else cfg


def _port_taken(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def require_free_port(port: int) -> None:
    if _port_taken(port):
        sys.exit(f"port {port} is in use (another engineer's Serve?); pass --port")


def wait_for_free_port(port: int, within_s: float) -> None:
    deadline = time.monotonic() + within_s
    while _port_taken(port):
        if time.monotonic() > deadline:
            sys.exit(f"port {port} is still in use after {within_s:.0f} s; stop what holds it")
        time.sleep(0.2)


@contextmanager
def own_ray(num_cpus: int) -> Iterator[None]:
    """A local Ray of `num_cpus` logical CPUs for several fleets in turn; shut down after."""
    import ray
    from ray import serve

    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, log_to_driver=False)
    try:
        yield
    finally:
        serve.shutdown()
        ray.shutdown()


@contextmanager
def fleet(config) -> Iterator[str]:
    """One app (on the Ray already up) for `config`; yields its /v1 base URL, then deletes it
    with its fleet controller and workers, so the next fleet starts on a quiet host."""
    from ray import serve

    from cluster.cli import start
    from cluster.controller import retire

    base = start(config)
    try:
        yield base
    finally:
        serve.delete("epd")
        retire("epd")
