"""`potluck demo --mode pipeline`: Ravnest on 127.0.0.1: 2 clusters x 3 stages train a 6-block MLP.

Seven peers (real TCP/TLS on 127.0.0.1, all in this one process, sharing its event loop; tensor
math runs in threads) profile themselves, publish their profiles in the DHT, and are grouped
into two clusters of three (the seventh stays a standby); each cluster splits the model into
three stages. The clusters train on different draws of the digits data with the asynchronous
pipeline and average each stage across clusters with the multi-ring all-reduce. Unless
--no-churn, one node of cluster 0 is shut down at 40% of the run: the cluster re-partitions
(the standby takes the lost node's place) and reloads the lost layers from cluster 1. Finally
the same model is trained in one process for the same number of updates, for comparison.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path
from typing import Any

from potluck.cli.processes import missing_demo_packages
from potluck.cli.tasks import accuracy, load_data

REPORT_KEYS = ("test_accuracy", "single_process_test_accuracy", "stage_utilization", "max_staleness_observed",
               "staleness_bound", "updates", "recoveries", "clusters", "loss_curve", "wall_seconds")
LAYERS = 6
HIDDEN = 128
MICRO_BATCH = 32
LEARNING_RATE = 1e-3
STALENESS_BOUND = 4
AVERAGE_EVERY = 5
NODES = 7  # 2 clusters x 3 stages + 1 standby
RUN_ID = "demo-pipeline"
# Each node declares memory for this fraction of the model, so a cluster needs three of them.
MEMORY_FRACTION = 0.4


def make_layers(indices: Any) -> list[Any]:
    """The 6-block MLP for digits; each layer is seeded by its index, so every cluster builds the
    same initial weights without anyone holding the whole model."""
    import torch
    from torch import nn
    out = []
    for i in indices:
        torch.manual_seed(7919 + i)
        if i == 0:
            out.append(nn.Sequential(nn.Flatten(), nn.Linear(64, HIDDEN), nn.ReLU()))
        elif i == LAYERS - 1:
            out.append(nn.Linear(HIDDEN, 10))
        else:
            out.append(nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.ReLU()))
    return out


def digits_source(x: Any, y: Any, cluster: int, batch: int = MICRO_BATCH) -> Any:
    """Micro-batch `mb` of a cluster: a deterministic random draw from the training set."""
    import torch

    def source(mb: int) -> tuple[Any, Any]:
        g = torch.Generator().manual_seed(cluster * 1_000_003 + mb)
        idx = torch.randint(0, len(y), (batch,), generator=g)
        return x[idx], y[idx]
    return source


def train_alone(x: Any, y: Any, updates: int) -> Any:
    """The same model, optimizer and micro-batches, in one process: the accuracy baseline."""
    import torch
    from torch import nn
    model = nn.Sequential(*make_layers(range(LAYERS)))
    opt = torch.optim.Adam(model.parameters(), LEARNING_RATE)
    source = digits_source(x, y, 0)
    for mb in range(updates):
        xb, yb = source(mb)
        opt.zero_grad()
        nn.functional.cross_entropy(model(xb), yb).backward()
        opt.step()
    return model


def assemble(workers: list[Any]) -> Any:
    """One cluster's model, layer by layer from its stages (for evaluation only)."""
    from torch import nn
    layers = {}
    for w in workers:
        layers.update(w.layers)
    return nn.Sequential(*(layers[i] for i in range(LAYERS)))


def _worker(args: argparse.Namespace) -> int:
    """One stage node in a process of its own (used by the tests that kill a node with SIGKILL),
    configured only by the peer id `spec["controller"]`: prints {"address", "peer_id"} as a JSON
    line, serves until stdin closes."""
    import sys
    import threading

    import torch

    from potluck.peer import Peer
    from potluck.pipeline.stage import PipelineConfig, StageWorker

    spec = json.loads(args.worker)
    torch.set_num_threads(1)
    x, y, _, _ = load_data()
    stop = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.readline(), stop.set()), daemon=True).start()
    with Peer(initial_peers=[spec["initial_peer"]], host="127.0.0.1") as peer:
        config = PipelineConfig(spec["run_id"], staleness_bound=spec.get("staleness_bound", STALENESS_BOUND),
                                average_every=spec.get("average_every", AVERAGE_EVERY))

        async def start() -> StageWorker:
            worker = StageWorker(peer, config, make_layers, lambda p: torch.optim.Adam(p, LEARNING_RATE),
                                 controller=spec["controller"], num_layers=LAYERS,
                                 source=digits_source(x, y, spec["cluster"]))
            worker.start()
            return worker
        worker = peer.run(start(), timeout=30)
        print(json.dumps({"address": peer.addresses[0], "peer_id": peer.peer_id}), flush=True)
        stop.wait()
        peer.run(worker.close(), timeout=30)
    return 0


