"""Issue 29: hole punching on demand. Once a victim shares a relayed connection with an attacker, the
attacker can open punch after punch on it; serving each, the victim dials an address of the
attacker's choice (a third party's) 3 times, because only the punches a peer starts counted
towards its backoff (`HolePuncher._serve`): 192 punches served in 40 s, 576 connections to a third
party. With made-up ids, each with a relayed connection of its own, there was no bound at all.

Now a punch a peer serves that fails counts towards the same backoff as one it starts, with that
peer and with the subnets it dialed (`net.holepunch`), and at most two punches dial one subnet at a
time. Here 1,000 made-up ids of one attacking host each share a relayed connection with the victim
and open punches that point it at one third party, while an honest peer from elsewhere punches a
direct connection with the victim. Emulated network, virtual clock; a relayed connection is an
ordinary one marked relayed on both ends (the protocol runs over it as over one through a relay).
The made-up ids' origin is set on the transports after they are built, so the same test runs (and
fails) against the code from before origins existed."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import pytest

from potluck.core.errors import NetworkError
from potluck.core.virtual_time import run_virtual
from potluck.net.connection import Connection
from potluck.net.emulated import EmulatedNetwork, EmulatedTransport
from potluck.net.holepunch import MAX_ATTEMPTS, PUNCH_METHOD, Connect, Sync
from potluck.net.origins import origin_of

MADE_UP_IDS = 1000
AT_ONCE = 50  # made-up ids punching at once
PUNCHES_PER_ID = 3  # punches each made-up id opens (served or refused)
# What the victim may dial at the third party: two punches (MAX_PUNCHES_PER_TARGET_SUBNET) of
# MAX_ATTEMPTS tries each, before the third party's subnet backs off.
DIAL_BOUND = 2 * MAX_ATTEMPTS


async def echo(request: Any, ctx: Any) -> Any:
    return request


async def relayed_pair(dialer: EmulatedTransport, acceptor: EmulatedTransport) -> tuple[Connection, Connection]:
    """A connection from `dialer` to `acceptor`, both ends marked relayed: (dialer's end, acceptor's end)."""
    await dialer.connect(acceptor.addresses[0])
    ends = dialer._shared[acceptor.peer_id][0], acceptor._shared[dialer.peer_id][0]
    for end in ends:
        end.remote = dataclasses.replace(end.remote, relayed=True)
    return ends


async def punch_at(conn: Connection, aimed: Any) -> bool:
    """The attacker's side of one punch over `conn`, every try's CONNECT naming `aimed`; whether
    the victim served it (False: refused at once)."""
    stream = await conn.open_stream(PUNCH_METHOD, None, timeout=60)
    try:
        for _ in range(MAX_ATTEMPTS):
            await stream.send(Connect((aimed,)).to_wire())
            Connect.from_wire(await stream.recv(10))
            await stream.send(Sync().to_wire())
        await stream.close()
        return True
    except NetworkError:
        stream.abort("refused")
        return False


@pytest.mark.timeout(300)
def test_made_up_ids_cannot_make_a_victim_dial_a_third_party_punch_after_punch():
    async def main():
        net = EmulatedNetwork(latency=0.01)
        victim, bystander, honest = net.transport(), net.transport(), net.transport(nat="eim")
        for t in (victim, bystander, honest):
            t.puncher.auto = False
            t.add_handler("echo", echo)
            await t.start()
        aimed = bystander.addresses[0].without_peer_id()
        dials: list[Any] = []
        dial = victim.dial

        async def counted(address, expected, bulk, *more):
            if address.host == aimed.host:
                dials.append(expected)
            return await dial(address, expected, bulk, *more)
        victim.dial = counted
        served = refused = 0

        async def made_up(n: int) -> None:
            nonlocal served, refused
            fake = net.transport(keepalive_interval=None)
            fake.origin = origin_of(f"198.51.100.{1 + n % 50}")
            fake.puncher.auto = False
            await fake.start()
            _, theirs = await relayed_pair(victim, fake)  # the victim dialed it (through a relay)
            for _ in range(PUNCHES_PER_ID):
                if await punch_at(theirs, aimed):
                    served += 1
                else:
                    refused += 1
                    await asyncio.sleep(1.0)
            await fake.close()

        async def honest_punch() -> Connection:
            await asyncio.sleep(5.0)  # the attack is in full swing
            _, at_victim = await relayed_pair(honest, victim)  # the victim accepted it: it punches
            return await victim.puncher.punch(at_victim)

        punched = asyncio.ensure_future(honest_punch())
        for start in range(0, MADE_UP_IDS, AT_ONCE):
            await asyncio.gather(*(made_up(n) for n in range(start, start + AT_ONCE)))
        direct = await punched
        assert not direct.relayed and await direct.call("echo", 1, timeout=5) == 1
        assert victim.is_connected_directly(honest.peer_id)
        assert len(dials) <= DIAL_BOUND, (f"made-up ids made the victim dial a third party {len(dials)} times "
                                          f"({served} punches served, {refused} refused)")
        assert served + refused == MADE_UP_IDS * PUNCHES_PER_ID

    run_virtual(main())
