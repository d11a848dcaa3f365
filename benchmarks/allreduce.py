"""All-reduce benchmark: seconds per averaging step on real processes (potluck with and without TLS,
hivemind side by side), and the all-reduce time under an emulated per-peer bandwidth cap.

Real processes: N peer processes on 127.0.0.1 (rank 0 bootstraps, the others join it), each with
a vector of M float32 drawn from its own seed. Every process creates a Peer and an Averager
(target_group_size = min_group_size = N, no compression), does one warm-up step, then K timed
steps. Before each step the parent holds a barrier (every process says "ready", then all get "go"),
and each process times the whole `avg.step()`: matchmaking included. A step's time is the slowest
peer's; the figure is the median over the K steps. Before each step every process resets its
tensor to its own vector, so every step averages N different vectors; after the last one each
process reports the SHA-256 of its result (all must be equal) and its max error against the mean
of all N vectors, which it regenerates from the seeds. hivemind (its `DecentralizedAverager`, same
group size, `min_matchmaking_time` = potluck's `matchmaking_time`) runs the same scenario with the
python of .venv-hivemind (scripts/hivemind-venv.sh); each of its peers is a process with its own
DHT process and Go daemon, as hivemind runs them.

Emulated (virtual clock, so the figure depends on the network model, not on this machine): P
peers, each with upload = download = B bytes/s and a one-way latency of L seconds, average M
float32. `allreduce_direct` times `AllReduceService.run` alone (the group built by hand, even
split): this is the figure compared with the bandwidth-optimal time 2(P-1)/P * 4M / B.
`allreduce_in_step` times `Averager.astep()` minus its matchmaking (`form_group`, timed by
wrapping it), and `step_virtual_seconds` the whole step.

potluck's peer processes import scipy.optimize before their first step (see run_potluck_worker;
`--cold-leader` does not), so that the timed steps measure the steady state.

Prints one JSON object per line, e.g.
  {"metric": "step_seconds", "system": "potluck", "tls": true, "peers": 4, "floats": 16777216, "value": 0.7, ...}
  {"metric": "step_seconds_ratio", "unit": "hivemind/potluck", "value": 3.1, ...}
  {"metric": "allreduce_direct_vs_optimal", "unit": "ratio", "peers": 8, "value": 1.1, ...}
A system that cannot run prints a line with an "error" field instead of its figures.

Usage: python benchmarks/allreduce.py [--quick] [--peers 4] [--floats 16M,1M] [--steps 3]
           [--parts potluck,trusted,hivemind,emulated] [--compression none|blockwise8|...]
           [--emulated-peers 8] [--emulated-floats 16M]
           [--bandwidth 50e6] [--latency 0.005] [--matchmaking-time 1.0] [--hivemind-python PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import hashlib
import json
import os
import platform
import select
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from peer_processes import Worker

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_HIVEMIND_PYTHON = ROOT / ".venv-hivemind" / "bin" / "python"
# Start-up of one peer process (imports, key generation, vectors, DHT join); hivemind also starts
# a DHT process and a Go daemon per peer, which takes several seconds on a loaded 2-core machine.
STARTUP_TIMEOUT = 120.0
# One averaging step, as the parent waits for it (the peers' own step deadline is STEP_TIMEOUT).
STEP_TIMEOUT = 90.0
# Final hash and error check (regenerating N vectors of M floats).
CHECK_TIMEOUT = 120.0
# A worker that hears nothing from the parent for this long exits (the parent died).
WORKER_IDLE_TIMEOUT = 300.0
# The emulated run in its subprocess.
EMULATED_TIMEOUT = 900.0
# Seeds of the peers' vectors: rank r draws from SEED_BASE + r.
SEED_BASE = 1000
MB = 1e6


def parse_count(text: str) -> int:
    """16M -> 16 * 2**20, 64K -> 65536, 1000 -> 1000."""
    text = text.strip().upper()
    scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
    return int(float(text[:-1] if scale > 1 else text) * scale)


def emit(row: dict) -> None:
    print(json.dumps(row), flush=True)


# == worker side ====================================================================================
def vector(rank: int, floats: int) -> Any:
    import torch
    return torch.randn(floats, generator=torch.Generator().manual_seed(SEED_BASE + rank))


def worker_say(**event: Any) -> None:
    print("@@" + json.dumps(event), flush=True)


def worker_wait_go() -> None:
    """Block until the parent writes a line; exit if it is gone or silent for too long."""
    ready, _, _ = select.select([sys.stdin], [], [], WORKER_IDLE_TIMEOUT)
    if not ready or not sys.stdin.readline():
        # This process leads its own process group (start_new_session): take hivemind's DHT and
        # averager processes and Go daemons down with it.
        os.killpg(os.getpgid(0), signal.SIGKILL)


def worker_check(rank: int, peers: int, floats: int, result: Any) -> dict:
    import torch
    digest = hashlib.sha256(result.contiguous().numpy().data).hexdigest()
    check: dict = {"hash": digest}
    if rank == 0:  # one peer checks the value; the hashes prove the others hold the same bits
        mean = torch.zeros(floats, dtype=torch.float64)
        for r in range(peers):
            mean += vector(r, floats).double()
        mean /= peers
        check["max_error"] = (result.double() - mean).abs().max().item()
    return check


def run_potluck_worker(args: argparse.Namespace) -> None:
    import potluck
    from potluck.averaging import Averager

    if not args.cold_leader:
        # potluck imports scipy.optimize lazily, on the event loop, the first time a peer leads a
        # group (load_balancing.optimal_fractions): that step stalls every member by ~0.2-0.5 s.
        # Which peer leads is random, so the stall would land in some timed steps and not others;
        # import it here so that every timed step measures the steady state (--cold-leader: don't).
        import scipy.optimize  # noqa: F401

    mine = vector(args.rank, args.floats)
    peer = potluck.Peer(host="127.0.0.1", initial_peers=[args.initial] if args.initial else [],
                        insecure=args.insecure)
    if args.rank == 0:
        worker_say(event="address", address=peer.addresses[0])
    avg = Averager(peer, [mine], "bench", target_group_size=args.peers, min_group_size=args.peers,
                   compression=args.compression, matchmaking_time=args.matchmaking_time)
    form_group = avg.matchmaker.form_group
    matchmaking: list[float] = []

    async def timed_form_group(*a: Any, **k: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return await form_group(*a, **k)
        finally:
            matchmaking.append(time.perf_counter() - t0)

    avg.matchmaker.form_group = timed_form_group
    for step in range(args.steps + 1):
        with avg.get_tensors() as tensors:
            tensors[0].copy_(mine)
        worker_say(event="ready", step=step)
        worker_wait_go()
        t0 = time.perf_counter()
        error = None
        try:
            result = avg.step(weight=1.0, timeout=STEP_TIMEOUT - 10)
        except Exception as e:  # noqa: BLE001 - a failed step is reported, the parent decides
            error, result = f"{type(e).__name__}: {e}", None
        seconds = time.perf_counter() - t0
        worker_say(event="step", step=step, seconds=seconds, error=error,
                   matchmaking=matchmaking[-1] if matchmaking else None,
                   group_size=result.group_size if result else None)
    with avg.get_tensors() as tensors:
        worker_say(event="done", **worker_check(args.rank, args.peers, args.floats, tensors[0]))
    worker_wait_go()
    avg.shutdown()
    peer.shutdown()


def run_hivemind_worker(args: argparse.Namespace) -> None:
    import hivemind
    from hivemind.averaging import DecentralizedAverager
    from hivemind.compression import NoCompression

    mine = vector(args.rank, args.floats)
    dht = hivemind.DHT(start=True, initial_peers=[args.initial] if args.initial else None,
                       host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    if args.rank == 0:
        worker_say(event="address", address=str(dht.get_visible_maddrs()[0]), version=hivemind.__version__)
    avg = DecentralizedAverager([mine.clone()], dht, start=True, prefix="bench", target_group_size=args.peers,
                                min_group_size=args.peers, min_matchmaking_time=args.matchmaking_time,
                                compression=NoCompression())
    for step in range(args.steps + 1):
        with avg.get_tensors() as tensors:
            tensors[0].copy_(mine)
        worker_say(event="ready", step=step)
        worker_wait_go()
        t0 = time.perf_counter()
        error = None
        try:
            result = avg.step(weight=1.0, timeout=STEP_TIMEOUT - 10)
            if result is None:
                error = "step returned None (failed)"
        except Exception as e:  # noqa: BLE001
            error, result = f"{type(e).__name__}: {e}", None
        seconds = time.perf_counter() - t0
        worker_say(event="step", step=step, seconds=seconds, error=error, matchmaking=None,
                   group_size=len(result) if result else None)
    with avg.get_tensors() as tensors:
        worker_say(event="done", **worker_check(args.rank, args.peers, args.floats, tensors[0]))
    worker_wait_go()
    avg.shutdown()
    dht.shutdown()


# == parent side: real processes ====================================================================
def session_cpu_seconds(sessions: set[int]) -> float:
    """CPU time (user + system) of every live process in these sessions: a peer process with its
    threads and, for hivemind, its DHT and averager processes and Go daemons."""
    total = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) in sessions:  # field 6 of stat (session id); fields[0] is field 3
            total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14, 15)
    return total / os.sysconf("SC_CLK_TCK")


def measure_real(system: str, python: str, insecure: bool, args: argparse.Namespace, floats: int) -> dict:
    """Run one scenario; returns the per-step, per-peer times and the checks."""
    base = [python, __file__, "--worker", system, "--peers", str(args.peers), "--floats", str(floats),
            "--steps", str(args.steps), "--matchmaking-time", str(args.matchmaking_time),
            "--compression", args.compression]
    if insecure:
        base.append("--insecure")
    if args.cold_leader:
        base.append("--cold-leader")
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), PYTHONUNBUFFERED="1")
    workers: list[Worker] = []
    try:
        workers.append(Worker([*base, "--rank", "0"], env))
        first = workers[0].expect("address", STARTUP_TIMEOUT)
        for rank in range(1, args.peers):
            workers.append(Worker([*base, "--rank", str(rank), "--initial", first["address"]], env))
        steps: list[list[dict]] = []
        cpu: list[float] = []
        sessions = {w.proc.pid for w in workers}
        for step in range(args.steps + 1):
            for w in workers:
                w.expect("ready", STARTUP_TIMEOUT if step == 0 else STEP_TIMEOUT)
            before = session_cpu_seconds(sessions)
            for w in workers:
                w.go()
            steps.append([w.expect("step", STEP_TIMEOUT) for w in workers])
            cpu.append(session_cpu_seconds(sessions) - before)
        done = [w.expect("done", CHECK_TIMEOUT) for w in workers]
        for w in workers:
            w.go()
        for w in workers:
            with contextlib.suppress(subprocess.TimeoutExpired):
                w.proc.wait(timeout=30)
        return {"steps": steps, "done": done, "version": first.get("version"), "cpu": cpu}
    finally:
        for w in workers:
            w.kill()


def real_rows(system: str, tls: bool, floats: int, raw: dict, common: dict,
              compression: str = "none") -> tuple[list[dict], float | None]:
    timed = raw["steps"][1:]
    errors = [s["error"] for step in raw["steps"] for s in step if s["error"]]
    per_step = [max(s["seconds"] for s in step) for step in timed]
    hashes = {d["hash"] for d in raw["done"]}
    params = {"system": system, "tls": tls, "peers": len(raw["done"]), "floats": floats, "compression": compression,
              "mbytes_per_peer": round(4 * floats / MB, 1), "steps": len(timed), **common}
    if raw.get("version"):
        params["version"] = raw["version"]
    rows = []
    value = statistics.median(per_step) if not errors else None
    rows.append({"metric": "step_seconds", "value": None if value is None else round(value, 3), "unit": "s",
                 "per_step": [round(v, 3) for v in per_step],
                 "warmup": round(max(s["seconds"] for s in raw["steps"][0]), 3), **params,
                 **({"error": "; ".join(sorted(set(errors)))[:2000]} if errors else {})})
    if all(s["matchmaking"] is not None for step in timed for s in step):
        mm = statistics.median(max(s["matchmaking"] for s in step) for step in timed)
        rest = statistics.median(max(s["seconds"] - s["matchmaking"] for s in step) for step in timed)
        rows.append({"metric": "matchmaking_seconds", "value": round(mm, 3), "unit": "s", **params})
        rows.append({"metric": "step_minus_matchmaking_seconds", "value": round(rest, 3), "unit": "s", **params})
    rows.append({"metric": "cpu_seconds_per_step", "value": round(statistics.median(raw["cpu"][1:]), 3),
                 "unit": "s", "measured": "user + system CPU of all peer processes (and their children) "
                 "during a step, median over steps", "cores": os.cpu_count(), **params})
    rows.append({"metric": "results_identical", "value": len(hashes) == 1, "unit": "bool", **params})
    rows.append({"metric": "max_error_vs_mean", "value": raw["done"][0].get("max_error"), "unit": "abs", **params})
    return rows, value


# == emulated ======================================================================================
def run_emulated_worker(args: argparse.Namespace) -> None:
    import asyncio

    import torch

    from potluck.averaging import AllReduceService, Averager, Group
    from potluck.averaging.load_balancing import optimal_fractions, part_sizes
    from potluck.compression import get_codec
    from potluck.core.virtual_time import run_virtual
    from potluck.dht import DHT, event_loop_clock
    from potluck.net.emulated import EmulatedNetwork

    n, floats, bw, latency = args.peers, args.floats, args.bandwidth, args.latency
    vectors = [vector(r, floats) for r in range(n)]
    mean = torch.stack(vectors).double().mean(0)

    async def direct() -> dict:
        net = EmulatedNetwork(latency=latency)
        transports = [net.transport(upload=bw, download=bw) for _ in range(n)]
        for t in transports:
            await t.start()
        for t in transports:
            for u in transports:
                if u is not t:
                    t.add_addresses(u.peer_id, u.addresses)
        services = [AllReduceService(t) for t in transports]
        codec = get_codec("none")
        loop = asyncio.get_running_loop()
        times = []
        for _ in range(2):  # the first also dials the connections
            group = Group(os.urandom(16), tuple(t.peer_id for t in transports), ("node",) * n,
                          tuple(part_sizes(floats, optimal_fractions(["node"] * n, [bw] * n))))

            async def one(i: int, group: Group) -> tuple[Any, float]:
                t0 = loop.time()
                result, _ = await services[i].run(group, vectors[i], 1.0, codec, 600.0)
                return result, loop.time() - t0
            results = await asyncio.gather(*(one(i, group) for i in range(n)))
            times.append(max(s for _, s in results))
        identical = all(torch.equal(r, results[0][0]) for r, _ in results)
        return {"first": times[0], "seconds": times[1], "identical": identical,
                "max_error": (results[0][0].double() - mean).abs().max().item()}

    async def in_step() -> dict:
        net = EmulatedNetwork(latency=latency)
        peers = []
        for _ in range(n):
            transport = net.transport(upload=bw, download=bw)
            await transport.start()
            dht = DHT(transport, initial_peers=[peers[0][0].addresses[0]] if peers else [],
                      clock=event_loop_clock())
            await dht.astart()
            peers.append((transport, dht))

        class SimPeer:
            def __init__(self, transport: Any, dht: Any):
                self.transport, self.dht = transport, dht

        avgs = [Averager(SimPeer(t, d), [v], "bench", target_group_size=n, min_group_size=n,
                         matchmaking_time=args.matchmaking_time, allreduce_timeout=600.0, bandwidth=bw)
                for (t, d), v in zip(peers, vectors, strict=True)]
        loop = asyncio.get_running_loop()
        matchmaking: dict[int, float] = {}
        for i, avg in enumerate(avgs):
            form_group = avg.matchmaker.form_group

            async def timed(*a: Any, _i: int = i, _f: Any = form_group, **k: Any) -> Any:
                t0 = loop.time()
                try:
                    return await _f(*a, **k)
                finally:
                    matchmaking[_i] = loop.time() - t0
            avg.matchmaker.form_group = timed

        async def one(i: int) -> tuple[float, float]:
            t0 = loop.time()
            await avgs[i].astep(weight=1.0)
            return loop.time() - t0, loop.time() - t0 - matchmaking[i]

        rows = []
        for _ in range(2):
            for avg, v in zip(avgs, vectors, strict=True):
                with avg.get_tensors() as tensors:  # the same start for both steps
                    tensors[0].copy_(v)
            rows.append(await asyncio.gather(*(one(i) for i in range(n))))
        identical = all(torch.equal(a._tensors[0], avgs[0]._tensors[0]) for a in avgs)
        return {"step": max(s for s, _ in rows[1]), "allreduce": max(a for _, a in rows[1]),
                "matchmaking": max(matchmaking.values()), "identical": identical}

    t0 = time.perf_counter()
    out = run_virtual(direct())
    out["direct_wall"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    out.update(run_virtual(in_step()))
    out["in_step_wall"] = time.perf_counter() - t0
    print("@@" + json.dumps(out), flush=True)


def measure_emulated(args: argparse.Namespace, common: dict) -> list[dict]:
    n, floats, bw = args.emulated_peers, args.emulated_floats, args.bandwidth
    cmd = [sys.executable, __file__, "--worker", "emulated", "--peers", str(n), "--floats", str(floats),
           "--bandwidth", str(bw), "--latency", str(args.latency), "--matchmaking-time", str(args.matchmaking_time)]
    params = {"peers": n, "floats": floats, "mbytes_per_peer": round(4 * floats / MB, 1),
              "bandwidth_mbytes_per_s": bw / MB, "latency_s": args.latency, "clock": "virtual", **common}
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=EMULATED_TIMEOUT,
                              start_new_session=True)
    except subprocess.TimeoutExpired:
        return [{"metric": "allreduce_direct_seconds", "value": None, "unit": "s", **params,
                 "error": f"emulated run exceeded {EMULATED_TIMEOUT:.0f} s of wall time"}]
    lines = [line for line in done.stdout.splitlines() if line.startswith("@@")]
    if done.returncode != 0 or not lines:
        return [{"metric": "allreduce_direct_seconds", "value": None, "unit": "s", **params,
                 "error": f"emulated worker failed ({done.returncode}): {done.stderr[-2000:]}"}]
    raw = json.loads(lines[-1][2:])
    optimal = 2 * (n - 1) / n * 4 * floats / bw
    params = {"link_model": "potluck emulator (output queues)", **params}
    return [
        {"metric": "optimal_seconds", "value": round(optimal, 4), "unit": "s",
         "formula": "2(N-1)/N * bytes / bandwidth", **params},
        {"metric": "allreduce_direct_seconds", "value": round(raw["seconds"], 4), "unit": "s",
         "measured": "AllReduceService.run, second run (connections already open), slowest peer",
         "first_run": round(raw["first"], 4), "identical": raw["identical"],
         "max_error_vs_mean": raw["max_error"], "wall_seconds": round(raw["direct_wall"], 1), **params},
        {"metric": "allreduce_direct_vs_optimal", "value": round(raw["seconds"] / optimal, 3), "unit": "ratio",
         "target": 1.25, **params},
        {"metric": "step_virtual_seconds", "value": round(raw["step"], 4), "unit": "s",
         "measured": "Averager.astep(), second step, slowest peer", "matchmaking_time": args.matchmaking_time,
         "matchmaking_seconds": round(raw["matchmaking"], 4), "identical": raw["identical"],
         "wall_seconds": round(raw["in_step_wall"], 1), **params},
        {"metric": "allreduce_in_step_seconds", "value": round(raw["allreduce"], 4), "unit": "s",
         "measured": "Averager.astep() minus its form_group (matchmaking), slowest peer", **params},
        {"metric": "allreduce_in_step_vs_optimal", "value": round(raw["allreduce"] / optimal, 3), "unit": "ratio",
         "target": 1.25, **params},
    ]


# == CPU against TLS alone (one process) =============================================================
# Bytes per TLS write when only moving bytes: the all-reduce's own chunk size is about this.
TLS_WRITE_BYTES = 1 << 20
TLS_ALONE_TIMEOUT = 60.0  # s for any one send or receive of the TLS-alone baseline; past it, an error


def measure_cpu(args: argparse.Namespace, floats: int, common: dict) -> list[dict]:
    """CPU seconds (this process: user + system) of one all-reduce step of N peers in this
    process over TCP + TLS, against moving the same bytes through TLS sockets alone."""
    import scipy.optimize  # noqa: F401 - see run_potluck_worker

    import potluck
    from potluck.averaging import Averager

    peers: list[Any] = []
    for _ in range(args.peers):
        peers.append(potluck.Peer(host="127.0.0.1", initial_peers=peers[0].addresses if peers else []))
    averagers = [Averager(p, [vector(r, floats)], "cpu", target_group_size=args.peers,
                          min_group_size=args.peers, compression="none", matchmaking_time=args.matchmaking_time)
                 for r, p in enumerate(peers)]
    import asyncio

    async def step() -> None:
        await asyncio.gather(*(a.astep(weight=1.0) for a in averagers))

    potluck_cpu = []
    try:
        for i in range(args.steps + 1):
            before = time.process_time()
            peers[0].run(step(), STEP_TIMEOUT)
            if i:
                potluck_cpu.append(time.process_time() - before)
    finally:
        for a in averagers:
            a.shutdown()
        for p in peers:
            p.shutdown()
    tls_cpu = [tls_alone_cpu(args.peers, 4 * floats // args.peers) for _ in range(args.steps)]
    params = {"peers": args.peers, "floats": floats, "mbytes_per_peer": round(4 * floats / MB, 1),
              "steps": args.steps, **common}
    moved = 2 * args.peers * (args.peers - 1) * (4 * floats // args.peers)
    potluck_median, tls_median = statistics.median(potluck_cpu), statistics.median(tls_cpu)
    return [
        {"metric": "cpu_seconds_per_step", "system": "potluck", "value": round(potluck_median, 3), "unit": "s",
         "per_step": [round(v, 3) for v in potluck_cpu], "measured": "process CPU of one Averager.astep() "
         "of every peer, all peers in this process, TLS, matchmaking included", **params},
        {"metric": "cpu_seconds_per_step", "system": "tls_alone", "value": round(tls_median, 3), "unit": "s",
         "per_step": [round(v, 3) for v in tls_cpu], "bytes_moved": moved,
         "measured": "process CPU of moving the all-reduce's bytes (each peer's part to its reducer and "
         "the result back) through blocking TLS 1.3 sockets, one connection per direction of each pair", **params},
        {"metric": "cpu_ratio", "value": round(potluck_median / tls_median, 2), "unit": "potluck/tls_alone",
         "target": 1.5, **params},
    ]


def tls_alone_cpu(peers: int, part_bytes: int) -> float:
    """Process CPU of moving `part_bytes` each way between every pair of `peers` twice (a part to
    its reducer, the result back) over TLS 1.3 with potluck's certificates. Blocking sockets, one
    connection per direction (an SSL socket is not safe to read and write from two threads at
    once: that hung), a thread per end, 1 MiB writes and reads into one buffer: the cheapest way
    Python moves bytes through TLS (asyncio's TLS streams cost more CPU than potluck's step)."""
    import concurrent.futures
    import socket
    import ssl
    import threading

    from potluck.net.identity import Identity, make_ssl_contexts

    server_context, client_context = make_ssl_contexts(Identity.generate())
    payload = os.urandom(TLS_WRITE_BYTES)
    total = 2 * part_bytes // TLS_WRITE_BYTES * TLS_WRITE_BYTES
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    links: list[tuple[ssl.SSLSocket, ssl.SSLSocket]] = []  # (sending end, receiving end)
    with concurrent.futures.ThreadPoolExecutor(1) as handshakes:
        for _ in range(peers * (peers - 1)):
            raw = socket.create_connection(("127.0.0.1", port), timeout=TLS_ALONE_TIMEOUT)
            accepted, _ = listener.accept()
            accepted.settimeout(TLS_ALONE_TIMEOUT)
            server_side = handshakes.submit(server_context.wrap_socket, accepted, server_side=True)
            links.append((client_context.wrap_socket(raw), server_side.result()))
    listener.close()
    failures: list[BaseException] = []

    def send(sock: ssl.SSLSocket) -> None:
        try:
            for _ in range(total // TLS_WRITE_BYTES):
                sock.sendall(payload)
        except OSError as e:
            failures.append(e)

    def receive(sock: ssl.SSLSocket) -> None:
        buffer = memoryview(bytearray(TLS_WRITE_BYTES))
        left = total
        try:
            while left:
                got = sock.recv_into(buffer, min(left, TLS_WRITE_BYTES))
                if not got:
                    raise ConnectionError("the sending end closed early")
                left -= got
        except OSError as e:
            failures.append(e)

    threads = []
    for a, b in links:
        threads += [threading.Thread(target=send, args=(a,)), threading.Thread(target=receive, args=(b,))]
    before = time.process_time()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    spent = time.process_time() - before
    for a, b in links:
        a.close()
        b.close()
    if failures:
        raise RuntimeError(f"moving bytes through TLS alone failed: {failures[0]!r}")
    return spent


# == main ==========================================================================================
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="1M floats, 2 timed steps, emulated 8 peers x 1M: under a minute")
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--floats", default="16M,1M", help="comma-separated vector sizes (K/M suffixes)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps after one warm-up step")
    parser.add_argument("--parts", default="potluck,trusted,hivemind,emulated",
                        help="potluck (TLS), trusted (potluck, insecure=True), hivemind, emulated, "
                             "cpu (potluck's CPU per step against moving the same bytes through TLS alone, "
                             "in this process)")
    parser.add_argument("--compression", default="none",
                        help="potluck's codec in the real-process parts (hivemind's always sends float32)")
    parser.add_argument("--matchmaking-time", type=float, default=1.0,
                        help="potluck's matchmaking_time and hivemind's min_matchmaking_time (s)")
    parser.add_argument("--emulated-peers", type=int, default=8)
    parser.add_argument("--emulated-floats", default="16M")
    parser.add_argument("--bandwidth", type=float, default=50e6, help="emulated upload = download, bytes/s")
    parser.add_argument("--latency", type=float, default=0.005, help="emulated one-way latency, s")
    parser.add_argument("--cold-leader", action="store_true",
                        help="don't import scipy.optimize in potluck's peer processes before the steps")
    parser.add_argument("--hivemind-python", default=str(DEFAULT_HIVEMIND_PYTHON))
    parser.add_argument("--worker", choices=["potluck", "hivemind", "emulated"], help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--initial", help=argparse.SUPPRESS)
    parser.add_argument("--insecure", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        args.floats = int(args.floats)
        {"potluck": run_potluck_worker, "hivemind": run_hivemind_worker,
         "emulated": run_emulated_worker}[args.worker](args)
        return
    # On SIGTERM (e.g. `timeout`), unwind so that the `finally` blocks kill the peer processes.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.quick:
        args.floats, args.steps, args.emulated_floats = "1M", 2, "1M"
    sizes = [parse_count(s) for s in args.floats.split(",")]
    args.emulated_floats = parse_count(args.emulated_floats)
    parts = args.parts.split(",")
    common = {"date": datetime.date.today().isoformat(),
              "machine": f"{platform.machine()} {os.cpu_count()} cores, {platform.python_version()}",
              "command": " ".join(["python", "benchmarks/allreduce.py", *sys.argv[1:]]),
              "matchmaking_time": args.matchmaking_time, "scipy_preimported": not args.cold_leader}
    for floats in sizes:
        figures: dict[str, float | None] = {}
        runs = [("potluck", "potluck", False, sys.executable), ("trusted", "potluck", True, sys.executable),
                ("hivemind", "hivemind", False, args.hivemind_python)]
        for part, system, insecure, python in runs:
            if part not in parts:
                continue
            params = {"system": system, "tls": not insecure, "peers": args.peers, "floats": floats, **common}
            if system == "hivemind" and not Path(python).exists():
                emit({"metric": "step_seconds", "value": None, "unit": "s", **params,
                      "error": f"no {python}; create it with scripts/hivemind-venv.sh"})
                continue
            try:
                raw = measure_real(system, python, insecure, args, floats)
            except Exception as e:  # noqa: BLE001 - report and go on with the other systems
                emit({"metric": "step_seconds", "value": None, "unit": "s", **params,
                      "error": f"{type(e).__name__}: {e}"[-3000:]})
                continue
            rows, figures[part] = real_rows(system, not insecure, floats, raw, common,
                                            "none" if system == "hivemind" else args.compression)
            for row in rows:
                emit(row)
        for part in ("potluck", "trusted"):
            if figures.get(part) and figures.get("hivemind"):
                emit({"metric": "step_seconds_ratio", "value": round(figures["hivemind"] / figures[part], 2),
                      "unit": "hivemind/potluck", "potluck_tls": part == "potluck", "peers": args.peers,
                      "floats": floats, **common})
        if "cpu" in parts:
            for row in measure_cpu(args, floats, common):
                emit(row)
    if "emulated" in parts:
        for row in measure_emulated(args, common):
            emit(row)


if __name__ == "__main__":
    main()
