"""DHT benchmark: potluck's DHT and hivemind's, side by side in one run, on the same scenario.

Scenario (the same code drives both systems): N server peers (default 64) join one by one on
127.0.0.1, all peers of one system in one Python process (potluck: TCPTransport with TLS, one event
loop; hivemind: DHTNodes in one loop, each with its own Go p2pd daemon, as hivemind runs them).
Then 4 more peers join in client mode, in addition to the N (they hold no records, so every call
they make is a real lookup, as for a trainer behind NAT); they issue every store and get. M keys
are stored by random clients; then G gets of those keys by random clients, one at a time, never
the same (client, key) twice while unfetched pairs remain (hivemind caches values it fetched).
After the first third of the gets, a fraction of the N server peers (default 10%) is killed:
- by default they shut down gracefully (connections closed, so callers fail over at once);
- with --abrupt they go silent without a goodbye, like a machine that lost power: their open
  connections stay up but are never read or answered, and new dials never complete (potluck:
  each socket is kept open by a duplicate descriptor and dropped by the event loop; hivemind:
  its p2pd daemon is stopped with SIGSTOP). Callers only notice through their timeouts.
Each system uses its defaults (potluck: k = 20 replicas; hivemind: 5 replicas, local caching).
Latencies are wall-clock per call. Success after the kill is reported on its own
(`get_success_rate_after_kill`, with the latencies of those gets), since all keys stay live.

Prints one JSON object per line, e.g.
  {"metric": "get_latency_p50", "system": "potluck", "value": 1.2, "unit": "ms", "peers": 64, ...}
  {"metric": "get_success_rate", "system": "hivemind", "value": 1.0, "unit": "fraction", ...}
  {"metric": "get_success_rate_after_kill", "system": "potluck", "value": 1.0, "killed": 6, ...}
  {"metric": "get_latency_p50_ratio", "value": 5.1, "unit": "hivemind/potluck", ...}

hivemind runs in its own virtual environment (scripts/hivemind-venv.sh creates .venv-hivemind);
without one, only potluck is measured.

Every row names "peers" (N, server mode), "clients" (4, in addition) and "abrupt".

Usage: python benchmarks/dht.py [--quick] [--peers 64] [--keys 256] [--gets 600] [--kill 0.1]
                                [--abrupt] [--system both|potluck|hivemind] [--hivemind-python PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_HIVEMIND_PYTHON = ROOT / ".venv-hivemind" / "bin" / "python"
# Client-mode peers that issue every store and get, in addition to the N server peers.
CLIENTS = 4
# A get or store that takes longer than this counts as failed (both systems' own deadlines are
# shorter; this only guards the benchmark against a hang).
CALL_DEADLINE = 30.0


class PotluckSystem:
    name = "potluck"

    def __init__(self) -> None:
        sys.path.insert(0, str(ROOT / "src"))
        from potluck.core.dht_time import get_dht_time
        from potluck.dht import DHT
        from potluck.net import Identity, TCPTransport

        self.DHT, self.Identity, self.TCPTransport, self.now = DHT, Identity, TCPTransport, get_dht_time

    async def create(self, initial: str | None, client_mode: bool = False) -> Any:
        transport = self.TCPTransport(self.Identity.generate(), host="127.0.0.1", client_mode=client_mode)
        await transport.start()
        return await self.DHT.create(transport, initial_peers=[initial] if initial else [])

    def address(self, node: Any) -> str:
        return str(node.node.transport.addresses[0])

    async def store(self, node: Any, key: str, value: Any, expiration: float) -> bool:
        return await node.astore(key, value, expiration)

    async def get(self, node: Any, key: str) -> Any:
        found = await node.aget(key)
        return None if found is None else found.value

    async def kill(self, node: Any) -> None:
        await node.ashutdown()
        await node.node.transport.close()

    async def kill_abruptly(self, node: Any) -> None:
        """Go silent without a goodbye: the kernel keeps every socket (and the listening one)
        open through a duplicate descriptor that nobody reads, while this process forgets them."""
        await node.ashutdown()  # local only: stops background work, sends nothing
        transport = node.node.transport
        self._frozen = getattr(self, "_frozen", [])
        server = transport._server
        if server is not None:
            self._frozen += [socket.socket(fileno=os.dup(s.fileno())) for s in server.sockets]
            server.close()  # the duplicate keeps listening: dials wait in its backlog, unanswered
            transport._server = None
        for link in list(transport._links):
            raw = link._transport.get_extra_info("socket") if link._transport is not None else None
            if raw is not None:
                self._frozen.append(socket.socket(fileno=os.dup(raw.fileno())))
            link.abort()  # this process drops it; the kernel keeps the connection (no FIN, no RST)

    async def release(self) -> None:
        for sock in getattr(self, "_frozen", []):
            sock.close()


class HivemindSystem:
    name = "hivemind"

    def __init__(self) -> None:
        import hivemind
        from hivemind.dht.node import DHTNode
        from hivemind.utils import get_dht_time

        self.DHTNode, self.now, self.version = DHTNode, get_dht_time, hivemind.__version__

    async def create(self, initial: str | None, client_mode: bool = False) -> Any:
        return await self.DHTNode.create(initial_peers=[initial] if initial else None, client_mode=client_mode)

    def address(self, node: Any) -> str:
        return str(self._maddrs[id(node)])

    async def prepare(self, node: Any) -> None:
        if node.protocol.client_mode:
            return
        self._maddrs = getattr(self, "_maddrs", {})
        self._maddrs[id(node)] = (await node.get_visible_maddrs())[0]

    async def store(self, node: Any, key: str, value: Any, expiration: float) -> bool:
        return bool(await node.store(key, value, expiration))

    async def get(self, node: Any, key: str) -> Any:
        found = await node.get(key)
        return None if found is None else found.value

    async def kill(self, node: Any) -> None:
        await node.shutdown()

    async def kill_abruptly(self, node: Any) -> None:
        """Freeze its p2pd daemon (SIGSTOP): connections stay up, nothing answers."""
        self._frozen = getattr(self, "_frozen", [])
        self._frozen.append(node.p2p._child.pid)
        os.kill(node.p2p._child.pid, signal.SIGSTOP)

    async def release(self) -> None:
        for pid in getattr(self, "_frozen", []):
            os.kill(pid, signal.SIGKILL)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[round(q * (len(ordered) - 1))] if ordered else float("nan")


async def scenario(system: Any, peers: int, keys: int, gets: int, kill: float, seed: int,
                   abrupt: bool = False) -> dict:
    rng = random.Random(seed)
    t0 = time.perf_counter()
    nodes: list[Any] = []
    for _ in range(peers):
        initial = system.address(rng.choice(nodes)) if nodes else None
        node = await system.create(initial)
        if hasattr(system, "prepare"):
            await system.prepare(node)
        nodes.append(node)
    join_seconds = time.perf_counter() - t0
    clients = [await system.create(system.address(rng.choice(nodes)), client_mode=True) for _ in range(CLIENTS)]

    names = [f"bench/{i}" for i in range(keys)]
    values = {name: {"i": i, "pad": "x" * 100} for i, name in enumerate(names)}
    expiration = system.now() + 3600
    store_latency, stored = [], 0
    for name in names:
        t = time.perf_counter()
        try:
            ok = await asyncio.wait_for(system.store(rng.choice(clients), name, values[name], expiration),
                                        CALL_DEADLINE)
        except Exception:  # noqa: BLE001 - a failed store is a data point, not a crash
            ok = False
        store_latency.append(time.perf_counter() - t)
        stored += ok

    alive = list(nodes)
    killed: list[Any] = []
    get_latency, found, found_after_kill, gets_after_kill, latency_after_kill = [], 0, 0, 0, []
    unfetched = [(c, name) for c in range(CLIENTS) for name in names]
    rng.shuffle(unfetched)
    for n in range(gets):
        if n == gets // 3 and kill > 0:
            killed = rng.sample(alive, round(kill * peers))
            for node in killed:
                await (system.kill_abruptly(node) if abrupt else system.kill(node))
            alive = [node for node in alive if node not in killed]
        client, name = unfetched.pop() if unfetched else (rng.randrange(CLIENTS), rng.choice(names))
        t = time.perf_counter()
        try:
            value = await asyncio.wait_for(system.get(clients[client], name), CALL_DEADLINE)
        except Exception:  # noqa: BLE001
            value = None
        get_latency.append(time.perf_counter() - t)
        ok = value == values[name]
        found += ok
        if killed:
            gets_after_kill += 1
            found_after_kill += ok
            latency_after_kill.append(get_latency[-1])
    for node in alive + clients:
        await system.kill(node)
    if abrupt:
        await system.release()
    return {
        "join_seconds": join_seconds, "store_latency": store_latency, "stored": stored,
        "get_latency": get_latency, "found": found, "found_after_kill": found_after_kill,
        "gets_after_kill": gets_after_kill, "get_latency_after_kill": latency_after_kill,
        "killed": len(killed),
    }


def metrics(system: str, raw: dict, common: dict) -> list[dict]:
    rows = []

    def row(metric: str, value: float, unit: str, **extra: Any) -> None:
        rows.append({"metric": metric, "system": system, "value": value, "unit": unit, **extra, **common})

    for op in ("get", "store"):
        lat = raw[f"{op}_latency"]
        row(f"{op}_latency_p50", round(percentile(lat, 0.5) * 1e3, 3), "ms", calls=len(lat))
        row(f"{op}_latency_p99", round(percentile(lat, 0.99) * 1e3, 3), "ms", calls=len(lat))
    row("store_success_rate", raw["stored"] / len(raw["store_latency"]), "fraction")
    row("get_success_rate", raw["found"] / len(raw["get_latency"]), "fraction")
    if raw["gets_after_kill"]:
        row("get_success_rate_after_kill", raw["found_after_kill"] / raw["gets_after_kill"], "fraction",
            killed=raw["killed"], calls=raw["gets_after_kill"])
        lat = raw["get_latency_after_kill"]
        row("get_latency_p50_after_kill", round(percentile(lat, 0.5) * 1e3, 3), "ms", calls=len(lat))
        row("get_latency_p99_after_kill", round(percentile(lat, 0.99) * 1e3, 3), "ms", calls=len(lat))
    row("join_seconds", round(raw["join_seconds"], 2), "s")
    return rows


def run_worker(args: argparse.Namespace) -> None:
    """Measure one system in this process and print its raw results as one JSON line."""
    system = PotluckSystem() if args.worker == "potluck" else HivemindSystem()
    try:
        import uvloop
        loop = uvloop.new_event_loop()
    except ImportError:
        loop = asyncio.new_event_loop()
    raw = loop.run_until_complete(scenario(system, args.peers, args.keys, args.gets, args.kill, args.seed,
                                           args.abrupt))
    raw["version"] = getattr(system, "version", None)
    print(json.dumps(raw), flush=True)


def measure(python: str, system: str, args: argparse.Namespace) -> dict:
    cmd = [python, __file__, "--worker", system, "--peers", str(args.peers), "--keys", str(args.keys),
           "--gets", str(args.gets), "--kill", str(args.kill), "--seed", str(args.seed)]
    if args.abrupt:
        cmd.append("--abrupt")
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src")) if system == "potluck" else None
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"{system} worker failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(lines[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="16 peers, 64 keys, 150 gets: under a minute")
    parser.add_argument("--peers", type=int, default=64, help=f"server peers ({CLIENTS} clients join as well)")
    parser.add_argument("--keys", type=int, default=256)
    parser.add_argument("--gets", type=int, default=600)
    parser.add_argument("--kill", type=float, default=0.1,
                        help="fraction of the N server peers killed during the gets")
    parser.add_argument("--abrupt", action="store_true",
                        help="killed peers go silent without closing anything (callers hit timeouts)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--system", choices=["both", "potluck", "hivemind"], default="both")
    parser.add_argument("--hivemind-python", default=str(DEFAULT_HIVEMIND_PYTHON),
                        help="python of a venv with hivemind (default: .venv-hivemind, see scripts/hivemind-venv.sh)")
    parser.add_argument("--worker", choices=["potluck", "hivemind"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quick:
        args.peers, args.keys, args.gets = 16, 64, 150
    if args.worker:
        run_worker(args)
        return
    common = {"peers": args.peers, "clients": CLIENTS, "keys": args.keys, "gets": args.gets,
              "killed_fraction": args.kill, "abrupt": args.abrupt,
              "date": datetime.date.today().isoformat(),
              "machine": f"{platform.machine()} {os.cpu_count()} cores, {platform.python_version()}",
              "command": " ".join(["python", "benchmarks/dht.py", *sys.argv[1:]])}
    results = {}
    systems = ["potluck", "hivemind"] if args.system == "both" else [args.system]
    for system in systems:
        python = sys.executable if system == "potluck" else args.hivemind_python
        if system == "hivemind" and not Path(python).exists():
            print(f"hivemind skipped: no {python}; create it with scripts/hivemind-venv.sh", file=sys.stderr)
            continue
        results[system] = measure(python, system, args)
        extra = {"version": results[system]["version"]} if results[system].get("version") else {}
        for row in metrics(system, results[system], {**common, **extra}):
            print(json.dumps(row), flush=True)
    if len(results) == 2:
        for op in ("get", "store"):
            ours = percentile(results["potluck"][f"{op}_latency"], 0.5)
            theirs = percentile(results["hivemind"][f"{op}_latency"], 0.5)
            print(json.dumps({"metric": f"{op}_latency_p50_ratio", "value": round(theirs / ours, 2),
                              "unit": "hivemind/potluck", **common}), flush=True)


if __name__ == "__main__":
    main()
