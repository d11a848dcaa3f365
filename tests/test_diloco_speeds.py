"""DiLoCo peers of unequal speed meet in every outer round (emulated network, virtual clock).

The faster peer makes its inner steps first and enters the round; a slower one joins it then,
with fewer inner steps, instead of arriving after the round's matchmaking window (it used to
step alone, fall an epoch further behind every round, and never meet the faster one again).
"""

from __future__ import annotations

import asyncio
import collections
from typing import Any

import pytest
import torch

import potluck
from potluck.core.dht_time import event_loop_clock
from potluck.core.runner import acquire_runner, release_runner
from potluck.core.virtual_time import virtual_time_loop
from potluck.net.emulated import EmulatedNetwork
from potluck.optim import EpochEvent, Optimizer
from potluck.optim.state import tensor_digest

BATCH = 8
COMPUTE_SECONDS = (0.02, 0.05)  # per batch: the second peer is 2.5x slower
INTERVAL = 24  # inner steps per round: the slower peer would come 0.72 s after the faster one, past the window
MATCHMAKING_SECONDS = 0.5
STALL_AT_STEP = 30  # the slower peer's step after which it stalls (test_a_stalled_peer_...)


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)  # the same start on every peer
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))


async def swarm(epochs: int, options: dict[str, Any], stall: float = 0.0,
                compute: tuple[float, float] = COMPUTE_SECONDS) -> dict:
    """Train the peers until `epochs` outer rounds (the slower peer stalls for `stall` seconds
    after its STALL_AT_STEP-th step; `compute`: each one's seconds a batch); per epoch, each
    peer's outer digest once it reached that epoch."""
    network = EmulatedNetwork(latency=0.01, seed=1)
    peers: list[potluck.Peer] = []
    for _ in compute:
        peers.append(await potluck.Peer.create(peers[0].addresses if peers else [], transport=network.transport(),
                                               clock=event_loop_clock()))
    models = [make_model() for _ in peers]
    optimizers = [Optimizer(peer, "speeds", model.parameters(), lambda p: torch.optim.SGD(p, 0.1),
                            target_batch_size=64, batch_size_per_step=BATCH, mode="diloco",
                            local_steps=INTERVAL * options.get("fragments", 1), matchmaking_time=MATCHMAKING_SECONDS, load_state=False, start=False, **options)
                  for peer, model in zip(peers, models, strict=True)]
    outer: dict[int, dict[int, str]] = collections.defaultdict(dict)  # epoch -> peer -> outer digest
    for index, opt in enumerate(optimizers):
        await opt.astart()

        def recording(event: EpochEvent, index: int = index, opt: Optimizer = opt) -> None:
            if event.how == "update":  # its own outer step
                outer[event.epoch][index] = tensor_digest(opt.training.outer + opt.training.momentum)
        opt.register_epoch_hook(recording)
    await asyncio.sleep(1)  # the peers see each other's progress: no first round alone
    steps = [0 for _ in peers]

    async def train(index: int) -> None:
        model, opt = models[index], optimizers[index]
        generator = torch.Generator().manual_seed(100 + index)
        while opt.local_epoch < epochs:
            x = torch.randn(BATCH, 16, generator=generator)
            y = (x[:, 0] > 0).long() + 2 * (x[:, 1] > 0).long()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            stalled = stall if index == 1 and steps[index] == STALL_AT_STEP else 0.0
            await asyncio.sleep(compute[index] + stalled)
            await opt.astep()
            steps[index] += 1

    try:
        await asyncio.wait_for(asyncio.gather(*(train(i) for i in range(len(peers)))), 60)  # virtual seconds
        return {"outer": dict(outer), "steps": steps, "epochs": [o.local_epoch for o in optimizers],
                "failed": [o.context.failed_rounds for o in optimizers]}
    finally:
        for opt in optimizers:
            opt.shutdown()
        for peer in peers:
            await peer.ashutdown()


def run(epochs: int, options: dict[str, Any], stall: float = 0.0, compute: tuple[float, float] = COMPUTE_SECONDS) -> dict:
    runner = acquire_runner(virtual_time_loop)
    try:
        return runner.run(swarm(epochs, options, stall, compute), timeout=120)
    finally:
        release_runner()


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("options", "waits"), [({}, 0), ({"fragments": 2, "outer_delay": 1}, 0),
                                               ({"fragments": 2, "outer_delay": INTERVAL - 1}, 6 * 8)],
                         ids=["diloco", "streaming", "streaming-long-delay"])
def test_diloco_peers_of_unequal_speed_take_every_outer_step_together(options: dict[str, Any], waits: int):
    # Streaming DiLoCo: an epoch is one fragment's round, every INTERVAL steps (a round runs in
    # the background for `outer_delay` inner steps); the whole outer state is compared after each
    # one. With a delay of nearly an interval the slower peer is still in its delay when the
    # faster one's next round is due: the faster one waits (taking inner steps) until the slower
    # one lands, which it does once it hears the faster one landed: `waits`, a few of the faster
    # one's steps a round (it used to sit out the slower one's whole delay: 356 steps, not 199).
    delay = options.get("outer_delay", 0)
    result = run(6, options)
    outer = result["outer"]
    assert result["epochs"] == [6, 6], result
    # Every outer step is taken by both peers, from the same round: their outer parameters and
    # momentum are identical after each one, and no round failed.
    assert sorted(outer) == list(range(1, 7)), result
    for epoch, digests in outer.items():
        assert set(digests) == {0, 1} and len(set(digests.values())) == 1, (epoch, result)
    assert result["failed"] == [0, 0], result
    # The faster peer sets the pace; the slower one joins each round with fewer inner steps.
    # (with a delayed round, the last one lands `delay` steps after the round's interval)
    assert 6 * INTERVAL <= result["steps"][0] <= 6 * INTERVAL + delay + waits, result
    assert result["steps"][1] < 0.75 * result["steps"][0], result


@pytest.mark.timeout(120)
def test_a_stalled_peer_follows_its_lone_partner_far_ahead_and_meets_it_again():
    # The slower peer stalls for 3 s: the other takes four or five outer steps alone, more than
    # MAX_EPOCH_LEAD ahead. It was in the stalled peer's last group, so that one still believes
    # its epoch (a lone stranger's it would not), downloads its state and meets it again in the
    # following rounds. (Without that, each went on alone at its own epoch for good.)
    result = run(10, {}, stall=3.0)
    outer = result["outer"]
    assert result["epochs"] == [10, 10], result
    assert any(set(outer[epoch]) == {0} for epoch in range(3, 7)), result  # the rounds it missed
    for epoch in (8, 9, 10):
        assert set(outer[epoch]) == {0, 1} and len(set(outer[epoch].values())) == 1, (epoch, result)


@pytest.mark.timeout(120)
def test_a_peer_whose_steps_outlast_the_matchmaking_window_meets_every_outer_round():
    # The slower peer's steps take 0.8 s, the window is 0.5 s: it joins a round only after the
    # step it is in when the round begins. A round's window now covers two of the slowest peer's
    # steps (`RunContext.round_window`); both take every outer step together.
    result = run(4, {}, compute=(0.1, 0.8))
    outer = result["outer"]
    assert result["epochs"] == [4, 4] and result["failed"] == [0, 0], result
    for epoch in range(1, 5):
        assert set(outer[epoch]) == {0, 1} and len(set(outer[epoch].values())) == 1, (epoch, result)
