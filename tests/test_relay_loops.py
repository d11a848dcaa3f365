"""Relayed TCP connections on both event loops potluck runs on: peers use uvloop when it is
installed (`potluck.core.runner`), whose `start_tls` refuses transports that are not its own,
such as the relayed byte pipe (`net.relay.StreamPipe`)."""

from __future__ import annotations

import pytest

from potluck.net.relay import RelayService
from tests.conftest import LOOP_KINDS
from tests.test_relay import PROMPT, fetch, reserved_on, serving, tcp_peers


@pytest.mark.parametrize("kind", LOOP_KINDS)
def test_tcp_relayed_tls_calls_and_streams_on_each_loop(arun, kind: str) -> None:
    async def main() -> None:
        async with tcp_peers(3) as (relay, target, dialer):
            RelayService(relay).start()
            serving(target)
            dialer.add_addresses(target.peer_id, await reserved_on(target, relay))
            reply = await dialer.call(target.peer_id, "echo", "hello", timeout=PROMPT)
            chunks = await fetch(dialer, target.peer_id, 2, 2**16)
            assert reply == {"echo": "hello", "relayed": True}
            assert chunks == [bytes([i]) * 2**16 for i in range(2)]

    arun(main(), timeout=30, kind=kind)
