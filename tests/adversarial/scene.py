"""The stage most transport attacks play on: a TLS server, an attacker and an honest peer, both
already connected to it over 127.0.0.1; everything closed afterwards."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

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
