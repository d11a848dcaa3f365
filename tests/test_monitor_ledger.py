"""The monitor's ledger (issue 18): a peer is credited with the samples it was really averaged with.

One sync-mode swarm on the emulated network under the virtual clock, followed by a monitor
(`Follower` into a `Ledger` on a file): three peers train, a newcomer joins at 0.8 s, one of the
first three dies mid-epoch at 1.2 s, and the monitor itself is stopped at 1.5 s and restarted on the
same database 0.5 s later. The truth is what the trainers published in their round records (the
samples each contributor's note gave its group; honest members all record the same).
"""

from __future__ import annotations

import asyncio
import sqlite3
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import potluck
from potluck.core.dht_time import event_loop_clock
from potluck.monitor.follower import Follower
from potluck.monitor.ledger import SCHEMA_VERSION, Ledger, LedgerError
from potluck.net.emulated import EmulatedNetwork
from potluck.net.identity import Identity
from potluck.net.membership import MembershipGate, MembershipToken
from potluck.optim import Optimizer, progress
from potluck.optim.progress import PeerProgress, RoundRecord, fetch_rounds
from tests.emulated_swarm import run_on_shared_runner

RUN = "ledger"
BATCH, TARGET = 8, 128
COMPUTE = 0.02  # virtual seconds per batch
POLL = 0.25  # the monitor's poll interval (virtual seconds)
JOIN_AT, DIE_AT, RESTART_AT, RESTART_GAP = 0.8, 1.2, 1.5, 0.5
EPOCHS = 10  # the survivors train this many epochs
KEPT_ROUNDS = 4


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))


def record_published(opt: Optimizer, published: list[tuple[str, RoundRecord]]) -> None:
    """Note every round record `opt` publishes in `published`, as (publisher, record): the truth."""
    publish = opt.tracker.record_round

    async def recording(record: RoundRecord, token: bytes | None = None) -> None:
        published.append((opt.peer.peer_id, record))
        await publish(record, token)
    opt.tracker.record_round = recording


async def stop_monitored(following: asyncio.Future, follower: Follower, ledger: Ledger,
                         optimizers: list[Optimizer], peers: list[potluck.Peer]) -> None:
    """Stop the monitor's follower and ledger, then the trainers and `peers` (the monitor's among them)."""
    following.cancel()
    follower.close()
    ledger.close()
    for opt in optimizers:
        opt.shutdown()
    for peer in peers:
        await peer.ashutdown()


async def train_on_noise(opt: Optimizer, seed: int, epochs: int) -> None:
    """Random gradients, a batch every COMPUTE virtual seconds, until `opt` reaches `epochs`."""
    generator = torch.Generator().manual_seed(seed)
    while opt.local_epoch < epochs:
        for group in opt.param_groups:
            for p in group["params"]:
                p.grad = torch.randn(p.shape, generator=generator)
        await asyncio.sleep(COMPUTE)
        await opt.astep()


