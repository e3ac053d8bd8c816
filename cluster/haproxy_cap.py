#!/usr/bin/env python3
"""The cluster's requests budget, enforced by HAProxy itself: a generation request that arrives
while as many requests are in flight to epd's replicas as the cluster admits gets its 429 from
HAProxy, before any Python runs, so a burst's refusals take milliseconds whatever the replicas
are busy with (issue #29). The replica's arrival gate stays the authority on everything else
(the token budget, the media lanes) and refuses, later, what this misses.

Ray Serve's HAProxy config has no hook for a rule of one's own, but Serve runs the binary that
RAY_SERVE_HAPROXY_BINARY_PATH names. epd names this file (cluster/front_door.py): run as a
program, it adds epd's rules to epd's backend in each config it is given (`-f`) and execs the
real HAProxy with the same arguments. The rules read a directory of the HTTP port's own that
the replicas fill (`publish`): the budget in an HAProxy map, also set live over HAProxy's admin
socket when a redeploy changes it, and the 429's body. HAProxy counts every request in flight
on the backend (`be_conn`), and one HAProxy sees only the clients of its own node; after a
reload the new process does not count the streams its predecessor still carries (it lets
through more, for the replicas' gate to refuse).

Stdlib only: the program runs on every node under any python3, before epd's imports.
"""

from __future__ import annotations

import os
import re
import socket
import sys
from pathlib import Path

ROOT = Path("/tmp/epd-haproxy")  # one directory per HTTP port: one Serve binds it at a time
MAP, BODY, SOCKET = "cap.map", "refusal.json", "admin-socket"
MARKER = "    # epd (cluster/haproxy_cap.py): the cluster's requests budget, refused here"
GENERATION_PATHS = ("/v1/chat/completions", "/v1/completions")
BINARY_ENV, BACKEND_ENV = "EPD_HAPROXY_BINARY", "EPD_HAPROXY_BACKEND"


def cap_dir(port: int) -> Path:
    return ROOT / str(port)


def rules(directory: Path) -> list[str]:
    """The backend's rules: a POST to a generation path that would be the budget's first request
    over is answered 429 with the replicas' refusal body; budget 0 (or none yet): no cap."""
    lookup = f"map_str_int({directory / MAP},0)"
    retry = f"%[str(retry_after_s),map_str({directory / MAP},1)]"
    return [
        MARKER,
        f"    acl epd_generation path {' '.join(GENERATION_PATHS)}",
        f"    http-request set-var(txn.epd_cap) str(requests),{lookup} if METH_POST epd_generation",
        "    http-request set-var(txn.epd_over) be_conn,sub(txn.epd_cap)"
        " if { var(txn.epd_cap) -m int gt 0 }",
        "    http-request return status 429 content-type application/json"
        f" hdr Retry-After {retry} hdr x-epd-refused-by haproxy file {directory / BODY}"
        " if { var(txn.epd_over) -m int gt 0 }",
    ]


def with_cap(config: str, backend: str, directory: Path) -> str:
    """`config` with epd's rules opening section `backend <backend>`; unchanged where that
    section is missing or already has them."""
    lines, header = config.split("\n"), f"backend {backend}"
    if MARKER in lines or header not in (line.rstrip() for line in lines):
        return config
    at = next(i for i, line in enumerate(lines) if line.rstrip() == header) + 1
    return "\n".join(lines[:at] + rules(directory) + lines[at:])


def _frontend_port(config: str) -> int | None:
    """The port of `frontend http_frontend`'s bind line (epd's HTTP port)."""
    match = re.search(r"^frontend http_frontend\n\s+bind \S*:(\d+)", config, re.MULTILINE)
    return int(match.group(1)) if match else None


def _admin_socket(config: str) -> str | None:
    match = re.search(r"^\s+stats socket (\S+)", config, re.MULTILINE)
    return match.group(1) if match else None


