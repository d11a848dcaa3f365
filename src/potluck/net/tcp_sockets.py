"""The sockets of the TCP transport (`net.tcp`): bound, listening sockets for a host, the
addresses a wildcard bind stands for, and what a connected socket says or is told of its sending
(unacknowledged bytes, a pacing cap)."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import ipaddress
import socket
import struct
import sys
import termios
from typing import Any

__all__ = ["LISTEN_BACKLOG", "PACED_QUEUE_MIN", "PACED_QUEUE_SECONDS", "announceable_hosts", "listening_sockets",
           "pace_socket", "unacknowledged"]

# Pending connections the OS queues for us to accept (asyncio's create_server uses 100).
LISTEN_BACKLOG = 1024
_LINUX = sys.platform.startswith("linux")
# The ioctl that reads a TCP socket's unacknowledged bytes (SIOCOUTQ, Linux only).
_SEND_QUEUE = getattr(termios, "TIOCOUTQ", None) if _LINUX else None
# The socket option that caps a TCP socket's pacing rate in bytes/s (SO_MAX_PACING_RATE, Linux
# only; -1 lifts the cap), and the largest rate it takes as a C int.
_MAX_PACING_RATE = getattr(socket, "SO_MAX_PACING_RATE", 47) if _LINUX else None
_MAX_PACING_VALUE = 2**31 - 1
# The option that caps the bytes a TCP socket holds not yet sent (TCP_NOTSENT_LOWAT; 0: the
# system's default, which is no cap).
_NOTSENT_LOWAT = getattr(socket, "TCP_NOTSENT_LOWAT", 25) if _LINUX else None
# A paced socket holds at most this many seconds of its pace not yet sent, and its transport as
# much in its buffer (never less than PACED_QUEUE_MIN bytes each: a frame or two). With the
# default MiBs queued per link, the all-reduce over emulated 100 Mbit/s links took 3.53 s against
# 3.47 s (wan) and 3.60-3.70 s against 3.51 s (0.5% loss) in float32 (benchmarks/wan.py).
PACED_QUEUE_SECONDS = 0.02
PACED_QUEUE_MIN = 16 * 2**10


def unacknowledged(sock: Any) -> int:
    """Bytes in a connected TCP socket's send queue that the other side has not acknowledged
    (Linux; 0 elsewhere, or for a socket closing under us)."""
    if _SEND_QUEUE is None:
        return 0
    with contextlib.suppress(OSError, ValueError):
        return struct.unpack("i", fcntl.ioctl(sock.fileno(), _SEND_QUEUE, b"\0\0\0\0"))[0]
    return 0


def pace_socket(sock: Any, rate: float | None) -> int | None:
    """Let a connected TCP socket send at most `rate` bytes/s, the kernel spacing its packets
    out, and hold little unsent (None: lift both); returns the most its transport should buffer
    (None: its default). Linux only; nothing elsewhere, or for a socket closing under us."""
    queue = None if rate is None else max(PACED_QUEUE_MIN, int(rate * PACED_QUEUE_SECONDS))
    if _MAX_PACING_RATE is None or _NOTSENT_LOWAT is None:
        return None
    value = -1 if rate is None else max(1, min(_MAX_PACING_VALUE, int(rate)))
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, _MAX_PACING_RATE, value)
        sock.setsockopt(socket.IPPROTO_TCP, _NOTSENT_LOWAT, min(_MAX_PACING_VALUE, queue or 0))
    return queue


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
