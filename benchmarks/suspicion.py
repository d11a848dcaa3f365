"""The record of deviations (`potluck.averaging.suspicion`) on a real network's gradients and on
noise that lies in few directions: how high do honest members score, and how soon is a liar out?

Part "cnn": N peers (3, 4, 5) on 127.0.0.1 train the demo's digits CNN with the sync Optimizer
under CenteredClip for EPOCHS epochs (global batch 512, 32 per step, Adam 3e-3, as
tests/test_optimizer.py), and every piece each reducer records is kept. Those recorded steps are
then replayed through a fresh `SuspicionLedger` each: as they were (all honest), and with member
0 (and 1) replaced by a liar:
  alie      the step's mean + e x the per-coordinate spread x a fixed random sign vector
            (e = 1, 2; with two colluders sending it too)
  push      its own gradient + 1 x the per-coordinate spread x that sign vector
Rows "suspicion_cnn": per group size, the highest honest score over the replayed series as they
were and over the attacked ones, the replays in which an honest member was ever left out, and per
attack the steps after which the liar was first left out (one per recorded shard; null: not
within the run).

Part "stress": honest members whose noise lies in RANK shared directions (each member moves along
each by its own N(0, 1) amount) plus 0.1 N(0, I), SIZE coordinates, 200 steps, SEEDS seeds per
setting; rows "suspicion_stress": runs in which an honest member was left out or excluded, and
the highest honest score.

Part "first-look": the first look at a cohort's second step (`suspicion.FIRST_LOOK_Z`, behind
`FIRST_LOOK_GATE`), on honest members only. Rows "first_look_synthetic": draws of two steps of 5, 6
or 8 members, noise independent across coordinates or in 1 to 512 shared directions (plus 0.1 N(0, I)),
with and without persistent differences between members' data and one member 3x noisier; per
noise kind, the members left out and how often the gate opened. Rows "first_look_cnn": the digits
CNN's recorded pieces (as part "cnn", 5 peers), every two consecutive steps taken as a
fresh cohort's first two: the honest members left out, how often the gate opened, and, with a liar
(alie_1, push_1 as in part "cnn"), how often the first look left it out.

    python benchmarks/suspicion.py [--part cnn|stress|first-look|all] [--epochs 30] [--seeds 15]
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import platform
import threading
from collections import defaultdict

import torch

SIZE, STEPS = 512, 200
GROUPS, RANKS = (3, 4, 6), (1, 2, 8)
PEERS = (3, 4, 5)
BATCH, TARGET, LR = 32, 512, 3e-3


def record_cnn(n: int, epochs: int) -> list[list[list[torch.Tensor]]]:
    """Train n TCP peers for `epochs` epochs under CenteredClip; every recorded shard's pieces, step by step."""
    import potluck
    from potluck.averaging import suspicion
    from potluck.cli.tasks import load_data, make_model
    from potluck.optim import Optimizer

    x, y, _, _ = load_data()
    series: dict[tuple[int, int], list[list[torch.Tensor]]] = defaultdict(list)
    lock = threading.Lock()
    original = suspicion.SuspicionLedger.record

    def record(self, start, peers, pieces, *args, **kwargs):
        if len(pieces) == n:
            with lock:
                series[(id(self), start)].append([p.clone() for p in pieces])
        return original(self, start, peers, pieces, *args, **kwargs)
    suspicion.SuspicionLedger.record = record
    peers, optimizers, models = [], [], []
    try:
        for i in range(n):
            peers.append(potluck.Peer(host="127.0.0.1", initial_peers=peers[0].addresses if peers else []))
            models.append(make_model())
            optimizers.append(Optimizer(peers[i], f"suspicion-{n}", models[i].parameters(),
                                        lambda p: torch.optim.Adam(p, LR), target_batch_size=TARGET,
                                        batch_size_per_step=BATCH, aggregation="centered_clip", load_state=False))

        def train(i: int) -> None:
            generator = torch.Generator().manual_seed(i)
            while optimizers[i].local_epoch < epochs:
                batch = torch.randint(0, len(y), (BATCH,), generator=generator)
                torch.nn.functional.cross_entropy(models[i](x[batch]), y[batch]).backward()
                optimizers[i].step()
        threads = [threading.Thread(target=train, args=(i,), daemon=True) for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(600)
    finally:
        suspicion.SuspicionLedger.record = original
        for opt in optimizers:
            opt.shutdown()
        for peer in peers:
            peer.shutdown()
    return [steps for steps in series.values() if len(steps) >= 5]


def replay(steps: list[list[torch.Tensor]], attack: str | None = None, e: float = 1.0,
           liars: tuple[int, ...] = ()) -> tuple[int | None, float, bool]:
    """(the step after which every liar was first left out, the highest honest score, whether an
    honest member was ever left out)."""
    from potluck.averaging.accountability import BanList
    from potluck.averaging.suspicion import SuspicionLedger

    n, size = len(steps[0]), steps[0][0].numel()
    sign = torch.randint(0, 2, (size,), generator=torch.Generator().manual_seed(1)).float() * 2 - 1
    ledger, names = SuspicionLedger(BanList()), [f"member{i}" for i in range(n)]
    honest = [p for i, p in enumerate(names) if i not in liars]
    first, highest, framed = None, 0.0, False
    for t, pieces in enumerate(steps):
        x = torch.stack([p.reshape(-1) for p in pieces])
        spread = x.std(dim=0)
        for i in liars:
            x[i] = (x.mean(dim=0) if attack == "alie" else x[i]) + e * spread * sign
        ledger.record(0, names, list(x))
        out = ledger.left_out(names)
        if liars and first is None and all(names[i] in out for i in liars):
            first = t + 1
        framed |= any(p in out for p in honest)
        scores = ledger.scores(0, size)
        highest = max([highest, *(scores[p] for p in honest)])
    return first, highest, framed


def cnn_part(args: argparse.Namespace, common: dict) -> None:
    attacks = {"alie_1": ("alie", 1.0, (0,)), "alie_2": ("alie", 2.0, (0,)),
               "alie_2_two_colluders": ("alie", 2.0, (0, 1)), "push_1": ("push", 1.0, (0,))}
    for n in PEERS:
        recorded = record_cnn(n, args.epochs)
        runs = [replay(steps) for steps in recorded]
        attacked = {name: [replay(steps, kind, e, liars) for steps in recorded]
                    for name, (kind, e, liars) in attacks.items() if len(liars) < n / 2}
        under_attack = [r for rs in attacked.values() for r in rs]
        print(json.dumps({"metric": "suspicion_cnn", "peers": n, "epochs": args.epochs, "series": len(recorded),
                          "steps": [len(s) for s in recorded],
                          "highest_honest_score": round(max(r[1] for r in runs), 2),
                          "highest_honest_score_under_attack": round(max(r[1] for r in under_attack), 2),
                          "honest_left_out": sum(r[2] for r in runs + under_attack),
                          "liar_out_after_steps": {k: [r[0] for r in rs] for k, rs in attacked.items()}, **common}),
              flush=True)


def stress_part(args: argparse.Namespace, common: dict) -> None:
    from potluck.averaging.accountability import BanList
    from potluck.averaging.suspicion import SuspicionLedger

    for n in GROUPS:
        for rank in RANKS:
            left, excluded, highest = 0, 0, 0.0
            for seed in range(args.seeds):
                g = torch.Generator().manual_seed(100 + seed)
                directions = torch.randn(rank, SIZE, generator=g)
                ledger, names = SuspicionLedger(BanList()), [f"member{i}" for i in range(n)]
                out = set()
                for _ in range(STEPS):
                    ledger.record(0, names, [torch.randn(rank, generator=g) @ directions
                                             + 0.1 * torch.randn(SIZE, generator=g) for _ in names])
                    out |= set(ledger.left_out(names))
                    highest = max([highest, *ledger.scores(0, SIZE).values()])
                left += bool(out)
                excluded += bool(len(ledger.excluded))
            print(json.dumps({"metric": "suspicion_stress", "members": n, "rank": rank, "runs": args.seeds,
                              "steps": STEPS, "size": SIZE, "runs_with_someone_left_out": left,
                              "runs_with_someone_excluded": excluded, "highest_score": round(highest, 2), **common}),
                  flush=True)


def first_look_rows(steps: list[list[torch.Tensor]], attack: str | None = None, e: float = 1.0,
                    liars: tuple[int, ...] = ()) -> tuple[int, int, int, int]:
    """Every two consecutive recorded steps as a fresh cohort's first two: (cohorts, gate open,
    honest members left out, cohorts whose liars were all left out)."""
    from potluck.averaging.accountability import BanList
    from potluck.averaging.suspicion import FIRST_LOOK_GATE, SuspicionLedger, _spread_over_directions

    n, size = len(steps[0]), steps[0][0].numel()
    sign = torch.randint(0, 2, (size,), generator=torch.Generator().manual_seed(1)).float() * 2 - 1
    names = [f"member{i}" for i in range(n)]
    cohorts = opened = framed = caught = 0
    for t in range(len(steps) - 1):
        ledger, pair = SuspicionLedger(BanList()), []
        for pieces in steps[t:t + 2]:
            x = torch.stack([p.reshape(-1) for p in pieces])
            spread = x.std(dim=0)
            for i in liars:
                x[i] = (x.mean(dim=0) if attack == "alie" else x[i]) + e * spread * sign
            pair.append(x)
            ledger.record(0, names, list(x))
        out = ledger.left_out(names)
        cohorts += 1
        opened += _spread_over_directions(pair[0] - pair[0].mean(0), pair[1] - pair[1].mean(0)) <= FIRST_LOOK_GATE
        framed += sum(names[i] in out for i in range(n) if i not in liars)
        caught += bool(liars) and all(names[i] in out for i in liars)
    return cohorts, opened, framed, caught


def first_look_part(args: argparse.Namespace, common: dict) -> None:
    import itertools

    from potluck.averaging.accountability import BanList
    from potluck.averaging.suspicion import FIRST_LOOK_GATE, SuspicionLedger, _spread_over_directions

    for kind, rank in [("iid", 0), *(("low", r) for r in (1, 3, 8, 32, 128, 512))]:
        members = framed = cohorts = opened = 0
        for n, size, hetero, noisier in itertools.product((5, 6, 8), (64, 512, 4096), (0.0, 1.0, 3.0), (False, True)):
            if rank >= size:
                continue
            for seed in range(args.seeds * (8 if size <= 512 else 2)):
                g = torch.Generator().manual_seed(hash((kind, rank, n, size, hetero, noisier, seed)) % 2**31)
                directions = torch.randn(max(rank, 1), size, generator=g)
                offsets = torch.stack([hetero * (1 + i) / n * torch.randn(size, generator=g) for i in range(n)])
                scales = torch.tensor([3.0 if noisier and i == 0 else 1.0 for i in range(n)])[:, None]
                ledger, names, xs = SuspicionLedger(BanList()), [f"member{i}" for i in range(n)], []
                for _ in range(2):
                    noise = torch.randn(n, size, generator=g) if kind == "iid" else (
                        torch.randn(n, rank, generator=g) @ directions + 0.1 * torch.randn(n, size, generator=g))
                    x = scales * noise + offsets
                    xs.append(x - x.mean(0))
                    ledger.record(0, names, list(x))
                members, cohorts = members + n, cohorts + 1
                framed += len(ledger.left_out(names))
                opened += _spread_over_directions(*xs) <= FIRST_LOOK_GATE
        print(json.dumps({"metric": "first_look_synthetic", "noise": kind, "directions": rank or None,
                          "members": members, "honest_left_out": framed, "cohorts": cohorts,
                          "gate_open": round(opened / cohorts, 3), **common}), flush=True)
    for n in (5,):  # (the first look needs FIRST_LOOK_MEMBERS)
        recorded = record_cnn(n, args.epochs)
        cohorts, opened, framed, _ = map(sum, zip(*(first_look_rows(s) for s in recorded), strict=True))
        row = {"metric": "first_look_cnn", "peers": n, "series": len(recorded), "cohorts": cohorts,
               "gate_open": round(opened / cohorts, 3), "honest_left_out": framed}
        for name, (kind, e) in {"alie_1": ("alie", 1.0), "push_1": ("push", 1.0)}.items():
            c, o, f, caught = map(sum, zip(*(first_look_rows(s, kind, e, (0,)) for s in recorded), strict=True))
            row[name] = {"liar_left_out": caught, "gate_open": o, "honest_left_out": f}
        print(json.dumps({**row, "cohorts_of": "two consecutive recorded steps", **common}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=("cnn", "stress", "first-look", "all"), default="all")
    parser.add_argument("--epochs", type=int, default=30, help="cnn: epochs of each recorded run")
    parser.add_argument("--seeds", type=int, default=15, help="stress: runs per setting")
    args = parser.parse_args()
    logging.getLogger("potluck").setLevel(logging.ERROR)
    now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    common = {"host": platform.node(), "date": now}
    if args.part in ("stress", "all"):
        stress_part(args, common)
    if args.part in ("cnn", "all"):
        cnn_part(args, common)
    if args.part in ("first-look", "all"):
        first_look_part(args, common)


if __name__ == "__main__":
    main()
