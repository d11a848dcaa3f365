"""The worker side of parameter-server training: push gradients, get fresh parameters back.

`PSClient` is the async core (it runs on the event loop, and drives emulated swarms);
`PSWorker` is the synchronous facade for a `potluck.Peer` in a plain training loop:

    worker = PSWorker(peer, "run", layout, model.parameters())
    worker.register()                  # waits for the other workers, loads the server's parameters
    for x, y in batches:
        model.zero_grad(); loss_fn(model(x), y).backward()
        worker.push()                  # sends p.grad, writes the new parameters into the model

The layout names servers by peer id; the worker's transport finds their addresses through their
signed peer records in the DHT, so workers and servers must share one swarm (`initial_peers`).
A shard whose server cannot be reached is retried at its standby (decentralized form); with
none left, `ShardServerLost` says which shard and why.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Collection, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from potluck.core.errors import ConnectionLost, DeadlineExceeded, PeerUnreachable, PotluckError
from potluck.core.names import RunNames
from potluck.core.peer_like import PeerLike
from potluck.core.staging import devices_of, synchronize, to_host
from potluck.net.identity import PeerID
from potluck.ps.messages import ParamsReply, PullRequest, PushRequest, RegisterRequest, ShardLayout
from potluck.ps.server import ParameterServer, ServerConfig, split_by_size

if TYPE_CHECKING:
    from potluck.peer import Peer

logger = logging.getLogger(__name__)

# How long a worker waits for the answer to one push or registration: a sync round may wait up to
# the server's worker timeout for a dead worker, and registration for the others to arrive.
PUSH_TIMEOUT = 60.0
# Errors that mean "this server is gone" (a RemoteError, by contrast, is the server refusing us).
_SERVER_GONE = (PeerUnreachable, ConnectionLost, DeadlineExceeded)


class ShardServerLost(PotluckError):
    """No server of a shard can be reached: training cannot go on without its parameters."""


class PSClient:
    """One worker's link to the parameter servers of run `run_id` (async; see the module docstring).

    Args:
        peer: the worker's started peer (a `potluck.Peer`, or an emulated one), in the servers' swarm.
        run_id: the training run.
        layout: which server holds which parameters (`ShardLayout`, by peer id).
        params: the model's parameters, on any device; gradients go out from host copies and
            replies are copied into them.
        timeout: deadline of one push or registration, in seconds.
    """

    def __init__(self, peer: PeerLike, run_id: str, layout: ShardLayout, params: Iterable[torch.Tensor],
                 timeout: float = PUSH_TIMEOUT):
        self.peer = peer
        self.transport = peer.transport
        self.run_id = run_id
        self.names = RunNames(run_id)
        self.layout = layout
        self.params = list(params)
        if len(self.params) != len(layout.assignment):
            raise ValueError(f"the layout places {len(layout.assignment)} tensors, the model has {len(self.params)}")
        self.timeout = timeout
        self._indices = [layout.indices(k) for k in range(layout.num_shards)]  # each shard's parameters
        self._server = [0] * layout.num_shards  # which of each shard's servers is in use
        self.steps = [0] * layout.num_shards  # server step of the parameters held, per shard
        self.pushes = 0
        self._seq = 0  # numbers every push, answered or not: one cancelled after the server applied it is not reused
        self.dropped = 0  # pushes a server of backup consistency did not use

    async def aregister(self) -> None:
        """Join the run: wait for the servers' start barrier and load their parameters."""
        await asyncio.gather(*(self._call(k, "register", RegisterRequest()) for k in range(self.layout.num_shards)))

    async def apush(self, grads: Sequence[torch.Tensor] | None = None) -> None:
        """Send gradients (default: each parameter's `.grad`) and load the parameters of the reply."""
        if grads is None:
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        grads = to_host(grads)
        seq, self._seq = self._seq, self._seq + 1
        await asyncio.gather(*(
            self._call(k, "push", PushRequest(self.steps[k], tuple(grads[i] for i in indices), seq))
            for k, indices in enumerate(self._indices)))
        self.pushes += 1

    async def apull(self) -> None:
        """Load the servers' current parameters without pushing anything."""
        await asyncio.gather(*(self._call(k, "pull", PullRequest()) for k in range(self.layout.num_shards)))

    async def _call(self, shard: int, verb: str, request: RegisterRequest | PullRequest | PushRequest) -> None:
        servers = self.layout.servers[shard]
        while True:
            server = servers[self._server[shard]]
            try:
                if server == self.transport.peer_id:  # this worker serves the shard itself (loopback)
                    request = _copied(request)
                reply = await self.transport.call(server, self.names.ps_shard(shard, verb), request.to_wire(),
                                                  timeout=self.timeout)
                break
            except _SERVER_GONE as e:
                if self._server[shard] + 1 >= len(servers):
                    raise ShardServerLost(
                        f"the server of shard {shard} of run {self.run_id!r} ({server}) is unreachable: {e}; "
                        "training cannot go on without its parameters (the decentralized form keeps a "
                        "standby copy of every shard)") from e
                self._server[shard] += 1
                logger.warning("ps %s: shard %d server %s lost (%s); turning to standby %s", self.run_id, shard,
                               server, e, servers[self._server[shard]])
        self._load(shard, reply)

    def _load(self, shard: int, wire: Any) -> None:
        indices = self._indices[shard]
        reply = ParamsReply.from_wire(wire, like=[self.params[i] for i in indices])
        with torch.no_grad():
            for i, value in zip(indices, reply.params, strict=True):
                self.params[i].copy_(value, non_blocking=True)
        synchronize(devices_of(self.params[i] for i in indices))
        self.steps[shard] = reply.step
        self.dropped += reply.dropped


