"""The stage most transport attacks play on: a TLS server, an attacker and an honest peer, both
already connected to it over 127.0.0.1; everything closed afterwards. Also the attacker's props:
raw TLS connections, a handler that parks calls until released, raw requests that are never
cancelled."""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from potluck.core import compat
from potluck.net.frames import Frame, Kind
from potluck.net.identity import Identity, PeerID
from potluck.net.tcp import TCPTransport


async def echo(request: Any, ctx: Any) -> Any:
    return request


@contextlib.asynccontextmanager
async def attacked_server(handlers: dict[str, Any] | None = None, stream_handlers: dict[str, Any] | None = None,
                          ) -> AsyncIterator[tuple[TCPTransport, TCPTransport, TCPTransport, PeerID]]:
    """(server, attacker, honest, server's id); the server also serves `echo`, for the honest peer."""
    server = TCPTransport(Identity.generate(), host="127.0.0.1")
    for name, handler in {"echo": echo, **(handlers or {})}.items():
        server.add_handler(name, handler)
    for name, handler in (stream_handlers or {}).items():
        server.add_stream_handler(name, handler)
    attacker = TCPTransport(Identity.generate(), host="127.0.0.1")
    honest = TCPTransport(Identity.generate(), host="127.0.0.1")
    for t in (server, attacker, honest):
        await t.start()
    try:
        server_id = await honest.connect(server.addresses[0], timeout=10)
        await attacker.connect(server.addresses[0], timeout=10)
        yield server, attacker, honest, server_id
    finally:
        for t in (attacker, honest, server):
            await t.close()


@contextlib.asynccontextmanager
async def running(*transports: TCPTransport) -> AsyncIterator[list[asyncio.StreamWriter]]:
    """Starts `transports`; yields a list for the raw connections' writers, all closed on exit,
    then the transports (in reverse order)."""
    writers: list[asyncio.StreamWriter] = []
    for t in transports:
        await t.start()
    try:
        yield writers
    finally:
        for writer in writers:
            writer.close()
        for t in reversed(transports):
            await t.close()


async def tls_connection(host: str, port: int, source: str | None = None,
                         ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter] | tuple[None, None]:
    """A TLS connection that never says HELLO (from `source`, an address on the loopback
    interface), or (None, None) if the server closed it during the TLS handshake (a connection
    over a cap is closed before TLS)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    try:
        return await asyncio.open_connection(host, port, ssl=ctx, server_hostname="",
                                             local_addr=None if source is None else (source, 0))
    except (ConnectionError, ssl.SSLError):
        return None, None


async def closed_within(reader: asyncio.StreamReader | None, seconds: float) -> tuple[bool, int]:
    """(whether the server closed the connection within `seconds`, bytes it sent before)."""
    received = 0
    if reader is None:
        return True, received
    try:
        async with compat.timeout(seconds):
            while chunk := await reader.read(65536):
                received += len(chunk)
        return True, received
    except (ConnectionError, ssl.SSLError):
        return True, received
    except TimeoutError:
        return False, received


def parking_handler() -> tuple[Callable[[Any, Any], Awaitable[None]], asyncio.Event]:
    """(a handler, unary or stream, that holds every call until the event is set, the event)."""
    release = asyncio.Event()

    async def park(request: Any, ctx: Any) -> None:
        await release.wait()

    return park, release


async def send_raw_requests(conn: Any, method: str, count: int, body: Any, first_id: int = 1,
                            kind: Kind = Kind.REQUEST) -> None:
    """`count` requests (or stream OPENs) written straight onto `conn`'s link, with odd call ids
    from `first_id`: the connection does not know them, so the sender never cancels them."""
    for i in range(count):
        await asyncio.wait_for(conn.link.send(Frame(kind, first_id + 2 * i, {"m": method, "t": 30.0},
                                                    body=body)), 10)