def patch(path: Path, backend: str) -> None:
    """Add the rules to the config at `path` in place, if the replicas have published a budget
    for its port (HAProxy refuses to start on a missing map or body file); note its admin
    socket there for live updates."""
    config = path.read_text()
    port = _frontend_port(config)
    directory = cap_dir(port) if port is not None else None
    if directory is None or not (directory / MAP).is_file() or not (directory / BODY).is_file():
        return
    if (admin := _admin_socket(config)) is not None:
        (directory / SOCKET).write_text(admin)
    patched = with_cap(config, backend, directory)
    if patched != config:
        path.write_text(patched)


def forget(port: int) -> None:
    """A new Serve on `port`: what an earlier one's replicas published there is not its budget."""
    for name in (MAP, BODY, SOCKET):
        (cap_dir(port) / name).unlink(missing_ok=True)


def publish(port: int, max_requests: int, retry_after_s: int, body: bytes) -> None:
    """From a replica: the cluster's requests budget and the 429's body, for the HAProxy on this
    node at the next (re)load and, over its admin socket, at once. Best effort: without it the
    replica's own gate refuses."""
    directory = cap_dir(port)
    directory.mkdir(parents=True, exist_ok=True)
    _write(directory / BODY, body)
    _write(directory / MAP, f"requests {max_requests}\nretry_after_s {retry_after_s}\n".encode())
    set_live(port, requests=max_requests, retry_after_s=retry_after_s)


def published(port: int) -> dict[str, int]:
    """What the replicas published for `port` (empty: nothing)."""
    try:
        lines = (cap_dir(port) / MAP).read_text().splitlines()
    except OSError:
        return {}
    return {key: int(value) for key, value in (line.split() for line in lines if line.strip())}


def set_live(port: int, **values: int) -> list[str]:
    """Set map entries (`requests`, `retry_after_s`) in the running HAProxy that loaded the rules
    for `port`, without a reload; its answers (none where no HAProxy has loaded them yet: the
    map file is enough then). The files stay as published."""
    if (admin := _noted_socket(port)) is None:
        return []
    path = cap_dir(port) / MAP
    return [ask(admin, f"set map {path} {key} {value}") for key, value in values.items()]


def live(port: int) -> dict[str, int]:
    """The map as the running HAProxy for `port` holds it (empty: none has loaded the rules)."""
    if (admin := _noted_socket(port)) is None:
        return {}
    # each line of `show map`: <ref> <key> <value>
    rows = (line.split() for line in ask(admin, f"show map {cap_dir(port) / MAP}").splitlines())
    return {row[1]: int(row[2]) for row in rows if len(row) == 3 and row[2].isdigit()}


def _noted_socket(port: int) -> str | None:
    """The admin socket of the HAProxy that last loaded the rules for `port`."""
    try:
        return (cap_dir(port) / SOCKET).read_text().strip()
    except OSError:
        return None


def _write(path: Path, data: bytes) -> None:
    """Whole or not at all: HAProxy may read it at any moment."""
    partial = path.with_name(f".{path.name}.{os.getpid()}")
    partial.write_bytes(data)
    partial.replace(path)


def ask(admin_socket: str, command: str) -> str:
    """One command to an HAProxy's admin socket; its answer (or why there was none)."""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(1.0)
            sock.connect(admin_socket)
            sock.sendall(command.encode() + b"\n")
            return sock.recv(4096).decode(errors="replace")
    except OSError as exc:  # an HAProxy that is gone (a stale note) or being reloaded
        return str(exc)


def main(argv: list[str]) -> None:
    """As HAProxy: patch each `-f` config, then become the real binary at niceness 0."""
    backend = os.environ.get(BACKEND_ENV)
    if backend:
        for flag, value in zip(argv, argv[1:]):
            if flag == "-f" and Path(value).is_file():
                try:
                    patch(Path(value), backend)
                except OSError as exc:  # no cap rather than no HAProxy
                    print(f"epd: {value} left as Serve wrote it: {exc}", file=sys.stderr)
    try:  # Ray starts its workers, so HAProxy, at niceness 15: the door keeps pace with decode
        os.setpriority(os.PRIO_PROCESS, 0, 0)
    except OSError:  # no CAP_SYS_NICE: Ray's niceness stays
        pass
    binary = os.environ[BINARY_ENV]
    os.execv(binary, [binary, *argv])


if __name__ == "__main__":
    main(sys.argv[1:])
