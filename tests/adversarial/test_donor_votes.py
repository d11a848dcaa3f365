"""Issue 29, "Votes count identities": a newcomer chooses among disagreeing state donors by the
rounds its witnesses recorded their holders in, never by how many identities agree or what they
claim.

Two honest peers train a few epochs in sync mode (their round records are real), then stop and
stay online. Attackers then publish live progress at the swarm's epoch (so the progress view
counts them as voters), announce and serve a fake state (every value 42.0), and publish round
records of rounds that never happened, listing each other (and the honest peers) with 10^9
samples each: a history that looks exactly like an honest group's. Before the fix the newcomer
took the state most donors agreed on, ties going to the higher version: 2 colluders claiming a
version 8 ahead tied 2 honest donors and won; 3 made-up identities outvoted 2. Everything runs on
the emulated network in virtual time.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from collections.abc import AsyncIterator
from typing import Any

import pytest
import torch

import potluck
from potluck.averaging.state_transfer import DonorRecord, StateServer
from potluck.core.dht_time import event_loop_clock
from potluck.core.names import RunNames
from potluck.dht.records import own_subkey
from potluck.net.emulated import EmulatedNetwork
from potluck.optim import Optimizer
from potluck.optim.context import MAX_STATE_EPOCH_LEAD
from potluck.optim.progress import MAX_RECORDED_ROUNDS, ROUNDS_TTL, PublishedRounds, RoundRecord
from tests.adversarial.members import join, keep_claiming, warnings_naming
from tests.emulated_swarm import run_on_shared_runner
from tests.test_monitor_ledger import train_on_noise

RUN = "votes"
TARGET, BATCH = 64, 8
EPOCHS = 3  # the honest peers train this many epochs first
POISON = 42.0
NAMES = RunNames(RUN)


def make_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Linear(64, 8)


class Scene:
    """Honest trainers, attackers and a newcomer on one emulated network."""

    def __init__(self) -> None:
        self.network = EmulatedNetwork(latency=0.005, seed=29)
        self.peers: list[potluck.Peer] = []
        self.honest: list[Optimizer] = []
        self.tasks: list[asyncio.Future] = []
        self.servers: list[StateServer] = []

    async def optimizer(self, peer: potluck.Peer, seed: int, **options: Any) -> Optimizer:
        return Optimizer(peer, RUN, make_model(seed).parameters(), lambda p: torch.optim.SGD(p, 0.1),
                         target_batch_size=TARGET, batch_size_per_step=BATCH, start=False, **options)

    async def train_honest(self, count: int = 2) -> None:
        for _ in range(count):
            self.honest.append(await self.optimizer(await join(self.network, self.peers), 1, load_state=False))
        for opt in self.honest:
            await opt.astart()
        await asyncio.wait_for(asyncio.gather(*(train_on_noise(o, i, EPOCHS) for i, o in enumerate(self.honest))),
                               60)
        await asyncio.sleep(0.5)  # every round recorded; the peers stay online, publishing progress

    @property
    def epoch(self) -> int:
        return self.honest[0].local_epoch

    def honest_state(self) -> list[torch.Tensor]:
        return [t.clone() for t in self.honest[0].context.state.tensors()]

    async def attackers(self, count: int, version: int) -> list[potluck.Peer]:
        """`count` identities serving one fake state at `version` (metadata: that epoch), live in
        progress at the swarm's epoch, with a made-up history of rounds together."""
        fake = [torch.full_like(t, POISON) for t in self.honest[0].context.state.tensors()]
        peers = [await join(self.network, self.peers) for _ in range(count)]
        ids = [p.peer_id for p in peers]
        honest = [o.peer.peer_id for o in self.honest]
        history = tuple(RoundRecord(max(0, self.epoch - i), 0, tuple((p, 10**9) for p in [*ids, *honest]),
                                    None, peers[0].dht.get_time(), secrets.token_hex(8))
                        for i in range(MAX_RECORDED_ROUNDS))
        for peer in peers:
            self.servers.append(StateServer(peer.transport, lambda: (version, {"epoch": version}, fake),
                                            NAMES.averager("state")))
            now = peer.dht.get_time()
            subkey = own_subkey(peer.transport.peer_id)
            await peer.dht.astore(NAMES.averager("state").donors, DonorRecord(version).to_wire(), now + 600,
                                  subkey=subkey)
            await peer.dht.astore(NAMES.rounds, PublishedRounds(history).to_wire(), now + ROUNDS_TTL, subkey=subkey)
            self.tasks.append(asyncio.ensure_future(keep_claiming(peer, RUN, epoch=self.epoch, done=self.epoch)))
        return peers

    async def newcomer(self, through: potluck.Peer | None = None) -> Optimizer:
        """A newcomer that joins through `through` (default: the first honest peer) and loads the state."""
        await asyncio.sleep(0.5)  # every record stored, every attacker's progress published
        peer = await potluck.Peer.create((through or self.peers[0]).addresses, transport=self.network.transport(),
                                         clock=event_loop_clock())
        self.peers.append(peer)
        opt = await self.optimizer(peer, 2, load_state_timeout=20)
        await opt.astart()
        return opt

    async def close(self) -> None:
        for task in self.tasks:
            task.cancel()
        for server in self.servers:
            server.close()
        for opt in self.honest:
            opt.shutdown()
        for peer in self.peers:
            await peer.ashutdown()


