"""`potluck.moe` on real peers over 127.0.0.1: remote experts, batching, bad input, checkpoints, layers."""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import threading
import time
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import potluck
from potluck.cli.expert_server import resumed_line
from potluck.core.errors import MalformedMessage, RemoteError
from potluck.core.virtual_time import run_virtual
from potluck.moe import (
    BadExpertRequest,
    ExpertNotFound,
    ExpertServer,
    NotEnoughExperts,
    RemoteExpert,
    RemoteMixtureOfExperts,
    RemoteSwitchMixtureOfExperts,
    TensorSchema,
    make_expert,
)
from potluck.moe.grid import ExpertLocation, announce_experts, parse_cell
from potluck.moe.messages import BackwardReply, BackwardRequest, ForwardReply, ForwardRequest
from potluck.moe.server import METHOD_BACKWARD, METHOD_FORWARD
from tests.emulated_swarm import make_swarm

HIDDEN = 8


def wait_until(predicate, timeout: float = 20.0) -> None:
    """Wait for a condition with a deadline (checks often; fails the test if it never holds)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached before the deadline"
        time.sleep(0.01)


@pytest.fixture
def peers():
    started = []

    def start(n: int = 2) -> list[potluck.Peer]:
        first = started[0] if started else None
        for _ in range(n):
            initial = first.addresses if first else []
            peer = potluck.Peer(initial_peers=initial, host="127.0.0.1")
            first = first or peer
            started.append(peer)
        return started[-n:]
    yield start
    for peer in reversed(started):
        peer.shutdown()


def grid_server(peer, uids, **kwargs) -> ExpertServer:
    return ExpertServer.from_type(peer, uids, "ffn", HIDDEN, **kwargs)


@pytest.mark.timeout(60)
def test_remote_expert_forward_backward_and_update_equal_a_local_copy(peers):
    server_peer, client = peers(2)
    torch.manual_seed(1)
    module, schema = make_expert("ffn", HIDDEN)
    local = make_expert("ffn", HIDDEN)[0]
    local.load_state_dict(module.state_dict())
    local_opt = torch.optim.SGD(local.parameters(), lr=0.1)
    with ExpertServer(server_peer, {"ffn.0.0": module}, lambda p: torch.optim.SGD(p, lr=0.1), input_schema=schema):
        remote = RemoteExpert(client, "ffn.0.0")
        for step in range(4):  # each step also checks that the server applied the same update
            x = torch.randn(5, HIDDEN, requires_grad=step % 2 == 0)  # odd steps: no input gradient wanted
            x_local = x.detach().clone().requires_grad_(x.requires_grad)
            target = torch.randn(5, HIDDEN)
            loss = ((remote(x) - target) ** 2).sum()
            loss_local = ((local(x_local) - target) ** 2).sum()
            torch.testing.assert_close(loss, loss_local)
            loss.backward()
            loss_local.backward()
            local_opt.step()
            local_opt.zero_grad()
            if x.requires_grad:
                torch.testing.assert_close(x.grad, x_local.grad)
        for p, q in zip(module.parameters(), local.parameters(), strict=True):
            torch.testing.assert_close(p.detach(), q.detach())
        info = remote.info()
        assert info.inputs == info.outputs == (TensorSchema((HIDDEN,)),) and info.updates == 4


@pytest.mark.timeout(60)
def test_backward_recomputes_when_the_forward_graph_was_evicted(peers):
    server_peer, client = peers(2)
    torch.manual_seed(2)
    module, schema = make_expert("ffn", HIDDEN)
    with ExpertServer(server_peer, {"ffn.0.0": module}, input_schema=schema, stash_calls=0) as server:
        x = torch.randn(4, HIDDEN, requires_grad=True)
        RemoteExpert(client, "ffn.0.0")(x).pow(2).sum().backward()
        x_local = x.detach().clone().requires_grad_()
        module(x_local).pow(2).sum().backward()
        torch.testing.assert_close(x.grad, x_local.grad)
        stats = server.stats["ffn.0.0"]
        assert stats.recomputes == 1 and stats.stash_hits == 0


class GatedExpert(nn.Module):
    """Blocks its first forward call until released, so the calls arriving meanwhile queue up."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(HIDDEN, HIDDEN)
        self.entered = threading.Event()
        self.release = threading.Event()

    def forward(self, x):
        if x.shape[0] != 2 and not self.entered.is_set():  # the schema probe uses 2 rows
            self.entered.set()
            assert self.release.wait(30)
        return self.linear(x)


