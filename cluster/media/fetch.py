"""Fetching http(s) media URLs for the ingress, behind an allow-list.

Only hosts the config names are contacted; every address a name resolves to must be
public (or inside a network the config allows), and the connection goes to the address
that was checked, so a DNS answer cannot change between the check and the request.
Redirects are followed by hand, each hop checked the same way. The body is read in
chunks under a byte limit and one deadline for the whole fetch (headers, redirects and
body), so a slow or endless body costs at most `timeout_s`. No torch, no Ray.
"""

from __future__ import annotations

import http.client
import ipaddress
import socket
import ssl
import time
from dataclasses import dataclass
from urllib.parse import urljoin, urlsplit

from cluster.media.errors import MediaError

_REDIRECTS = (301, 302, 303, 307, 308)
_CHUNK_BYTES = 64 * 1024


@dataclass(frozen=True)
class FetchPolicy:
    allowed_hosts: tuple[str, ...]  # exact names, "*.example.com", or "*" for any host
    allowed_networks: tuple[
        ipaddress.IPv4Network | ipaddress.IPv6Network, ...
    ]  # non-public ranges allowed anyway
    max_bytes: int
    timeout_s: float
    max_redirects: int

    @classmethod
    def of(
        cls, hosts, networks, *, max_bytes: int, timeout_s: float, max_redirects: int
    ) -> FetchPolicy:
        nets = tuple(ipaddress.ip_network(n, strict=False) for n in networks)
        return cls(tuple(h.lower() for h in hosts), nets, max_bytes, timeout_s, max_redirects)

    def host_allowed(self, host: str) -> bool:
        host = host.lower()
        return any(
            p == "*" or p == host or (p.startswith("*.") and host.endswith(p[1:]))
            for p in self.allowed_hosts
        )

    def address_allowed(self, address: str) -> bool:
        ip = ipaddress.ip_address(address.split("%", 1)[0])
        if getattr(ip, "ipv4_mapped", None):
            ip = ip.ipv4_mapped
        if any(ip in net for net in self.allowed_networks):
            return True
        return ip.is_global and not ip.is_multicast


def fetch(url: str, policy: FetchPolicy, *, noun: str, param: str) -> tuple[str, bytes]:
    """(MIME type, body) of an http(s) URL under `policy`; else a MediaError naming the reason."""
    deadline = time.monotonic() + policy.timeout_s
    for _ in range(policy.max_redirects + 1):
        status, headers, body = _get_once(url, policy, deadline, noun=noun, param=param)
        if status in _REDIRECTS:
            if "location" not in headers:
                raise MediaError(
                    f"fetching the {noun}: redirect {status} without a Location", param
                )
            url = urljoin(url, headers["location"])
            continue
        if status != 200:
            raise MediaError(
                f"fetching the {noun} failed: the server answered HTTP {status}", param
            )
        return headers.get("content-type", "").split(";", 1)[0].strip().lower(), body
    raise MediaError(f"fetching the {noun}: more than {policy.max_redirects} redirects", param)


def _get_once(url: str, policy: FetchPolicy, deadline: float, *, noun: str, param: str):
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise MediaError(
            f"cannot fetch the {noun} from {url[:100]!r}: only http(s) URLs with a host", param
        )
    host = parts.hostname
    if not policy.host_allowed(host):
        raise MediaError(f"fetching media from host '{host}' is not allowed on this server", param)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    address = _checked_address(host, port, policy, noun=noun, param=param)
    conn = _connection(parts.scheme, host, address, port, _left(deadline, policy, noun, param))
    try:
        path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        conn.request(
            "GET",
            path,
            headers={
                "Host": parts.netloc.rsplit("@", 1)[-1],
                "User-Agent": "epd-media-fetch",
                "Accept-Encoding": "identity",
            },
        )
        sock = conn.sock  # http.client lets go of it once the response says the connection closes
        response = conn.getresponse()
        headers = {k.lower(): v for k, v in response.getheaders()}
        body = (
            b""
            if response.status in _REDIRECTS
            else _read_body(sock, response, policy, deadline, noun, param)
        )
        return response.status, headers, body
    except (OSError, http.client.HTTPException) as exc:
        if time.monotonic() >= deadline or isinstance(exc, socket.timeout):
            raise MediaError(
                f"fetching the {noun} took longer than {policy.timeout_s:g} s", param
            ) from None
        raise MediaError(f"fetching the {noun} failed: {exc}", param) from None
    finally:
        conn.close()


def _checked_address(host: str, port: int, policy: FetchPolicy, *, noun: str, param: str) -> str:
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise MediaError(
            f"cannot fetch the {noun}: host '{host}' does not resolve ({exc.strerror})", param
        ) from None
    addresses = [info[4][0] for info in infos]
    refused = [a for a in addresses if not policy.address_allowed(a)]
    if refused:  # all or nothing: a name with one private answer is refused whole
        raise MediaError(
            f"cannot fetch the {noun}: host '{host}' resolves to a private or reserved address "
            f"({refused[0]})",
            param,
        )
    return addresses[0]


def _connection(
    scheme: str, host: str, address: str, port: int, timeout_s: float
) -> http.client.HTTPConnection:
    if scheme == "http":
        return http.client.HTTPConnection(address, port, timeout=timeout_s)
    return _PinnedHTTPS(host, address, port, timeout_s)


class _PinnedHTTPS(http.client.HTTPSConnection):
    """HTTPS to the checked address, with the host name for SNI and the certificate check."""

    def __init__(self, host: str, address: str, port: int, timeout_s: float):
        super().__init__(host, port, timeout=timeout_s, context=ssl.create_default_context())
        self._address = address

    def connect(self) -> None:
        sock = socket.create_connection((self._address, self.port), self.timeout)
        self.sock = self._context.wrap_socket(sock, server_hostname=self.host)


def _read_body(
    sock: socket.socket, response, policy: FetchPolicy, deadline: float, noun: str, param: str
) -> bytes:
    declared = response.getheader("content-length")
    if declared and declared.isdigit() and int(declared) > policy.max_bytes:
        raise MediaError(
            f"the {noun} at this URL is {int(declared)} bytes; the limit is {policy.max_bytes}",
            param,
        )
    chunks, size = [], 0
    while True:
        sock.settimeout(_left(deadline, policy, noun, param))
        chunk = response.read1(_CHUNK_BYTES)
        if not chunk:
            return b"".join(chunks)
        size += len(chunk)
        if size > policy.max_bytes:
            raise MediaError(
                f"the {noun} at this URL is over the limit of {policy.max_bytes} bytes", param
            )
        chunks.append(chunk)
        _left(deadline, policy, noun, param)


def _left(deadline: float, policy: FetchPolicy, noun: str, param: str) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise MediaError(f"fetching the {noun} took longer than {policy.timeout_s:g} s", param)
    return left
