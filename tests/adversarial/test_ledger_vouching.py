"""Issue 29, "Credit counts identities": the monitor credits what its witnesses recorded, and a
round's keeper is a member the round's own records agree on, never one liar's word.

Before the fix the ledger took a round's keeper from whatever one member's record named and took
the round's samples off it (one liar zeroed an honest member's credit for every epoch), and
credited any two identities that recorded each other (a pair that never trained was credited
10^9 samples each: all of the run's credit). Sync-mode swarms on the emulated network under the
virtual clock, followed by a monitor that joined through the first honest peer (its witness).
"""

from __future__ import annotations

import asyncio
import dataclasses
import secrets
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import pytest
import torch

import potluck
from potluck.core.dht_time import event_loop_clock
from potluck.core.names import RunNames
from potluck.dht.records import own_subkey
from potluck.monitor.follower import Follower
from potluck.monitor.ledger import Ledger
from potluck.net.emulated import EmulatedNetwork
from potluck.optim import Optimizer
from potluck.optim.progress import ROUNDS_TTL, PublishedRounds, RoundRecord
from tests.emulated_swarm import run_on_shared_runner
from tests.test_monitor_ledger import BATCH, make_model, record_published, stop_monitored, train_on_noise, truth

RUN = "vouching"
TARGET = 96
EPOCHS = 5
BILLION = 10**9


async def monitored_swarm(trainers: int, extra: int, lie: Callable[..., Any]) -> dict:
    """`trainers` peers train EPOCHS epochs in sync mode and `extra` peers only join, with a
    monitor that joined through the first trainer; `lie(optimizers, extras, published)` sets the
    attack up before training (noting in `published` what it stores itself). Returns every round record published (the truth, and the lies), the credits
    of the monitor's ledger, and those of a ledger without witnesses fed the same records."""
    network = EmulatedNetwork(latency=0.01, seed=29)
    peers: list[potluck.Peer] = []
    for _ in range(trainers + extra):
        peers.append(await potluck.Peer.create(peers[0].addresses if peers else [], transport=network.transport(),
                                               clock=event_loop_clock()))
    optimizers = [Optimizer(peer, RUN, make_model().parameters(), lambda p: torch.optim.SGD(p, 0.1),
                            target_batch_size=TARGET, batch_size_per_step=BATCH, load_state=False, start=False)
                  for peer in peers[:trainers]]
    published: list[tuple[str, RoundRecord]] = []
    for opt in optimizers:
        record_published(opt, published)
    lie(optimizers, peers[trainers:], published)
    monitor = await potluck.Peer.create(peers[0].addresses, transport=network.transport(client_mode=True),
                                        clock=event_loop_clock())
    ledger = Ledger(":memory:", RUN)
    follower = Follower(monitor, RUN, ledger, poll_interval=0.25)
    following = asyncio.ensure_future(follower.run())
    try:
        for opt in optimizers:
            await opt.astart()
        await asyncio.wait_for(asyncio.gather(*(train_on_noise(o, i, EPOCHS) for i, o in enumerate(optimizers))),
                               120)
        await asyncio.sleep(0.5)
        following.cancel()
        await asyncio.gather(following, return_exceptions=True)
        await follower.poll()
        everyone = Ledger(":memory:", RUN)  # the same records, every member's counted (no witnesses)
        by_signer: dict[str, list[RoundRecord]] = defaultdict(list)
        for signer, record in published:
            by_signer[signer].append(record)
        everyone.observe(1.0, {}, by_signer)
        return {"published": published, "credits": ledger.credits(), "by_epoch": _by_epoch(ledger),
                "unwitnessed_by_epoch": _by_epoch(everyone), "ids": [p.peer_id for p in peers],
                "share": {c.peer_id: c.share for c in ledger.contributors()}}
    finally:
        await stop_monitored(following, follower, ledger, optimizers, [*peers, monitor])


