"""Issue 18: a member that lies about its samples gets only what the other members confirm.

Two honest peers and a liar train in sync mode (emulated network, virtual clock), followed by a
monitor. The liar averages honestly (its round notes are what it computed: the others check what
they average), but claims 50 times its samples in its progress records, records 100 times its
samples for itself in its round records and 0 for the others, and at the end publishes a round
record of an epoch that never happened, crediting itself and a peer it made up with a million
samples each. A naive monitor taking each peer's own records at their word would credit the liar
100 times its share (checked below on what the DHT held: the lie was published); the ledger
credits it exactly what the honest members averaged with it, and the honest peers in full.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections import defaultdict
from pathlib import Path

import pytest
import torch

import potluck
from potluck.core.dht_time import event_loop_clock
from potluck.monitor.follower import Follower
from potluck.monitor.ledger import Ledger
from potluck.net.emulated import EmulatedNetwork
from potluck.net.identity import Identity
from potluck.optim import Optimizer
from potluck.optim.progress import RoundRecord, fetch_rounds
from tests.emulated_swarm import run_on_shared_runner
from tests.test_monitor_ledger import BATCH, make_model, record_published, stop_monitored, train_on_noise, truth

RUN = "liar"
TARGET = 96
EPOCHS = 6
LIE = 100  # the liar's round records claim this many times its samples
FAKE_EPOCH, MILLION = 10_000, 1_000_000


async def scenario(db: Path) -> dict:
    network = EmulatedNetwork(latency=0.01, seed=11)
    peers: list[potluck.Peer] = []
    optimizers: list[Optimizer] = []
    honest_records: list[tuple[str, RoundRecord]] = []
    for _ in range(3):
        peer = await potluck.Peer.create(peers[0].addresses if peers else [], transport=network.transport(),
                                         clock=event_loop_clock())
        peers.append(peer)
        opt = Optimizer(peer, RUN, make_model().parameters(), lambda p: torch.optim.SGD(p, 0.1),
                        target_batch_size=TARGET, batch_size_per_step=BATCH, load_state=False, start=False)
        optimizers.append(opt)
    *honest, liar = optimizers
    liar_id = liar.peer.peer_id
    for opt in honest:
        record_published(opt, honest_records)
    publish_truly, report_truly = liar.tracker.record_round, liar.tracker.report

    async def lying_record(record: RoundRecord, token: bytes | None = None) -> None:
        claims = tuple((p, n * LIE if p == liar_id else 0) for p, n in record.samples)
        await publish_truly(dataclasses.replace(record, samples=claims), token)

    async def lying_report(epoch: int, samples: int, sps: float, *args, **kwargs) -> None:
        await report_truly(epoch, samples * 50, sps * 50, *args, **kwargs)
    liar.tracker.record_round, liar.tracker.report = lying_record, lying_report
    monitor = await potluck.Peer.create(peers[0].addresses, transport=network.transport(client_mode=True),
                                        clock=event_loop_clock())
    ledger = Ledger(db, RUN)
    follower = Follower(monitor, RUN, ledger, poll_interval=0.25)
    following = asyncio.ensure_future(follower.run())
    try:
        for opt in optimizers:
            await opt.astart()
        await asyncio.wait_for(asyncio.gather(*(train_on_noise(o, i, EPOCHS) for i, o in enumerate(optimizers))),
                               120)
        sybil = str(Identity.generate().peer_id)
        await publish_truly(RoundRecord(FAKE_EPOCH, 0, ((liar_id, MILLION), (sybil, MILLION),
                                                        (honest[0].peer.peer_id, 1))))
        await asyncio.sleep(0.5)
        following.cancel()
        await asyncio.gather(following, return_exceptions=True)
        await follower.poll()
        published = await fetch_rounds(monitor.dht, RUN)
        claimed = sum(n for r in published[liar_id][0] for p, n in r.samples if p == liar_id)
        liar_epochs = {r.epoch for r in published[liar_id][0]}
        return {"liar": liar_id, "sybil": sybil, "honest": [o.peer.peer_id for o in honest],
                "honest_records": honest_records, "claimed_in_dht": claimed, "liar_epochs_in_dht": liar_epochs,
                "credits": {e: ledger.credits(e) for e in [*(row.epoch for row in ledger.epochs()), FAKE_EPOCH]
                            if ledger.credits(e)},
                "contributors": {c.peer_id: c for c in ledger.contributors()}}
    finally:
        await stop_monitored(following, follower, ledger, optimizers, [*peers, monitor])


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return run_on_shared_runner(scenario(tmp_path_factory.mktemp("liar") / "monitor.db"), timeout=300)


def test_a_liar_is_credited_only_what_the_other_members_confirm(run: dict) -> None:
    expected = truth(run["honest_records"])  # what the honest members averaged, the liar's samples included
    credited = defaultdict(int)
    for credits in run["credits"].values():
        for peer, n in credits.items():
            credited[peer] += n
    liar_truly = sum(n for (p, _), n in expected.items() if p == run["liar"])
    assert liar_truly > 0 and credited[run["liar"]] == liar_truly
    # the naive rule (each peer's own record) would have credited it 100 times that: the lie was there
    in_dht = sum(n for (p, e), n in expected.items() if p == run["liar"] and e in run["liar_epochs_in_dht"]
                 and e != FAKE_EPOCH)
    assert run["claimed_in_dht"] >= LIE * in_dht + MILLION > 0


def test_the_liars_records_take_nothing_from_the_honest_and_invent_nobody(run: dict) -> None:
    expected = truth(run["honest_records"])
    for peer in run["honest"]:
        assert {e: c[peer] for e, c in run["credits"].items() if peer in c} == \
            {e: n for (p, e), n in expected.items() if p == peer}
    assert FAKE_EPOCH not in run["credits"]  # the round nobody else recorded credits nobody
    # its share is what it truly averaged (here more than either honest peer's: how the emulated
    # peers' batches fall into rounds), not what it claimed
    truly = defaultdict(int)
    for (peer, _), n in expected.items():
        truly[peer] += n
    assert run["contributors"][run["liar"]].share == pytest.approx(truly[run["liar"]] / sum(truly.values()))
    assert run["sybil"] not in run["contributors"]
