"""`potluck demo`: a local swarm of peer processes doing real work together.

For now the work is an all-to-all exchange: every peer streams its tensor to every other peer over
TLS, and each computes the swarm mean; the demo checks that all peers hold the same, correct
result. (Collaborative training replaces this job once the Optimizer lands.)
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

CHUNK_FLOATS = 2**20  # 4 MiB chunks on the wire


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "demo", help="run a small local swarm and show what it does",
        description="Start several local peer processes that exchange tensors over TLS and agree on "
                    "their mean. Writes DIR/report.json with: peers, megabytes_per_peer, "
                    "wall_seconds, all_identical, correct, and per_peer (peer_id, seconds, "
                    "mb_per_s_received).")
    parser.add_argument("--peers", type=int, default=4, help="number of peer processes (default 4)")
    parser.add_argument("--megabytes", type=int, default=32, help="tensor size per peer in MB (default 32)")
    parser.add_argument("--out", default="potluck-report", metavar="DIR", help="report folder")
    parser.add_argument("--insecure", action="store_true", help="plain TCP instead of TLS")
    parser.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    parser.set_defaults(run=run)


def _tensor_for(index: int, megabytes: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 + index)
    return torch.randn(megabytes * 2**20 // 4, generator=generator)


def _mean_in_order(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Sum in peer order, so that every peer gets bit-identical results."""
    total = torch.zeros_like(tensors[0])
    for t in tensors:
        total += t
    return total / len(tensors)


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.numpy().tobytes()).hexdigest()[:16]


def run(args: argparse.Namespace) -> int:
    if args.worker is not None:
        return _worker(args)
    if args.peers < 2:
        print("--peers must be at least 2", file=sys.stderr)
        return 2
    started = time.perf_counter()
    print(f"starting {args.peers} peers, {args.megabytes} MB each ({'plain TCP' if args.insecure else 'TLS 1.3'})")
    base = [sys.executable, "-m", "potluck", "demo", "--megabytes", str(args.megabytes)]
    if args.insecure:
        base.append("--insecure")
    procs = [subprocess.Popen(base + ["--worker", str(i)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True) for i in range(args.peers)]
    try:
        addresses = []
        for i, proc in enumerate(procs):
            line = proc.stdout.readline().strip()
            if not line:
                raise RuntimeError(f"peer {i} exited before it started listening")
            addresses.append(line)
            print(f"  peer {i}: {line}")
        for proc in procs:
            proc.stdin.write(json.dumps(addresses) + "\n")
            proc.stdin.close()
        results = []
        for i, proc in enumerate(procs):
            line = proc.stdout.readline()
            if not line:
                raise RuntimeError(f"peer {i} failed; run with -v for its log")
            results.append(json.loads(line))
            proc.wait(timeout=30)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    expected = _digest(_mean_in_order([_tensor_for(i, args.megabytes) for i in range(args.peers)]))
    digests = {r["digest"] for r in results}
    report = {
        "peers": args.peers, "megabytes_per_peer": args.megabytes, "tls": not args.insecure,
        "wall_seconds": round(time.perf_counter() - started, 3),
        "all_identical": len(digests) == 1, "correct": digests == {expected},
        "per_peer": [{k: r[k] for k in ("peer_id", "seconds", "mb_per_s_received")} for r in results],
    }
    print("peer  exchange time  received MB/s")
    for i, r in enumerate(results):
        print(f"{i:4d}  {r['seconds']:11.2f}s  {r['mb_per_s_received']:13.0f}")
    verdict = "all peers hold the same, correct mean" if report["correct"] else "MISMATCH between peers"
    print(f"{verdict}; wall time {report['wall_seconds']} s")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(report, indent=2))
    print(f"report: {out / 'report.json'}")
    return 0 if report["correct"] else 1


def _worker(args: argparse.Namespace) -> int:
    from potluck.peer import Peer

    me = args.worker
    mine = _tensor_for(me, args.megabytes)
    received: dict[int, torch.Tensor] = {}
    all_in = asyncio.Event()

    with Peer(host="127.0.0.1", insecure=args.insecure) as peer:
        async def push(stream, ctx):
            index = stream.request["index"]
            buf = torch.empty_like(mine)
            offset = 0
            async for chunk in stream:
                buf[offset:offset + chunk.numel()] = chunk
                offset += chunk.numel()
            received[index] = buf
            if len(received) == len(addresses) - 1:
                all_in.set()

        peer.transport.add_stream_handler("demo.push", push)
        print(peer.addresses[0], flush=True)
        addresses = json.loads(sys.stdin.readline())

        async def exchange() -> float:
            t0 = time.perf_counter()

            async def send_to(addr: str) -> None:
                pid = await peer.transport.connect(addr)
                async with await peer.transport.open_stream(pid, "demo.push", {"index": me}) as stream:
                    for start in range(0, mine.numel(), CHUNK_FLOATS):
                        await stream.send(mine[start:start + CHUNK_FLOATS])

            await asyncio.gather(*(send_to(a) for i, a in enumerate(addresses) if i != me))
            await asyncio.wait_for(all_in.wait(), 120)
            return time.perf_counter() - t0

        seconds = peer.run(exchange(), timeout=180)
        received[me] = mine
        mean = _mean_in_order([received[i] for i in range(len(addresses))])
        mb = mine.numel() * 4 * (len(addresses) - 1) / 1e6
        print(json.dumps({"peer_id": peer.peer_id, "seconds": round(seconds, 3),
                          "mb_per_s_received": round(mb / seconds, 1), "digest": _digest(mean)}),
              flush=True)
    return 0
