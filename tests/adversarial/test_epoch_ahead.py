"""A made-up identity one epoch ahead must not end every round of the honest peers.

`MAX_EPOCH_LEAD` lets a record count up to one epoch past the second-highest epoch reported (an
honest peer is that far ahead for a moment after its round). One made-up id that publishes a live
progress record of our run one epoch past the honest peers' (with that epoch applied), every
PROGRESS_INTERVAL, made every honest `step()` see the swarm's epoch past its own and "catch up"
(take that epoch) instead of averaging, every epoch, for as long as it published. Measured here
(two honest peers, 10 s of virtual time, emulated network):

- sync: alone 38 rounds (parameters moved 22.6); beside the id 0 rounds, 38 and 42 catch-ups,
  the epoch counter at 46, the parameters never moved;
- DiLoCo (local_steps=4): alone 59 rounds; beside the id 0 rounds, 37 and 48 catch-ups, and the
  two models drifted apart (L1 distance 4.4).

A lead over a peer's own epoch (a higher epoch, or more epochs applied) now counts only when it
is backed (`ProgressTracker._backed`): a peer of our recent groups or one we follow reports as
much, or peers of two network origins do (subnets of open connections, never a count of
identities). After: sync 8 rounds, 1 catch-up each, the epoch counter at 9, parameters moved 7.7,
the two peers identical; DiLoCo 28 rounds, identical. (What is left is the cost of a live id at
our own epoch that never joins a round, as right after each of our epochs, before its next
claim: it is counted into the round, which waited out its window; now only its first: see
test_no_show.py.)
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch

import potluck
from potluck.core.dht_time import event_loop_clock
from potluck.net.emulated import EmulatedNetwork
from potluck.net.identity import Identity, PeerID
from potluck.net.origins import Origin
from potluck.optim import Optimizer
from potluck.optim.context import PROGRESS_INTERVAL
from potluck.optim.progress import PeerProgress, ProgressTracker
from tests.adversarial.members import claim_progress
from tests.emulated_swarm import run_on_shared_runner

RUN = "ahead"
BATCH, TARGET, COMPUTE = 8, 128, 0.02
SECONDS = 10.0
MADE_UP_IP = "10.66.0.1"  # the host of the made-up ids (several: one origin)


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))


async def claim_ahead(made_up: potluck.Peer, opts: list[Optimizer], lead: int = 1) -> None:
    """Publish, every PROGRESS_INTERVAL, epoch (and done) `lead` past the honest peers' highest."""
    fingerprint = opts[0].schema.fingerprint
    while True:
        epoch = max(o.local_epoch for o in opts) + lead
        await claim_progress(made_up, RUN, epoch=epoch, done=epoch, samples=BATCH, sps=400.0, fp=fingerprint)
        await asyncio.sleep(PROGRESS_INTERVAL)


async def scenario(made_up: int, lead: int = 1, **mode: Any) -> dict[str, Any]:
    """Two honest Optimizers train SECONDS of virtual time beside `made_up` ids (on one host) that
    claim to be `lead` epochs ahead, then on to the epoch after the latest of theirs (so that a
    round under way ends together, not with one of them alone); what they ended with."""
    loop = asyncio.get_running_loop()
    network = EmulatedNetwork(latency=0.01, seed=3)
    peers: list[potluck.Peer] = []
    for i in range(2 + made_up):
        transport = network.transport(ip=MADE_UP_IP if i >= 2 else None)
        peers.append(await potluck.Peer.create(peers[0].addresses if peers else [], transport=transport,
                                               clock=event_loop_clock()))
    models = [make_model() for _ in range(2)]
    start = [p.detach().clone() for p in models[0].parameters()]
    opts = [Optimizer(p, RUN, m.named_parameters(), lambda ps: torch.optim.SGD(ps, 0.1), target_batch_size=TARGET,
                      batch_size_per_step=BATCH, load_state=False, start=False, **mode)
            for p, m in zip(peers, models, strict=False)]
    for opt in opts:
        await opt.astart()
    claims = [asyncio.ensure_future(claim_ahead(p, opts, lead)) for p in peers[2:]]
    began = loop.time()

    stop: list[int] = []  # once the time is up, the epoch both train to: a round under way ends together

    async def train(i: int) -> None:
        generator = torch.Generator().manual_seed(i)
        while loop.time() - began < 3 * SECONDS:
            if loop.time() - began >= SECONDS:
                stop[:] = stop or [max(o.local_epoch for o in opts) + 1]
                if opts[i].local_epoch >= stop[0]:
                    break
            x = torch.randn(BATCH, 16, generator=generator)
            torch.nn.functional.cross_entropy(models[i](x), (x[:, 0] > 0).long()).backward()
            await asyncio.sleep(COMPUTE)
            await opts[i].astep()

    try:
        await asyncio.gather(train(0), train(1))
        a, b = (list(m.parameters()) for m in models)
        return {"epochs": [o.local_epoch for o in opts], "rounds": [o.context.rounds_completed for o in opts],
                "catch_ups": [o.context.catch_ups for o in opts],
                "moved": sum((p - q).abs().sum().item() for p, q in zip(a, start, strict=True)),
                "apart": sum((p - q).abs().sum().item() for p, q in zip(a, b, strict=True))}
    finally:
        for claim in claims:
            claim.cancel()
        for opt in opts:
            opt.shutdown()
        for peer in peers:
            await peer.ashutdown()


