"""Verified training (`potluck.optim.Verified`): how soon is a lying member caught, is an honest
one ever banned, and how far apart are two honest computations of the same gradient?

Part "detection" (the default): 4 peers on the emulated network (virtual clock, one process)
train a small classifier on a fixed synthetic dataset in sync mode with `verify=Verified(...,
fraction=F)` (default 0.1: each peer spends about a tenth of its compute validating). Per run:
  honest      4 honest peers for EPOCHS epochs: any ban is a false positive;
  scaled      member 3 sends 1.5 x its gradients;
  other_data  member 3 computes its gradients on batches of its own choosing (other samples of
              the same dataset), not on its public batches.
An attack run ends once every honest peer has banned the liar (or at EPOCHS). Each run prints a
JSON row; then per attack a summary: runs, runs in which the liar was caught, the epoch of the
first ban and of the last honest peer's ban (median, 90th percentile, max), honest peers ever
banned, and the share of compute spent validating (samples recomputed / samples trained).

Part "training": every attack (scaled; sign_flip: -4 x its gradients; other_data) for a whole
run of EPOCHS epochs, with 1 of 4 and 2 of 5 members lying, against the honest members alone:
the honest peers' test loss at the end beside the honest-only run's (rows "verified_training").

Part "tolerance": the relative L2 error between two computations of the same batches' mean
gradient that may differ in float order (1 torch thread against 2; one batch of 64 against two
of 32 at once would change the math, so it is not compared), for the demo's CNN on digits and
for a small transformer, over BATCHES batches each: the largest is the nondeterminism a
validator must tolerate. With `--device cuda`, also the same gradients computed twice on the GPU,
and on the CPU against the GPU with TF32 off, with torch's defaults (cuDNN's convolutions in
TF32, matrix products not) and with TF32 on; potluck.optim.verified.TOLERANCE must sit far above it and far below
the error of a lie (a gradient scaled by 1.001 is off by 1e-3).

Usage: python benchmarks/verified.py [--runs 20] [--epochs 60] [--fraction 0.1] [--training-runs 3]
       [--configs 4:1,5:2] [--part detection|tolerance|training|all] [--device cuda]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

import potluck  # noqa: E402
from potluck.averaging.accountability import ban_list  # noqa: E402
from potluck.core.dht_time import event_loop_clock  # noqa: E402
from potluck.core.runner import acquire_runner, release_runner  # noqa: E402
from potluck.core.virtual_time import virtual_time_loop  # noqa: E402
from potluck.net.emulated import EmulatedNetwork  # noqa: E402
from potluck.optim import Optimizer, Verified  # noqa: E402
from potluck.optim.verified import TOLERANCE  # noqa: E402

BATCH, TARGET, PEERS = 8, 32, 4


def dataset() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(1024, 16, generator=g)
    y = (x[:, 0] > 0).long() + 2 * (x[:, 1] > 0).long()
    return list(zip(x, y, strict=True))


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))


def loss(model: torch.nn.Module, batch) -> torch.Tensor:
    x, y = batch
    return torch.nn.functional.cross_entropy(model(x), y)


SCALES = {"scaled": 1.5, "sign_flip": -4.0}  # what a lying member multiplies its loss by


async def scene(attack: str, epochs: int, fraction: float, seed: int, data, size: int = PEERS, liars: int = 1,
                until_caught: bool = True, test=None) -> dict:
    network = EmulatedNetwork(latency=0.01, seed=seed)
    peers: list[potluck.Peer] = []
    for _ in range(size):
        peers.append(await potluck.Peer.create(peers[0].addresses if peers else [], transport=network.transport(),
                                               clock=event_loop_clock()))
    models = [make_model() for _ in peers]
    optimizers = [Optimizer(peer, f"verified{seed}", model.parameters(), lambda p: torch.optim.SGD(p, 0.05),
                            target_batch_size=TARGET, batch_size_per_step=BATCH, load_state=False, start=False,
                            verify=Verified(model, loss, data, fraction=fraction))
                  for peer, model in zip(peers, models, strict=True)]
    lying = [] if attack == "honest" else list(range(size - liars, size))
    for i in lying:
        optimizers[i].validation.self_checked = True  # a liar skips the check of its own gradients
    honest = [i for i in range(size) if i not in lying]
    trained = [0] * size
    done = asyncio.Event()

    async def train(i: int) -> None:
        other = torch.Generator().manual_seed(1000 * (i + 1) + seed)
        while optimizers[i].local_epoch < epochs and not done.is_set():
            batch = optimizers[i].batch()
            if i in lying and attack == "other_data":
                picks = torch.randint(len(data), (BATCH,), generator=other).tolist()
                batch = torch.utils.data.default_collate([data[k] for k in picks])
            scale = SCALES.get(attack, 1.0) if i in lying else 1.0
            (scale * loss(models[i], batch)).backward()
            trained[i] += BATCH
            await asyncio.sleep(0.02 * (1 + i % 2))  # two speeds
            await optimizers[i].astep()

    def caught(liar: int) -> bool:
        return all(str(peers[liar].peer_id) in {str(p) for p in ban_list(peers[i].transport)} for i in honest)

    async def watch() -> None:
        while not all(caught(liar) for liar in lying):
            await asyncio.sleep(0.5)
        done.set()
    try:
        for opt in optimizers:
            await opt.astart()
        liars_training = [asyncio.ensure_future(train(i)) for i in lying]
        tasks = [asyncio.ensure_future(train(i)) for i in honest]
        watcher = asyncio.ensure_future(watch()) if lying and until_caught else asyncio.gather(*tasks)
        await asyncio.wait([*tasks, watcher], return_when=asyncio.FIRST_COMPLETED)
        for t in tasks:
            if t.done() and t.exception() is not None:
                raise t.exception()
        await asyncio.wait(tasks, timeout=5.0)
        for t in [*tasks, watcher, *liars_training]:
            t.cancel()
        bans = [{str(p) for p in ban_list(peer.transport)} for peer in peers]
        names = {str(peers[i].peer_id) for i in lying}
        banned_at = [optimizers[i].validation.banned_at.get(name) for i in honest for name in names]
        validations = sum(o.validation.validated for o in optimizers)
        row = {"metric": "verified_detection", "attack": attack, "peers": size, "liars": len(lying), "seed": seed,
               "fraction": fraction, "caught": bool(names) and all(e is not None for e in banned_at),
               "first_ban_epoch": min((e for e in banned_at if e is not None), default=None),
               "last_ban_epoch": max(banned_at) if banned_at and all(e is not None for e in banned_at) else None,
               "epochs": max(o.local_epoch for i, o in enumerate(optimizers) if i in honest),
               "honest_banned": sum(len(bans[i] - names) for i in honest),
               "validations": validations,
               "validation_compute_share": sum(o.validation.recomputed for o in optimizers) / max(1, sum(trained))}
        if test is not None:
            with torch.no_grad():
                row["test_loss"] = float(loss(models[honest[0]], test))
        return row
    finally:
        for opt in optimizers:
            opt.shutdown()
        for peer in peers:
            await peer.ashutdown()


def detection(args: argparse.Namespace) -> None:
    data = dataset()
    for attack in ("honest", "scaled", "other_data"):
        rows = []
        for seed in range(args.runs):
            runner = acquire_runner(virtual_time_loop)
            started = time.perf_counter()
            try:
                row = runner.run(scene(attack, args.epochs, args.fraction, seed, data), timeout=3600)
            finally:
                release_runner()
            row["wall_seconds"] = round(time.perf_counter() - started, 2)
            rows.append(row)
            print(json.dumps(row), flush=True)
        firsts = sorted(r["first_ban_epoch"] for r in rows if r["first_ban_epoch"] is not None)
        lasts = sorted(r["last_ban_epoch"] for r in rows if r["last_ban_epoch"] is not None)

        def spread(values: list[int]) -> dict:
            if not values:
                return {}
            return {"median": statistics.median(values), "p90": values[int(0.9 * (len(values) - 1))],
                    "max": values[-1]}
        print(json.dumps({"metric": "verified_detection_summary", "attack": attack, "fraction": args.fraction,
                          "runs": len(rows), "caught": sum(r["caught"] for r in rows),
                          "first_ban_epoch": spread(firsts), "all_honest_banned_by_epoch": spread(lasts),
                          "honest_banned": sum(r["honest_banned"] for r in rows),
                          "validation_compute_share": statistics.mean(r["validation_compute_share"] for r in rows),
                          "epochs_per_run": args.epochs if attack == "honest" else None}), flush=True)


def training(args: argparse.Namespace) -> None:
    """Each attack for a whole run (no early stop), 1 of 4 and 2 of 5 lying, against the honest
    members alone: the honest peers' test loss after EPOCHS epochs."""
    data = dataset()
    g = torch.Generator().manual_seed(11)
    x = torch.randn(512, 16, generator=g)
    test = (x, (x[:, 0] > 0).long() + 2 * (x[:, 1] > 0).long())
    for size, liars in (tuple(map(int, c.split(":"))) for c in args.configs.split(",")):
        for seed in range(args.training_runs):
            runner = acquire_runner(virtual_time_loop)
            try:
                alone = runner.run(scene("honest", args.epochs, args.fraction, seed, data, size - liars,
                                         test=test), timeout=3600)
                rows = [runner.run(scene(attack, args.epochs, args.fraction, seed, data, size, liars,
                                         until_caught=False, test=test), timeout=3600)
                        for attack in ("scaled", "sign_flip", "other_data")]
            finally:
                release_runner()
            for row in rows:
                print(json.dumps({**row, "metric": "verified_training", "honest_only_test_loss": alone["test_loss"]}),
                      flush=True)


