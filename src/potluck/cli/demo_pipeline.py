"""`potluck demo --mode pipeline`: Ravnest on 127.0.0.1: 2 clusters x 3 stages train a 6-block MLP.

Seven processes of `potluck pipeline run` (real TCP/TLS on 127.0.0.1), started as a user would
start them on seven machines, profile themselves, publish their profiles in the DHT, and plan the
run by the same rule: two clusters of three (the seventh stays a standby), each splitting the model
into three stages, each with a controller elected by the rule. The clusters train on different
draws of the digits data with the asynchronous pipeline and average each stage across clusters
with the multi-ring all-reduce. Unless --no-churn, cluster 0's stage-1 node is killed with SIGKILL
at 40% of the run: the cluster re-partitions (its controller, or the next node if that was the
controller, re-configures the survivors, the standby if needed) and reloads the lost layers from
cluster 1. At the end every node saves its layers; cluster 0's are assembled for the test accuracy,
and the same model is trained in one process for the same number of updates, for comparison.
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import sys
import time
from pathlib import Path
from typing import Any

from potluck.cli.processes import missing_demo_packages, spawn
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
CLUSTERS = 2  # what every node's plan makes of NODES nodes with MEMORY_FRACTION each
RUN_ID = "demo-pipeline"
# Each node declares memory for this fraction of the model, so a cluster needs three of them.
MEMORY_FRACTION = 0.4
# Every node declares the same speed (they share this machine's cores), so clusters are balanced.
NODE_FLOPS = 1e9
# Starting the processes (importing torch, joining the swarm, planning) on a loaded 2-core machine.
START_SECONDS = 120.0


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


def digits_batches(rank: int, seed: int) -> Any:
    """The `--data` of the demo's nodes: cluster `rank`'s micro-batches, endless (`digits_source`)."""
    import itertools
    x, y, _, _ = load_data()
    source = digits_source(x, y, rank + seed * 1_000)
    return (source(mb) for mb in itertools.count())


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

    from potluck.pipeline.planning import model_costs, model_demand

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    saved = out / "layers"
    shutil.rmtree(saved, ignore_errors=True)
    started = time.time()
    x, y, x_test, y_test = load_data()
    demand = model_demand(model_costs(make_layers(range(LAYERS)), x[:MICRO_BATCH]), MICRO_BATCH, STALENESS_BOUND)
    argv = ["pipeline", "run", "--host", "127.0.0.1", "--run-id", RUN_ID, "--nodes", str(NODES),
            "--data", "potluck.cli.demo_pipeline:digits_batches", "--lr", str(LEARNING_RATE),
            "--memory", str(demand.memory * MEMORY_FRACTION / 2**20), "--flops", str(NODE_FLOPS),
            "--staleness-bound", str(STALENESS_BOUND), "--average-every", str(AVERAGE_EVERY),
            "--heartbeat", "0.5", "--failure-timeout", "2", "--report-every", "0.5", "--save", str(saved)]
    print(f"{NODES} processes of `potluck pipeline run` on 127.0.0.1, memory declared as {MEMORY_FRACTION:.0%} "
          f"of the model's {demand.memory / 2**20:.2f} MiB each; logs in {out}/", flush=True)
    nodes = [spawn("node-0", "node", argv, out, needs_final=False)]
    try:
        if not nodes[0].ready.wait(START_SECONDS) or not nodes[0].address:
            print(f"node-0 did not start: see {out}/node-0.log", file=sys.stderr)
            return 1
        nodes += [spawn(f"node-{i}", "node", [*argv, "--initial-peers", nodes[0].address], out, needs_final=False)
                  for i in range(1, NODES)]
        deadline = time.time() + START_SECONDS
        while not (all("role" in n.last for n in nodes) and _configured(nodes) == CLUSTERS):
            if time.time() > deadline or any(n.proc.poll() is not None for n in nodes):
                print(f"the nodes did not start training: see {out}/node-*.log", file=sys.stderr)
                return 1
            time.sleep(0.2)
        clusters: dict[str, list[str]] = {}
        for n in nodes:
            if n.last.get("cluster") is not None:
                clusters.setdefault(n.last["cluster"], []).append(n.hello["peer_id"])
        print(f"planned by every node alike: {len(clusters)} clusters of {[len(c) for c in clusters.values()]} "
              f"nodes, {NODES - sum(map(len, clusters.values()))} standby", flush=True)
        report = _train(args, nodes)
        for n in nodes:
            if n.proc.poll() is None:
                n.proc.send_signal(signal.SIGTERM)  # each saves its layers on the way out
        for n in nodes:
            n.proc.wait(timeout=60)
    finally:
        for n in nodes:
            if n.proc.poll() is None:
                n.proc.kill()
                n.proc.wait()
    layers = {}
    for path in saved.glob("*.pt"):
        state = torch.load(path, weights_only=True)
        if state["cluster"] == "c0":
            layers.update({int(i): weights for i, weights in state["layers"].items()})
    model = torch.nn.Sequential(*make_layers(range(LAYERS)))
    for i in range(LAYERS):
        model[i].load_state_dict(layers[i])
    report["test_accuracy"] = round(accuracy(model, x_test, y_test), 4)
    baseline = train_alone(x, y, report["updates"])
    report["single_process_test_accuracy"] = round(accuracy(baseline, x_test, y_test), 4)
    report["clusters"] = [[p[:8] for p in members] for _, members in sorted(clusters.items())]
    report["wall_seconds"] = round(time.time() - started, 1)
    (out / "report.json").write_text(json.dumps(report, indent=1))
    _plot(out, report)
    print(f"\npipeline test accuracy {report['test_accuracy']:.1%} after up to {report['updates']} updates per stage; "
          f"one process: {report['single_process_test_accuracy']:.1%}; max staleness "
          f"{report['max_staleness_observed']} (bound {report['staleness_bound']})")
    print(f"report: {out / 'report.json'} ({report['wall_seconds']} s)")
    return 0


def _configured(nodes: list[Any]) -> int:
    """How many clusters have every layer held by a configured stage (from the nodes' last rows)."""
    held: dict[str, set[int]] = {}
    for n in nodes:
        if n.last.get("role") == "stage":
            held.setdefault(n.last["cluster"], set()).update(range(*n.last["layers"]))
    return sum(layers == set(range(LAYERS)) for layers in held.values())


def _train(args: argparse.Namespace, nodes: list[Any]) -> dict[str, Any]:
    """Watch the nodes' rows, print a line per cluster every 2 s, SIGKILL cluster 0's stage-1 node
    at 40% of the run (churn)."""
    start = time.time()
    busy0 = {n.name: n.last.get("busy_seconds", 0.0) for n in nodes}
    last_print, last_busy, curve = start, dict(busy0), []
    killed, killed_epoch = None, 0
    while (elapsed := time.time() - start) < args.duration:
        time.sleep(0.5)
        live = [n for n in nodes if n.status != "killed"]
        if not args.no_churn and killed is None and elapsed > 0.4 * args.duration:
            victim = next(n for n in live if n.last.get("cluster") == "c0" and n.last.get("stage") == 1)
            killed, killed_epoch = victim, victim.last["epoch"]
            victim.status = "killed"
            victim.proc.kill()
            role = "cluster 0's controller" if victim.last.get("controls") else "a plain stage"
            print(f"  {victim.name} ({victim.hello['peer_id'][:6]}: cluster 0, stage 1, {role}) killed with "
                  "SIGKILL: the cluster must recover", flush=True)
        if time.time() - last_print >= 2.0:
            now = time.time()
            for cluster in ("c0", "c1"):
                stages = sorted((n for n in live if n.last.get("cluster") == cluster), key=lambda n: n.last["stage"])
                cells = [f"s{n.last['stage']} "
                         f"{(n.last['busy_seconds'] - last_busy.get(n.name, 0.0)) / (now - last_print):4.0%}"
                         for n in stages]
                loss = next((n.last["loss"] for n in stages if n.last["last"]), None)
                cells.append(f"loss {loss:.3f}" if loss is not None else "loss -")
                epoch = max((n.last["epoch"] for n in stages), default=0)
                print(f"  {elapsed:5.1f}s cluster {cluster[1:]}: " + "  ".join(cells) + f"  (epoch {epoch})",
                      flush=True)
                if cluster == "c0" and loss is not None:
                    curve.append((round(elapsed, 2), round(loss, 4)))
            last_busy = {n.name: n.last.get("busy_seconds", 0.0) for n in live}
            last_print = now
    wall = time.time() - start
    staged = [n for n in nodes if n.status != "killed" and n.last.get("role") == "stage"]
    rows = [n.last for n in staged]
    utilization = {f"cluster{n.last['cluster'][1:]}/stage{n.last['stage']}":
                   round((n.last["busy_seconds"] - busy0.get(n.name, 0.0)) / wall, 3) for n in staged}
    recoveries = [e for r in rows for e in r["recoveries"] if e["cluster"] == "c0" and e["epoch"] > killed_epoch]
    return {
        "stage_utilization": dict(sorted(utilization.items())),
        "max_staleness_observed": max(r["max_in_flight"] for r in rows),
        "max_version_lag": max(r["max_version_lag"] for r in rows),
        "staleness_bound": STALENESS_BOUND,
        "updates": max(r["updates"] for r in rows),  # of the stage that made the most
        "averaging_rounds": max(r["rounds_applied"] for r in rows),
        "recoveries": [{"dead": e["dead"][:8], "recovery_s": e["recovery_s"], "epoch": e["epoch"],
                        "fetched_from": {k: v[:8] for k, v in e["fetched_from"].items()}} for e in recoveries],
        "killed": killed.hello["peer_id"][:8] if killed else None,
        "loss_curve": curve,
    }


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
