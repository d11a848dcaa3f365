"""A made-up id that publishes progress at our own epoch and never joins holds one round, not all.

Every peer training at our epoch is counted into the round's group, which closes once that many
are in, else at the end of its matchmaking window (an honest peer counted is on its way). A
made-up id that kept a live progress record at the honest peers' epoch, and never joined, made
every round wait out its window: two honest sync peers averaged 8 rounds in 10 s of virtual time
beside it (38 alone), DiLoCo peers 9 (59 alone). Now a peer counted into a round that did not come, while the group had room
for it, and that we have not averaged with lately, is a no-show (`RunContext.group_formed`): our
rounds wait for it only `SEAT_FRACTION` of their window once everyone else is in: 15 sync rounds,
20 DiLoCo rounds."""

from __future__ import annotations

import asyncio

import pytest
import torch

from potluck.averaging import Averager
from potluck.averaging.matchmaking import POLL_FRACTION, SEAT_FRACTION
from potluck.core.virtual_time import run_virtual
from potluck.net.identity import Identity
from tests.adversarial.test_epoch_ahead import scenario
from tests.emulated_swarm import make_swarm, run_on_shared_runner


def assert_rounds(result: dict, at_least: int) -> None:
    for rounds, catch_ups in zip(result["rounds"], result["catch_ups"], strict=True):
        assert rounds >= at_least and catch_ups <= 2, result
    assert result["moved"] > 1.0 and result["apart"] == 0.0, result


@pytest.mark.timeout(120)
def test_sync_peers_wait_for_an_id_at_their_epoch_that_never_joins_only_once() -> None:
    assert_rounds(run_on_shared_runner(scenario(1, lead=0), timeout=120), 12)  # before: 8


@pytest.mark.timeout(120)
def test_diloco_peers_wait_for_an_id_at_their_epoch_that_never_joins_only_once() -> None:
    assert_rounds(run_on_shared_runner(scenario(1, lead=0, mode="diloco", local_steps=4), timeout=120), 16)  # before: 9


@pytest.mark.parametrize("told", [False, True], ids=["counted", "named-a-no-show"])
def test_a_group_waits_for_a_no_show_only_the_seat_time(told: bool) -> None:
    """`Averager.astep(no_shows=...)`: two averagers count a third peer that never comes; told it
    is a no-show, the group closes at the seat time instead of the window's end."""
    window = 2.0

    async def main():
        _, peers = await make_swarm(2)
        avgs = [Averager(p, [torch.full((8,), float(i))], "noshow", matchmaking_time=window) for i, p in enumerate(peers)]
        absent = str(Identity.generate().peer_id)
        loop = asyncio.get_running_loop()
        started = loop.time()
        results = await asyncio.gather(*(a.astep(target_group_size=3, no_shows=[absent] if told else ())
                                         for a in avgs))
        took = loop.time() - started
        assert all(r.group_size == 2 for r in results), results
        if told:
            assert took < window * (SEAT_FRACTION + 2 * POLL_FRACTION), took
        else:
            assert took >= window, took
        for a in avgs:
            a.shutdown()
    run_virtual(main())
