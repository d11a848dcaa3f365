"""Mixture-of-experts throughput: forward+backward through remote experts vs the same expert locally.

Three measurements of one setup (C clients, E ffn experts of width H, batches of B rows, Adam on the
server), each in separate processes on 127.0.0.1:
- local: one process runs forward + backward + Adam step of one expert (the limit);
- potluck: an `ExpertServer` process and C client processes using `RemoteExpert`;
- hivemind: hivemind's `Server` and C clients with its `RemoteExpert`, run in .venv-hivemind
  (the setup of hivemind's own benchmarks/benchmark_throughput.py, "minimalistic" preset when C=E=1).

Prints one JSON object per line, e.g.
  {"metric": "samples_per_second", "system": "potluck", "value": 1000.0, "unit": "samples/s", ...}
  {"metric": "remote_over_local", "value": 0.8, "unit": "ratio", ...}
  {"metric": "potluck_over_hivemind", "value": 1.5, "unit": "ratio", ...}

The systems are measured in interleaved rounds (each round runs every system back to back; the
figures are medians over rounds), so load from other work on the machine hits all of them alike.

Usage: python benchmarks/moe_throughput.py [--quick] [--clients C] [--experts E] [--hidden H]
       [--batch B] [--batches N] [--rounds R] [--system all|local|potluck|hivemind]
       [--hivemind-python PATH]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_HIVEMIND_PYTHON = ROOT / ".venv-hivemind" / "bin" / "python"
# Batches each client runs before the timed ones (connection set-up, allocator warm-up).
WARMUP_BATCHES = 2


def _env() -> dict:
    return dict(os.environ, PYTHONPATH=str(ROOT / "src"))


def _spawn(python: str, *args: str) -> subprocess.Popen:
    """A child running one role; its log goes to a temporary file (shown if the measurement fails)."""
    log = tempfile.TemporaryFile("w+")  # noqa: SIM115 - closed with the process
    proc = subprocess.Popen([python, str(Path(__file__).resolve()), *args], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=log, text=True, env=_env())
    proc.log = log  # type: ignore[attr-defined]
    return proc


def _log_tail(proc: subprocess.Popen) -> str:
    proc.log.seek(0)  # type: ignore[attr-defined]
    return proc.log.read()[-1500:]  # type: ignore[attr-defined]


def _ffn(hidden: int):  # the same block as potluck.moe.FeedForwardExpert and hivemind's "ffn"
    import torch
    from torch import nn

    class FFN(nn.Module):
        def __init__(self):
            super().__init__()
            self.up, self.down = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)
            self.norm = nn.LayerNorm(hidden)

        def forward(self, x):
            return self.norm(x + self.down(nn.functional.gelu(self.up(x), approximate="tanh")))
    torch.manual_seed(0)
    return FFN()


# -- roles run in child processes ---------------------------------------------------------------------
# Every measuring role warms up, prints {"ready": true}, then runs `--batches` batches each time the
# parent writes a line ("go") and prints {"start", "end"}; it exits when its stdin closes. The parent
# interleaves the systems round by round, so a burst of load from elsewhere hits all of them alike.
def _rounds(step) -> None:
    for _ in range(WARMUP_BATCHES):
        step()
    print(json.dumps({"ready": True}), flush=True)
    while sys.stdin.readline():
        start = time.perf_counter()
        for _ in range(ARGS.batches):
            step()
        print(json.dumps({"start": start, "end": time.perf_counter()}), flush=True)


def role_local(args: argparse.Namespace) -> None:
    import torch
    expert = _ffn(args.hidden)
    opt = torch.optim.Adam(expert.parameters())
    x = torch.randn(args.batch, args.hidden)

    def step() -> None:
        expert(x).sum().backward()
        opt.step()
        opt.zero_grad()
    # In a worker thread, like the expert server's runtime: on this machine the same steps ran ~25%
    # faster there than on the main thread (glibc's allocator treats the main arena differently),
    # and the baseline should be the fastest local run.
    worker = threading.Thread(target=_rounds, args=(step,))
    worker.start()
    worker.join()


def role_potluck_server(args: argparse.Namespace) -> None:
    import torch

    import potluck
    from potluck.moe import ExpertServer
    with potluck.Peer(host="127.0.0.1") as peer:
        uids = [f"expert.{i}" for i in range(args.experts)]
        with ExpertServer.from_type(peer, uids, "ffn", args.hidden, lambda p: torch.optim.Adam(p),
                                    max_batch_size=4 * args.batch):
            print(peer.addresses[0], flush=True)
            sys.stdin.read()


def role_potluck_client(args: argparse.Namespace) -> None:
    import torch

    import potluck
    from potluck.moe import RemoteExpert
    torch.set_num_threads(1)
    with potluck.Peer(initial_peers=[args.address], host="127.0.0.1") as peer:
        experts = [RemoteExpert(peer, f"expert.{i}") for i in range(args.experts)]
        _client_rounds(args, experts)


def role_hivemind_server(args: argparse.Namespace) -> None:
    import torch
    from hivemind.dht import DHT
    from hivemind.moe.server import ModuleBackend, Server
    from hivemind.utils.tensor_descr import BatchTensorDescriptor
    dht = DHT(start=True)
    backends = {}
    for i in range(args.experts):
        expert = torch.jit.script(_ffn(args.hidden))
        backends[f"expert.{i}"] = ModuleBackend(
            name=f"expert.{i}", module=expert, optimizer=torch.optim.Adam(expert.parameters()),
            args_schema=(BatchTensorDescriptor(args.hidden),), outputs_schema=BatchTensorDescriptor(args.hidden),
            max_batch_size=4 * args.batch)
    server = Server(dht=dht, module_backends=backends, num_connection_handlers=max(1, args.clients // 2))
    server.start()
    server.ready.wait()
    print(json.dumps({"maddrs": [str(a) for a in dht.get_visible_maddrs()], "peer_id": dht.peer_id.to_base58()}),
          flush=True)
    sys.stdin.read()
    server.shutdown()
    server.join()


def role_hivemind_client(args: argparse.Namespace) -> None:
    import torch
    from hivemind.moe.client.expert import RemoteExpert
    from hivemind.moe.client.remote_expert_worker import RemoteExpertWorker
    from hivemind.moe.expert_uid import ExpertInfo
    from hivemind.p2p import P2P, PeerID
    torch.set_num_threads(1)
    info = json.loads(args.address)
    p2p = RemoteExpertWorker.run_coroutine(P2P.create(initial_peers=info["maddrs"]))
    peer_id = PeerID.from_base58(info["peer_id"])
    experts = [RemoteExpert(ExpertInfo(uid=f"expert.{i}", peer_id=peer_id), p2p=p2p) for i in range(args.experts)]
    _client_rounds(args, experts)


def _client_rounds(args: argparse.Namespace, experts: list) -> None:
    """What hivemind's benchmark clients do: a fixed batch (no input gradient) to a random expert."""
    import torch
    x = torch.randn(args.batch, args.hidden)
    rng = random.Random(os.getpid())
    _rounds(lambda: rng.choice(experts)(x).sum().backward())


