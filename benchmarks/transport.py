"""Transport benchmark: two processes on 127.0.0.1, TLS on and off; and the emulated network
on the real clock.

Prints one JSON object per line:
  {"metric": "throughput", "unit": "MB/s", "tls": true, "chunk_mib": 4, "value": ...}
  {"metric": "rtt_p50", "unit": "us", "tls": true, "value": ...}   (and rtt_p99)
  {"metric": "deadline_overshoot_p50", "unit": "ms", "tls": true, "timeout_s": 0.3, "value": ...}
      how late a call's deadline fires (median of several calls to a handler that never answers)
  {"metric": "keepalive_detection", "unit": "s", "tls": true, "keepalive_interval_s": 0.2,
   "keepalive_timeout_s": 1.0, "value": ...}
      from freezing the server (SIGSTOP) until a pending call fails with the keepalive timeout;
      by design between the timeout and the timeout plus one interval
  {"metric": "emulated_real_clock_overshoot_p50", "unit": "ms", "model_ms": 124.9, "value": ...}
      an 8 MiB call over an emulated 80 MB/s link with 20 ms latency on an ordinary loop: how much
      later than the timing model it arrives (tests only check that it is never early)

Usage: python benchmarks/transport.py [--quick] [--loop asyncio|uvloop]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

from potluck.core.errors import ConnectionLost, DeadlineExceeded  # noqa: E402
from potluck.core.runner import new_event_loop  # noqa: E402
from potluck.net import EmulatedNetwork, Identity, TCPTransport  # noqa: E402

MiB = 2**20


def make_loop(kind: str) -> asyncio.AbstractEventLoop:
    if kind == "uvloop":
        return new_event_loop()
    return asyncio.new_event_loop()


async def echo(request, ctx):
    return request


async def sink(stream, ctx):
    """Count the bytes of the tensors streamed in; answer the total."""
    total = 0
    async for chunk in stream:
        total += chunk.numel() * chunk.element_size()
    await stream.send(total)


async def serve(insecure: bool) -> None:
    transport = TCPTransport(Identity.generate(), host="127.0.0.1", insecure=insecure)

    async def hang(request, ctx):
        await asyncio.Event().wait()  # never answers: the caller's deadline ends the call

    transport.add_handler("echo", echo)
    transport.add_handler("hang", hang)
    transport.add_stream_handler("sink", sink)
    await transport.start()
    print(transport.addresses[0], flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)  # until the parent closes it
    await transport.close()


async def measure(address: str, insecure: bool, total_mib: int, chunk_mib: list[int], calls: int) -> list[dict]:
    transport = TCPTransport(Identity.generate(), host="127.0.0.1", insecure=insecure)
    await transport.start()
    pid = await transport.connect(address)
    results = []
    for chunk in chunk_mib:
        data = torch.randint(0, 255, (chunk * MiB,), dtype=torch.uint8)
        stream = await transport.open_stream(pid, "sink", timeout=300)  # warm the bulk connection
        await stream.send(data)
        await stream.close()
        await stream.recv()
        t0 = time.perf_counter()
        stream = await transport.open_stream(pid, "sink", timeout=300)
        for _ in range(total_mib // chunk):
            await stream.send(data)
        await stream.close()
        received = await stream.recv()
        seconds = time.perf_counter() - t0
        assert received == total_mib * MiB, received
        results.append({"metric": "throughput", "unit": "MB/s", "tls": not insecure, "chunk_mib": chunk,
                        "total_mib": total_mib, "value": round(received / seconds / 1e6, 1)})
    for _ in range(100):
        await transport.call(pid, "echo", b"x", timeout=10)
    latencies = []
    for _ in range(calls):
        t0 = time.perf_counter()
        await transport.call(pid, "echo", b"x", timeout=10)
        latencies.append(time.perf_counter() - t0)
    latencies.sort()
    for name, q in (("rtt_p50", 0.5), ("rtt_p99", 0.99)):
        results.append({"metric": name, "unit": "us", "tls": not insecure, "calls": calls,
                        "value": round(latencies[int(q * (len(latencies) - 1))] * 1e6, 1)})
    timeout, overshoots = 0.3, []
    for _ in range(DEADLINE_CALLS):
        t0 = time.perf_counter()
        try:
            await transport.call(pid, "hang", timeout=timeout)
        except DeadlineExceeded:
            overshoots.append(time.perf_counter() - t0 - timeout)
        else:
            raise AssertionError("the hanging call returned")
    results.append({"metric": "deadline_overshoot_p50", "unit": "ms", "tls": not insecure, "timeout_s": timeout,
                    "calls": DEADLINE_CALLS, "value": round(statistics.median(overshoots) * 1e3, 2)})
    await transport.close()
    return results


DEADLINE_CALLS = 5


async def keepalive_detection(address: str, server: subprocess.Popen, insecure: bool) -> dict:
    """Seconds from freezing the server until a pending call fails with the keepalive timeout."""
    interval, timeout = 0.2, 1.0
    transport = TCPTransport(Identity.generate(), host="127.0.0.1", insecure=insecure,
                             keepalive_interval=interval, keepalive_timeout=timeout)
    await transport.start()
    pid = await transport.connect(address)
    await transport.call(pid, "echo", b"x", timeout=10)
    server.send_signal(signal.SIGSTOP)
    try:
        t0 = time.perf_counter()
        try:
            await transport.call(pid, "echo", b"x", timeout=30)
        except ConnectionLost as e:
            seconds = time.perf_counter() - t0
            if "keepalive" not in str(e):
                raise
        else:
            raise AssertionError("a frozen server answered")
    finally:
        server.send_signal(signal.SIGCONT)
    await transport.close()
    return {"metric": "keepalive_detection", "unit": "s", "tls": not insecure, "keepalive_interval_s": interval,
            "keepalive_timeout_s": timeout, "value": round(seconds, 3)}


async def emulated_real_clock(repeats: int) -> dict:
    """How much later than the timing model an emulated transfer arrives on an ordinary loop."""
    size, bandwidth, latency = 8 * MiB, 80e6, 0.02
    loop = asyncio.get_running_loop()
    overshoots = []
    for _ in range(repeats):
        net = EmulatedNetwork(latency=latency)
        a, b = net.transport(upload=bandwidth), net.transport()
        await a.start()
        await b.start()
        arrived: list[float] = []

        async def sink(request, ctx, arrived=arrived):
            arrived.append(loop.time())

        b.add_handler("sink", sink)
        a.add_addresses(b.peer_id, b.addresses)
        await a.call(b.peer_id, "sink", b"warm-up")
        payload = torch.zeros(size, dtype=torch.uint8)
        t0 = loop.time()
        await a.call(b.peer_id, "sink", payload, timeout=60)
        overshoots.append(arrived[-1] - t0 - (size / bandwidth + latency))
        await a.close()
        await b.close()
    return {"metric": "emulated_real_clock_overshoot_p50", "unit": "ms", "bytes": size,
            "bandwidth_bytes_per_s": bandwidth, "latency_s": latency, "repeats": repeats,
            "model_ms": round((size / bandwidth + latency) * 1e3, 1),
            "value": round(statistics.median(overshoots) * 1e3, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smaller run, under a minute")
    parser.add_argument("--loop", choices=["asyncio", "uvloop"], default="uvloop")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--insecure", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.loop == "uvloop":
        try:
            import uvloop  # noqa: F401
        except ImportError:
            args.loop = "asyncio"
    loop = make_loop(args.loop)
    if args.serve:
        loop.run_until_complete(serve(args.insecure))
        return
    total = 64 if args.quick else 256
    calls = 2000
    common = {"date": datetime.date.today().isoformat(), "machine": f"{platform.machine()} {os.cpu_count()} cores",
              "loop": args.loop, "command": " ".join(["python", *sys.argv])}
    for insecure in (False, True):
        cmd = [sys.executable, __file__, "--serve", "--loop", args.loop] + (["--insecure"] if insecure else [])
        server = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            address = server.stdout.readline().strip()
            for row in loop.run_until_complete(measure(address, insecure, total, [1, 4], calls)):
                print(json.dumps({**row, **common}), flush=True)
            row = loop.run_until_complete(keepalive_detection(address, server, insecure))
            print(json.dumps({**row, **common}), flush=True)
        finally:
            server.stdin.close()
            server.wait(30)
    row = loop.run_until_complete(emulated_real_clock(5 if args.quick else 20))
    print(json.dumps({**row, **common}), flush=True)
    loop.close()


if __name__ == "__main__":
    main()
