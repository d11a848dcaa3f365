"""Parameter-server training of one model by a swarm on the emulated network, in one process.

Used by the tests (under the virtual clock, so timings repeat exactly) and by `potluck compare`
(in real time). Each worker is a coroutine with its own model replica, data order and compute
time; workers and servers can be crashed mid-run.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from potluck.dht import DHT, event_loop_clock
from potluck.net.emulated import EmulatedNetwork, EmulatedTransport
from potluck.ps.messages import ShardLayout
from potluck.ps.server import ParameterServer, ServerConfig
from potluck.ps.worker import PSClient, start_parameter_servers, train_worker

logger = logging.getLogger(__name__)

Batches = Callable[[int], Callable[[], tuple[Any, Any]]]  # worker index -> next-batch function
RUN_ID = "sim"


@dataclass
class EmulatedPeer:
    """A transport and its DHT on the emulated network: a `PeerLike` for the servers and clients."""

    transport: EmulatedTransport
    dht: DHT

    @classmethod
    async def start(cls, network: EmulatedNetwork, bandwidth: float | None,
                    bootstrap: EmulatedPeer | None) -> EmulatedPeer:
        transport = network.transport(upload=bandwidth, download=bandwidth)
        await transport.start()
        dht = DHT(transport, initial_peers=[bootstrap.transport.addresses[0]] if bootstrap else [],
                  clock=event_loop_clock())
        await dht.astart()
        return cls(transport, dht)

    async def close(self) -> None:
        await self.dht.ashutdown()
        await self.transport.close()


@dataclass
class PSSimulation:
    """A parameter-server swarm on an emulated network; build with `await PSSimulation.start(...)`.

    `compute_times[i]` is worker i's modeled compute time per step (seconds); with `num_shards`
    dedicated servers (`standbys=True`: each also keeps a standby copy of the next one's shard), or
    `decentralized=True` for one shard served by each worker. `offload=False`
    keeps all tensor math on the loop: under the virtual clock a run then repeats exactly.
    """

    network: EmulatedNetwork
    servers: list[ParameterServer]
    layout: ShardLayout
    workers: list[EmulatedPeer]
    server_peers: list[EmulatedPeer]
    models: list[torch.nn.Module]
    clients: list[PSClient]
    compute_times: list[float]
    losses: list[tuple[float, float]] = field(default_factory=list)  # (loop time, loss) of every step
    tasks: list[asyncio.Task] = field(default_factory=list)
    offload: bool = True

    @classmethod
    async def start(cls, make_model: Callable[[], torch.nn.Module],
                    optimizer: Callable[[list[torch.Tensor]], torch.optim.Optimizer], config: ServerConfig,
                    compute_times: Sequence[float], *, num_shards: int = 1, decentralized: bool = False,
                    standbys: bool = False, bandwidth: float | None = 100e6, latency: float = 0.001,
                    offload: bool = True) -> PSSimulation:
        network = EmulatedNetwork(latency=latency)
        peers: list[EmulatedPeer] = []
        for _ in range(len(compute_times) + (0 if decentralized else num_shards)):
            peers.append(await EmulatedPeer.start(network, bandwidth, peers[0] if peers else None))
        workers = peers[:len(compute_times)]
        server_peers = workers if decentralized else peers[len(compute_times):]
        reference = make_model()
        servers, layout = start_parameter_servers(server_peers, RUN_ID, list(reference.parameters()),
                                                  optimizer, config, decentralized=decentralized or standbys,
                                                  offload=offload)
        models = [make_model() for _ in compute_times]
        clients = [PSClient(p, RUN_ID, layout, m.parameters()) for p, m in zip(workers, models, strict=True)]
        await asyncio.gather(*(c.aregister() for c in clients))
        return cls(network, servers, layout, workers, server_peers, models, clients, list(compute_times),
                   offload=offload)

    @property
    def primary(self) -> ParameterServer:
        """Shard 0's first server (its step counts the run's steps)."""
        return self.servers[0]

    def applied(self) -> int:
        """Gradients shard 0's server has applied."""
        return len(self.primary.staleness)

    async def run(self, batches: Batches, until: Callable[[], bool]) -> None:
        """Train every live worker until `until()` is true (checked after each worker step)."""
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()

        def on_step(loss: float) -> None:
            self.losses.append((loop.time(), loss))
            if until():
                stop.set()
        self.tasks = [asyncio.create_task(train_worker(c, m, batches(i), compute_time=self.compute_times[i],
                                                       stop=stop, on_step=on_step, offload=self.offload))
                      for i, (c, m) in enumerate(zip(self.clients, self.models, strict=True))]
        stopped = asyncio.ensure_future(stop.wait())
        try:
            # Once stopped, pushes still waiting for a round are cut short: the run is over, and
            # waiting for them would only wait out the worker timeout of the workers that stopped.
            # A worker that fails ends the run too: the others could wait for it forever (`until`
            # may count its steps), which would turn any error, a test's timeout included, into a hang.
            pending: set[asyncio.Future] = {stopped, *self.tasks}
            while stopped in pending and len(pending) > 1:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                if any(not t.cancelled() and t.exception() is not None for t in done if t is not stopped):
                    break
        finally:
            stopped.cancel()
            for task in self.tasks:
                task.cancel()
            results = await asyncio.gather(*self.tasks, return_exceptions=True)
        # Crashed workers end cancelled: not errors.
        errors = [r for r in results if isinstance(r, BaseException) and not isinstance(r, asyncio.CancelledError)]
        if errors:
            raise errors[0]

    def crash_worker(self, index: int) -> None:
        """Worker `index` dies: its process stops and its connections reset."""
        if self.tasks:
            self.tasks[index].cancel()
        self.network.crash(self.workers[index].transport.peer_id)

    def crash_server(self, shard: int) -> None:
        """Shard `shard`'s primary server's machine dies."""
        self.network.crash(self.layout.servers[shard][0])

    async def close(self) -> None:
        for peer in {id(p): p for p in self.workers + self.server_peers}.values():
            await peer.close()
