"""Issue 29, the reachability check (`net.reachability`) against made-up identities, on the emulated
network and the virtual clock: a dial whose far end does not answer frees its server's slot within
`DIALBACK_ANSWER_TIMEOUT` (not the whole `DIALBACK_TIMEOUT`), and made-up servers of one host that
lie ("not reached") are one voice: a check asks across origins, and one subnet's word alone does
not make a peer believe it is private while a server elsewhere could not answer (before, the
first three servers asked were all the liars, and their answer made the peer private). The
attack on the dial-back slots themselves: `test_dialback_origin_shares`."""

from __future__ import annotations

import asyncio

import pytest

from potluck.core.virtual_time import run_virtual
from potluck.net.emulated import EmulatedNetwork
from potluck.net.origins import origin_of
from potluck.net.reachability import (
    DIALBACK,
    DIALBACK_ANSWER_TIMEOUT,
    DIALBACK_TIMEOUT,
    DialbackBusy,
    DialbackReply,
    DialbackService,
    check_reachability,
)


def test_a_dial_back_whose_far_end_does_not_answer_frees_its_slot_within_the_answer_bound():
    """Virtual clock: the caller is 3 s away (its dial-back's answer would take 6 s): the server
    gives up on it DIALBACK_ANSWER_TIMEOUT after dialing, not DIALBACK_TIMEOUT."""
    async def scenario():
        network = EmulatedNetwork()
        server, caller = network.transport(), network.transport()
        for t in (server, caller):
            await t.start()
        service = DialbackService(server)
        service.start()
        network.set_latency(server.peer_id, caller.peer_id, 3.0)
        await caller.connect(server.addresses[0])
        loop = asyncio.get_running_loop()
        asked = loop.time()
        call = asyncio.ensure_future(caller.call(server.peer_id, DIALBACK, {"addrs": [
            str(caller.addresses[0].without_peer_id())]}, timeout=30))
        await asyncio.sleep(3.0 + 1.0)  # the request arrived a second ago: its slot is held
        assert service.in_progress == 1
        await asyncio.sleep(DIALBACK_ANSWER_TIMEOUT)
        assert service.in_progress == 0 and loop.time() - asked - 3.0 < DIALBACK_TIMEOUT
        assert (await call)["reached"] == []
    run_virtual(scenario())


async def lying(request, ctx):
    """A server that never dials and says so: "you are not reachable"."""
    return DialbackReply((), str(ctx.remote.observed)).to_wire()


async def busy(request, ctx):
    raise DialbackBusy("too many dial-backs in progress; ask another peer")


@pytest.mark.parametrize("honest_server", ["answers", "busy"])
def test_made_up_servers_of_one_host_cannot_make_a_peer_believe_it_is_private(honest_server):
    """A peer checks its reachability with three made-up servers of one host (liars: "not reached")
    and one honest server elsewhere, in that order: it asks across origins, so the honest server is
    asked. If it answers, the peer is public; if it is busy, one subnet's word is not enough for
    "private": unknown (the peer keeps what it assumed and checks again soon)."""
    async def scenario():
        network = EmulatedNetwork(latency=0.01)
        me, honest = network.transport(), network.transport()
        liars = [network.transport() for _ in range(3)]
        for n, liar in enumerate(liars):
            liar.origin = origin_of(f"198.51.100.{n + 1}")
            liar.add_handler(DIALBACK, lying)
        if honest_server == "answers":
            DialbackService(honest).start()
        else:
            honest.add_handler(DIALBACK, busy)
        for t in (me, honest, *liars):
            await t.start()
        for server in (*liars, honest):
            await me.connect(server.addresses[0])
        report = await check_reachability(me, [liar.peer_id for liar in liars] + [honest.peer_id])
        assert honest.peer_id in report.asked
        assert report.verdict == ("public" if honest_server == "answers" else "unknown"), report
    run_virtual(scenario())
