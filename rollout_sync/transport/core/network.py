"""Which local address and interface a rank's group connections use, derived from the one address a user
names: the coordinator's.

A process group's backend must listen on an address its peers reach. gloo, left to itself, resolves this
machine's hostname, which often resolves to a loopback address (Debian's ``127.0.1.1``, a container's
``/etc/hosts``): peers on other hosts then get "Connection refused" and wait. NCCL picks an interface by
its own rules (``NCCL_SOCKET_IFNAME``). Instead, each rank asks the kernel which local address routes to
the coordinator (a UDP socket's ``connect`` sends nothing) and binds that: the address on the interface
that reaches the coordinator's host, the same interface its other peers are reached through in a cluster.
A user's ``GLOO_SOCKET_IFNAME`` or ``NCCL_SOCKET_IFNAME`` still wins.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import os
import socket
import struct
from urllib.parse import urlparse

from ...errors import HandshakeError

__all__ = [
    "GLOO_IFNAME_ENV",
    "NCCL_IFNAME_ENV",
    "interface_of",
    "is_loopback",
    "resolve",
    "route_source",
    "split_address",
    "use_nccl_interface",
]

GLOO_IFNAME_ENV = "GLOO_SOCKET_IFNAME"
NCCL_IFNAME_ENV = "NCCL_SOCKET_IFNAME"
_SIOCGIFADDR = 0x8915


def split_address(address: str) -> tuple[str, int]:
    """``tcp://HOST:PORT`` as (host, port)."""
    url = urlparse(address)
    if url.scheme != "tcp" or not url.hostname or not url.port:
        raise ValueError(f"the coordinator address must look like tcp://HOST:PORT, not {address!r}")
    return url.hostname, url.port


def resolve(host: str) -> str:
    """``host`` as an IPv4 address (a name is resolved as every other program here resolves it)."""
    try:
        return socket.gethostbyname(host)
    except OSError as exc:
        raise HandshakeError(f"cannot resolve the coordinator's host {host!r}: {exc}") from None


def route_source(host: str, port: int = 9) -> str:
    """The local IPv4 address the kernel would send from to reach ``host`` (no packet is sent)."""
    target = resolve(host)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((target, port or 9))
        except OSError as exc:
            raise HandshakeError(
                f"no route from this host ({socket.gethostname()}) to the coordinator's host {host!r} "
                f"({target}): {exc}"
            ) from None
        return str(s.getsockname()[0])


def is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


def interface_of(address: str) -> str | None:
    """The name of the network interface that holds IPv4 ``address`` (None when none does)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            request = struct.pack("256s", name.encode()[:15])
            with contextlib.suppress(OSError):
                reply = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, request)
                if socket.inet_ntoa(reply[20:24]) == address:
                    return name
    return None


def use_nccl_interface(address: str) -> str:
    """Point NCCL at the interface holding ``address`` (this rank's route to the coordinator) unless the
    user set ``NCCL_SOCKET_IFNAME``; the interface NCCL will use. NCCL reads it when a communicator is
    made, so this runs before the group is built."""
    chosen = os.environ.get(NCCL_IFNAME_ENV)
    if chosen:
        return chosen
    name = interface_of(address)
    if name is None:
        raise HandshakeError(
            f"no network interface holds {address}, this host's route to the coordinator: set "
            f"{NCCL_IFNAME_ENV} to the interface NCCL should use"
        )
    os.environ[NCCL_IFNAME_ENV] = name
    return name