async def scenario(db: Path) -> dict:
    loop = asyncio.get_running_loop()
    network = EmulatedNetwork(latency=0.01, seed=7)
    peers: list[potluck.Peer] = []
    published: list[tuple[str, RoundRecord]] = []  # (publisher, record): the truth
    optimizers: list[Optimizer] = []

    async def add(load_state: bool) -> tuple[potluck.Peer, Optimizer, torch.nn.Module]:
        peer = await potluck.Peer.create(peers[0].addresses if peers else [], transport=network.transport(),
                                         clock=event_loop_clock())
        peers.append(peer)
        model = make_model()
        opt = Optimizer(peer, RUN, model.parameters(), lambda p: torch.optim.SGD(p, 0.1), target_batch_size=TARGET,
                        batch_size_per_step=BATCH, load_state=load_state, start=False)
        record_published(opt, published)
        await opt.astart()
        optimizers.append(opt)
        return peer, opt, model

    async def train(opt: Optimizer, model: torch.nn.Module, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        while opt.local_epoch < EPOCHS:
            x = torch.randn(BATCH, 8, generator=generator)
            loss = torch.nn.functional.cross_entropy(model(x), (x[:, 0] > 0).long())
            loss.backward()
            opt.report_metrics(loss=loss.item(), accuracy=0.5)
            await asyncio.sleep(COMPUTE)
            await opt.astep()

    trainers = [await add(load_state=False) for _ in range(3)]
    monitor = await potluck.Peer.create(peers[0].addresses, transport=network.transport(client_mode=True),
                                        clock=event_loop_clock())
    ledger = Ledger(db, RUN, history_interval=POLL)
    follower = Follower(monitor, RUN, ledger, poll_interval=POLL)
    following = asyncio.ensure_future(follower.run())
    tasks = [asyncio.ensure_future(train(opt, model, i)) for i, (_, opt, model) in enumerate(trainers)]
    start = loop.time()
    result: dict = {}
    try:
        await asyncio.sleep(JOIN_AT)
        newcomer, new_opt, new_model = await add(load_state=True)
        result["newcomer"], result["joined_at_epoch"] = newcomer.peer_id, new_opt.local_epoch
        tasks.append(asyncio.ensure_future(train(new_opt, new_model, 9)))
        await asyncio.sleep(start + DIE_AT - loop.time())
        dead, dead_opt = trainers[2][0], trainers[2][1]
        tasks[2].cancel()
        result["dead"], result["died_in_epoch"] = dead.peer_id, dead_opt.accumulating_epoch
        dead_opt.shutdown()
        await dead.ashutdown()
        await asyncio.sleep(start + RESTART_AT - loop.time())
        following.cancel()
        await asyncio.gather(following, return_exceptions=True)
        follower.close()
        ledger.close()
        await asyncio.sleep(RESTART_GAP)
        ledger = Ledger(db, RUN, history_interval=POLL)
        follower = Follower(monitor, RUN, ledger, poll_interval=POLL)
        following = asyncio.ensure_future(follower.run())
        await asyncio.wait_for(asyncio.gather(*(t for i, t in enumerate(tasks) if i != 2)), 120)
        await asyncio.sleep(2 * POLL)  # the last rounds' records reach the DHT and the monitor
        following.cancel()
        await asyncio.gather(following, return_exceptions=True)
        await follower.poll()  # read once more: nothing is counted twice
        result["rounds_in_the_dht"] = {(r.epoch, r.part) for peer, (records, _) in
                                       (await fetch_rounds(monitor.dht, RUN)).items() if peer != dead.peer_id
                                       for r in records}  # (the dead peer's record lives on for a minute)
        result.update(published=published, credits=_credits(ledger), contributors=ledger.contributors(),
                      epochs=ledger.epochs(), history=ledger.history(), peers=ledger.peers(),
                      now=ledger.swarm_now(), trained=[p.peer_id for p in peers])
        return result
    finally:
        for t in tasks:
            t.cancel()
        await stop_monitored(following, follower, ledger, optimizers, [*peers, monitor])


def _credits(ledger: Ledger) -> dict[tuple[str, int], int]:
    epochs = {row.epoch for row in ledger.epochs(limit=1000)}
    return {(peer, e): n for e in epochs for peer, n in ledger.credits(e).items() if n}


def truth(published: list[tuple[str, RoundRecord]]) -> dict[tuple[str, int], int]:
    """Each peer's samples in each epoch's rounds, as honest members recorded them (a short
    round's samples count for their members, and not again in the note of the member that
    carried them on)."""
    rounds = {(r.epoch, r.part, r.round, frozenset(dict(r.samples))): r for _, r in published}
    samples: dict[tuple[str, int], int] = defaultdict(int)
    for r in rounds.values():
        for peer, n in r.samples:
            samples[peer, r.epoch] += n
        if r.keeper is not None:
            samples[r.keeper, r.epoch] -= sum(n for _, n in r.samples)
    return {k: n for k, n in samples.items() if n}


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    with pytest.MonkeyPatch.context() as patch:
        # Peers keep their last 4 rounds (about 1 s of this run) in their records: the rounds from
        # before the monitor's restart are gone from the DHT by the end, so only its database has them.
        patch.setattr(progress, "MAX_RECORDED_ROUNDS", KEPT_ROUNDS)
        return run_on_shared_runner(scenario(tmp_path_factory.mktemp("ledger") / "monitor.db"), timeout=300)


def test_the_ledger_credits_exactly_the_samples_that_were_averaged(run: dict) -> None:
    expected = truth(run["published"])
    assert run["credits"] == expected
    # an epoch's credit is its rounds' samples: what scaled the update the members applied
    closing = {(r.epoch, frozenset(dict(r.samples))): sum(n for _, n in r.samples)
               for _, r in run["published"] if r.keeper is None}
    per_epoch: dict[int, int] = defaultdict(int)
    for (epoch, _), total in closing.items():
        per_epoch[epoch] += total
    rows = {row.epoch: row for row in run["epochs"]}
    assert {e: rows[e].samples for e in per_epoch} == dict(per_epoch)
    assert all(n >= TARGET for n in per_epoch.values())
    assert len(per_epoch) >= EPOCHS - 1
    assert all(rows[e].group_sizes and sum(rows[e].group_sizes) >= 2 for e in per_epoch)
    contributors = {c.peer_id: c for c in run["contributors"]}
    total = sum(expected.values())
    for peer in run["trained"]:
        credited = sum(n for (p, _), n in expected.items() if p == peer)
        assert contributors[peer].samples == credited
        assert contributors[peer].share == pytest.approx(credited / total)
        assert contributors[peer].online_hours > 0


def test_a_peer_that_dies_mid_epoch_is_credited_for_the_rounds_it_completed_only(run: dict) -> None:
    dead = run["dead"]
    credited = {epoch for (peer, epoch) in run["credits"] if peer == dead}
    # (the epoch it died in counts where its pieces were in before it died: the others averaged them)
    assert credited and max(credited) <= run["died_in_epoch"], (credited, run["died_in_epoch"])
    assert {k: n for k, n in run["credits"].items() if k[0] == dead} == \
        {k: n for k, n in truth(run["published"]).items() if k[0] == dead}
    assert not next(p for p in run["peers"] if p.peer_id == dead).online


def test_a_newcomer_is_credited_from_its_first_round(run: dict) -> None:
    newcomer = run["newcomer"]
    credited = sorted(epoch for (peer, epoch) in run["credits"] if peer == newcomer)
    first_round = min(r.epoch for _, r in run["published"] if newcomer in dict(r.samples))
    assert credited[0] == first_round >= run["joined_at_epoch"]
    assert len(credited) >= EPOCHS - first_round - 1


def test_a_restarted_monitor_resumes_from_its_database(run: dict) -> None:
    """The monitor was down for RESTART_GAP mid-run and read every record again at the end: the
    credits above equal the truth, so nothing was lost or counted twice. Its view and charts go on."""
    assert min(run["rounds_in_the_dht"])[0] > max(epoch for (_, epoch) in run["credits"]) - KEPT_ROUNDS
    restarted_in = 4  # rounds before it is in the database only (the restart came at about epoch 6)
    assert min(epoch for (_, epoch) in run["credits"]) + restarted_in < min(run["rounds_in_the_dht"])[0]
    assert run["now"].epoch >= EPOCHS - 1 and run["now"].target_batch_size == TARGET
    history = run["history"]
    assert len(history) >= 3 and all(a.time < b.time for a, b in zip(history, history[1:], strict=False))
    assert any(p.loss is not None for p in history)
    assert all(set(row.metrics) == {"loss", "accuracy"} for row in run["epochs"][:3])


def report(peer: str, epoch: int, failed: int = 0, loss: float | None = None, time: float = 0.0) -> PeerProgress:
    metrics = (("loss", loss),) if loss is not None else ()
    return PeerProgress(peer, epoch, 0, 10.0, time, failed=failed, metrics=metrics, metrics_time=time, target=64)


def test_ledger_counts_failed_rounds_and_metrics_once_and_refuses_a_newer_schema(tmp_path: Path) -> None:
    db = tmp_path / "m.db"
    with Ledger(db, "run") as ledger:
        ledger.observe(1.0, {"a": report("a", 3, failed=1, loss=2.0, time=1.0)}, {})
        ledger.observe(2.0, {"a": report("a", 3, failed=3, loss=1.0, time=2.0),
                             "b": report("b", 3, failed=0, loss=3.0, time=2.0)}, {})
        ledger.observe(2.5, {"a": report("a", 3, failed=3, loss=1.0, time=2.0)}, {})  # the same record again
    with Ledger(db, "run") as ledger:  # reopened: the counter goes on from where it was
        ledger.observe(3.0, {"a": report("a", 4, failed=4, time=3.0)}, {})
        rows = {row.epoch: row for row in ledger.epochs()}
        assert rows[3].failed_rounds == 2 and rows[4].failed_rounds == 1
        assert rows[3].metrics == {"loss": pytest.approx(2.0)}  # 2.0, 1.0 (a), 3.0 (b)
        assert next(c for c in ledger.contributors() if c.peer_id == "a").online_hours == pytest.approx(2 / 3600)
    with pytest.raises(LedgerError, match="run 'run', not 'other'"):
        Ledger(db, "other")
    connection = sqlite3.connect(db)
    connection.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    connection.close()
    with pytest.raises(LedgerError, match="newer potluck"):
        Ledger(db, "run")


def test_metrics_keep_a_row_per_peer_and_epoch_however_often_peers_report(tmp_path: Path) -> None:
    """Peers that report every step, polled every second: a row per report (schema 1) grew the
    ledger by about 2 GB a day for 50 peers. Now each peer's sum and count per epoch."""
    with Ledger(tmp_path / "m.db", "run") as ledger:
        for t in range(1, 301):
            epoch = 5 + t // 100
            ledger.observe(float(t), {p: report(p, epoch, failed=t, loss=float(t % 7) + i, time=float(t))
                                      for i, p in enumerate(["a", "b", "c"])}, {})  # (failures make epoch rows)
        assert ledger._scalar("SELECT COUNT(*) FROM metrics") == 3 * 4  # 3 peers x epochs 5-8
        rows = {row.epoch: row for row in ledger.epochs()}
        losses = [float(t % 7) + i for t in range(100, 200) for i in range(3)]
        assert rows[6].metrics == {"loss": pytest.approx(sum(losses) / len(losses))}


def test_a_schema_1_ledger_is_migrated_with_its_metrics(tmp_path: Path) -> None:
    db = tmp_path / "old.db"
    connection = sqlite3.connect(db)
    connection.executescript("""
        CREATE TABLE metrics (peer_id TEXT NOT NULL, time REAL NOT NULL, epoch INTEGER NOT NULL, name TEXT NOT NULL,
                              value REAL NOT NULL, PRIMARY KEY (peer_id, time, name));
        INSERT INTO metrics VALUES ('a', 1.0, 3, 'loss', 2.0), ('a', 2.0, 3, 'loss', 1.0), ('b', 2.0, 3, 'loss', 3.0);
        PRAGMA user_version = 1;""")
    connection.close()
    with Ledger(db, "run") as ledger:
        ledger.observe(3.0, {"a": report("a", 3, time=3.0)}, {})
        ledger.observe(3.5, {"a": report("a", 3, failed=1, time=3.5)}, {})  # epoch 3 gets its row
        assert {row.epoch: row for row in ledger.epochs()}[3].metrics == {"loss": pytest.approx(2.0)}
        ledger.observe(4.0, {"b": report("b", 3, loss=7.0, time=4.0)}, {})
        assert {row.epoch: row for row in ledger.epochs()}[3].metrics == {"loss": pytest.approx(13.0 / 4)}
    assert sqlite3.connect(db).execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION


def test_names_come_from_membership_tokens_that_admit_their_publisher() -> None:
    authority, stranger = Identity.generate(), Identity.generate()
    alice, bob, carol, dave = (Identity.generate().peer_id for _ in range(4))
    gate = MembershipGate(authority.peer_id, RUN, clock=lambda: 100.0)
    transport = SimpleNamespace(add_handler=lambda *_: None, remove_handler=lambda *_: None, membership=gate)
    follower = Follower(SimpleNamespace(dht=None, transport=transport, peer_id="monitor"), RUN, Ledger(":memory:"))

    def token(peer: object, signer: Identity = authority, name: str = "alice") -> bytes:
        return MembershipToken.issue(signer, peer, name, RUN, 200.0).to_wire()
    names = follower._names({str(alice): ([], token(alice)), str(bob): ([], token(alice, name="mallory")),
                             str(carol): ([], token(carol, stranger, "carol")), str(dave): ([], b"junk"),
                             "not a peer id": ([], token(alice))})
    assert names == {str(alice): "alice"}  # bob showed alice's token, a stranger signed carol's, dave's is junk


async def local_update_swarm(mode: str, every_trainer_a_witness: bool) -> dict:
    """Three peers in `mode` (moshpit or diloco) for a few rounds, followed by a monitor that joined
    through the first of them (its witness), or that names every trainer a witness."""
    network = EmulatedNetwork(latency=0.01, seed=3)
    peers: list[potluck.Peer] = []
    published: list[tuple[str, RoundRecord]] = []
    for _ in range(4):
        peers.append(await potluck.Peer.create(peers[0].addresses if peers else [], transport=network.transport(),
                                               clock=event_loop_clock()))
    *trainers, monitor = peers
    optimizers = []
    for peer in trainers:
        opt = Optimizer(peer, RUN, make_model().parameters(), lambda p: torch.optim.SGD(p, 0.1), target_batch_size=TARGET,
                        batch_size_per_step=BATCH, mode=mode, local_steps=4, load_state=False, start=False)
        record_published(opt, published)
        optimizers.append(opt)
    ledger = Ledger(":memory:", RUN)
    witnesses = [p.peer_id for p in trainers] if every_trainer_a_witness else None
    follower = Follower(monitor, RUN, ledger, poll_interval=POLL, witnesses=witnesses)
    following = asyncio.ensure_future(follower.run())
    try:
        for opt in optimizers:
            await opt.astart()
        await asyncio.wait_for(asyncio.gather(*(train_on_noise(o, i, 4) for i, o in enumerate(optimizers))), 120)
        await asyncio.sleep(2 * POLL)
        await follower.poll()
        return {"published": published, "credits": _credits(ledger), "witness": trainers[0].peer_id}
    finally:
        await stop_monitored(following, follower, ledger, optimizers, peers)


@pytest.mark.parametrize("mode", ["moshpit", "diloco"])
@pytest.mark.parametrize("every_trainer_a_witness", [False, True])
def test_local_update_modes_credit_the_samples_of_the_rounds_a_witness_averaged_in(
        mode: str, every_trainer_a_witness: bool) -> None:
    """Only rounds a witness recorded are credited (docs/security.md): all of them in DiLoCo, whose
    rounds take everyone; in moshpit's small groups, the witness's own, unless the monitor names
    more witnesses (here: every trainer, as an operator of all three machines would)."""
    run = run_on_shared_runner(local_update_swarm(mode, every_trainer_a_witness), timeout=300)
    together = [(p, r) for p, r in run["published"] if len(r.samples) >= 2]  # averaged with someone
    witnessed = [(p, r) for p, r in together if every_trainer_a_witness or run["witness"] in dict(r.samples)]
    assert witnessed and run["credits"] == truth(witnessed)
    if mode == "diloco" or every_trainer_a_witness:
        assert witnessed == together
    assert all(n % (4 * BATCH) == 0 for n in run["credits"].values())  # local_steps batches each round
