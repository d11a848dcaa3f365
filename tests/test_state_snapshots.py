"""A donor in sync mode offers newcomers the state it holds now, labelled with its epoch.

Regression: the state averager's round names the snapshot a donor offers, and in sync mode a
round that averaged epoch e's state left it at e + 1, the label the next epoch's step then gave
it again: the snapshot taken between the two was offered as current after the step, so a peer
catching up took epoch e's parameters (and, more than one epoch behind, the swarm's epoch with
them). And a manifest whose downloader never opened a chunk stream held its snapshot on offer
for as long as anyone kept asking.
"""

from __future__ import annotations

import asyncio

import torch

import potluck
from potluck.averaging.state_transfer import ManifestRequest, download_state
from potluck.averaging.state_transfer.server import SNAPSHOT_CLAIM_SECONDS
from potluck.core.dht_time import event_loop_clock
from potluck.core.names import RunNames
from potluck.core.runner import acquire_runner, release_runner
from potluck.core.virtual_time import virtual_time_loop
from potluck.net.emulated import EmulatedNetwork
from potluck.optim import Optimizer

BATCH, TARGET = 8, 32


async def two_peers_and_a_reader() -> None:
    network = EmulatedNetwork(latency=0.01, seed=1)
    first = await potluck.Peer.create([], transport=network.transport(), clock=event_loop_clock())
    peers = [first, *[await potluck.Peer.create(first.addresses, transport=network.transport(),
                                                clock=event_loop_clock()) for _ in range(2)]]
    models = []
    for seed in (1, 2):  # different starts: every epoch's state differs, so its state round runs
        torch.manual_seed(seed)
        models.append(torch.nn.Linear(16, 4))
    optimizers = [Optimizer(peer, "snap", model.parameters(), lambda p: torch.optim.SGD(p, 0.1),
                            target_batch_size=TARGET, batch_size_per_step=BATCH, load_state=False, start=False)
                  for peer, model in zip(peers, models)]
    donor, reader = optimizers[0], peers[2]
    try:
        for opt in optimizers:
            await opt.astart()
        await asyncio.sleep(1)  # they see each other

        async def train(index: int, until: int) -> None:
            generator = torch.Generator().manual_seed(index)
            while optimizers[index].local_epoch < until:
                x = torch.randn(BATCH, 16, generator=generator)
                torch.nn.functional.cross_entropy(models[index](x), (x[:, 0] > 0).long()).backward()
                await asyncio.sleep(0.02)
                await optimizers[index].astep()

        server = donor.state_averager.state_server
        for epoch in (1, 2, 3):
            await asyncio.gather(train(0, epoch), train(1, epoch))
            _, metadata, tensors = await download_state(reader.transport, [peers[0].transport.peer_id], RunNames("snap").averager("state"),
                                                        5, like=donor.context.state.tensors())
            assert metadata == donor.context.state.metadata(epoch) and metadata["epoch"] == epoch  # and the run schema
            assert all(torch.equal(a, b) for a, b in zip(tensors, donor.context.state.tensors(), strict=True))
        # A manifest nobody streams holds its snapshot a while only; asking again does not extend it.
        loop = asyncio.get_running_loop()
        await server._manifest(ManifestRequest())
        await asyncio.gather(train(0, 4), train(1, 4))
        until = loop.time() + SNAPSHOT_CLAIM_SECONDS
        while loop.time() < until:
            await server._manifest(ManifestRequest())
            await asyncio.sleep(1)
        assert (await server._manifest(ManifestRequest())).metadata == donor.context.state.metadata(4)
    finally:
        for opt in optimizers:
            opt.shutdown()
        for peer in peers:
            await peer.ashutdown()


def test_a_sync_donor_offers_the_state_of_its_epoch():
    runner = acquire_runner(virtual_time_loop)
    try:
        runner.run(two_peers_and_a_reader(), timeout=120)
    finally:
        release_runner()
