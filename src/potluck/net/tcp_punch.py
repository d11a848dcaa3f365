"""Hole punching on TCP: one try's sockets (`TCPPunch`, a `transport.PunchEndpoint`).

A try binds a fresh port, listens on it and dials the other side from it; `net.tcp` runs TLS
and the handshake on whichever socket connects (`TCPTransport.punch_endpoint`).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Awaitable, Callable
from typing import Any

from potluck.core.errors import PeerUnreachable
from potluck.net.address import Multiaddr
from potluck.net.connection import Connection
from potluck.net.holepunch import MAX_CANDIDATES
from potluck.net.identity import PeerID

__all__ = ["PUNCH_BACKLOG", "PunchedLink", "TCPPunch"]

# Connections a hole punch's listener queues: it waits for one, from one peer.
PUNCH_BACKLOG = 4
# Ports shared by a punch's listener and its dial need SO_REUSEPORT (Linux, macOS, BSDs).
_REUSE_PORT = hasattr(socket, "SO_REUSEPORT")

# Runs TLS and the handshake on a punched socket: (socket, peername, expected id, whether we are
# the TLS client) -> the authenticated connection, registered in the transport.
PunchedLink = Callable[[socket.socket, Any, PeerID, bool], Awaitable[Connection]]


class TCPPunch:
    """One hole punch try on TCP (`net.holepunch`): a socket listening on a fresh port, and a dial
    from that same port to the other side's first candidate of our address family (one address
    each, so both sides' dials are one TCP connection). The connection is our dial if our SYN
    crossed theirs (a simultaneous open through both NATs), or the one we accepted (where nothing
    drops their SYN before ours leaves: no NAT on our side, or loopback). The listener and the dial
    share the port through SO_REUSEADDR and SO_REUSEPORT; where SO_REUSEPORT is missing there is no
    listener, and only a simultaneous open connects.

    Candidates: the port on each of `public_hosts` (the hosts others saw us at: a port-preserving
    NAT keeps the port; else our listening hosts). `link` runs TLS and the handshake on the socket
    that connected."""

    def __init__(self, host: str, public_hosts: list[str], link: PunchedLink):
        self._link = link
        self._family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._kind = "ip6" if self._family == socket.AF_INET6 else "ip4"
        self._listener: socket.socket | None = _punch_socket(self._family, (host, 0))
        port = self._listener.getsockname()[1]
        self._local = (host, port)
        if _REUSE_PORT:
            self._listener.listen(PUNCH_BACKLOG)
        self.candidates: list[Multiaddr] = []
        for public in dict.fromkeys(public_hosts):
            with contextlib.suppress(ValueError):  # not an address: skipped
                addr = Multiaddr.tcp(public, port)
                if addr.kind == self._kind:
                    self.candidates.append(addr)
        del self.candidates[MAX_CANDIDATES:]

    async def connect(self, remote: list[Multiaddr], expected: PeerID, client: bool) -> Connection:
        """The direct connection with `expected`, the TLS client if `client` (see `link`)."""
        target = next((a for a in remote if a.kind == self._kind and a.port), None)
        if target is None:
            raise PeerUnreachable(f"{expected} gave no {self._kind} address to punch to")
        loop = asyncio.get_running_loop()
        if not _REUSE_PORT and self._listener is not None:
            self._listener.close()  # frees the port for the dial (there is no listener)
            self._listener = None
        tries = [loop.create_task(self._dial(target))]
        if self._listener is not None:
            tries.append(loop.create_task(self._accept(target.host)))
        sock, peer = await _first_socket(tries)
        self.close()
        return await self._link(sock, peer, expected, client)

    async def _dial(self, target: Multiaddr) -> tuple[socket.socket, Any]:
        sock = _punch_socket(self._family, self._local)
        try:
            await asyncio.get_running_loop().sock_connect(sock, (target.host, target.port))
        except BaseException:
            sock.close()
            raise
        return sock, sock.getpeername()

    async def _accept(self, host: str) -> tuple[socket.socket, Any]:
        """The first connection from `host` (others are strangers: closed)."""
        assert self._listener is not None
        while True:
            sock, peer = await asyncio.get_running_loop().sock_accept(self._listener)
            if str(peer[0]) == host:
                sock.setblocking(False)
                return sock, peer
            sock.close()

    def close(self) -> None:
        if self._listener is not None:
            self._listener.close()
            self._listener = None


def _punch_socket(family: int, address: tuple[str, int]) -> socket.socket:
    """A TCP socket bound to `address`, whose port other punch sockets may share."""
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, True)
        if _REUSE_PORT:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, True)
        sock.bind(address)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


async def _first_socket(tries: list[asyncio.Task]) -> tuple[socket.socket, Any]:
    """The socket of the first of `tries` that connects; the others are cancelled (or closed)."""
    errors: list[str] = []
    pending = set(tries)
    try:
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                if task.exception() is None:
                    for other in done - {task}:
                        if other.exception() is None:
                            other.result()[0].close()
                    return task.result()
                errors.append(str(task.exception()) or type(task.exception()).__name__)
    finally:
        for task in pending:
            task.cancel()
            task.add_done_callback(_close_socket)
    raise PeerUnreachable("punch dial failed: " + "; ".join(errors))


def _close_socket(task: asyncio.Task) -> None:
    """A try that connected after another had won (or after the deadline): close its socket."""
    if not task.cancelled() and task.exception() is None:
        task.result()[0].close()