@pytest.mark.timeout(60)
def test_concurrent_clients_are_batched_together_server_side(peers):
    server_peer, *clients = peers(5)
    expert = GatedExpert()
    with ExpertServer(server_peer, {"gated.0": expert}, input_schema=(TensorSchema((HIDDEN,)),)) as server:
        remotes = [RemoteExpert(c, "gated.0") for c in clients]
        inputs = [torch.randn(3, HIDDEN, requires_grad=True) for _ in clients]
        with concurrent.futures.ThreadPoolExecutor(len(clients)) as pool:
            first = pool.submit(remotes[0], inputs[0])
            assert expert.entered.wait(20)
            rest = [pool.submit(r, x) for r, x in zip(remotes[1:], inputs[1:], strict=True)]
            queue = server._queues[("gated.0", "forward")]
            wait_until(lambda: len(queue) == len(rest))
            expert.release.set()
            outputs = [first.result(30)] + [f.result(30) for f in rest]
        for x, y in zip(inputs, outputs, strict=True):
            torch.testing.assert_close(y, expert.linear(x))
            y.pow(2).sum().backward()
            x_local = x.detach().clone().requires_grad_()
            expert.linear(x_local).pow(2).sum().backward()
            torch.testing.assert_close(x.grad, x_local.grad)
        stats = server.stats["gated.0"]
        assert stats.max_calls_per_batch == len(rest) > 1
        assert stats.forward_batches == 2 and stats.forward_calls == len(clients)
        assert stats.stash_hits == 1 and stats.recomputes == len(rest)  # batched calls keep no graph


@pytest.mark.timeout(60)
def test_bad_requests_get_clear_errors_and_the_server_keeps_serving(peers):
    server_peer, client = peers(2)
    with grid_server(server_peer, ["ffn.0.0"], max_batch_size=16) as server:
        remote = RemoteExpert(client, "ffn.0.0")
        with pytest.raises(BadExpertRequest, match=r"shape \[4, 5\]; expected float32\[batch, 8\]") as info:
            remote(torch.randn(4, 5))
        assert info.value.field.startswith("'inputs'[0]") and info.value.uid == "ffn.0.0"
        assert isinstance(info.value, MalformedMessage)  # catchable by kind, with every protocol's refusals
        with pytest.raises(BadExpertRequest, match="dtype float64"):
            remote(torch.randn(4, HIDDEN, dtype=torch.float64))
        with pytest.raises(BadExpertRequest, match="17 rows; this server takes 1 to 16"):
            remote(torch.randn(17, HIDDEN))
        with pytest.raises(BadExpertRequest, match=r"'inputs' must hold 1 tensor\(s\)"):
            remote(torch.randn(4, HIDDEN), torch.randn(4, HIDDEN))
        location = remote.location
        with pytest.raises(ExpertNotFound, match="'ffn.9.9' is not served"):
            RemoteExpert(client, "ffn.9.9", location=ExpertLocation("ffn.9.9", location.peer_id))(torch.randn(1, HIDDEN))
        with pytest.raises(ExpertNotFound, match="no live server"):
            RemoteExpert(client, "ffn.7.7")(torch.randn(1, HIDDEN))
        with pytest.raises(RemoteError, match="malformed forward request: not a map"):
            client.call(location.peer_id, METHOD_FORWARD, [1, 2, 3], timeout=10)
        with pytest.raises(RemoteError, match=r"'inputs'\[0\] must be a tensor") as info:
            client.call(location.peer_id, METHOD_FORWARD, {"uid": "ffn.0.0", "call": 1, "inputs": ["x"]}, timeout=10)
        assert info.value.remote_type == "BadExpertRequest"
        assert server.stats["ffn.0.0"].rejected == 5
        x = torch.randn(16, HIDDEN)  # the server still answers correct calls
        torch.testing.assert_close(remote(x), server.experts["ffn.0.0"].module(x))