@contextlib.asynccontextmanager
async def scene() -> AsyncIterator[Scene]:
    stage = Scene()
    try:
        await stage.train_honest()
        yield stage
    finally:
        await stage.close()


def assert_honest(newcomer: Optimizer, honest: list[torch.Tensor], epoch: int) -> None:
    assert newcomer.local_epoch == epoch
    for got, expected in zip(newcomer.context.state.tensors(), honest, strict=True):
        assert torch.equal(got, expected)
    newcomer.shutdown()


@pytest.mark.timeout(120)
def test_two_colluders_claiming_a_newer_version_do_not_outvote_two_honest_donors(
        caplog: pytest.LogCaptureFixture) -> None:
    """Before: a 2-2 tie, and ties went to the higher version the colluders claimed (the newcomer
    took 42.0 and epoch + 8). Now neither headcount nor version decides: the honest state is backed
    by the rounds the newcomer's witness (the honest peer it joined through) recorded."""
    async def main() -> None:
        async with scene() as stage:
            honest, epoch = stage.honest_state(), stage.epoch
            colluders = await stage.attackers(2, epoch + MAX_STATE_EPOCH_LEAD)
            with caplog.at_level(logging.WARNING):
                newcomer = await stage.newcomer()
            assert_honest(newcomer, honest, epoch)
            assert all(warnings_naming(caplog, c.peer_id, "not using the states") for c in colluders)
    run_on_shared_runner(main(), timeout=120)


@pytest.mark.timeout(120)
def test_three_made_up_identities_with_live_progress_do_not_outvote_two_honest_donors() -> None:
    """Before: three identities publishing progress at the swarm's epoch and one fake state of that
    very epoch were the largest group of agreeing donors, and won."""
    async def main() -> None:
        async with scene() as stage:
            honest, epoch = stage.honest_state(), stage.epoch
            await stage.attackers(3, epoch)
            assert_honest(await stage.newcomer(), honest, epoch)
    run_on_shared_runner(main(), timeout=120)


@pytest.mark.timeout(120)
def test_without_a_witness_that_trains_disagreeing_donors_are_refused_not_counted(
        caplog: pytest.LogCaptureFixture) -> None:
    """A newcomer that joined through a peer that only serves the DHT has no witness with rounds:
    made-up histories then back nothing and the honest one backs nothing it can check. It takes
    neither state (it keeps its own and says why); before, the three identities won."""
    async def main() -> None:
        async with scene() as stage:
            bootstrap = await join(stage.network, stage.peers)  # trains nothing, holds no state
            await stage.attackers(3, stage.epoch)
            own = [t.clone() for t in make_model(2).parameters()]
            with caplog.at_level(logging.WARNING):
                newcomer = await stage.newcomer(through=bootstrap)
            assert newcomer.local_epoch == 0
            for got, expected in zip(newcomer.param_groups[0]["params"], own, strict=True):
                assert torch.equal(got, expected)
            assert any("no state is backed by more than another" in r.getMessage() for r in caplog.records)
            newcomer.shutdown()
    run_on_shared_runner(main(), timeout=120)


def test_the_vote_counts_witnessed_rounds_then_users_then_a_witness_never_identities_or_claims() -> None:
    """The rule itself (`potluck.optim.vouching`): rounds a witness recorded count once however many
    holders were in them; in a governed run, one user is one vote; a witness breaks a tie; else none."""
    from potluck.optim.vouching import Backing, back, elect  # (here: the attacks above also run on the code before)
    rounds = {(5, 0, "a"): frozenset({"h1", "h2", "w"}), (6, 0, "b"): frozenset({"h1", "w"}),
              (6, 0, "c"): frozenset({"s1", "w"})}
    honest, sybils = ["h1", "h2"], ["s1", "s2", "s3", "s4"]
    assert back([honest, sybils], rounds, {"w"}) == [Backing(2, 0, False), Backing(1, 0, False)]
    assert elect(back([honest, sybils], rounds, {"w"})) == 0
    # with no witnessed round at all: a witness among the holders decides, else nobody
    assert elect(back([sybils, honest], {}, {"h2"})) == 1
    assert elect(back([sybils, honest], {}, {"me"})) is None
    # governed: users confirmed by another user's record, one vote each however many identities
    partners = {"h1": {"h2"}, "h2": {"h1"}, "s1": {"s2"}, "s2": {"s1"}, "s3": {"s1"}}
    names = {"h1": "alice", "h2": "bob", "s1": "mallory", "s2": "mallory", "s3": "mallory"}
    assert [b.users for b in back([honest, sybils], {}, {"me"}, partners, names)] == [2, 0]
    names["s2"] = "trudy"
    assert [b.users for b in back([honest, sybils], {}, {"me"}, partners, names)] == [2, 2]
    assert elect(back([honest, sybils], {}, {"me"}, partners, names)) is None
