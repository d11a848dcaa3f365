"""Ravnest pipeline benchmark, on the emulated network with the virtual clock.

1. `pipeline_*`: one cluster of 3 nodes trains a 6-layer MLP (real tensors, real messages over
   emulated links with bandwidth B and one-way latency L). Each stage also waits its profiled
   compute time (`emulate_compute`: per-layer seconds per sample x micro-batch, forward 1/3,
   backward 2/3), so on the virtual clock the figures depend on the stated costs and the network
   model, not on this machine's load. The same stages run twice: the asynchronous schedule
   (no flush, staleness bound S) and the synchronous GPipe-style one (flush after every global
   batch of 4 micro-batches). Both update every 4 backwards. Measured after a warm-up: micro-
   batches/s finished at stage 0, and the utilization (busy fraction) of the bottleneck stage.
2. `pipeline_throughput_two_clusters`: the same with two clusters, with and without a ring round
   (all three rings at once) every 4 updates: averaging overlapped with compute costs little.
3. `multi_ring_*`: K clusters x 3 stages; every stage's holders form a ring of K and all three
   rings run at once; time to finish all of them vs the bandwidth-optimal time of the largest
   ring, 2 (K-1)/K * bytes / B (every node has its own B up and down).

Prints one JSON object per line ({"metric", "value", "unit", ...parameters}).
Usage: python benchmarks/pipeline.py [--quick] [--bandwidth 50e6] [--latency 0.005]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

from emulated_swarm import make_swarm  # noqa: E402

from potluck.core.virtual_time import run_virtual  # noqa: E402
from potluck.pipeline.harness import launch_run  # noqa: E402
from potluck.pipeline.layout import Span  # noqa: E402
from potluck.pipeline.profiling import LayerCost  # noqa: E402
from potluck.pipeline.ring import RingAllReduce, ring_segments  # noqa: E402
from potluck.pipeline.stage import PipelineConfig  # noqa: E402

HIDDEN = 512
MICRO_BATCH = 32
# Seconds per sample, forward + backward, per layer: stage 1 (layers 2-3) is the bottleneck.
LAYER_SECONDS = [1e-4, 1e-4, 1.5e-4, 1.5e-4, 1e-4, 1e-4]


def make_layers(indices):
    out = []
    for i in indices:
        torch.manual_seed(i)
        out.append(nn.Linear(HIDDEN, 10) if i == len(LAYER_SECONDS) - 1 else
                   nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.ReLU()))
    return out


def source(mb: int):
    g = torch.Generator().manual_seed(mb)
    return torch.randn(MICRO_BATCH, HIDDEN, generator=g), torch.randint(0, 10, (MICRO_BATCH,), generator=g)


async def pipeline_run(mode: str, micro_batches: int, warmup: int, bandwidth: float, latency: float,
                       bound: int, clusters: int = 1, average_every: int = 0) -> dict:
    net, peers = await make_swarm(3 * clusters, latency=latency, bandwidth=bandwidth)
    costs = [LayerCost(s, HIDDEN * HIDDEN * 4, HIDDEN * 4) for s in LAYER_SECONDS]
    gpipe = mode == "gpipe"
    config = PipelineConfig(f"bench-{mode}", staleness_bound=4 if gpipe else bound, update_frequency=4,
                            flush_every=4 if gpipe else 0, emulate_compute=True, message_timeout=60,
                            average_every=average_every)
    run = await launch_run(peers, [[3 * c, 3 * c + 1, 3 * c + 2] for c in range(clusters)],
                           config, make_layers, len(LAYER_SECONDS), lambda p: torch.optim.SGD(p, lr=1e-3),
                           sample=torch.zeros(2, HIDDEN), sources=[source] * clusters, costs=costs, heartbeat=3600)
    stages = [run.worker_of(0, s) for s in range(3)]
    periods = run.controllers[0].partition.periods
    bottleneck = max(range(3), key=lambda s: periods[s])
    loop = asyncio.get_running_loop()

    async def reach(n: int) -> None:
        while stages[0].stats.backwards < n:
            await asyncio.sleep(0.0005)
    await reach(warmup)
    t0, b0, busy0 = loop.time(), stages[0].stats.backwards, stages[bottleneck].stats.busy_seconds
    await reach(warmup + micro_batches)
    t1, b1, busy1 = loop.time(), stages[0].stats.backwards, stages[bottleneck].stats.busy_seconds
    layout = [(a, b) for _, a, b in run.controllers[0].stages]
    await run.close()
    for p in peers:
        await p.dht.ashutdown()
        await p.transport.close()
    rounds = min(w.stats.rounds_applied for w in run.workers.values())
    return {"throughput": (b1 - b0) / (t1 - t0), "utilization": (busy1 - busy0) / (t1 - t0), "rounds": rounds,
            "bottleneck_stage": bottleneck, "stages": layout, "max_in_flight": stages[0].schedule.max_in_flight}


async def multi_ring(clusters: int, floats: list[int], bandwidth: float, latency: float) -> dict:
    net, peers = await make_swarm(clusters * 3, latency=latency, bandwidth=bandwidth)
    for a in peers:
        for b in peers:
            if a is not b:
                a.transport.add_addresses(b.transport.peer_id, b.transport.addresses)

    async def ping(request, ctx):
        return {"ok": True}
    rings = []
    for p in peers:
        p.transport.add_handler("bench.ping", ping)
        rings.append(RingAllReduce(p, "bench", "bench.ping"))
    ids = [str(p.transport.peer_id) for p in peers]
    layouts = {f"c{c}": [Span(ids[3 * c + s], s, s + 1) for s in range(3)] for c in range(clusters)}
    segments = ring_segments(layouts)
    ring_of = {pid: r for pid, r in zip(ids, rings, strict=True)}
    loop = asyncio.get_running_loop()
    start = loop.time()
    await asyncio.gather(*(ring_of[m].allreduce(0, seg, torch.ones(floats[seg.start]), timeout=600)
                           for seg in segments for m in seg.members))
    elapsed = loop.time() - start
    for p in peers:
        await p.dht.ashutdown()
        await p.transport.close()
    optimal = max(2 * (clusters - 1) / clusters * 4 * f / bandwidth for f in floats)
    return {"seconds": elapsed, "optimal": optimal}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer micro-batches and smaller rings (< 1 min)")
    parser.add_argument("--bandwidth", type=float, default=50e6, help="bytes/s per node, each direction")
    parser.add_argument("--latency", type=float, default=0.005, help="one-way seconds per link")
    parser.add_argument("--staleness-bound", type=int, default=8)
    args = parser.parse_args()
    torch.set_num_threads(1)
    micro_batches, warmup = (48, 12) if args.quick else (200, 24)
    common = {"bandwidth": args.bandwidth, "latency": args.latency, "micro_batch": MICRO_BATCH, "hidden": HIDDEN,
              "micro_batches": micro_batches, "clock": "virtual"}
    results = {}
    for mode in ("async", "gpipe"):
        started = time.perf_counter()
        r = run_virtual(pipeline_run(mode, micro_batches, warmup, args.bandwidth, args.latency, args.staleness_bound))
        results[mode] = r
        params = dict(common, mode=mode, stages=r["stages"], staleness_bound=args.staleness_bound if mode == "async"
                      else None, flush_every=4 if mode == "gpipe" else None,
                      wall_seconds=round(time.perf_counter() - started, 1))
        print(json.dumps({"metric": "pipeline_throughput", "value": round(r["throughput"], 2),
                          "unit": "micro-batches/s", **params}), flush=True)
        print(json.dumps({"metric": "pipeline_bottleneck_utilization", "value": round(r["utilization"], 4),
                          "unit": "fraction", "bottleneck_stage": r["bottleneck_stage"], **params}), flush=True)
    print(json.dumps({"metric": "pipeline_speedup_async_vs_gpipe",
                      "value": round(results["async"]["throughput"] / results["gpipe"]["throughput"], 3),
                      "unit": "ratio", **common}), flush=True)
    for every in (0, 4):  # two clusters; ring rounds run in the background or not at all
        r = run_virtual(pipeline_run("async", micro_batches, warmup, args.bandwidth, args.latency,
                                     args.staleness_bound, clusters=2, average_every=every))
        print(json.dumps({"metric": "pipeline_throughput_two_clusters", "value": round(r["throughput"], 2),
                          "unit": "micro-batches/s (cluster 0)", "average_every_updates": every,
                          "ring_rounds_applied": r["rounds"], "bottleneck_utilization": round(r["utilization"], 4),
                          **common}), flush=True)
    sizes = [2**20, 2**21, 2**20] if args.quick else [2**22, 2**23, 2**22]
    for clusters in (2, 4):
        started = time.perf_counter()
        r = run_virtual(multi_ring(clusters, sizes, args.bandwidth, args.latency))
        print(json.dumps({"metric": "multi_ring_allreduce_seconds", "value": round(r["seconds"], 4), "unit": "s",
                          "optimal_seconds": round(r["optimal"], 4), "clusters": clusters, "rings": 3,
                          "floats_per_stage": sizes, "bandwidth": args.bandwidth, "latency": args.latency,
                          "clock": "virtual", "wall_seconds": round(time.perf_counter() - started, 1)}), flush=True)
        print(json.dumps({"metric": "multi_ring_optimal_over_measured", "value": round(r["optimal"] / r["seconds"], 3),
                          "unit": "ratio", "clusters": clusters, "floats_per_stage": sizes}), flush=True)


if __name__ == "__main__":
    main()