def _by_epoch(ledger: Ledger) -> dict[tuple[str, int], int]:
    return {(peer, row.epoch): n for row in ledger.epochs(limit=1000) for peer, n in ledger.credits(row.epoch).items()
            if n}


def honest_truth(published: list[tuple[str, RoundRecord]], honest: list[str]) -> dict[tuple[str, int], int]:
    """What the honest members recorded (each honest member records a round alike)."""
    return truth([(signer, r) for signer, r in published if signer in honest])


@pytest.mark.timeout(300)
def test_one_liar_naming_an_honest_member_the_keeper_takes_nothing_from_it() -> None:
    """A real member records every round as a short one kept by the second honest peer. Before,
    the ledger took each round's samples off that peer: zero credit for every epoch."""
    def lie(optimizers: list[Optimizer], *_: Any) -> None:
        *_, victim, liar = optimizers
        publish = liar.tracker.record_round

        async def naming_the_victim(record: RoundRecord, token: bytes | None = None) -> None:
            await publish(dataclasses.replace(record, keeper=victim.peer.peer_id), token)
        liar.tracker.record_round = naming_the_victim
    run = run_on_shared_runner(monitored_swarm(3, 0, lie), timeout=300)
    honest = run["ids"][:2]
    expected = honest_truth(run["published"], honest)
    victim = run["ids"][1]
    assert any(r.keeper == victim for signer, r in run["published"] if signer == run["ids"][2])  # the lie was told
    for credits in (run["by_epoch"], run["unwitnessed_by_epoch"]):  # with the monitor's witness, and without any
        assert {k: n for k, n in credits.items() if k[0] == victim} == \
            {k: n for k, n in expected.items() if k[0] == victim} != {}


@pytest.mark.timeout(300)
def test_a_pair_vouching_for_each_other_earns_only_what_a_witness_saw_it_contribute() -> None:
    """Two identities record rounds together at every epoch, 10^9 samples each: one of them also
    trains with the honest peers (honestly), the other never trains. Before, both were credited
    10^9 per made-up round (all of the run's credit); now the trainer earns exactly what the
    monitor's witness recorded it averaging, and the other nothing."""
    def lie(optimizers: list[Optimizer], extras: list[potluck.Peer], published: list) -> None:
        sybil, partner = optimizers[-1], extras[0]
        publish = sybil.tracker.record_round
        made_up: list[RoundRecord] = []

        async def with_made_up_rounds(record: RoundRecord, token: bytes | None = None) -> None:
            await publish(record, token)
            fake = RoundRecord(record.epoch, 0, ((sybil.peer.peer_id, BILLION), (partner.peer_id, BILLION)), None,
                               record.time, secrets.token_hex(8))
            made_up.append(fake)
            published.append((partner.peer_id, fake))
            await publish(fake, token)
            await partner.dht.astore(RunNames(RUN).rounds, PublishedRounds(tuple(made_up[-16:])).to_wire(),
                                     partner.dht.get_time() + ROUNDS_TTL, subkey=own_subkey(partner.transport.peer_id))
        sybil.tracker.record_round = with_made_up_rounds
    run = run_on_shared_runner(monitored_swarm(3, 1, lie), timeout=300)
    honest, sybil, partner = run["ids"][:2], run["ids"][2], run["ids"][3]
    made_up = [r for signer, r in run["published"] if signer == sybil and BILLION in dict(r.samples).values()]
    assert len(made_up) >= EPOCHS - 1  # the lie was told, every epoch
    assert run["unwitnessed_by_epoch"].get((partner, made_up[0].epoch)) == BILLION  # and every member's word pays it
    expected = honest_truth(run["published"], honest)  # what the honest members averaged, the sybil's samples too
    assert {k: n for k, n in run["by_epoch"].items()} == expected
    assert run["credits"].get(partner, 0) == 0
    assert 0 < run["credits"][sybil] == sum(n for (p, _), n in expected.items() if p == sybil) < BILLION
    assert run["share"][sybil] < 0.5
