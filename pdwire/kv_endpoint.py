"""A decode node's KV endpoint as it announces it (NodeHello.kv_endpoint): the router checks its
form at registration, before any prefill node is told to connect to it.

  tcp://HOST:PORT   HOST a DNS name, an IPv4 address or a bracketed IPv6 one; PORT 1-65535
                    (ZeroMQ and torch_dist receivers)
  ipc://PATH        a Unix socket path (a receiver bound to one; same-host nodes only)

Only the form is checked (no lookup: the router's loop must not wait on DNS); a name that does
not resolve fails the pairing on the prefill node, retryably.
"""
from __future__ import annotations

import ipaddress
import re

_LABEL = re.compile(r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?\Z")


def _host_ok(host: str) -> bool:
    if host.startswith("[") and host.endswith("]"):
        try:
            return ipaddress.ip_address(host[1:-1]).version == 6
        except ValueError:
            return False
    return len(host) <= 253 and all(_LABEL.match(label) for label in host.split("."))


def kv_endpoint_problem(endpoint: str) -> str:
    """Why endpoint is not of a form above ("" if it is)."""
    if endpoint.startswith("ipc://"):
        path = endpoint[len("ipc://"):]
        return "" if path and not any(c.isspace() or c == "\0" for c in path) else f"bad ipc path in {endpoint!r}"
    if not endpoint.startswith("tcp://"):
        return f"{endpoint!r} is not tcp://HOST:PORT or ipc://PATH"
    netloc = endpoint[len("tcp://"):]
    host, sep, port = netloc.rpartition(":")
    if not sep or not (port.isascii() and port.isdigit()) or not 0 < int(port) < 65536:
        return f"no port 1-65535 in {endpoint!r}"
    if not _host_ok(host):
        return f"bad host in {endpoint!r}"
    return ""
