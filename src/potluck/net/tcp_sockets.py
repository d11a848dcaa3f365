"""The listening side of the TCP transport (`net.tcp`): bound, listening sockets for a host, and
the addresses a wildcard bind stands for."""

from __future__ import annotations

import asyncio
import errno
import ipaddress
import socket

__all__ = ["LISTEN_BACKLOG", "announceable_hosts", "listening_sockets"]

# Pending connections the OS queues for us to accept (asyncio's create_server uses 100).
LISTEN_BACKLOG = 1024


async def listening_sockets(host: str, port: int) -> list[socket.socket]:
    """Bound, listening, non-blocking sockets for `host` (each of its addresses), as
    loop.create_server(host, port, reuse_address=True) makes them."""
    loop = asyncio.get_running_loop()
    infos = await loop.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    sockets: list[socket.socket] = []
    try:
        for family, kind, proto, _, address in dict.fromkeys(infos):
            try:
                sock = socket.socket(family, kind, proto)
            except OSError:  # e.g. no IPv6 on this host
                continue
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, True)
            if family == socket.AF_INET6 and hasattr(socket, "IPPROTO_IPV6"):
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, True)
            try:
                sock.bind(address)
            except OSError as e:
                raise OSError(e.errno, f"error while attempting to bind on address {address!r}: "
                                       f"{e.strerror.lower() if e.strerror else e}") from None
            sock.listen(LISTEN_BACKLOG)
            sock.setblocking(False)
        if not sockets:
            raise OSError(errno.EADDRNOTAVAIL, f"no address to listen on for {host!r}")
    except BaseException:
        for sock in sockets:
            sock.close()
        raise
    return sockets


def announceable_hosts(bound: str) -> list[str]:
    """The hosts to advertise for a listening socket: wildcard binds expand to local addresses."""
    ip = ipaddress.ip_address(bound)
    if not ip.is_unspecified:
        return [bound]
    hosts = []
    try:
        family = socket.AF_INET if ip.version == 4 else socket.AF_INET6
        for info in socket.getaddrinfo(socket.gethostname(), None, family=family):
            host = info[4][0]
            if host not in hosts and not ipaddress.ip_address(host).is_loopback:
                hosts.append(host)
    except OSError:
        pass
    loopback = "127.0.0.1" if ip.version == 4 else "::1"
    return hosts + [loopback]
