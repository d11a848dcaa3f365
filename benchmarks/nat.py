"""Relayed vs direct connections (issue 16), side by side in one run on 127.0.0.1 TCP with TLS.

Three processes: a relay (`RelayService`), a target that listens and also holds a reservation on
the relay, and this one with two client transports: one dials the target directly, the other
through the relay's circuit address (end-to-end TLS over the relayed stream). Rounds alternate
between the two paths (which goes first alternates too), so machine noise hits both alike.

Prints one JSON object per line:
  {"metric": "throughput", "path": "direct" | "relayed", "unit": "MB/s", "value": ...}
      a stream of --mib MiB in 1 MiB tensors to a sink; the median over rounds
  {"metric": "rtt_p50" | "rtt_p90", "path": ..., "unit": "us", "value": ...}  small calls
  {"metric": "relayed_vs_direct", ...}  the ratios
  {"metric": "hole_punch", "tries": N, "succeeded": k, "time_p50_ms": ...}
      fresh relayed connections each punched to a direct one (`net.holepunch`); on one host
      with no NAT this measures the protocol's cost, not whether NATs let it through (see
      scripts/netns/nat_check.py for real NATs)

Usage: python benchmarks/nat.py [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

from transport import echo, sink  # noqa: E402 - benchmarks/transport.py (this folder is on sys.path)

from potluck.core.errors import NetworkError  # noqa: E402
from potluck.core.runner import new_event_loop  # noqa: E402
from potluck.net import Identity, TCPTransport  # noqa: E402
from potluck.net.relay import RelayLimits, RelayService, reserve  # noqa: E402

MiB = 2**20
WARMUP_CALLS = 100
# The benchmark streams more than a relay lets one peer send in a window by default
# (MAX_BYTES_PER_PEER per BYTES_WINDOW_SECONDS): lift that cap on this relay only.
BENCH_LIMITS = RelayLimits(max_bytes_per_peer=2**40)


async def wait_for_stdin_eof() -> None:
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)


async def serve_relay() -> None:
    transport = TCPTransport(Identity.generate(), host="127.0.0.1")
    await transport.start()
    relay = RelayService(transport, BENCH_LIMITS)
    relay.start()
    print(transport.addresses[0], flush=True)
    await wait_for_stdin_eof()
    relay.close()
    await transport.close()


async def serve_target(relay_address: str) -> None:
    transport = TCPTransport(Identity.generate(), host="127.0.0.1")
    transport.add_handler("echo", echo)
    transport.add_stream_handler("sink", sink)
    # The target would punch every relayed connection it accepts (as a NATed peer does), and on one
    # host that always works: the relayed path would not stay relayed long enough to be measured.
    # It still answers punches that the client starts (the hole punch figures).
    transport.puncher.auto = False
    await transport.start()
    relay = await transport.connect(relay_address)
    reservation = await reserve(transport, relay)
    print(json.dumps({"direct": str(transport.listen_addresses[0]), "relayed": str(reservation.addresses[0])}),
          flush=True)
    await wait_for_stdin_eof()
    await transport.close()


async def throughput(transport: TCPTransport, target, mib: int) -> float:
    data = torch.randint(0, 255, (MiB,), dtype=torch.uint8)
    t0 = time.perf_counter()
    stream = await transport.open_stream(target, "sink", timeout=300)
    for _ in range(mib):
        await stream.send(data)
    await stream.close()
    received = await stream.recv(timeout=300)
    seconds = time.perf_counter() - t0
    assert received == mib * MiB, received
    return received / seconds / 1e6


async def latencies(transport: TCPTransport, target, calls: int) -> list[float]:
    out = []
    for _ in range(calls):
        t0 = time.perf_counter()
        await transport.call(target, "echo", b"x", timeout=10)
        out.append(time.perf_counter() - t0)
    return out


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[int(q * (len(ordered) - 1))]


async def compare(addresses: dict, rounds: int, mib: int, calls: int) -> list[dict]:
    clients = {path: TCPTransport(Identity.generate(), host="127.0.0.1") for path in ("direct", "relayed")}
    targets = {}
    for path, client in clients.items():
        await client.start()
        targets[path] = await client.connect(addresses[path])
        await throughput(client, targets[path], 8)  # warm the bulk connection (and the relay's pipe)
        await latencies(client, targets[path], WARMUP_CALLS)
    speeds: dict[str, list[float]] = {p: [] for p in clients}
    rtts: dict[str, list[float]] = {p: [] for p in clients}
    for r in range(rounds):
        for path in ("direct", "relayed") if r % 2 == 0 else ("relayed", "direct"):
            speeds[path].append(await throughput(clients[path], targets[path], mib))
            rtts[path] += await latencies(clients[path], targets[path], calls)
    for path, client in clients.items():
        conns = [c for c in client.open_connections() if c.peer_id == targets[path]]
        assert conns and all(c.relayed == (path == "relayed") for c in conns), f"{path}: {conns}"
        await client.close()
    rows = []
    for path in clients:
        rows.append({"metric": "throughput", "path": path, "unit": "MB/s", "stream_mib": mib, "rounds": rounds,
                     "value": round(statistics.median(speeds[path]), 1),
                     "all": [round(s, 1) for s in speeds[path]]})
        for name, q in (("rtt_p50", 0.5), ("rtt_p90", 0.9)):
            rows.append({"metric": name, "path": path, "unit": "us", "calls": len(rtts[path]),
                         "value": round(quantile(rtts[path], q) * 1e6, 1)})
    by = {(row["metric"], row["path"]): row["value"] for row in rows}
    rows.append({"metric": "relayed_vs_direct",
                 "throughput_ratio": round(by["throughput", "relayed"] / by["throughput", "direct"], 3),
                 "rtt_p50_ratio": round(by["rtt_p50", "relayed"] / by["rtt_p50", "direct"], 2)})
    return rows


async def hole_punches(relayed_address: str, tries: int) -> dict:
    """Fresh clients, each connected through the relay, each punching to a direct connection."""
    times, errors = [], []
    for _ in range(tries):
        client = TCPTransport(Identity.generate(), host="127.0.0.1")
        await client.start()
        try:
            target = await client.connect(relayed_address)
            relayed = next(c for c in client.open_connections() if c.peer_id == target)
            t0 = time.perf_counter()
            try:
                direct = await client.puncher.punch(relayed)
            except NetworkError as e:
                errors.append(str(e))
                continue
            times.append(time.perf_counter() - t0)
            assert not direct.relayed
            await client.call(target, "echo", b"x", timeout=10)
        finally:
            await client.close()
    return {"metric": "hole_punch", "tries": tries, "succeeded": len(times),
            "time_p50_ms": round(statistics.median(times) * 1e3, 1) if times else None,
            "time_max_ms": round(max(times) * 1e3, 1) if times else None, "errors": errors[:3]}


def run(coro):
    """On the loop potluck's peers run on (uvloop when installed)."""
    loop = new_event_loop()
    try:
        return loop.run_until_complete(coro)
    finally:
        loop.close()


