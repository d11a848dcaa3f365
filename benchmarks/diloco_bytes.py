"""Bytes on the wire per sample: sync (DeDLOC), DiLoCo and Streaming DiLoCo on the same swarm.

N peers on the emulated network, under the virtual clock (so tensor math costs no virtual time and
the figures do not depend on this machine's load), train the same MLP (16 -> W -> W -> 4, about
W^2 parameters) on the same synthetic task for S local steps of batch B each. Per mode it reports
the bytes each peer sent and received per sample it processed (`Optimizer.bytes_per_sample()`,
from `transport.stats`: everything the peer put on the wire, DHT and progress records included),
and the held-out loss of peer 0's model at the end.

Modes: sync (global batch N x B x 2: a gradient round every 2 steps per peer), diloco (H local
steps), and Streaming DiLoCo with F fragments, outer_delay D and uncompressed, 4-bit, 8-bit or
top-1% pseudo-gradients.

Prints one JSON object per line, e.g.
  {"mode": "streaming-4bit", "peers": 4, "parameters": 1054724, "sent_per_sample": 1234.5, ...}

Usage: python benchmarks/diloco_bytes.py [--peers 4] [--width 1024] [--steps 64] [--local-steps 32]
           [--fragments 4] [--delay 2] [--modes sync,diloco,streaming-4bit,streaming-8bit,streaming-topk]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

import torch

import potluck
from potluck.core.dht_time import event_loop_clock
from potluck.core.runner import acquire_runner, release_runner
from potluck.core.virtual_time import virtual_time_loop
from potluck.net.emulated import EmulatedNetwork
from potluck.optim import Optimizer

BATCH = 32
COMPUTE_SECONDS = 0.05  # modeled compute time of one step (virtual)


def modes(local_steps: int, fragments: int, delay: int, peers: int) -> dict[str, dict[str, Any]]:
    streaming = dict(mode="diloco", local_steps=local_steps, fragments=fragments, outer_delay=delay, mixing=0.5)
    return {
        "sync": dict(mode="sync", target_batch_size=peers * BATCH * 2),
        "diloco": dict(mode="diloco", local_steps=local_steps),
        "streaming": streaming,  # no compression: what fragments and overlap alone do
        "streaming-4bit": {**streaming, "outer_compression": "blockwise4"},
        "streaming-8bit": {**streaming, "outer_compression": "blockwise8"},
        "streaming-topk": {**streaming, "outer_compression": {"name": "topk", "ratio": 0.01}},
    }


def make_model(width: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, width), torch.nn.ReLU(), torch.nn.Linear(width, width),
                               torch.nn.ReLU(), torch.nn.Linear(width, 4))


def batch(generator: torch.Generator, size: int = BATCH) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(size, 16, generator=generator)
    return x, (x[:, 0] > 0).long() + 2 * (x[:, 1] * x[:, 2] > 0).long()


@contextlib.asynccontextmanager
async def emulated_peers(count: int) -> AsyncIterator[list[potluck.Peer]]:
    """`count` peers on one emulated network (10 ms, 100 MB/s each way), the first the others'
    bootstrap; shut down on the way out. (benchmarks/diloco_settings.py uses it too.)"""
    network = EmulatedNetwork(latency=0.01, seed=1)
    nodes: list[potluck.Peer] = []
    try:
        for _ in range(count):
            nodes.append(await potluck.Peer.create(nodes[0].addresses if nodes else [],
                                                   transport=network.transport(upload=100e6, download=100e6),
                                                   clock=event_loop_clock()))
        yield nodes
    finally:
        for node in nodes:
            await node.ashutdown()


def run_in_virtual_time(coroutine: Any) -> Any:
    """Run `coroutine` on the shared runner's virtual-time loop (tensor math costs no virtual time)."""
    runner = acquire_runner(virtual_time_loop)
    try:
        return runner.run(coroutine, timeout=3600)
    finally:
        release_runner()


async def swarm(peers: int, width: int, steps: int, options: dict[str, Any]) -> dict[str, Any]:
    async with emulated_peers(peers) as nodes:
        return await train_swarm(nodes, width, steps, options)


async def train_swarm(nodes: list[potluck.Peer], width: int, steps: int, options: dict[str, Any]) -> dict[str, Any]:
    peers = len(nodes)
    models = [make_model(width) for _ in nodes]
    options = {"target_batch_size": peers * BATCH * 2, **options}
    optimizers = [Optimizer(peer, "bytes", model.parameters(), lambda p: torch.optim.Adam(p, 1e-3),
                            batch_size_per_step=BATCH, matchmaking_time=1.0, load_state=False, start=False, **options)
                  for peer, model in zip(nodes, models, strict=True)]
    for opt in optimizers:
        await opt.astart()
    await asyncio.sleep(2)  # the peers see each other before training
    loop = asyncio.get_running_loop()
    start = loop.time()

    async def train(index: int) -> None:
        generator = torch.Generator().manual_seed(100 + index)
        for _ in range(steps):
            x, y = batch(generator)
            torch.nn.functional.cross_entropy(models[index](x), y).backward()
            await asyncio.sleep(COMPUTE_SECONDS)
            await optimizers[index].astep()

    try:
        await asyncio.gather(*(train(i) for i in range(peers)))
        x, y = batch(torch.Generator().manual_seed(999), 4096)
        with torch.no_grad():
            loss = float(torch.nn.functional.cross_entropy(models[0](x), y))
        figures = [opt.bytes_per_sample() for opt in optimizers]
        return {"sent_per_sample": round(sum(f[0] for f in figures) / peers, 1),
                "received_per_sample": round(sum(f[1] for f in figures) / peers, 1),
                "held_out_loss": round(loss, 4), "virtual_seconds": round(loop.time() - start, 2),
                "parameters": sum(p.numel() for p in models[0].parameters())}
    finally:
        for opt in optimizers:
            opt.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=64, help="local steps per peer")
    parser.add_argument("--local-steps", type=int, default=32, help="H: inner steps between a fragment's rounds")
    parser.add_argument("--fragments", type=int, default=4)
    parser.add_argument("--delay", type=int, default=2)
    parser.add_argument("--modes", default="sync,diloco,streaming-4bit,streaming-8bit,streaming-topk")
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)
    table = modes(args.local_steps, args.fragments, args.delay, args.peers)
    for mode in args.modes.split(","):
        result = run_in_virtual_time(swarm(args.peers, args.width, args.steps, table[mode]))
        print(json.dumps({"mode": mode, "peers": args.peers, "steps": args.steps, "batch": BATCH,
                          "local_steps": args.local_steps, **({"fragments": args.fragments, "delay": args.delay}
                                                              if mode.startswith("streaming") else {}),
                          **result}), flush=True)


if __name__ == "__main__":
    main()
