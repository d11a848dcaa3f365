"""Malicious members over many rounds (drift) and in training, under each aggregation.

Part "drift" (the default): how far do attackers move the honest peers over ROUNDS rounds? n
members average vectors of DIM coordinates through the reducers' own code: each member reduces one
shard (`robust.aggregate`, or the mean), and each honest reducer keeps its averager's record
(`potluck.averaging.suspicion.SuspicionLedger`), records the step's pieces once all are in and
leaves out whom it suspects or banned (as `ShardReducer` does: a sender one reducer leaves out
is out of the whole step). Honest pieces are mu + sigma N(0, I) (mu fixed: a steady gradient,
sigma = 1); the f attackers all send, knowing the honest pieces of the round:
  alie        mean - 1.0 std, per coordinate ("a little is enough", Baruch et al. 2019)
  ipm         -0.5 x the honest mean (inner-product manipulation, Xie et al. 2020)
  sign_flip   minus its own honest gradient
  far_edge    honest mean + (largest honest distance from it) x a fixed unit vector
  other_data  mu' + sigma N(0, I): a gradient of other data (mu' another fixed vector)
  patient     its own honest gradient + PATIENT_OFFSET sigma on every coordinate (not in the
              default list: the slowest to find out; --drift-attacks patient)
The honest peers' parameters add up the results (SGD with lr 1, no loss pulling them back: the
worst case, where every round's bias stays); the honest-only run averages the n - f honest
pieces alone with the same aggregation. One JSON row per run: "byzantine_drift", value = the
largest distance over the rounds between the two runs' parameters, per coordinate (RMS) in
sigma, with the distance after the first round (one round's bias), after 20, 50, 100 and the
last round, "from_attackers_honest" (the largest distance from a run in which the attackers had
sent their own honest gradients in the rounds they were counted in: for an attack built on the
attacker's own gradient, the lie's effect without the noise of its samples, which moves a run
from the honest-only one too, like the square root of the rounds it is counted in), the round
from which the attackers were left out, and the honest members ever banned; with consequences
(the library's behaviour) and without (`consequences: false`: the record disabled, as before it
existed). Rows "byzantine_drift_honest" give the honest-only run's
distance from the plain mean of the honest pieces (what the robust aggregation itself costs).

Part "training": how far do attackers push training, under each aggregation?

8 peers (`--peers`) on the emulated network (virtual clock, one process, one torch thread) train the demo's
CNN on scikit-learn's digits (`potluck.cli.tasks`: same model, initial weights and split as
`potluck demo` and `potluck compare`) data-parallel, as potluck's sync mode does: at every step
(an epoch of sync mode) each peer computes the gradient of 128 of its own samples (a global batch
of 1024, benchmarks/training.py's target_batch_size), the 8 average their gradients with a
`potluck.Averager` (one group of 8; the group meets through the DHT once, then again with
`members=`), and every honest peer applies the averaged gradient with Adam (lr 6e-3, as
benchmarks/training.py). Honest peers start from the same weights and receive bit-identical
averages, so they hold one model; its test accuracy after the last step is the run's result.

Attackers are 1 or 2 of the 8 peers. Each computes its honest gradient g, sends instead
  sign_flip  -g                       (the BTARD paper's sign flipping),
  scaled     -100 g                   (sign-flipped and scaled x100),
  random     100 * rms(g) * N(0, 1)   (noise, each coordinate, 100 times g's scale),
  or one of part drift's attacks (alie, ipm, far_edge: from the honest gradients of the step;
  other_data: the gradient of its batch with every label shifted by one),
and (scaled and random only: the others claim 1, to stay hidden) claims weight ATTACKER_WEIGHT
(1e30: with the mean, reducers bound it to
MAX_WEIGHT_OVER_MEDIAN x the median; robust aggregations count each sender once) while honest
peers claim 1.

For each aggregation ("mean", "centered_clip", "trimmed_mean") the script runs all-honest (8
honest peers) and every attack with 1 and 2 attackers, and prints one JSON object per run:
  {"metric": "byzantine_accuracy", "aggregation": ..., "attack": ..., "attackers": f,
   "value": final test accuracy, "reduce_ms_per_step": ..., "wall_seconds_per_step": ...,
   "failed_steps": ...}
then, per aggregation, a summary row: accuracy with everyone honest, the worst under attack and
how many points that is below the all-honest run with the mean, and the cost with everyone
honest: reduce_ms_per_step (CPU the 8 reducers spent aggregating in one step, all shards of the
38,570-float gradient) and chunk_aggregation_ms (one chunk of 2^18 floats from 8 senders), each
beside the mean's. wall_seconds_per_step is the whole simulation's CPU per step (8 peers'
gradients, the emulated protocol, the reducers): the virtual clock counts no CPU, and on a
shared machine this figure follows the machine's load more than the aggregation.

Usage: python benchmarks/byzantine.py [--part drift|training|all] [--rounds 200] [--dim 2048]
           [--groups 1/4,2/5,3/10] [--drift-attacks alie,ipm,sign_flip,far_edge,other_data] [--undo-rounds K]
           [--patient-offset E] [--worker-momentum B]
       python benchmarks/byzantine.py --part training [--steps 60] [--aggregations mean,centered_clip,trimmed_mean]
           [--attacks sign_flip,scaled,random] [--attackers 1,2] [--peers 8] [--target ACC] [--clip-radius R]
           [--jobs 1] [--seed 0] [--quick]
(--quick: drift over 50 rounds with 2 of 5 attackers; training as below. Drift runs the robust
aggregations only: the mean keeps no record of deviations, and one liar moves it anywhere.)
(--jobs: runs in that many processes at once; each run is one process's work, so accuracies do
not change; CPU timings do when the processes compete for cores.)
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import datetime
import json
import logging
import math
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "src"))

from emulated_swarm import make_swarm  # noqa: E402

from potluck.averaging import Averager, robust  # noqa: E402
from potluck.averaging.accountability import BanList  # noqa: E402
from potluck.averaging.allreduce import CHUNK_ELEMENTS  # noqa: E402
from potluck.averaging.allreduce.reducer import ShardReducer  # noqa: E402
from potluck.averaging.allreduce.reduction import weighted_chunk  # noqa: E402
from potluck.averaging.suspicion import SuspicionLedger  # noqa: E402
from potluck.cli.tasks import accuracy, load_data, make_model  # noqa: E402
from potluck.core.virtual_time import run_virtual  # noqa: E402

PEERS = 8
BATCH = 128
LR = 6e-3
ATTACK_SCALE = 100.0
ATTACKER_WEIGHT = 1e30
BANDWIDTH = 100e6  # bytes/s each way, per emulated peer
LATENCY = 0.005


DRIFT_ATTACKS = ("alie", "ipm", "sign_flip", "far_edge", "other_data")
ALIE_Z = 1.0  # standard deviations (the paper's z_max for 2 of 5 is 0.84, for 1 of 4 zero)
IPM_EPSILON = 0.5
PATIENT_OFFSET = 0.2  # sigma per coordinate, the same way every round (--patient-offset)
# Worker momentum (what-if): rounds of momentum before the first measured one, in time constants
# 1 / (1 - momentum): the momenta are then within e^-5 of their steady state.
WARMUP_TIME_CONSTANTS = 5


def drift_attack(kind: str, honest: torch.Tensor, own: torch.Tensor, mu_other: torch.Tensor, edge: torch.Tensor,
                 g: torch.Generator, offset: float = PATIENT_OFFSET) -> torch.Tensor:
    mean = honest.mean(0)
    if kind == "alie":
        return mean - ALIE_Z * honest.std(0)
    if kind == "ipm":
        return -IPM_EPSILON * mean
    if kind == "sign_flip":
        return -own
    if kind == "far_edge":
        return mean + (honest - mean).norm(dim=1).max() * edge
    if kind == "other_data":
        return mu_other + torch.randn(mean.shape, generator=g)
    if kind == "patient":
        return own + offset
    raise ValueError(kind)


def aggregate_shard(aggregation: str, pieces: list[torch.Tensor], out: torch.Tensor) -> dict[int, float]:
    if aggregation == "mean":
        torch.stack(pieces).mean(0, out=out)
        return {}
    return robust.aggregate(aggregation, pieces, [1.0] * len(pieces), out, measure=True)


def drift(aggregation: str, attack_kind: str | None, n: int, f: int, rounds: int, dim: int, consequences: bool,
          seed: int, undo_rounds: int = 0, momentum: float = 0.0, offset: float = PATIENT_OFFSET) -> dict:
    """One run of part "drift" (see the module docstring). `undo_rounds` (a what-if, not what the
    library does): once senders are left out, the results of the last `undo_rounds` rounds they
    were counted in are recomputed without them and the difference added to this round's.
    `momentum` (a what-if too, worker momentum): every member sends m = momentum x m + (1 -
    momentum) x its gradient instead of the gradient, after WARMUP_TIME_CONSTANTS / (1 - momentum)
    rounds of it before the first measured one (a run in progress, not one whose momenta are
    still near zero); the attacks are computed on the honest momenta; reducers record each
    sender's implied gradient (m_t - momentum x m_t-1) / (1 - momentum), whose honest noise is new
    at every step as the record needs; both runs step on the aggregated momentum."""
    torch.set_num_threads(1)
    logging.getLogger("potluck").setLevel(logging.ERROR)  # each ban is logged; the row counts them
    if attack_kind is None:  # the honest members alone
        n, f = n - f, 0
    g = torch.Generator().manual_seed(seed)
    mu, mu_other, edge = torch.randn(dim, generator=g), torch.randn(dim, generator=g), torch.randn(dim, generator=g)
    edge /= edge.norm()
    peers = [f"member{i}" for i in range(n)]  # attackers first
    bounds = [(k * dim // n, (k + 1) * dim // n) for k in range(n)]
    ledgers = {k: SuspicionLedger(BanList()) for k in range(f, n)} if consequences else {}
    params, reference, plain, counterfactual = (torch.zeros(dim) for _ in range(4))
    out, ref, cf = torch.empty(dim), torch.empty(dim), torch.empty(dim)
    named: dict[int, list[int]] = {}
    distances, biases, left_from = [], [], None
    history: list[tuple[list[torch.Tensor], list[int]]] = []  # the last rounds' pieces and senders (undo)
    # worker momentum (what-if): the honest members', an attacker's own and its other data's
    momenta = torch.zeros(n - f + 2 if momentum else 0, dim)
    warmup = math.ceil(WARMUP_TIME_CONSTANTS / (1 - momentum)) if momentum else 0
    sent = None  # the pieces of the round before (implied gradients)
    for t in range(-warmup, rounds):
        honest = mu + torch.randn(n - f, dim, generator=g)
        own = mu + torch.randn(dim, generator=g)
        if momentum:
            other = mu_other + torch.randn(dim, generator=g)
            momenta.mul_(momentum).add_(torch.cat([honest, own[None], other[None]]), alpha=1 - momentum)
            honest, own = momenta[:n - f].clone(), momenta[n - f].clone()
            if t < 0:
                sent = torch.cat([momenta[n - f:n - f + 1].expand(f, dim), honest])  # the attackers were honest
                continue
        bad = ((momenta[n - f + 1].clone() if momentum and attack_kind == "other_data"
                else drift_attack(attack_kind, honest, own, mu_other, edge, g, offset)) if f else None)
        pieces = [bad] * f + list(honest)
        recorded = pieces
        if momentum:
            now = torch.stack(pieces)
            recorded = list((now - momentum * sent) / (1 - momentum))
            sent = now
        left: set[int] = set()
        for k, ledger in ledgers.items():
            lo, hi = bounds[k]
            ledger.record(lo, peers, [p[lo:hi] for p in recorded], [peers[i] for i in named.get(k, ())])
            left |= {peers.index(p) for p in ledger.left_out(peers)}
        if f and left_from is None and set(range(f)) <= left:
            left_from = t
        senders = [i for i in range(n) if i not in left]
        for k, (lo, hi) in enumerate(bounds):
            measured = aggregate_shard(aggregation, [pieces[i][lo:hi] for i in senders], out[lo:hi])
            named[k] = [senders[j] for j in robust.far_pieces(measured)[1]]
            aggregate_shard(aggregation, [h[lo:hi] for h in honest], ref[lo:hi])
            aggregate_shard(aggregation, [(own if i < f else pieces[i])[lo:hi] for i in senders], cf[lo:hi])
        for h, (old_pieces, old_senders) in enumerate(history):
            kept = [i for i in old_senders if i not in left]
            if len(kept) < len(old_senders):  # undo their part of that round, once
                history[h] = (old_pieces, kept)
                was, now = torch.empty(dim), torch.empty(dim)
                for lo, hi in bounds:
                    aggregate_shard(aggregation, [old_pieces[i][lo:hi] for i in old_senders], was[lo:hi])
                    aggregate_shard(aggregation, [old_pieces[i][lo:hi] for i in kept], now[lo:hi])
                out += now - was
        history = (history + [(pieces, senders)])[-undo_rounds:] if undo_rounds else []
        params += out
        reference += ref
        plain += honest.mean(0)
        counterfactual += cf
        distances.append(((params - reference).norm() / dim ** 0.5).item())
        biases.append(((params - counterfactual).norm() / dim ** 0.5).item())
    at = {f"drift_after_{r}": round(distances[r - 1], 3) for r in (1, 20, 50, 100) if r <= rounds}
    honest_banned = sorted({p for ledger in ledgers.values() for p in peers[f:] if p in ledger.excluded})
    return {"value": round(max(distances), 3), **at, "drift_last": round(distances[-1], 3),
            "from_attackers_honest": round(max(biases), 3),
            "left_out_from_round": left_from, "honest_banned": len(honest_banned),
            "honest_only_from_mean": round(((reference - plain).norm() / dim ** 0.5).item(), 3)}


def emit(row: dict) -> None:
    print(json.dumps(row), flush=True)


def attack(kind: str, grad: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    if kind == "sign_flip":
        return -grad
    if kind == "scaled":
        return -ATTACK_SCALE * grad
    if kind == "random":
        return ATTACK_SCALE * grad.pow(2).mean().sqrt() * torch.randn(grad.shape, generator=g)
    raise ValueError(kind)


def flat_grad(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])


class ReduceTimer:
    """CPU time the reducers spend aggregating (ShardReducer._reduce, on the event loop's thread),
    summed over a run."""

    seconds = 0.0
    _original = ShardReducer._reduce

    @classmethod
    def install(cls) -> None:
        def timed(reducer: Any, *args: Any) -> None:
            t0 = time.thread_time()
            try:
                cls._original(reducer, *args)
            finally:
                cls.seconds += time.thread_time() - t0
        ShardReducer._reduce = timed


def train(aggregation: str, attack_kind: str | None, attackers: int, steps: int, clip_radius: float,
          seed: int, n: int = PEERS, target: float = 0.0) -> dict:
    """One training run of `n` peers (in its own process with --jobs); see the module docstring.
    `target`: a test accuracy; the first step after which the honest model reaches it is reported."""
    torch.set_num_threads(1)
    robust.CLIP_RADIUS = clip_radius
    ReduceTimer.install()
    ReduceTimer.seconds = 0.0
    x_train, y_train, x_test, y_test = load_data()
    model = make_model()  # the honest peers' one model (they stay bit-identical)
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    size = sum(p.numel() for p in model.parameters())
    rngs = [torch.Generator().manual_seed(100 * seed + 100 + i) for i in range(n)]  # batches, noise
    edge = torch.randn(size, generator=torch.Generator().manual_seed(seed))
    edge /= edge.norm()  # far_edge's direction
    loud = attack_kind in ("scaled", "random")  # these also claim a huge weight; the others stay hidden

    async def main() -> dict:
        net, peers = await make_swarm(n, latency=LATENCY, bandwidth=BANDWIDTH)
        # The honest peers go on without attackers their reducers banned (averaging.suspicion).
        averagers = [Averager(p, [torch.zeros(size)], "byzantine", target_group_size=n,
                              min_group_size=n - attackers,
                              matchmaking_time=1.0, allreduce_timeout=30.0, bandwidth=BANDWIDTH,
                              allow_state_sharing=False, aggregation=aggregation) for p in peers]
        members = None
        failed, averaging_wall, reached = 0, 0.0, None
        for step in range(steps):
            grads = []
            for i in range(n):
                picks = torch.randint(len(y_train), (BATCH,), generator=rngs[i])
                labels = (y_train[picks] + 1) % 10 if attack_kind == "other_data" and i < attackers else y_train[picks]
                model.zero_grad()
                torch.nn.functional.cross_entropy(model(x_train[picks]), labels).backward()
                grads.append(flat_grad(model))
            honest_grads = torch.stack(grads[attackers:])
            for i, avg in enumerate(averagers):
                grad = grads[i]
                if i < attackers and attack_kind in DRIFT_ATTACKS:  # other_data: its labels were wrong
                    grad = grad if attack_kind == "other_data" else \
                        drift_attack(attack_kind, honest_grads, grad, grad, edge, rngs[i])
                elif i < attackers:
                    grad = attack(attack_kind, grad, rngs[i])
                with avg.get_tensors() as tensors:
                    tensors[0].copy_(grad)
            t0 = time.perf_counter()
            results = await asyncio.gather(
                *(a.astep(weight=ATTACKER_WEIGHT if i < attackers and loud else 1.0, group_key=f"step{step}",
                          members=members)
                  for i, a in enumerate(averagers)), return_exceptions=True)
            averaging_wall += time.perf_counter() - t0
            honest = results[attackers]
            if isinstance(honest, BaseException):
                failed += 1
                continue
            members = honest.peers
            with averagers[attackers].get_tensors() as tensors:
                averaged = tensors[0]
                offset = 0
                for p in model.parameters():
                    p.grad.copy_(averaged[offset:offset + p.numel()].view_as(p))
                    offset += p.numel()
            optimizer.step()
            if target and reached is None and accuracy(model, x_test, y_test) >= target:
                reached = step + 1
        for a in averagers:
            a.shutdown()
        identical = all(torch.equal(averagers[i]._tensors[0], averagers[attackers]._tensors[0])
                        for i in range(attackers, n))
        return {"failed_steps": failed, "averaging_wall": averaging_wall, "honest_identical": identical,
                "steps_to_target": reached}

    t0 = time.perf_counter()
    out = run_virtual(main())
    wall = time.perf_counter() - t0
    acc = accuracy(model, x_test, y_test)
    return {"value": round(acc, 4), "reduce_ms_per_step": round(1000 * ReduceTimer.seconds / steps, 2),
            "wall_seconds_per_step": round(wall / steps, 4),
            "averaging_wall_seconds_per_step": round(out["averaging_wall"] / steps, 4),
            "failed_steps": out["failed_steps"], "honest_identical": out["honest_identical"],
            **({"target": target, "steps_to_target": out["steps_to_target"]} if target else {})}


def aggregation_cost(aggregation: str, repeats: int = 5) -> float:
    """Milliseconds to reduce one chunk of CHUNK_ELEMENTS floats from PEERS honest senders."""
    g = torch.Generator().manual_seed(0)
    pieces = [torch.randn(CHUNK_ELEMENTS, generator=g) for _ in range(PEERS)]
    out, scratch = torch.empty(CHUNK_ELEMENTS), torch.empty(CHUNK_ELEMENTS)
    t0 = time.perf_counter()
    for _ in range(repeats):
        if aggregation == "mean":
            weighted_chunk({i: [p] for i, p in enumerate(pieces)}, dict.fromkeys(range(PEERS), 1.0),
                            tuple(range(PEERS)), 0, out, scratch)
        else:
            robust.aggregate(aggregation, pieces, [1.0] * PEERS, out)
    return (time.perf_counter() - t0) / repeats * 1000


def drift_part(args: argparse.Namespace, common: dict) -> None:
    """Part "drift": every aggregation x attack x group, with and without consequences."""
    groups = [tuple(int(x) for x in g.split("/")) for g in args.groups.split(",")]
    robust_ones = [a for a in args.aggregations.split(",") if a != "mean"]  # the mean keeps no record
    runs = [(agg, kind, f, n, on) for agg in robust_ones for f, n in groups
            for kind in [None, *args.drift_attacks.split(",")] for on in ((True,) if kind is None else (True, False))]
    with concurrent.futures.ProcessPoolExecutor(args.jobs) as pool:
        futures = [pool.submit(drift, agg, kind, n, f, args.rounds, args.dim, on, args.seed, args.undo_rounds,
                               args.worker_momentum, args.patient_offset)
                   for agg, kind, f, n, on in runs]
        for (agg, kind, f, n, on), future in zip(runs, futures, strict=True):
            result = future.result()
            metric = "byzantine_drift" if kind else "byzantine_drift_honest"
            if kind is None:
                result = {"value": result["honest_only_from_mean"], "honest_banned": result["honest_banned"]}
            emit({"metric": metric, "unit": "sigma", "aggregation": agg, "attack": kind or "none",
                  "attackers": f, "members": n, "consequences": on, "rounds": args.rounds, "dim": args.dim,
                  **({"undo_rounds": args.undo_rounds} if args.undo_rounds else {}),
                  **({"worker_momentum": args.worker_momentum} if args.worker_momentum else {}),
                  **({"patient_offset": args.patient_offset} if kind == "patient" else {}), **result, **common})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", choices=("drift", "training", "all"), default="drift")
    parser.add_argument("--rounds", type=int, default=200, help="drift: rounds")
    parser.add_argument("--dim", type=int, default=2048, help="drift: coordinates of the averaged vector")
    parser.add_argument("--groups", default="1/4,2/5,3/10", help="drift: attackers/members")
    parser.add_argument("--drift-attacks", default=",".join(DRIFT_ATTACKS))
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--aggregations", default="mean,centered_clip,trimmed_mean")
    parser.add_argument("--attacks", default="sign_flip,scaled,random,alie,ipm,far_edge,other_data")
    parser.add_argument("--attackers", default="1,2")
    parser.add_argument("--clip-radius", type=float, default=robust.CLIP_RADIUS,
                        help="CenteredClip's radius in median distances (for tuning; the default is the library's)")
    parser.add_argument("--undo-rounds", type=int, default=0,
                        help="drift, a what-if (not the library's behaviour): undo the contributions of the last "
                             "K rounds of senders once they are left out")
    parser.add_argument("--patient-offset", type=float, default=PATIENT_OFFSET,
                        help="drift: what the patient attack adds to every coordinate, in sigma")
    parser.add_argument("--worker-momentum", type=float, default=0.0,
                        help="drift, a what-if (not the library's behaviour): members send their gradients' "
                             "momentum with this coefficient, and both runs step on its aggregate")
    parser.add_argument("--peers", type=int, default=PEERS, help="training: peers, attackers included")
    parser.add_argument("--target", type=float, default=0.0,
                        help="training: a test accuracy; each run reports the step after which it first reached it")
    parser.add_argument("--jobs", type=int, default=1, help="runs in parallel processes")
    parser.add_argument("--seed", type=int, default=0, help="picks the peers' batches (the model starts the same)")
    parser.add_argument("--quick", action="store_true",
                        help="drift: 50 rounds, 2 of 5; training: 20 steps, the scaled attack only, 2 attackers")
    args = parser.parse_args()
    if args.quick:
        args.steps, args.attacks, args.attackers, args.rounds, args.groups = 20, "scaled", "2", 50, "2/5"
    torch.set_num_threads(1)
    robust.CLIP_RADIUS = args.clip_radius
    now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    if args.part in ("drift", "all"):
        drift_part(args, {"clip_radius": args.clip_radius, "seed": args.seed, "host": platform.node(), "date": now})
    if args.part in ("training", "all"):
        training_part(args, now)


def training_part(args: argparse.Namespace, now: str) -> None:
    """Part "training" (see the module docstring)."""
    common = {"peers": args.peers, "steps": args.steps, "batch_per_peer": BATCH, "clip_radius": args.clip_radius,
              "seed": args.seed, "host": platform.node(), "date": now}
    aggregations = args.aggregations.split(",")
    scenarios = [(None, 0)] + [(a, int(f)) for f in args.attackers.split(",") for a in args.attacks.split(",")]
    runs = [(agg, kind, f) for agg in aggregations for kind, f in scenarios]
    with concurrent.futures.ProcessPoolExecutor(args.jobs) as pool:
        futures = [pool.submit(train, agg, kind, f, args.steps, args.clip_radius, args.seed, args.peers, args.target)
                   for agg, kind, f in runs]
        rows = []
        for (agg, kind, f), future in zip(runs, futures, strict=True):
            row = {"metric": "byzantine_accuracy", "aggregation": agg, "attack": kind or "none", "attackers": f,
                   **future.result(), **common}
            emit(row)
            rows.append(row)
    honest = {r["aggregation"]: r for r in rows if r["attackers"] == 0}
    reference = honest.get("mean")
    chunk_ms = {agg: aggregation_cost(agg) for agg in {"mean", *aggregations}}
    for agg in aggregations:
        worst = min((r["value"] for r in rows if r["aggregation"] == agg and r["attackers"]), default=None)
        summary = {"metric": "byzantine_summary", "aggregation": agg, "all_honest_accuracy": honest[agg]["value"],
                   "worst_attacked_accuracy": worst,
                   "honest_reduce_ms_per_step": honest[agg]["reduce_ms_per_step"],
                   "honest_wall_seconds_per_step": honest[agg]["wall_seconds_per_step"],
                   "chunk_aggregation_ms": round(chunk_ms[agg], 2),
                   "mean_chunk_aggregation_ms": round(chunk_ms["mean"], 2),
                   "chunk_elements": CHUNK_ELEMENTS}
        if reference is not None and worst is not None:
            summary["worst_points_below_all_honest_mean"] = round(100 * (reference["value"] - worst), 2)
            summary["mean_reduce_ms_per_step"] = reference["reduce_ms_per_step"]
            summary["mean_wall_seconds_per_step"] = reference["wall_seconds_per_step"]
        emit({**summary, **common})


if __name__ == "__main__":
    main()
