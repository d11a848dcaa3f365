"""What an attacker must contribute before it outvotes honest state donors or is credited
(`potluck.optim.vouching`, `potluck.monitor.ledger`; docs/security.md states the bounds).

Part 1, made-up identities (pure computation over the records they can publish): n identities
(1 to 1,000) publish full made-up histories, every one MAX_RECORDED_ROUNDS rounds listing each
other with 10^9 samples each, against two honest donors whose latest 16 rounds a witness (one of
them) recorded. One line per n: what backs the fake state and the honest one, the vote's winner,
the credit a monitor gives the identities with its witness and without any (every member's vote,
the rule before issue 29), and the time the vote and the credit take.

Part 2, real contribution (an emulated sync swarm under the virtual clock, a 263 KB model): a
witness W (a client-mode trainer: it holds no state to give), an honest donor H that trained in
the last h epochs and an attacker A that trained, honestly, in the last a epochs; then A and two
made-up identities serve one fake state with live progress, and a newcomer joins through W. One
line per (h, a): the witnessed rounds backing each state, what the newcomer took (honest, fake,
or refused: its own), the bytes A sent per round it joined, and the samples a monitor with W as
witness credits A (and H).

Usage: python benchmarks/vouching.py [--quick]
Prints one JSON object per line: {"metric", "value", "unit", ...parameters}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from typing import Any

import torch

import potluck
from potluck.averaging.state_transfer import DonorRecord, StateServer
from potluck.core.dht_time import event_loop_clock
from potluck.core.names import RunNames
from potluck.core.runner import acquire_runner, release_runner
from potluck.core.virtual_time import virtual_time_loop
from potluck.dht.records import own_subkey
from potluck.monitor.ledger import Ledger
from potluck.net.emulated import EmulatedNetwork
from potluck.optim import Optimizer
from potluck.optim.progress import MAX_RECORDED_MEMBERS, MAX_RECORDED_ROUNDS, PROGRESS_TTL, RoundRecord, fetch_rounds
from potluck.optim.vouching import back, elect, witnessed

BILLION = 10**9


def emit(**row: Any) -> None:
    print(json.dumps(row), flush=True)


# -- part 1: made-up identities -----------------------------------------------------------------------
def made_up(n: int) -> dict[str, list[RoundRecord]]:
    """n identities' records: each its latest MAX_RECORDED_ROUNDS rounds, with as many of the
    others as a record holds (MAX_RECORDED_MEMBERS entries), 10^9 samples each."""
    ids = [f"sybil{i}" for i in range(n)]
    per_round = max(2, min(n, MAX_RECORDED_MEMBERS // MAX_RECORDED_ROUNDS))
    records: dict[str, list[RoundRecord]] = {}
    for i, me in enumerate(ids):
        start = i - i % per_round  # the identities fall in cliques that fill a record
        clique = ids[start:start + per_round]
        records[me] = [RoundRecord(100 - k, 0, tuple((p, BILLION) for p in clique), None, 0.0, f"s{start}-{k}")
                       for k in range(MAX_RECORDED_ROUNDS)]
    return records


def honest_records() -> dict[str, list[RoundRecord]]:
    rounds = [RoundRecord(100 - k, 0, (("h1", 32), ("h2", 32)), None, 0.0, f"h-{k}")
              for k in range(MAX_RECORDED_ROUNDS)]
    return {"h1": list(rounds), "h2": list(rounds)}


def part1(sizes: list[int]) -> None:
    for n in sizes:
        records = {**honest_records(), **made_up(n)}
        sybils = [p for p in records if p.startswith("sybil")]
        began = time.perf_counter()
        backings = back([sybils, ["h1", "h2"]], witnessed(records, {"h1"}), {"h1"})
        winner = elect(backings)
        vote_ms = 1000 * (time.perf_counter() - began)
        credits = {}
        for label, witnesses in (("witnessed", {"h1"}), ("every_member", None)):
            ledger = Ledger(":memory:", "bench", witnesses=witnesses)
            began = time.perf_counter()
            ledger.observe(1.0, {}, records)
            credits[label] = (sum(n for p, n in ledger.credits().items() if p.startswith("sybil")),
                              1000 * (time.perf_counter() - began))
            ledger.close()
        emit(metric="made_up_identities_vote", value=["fake", "honest", None][2 if winner is None else winner],
             unit="winner", identities=n, fake_backing=backings[0].rounds, honest_backing=backings[1].rounds,
             vote_ms=round(vote_ms, 3))
        emit(metric="made_up_identities_credit", value=credits["witnessed"][0], unit="samples", identities=n,
             credit_without_witnesses=credits["every_member"][0], ledger_ms=round(credits["witnessed"][1], 1))


# -- part 2: real contribution ----------------------------------------------------------------------
RUN, TARGET, BATCH, COMPUTE = "vouching", 64, 8, 0.02
NAMES = RunNames(RUN)


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(256, 256)


async def train(opt: Optimizer, net: torch.nn.Module, seed: int, epochs: int) -> None:
    g = torch.Generator().manual_seed(seed)
    while opt.local_epoch < epochs:
        x = torch.randn(BATCH, 256, generator=g)
        net(x).square().mean().backward()
        await asyncio.sleep(COMPUTE)
        await opt.astep()


async def keep_claiming(peer: potluck.Peer, epoch: int) -> None:
    while True:
        now = peer.dht.get_time()
        record = {"epoch": epoch, "samples": 0, "sps": 0.0, "time": now, "client": False, "done": epoch}
        await peer.dht.astore(NAMES.progress, record, now + PROGRESS_TTL, subkey=own_subkey(peer.transport.peer_id))
        await asyncio.sleep(0.1)


async def swarm(epochs: int, attacker_trains: bool, through_witness: bool) -> dict:
    """W and H train `epochs` epochs (A with them if `attacker_trains`); then the attack, and a
    newcomer that joins through W (its witness) or through a host that trains nothing."""
    network = EmulatedNetwork(latency=0.01, seed=29)
    peers: list[potluck.Peer] = []

    async def peer(through: potluck.Peer | None = None) -> potluck.Peer:
        boot = (through or peers[0]).addresses if peers else []
        made = await potluck.Peer.create(boot, transport=network.transport(), clock=event_loop_clock())
        peers.append(made)
        return made

    host = await peer()  # a DHT node it could join through; it trains nothing
    w_peer, h_peer, a_peer = await peer(), await peer(), await peer()
    names = "wha" if attacker_trains else "wh"
    nets = {name: model() for name in names}
    opts = {name: Optimizer(p, RUN, nets[name].parameters(), lambda ps: torch.optim.SGD(ps, 0.1),
                            target_batch_size=TARGET, batch_size_per_step=BATCH, start=False, load_state=False)
            for name, p in zip(names, (w_peer, h_peer, a_peer), strict=False)}
    tasks, servers = [], []
    try:
        for opt in opts.values():
            await opt.astart()
        sent_before = a_peer.transport.stats.bytes_sent
        await asyncio.wait_for(asyncio.gather(*(train(opts[n], nets[n], i, epochs) for i, n in enumerate(names))), 300)
        await asyncio.sleep(0.5)
        a_sent = a_peer.transport.stats.bytes_sent - sent_before
        published = await fetch_rounds(host.dht, RUN)
        records = {signer: rounds for signer, (rounds, _) in (published or {}).items()}
        ledger = Ledger(":memory:", RUN, witnesses={w_peer.peer_id})
        ledger.observe(1.0, {}, records)
        credits = ledger.credits()
        rounds = witnessed(records, {w_peer.peer_id})
        a_rounds = sum(1 for members in rounds.values() if a_peer.peer_id in members)
        honest = [t.clone() for t in opts["h"].context.state.tensors()]
        if attacker_trains:
            opts.pop("a").shutdown()  # A stops training and serves a fake state, with two made-up friends
        fake = [torch.full_like(t, 42.0) for t in honest]
        version = opts["h"].local_epoch
        for liar in [a_peer, await peer(), await peer()]:
            servers.append(StateServer(liar.transport, lambda: (version, {"epoch": version}, fake),
                                       NAMES.averager("state")))
            await liar.dht.astore(NAMES.averager("state").donors, DonorRecord(version).to_wire(),
                                  liar.dht.get_time() + 600, subkey=own_subkey(liar.transport.peer_id))
            tasks.append(asyncio.ensure_future(keep_claiming(liar, version)))
        await asyncio.sleep(0.5)
        newcomer_peer = await peer(through=w_peer if through_witness else host)
        newcomer = Optimizer(newcomer_peer, RUN, model().parameters(), lambda ps: torch.optim.SGD(ps, 0.1),
                             target_batch_size=TARGET, batch_size_per_step=BATCH, start=False, load_state_timeout=20)
        own = [t.clone() for t in newcomer.context.state.tensors()]
        await newcomer.astart()
        got = newcomer.context.state.tensors()
        took = ("honest" if all(torch.equal(x, y) for x, y in zip(got, honest, strict=True)) else
                "fake" if all(torch.equal(x, y) for x, y in zip(got, fake, strict=True)) else
                "refused" if all(torch.equal(x, y) for x, y in zip(got, own, strict=True)) else "other")
        newcomer.shutdown()
        return {"took": took, "honest_backing": sum(1 for m in rounds.values() if h_peer.peer_id in m),
                "attacker_backing": a_rounds, "attacker_bytes_per_round": a_sent // a_rounds if a_rounds else None,
                "attacker_credit": credits.get(a_peer.peer_id, 0), "honest_credit": credits.get(h_peer.peer_id, 0),
                "model_bytes": sum(t.numel() * t.element_size() for t in honest)}
    finally:
        for task in tasks:
            task.cancel()
        for server in servers:
            server.close()
        for opt in opts.values():
            opt.shutdown()
        for p in peers:
            await p.ashutdown()


def part2(epochs: int) -> None:
    for attacker_trains, through_witness in ((False, True), (True, True), (True, False)):
        runner = acquire_runner(virtual_time_loop)
        try:
            result = runner.run(swarm(epochs, attacker_trains, through_witness), timeout=600)
        finally:
            release_runner()
        emit(metric="attack_after_real_rounds", value=result.pop("took"), unit="newcomer took", epochs=epochs,
             attacker_trained=attacker_trains, joined_through="witness" if through_witness else "dht_only_host",
             **result)


def sweep() -> None:
    """The rule's threshold: the witness (not a holder: the reader itself, catching up) recorded
    16 rounds; honest holders were in h of them, the attacker's in a."""
    for h in (16, 8):
        for a in (0, 8, 16):
            rounds = {(k, 0, str(k)): frozenset({*(["h"] if k < h else []), *(["a"] if k < a else []), "me"})
                      for k in range(MAX_RECORDED_ROUNDS)}
            winner = elect(back([["a", "s1", "s2"], ["h"]], rounds, {"me"}))
            took = ["fake", "honest", "refused"][2 if winner is None else winner]
            emit(metric="witnessed_rounds_threshold", value=took, unit="newcomer took", honest_rounds=h,
                 attacker_rounds=a, witness_rounds=MAX_RECORDED_ROUNDS)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer sizes and cases (under a minute)")
    args = parser.parse_args()
    part1([1, 10, 1000] if args.quick else [1, 10, 100, 1000])
    sweep()
    part2(6 if args.quick else 20)


if __name__ == "__main__":
    main()