def mean_gradient(model: torch.nn.Module, batches: list, lossf, threads: int, device: str = "cpu") -> torch.Tensor:
    """The mean gradient of `batches` on the host, computed on `device` (with `threads` torch
    threads on the CPU)."""
    if device == "cpu":
        torch.set_num_threads(threads)
    model.to(device)
    total = None
    for batch in batches:
        model.zero_grad(set_to_none=True)
        lossf(model, [t.to(device) for t in batch]).backward()
        flat = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).to("cpu")
        total = flat if total is None else total + flat
    model.to("cpu")
    return total / len(batches)


def tolerance(args: argparse.Namespace) -> None:
    from potluck.cli.tasks import load_data
    from potluck.cli.tasks import make_model as make_cnn
    from potluck.workloads.lm import LMConfig, batches, lm_loss, load_corpus, make_lm

    x_train, y_train, _, _ = load_data()
    g = torch.Generator().manual_seed(0)
    digits = []
    for _ in range(args.batches):
        idx = torch.randint(len(x_train), (64,), generator=g)
        digits.append([(x_train[idx], y_train[idx])])
    config = LMConfig()
    text = batches(load_corpus(), 16, config.context)
    texts = [[next(text)] for _ in range(args.batches)]

    def cnn_loss(model, batch):
        x, y = batch
        return torch.nn.functional.cross_entropy(model(x), y)

    def gpt_loss(model, batch):
        return lm_loss(model, *batch)
    threads = torch.get_num_threads()
    # (label, first computation, second): (device, TF32 allowed) each; TF32 None = torch's default
    comparisons = [("cpu_1_thread_vs_2", ("cpu", None), ("cpu", None))]
    if args.device != "cpu":
        default_tf32 = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
        comparisons += [(f"{args.device}_twice", (args.device, None), (args.device, None)),
                        (f"cpu_vs_{args.device}_tf32_off", ("cpu", None), (args.device, False)),
                        (f"cpu_vs_{args.device}_torch_default", ("cpu", None), (args.device, None)),
                        (f"cpu_vs_{args.device}_tf32_on", ("cpu", None), (args.device, True))]
    for name, model, sample, lossf in (("digits_cnn", make_cnn(), digits, cnn_loss),
                                       ("byte_gpt", make_lm(config), texts, gpt_loss)):
        for label, *computations in comparisons:
            errors = []
            for batch in sample:
                grads = []
                for k, (device, tf32) in enumerate(computations):
                    if device != "cpu":
                        torch.backends.cudnn.allow_tf32 = default_tf32[0] if tf32 is None else tf32
                        torch.backends.cuda.matmul.allow_tf32 = default_tf32[1] if tf32 is None else tf32
                    grads.append(mean_gradient(model, batch, lossf, 1 + k if device == "cpu" else threads, device))
                errors.append(float((grads[0] - grads[1]).norm() / grads[0].norm()))
            print(json.dumps({"metric": "verified_nondeterminism", "model": name, "compared": label,
                              "batches": len(sample), "max_relative_error": max(errors),
                              "median_relative_error": statistics.median(errors), "tolerance": TOLERANCE,
                              "scaled_by_1.001": 1e-3}), flush=True)
    if args.device != "cpu":
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = default_tf32
    torch.set_num_threads(threads)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--epochs", type=int, default=60)
    parser.add_argument("--fraction", type=float, default=0.1)
    parser.add_argument("--batches", type=int, default=20)
    parser.add_argument("--training-runs", type=int, default=3)
    parser.add_argument("--configs", default="4:1,5:2", help="peers:liars of the training part, comma-separated")
    parser.add_argument("--device", default="cpu",
                        help="tolerance part: also compare gradients computed on this device (cuda) with the CPU's")
    parser.add_argument("--part", choices=["detection", "tolerance", "training", "all"], default="all")
    args = parser.parse_args()
    if args.part in ("tolerance", "all"):
        tolerance(args)
    if args.part in ("detection", "all"):
        detection(args)
    if args.part in ("training", "all"):
        training(args)


if __name__ == "__main__":
    main()