def assert_averaging(result: dict[str, Any]) -> None:
    """The honest peers averaged epoch after epoch: (nearly) every epoch came from a round, not
    from catching up with the made-up id; their parameters moved, and stayed alike."""
    for epochs, rounds, catch_ups in zip(result["epochs"], result["rounds"], result["catch_ups"], strict=True):
        assert rounds >= 5 and catch_ups <= 2 and epochs <= rounds + 2, result  # before: 0 rounds, epoch 46
    assert result["moved"] > 1.0 and result["apart"] == 0.0, result


@pytest.mark.timeout(120)
def test_sync_peers_keep_averaging_beside_an_id_one_epoch_ahead() -> None:
    assert_averaging(run_on_shared_runner(scenario(1), timeout=120))


@pytest.mark.timeout(120)
def test_diloco_peers_keep_averaging_beside_an_id_one_epoch_ahead() -> None:
    assert_averaging(run_on_shared_runner(scenario(1, mode="diloco", local_steps=4), timeout=120))


@pytest.mark.timeout(120)
def test_two_made_up_ids_on_one_host_back_nothing() -> None:
    """Two ids agreeing on the lead is two identities, not two origins: the lead stays unbacked
    (and with two of them the epoch one past theirs would count too, by MAX_EPOCH_LEAD alone)."""
    assert_averaging(run_on_shared_runner(scenario(2), timeout=120))


# -- the rule itself -------------------------------------------------------------------------------------
class Transport:
    """Open connections with some peers, each from a given subnet."""

    def __init__(self, subnets: dict[str, str]):
        self.subnets = subnets

    def add_handler(self, *args: Any) -> None: ...

    def is_connected(self, peer: PeerID) -> bool:
        return str(peer) in self.subnets

    def peer_origin(self, peer: PeerID) -> Origin:
        return Origin(self.subnets[str(peer)], self.subnets[str(peer)])


def test_a_lead_counts_only_backed_by_a_peer_we_know_or_by_two_origins() -> None:
    me, grouped, followed, a, b, c = (str(Identity.generate().peer_id) for _ in range(6))
    subnets = {a: "10.1.0.0/24", b: "10.1.0.0/24", c: "10.2.0.0/24"}
    tracker = ProgressTracker(None, Transport(subnets), RUN, me, 1000)
    local = PeerProgress(me, 5, 20, 100.0, 10.0, done=5)

    def at(peer: str, epoch: int, done: int | None = None) -> PeerProgress:
        return PeerProgress(peer, epoch, 20, 100.0, 10.0, done=epoch if done is None else done)

    def epoch(*reports: PeerProgress, of: PeerProgress = local) -> int:
        return tracker.estimate({r.peer_id: r for r in reports}, of).epoch

    assert epoch(at(a, 6), at(grouped, 5)) == 5  # one unknown id ahead: ignored
    assert epoch(at(a, 6), at(b, 6), at(grouped, 5)) == 5  # two of one subnet: still one origin
    assert epoch(at(a, 6), at(c, 6)) == 6  # two origins
    assert epoch(at(a, 5, done=5), at(b, 6, done=5)) == 5  # a lead in epoch alone needs backing too
    tracker.set_neighbors([grouped])
    assert epoch(at(a, 6), at(grouped, 6)) == 6  # a peer of our last group says as much
    tracker.set_neighbors([])  # ... and of an earlier one
    assert epoch(at(grouped, 6)) == 6
    tracker.followed = frozenset({followed})
    assert epoch(at(followed, 6), at(a, 5)) == 6
    # Before we trained or took a state our epoch is no evidence: a newcomer takes a lone run's epoch.
    fresh = PeerProgress(me, 0, 0, 0.0, 10.0)
    assert epoch(at(a, 1), of=fresh) == 1