def run(args: argparse.Namespace) -> int:
    if getattr(args, "worker", None):
        return _worker(args)
    if missing_demo_packages("matplotlib", "sklearn"):
        return 2
    import torch

    from potluck.peer import Peer
    from potluck.pipeline.clustering import ModelDemand, form_clusters
    from potluck.pipeline.harness import launch_run
    from potluck.pipeline.partition import STATE_FACTOR
    from potluck.pipeline.profiling import (
        fetch_profiles,
        measure_flops,
        profile_layers,
        profile_node,
        publish_profile,
        serve_probes,
    )
    from potluck.pipeline.stage import PipelineConfig

    torch.set_num_threads(1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.time()
    x, y, x_test, y_test = load_data()
    layers = make_layers(range(LAYERS))
    costs = profile_layers(layers, x[:MICRO_BATCH])
    model_memory = sum(c.param_bytes for c in costs) * (STATE_FACTOR + 2) + \
        sum(c.activation_bytes for c in costs) * MICRO_BATCH * STALENESS_BOUND
    del layers
    print(f"potluck demo (pipeline): {NODES} peers on 127.0.0.1 in this process, {args.duration:.0f} s; "
          f"model: {LAYERS} layers, {sum(c.param_bytes for c in costs) / 1024:.0f} KiB of weights")
    peers: list[Any] = []
    try:
        peers.append(Peer(host="127.0.0.1"))
        peers += [Peer(initial_peers=peers[0].addresses, host="127.0.0.1") for _ in range(NODES - 1)]
        for p in peers:
            serve_probes(p)
        loop_peer = peers[0]
        all_ids = [p.transport.peer_id for p in peers]  # one swarm: each finds the others through the DHT

        flops = measure_flops()  # one CPU shared by every peer of this process: measured once

        async def profile_all() -> list[Any]:
            for p in peers:
                profile = await profile_node(p, [i for i in all_ids if i != p.transport.peer_id],
                                             flops=flops, memory=int(model_memory * MEMORY_FRACTION))
                await publish_profile(p, RUN_ID, profile)
            return await fetch_profiles(peers[0], RUN_ID)
        profiles = loop_peer.run(profile_all(), timeout=120)
        reference = max(p.flops for p in profiles)  # every node here is this process: the same speed
        demand = ModelDemand(work=sum(c.seconds for c in costs) * reference,
                             activation_bytes=max(c.activation_bytes for c in costs), memory=model_memory)
        plan = form_clusters(profiles, demand)
        print(f"profiled {len(profiles)} nodes ({profiles[0].flops / 1e9:.1f} GFLOP/s each, memory declared as "
              f"{MEMORY_FRACTION:.0%} of the model's {model_memory / 2**20:.1f} MiB): {len(plan.clusters)} clusters "
              f"of {[len(c) for c in plan.clusters]} nodes, standby {len(plan.standby)}")
        index = {str(p.transport.peer_id): i for i, p in enumerate(peers)}
        config = PipelineConfig(RUN_ID, staleness_bound=STALENESS_BOUND, average_every=AVERAGE_EVERY)
        run_ = loop_peer.run(launch_run(
            peers, [[index[m] for m in c] for c in plan.clusters], config,
            make_layers, LAYERS, lambda params: torch.optim.Adam(params, LEARNING_RATE), sample=x[:MICRO_BATCH],
            sources=[digits_source(x, y, c) for c in range(len(plan.clusters))], costs=costs,
            profiles={p.peer_id: p for p in profiles}, reference_flops=reference,
            standby=[[index[s] for s in plan.standby]] if plan.standby else (),
            heartbeat=0.5, failure_timeout=2.0), timeout=120)
        for c, controller in enumerate(run_.controllers):
            stages = ", ".join(f"{p[:6]}:layers {a}-{b - 1}" for p, a, b in controller.stages)
            print(f"cluster {c}: {stages}")
        report = _train(args, run_, loop_peer, peers, config)
        final_workers = [run_.workers[p] for p, _, _ in run_.controllers[0].stages]
        model = assemble(final_workers)
        report["test_accuracy"] = round(accuracy(model, x_test, y_test), 4)
        loop_peer.run(run_.close(), timeout=30)
        baseline = train_alone(x, y, report["updates"])
        report["single_process_test_accuracy"] = round(accuracy(baseline, x_test, y_test), 4)
        report["clusters"] = [[p[:8] for p in c] for c in plan.clusters]
        report["wall_seconds"] = round(time.time() - started, 1)
    finally:
        for p in reversed(peers):
            p.shutdown()
    (out / "report.json").write_text(json.dumps(report, indent=1))
    _plot(out, report)
    print(f"\npipeline test accuracy {report['test_accuracy']:.1%} after up to {report['updates']} updates per stage; "
          f"one process: {report['single_process_test_accuracy']:.1%}; max staleness "
          f"{report['max_staleness_observed']} (bound {report['staleness_bound']})")
    print(f"report: {out / 'report.json'} ({report['wall_seconds']} s)")
    return 0


def _train(args: argparse.Namespace, run_: Any, loop_peer: Any, peers: list[Any], config: Any) -> dict[str, Any]:
    """Watch the run, print a line per stage every 2 s, shut a node down at 40% (churn)."""
    async def stats() -> list[Any]:
        return [await c.stats() for c in run_.controllers]

    start = time.time()
    busy0 = {p: w.stats.busy_seconds for p, w in run_.workers.items()}
    last_print, last_busy, curve = start, dict(busy0), []
    killed, killed_at = None, 0.0
    while (elapsed := time.time() - start) < args.duration:
        time.sleep(0.5)
        if not args.no_churn and killed is None and elapsed > 0.4 * args.duration:
            killed = run_.controllers[0].stages[1].peer
            victim = next(p for p in peers if p.peer_id == killed)
            killed_at = loop_peer.run(_loop_time(), timeout=5)
            loop_peer.run(run_.workers[killed].close(), timeout=10)
            victim.shutdown()
            print(f"  node {killed[:6]} (cluster 0, stage 1) shut down: the cluster must recover")
        if time.time() - last_print >= 2.0:
            now = time.time()
            for c, controller in enumerate(run_.controllers):
                cells = []
                for s, (peer, _, _) in enumerate(controller.stages):
                    w = run_.workers[peer]
                    util = (w.stats.busy_seconds - last_busy.get(peer, 0.0)) / (now - last_print)
                    cells.append(f"s{s} {util:4.0%}")
                last_loss = run_.workers[controller.stages[-1].peer].report().loss
                cells.append(f"loss {last_loss:.3f}" if last_loss is not None else "loss -")
                print(f"  {elapsed:5.1f}s cluster {c}: " + "  ".join(cells), flush=True)
                if c == 0 and last_loss is not None:
                    curve.append((round(elapsed, 2), round(last_loss, 4)))
            last_busy = {p: w.stats.busy_seconds for p, w in run_.workers.items()}
            last_print = now
    wall = time.time() - start
    final = loop_peer.run(stats(), timeout=30)
    utilization = {}
    for c, controller in enumerate(run_.controllers):
        for s, (peer, _, _) in enumerate(controller.stages):
            w = run_.workers[peer]
            utilization[f"cluster{c}/stage{s}"] = round((w.stats.busy_seconds - busy0.get(peer, 0.0)) / wall, 3)
    entries = [e for cluster in final for e in cluster.values() if e is not None]  # None: a dead stage
    return {
        "stage_utilization": utilization,
        "max_staleness_observed": max(e.max_in_flight for e in entries),
        "max_version_lag": max(e.max_version_lag for e in entries),
        "staleness_bound": config.staleness_bound,
        "updates": max(e.updates for e in entries),  # of the stage that made the most
        "averaging_rounds": max(e.rounds for e in entries),
        "recoveries": [{"dead": ev.dead[:8], "detected_after_s": round(ev.detected_at - killed_at, 3),
                        "recovery_s": round(ev.recovered_at - ev.detected_at, 3),
                        "stages": [(s.peer[:8], s.start, s.end) for s in ev.stages],
                        "fetched_from": {str(k): v[:8] for k, v in ev.fetched_from.items()}}
                       for ev in run_.controllers[0].events],
        "killed": killed[:8] if killed else None,
        "loss_curve": curve,
    }


async def _loop_time() -> float:
    return asyncio.get_running_loop().time()


def _plot(out: Path, report: dict[str, Any]) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    names = list(report["stage_utilization"])
    a.bar(range(len(names)), [report["stage_utilization"][n] for n in names])
    a.set_xticks(range(len(names)), [n.replace("cluster", "c").replace("/stage", "s") for n in names])
    a.set_ylabel("busy fraction")
    a.set_title("stage utilization")
    if report["loss_curve"]:
        t, loss = zip(*report["loss_curve"], strict=True)
        b.plot(t, loss)
    b.set_xlabel("seconds")
    b.set_ylabel("training loss (cluster 0)")
    fig.tight_layout()
    fig.savefig(out / "pipeline.png", dpi=100)
    plt.close(fig)