@pytest.mark.timeout(60)
def test_a_restarted_server_resumes_its_experts_from_checkpoints(peers, tmp_path):
    server_peer, client = peers(2)
    adam = lambda p: torch.optim.Adam(p, lr=0.01)  # noqa: E731
    uids = ["ffn.0.0", "ffn.0.1"]
    server = grid_server(server_peer, uids, optimizer=adam, checkpoint_dir=tmp_path)
    assert server.resumed == {}
    assert resumed_line(server.resumed, 2, "d") == "no checkpoints in d: every expert starts from its initial weights"
    fresh = {n: p.clone() for n, p in server.experts["ffn.0.1"].module.state_dict().items()}
    remote = RemoteExpert(client, "ffn.0.1")
    for _ in range(3):
        remote(torch.randn(4, HIDDEN)).sum().backward()
    trained = {n: p.clone() for n, p in server.experts["ffn.0.1"].module.state_dict().items()}
    assert not torch.equal(trained["up.weight"], fresh["up.weight"])
    server.shutdown()  # writes the last checkpoint
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ffn.0.0.ckpt", "ffn.0.1.ckpt"]
    with grid_server(server_peer, uids, optimizer=adam, checkpoint_dir=tmp_path) as restarted:
        hosted = restarted.experts["ffn.0.1"]
        assert restarted.resumed == {"ffn.0.0": 0, "ffn.0.1": 3}  # what the restarted server says it loaded
        assert resumed_line(restarted.resumed, 2, "d") == "resumed from d: ffn.0.0 (0 updates), ffn.0.1 (3 updates)"
        for name, tensor in hosted.module.state_dict().items():
            torch.testing.assert_close(tensor, trained[name])
        assert hosted.stats.updates == 3
        assert hosted.optimizer.state_dict()["state"][0]["step"] == 3  # Adam's moments came back too
        remote(torch.randn(4, HIDDEN)).sum().backward()  # and it keeps training
        assert hosted.stats.updates == 4