def _copied(request: RegisterRequest | PullRequest | PushRequest) -> RegisterRequest | PullRequest | PushRequest:
    """A request to this peer itself with its tensors copied, as the wire would: the loopback
    passes the objects themselves, and the server keeps the gradients past this call."""
    if isinstance(request, PushRequest):
        return PushRequest(request.step, tuple(g.clone() for g in request.grads), request.seq)
    return request


class PSWorker:
    """Synchronous facade of `PSClient` for a `potluck.Peer` (see the module docstring)."""

    def __init__(self, peer: Peer, run_id: str, layout: ShardLayout, params: Iterable[torch.Tensor],
                 timeout: float = PUSH_TIMEOUT):
        self.peer = peer  # a `potluck.Peer`: its `run` drives the client on the peer's event loop
        self.client = PSClient(peer, run_id, layout, params, timeout)

    def register(self) -> None:
        self.peer.run(self.client.aregister(), self.client.timeout + 5)

    def push(self, grads: Sequence[torch.Tensor] | None = None) -> None:
        self.peer.run(self.client.apush(grads), self.client.timeout + 5)

    def pull(self) -> None:
        self.peer.run(self.client.apull(), self.client.timeout + 5)


def start_parameter_servers(peers: Sequence[PeerLike], run_id: str, params: Sequence[torch.Tensor],
                            optimizer: Callable[[list[torch.Tensor]], torch.optim.Optimizer],
                            config: ServerConfig | None = None, *, decentralized: bool = False,
                            offload: bool = True, workers: Collection[PeerID] | None = None
                            ) -> tuple[list[ParameterServer], ShardLayout]:
    """Serve `params` split by size over one shard per peer.

    With `decentralized=True` (the peers are the workers' own) the server of shard k also
    copies its state to a standby on the next peer, which takes over if k's server dies.
    Returns the servers (standbys included) and the layout for clients (servers named by peer id:
    a client in the same swarm finds their addresses through the DHT).
    `offload`, `workers` (the run's workers by peer id; None: `num_workers` seats, first come): see
    `ParameterServer`.
    """
    n = len(peers)
    assignment = split_by_size([p.numel() for p in params], n)
    servers: list[ParameterServer] = []
    shard_servers = []
    for k, peer in enumerate(peers):
        mine = [params[i] for i, s in enumerate(assignment) if s == k]
        standby = peers[(k + 1) % n] if decentralized and n > 1 else None
        primary_id = peer.transport.peer_id
        standby_id = standby.transport.peer_id if standby is not None else None
        servers.append(ParameterServer(peer, run_id, mine, optimizer, config, shard=k, replica=standby_id,
                                       offload=offload, workers=workers))
        if standby is not None:
            servers.append(ParameterServer(standby, run_id, mine, optimizer, config, shard=k, standby_of=primary_id,
                                           offload=offload, workers=workers))
        shard_servers.append((primary_id,) + ((standby_id,) if standby_id is not None else ()))
    return servers, ShardLayout(tuple(assignment), tuple(shard_servers))


async def train_worker(client: PSClient, model: torch.nn.Module, next_batch: Callable[[], tuple[Any, Any]],
                       steps: int | None = None, *, compute_time: float = 0.0, stop: asyncio.Event | None = None,
                       loss_fn: Callable[[Any, Any], torch.Tensor] = torch.nn.functional.cross_entropy,
                       on_step: Callable[[float], None] | None = None, offload: bool = True) -> int:
    """Train `model` (whose parameters are `client.params`) until `steps` or `stop`; returns steps done.

    `compute_time` is extra seconds per step that model a slower machine's compute (it is waited
    out on the loop, so under the virtual clock it costs no real time). `offload` runs forward and
    backward in a worker thread; False runs them on the loop (exact repeats under the virtual clock).
    """
    loop = asyncio.get_running_loop()

    def compute() -> float:
        x, y = next_batch()
        model.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), y)
        loss.backward()
        return float(loss.detach())

    done = 0
    while (steps is None or done < steps) and not (stop is not None and stop.is_set()):
        loss = await loop.run_in_executor(None, compute) if offload else compute()
        if compute_time > 0:
            await asyncio.sleep(compute_time)  # models this worker's slower compute
        await client.apush()
        done += 1
        if on_step is not None:
            on_step(loss)
    return done
