"""An expert server's weights are shared by every caller: one caller's NaN or infinite gradients
or inputs must not reach them. Such requests are refused at parse time with an error naming the
field, and the server keeps serving honest callers with unchanged weights."""

from __future__ import annotations

import pytest
import torch

import potluck
from potluck.core.errors import RemoteError
from potluck.moe import ExpertServer, RemoteExpert
from potluck.moe.server import METHOD_BACKWARD, METHOD_FORWARD

HIDDEN = 8
UID = "ffn.0.0"


@pytest.mark.timeout(60)
def test_non_finite_gradients_and_inputs_are_refused_and_the_weights_stay_finite():
    server_peer = potluck.Peer(host="127.0.0.1")
    attacker = potluck.Peer(initial_peers=server_peer.addresses, host="127.0.0.1")
    honest = potluck.Peer(initial_peers=server_peer.addresses, host="127.0.0.1")
    try:
        with ExpertServer.from_type(server_peer, [UID], "ffn", HIDDEN, lambda p: torch.optim.SGD(p, lr=0.1)) as server:
            hosted = server.experts[UID]
            before = {n: p.detach().clone() for n, p in hosted.module.state_dict().items()}
            peer_id = server_peer.transport.peer_id
            x = torch.randn(4, HIDDEN)
            nan = torch.full((4, HIDDEN), float("nan"))
            inf = torch.full((4, HIDDEN), float("inf"))
            # A forward call the attacker means to follow with poisoned gradients (its graph is stashed).
            attacker.call(peer_id, METHOD_FORWARD, {"uid": UID, "call": 1, "inputs": [x]}, timeout=10)
            attacks = [
                (METHOD_BACKWARD, {"uid": UID, "call": 1, "grads": [nan]}, "'grads'[0] has non-finite"),
                (METHOD_BACKWARD, {"uid": UID, "call": 2, "grads": [x], "inputs": [inf]}, "'inputs'[0] has non-finite"),
                (METHOD_BACKWARD, {"uid": UID, "call": 3, "grads": [-inf], "inputs": [x]}, "'grads'[0] has non-finite"),
                (METHOD_FORWARD, {"uid": UID, "call": 4, "inputs": [nan]}, "'inputs'[0] has non-finite"),
            ]
            for method, request, error in attacks:
                with pytest.raises(RemoteError, match=error.replace("[", r"\[").replace("]", r"\]")) as info:
                    attacker.call(peer_id, method, request, timeout=10)
                assert info.value.remote_type == "BadExpertRequest"
            assert hosted.stats.rejected == len(attacks) and hosted.stats.updates == 0
            # Finite but huge gradients overflow inside the backward pass: that step is skipped too.
            huge = torch.full((4, HIDDEN), 3e38)
            attacker.call(peer_id, METHOD_BACKWARD, {"uid": UID, "call": 5, "grads": [huge], "inputs": [x * 1e30]},
                          timeout=10)
            assert hosted.stats.skipped_updates == 1 and hosted.stats.updates == 0
            for name, tensor in hosted.module.state_dict().items():
                assert torch.equal(tensor, before[name]), name  # nothing reached the weights
            remote = RemoteExpert(honest, UID)  # an honest caller is served and trains the expert as usual
            y = remote(x)
            torch.testing.assert_close(y, hosted.module(x))
            y.sum().backward()
            assert hosted.stats.updates == 1
            assert all(bool(torch.isfinite(p).all()) for p in hosted.module.parameters())
    finally:
        for peer in (honest, attacker, server_peer):
            peer.shutdown()