def _mixture_setup(peers, grid=(2, 3)):
    server_a, server_b, client = peers(3)
    uids = [f"ffn.{i}.{j}" for i in range(grid[0]) for j in range(grid[1])]
    a = grid_server(server_a, uids[: len(uids) // 2])
    b = grid_server(server_b, uids[len(uids) // 2:], seed=100)
    return a, b, client


def _grid_experts(*servers) -> dict[str, nn.Module]:
    """Local copies of every expert the servers host (the reference computes with these)."""
    return {uid: copy.deepcopy(hosted.module) for s in servers for uid, hosted in s.experts.items()}


def _grid_scores(gate: nn.Module, x: torch.Tensor, grid: tuple[int, int]) -> tuple[list[str], torch.Tensor]:
    """Every expert's uid and gating score: the sum of its coordinates' logits (product keys)."""
    rows, cols = gate(x).split(grid, dim=-1)
    uids = [f"ffn.{i}.{j}" for i in range(grid[0]) for j in range(grid[1])]
    scores = torch.stack([rows[:, i] + cols[:, j] for i in range(grid[0]) for j in range(grid[1])], dim=1)
    return uids, scores


def _mixture_reference(gate, experts, x, k, grid, answering=None):
    """Each sample's k best experts by score, softmax weights over those that answer, the weighted sum."""
    uids, scores = _grid_scores(gate, x, grid)
    top = scores.topk(k, dim=1).indices  # [B, k]
    chosen = [[uids[int(e)] for e in row] for row in top]
    answered = torch.tensor([[answering is None or u in answering for u in row] for row in chosen])
    weights = torch.softmax(scores.gather(1, top).masked_fill(~answered, float("-inf")), dim=1)
    outputs = torch.stack([experts[u](x) for u in uids], dim=1)  # [B, experts, H]
    picked = outputs.gather(1, top[:, :, None].expand(-1, -1, outputs.shape[-1]))
    return (weights[:, :, None] * picked).sum(1), chosen, answered


def _switch_reference(gate, experts, x, grid, answering):
    """Top-1 routing: the best expert's output times its gate probability (the product of each
    coordinate's softmax probability), zero where it does not answer; and the load-balancing
    loss sum_d size_d * sum_i (fraction of samples routed to coordinate i) * (mean probability of i)."""
    uids, scores = _grid_scores(gate, x, grid)
    probs = [torch.softmax(logits, dim=-1) for logits in gate(x).split(grid, dim=-1)]
    best = scores.argmax(1).tolist()
    coords = [(e // grid[1], e % grid[1]) for e in best]
    rows = []
    for b, (i, j) in enumerate(coords):
        uid = uids[best[b]]
        p = probs[0][b, i] * probs[1][b, j]
        rows.append(p * experts[uid](x[b:b + 1])[0] if uid in answering else torch.zeros(x.shape[1]))
    aux = x.new_zeros(())
    for d, size in enumerate(grid):
        fraction = torch.tensor([sum(c[d] == i for c in coords) / len(coords) for i in range(size)])
        aux = aux + size * (fraction * probs[d].mean(0)).sum()
    return torch.stack(rows), [[uids[e]] for e in best], aux


@pytest.mark.timeout(60)
def test_mixture_averages_k_best_experts_and_drops_a_dead_server(peers):
    grid = (2, 3)
    a, b, client = _mixture_setup(peers, grid)
    try:
        torch.manual_seed(3)
        experts = _grid_experts(a, b)
        # every expert's answer is expected, however loaded the machine: no grace period after k_min
        layer = RemoteMixtureOfExperts(client, HIDDEN, grid, "ffn", k_best=4, k_min=1, forward_timeout=10,
                                       timeout_after_k_min=None)
        x = torch.randn(6, HIDDEN, requires_grad=True)
        out = layer(x)
        out.pow(2).sum().backward()
        assert out.shape == (6, HIDDEN) and layer.last_answered == 4
        x_ref = x.detach().clone().requires_grad_()
        expected, chosen, _ = _mixture_reference(layer.gate, experts, x_ref, 4, grid)
        assert [set(u) for u in layer.last_uids] == [set(u) for u in chosen]  # the exact top 4 of 6
        torch.testing.assert_close(out, expected)
        grads = torch.autograd.grad(expected.pow(2).sum(), [x_ref, layer.gate.weight, layer.gate.bias])
        for got, want in zip([x.grad, layer.gate.weight.grad, layer.gate.bias.grad], grads, strict=True):
            torch.testing.assert_close(got, want)  # through the experts and through the gate
        b.peer.transport.remove_handler(METHOD_FORWARD)  # b's experts now fail: dropped, weights renormalized
        layer.directory.forget()
        out = layer(x.detach())
        expected, chosen, answered = _mixture_reference(layer.gate, experts, x.detach(), 4, grid, answering=a.experts)
        assert [set(u) for u in layer.last_uids] == [set(u) for u in chosen]  # b's are still asked
        assert 0 < layer.last_answered < 4 and layer.last_answered == answered.sum(1).float().mean().item()
        torch.testing.assert_close(out, expected)
        with pytest.raises(NotEnoughExperts, match="fewer than 4 expert answers"):
            RemoteMixtureOfExperts(client, HIDDEN, grid, "ffn", k_best=4, k_min=4)(x.detach())
        switch = RemoteSwitchMixtureOfExperts(client, HIDDEN, grid, "ffn")
        out, aux = switch(x.detach())
        expected, chosen, expected_aux = _switch_reference(switch.gate, experts, x.detach(), grid, a.experts)
        assert switch.last_uids == chosen
        assert {u for (u,) in chosen} & set(b.experts)  # the test needs both kinds
        assert {u for (u,) in chosen} & set(a.experts)
        torch.testing.assert_close(out, expected)  # gate-scaled; samples routed to b's (failing) experts get zeros
        assert all((out[row].abs().sum() == 0) == (uid in b.experts) for row, (uid,) in enumerate(chosen))
        torch.testing.assert_close(aux, expected_aux)
        aux.backward()
        want = torch.autograd.grad(expected_aux, [switch.gate.weight, switch.gate.bias])
        torch.testing.assert_close(switch.gate.weight.grad, want[0])
        torch.testing.assert_close(switch.gate.bias.grad, want[1])
        assert switch.gate.weight.grad.abs().sum() > 0
    finally:
        a.shutdown()
        b.shutdown()


@pytest.mark.timeout(60)
def test_a_late_expert_is_dropped_weights_renormalize_and_its_server_keeps_serving(peers):
    slow_peer, fast_peer, client = peers(3)
    gated = GatedExpert()
    torch.manual_seed(4)
    fast_module, schema = make_expert("ffn", HIDDEN)
    with ExpertServer(slow_peer, {"g.0.0": gated}, input_schema=schema) as slow, \
            ExpertServer(fast_peer, {"g.0.1": fast_module}, input_schema=schema):
        layer = RemoteMixtureOfExperts(client, HIDDEN, (1, 2), "g", k_best=2, k_min=1, forward_timeout=3.0)
        x = torch.randn(3, HIDDEN)
        out = layer(x)  # g.0.0 blocks past the deadline: only g.0.1 counts, with weight 1
        assert layer.last_answered == 1
        assert all(sorted(uids) == ["g.0.0", "g.0.1"] for uids in layer.last_uids)  # both were asked
        torch.testing.assert_close(out, fast_module(x))
        gated.release.set()
        remote = RemoteExpert(client, "g.0.0")  # the slow server got over it and serves again
        torch.testing.assert_close(remote(x), gated.linear(x))
        assert slow.stats["g.0.0"].forward_calls >= 1


def _scaling_expert(host, uid: str, scale: float, slow_forward: float = 0.0, slow_backward: float = 0.0) -> None:
    """A stand-in expert server on an emulated peer: output = scale * input (and so is the input
    gradient), after `slow_*` virtual seconds."""
    shapes = {uid: SimpleNamespace(input_schema=(TensorSchema((HIDDEN,)),), output_schema=(TensorSchema((HIDDEN,)),))}

    async def forward(msg, ctx):
        request = ForwardRequest.from_wire(msg, experts=shapes, max_rows=64)
        await asyncio.sleep(slow_forward)
        return ForwardReply((request.inputs[0] * scale,), kept=True).to_wire()

    async def backward(msg, ctx):
        request = BackwardRequest.from_wire(msg, experts=shapes, max_rows=64)
        await asyncio.sleep(slow_backward)
        return BackwardReply((request.grads[0] * scale,)).to_wire()
    host.transport.add_handler(METHOD_FORWARD, forward)
    host.transport.add_handler(METHOD_BACKWARD, backward)


@pytest.mark.timeout(30)
def test_after_k_min_answers_a_slow_expert_gets_only_the_grace_period():
    """Virtual clock: three experts, one 30 s late in forward, another in backward. Once every
    sample has k_min answers the call waits timeout_after_k_min more, then goes on with the others."""
    slow, grace = 30.0, 1.0

    async def main():
        _, peers = await make_swarm(4)
        hosts, client = peers[:3], peers[3]
        _scaling_expert(hosts[0], "ffn.0.0", 1.0)
        _scaling_expert(hosts[1], "ffn.0.1", 2.0, slow_backward=slow)
        _scaling_expert(hosts[2], "ffn.0.2", 3.0, slow_forward=slow)
        for i, host in enumerate(hosts):  # each announces its own (records name their owner)
            location = ExpertLocation(f"ffn.0.{i}", host.transport.peer_id)
            assert await announce_experts(host.dht, [location], host.dht.get_time() + 600, timeout=10) > 0
        loop = asyncio.get_running_loop()
        x, grad_out = torch.randn(4, HIDDEN), torch.randn(4, 3, HIDDEN)
        scores = [[[0.0]] * 4, [[3.0, 2.0, 1.0]] * 4]  # every sample asks all three experts

        async def call(layer: RemoteMixtureOfExperts, backward: bool = False) -> tuple[float, dict]:
            dispatches, _ = layer._dispatch(await layer._search(scores, 3), 3)
            started = loop.time()
            if backward:
                results = await layer._backward_all(x, grad_out, dispatches)
            else:
                results = await layer._forward_all(x, dispatches)
            return loop.time() - started, {d.location.uid: r for d, r in zip(dispatches, results, strict=True)}

        layer = RemoteMixtureOfExperts(client, HIDDEN, (1, 3), "ffn", k_best=3, k_min=1, forward_timeout=60,
                                       backward_timeout=60, timeout_after_k_min=grace)
        elapsed, results = await call(layer)
        assert grace <= elapsed < grace + 0.5  # not the 30 s of the slow expert, nor forward_timeout
        assert isinstance(results["ffn.0.2"], TimeoutError)
        for uid, scale in (("ffn.0.0", 1.0), ("ffn.0.1", 2.0)):
            torch.testing.assert_close(results[uid].outputs[0], x * scale)
        elapsed, results = await call(layer, backward=True)
        assert grace <= elapsed < grace + 0.5 and isinstance(results["ffn.0.1"], TimeoutError)
        torch.testing.assert_close(results["ffn.0.0"][0], grad_out[:, 0])
        torch.testing.assert_close(results["ffn.0.2"][0], grad_out[:, 2] * 3.0)

        waiting = RemoteMixtureOfExperts(client, HIDDEN, (1, 3), "ffn", k_best=3, k_min=1, forward_timeout=60,
                                         timeout_after_k_min=None)  # waits for every expert, up to forward_timeout
        elapsed, results = await call(waiting)
        assert slow <= elapsed < slow + 0.5
        torch.testing.assert_close(results["ffn.0.2"].outputs[0], x * 3.0)
        with pytest.raises(ValueError, match="timeout_after_k_min"):
            RemoteMixtureOfExperts(client, HIDDEN, (1, 3), "ffn", k_best=3, timeout_after_k_min=-1.0)
        all_three = RemoteMixtureOfExperts(client, HIDDEN, (1, 3), "ffn", k_best=3, k_min=3, forward_timeout=60,
                                           timeout_after_k_min=grace)  # k_min answers come only with the slow one
        elapsed, results = await call(all_three)
        assert slow <= elapsed < slow + 0.5 and not any(isinstance(r, BaseException) for r in results.values())
    run_virtual(main())


@pytest.mark.timeout(60)
def test_transformer_and_custom_expert_types_work_remotely(peers):
    from potluck.moe import register_expert_type
    from potluck.moe.experts import TRANSFORMER_SEQUENCE_LENGTH
    server_peer, client = peers(2)
    register_expert_type("scaled", lambda h: nn.Linear(h, 2 * h), lambda h: (TensorSchema((h,)),))
    torch.manual_seed(5)
    transformer, t_schema = make_expert("transformer", 16)
    scaled, s_schema = make_expert("scaled", HIDDEN)
    with ExpertServer(server_peer, {"tf.0": transformer, "scaled.0": scaled},
                      input_schema={"tf.0": t_schema, "scaled.0": s_schema}):
        x = torch.randn(2, TRANSFORMER_SEQUENCE_LENGTH, 16, requires_grad=True)
        x_local = x.detach().clone().requires_grad_()
        y = RemoteExpert(client, "tf.0")(x)
        torch.testing.assert_close(y, transformer(x_local))
        y.sum().backward()
        transformer(x_local).sum().backward()
        torch.testing.assert_close(x.grad, x_local.grad)
        assert RemoteExpert(client, "scaled.0")(torch.randn(4, HIDDEN)).shape == (4, 2 * HIDDEN)
    with pytest.raises(ValueError, match="unknown expert type 'nope'"):
        make_expert("nope", 8)


@pytest.mark.timeout(60)
def test_abandoned_forward_graphs_are_bounded_and_an_evicted_call_still_gets_its_gradients(peers):
    server_peer, client, quitter = peers(3)
    torch.manual_seed(6)
    module, schema = make_expert("ffn", HIDDEN)
    with ExpertServer(server_peer, {"ffn.0.0": module}, input_schema=schema, stash_calls=2) as server:
        hosted = server.experts["ffn.0.0"]
        for _ in range(3):  # a client that dies between forward and backward leaves graphs behind
            RemoteExpert(quitter, "ffn.0.0")(torch.randn(2, HIDDEN, requires_grad=True))
        quitter.shutdown()
        x = torch.randn(4, HIDDEN, requires_grad=True)
        y = RemoteExpert(client, "ffn.0.0")(x)
        for _ in range(2):  # two more calls push this one's graph out of the stash
            RemoteExpert(client, "ffn.0.0")(torch.randn(2, HIDDEN, requires_grad=True))
        assert len(hosted._stash) == 2
        y.sum().backward()  # the server asks for the inputs again and recomputes
        x_local = x.detach().clone().requires_grad_()
        module(x_local).sum().backward()
        torch.testing.assert_close(x.grad, x_local.grad)
        assert hosted.stats.recomputes == 1


@pytest.mark.timeout(60)
def test_announcements_are_refreshed_while_serving_and_expire_after_shutdown(peers):
    server_peer, client = peers(2)
    server = grid_server(server_peer, ["ffn.0.0", "ffn.1.0"], announce_ttl=1.5)

    def record(key):
        return client.dht.get(key, latest=True, timeout=5)
    first = record("ffn.1.0").expiration_time
    server_id = server_peer.transport.peer_id

    def cells(key):  # the coordinates listed, each under the server's own signed subkey
        return {parse_cell(subkey) for subkey in record(key).value}
    assert cells("ffn.") == {(0, server_id), (1, server_id)} and cells("ffn.1.") == {(0, server_id)}
    wait_until(lambda: record("ffn.1.0").expiration_time > first + 0.4)  # refreshed every ttl / 3
    server.shutdown()
    wait_until(lambda: record("ffn.1.0") is None and record("ffn.") is None, timeout=10)
    with pytest.raises(ExpertNotFound):
        RemoteExpert(client, "ffn.1.0")(torch.randn(1, HIDDEN))
