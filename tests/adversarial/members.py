"""The stage of the malicious-member tests (issue 15): averaging groups of four with one attacker,
`potluck.Peer`s for Optimizers on the emulated network under virtual time, progress records that
claim anything, and the warnings that must name the attacker."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any, TypeVar

import pytest
import torch

import potluck
from potluck.averaging import Averager
from potluck.averaging.accountability import ban_list
from potluck.core.dht_time import event_loop_clock
from potluck.core.errors import AveragingError
from potluck.dht.records import own_subkey
from potluck.net.emulated import EmulatedNetwork
from potluck.optim.context import PROGRESS_INTERVAL
from potluck.optim.progress import PROGRESS_TTL
from tests.emulated_swarm import make_swarm

T = TypeVar("T")

N = 400  # elements each member averages: 4 shards of 100


# -- averaging groups --------------------------------------------------------------------------------
async def group_of_four(tag: str, matchmaking_time: float, spread: bool = False,
                        **options: Any) -> tuple[list[Averager], list[torch.Tensor]]:
    """Four averagers under `tag` (with Averager `options`), member i holding N copies of i, or
    with `spread` N values drawn around i (a codec then rounds them); the test picks the
    attacker. Returns them and their starting vectors."""
    _, peers = await make_swarm(4)
    vectors = [torch.full((N,), float(i)) for i in range(4)]
    if spread:
        generator = torch.Generator().manual_seed(5)
        vectors = [v + torch.randn(N, generator=generator) for v in vectors]
    avgs = [Averager(p, [v], tag, target_group_size=4, matchmaking_time=matchmaking_time, sender_timeout=1.0,
                     **options) for p, v in zip(peers, vectors, strict=True)]
    return avgs, vectors


async def step_together(avgs: Sequence[Averager], delays: Sequence[float]) -> list:
    """One step of every averager, each starting after its delay (who declares first leads);
    the results, or the errors raised."""
    async def one(averager: Averager, delay: float) -> Any:
        await asyncio.sleep(delay)
        return await averager.astep(timeout=30)
    return await asyncio.gather(*(one(a, d) for a, d in zip(avgs, delays, strict=True)), return_exceptions=True)


def assert_refused(results: Sequence[Any], honest: Sequence[Averager], vectors: Sequence[torch.Tensor],
                   attacker: Averager) -> None:
    """Every honest step failed, so each honest member kept its own tensors, and bans the attacker."""
    assert all(isinstance(r, AveragingError) for r in results[:len(honest)]), results
    for averager, vector in zip(honest, vectors, strict=False):
        assert torch.equal(averager._tensors[0], vector)
        assert attacker.transport.peer_id in ban_list(averager.transport)


def warnings_naming(caplog: pytest.LogCaptureFixture, who: object, words: str) -> int:
    """How many warnings (or worse) name `who` (a peer id) and say `words`."""
    return sum(str(who) in r.getMessage() and words in r.getMessage()
               for r in caplog.records if r.levelno >= logging.WARNING)


# -- Optimizer swarms ----------------------------------------------------------------------------------
async def join(network: EmulatedNetwork, peers: list[potluck.Peer]) -> potluck.Peer:
    """A new `potluck.Peer` on `network`, bootstrapped from the first of `peers`, appended to them."""
    peer = await potluck.Peer.create(peers[0].addresses if peers else [], transport=network.transport(),
                                     clock=event_loop_clock())
    peers.append(peer)
    return peer


# -- progress records that lie ------------------------------------------------------------------------
async def claim_progress(peer: Any, run_id: str, lifetime: float = PROGRESS_TTL, **claims: Any) -> bool:
    """Store a progress record of `run_id` under `peer`'s own subkey (read as its own: signed), in
    the shape `ProgressTracker.report` stores, dated now, at epoch 0 with nothing done unless
    `claims` (wire names: epoch, samples, sps, time, done, ...) say otherwise; whether it was stored."""
    now = peer.dht.get_time()
    record = {"epoch": 0, "samples": 0, "sps": 0.0, "time": now, "client": False, "done": 0,
              "averaging": False, "idle": False, "part": 0, **claims}
    return await peer.dht.astore(f"{run_id}.progress", record, now + lifetime,
                                 subkey=own_subkey(peer.transport.peer_id))


async def keep_claiming(peer: Any, run_id: str, **claims: Any) -> None:
    """Publish `claims` as `peer`'s progress every PROGRESS_INTERVAL, as a live peer does, until cancelled."""
    while True:
        await claim_progress(peer, run_id, **claims)
        await asyncio.sleep(PROGRESS_INTERVAL)