def start(args: list[str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, __file__, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smaller run, well under a minute")
    parser.add_argument("--serve-relay", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--serve-target", metavar="RELAY", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_relay:
        run(serve_relay())
        return
    if args.serve_target:
        run(serve_target(args.serve_target))
        return
    rounds, mib, calls, tries = (4, 64, 500, 10) if args.quick else (8, 256, 1000, 30)
    probe = new_event_loop()
    loop_name = type(probe).__module__.split(".")[0]
    probe.close()
    common = {"date": datetime.date.today().isoformat(), "machine": f"{platform.machine()} {os.cpu_count()} cores",
              "loop": loop_name, "command": " ".join(["python", *sys.argv])}
    relay = start(["--serve-relay"])
    target = None
    try:
        relay_address = relay.stdout.readline().strip()
        target = start(["--serve-target", relay_address])
        addresses = json.loads(target.stdout.readline())
        for row in run(compare(addresses, rounds, mib, calls)):
            print(json.dumps({**row, **common}), flush=True)
        row = run(hole_punches(addresses["relayed"], tries))
        print(json.dumps({**row, **common}), flush=True)
    finally:
        for proc in (target, relay):
            if proc is not None:
                proc.stdin.close()
                proc.wait(30)


if __name__ == "__main__":
    main()