ROLES = {"local": role_local, "potluck-server": role_potluck_server, "potluck-client": role_potluck_client,
         "hivemind-server": role_hivemind_server, "hivemind-client": role_hivemind_client}
ARGS: argparse.Namespace


# -- the parent ---------------------------------------------------------------------------------------
def _child_args(args: argparse.Namespace) -> list[str]:
    return ["--clients", str(args.clients), "--experts", str(args.experts), "--hidden", str(args.hidden),
            "--batch", str(args.batch), "--batches", str(args.batches)]


class System:
    """One system's processes: an optional server and the measuring processes, driven round by round."""

    def __init__(self, name: str, python: str, server_role: str | None, client_role: str, args: argparse.Namespace):
        self.name, self.args = name, args
        self.procs: list[subprocess.Popen] = []
        extra: list[str] = []
        if server_role is not None:
            server = self._spawn(python, "--role", server_role, *_child_args(args))
            address = server.stdout.readline().strip()
            if not address:
                raise RuntimeError(f"{server_role} did not start: {_log_tail(server)}")
            extra = ["--address", address]
        count = args.clients if server_role is not None else 1
        self.clients = [self._spawn(python, "--role", client_role, *extra, *_child_args(args)) for _ in range(count)]

    def _spawn(self, *cmd: str) -> subprocess.Popen:
        proc = _spawn(*cmd)
        self.procs.append(proc)
        return proc

    def wait_ready(self) -> None:
        for c in self.clients:
            if not json.loads(c.stdout.readline() or "{}").get("ready"):
                raise RuntimeError(f"a {self.name} process failed to warm up: {_log_tail(c)}")

    def measure(self) -> float:
        """One round: every measuring process runs its batches at once; returns samples/s."""
        for c in self.clients:
            c.stdin.write("go\n")
            c.stdin.flush()
        spans = []
        for c in self.clients:
            line = c.stdout.readline()
            if not line:
                raise RuntimeError(f"a {self.name} process died: {_log_tail(c)}")
            spans.append(json.loads(line))
        seconds = max(s["end"] for s in spans) - min(s["start"] for s in spans)
        return len(self.clients) * self.args.batches * self.args.batch / seconds

    def close(self) -> None:
        for p in reversed(self.procs):
            if p.poll() is None:
                p.stdin.close()
        for p in reversed(self.procs):
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer batches (under a minute)")
    parser.add_argument("--clients", type=int, default=1)
    parser.add_argument("--experts", type=int, default=1)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=2048)
    parser.add_argument("--batches", type=int, default=None,
                        help="timed batches per client and round (default 6; 3 quick)")
    parser.add_argument("--rounds", type=int, default=None,
                        help="measurement rounds, systems interleaved (default 5; 2 quick)")
    parser.add_argument("--system", choices=["all", "local", "potluck", "hivemind"], default="all")
    parser.add_argument("--hivemind-python", default=str(DEFAULT_HIVEMIND_PYTHON))
    parser.add_argument("--role", choices=sorted(ROLES), help=argparse.SUPPRESS)
    parser.add_argument("--address", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.batches is None:
        args.batches = 3 if args.quick else 6
    if args.rounds is None:
        args.rounds = 2 if args.quick else 5
    global ARGS
    ARGS = args
    if args.role:
        ROLES[args.role](args)
        return
    common = {"clients": args.clients, "experts": args.experts, "hidden": args.hidden, "batch": args.batch,
              "batches_per_client_per_round": args.batches, "rounds": args.rounds,
              "date": datetime.date.today().isoformat(),
              "machine": f"{platform.machine()} {os.cpu_count()} cores"}
    wanted = [name for name in ("local", "potluck", "hivemind") if args.system in ("all", name)]
    if "hivemind" in wanted and not Path(args.hivemind_python).exists():
        print(json.dumps({"metric": "skipped", "system": "hivemind", "value": 0, "unit": "",
                          "reason": f"no hivemind python at {args.hivemind_python}"}), flush=True)
        wanted.remove("hivemind")
    specs = {"local": (sys.executable, None, "local"),
             "potluck": (sys.executable, "potluck-server", "potluck-client"),
             "hivemind": (args.hivemind_python, "hivemind-server", "hivemind-client")}
    systems: dict[str, System] = {}
    rounds: dict[str, list[float]] = {name: [] for name in wanted}
    try:
        for name in wanted:
            try:
                systems[name] = System(name, *specs[name], args)
                systems[name].wait_ready()
            except Exception as e:  # noqa: BLE001 - report what failed and go on with the others
                failure = {"metric": "failed", "system": name, "value": 0, "unit": "", "error": str(e)}
                print(json.dumps(failure), flush=True)
                systems.pop(name, None)
                rounds.pop(name)
        for r in range(args.rounds):
            order = list(systems)
            order = order[r % len(order):] + order[:r % len(order)]  # rotate: no system always goes first
            for name in order:
                rounds[name].append(systems[name].measure())
    finally:
        for system in systems.values():
            system.close()
    results = {name: statistics.median(values) for name, values in rounds.items() if values}
    for name, value in results.items():
        print(json.dumps({"metric": "samples_per_second", "system": name, "value": round(value, 1),
                          "unit": "samples/s", "per_round": [round(v, 1) for v in rounds[name]], **common}), flush=True)
    for metric, a, b in (("remote_over_local", "potluck", "local"), ("potluck_over_hivemind", "potluck", "hivemind")):
        if a in results and b in results:  # the median of per-round ratios: each pair ran back to back
            ratio = statistics.median(x / y for x, y in zip(rounds[a], rounds[b], strict=True))
            print(json.dumps({"metric": metric, "value": round(ratio, 3), "unit": "ratio", **common}), flush=True)


if __name__ == "__main__":
    main()
