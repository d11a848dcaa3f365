"""An expert server is shared by every caller, so one caller must not take the others' share
(issue 14: eight forward calls of a stranger evicted an honest caller's stashed forward graph, so
its backward call failed with StashMissing and had to resend its inputs). Now the stash is shared
fairly (a flood evicts the flooder's own graphs), and each caller has a rate (a token bucket per
peer id): past it a caller is told to slow down while the others are still served."""

from __future__ import annotations

import pytest
import torch

import potluck
from potluck.core.errors import RemoteError
from potluck.moe import ExpertServer
from potluck.moe import server as moe_server
from potluck.moe.server import METHOD_BACKWARD, METHOD_FORWARD

HIDDEN = 8
UID = "ffn.0.0"


@pytest.fixture
def scene():
    """A server peer, an attacker and an honest caller, on 127.0.0.1."""
    server_peer = potluck.Peer(host="127.0.0.1")
    attacker = potluck.Peer(initial_peers=server_peer.addresses, host="127.0.0.1")
    honest = potluck.Peer(initial_peers=server_peer.addresses, host="127.0.0.1")
    yield server_peer, attacker, honest
    for peer in (honest, attacker, server_peer):
        peer.shutdown()


def forward(peer, server_id, call: int, x: torch.Tensor) -> dict:
    return peer.call(server_id, METHOD_FORWARD, {"uid": UID, "call": call, "inputs": [x]}, timeout=10)


@pytest.mark.timeout(60)
def test_a_flood_of_forward_calls_does_not_evict_an_honest_callers_stashed_graph(scene):
    server_peer, attacker, honest = scene
    with ExpertServer.from_type(server_peer, [UID], "ffn", HIDDEN, lambda p: torch.optim.SGD(p, lr=0.1)) as server:
        hosted, server_id = server.experts[UID], server_peer.transport.peer_id
        x = torch.randn(4, HIDDEN)
        assert forward(honest, server_id, 1, x)["kept"]  # the honest caller's graph is stashed ...
        for call in range(2 * hosted.stash_calls):  # ... and a stranger sends twice the stash's worth
            forward(attacker, server_id, 100 + call, torch.randn(4, HIDDEN))
        assert len(hosted._stash) <= hosted.stash_calls  # still bounded
        # The honest backward call sends no inputs: it needs its stashed graph (before: StashMissing).
        grads = torch.randn(4, HIDDEN)
        x_local = x.clone().requires_grad_()
        hosted.module(x_local).backward(grads)
        reply = honest.call(server_id, METHOD_BACKWARD, {"uid": UID, "call": 1, "grads": [grads]}, timeout=10)
        torch.testing.assert_close(reply["grads"][0], x_local.grad)
        assert hosted.stats.stash_hits == 1 and hosted.stats.recomputes == 0 and hosted.stats.updates == 1


@pytest.mark.timeout(60)
def test_a_caller_over_its_rate_is_told_to_slow_down_while_another_is_served(scene, monkeypatch):
    server_peer, attacker, honest = scene
    # A tiny bucket, so the test needs no clock: 3 calls, then one every 1,000 s.
    monkeypatch.setattr(moe_server, "CALLER_BURST", 3, raising=False)
    monkeypatch.setattr(moe_server, "CALLER_CALLS_PER_SECOND", 1e-3, raising=False)
    with ExpertServer.from_type(server_peer, [UID], "ffn", HIDDEN, lambda p: torch.optim.SGD(p, lr=0.1)) as server:
        hosted, server_id = server.experts[UID], server_peer.transport.peer_id
        x = torch.randn(2, HIDDEN)
        for call in range(3):
            forward(attacker, server_id, call, x)
        with pytest.raises(RemoteError, match="slow down") as info:
            forward(attacker, server_id, 3, x)
        assert info.value.remote_type == "CallerRateLimited"
        assert f"peer {attacker.transport.peer_id} is over its share" in str(info.value)
        assert hosted.stats.forward_calls == 3  # the refused call cost nothing but the refusal
        reply = forward(honest, server_id, 1, x)  # another caller has its own bucket
        torch.testing.assert_close(reply["outputs"][0], hosted.module(x))
        # The client side raises the same kind of error (an ExpertError), not a generic one.
        from potluck.moe import RemoteExpert
        from potluck.moe.server import CallerRateLimited
        with pytest.raises(CallerRateLimited, match="slow down"):
            RemoteExpert(attacker, UID)(x)


def test_the_stash_is_shared_fairly_and_the_rate_table_is_bounded():
    """The two structures on their own: the shares the stash keeps when full, and that the
    buckets of many identities do not grow the table past its cap."""
    from potluck.moe.server import _CallerBuckets, _Stash, _Stashed

    stash = _Stash(6)
    graph = _Stashed(0, float("inf"), [], ())  # never expires in this test
    for caller, calls in (("a", 1), ("b", 2), ("c", 10)):
        for call in range(calls):
            stash.put((caller, call), graph)
    assert (stash.held("a"), stash.held("b"), stash.held("c")) == (1, 2, 3)  # c flooded: it lost its own
    assert ("c", 9) in stash._entries and ("c", 6) not in stash._entries  # its newest graphs stay
    for caller in "defghij":  # more callers than places: a newcomer at its share gives its graph up
        stash.put((caller, 0), graph)
    assert stash.held("a") == 1 and len(stash) == 6

    buckets = _CallerBuckets(rate=1.0, burst=2, max_callers=16)
    assert [buckets.take("x", 0.0) for _ in range(3)] == [0.0, 0.0, 1.0]  # the third waits a second
    assert buckets.take("x", 1.0) == 0.0  # refilled
    for n in range(1000):
        buckets.take(f"id{n}", 2.0)
    assert len(buckets) == 16
