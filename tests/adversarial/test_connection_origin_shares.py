"""Issue 29: a peer's connection caps were per IP address (and per peer id), so one party holding a
few addresses of one subnet took every slot: three addresses of a /24 take all 768 accepted
connections, two all 128 handshakes in progress, and honest peers elsewhere are refused.

Accepted connections and handshakes in progress are now capped per subnet as well
(`net.tcp.MAX_CONNECTIONS_PER_SUBNET`, `MAX_PENDING_HANDSHAKES_PER_SUBNET`: half of each). Here one
attacking subnet (127.0.0.1 to 127.0.0.4: every 127.x.y.z address is this machine) opens
connections under 1,000 made-up ids (each proving its id), or 1,000 connections that never start
TLS, while an honest peer on another /24 (127.0.1.1) connects and calls. The caps are scaled down
and set on the instance (the code before them ignores what it does not know), and the attacker's
connections leave from chosen addresses by hand, so the same test runs (and fails) against the
code from before."""

from __future__ import annotations

import asyncio

import pytest

from potluck.core.errors import NetworkError
from potluck.net import Identity, TCPTransport, tcp
from tests.adversarial.scene import echo, running

MADE_UP_IDS = 1000
ATTACKER_HOSTS = [f"127.0.0.{i}" for i in range(1, 5)]
HONEST_HOST = "127.0.1.1"
ROUND_TRIP_BOUND = 5.0
AT_ONCE = 50


async def dial_from(attacker: TCPTransport, address, source: str):
    """A potluck connection (TLS, HELLO, AUTH) to `address` that leaves from `source`."""
    link = tcp.TCPLink(attacker, initiator=True)
    await asyncio.get_running_loop().create_connection(lambda: link, address.host, address.port,
                                                       local_addr=(source, 0), **attacker._tls_client())
    return await link.authenticated(str(address))


@pytest.mark.timeout(120)
def test_made_up_ids_from_one_subnet_take_its_share_of_connections_and_an_honest_peer_connects(arun):
    async def main():
        server = TCPTransport(Identity.generate(), host="127.0.0.1")
        server.max_connections = 48
        server.max_connections_per_ip = 16
        server.max_connections_per_subnet = 24
        server.add_handler("echo", echo)
        honest = TCPTransport(Identity.generate(), host=HONEST_HOST)
        fakes = [TCPTransport(Identity.generate(), client_mode=True) for _ in range(MADE_UP_IDS)]
        async with running(server, honest):
            address = server.addresses[0]
            held = []

            async def attack(n: int) -> None:
                try:
                    held.append(await asyncio.wait_for(dial_from(fakes[n], address, ATTACKER_HOSTS[n % 4]), 10))
                except (NetworkError, OSError, TimeoutError):
                    pass

            try:
                for start in range(0, MADE_UP_IDS, AT_ONCE):
                    await asyncio.gather(*(attack(n) for n in range(start, start + AT_ONCE)))
                sid = await honest.connect(address, timeout=ROUND_TRIP_BOUND)
                assert await honest.call(sid, "echo", "hi", timeout=ROUND_TRIP_BOUND) == "hi"
                assert len(held) == server.max_connections_per_subnet, f"one subnet holds {len(held)} connections"
                assert await held[0].call("echo", 1, timeout=ROUND_TRIP_BOUND) == 1  # the accepted ones work
            finally:
                for fake in fakes:
                    await fake.close()

    arun(main(), timeout=110)


@pytest.mark.timeout(120)
def test_stalled_handshakes_from_one_subnet_take_its_share_and_an_honest_peer_connects(arun, monkeypatch):
    monkeypatch.setattr(tcp, "HANDSHAKE_TIMEOUT", 60.0)  # the stalled ones are held for the whole test

    async def main():
        server = TCPTransport(Identity.generate(), host="127.0.0.1")
        server.max_pending_handshakes = 32
        server.max_pending_handshakes_per_ip = 16
        server.max_pending_handshakes_per_subnet = 16
        server.add_handler("echo", echo)
        honest = TCPTransport(Identity.generate(), host=HONEST_HOST)
        async with running(server, honest) as writers:
            address = server.addresses[0]

            async def stall(n: int) -> None:
                try:
                    _, writer = await asyncio.open_connection(address.host, address.port,
                                                              local_addr=(ATTACKER_HOSTS[n % 4], 0))
                    writers.append(writer)
                except OSError:
                    pass

            for start in range(0, MADE_UP_IDS, AT_ONCE):
                await asyncio.gather(*(stall(n) for n in range(start, start + AT_ONCE)))
            await asyncio.sleep(0.5)  # the refused ones are closed; the held ones wait for TLS
            sid = await honest.connect(address, timeout=ROUND_TRIP_BOUND)
            assert await honest.call(sid, "echo", "hi", timeout=ROUND_TRIP_BOUND) == "hi"
            assert server.pending_handshakes == server.max_pending_handshakes_per_subnet

    arun(main(), timeout=110)
