"""Issue 29: an expert server's stash of forward graphs was shared per caller id: when full, the
caller holding the most graphs lost one, the newcomer itself on a tie. Eight made-up ids with one
graph each therefore kept every new caller's graph out (its forward call came back `kept: False`,
so its backward call had to resend its inputs and be recomputed).

The stash is now shared per subnet first (`moe.server._Stash`): made-up ids of one host share that
host's place. Here one attacking host (127.0.0.1) makes forward calls under 1,000 made-up ids, one
each, before and after an honest caller on another /24 (127.0.1.1) makes its own: the honest graph
is kept, and its backward call uses it. Real TCP on the loopback interface (the caller's origin is
the address its connection comes from)."""

from __future__ import annotations

import asyncio

import pytest
import torch

import potluck
from potluck.moe import ExpertServer
from potluck.moe.server import METHOD_BACKWARD, METHOD_FORWARD
from potluck.net import Identity, TCPTransport

HIDDEN = 8
UID = "ffn.0.0"
MADE_UP_IDS = 1000
AT_ONCE = 25  # made-up callers connected at once


async def made_up_forwards(server_address, server_id, ids: list[Identity]) -> int:
    """A forward call from each of `ids` (client transports dialing from 127.0.0.1), one call at a
    time (calls that arrive together are batched, and a batch stashes nothing); how many were kept."""
    kept = 0
    for start in range(0, len(ids), AT_ONCE):
        fakes = [TCPTransport(identity, client_mode=True) for identity in ids[start:start + AT_ONCE]]
        try:
            await asyncio.gather(*(fake.connect(server_address, timeout=10) for fake in fakes))
            for fake in fakes:
                reply = await fake.call(server_id, METHOD_FORWARD,
                                        {"uid": UID, "call": 1, "inputs": [torch.randn(2, HIDDEN)]}, timeout=10)
                kept += bool(reply["kept"])
        finally:
            await asyncio.gather(*(fake.close() for fake in fakes))
    return kept


@pytest.mark.timeout(180)
def test_a_thousand_made_up_callers_of_one_host_do_not_keep_an_honest_callers_graph_out():
    server_peer = potluck.Peer(host="127.0.0.1")
    honest = potluck.Peer(initial_peers=server_peer.addresses, host="127.0.1.1")
    ids = [Identity.generate() for _ in range(MADE_UP_IDS)]
    try:
        with ExpertServer.from_type(server_peer, [UID], "ffn", HIDDEN, lambda p: torch.optim.SGD(p, lr=0.1)) as server:
            hosted, server_id = server.experts[UID], server_peer.transport.peer_id
            address = server_peer.transport.addresses[0]
            half = MADE_UP_IDS // 2
            server_peer.run(made_up_forwards(address, server_id, ids[:half]))
            assert len(hosted._stash) == hosted.stash_calls  # full of the attacker's graphs
            x = torch.randn(4, HIDDEN)
            reply = honest.call(server_id, METHOD_FORWARD, {"uid": UID, "call": 7, "inputs": [x]}, timeout=10)
            assert reply["kept"], "the honest caller's graph was refused a place in the stash"
            server_peer.run(made_up_forwards(address, server_id, ids[half:]))
            # The honest backward call sends no inputs: it needs its stashed graph.
            grads = torch.randn(4, HIDDEN)
            x_local = x.clone().requires_grad_()
            hosted.module(x_local).backward(grads)
            reply = honest.call(server_id, METHOD_BACKWARD, {"uid": UID, "call": 7, "grads": [grads]}, timeout=10)
            torch.testing.assert_close(reply["grads"][0], x_local.grad)
            assert hosted.stats.stash_hits == 1 and hosted.stats.recomputes == 0
            assert len(hosted._stash) <= hosted.stash_calls
    finally:
        honest.shutdown()
        server_peer.shutdown()
