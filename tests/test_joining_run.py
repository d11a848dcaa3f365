"""Joining a run in progress over slow links: three peers join while a fourth has trained alone.

A run starts with one peer: it trains alone, epochs ahead of anyone who joins later. The joiners
must take its state (it is the run, not a liar ahead of the swarm) and train with it, instead of
training apart at epoch 0 for good. Everything runs on the emulated network under the virtual
clock: links of 50 ms round trip and 10 or 100 Mbit/s each way, so state downloads take epochs of
the lone peer's time.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

import potluck
from potluck.core.dht_time import event_loop_clock
from potluck.net.emulated import EmulatedNetwork
from potluck.optim import Optimizer
from tests.emulated_swarm import run_on_shared_runner

RUN = "joining"
BATCH, TARGET, COMPUTE = 8, 64, 0.02  # one peer alone: an epoch per 0.16 s
LATENCY = 0.025  # one way: 50 ms round trip
BANDWIDTH = 10e6 / 8  # bytes/s each way per peer (10 Mbit/s)
WIDTH = 256  # a model of 256 x 260 floats (266 kB): three downloads through one uplink take ~4 epochs
ALONE_SECONDS = 3.0  # the first peer trains alone this long (about 18 epochs) before the others join
# The stated bound: within this many (virtual) seconds of the first join, a round of all four.
TOGETHER_WITHIN = 8.0


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh(), torch.nn.Linear(WIDTH, 4))


async def scenario(through_first: bool = True, bandwidth: float = BANDWIDTH) -> dict:
    """Peer 0 trains alone, then peers 1-3 join (through peer 0, or through a peer that only
    serves the DHT) and train; the sizes of every gradient round, with when it ended."""
    loop = asyncio.get_running_loop()
    network = EmulatedNetwork(latency=LATENCY, seed=11)

    async def new_peer(initial: list[str]) -> potluck.Peer:
        return await potluck.Peer.create(initial, transport=network.transport(upload=bandwidth, download=bandwidth),
                                         clock=event_loop_clock())

    bootstrap = None if through_first else await new_peer([])
    first = await new_peer([] if bootstrap is None else bootstrap.addresses)
    entry = first if bootstrap is None else bootstrap
    peers, models, opts = [first], [make_model()], []
    rounds: list[tuple[float, int, int]] = []  # (time, peer index, group size)
    tasks: list[asyncio.Future] = []
    stop = asyncio.Event()

    async def start(index: int, peer: potluck.Peer) -> None:
        opt = Optimizer(peer, RUN, models[index].parameters(), lambda p: torch.optim.SGD(p, 0.05),
                        target_batch_size=TARGET, batch_size_per_step=BATCH, load_state=index > 0, start=False)
        await opt.astart()
        averager = opt.training.grad_averager
        astep = averager.astep

        async def recording(*args, _astep=astep, **kwargs):
            result = await _astep(*args, **kwargs)
            rounds.append((loop.time(), index, result.group_size))
            return result
        averager.astep = recording
        opts.append(opt)
        generator = torch.Generator().manual_seed(index)
        model = models[index]
        while not stop.is_set():
            x = torch.randn(BATCH, WIDTH, generator=generator)
            model(x).square().mean().backward()
            await asyncio.sleep(COMPUTE)
            await opt.astep()

    try:
        tasks.append(asyncio.ensure_future(start(0, first)))
        await asyncio.sleep(ALONE_SECONDS)
        joined = loop.time()
        for index in (1, 2, 3):
            peers.append(await new_peer(entry.addresses))
            models.append(make_model())
            tasks.append(asyncio.ensure_future(start(index, peers[-1])))
            await asyncio.sleep(0.2)
        await asyncio.sleep(TOGETHER_WITHIN + 2)
        stop.set()
        await asyncio.wait_for(asyncio.gather(*tasks), 60)
        return {"joined": joined, "rounds": rounds, "epochs": [o.local_epoch for o in opts],
                "lone_epochs": ALONE_SECONDS / (TARGET / BATCH * COMPUTE)}
    finally:
        stop.set()
        for task in tasks:
            task.cancel()
        for opt in opts:
            opt.shutdown()
        for peer in [*peers, *([bootstrap] if bootstrap else [])]:
            await peer.ashutdown()


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("through_first", "bandwidth"), [(True, BANDWIDTH), (False, 10 * BANDWIDTH)],
                         ids=["through-the-lone-peer", "through-a-dht-peer-100mbit"])
def test_three_peers_join_a_peer_that_trained_alone_and_all_four_average_together(through_first: bool,
                                                                                  bandwidth: float) -> None:
    """Through the lone peer (it is their witness), over 10 Mbit/s: downloads take epochs. Through
    a DHT-only peer, over 100 Mbit/s: they follow their donor, and the first peer's stable group
    reads the DHT often enough, while they are outside it, to take them into its rounds."""
    result = run_on_shared_runner(scenario(through_first, bandwidth), timeout=120)
    joined, rounds = result["joined"], result["rounds"]
    full = [t for t, _, size in rounds if size == 4]
    assert full and full[0] - joined < TOGETHER_WITHIN, rounds
    # ... and they stay together: every round of the last seconds is one of all four.
    late = [size for t, _, size in rounds if t > joined + TOGETHER_WITHIN]
    assert late and set(late) == {4}, rounds
    # The joiners took the lone peer's epochs (it was the run), not a swarm of their own at 0.
    assert min(result["epochs"]) > result["lone_epochs"] / 2, result["epochs"]
