"""potluck's all-reduce over emulated WAN links: peers in Linux network namespaces (run as root).

Each peer runs in its own namespace (named PREFIX + index), attached by a TAP device to one
user-space switch (scripts/netns/wan_switch.py) that shapes every port like a WAN link; the kernel
here has no sch_netem, so delay and loss cannot be done with tc. Profiles (per peer):

  wan    50 ms round trip between any two peers, 100 Mbit/s up and down
  home   80 ms round trip, 20 Mbit/s up, 100 Mbit/s down
  lossy  wan, and 0.5% of frames dropped

Every peer holds --floats float32 values and averages them with the others (`potluck.Averager`,
a butterfly all-reduce: the primitive of the sync mode) once as a warm-up, then --rounds times,
each round started together (the parent's barrier), with each --compression codec; the peers are
told their links' rates (`bandwidth`: the load split uses them and the all-reduce paces its sends
to the uplink), or measure them (`--allreduce potluck_measured`). Reported: the
median round's all-reduce time (the slowest member's step minus its matchmaking) against the
bandwidth bound 2(N-1)/N x size / uplink (an 8-bit codec: a quarter of the size), the whole
step (`step_s`), bytes each peer sent per round, the peers' own estimates of their upload and
download after the last round (bytes/s, medians: what the load split believed, against the
profile's link), and the switch's CPU time and dropped frames (it shares the machine with the
peers; a full port queue drops frames as a router's does). With `--allreduce potluck,gloo` the
same float32 values are also averaged by torch.distributed's Gloo all-reduce (the engine under
torchft's flat all-reduce; `"engine": "gloo"`): what a mature ring all-reduce gets from the same
emulated links; and `tcp` moves the butterfly's bytes and nothing else (each peer sends 2/N of
the values' bytes to each other peer over plain TCP, all at once, a quarter as many for a codec:
the time the links themselves need for an all-reduce's traffic; `tcp_paced` the same with each
flow paced to its share of the uplink), so that the bound is read against what the links allow.
Namespaces are removed whatever happens, and leftovers of a crashed run before starting.

Then each of --systems (potluck's sync, sync 8-bit, DiLoCo, DiLoCo with 8-bit changes, Streaming
DiLoCo, Streaming DiLoCo with 4-bit changes; torchft and hivemind from the python of .venv-torchft
and .venv-hivemind where they exist, else reported as not installed) trains the digits task
(--workload digits: the demo's CNN, 38K parameters; wide: an MLP of 6.7M parameters, where
bandwidth sets the pace) from a common start on the same links until --target test accuracy or
--cap seconds, or (--workload lm) a byte-level language model of 6.3M parameters, nearly all one
table of hashed contexts (cheap steps, 25 MB a float32 round), on the standard library's source
until a validation loss that one process alone reaches in about a minute (potluck's peers told
their links' rates, or measuring them with --measure-bandwidth): time to target, and each
system's ratio to potluck's sync (above 1: sync is faster). With --alone BATCH, one more process
trains beside each system from the same start, alone (Adam on batches of BATCH, no network), with a
peer's share of the same cores: the swarm against one machine at equal wall time (ratio
alone/system above 1: the swarm got there sooner). With --cpus CORES every training process runs in
a CPU cgroup of its own, capped at CORES cores: machines of equal compute (without it a process
takes whatever cores the others leave idle, so the lone process's share depends on the system
beside it). torchft 0.2.0 as benchmarks/torchft_compare.py
runs it (lighthouse on peer 0, one flat all-reduce of the gradients per step over Gloo, bound to
the namespace's TAP device by GLOO_SOCKET_IFNAME; its servers advertise the namespace's address),
and its DiLoCo (`torchft_diloco`: DiLoCo's settings as potluck's `diloco` system); hivemind 1.1.12
with `hivemind.Optimizer` and potluck sync's settings, its DHT and daemon on the namespace's
address.

Prints one JSON object per line, e.g.
  {"metric": "allreduce_seconds", "profile": "wan", "compression": "none", "value": 0.9, "unit": "s",
   "bound_s": 0.48, "over_bound": 1.9, "step_s": 1.3, "bytes_sent_per_peer": 6000000, ...}
  {"metric": "allreduce_over_links", "profile": "wan", "compression": "none", "unit": "potluck/tcp", "value": 1.0}
  {"metric": "time_to_accuracy", "system": "torchft", "profile": "wan", "value": 23.5, "unit": "s", ...}
  {"metric": "time_to_accuracy_ratio", "unit": "torchft/sync", "profile": "wan", "value": 0.94}

Usage: sudo .venv/bin/python benchmarks/wan.py [--profile wan,home,lossy] [--peers 4]
           [--floats 1M] [--rounds 5] [--compression none,blockwise8] [--allreduce potluck,tcp_paced,...] [--short]
           [--systems sync,sync_8bit,diloco,...,torchft,torchft_diloco,hivemind]
           [--workload digits|wide|lm] [--local-steps 8] [--outer-lr 0.7] [--outer-momentum 0.9] [--outer-delay 1]
           [--aggregation mean] [--lr 1e-3] [--local-batch 32] [--matchmaking-time 1]
           [--target 0.95] [--cap 90] [--alone 32] [--cpus 0.35] [--measure-bandwidth]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts" / "netns"))
sys.path.insert(0, str(ROOT / "benchmarks"))

PREFIX = "potluck-wan-"  # every namespace of this benchmark; leftovers with it are removed first
SUBNET = "10.77.0"
MBIT = 1e6 / 8  # bytes/s
PROFILES = {  # up, down (bytes/s), one-way delay per port (s: two ports per path), loss
    "wan": (100 * MBIT, 100 * MBIT, 0.0125, 0.0),
    "home": (20 * MBIT, 100 * MBIT, 0.02, 0.0),
    "lossy": (100 * MBIT, 100 * MBIT, 0.0125, 0.005),
}
COMMAND_TIMEOUT = 20.0
WORKER_TIMEOUT = 300.0  # one profile's workers, start to finish
STEP_TIMEOUT = 60.0  # one averaging round (6.57M floats take ~5 s on the wan profile)
RUN_ID = "wan"
GLOO_PORT = 29561  # the reference all-reduce's rendezvous (a TCPStore on peer 0)
TCP_PORT = 29562  # the plain-TCP reference's listener on every peer
# potluck's and hivemind's matchmaking window (--matchmaking-time): the Optimizer's default.
# torchft_compare.py's 0.5 s (for loopback) split DiLoCo swarms here: DHT declarations over loaded
# 50 ms links came too late for peers 0.4 s apart, and pairs and lone peers went on apart
# (docs/benchmarks.md). A peer joins a round only between its steps: with steps of 0.5-1 s (the lm
# workload under --cpus 0.35) 1 s was too short, and most Streaming DiLoCo rounds gathered one peer,
# until DiLoCo rounds stretched their windows to the slowest peer's steps (RunContext.round_window).
MATCHMAKING_TIME = 1.0


# --cpus: every training process (a peer, the lone process) in a CPU cgroup of its own, capped at
# that many cores: machines of equal compute. Without it they share the machine's cores as the
# scheduler hands them out, and a process gets what the others leave idle: the lone process beside
# a swarm whose peers wait for their rounds then trains on more than one peer's share.
CGROUP_PREFIX = "potluck-wan-cpu-"
CGROUP_PERIOD_US = 100_000
CGROUP_ROOTS = (Path("/sys/fs/cgroup/cpu"), Path("/sys/fs/cgroup"))  # cgroup v1's cpu controller, v2's unified tree


def cgroup_root() -> Path:
    """The CPU controller's hierarchy: cgroup v1's cpu controller, or v2's unified one."""
    for root in CGROUP_ROOTS:
        if (root / "cpu.cfs_quota_us").exists() or "cpu" in _read(root / "cgroup.subtree_control").split():
            return root
    sys.exit("--cpus needs the cgroup cpu controller (/sys/fs/cgroup/cpu, or cpu in cgroup v2's subtree_control)")


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def cpu_capped(command: list[str], name: str, cores: float | None) -> list[str]:
    """`command`, run in the cgroup `name` (made now) whose processes share at most `cores` cores
    (`command` unchanged if `cores` is None)."""
    if cores is None:
        return command
    group = cgroup_root() / f"{CGROUP_PREFIX}{name}"
    group.mkdir(exist_ok=True)
    quota = max(1000, round(cores * CGROUP_PERIOD_US))
    if (group / "cpu.cfs_quota_us").exists():
        (group / "cpu.cfs_period_us").write_text(str(CGROUP_PERIOD_US))
        (group / "cpu.cfs_quota_us").write_text(str(quota))
    else:
        (group / "cpu.max").write_text(f"{quota} {CGROUP_PERIOD_US}")
    # the shell joins the group, then becomes the command (its children join with it)
    return ["sh", "-c", 'echo $$ > "$0" && exec "$@"', str(group / "cgroup.procs"), *command]


def remove_cgroups() -> None:
    """Delete our CPU cgroups (once their processes are gone: a few tries while they exit)."""
    for root in CGROUP_ROOTS:
        for group in root.glob(f"{CGROUP_PREFIX}*"):
            for _ in range(20):
                try:
                    group.rmdir()
                    break
                except OSError:
                    time.sleep(0.1)


def sh(*args: str) -> str:
    result = subprocess.run(args, capture_output=True, text=True, timeout=COMMAND_TIMEOUT)
    if result.returncode != 0:
        raise RuntimeError(f"`{' '.join(args)}` failed: {result.stderr.strip()}")
    return result.stdout


def sweep() -> None:
    """Kill what runs in our namespaces (this run's or a crashed one's) and delete them."""
    for line in sh("ip", "netns", "list").splitlines():
        name = line.split()[0] if line.strip() else ""
        if name.startswith(PREFIX):
            pids = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True,
                                  timeout=COMMAND_TIMEOUT).stdout  # (empty if it is gone meanwhile)
            for pid in pids.split():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), 9)
            subprocess.run(["ip", "netns", "delete", name], capture_output=True, timeout=COMMAND_TIMEOUT)
    remove_cgroups()


def build(peers: int, profile: str):
    """Namespaces with one TAP each, on a shaping switch; returns the switch."""
    from wan_switch import MTU, Port, Switch, open_tap
    up, down, delay, loss = PROFILES[profile]
    ports = []
    for i in range(peers):
        name, tap = f"{PREFIX}{i}", f"pwan{i}"
        sh("ip", "netns", "add", name)
        fd = open_tap(tap)  # the fd stays ours after the device moves into the namespace
        sh("ip", "link", "set", tap, "netns", name)
        sh("ip", "-n", name, "link", "set", tap, "mtu", str(MTU))
        sh("ip", "-n", name, "addr", "add", f"{SUBNET}.{i + 1}/24", "dev", tap)
        sh("ip", "-n", name, "link", "set", "lo", "up")
        sh("ip", "-n", name, "link", "set", tap, "up")
        ports.append(Port(tap, fd, up, down, delay, loss))
    return Switch(ports)


def run_profile(args: argparse.Namespace, profile: str, compression: str, engine: str = "potluck") -> dict:
    sweep()
    switch = build(args.peers, profile)
    procs: list[subprocess.Popen] = []
    deadline = time.monotonic() + WORKER_TIMEOUT

    def line(proc: subprocess.Popen) -> dict:
        text = proc.stdout.readline()
        if not text:
            raise RuntimeError(f"a worker exited (status {proc.wait(timeout=COMMAND_TIMEOUT)}); see its stderr above")
        if time.monotonic() > deadline:
            raise TimeoutError(f"the workers did not finish within {WORKER_TIMEOUT} s")
        return json.loads(text)

    try:
        def spawn(rank: int, initial: str) -> subprocess.Popen:
            command = ["ip", "netns", "exec", f"{PREFIX}{rank}", sys.executable, __file__, "--worker",
                       "--rank", str(rank), "--peers", str(args.peers), "--floats", str(args.floats),
                       "--rounds", str(args.rounds), "--initial", initial, "--compression", compression,
                       "--allreduce", engine, "--profile", profile]
            env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
            return subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        procs.append(spawn(0, ""))
        first = line(procs[0])["address"]
        procs += [spawn(rank, first) for rank in range(1, args.peers)]
        for proc in procs[1:]:
            line(proc)  # its Averager is up
        steps: list[list[dict]] = []
        for _ in range(args.rounds + 1):  # a warm-up round, then the timed ones
            for proc in procs:  # a common start: nobody averages before everyone is ready
                proc.stdin.write("go\n")
                proc.stdin.flush()
            steps.append([line(proc) for proc in procs])
        for proc in procs:
            proc.stdin.close()
            proc.wait(timeout=COMMAND_TIMEOUT)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
        switch.close()
        sweep()
    up, _, delay, loss = PROFILES[profile]
    size = 4 * args.floats / (4 if compression != "none" else 1)  # 8-bit codes: a quarter of float32
    bound = 2 * (args.peers - 1) / args.peers * size / up
    timed = steps[1:]
    ok = [step for step in timed if all(r["error"] is None for r in step)]
    step_s = [max(r["seconds"] for r in step) for step in ok]  # a round's time is its slowest member's
    reduce_s = [max(r["seconds"] - r["matchmaking"] for r in step) for step in ok]
    median = statistics.median(reduce_s) if reduce_s else float("nan")

    def estimate(key: str) -> int | None:
        values = [r[key] for r in steps[-1] if r[key] is not None]
        return round(statistics.median(values)) if values else None
    return {"metric": "allreduce_seconds", "profile": profile, "compression": compression, "engine": engine,
            "value": round(median, 3), "unit": "s", "bound_s": round(bound, 3), "over_bound": round(median / bound, 2),
            "step_s": round(statistics.median(step_s), 3) if step_s else None,
            "bytes_sent_per_peer": int(statistics.median(r["bytes_sent"] for step in ok for r in step)) if ok else None,
            "failed_rounds": len(timed) - len(ok), "peers": args.peers, "floats": args.floats, "rounds": args.rounds,
            "upload_estimate": estimate("upload_estimate"), "download_estimate": estimate("download_estimate"),
            "rtt_ms": round(4000 * delay), "up_mbit": up / MBIT, "loss": loss,
            "switch_cpu_s": round(switch.cpu_seconds, 2), "switch_dropped_frames": switch.dropped}


def gloo_worker(args: argparse.Namespace) -> None:
    """The reference: one peer of a torch.distributed Gloo group (rank 0 holds the rendezvous) that
    averages its values at each "go", reporting as `worker` does (no matchmaking, no estimates)."""
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    tap = f"pwan{args.rank}"
    os.environ["GLOO_SOCKET_IFNAME"] = tap
    store = dist.TCPStore(f"{SUBNET}.1", GLOO_PORT, args.peers, args.rank == 0, timeout=datetime.timedelta(seconds=60),
                         wait_for_workers=False)
    print(json.dumps({"address": f"{SUBNET}.1:{GLOO_PORT}"}), flush=True)
    dist.init_process_group("gloo", store=store, rank=args.rank, world_size=args.peers,
                            timeout=datetime.timedelta(seconds=STEP_TIMEOUT))
    mine = torch.full((args.floats,), float(args.rank))
    values = torch.empty_like(mine)
    counter = Path(f"/sys/class/net/{tap}/statistics/tx_bytes")  # this namespace's sysfs (ip netns exec)
    while sys.stdin.readline():
        values.copy_(mine)
        sent, start, error = int(counter.read_text()), time.monotonic(), None
        try:
            dist.all_reduce(values)
            values /= args.peers
        except RuntimeError as e:
            error = str(e)
        print(json.dumps({"seconds": time.monotonic() - start, "matchmaking": 0.0, "error": error,
                          "bytes_sent": int(counter.read_text()) - sent, "upload_estimate": None,
                          "download_estimate": None}), flush=True)
    dist.destroy_process_group()


def tcp_worker(args: argparse.Namespace) -> None:
    """The links' own reference: at each "go", send 2/N of the values' bytes to every other peer
    and receive as much from each, all at once over plain TCP (the butterfly's traffic without its
    computation, framing or encryption); reports as `worker` does. "tcp_paced": each flow paced
    to its share of the uplink."""
    import socket
    import threading
    share = 2 * 4 * args.floats // args.peers // (1 if args.compression == "none" else 4)  # (8-bit: a quarter)
    others = [r for r in range(args.peers) if r != args.rank]
    listener = socket.create_server((f"{SUBNET}.{args.rank + 1}", TCP_PORT), backlog=args.peers)
    incoming: list[socket.socket] = []
    outgoing: list[socket.socket] = []
    print(json.dumps({"address": f"{SUBNET}.{args.rank + 1}:{TCP_PORT}"}), flush=True)
    payload = bytes(share)

    def send(sock: socket.socket) -> None:
        sock.sendall(payload)

    def receive(sock: socket.socket) -> None:
        left = share
        while left:
            got = len(sock.recv(min(left, 1 << 20)))
            if not got:
                raise ConnectionError("a peer closed its connection")
            left -= got
    while sys.stdin.readline():
        start, error = time.monotonic(), None
        sent = int(Path(f"/sys/class/net/pwan{args.rank}/statistics/tx_bytes").read_text())
        if not outgoing:  # the warm-up round connects (every listener is up by the first go)
            outgoing = [socket.create_connection((f"{SUBNET}.{r + 1}", TCP_PORT), timeout=STEP_TIMEOUT) for r in others]
            incoming = [listener.accept()[0] for _ in others]
            if args.allreduce == "tcp_paced":  # each flow a share of the uplink (the kernel paces it)
                for sock in outgoing:
                    sock.setsockopt(socket.SOL_SOCKET, getattr(socket, "SO_MAX_PACING_RATE", 47),
                                    int(PROFILES[args.profile][0] / len(others)))
        threads = [threading.Thread(target=send, args=(s,)) for s in outgoing] + \
                  [threading.Thread(target=receive, args=(s,)) for s in incoming]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(STEP_TIMEOUT)
        if any(thread.is_alive() for thread in threads):
            error = "timed out"
        print(json.dumps({"seconds": time.monotonic() - start, "matchmaking": 0.0, "error": error,
                          "bytes_sent": int(Path(f"/sys/class/net/pwan{args.rank}/statistics/tx_bytes").read_text())
                          - sent, "upload_estimate": None, "download_estimate": None}), flush=True)


def told_bandwidth(args: argparse.Namespace) -> tuple[float, float] | None:
    """What potluck's peers are told of their links: the profile's rates, as a user who knows
    theirs gives them (the load split then uses them and the all-reduce paces its sends to the
    upload); None where they measure their links instead (--allreduce potluck_measured,
    --measure-bandwidth)."""
    if args.allreduce == "potluck_measured" or args.measure_bandwidth:
        return None
    up, down, _, _ = PROFILES[args.profile]
    return up, down


def worker(args: argparse.Namespace) -> None:
    """One peer: join, then at each "go" on stdin average its values once and print how long it
    took (`seconds`, of which `matchmaking`), the bytes it sent and its bandwidth estimates."""
    import torch

    import potluck
    torch.set_num_threads(1)
    peer = potluck.Peer(host=f"{SUBNET}.{args.rank + 1}", initial_peers=[args.initial] if args.initial else [])
    mine = torch.full((args.floats,), float(args.rank))
    avg = potluck.Averager(peer, [mine], RUN_ID, target_group_size=args.peers, min_group_size=args.peers,
                           compression=args.compression, bandwidth=told_bandwidth(args))
    form_group = avg.matchmaker.form_group
    matchmaking: list[float] = []

    async def timed_form_group(*a, **k):
        start = time.monotonic()
        try:
            return await form_group(*a, **k)
        finally:
            matchmaking.append(time.monotonic() - start)
    avg.matchmaker.form_group = timed_form_group
    print(json.dumps({"address": peer.addresses[0]}), flush=True)
    while sys.stdin.readline():  # the parent's go: everyone is ready
        with avg.get_tensors() as tensors:
            tensors[0].copy_(mine)
        matchmaking.clear()
        sent, start, error = peer.transport.stats.bytes_sent, time.monotonic(), None
        try:
            avg.step(timeout=STEP_TIMEOUT)
        except potluck.AveragingError as e:
            error = str(e)
        print(json.dumps({"seconds": time.monotonic() - start, "matchmaking": sum(matchmaking), "error": error,
                          "bytes_sent": peer.transport.stats.bytes_sent - sent, "upload_estimate": avg.bandwidth,
                          "download_estimate": avg.download_bandwidth}), flush=True)
    avg.shutdown()
    peer.shutdown()


# -- time to target: the training modes on the digits workload ------------------------------------------
# potluck's Optimizer options per system (the rest as benchmarks/torchft_compare.py's: Adam 3e-3, a
# global batch of 256, 32 per step, state averaged every 5 epochs, one peer 2x slower, 0.5 s
# matchmaking). 8-bit is the gradients' codec; the state is averaged losslessly (`Optimizer`'s
# `compression`: Adam's statistics in 8 bits, tiny second moments rounded to 0, wrecked the model).
# "sync" runs the default aggregation (CenteredClip in these open runs); "sync_mean" the mean
# (the default before 2026-12-03), for the robust default's cost side by side.
SYSTEMS = {
    "sync": {},
    "sync_mean": {"aggregation": "mean"},
    "sync_8bit": {"compression": "blockwise8"},
    "diloco": {"mode": "diloco", "local_steps": 8},
    "diloco_8bit": {"mode": "diloco", "local_steps": 8, "compression": "blockwise8"},
    "streaming_diloco": {"mode": "diloco", "local_steps": 8, "fragments": 2, "outer_delay": 1},
    "streaming_diloco_4bit": {"mode": "diloco", "local_steps": 8, "fragments": 2, "outer_delay": 1,
                              "outer_compression": "blockwise4"},
}
# the python of each one's venv
# --allreduce's engines (potluck's, then the references)
ENGINES = ("potluck", "potluck_measured", "gloo", "tcp", "tcp_paced")
OTHERS = {"torchft": ".venv-torchft", "torchft_diloco": ".venv-torchft", "hivemind": ".venv-hivemind"}


# Workloads for time to target: the demo's CNN (38K parameters: latency sets the pace), and an MLP
# of 6.7M parameters on the same digits (each float32 all-reduce moves 27 MB per peer: bandwidth
# sets it, as for the larger models people train over such links).
WIDE_HIDDEN = 2560
WIDE_TORCHFT_TIMEOUT = 60.0  # s, torchft's collectives and quorums on the wide workload


# The "lm" workload: a byte-level language model of 6.3M parameters, nearly all of them one table
# (the two previous bytes, hashed into LM_BUCKETS rows), so a step costs little compute and each
# float32 round moves 25 MB: communication sets the pace, as the issue's "5-10M parameters where
# communication dominates" asks. Every system's steps, and the process alone's, take the settings
# one process does best with (benchmarks/lm_alone.py): batches of LM_BATCH windows, Adam at LM_LR,
# LM_TARGET in 245 steps, about 50 s of a core (as do batches of 512, in 135 steps of twice the
# CPU). A step is mostly Adam's pass over the table, whatever the batch. Until 2026-12-07 the
# workload ran batches of 32 at lr 1e-3 to a loss of 1.50: 940 steps, where one process tuned
# gets there in 60 steps and a tenth of the CPU. One machine was compared far below its pace.
LM_BUCKETS = 65536
LM_WIDTH = 96
LM_CONTEXT = 64  # bytes per window; a sample is a window
LM_LR = 1.6e-2  # Adam; 3.2e-2 is as fast (280 steps), 8e-3 slower
LM_BATCH = 256
LM_TARGET = 1.40  # validation loss, nats per byte
LM_VALIDATION_WINDOWS = 256  # held-out windows scored (16K bytes: about 20 ms a score on a core)
LM_EVAL_EVERY = 2.0  # s between scores, by time only: one per sync epoch (2 steps of ~60 ms) costs a sixth more


def make_lm() -> Any:
    """The "lm" workload's model, the same initial weights on every call: logits for the next
    byte from the sum of the current byte's embedding and its hashed 3-byte context's row."""
    import torch
    from torch import nn
    from torch.nn import functional as F

    class HashedBytes(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.table = nn.Embedding(LM_BUCKETS, LM_WIDTH)
            self.byte = nn.Embedding(256, LM_WIDTH)
            self.head = nn.Linear(LM_WIDTH, 256)
            nn.init.normal_(self.table.weight, std=0.02)
            nn.init.normal_(self.byte.weight, std=0.02)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            previous, before = F.pad(x, (1, 0))[:, :-1], F.pad(x, (2, 0))[:, :-2]
            rows = (x * 257 + previous * 65599 + before * 31) % LM_BUCKETS
            return self.head(torch.tanh(self.byte(x) + self.table(rows)))

    torch.manual_seed(0)
    return HashedBytes()


def lm_data() -> dict:
    """The "lm" workload's data as `LMTask` takes it: the training text, and the held-out windows
    every process scores on (the same ones everywhere)."""
    from potluck.workloads import lm
    corpus = lm.load_corpus()
    return {"train": corpus.train, "validation": lm.validation_sample(corpus, LM_CONTEXT, LM_VALIDATION_WINDOWS)}


class LMTask:
    """The "lm" workload's batches (random training windows) and score (validation loss on the
    parent's held-out windows, the same for every process; the target is reached at or below it),
    as `training.train_until_stopped` takes them."""

    eval_every = LM_EVAL_EVERY
    eval_at_epochs = False

    def __init__(self, data: dict, target: float):
        from potluck.workloads import lm
        self.lm, self.train, self.validation, self.target = lm, data["train"], data["validation"], target

    def batch(self, generator: Any, size: int) -> tuple[Any, Any]:
        import torch
        starts = torch.randint(0, len(self.train) - LM_CONTEXT - 1, (size,), generator=generator)
        return self.lm.windows(self.train, starts, LM_CONTEXT)

    def loss(self, model: Any, x: Any, y: Any) -> Any:
        return self.lm.lm_loss(model, x, y)

    def score(self, model: Any) -> float:
        return self.lm.evaluate(model, self.validation)["val_loss"]

    def reached(self, score: float) -> bool:
        return score <= self.target


def make_wide() -> Any:
    """The "wide" workload's model: 64 -> 2560 -> 2560 -> 10, the same initial weights on every call."""
    import torch
    from torch import nn
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), nn.Linear(64, WIDE_HIDDEN), nn.ReLU(), nn.Linear(WIDE_HIDDEN, WIDE_HIDDEN),
                         nn.ReLU(), nn.Linear(WIDE_HIDDEN, 10))


class LoneAdam:
    """One process training alone (`--alone`): Adam at the swarms' `lr`, on batches of `batch`; an
    "epoch" is every global batch of samples (256), so it evaluates as often per sample as a sync
    swarm's peer does, and as often in time as every process does."""

    def __init__(self, model: Any, batch: int, lr: float):
        import torch
        import torchft_compare as base
        self.adam = torch.optim.Adam(model.parameters(), lr)
        self.steps_per_epoch = max(1, base.GLOBAL_BATCH // batch)
        self.steps = 0

    def zero_grad(self) -> None:
        self.adam.zero_grad()

    def step(self) -> None:
        self.adam.step()
        self.steps += 1

    @property
    def local_epoch(self) -> int:
        return self.steps // self.steps_per_epoch


def train_worker(args: argparse.Namespace) -> None:
    """One training peer (benchmarks/training.py's loop: ready, go, train and evaluate, stop).

    torchft as benchmarks/torchft_compare.py runs it (a replica group of one process, the global
    batch split over the peers, one flat all-reduce of the gradients per step), its servers and
    Gloo on this namespace's address; hivemind with `hivemind.Optimizer` and potluck sync's
    settings (as benchmarks/training.py runs it), its Go daemon listening on this address."""
    host = f"{SUBNET}.{args.rank + 1}"
    if args.train.startswith("torchft"):
        os.environ["GLOO_SOCKET_IFNAME"] = f"pwan{args.rank}"  # else Gloo binds to what "vm" is: 127.0.0.1
    import torch
    import torchft_compare as base
    from training import say, train_until_stopped

    from potluck.cli.tasks import make_model
    torch.set_num_threads(1)
    data = torch.load(args.data)
    model = {"wide": make_wide, "lm": make_lm}.get(args.workload, make_model)()
    task = LMTask(data, args.target) if args.workload == "lm" else None
    lr = args.lr
    batch = args.local_batch  # each peer's samples a step; the global batch grows with it
    global_batch = base.GLOBAL_BATCH * batch // base.POTLUCK_LOCAL_BATCH
    slowdown = base.SLOWDOWN if args.rank == base.SLOW_RANK else 1.0
    if args.train.startswith("torchft"):
        diloco = args.train == "torchft_diloco"
        # (an all-reduce of the wide or lm model takes over 4 s on these links: past torchft_compare's 5 s)
        timeout = base.TORCHFT_TIMEOUT if args.workload == "digits" else WIDE_TORCHFT_TIMEOUT
        address, opt, closers = base.torchft_peer(args, model, host=host, timeout_s=timeout, diloco=diloco,
                                                  sync_every=args.local_steps, lr=lr, outer_lr=args.outer_lr,
                                                  outer_momentum=args.outer_momentum)
        say(event="ready", address=address, version=None)
        train_until_stopped(args, model, opt, opt.zero_grad, closers, data, slowdown=slowdown,
                            local_batch=batch if diloco else global_batch // args.peers,
                            task=task)
        return
    if args.train == "hivemind":
        import hivemind
        dht = hivemind.DHT(start=True, initial_peers=[args.initial] if args.initial else None,
                           host_maddrs=[f"/ip4/{host}/tcp/0"])
        opt = hivemind.Optimizer(dht=dht, run_id=RUN_ID, params=model.parameters(),
                                 optimizer=lambda p: torch.optim.Adam(p, lr), target_batch_size=global_batch,
                                 batch_size_per_step=batch,
                                 average_state_every=base.AVERAGE_STATE_EVERY, matchmaking_time=args.matchmaking_time,
                                 averaging_timeout=base.AVERAGING_TIMEOUT, verbose=False)
        say(event="ready", address=str(dht.get_visible_maddrs()[0]), version=hivemind.__version__)
        # hivemind's documented loop calls zero_grad (it accumulates into its own buffers)
        train_until_stopped(args, model, opt, opt.zero_grad, [opt.shutdown, dht.shutdown], data,
                            local_batch=batch, slowdown=slowdown, task=task)
        return
    if args.train == "alone":
        opt = LoneAdam(model, args.alone, lr)
        say(event="ready", address=None, version=None)
        train_until_stopped(args, model, opt, opt.zero_grad, [], data, local_batch=args.alone, task=task)
        return
    import potluck
    peer = potluck.Peer(host=host, initial_peers=[args.initial] if args.initial else [])
    options = {"average_state_every": base.AVERAGE_STATE_EVERY, "matchmaking_time": args.matchmaking_time,
               "averaging_timeout": base.AVERAGING_TIMEOUT, **SYSTEMS[args.train]}
    if "local_steps" in options:
        options.update(local_steps=args.local_steps, outer_lr=args.outer_lr, outer_momentum=args.outer_momentum)
        if args.outer_delay is not None:
            options["outer_delay"] = args.outer_delay
    if args.aggregation:
        options["aggregation"] = args.aggregation
    opt = potluck.Optimizer(peer, RUN_ID, model.parameters(), lambda p: torch.optim.Adam(p, lr),
                            target_batch_size=global_batch, batch_size_per_step=batch,
                            bandwidth=told_bandwidth(args), **options)
    say(event="ready", address=peer.addresses[0], version=None)
    train_until_stopped(args, model, opt, None, [opt.shutdown, peer.shutdown], data,
                        local_batch=batch, slowdown=slowdown, task=task)


def train_profile(args: argparse.Namespace, profile: str, data: str) -> None:
    """Each of --systems from a common start on this profile's links, until the target or the cap."""
    from training import rows_for, run_swarm
    sweep()
    switch = build(args.peers, profile)
    figures: dict[str, float | None] = {}
    try:
        for system in args.systems.split(","):
            params = {"profile": profile, "workload": args.workload, "local_steps": args.local_steps,
                      "bandwidth": "measured" if args.measure_bandwidth else "told",
                      "outer": [args.outer_lr, args.outer_momentum], "outer_delay": args.outer_delay,
                      "aggregation": args.aggregation, "cpus": args.cpus, "local_batch": args.local_batch,
                      "matchmaking_time": args.matchmaking_time,
                      "lr": args.lr,
                      "target": args.target, "cap_s": args.cap,
                      "date": datetime.date.today().isoformat(),
                      "command": " ".join(["python", "benchmarks/wan.py", *sys.argv[1:]])}
            python = str(ROOT / OTHERS[system] / "bin" / "python") if system in OTHERS else sys.executable
            if not Path(python).exists():
                print(json.dumps({"metric": "time_to_accuracy", "system": system, "value": None, "unit": "s",
                                  **params, "error": f"not installed ({OTHERS[system]})"}), flush=True)
                continue

            def command(rank: int, initial: str | None, system: str = system, python: str = python) -> list[str]:
                return cpu_capped(["ip", "netns", "exec", f"{PREFIX}{rank}", python, __file__, "--train", system,
                        "--rank", str(rank), "--peers", str(args.peers), "--data", data, "--workload", args.workload,
                        "--local-steps", str(args.local_steps), "--outer-lr", str(args.outer_lr),
                        "--outer-momentum", str(args.outer_momentum), "--local-batch", str(args.local_batch),
                        "--lr", str(args.lr), "--matchmaking-time", str(args.matchmaking_time),
                        *(["--outer-delay", str(args.outer_delay)] if args.outer_delay is not None else []),
                        *(["--aggregation", args.aggregation] if args.aggregation else []),
                        "--target", str(args.target), "--profile", profile,
                        *(["--measure-bandwidth"] if args.measure_bandwidth else []),
                        *(["--initial", initial] if initial else [])], f"peer{rank}", args.cpus)
            beside = [cpu_capped([sys.executable, __file__, "--train", "alone", "--alone", str(args.alone),
                                  "--data", data, "--workload", args.workload, "--target", str(args.target),
                                  "--lr", str(args.lr)],
                                 "alone", args.cpus)] if args.alone else []
            try:
                raw = run_swarm(command, args.peers, args.cap, beside=beside)
            except Exception as e:  # noqa: BLE001 - reported, and the other systems run
                print(json.dumps({"metric": "time_to_accuracy", "system": system, "value": None, "unit": "s",
                                  **params, "error": f"{type(e).__name__}: {e}"[-2000:]}), flush=True)
                continue
            rows, figures[system] = rows_for(system, args.peers, raw, params)
            if args.workload == "lm":  # (rows_for names the score after the digits' accuracy)
                rows[0]["final_val_loss"] = rows[0].pop("final_accuracy")
                rows[0]["measured"] = "wall time from the common start until the first peer's validation loss <= target"
                rows[1]["unit"] = "(s, epoch, validation loss)"
            print(json.dumps(rows[0]), flush=True)
            print(json.dumps(rows[1]), flush=True)
            if args.alone:
                print_alone(raw["beside"][0], system, figures[system], args, params)
        for system, seconds in figures.items():  # above 1: potluck's sync is faster
            if system != "sync" and "sync" in figures:
                row = {"metric": "time_to_accuracy_ratio", "unit": f"{system}/sync", "profile": profile,
                       "value": round(seconds / figures["sync"], 2) if seconds and figures["sync"] else None}
                if figures["sync"] and not seconds:
                    row["at_least"] = round(args.cap / figures["sync"], 2)
                print(json.dumps(row), flush=True)
    finally:
        switch.close()
        sweep()
        print(json.dumps({"metric": "switch_cpu_seconds", "profile": profile, "value": round(switch.cpu_seconds, 2),
                          "unit": "s", "dropped_frames": switch.dropped}), flush=True)


def print_alone(lone: dict, system: str, swarm: float | None, args: argparse.Namespace, params: dict) -> None:
    """The lone process's time to target beside `system`'s swarm, and its ratio (above 1: the swarm
    got there sooner)."""
    seconds = None if lone["reached"] is None else round(lone["reached"]["seconds"], 2)
    final = lone["final"] or {}
    score = "final_val_loss" if args.workload == "lm" else "final_accuracy"
    print(json.dumps({"metric": "time_to_accuracy", "system": "alone", "beside": system, "batch": args.alone,
                      "value": seconds, "unit": "s", "steps": final.get("samples", 0) // args.alone,
                      **{k: final.get(k) for k in ("in_step_seconds", "in_step_cpu_seconds", "train_cpu_seconds",
                                                   "process_cpu_seconds")},
                      score: final.get("accuracy"), "curve": (final.get("curve") or [])[::10], **params}), flush=True)
    row = {"metric": "time_to_accuracy_ratio", "unit": f"alone/{system}", "batch": args.alone,
           "value": round(seconds / swarm, 2) if seconds and swarm else None, **params}
    if swarm and not seconds:
        row["at_least"] = round(args.cap / swarm, 2)
    print(json.dumps(row), flush=True)


def parse_count(text: str) -> int:
    scale = {"K": 10**3, "M": 10**6}.get(text[-1:].upper(), 1)
    return int(float(text[:-1] if scale > 1 else text) * scale)


def main() -> None:
    import torchft_compare as base
    base_outer = (base.DILOCO_OUTER_LR, base.DILOCO_OUTER_MOMENTUM)  # potluck's defaults (the paper's)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profile", default="wan,home,lossy")
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--floats", type=parse_count, default=parse_count("1M"))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--compression", default="none,blockwise8",
                        help="codecs to run, comma-separated (none: float32; blockwise8: 8-bit)")
    parser.add_argument("--allreduce", default="potluck",
                        help="all-reduce engines, comma-separated: potluck (told its link's rates), "
                             "potluck_measured (measuring them); references: gloo (torch.distributed's, float32), "
                             "tcp (the butterfly's bytes over plain TCP), tcp_paced (each flow paced to its "
                             "share of the uplink)")
    parser.add_argument("--short", "--quick", action="store_true",
                        help="the wan profile, 1M floats, 3 rounds, both codecs (under two minutes)")
    parser.add_argument("--systems", default=",".join([*SYSTEMS, *OTHERS]),
                        help="training systems for time to target ('' for none)")
    parser.add_argument("--target", type=float, default=None,
                        help=f"test accuracy to reach (digits, wide: default 0.95) or validation loss to reach "
                             f"(lm: default {LM_TARGET})")
    parser.add_argument("--local-steps", type=int, default=8,
                        help="inner steps per outer step of the DiLoCo systems, potluck's and torchft's (default 8)")
    parser.add_argument("--outer-lr", type=float, default=base_outer[0],
                        help=f"the DiLoCo systems' outer learning rate, potluck's and torchft's alike "
                             f"(default {base_outer[0]})")
    parser.add_argument("--outer-momentum", type=float, default=base_outer[1],
                        help=f"their outer Nesterov momentum (default {base_outer[1]}; 0 and lr 1: the plain "
                             "average)")
    parser.add_argument("--outer-delay", type=int, default=None,
                        help="inner steps each outer round of potluck's DiLoCo systems overlaps (default: each "
                             "system's own, 1 for Streaming DiLoCo, 0 otherwise); under local steps / fragments")
    parser.add_argument("--aggregation", choices=["mean", "centered_clip", "trimmed_mean"], default=None,
                        help="how potluck's systems aggregate each round (default: each system's own, CenteredClip "
                             "in these open runs, the mean for sync_mean)")
    parser.add_argument("--workload", choices=["digits", "wide", "lm"], default="digits",
                        help="time to target: the demo's CNN, a 6.7M-parameter MLP on the same digits, or a "
                             "6.3M-parameter byte-level language model (hashed contexts) on the standard library's "
                             "source")
    parser.add_argument("--lr", type=float, default=None,
                        help=f"Adam's learning rate, every system's (their inner steps) and the lone process's "
                             f"(default: the workload's, {LM_LR} for lm, {base.LR} otherwise)")
    parser.add_argument("--local-batch", type=int, default=None,
                        help=f"samples in each peer's step, every system's; the global batch of the synchronous "
                             f"ones grows with it (default: the workload's, {LM_BATCH} for lm, "
                             f"{base.POTLUCK_LOCAL_BATCH} otherwise; global {base.GLOBAL_BATCH} at "
                             f"{base.POTLUCK_LOCAL_BATCH})")
    parser.add_argument("--matchmaking-time", type=float, default=MATCHMAKING_TIME,
                        help=f"seconds potluck's and hivemind's rounds gather their group (default "
                             f"{MATCHMAKING_TIME}, the Optimizer's); over a peer's step time, or peers miss rounds")
    parser.add_argument("--cap", type=float, default=90.0, help="seconds of training per system at most")
    parser.add_argument("--alone", type=int, default=0, metavar="BATCH",
                        help="with each system, one more process trains alone (Adam on batches of BATCH, no "
                             "network) from the same start on the same cores: the swarm against one machine")
    parser.add_argument("--cpus", type=float, default=None, metavar="CORES",
                        help="time to target: each training process (a peer, the lone process) in a CPU cgroup "
                             "of its own capped at CORES cores, machines of equal compute (default: no cap, the "
                             "processes share the cores as the scheduler gives them)")
    parser.add_argument("--measure-bandwidth", action="store_true",
                        help="time to target: potluck's peers measure their links instead of being told the "
                             "profile's rates (the all-reduce then does not pace its sends)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--train", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--data", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--initial", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.lr is None:
        args.lr = LM_LR if args.workload == "lm" else base.LR
    if args.local_batch is None:
        args.local_batch = LM_BATCH if args.workload == "lm" else base.POTLUCK_LOCAL_BATCH
    if args.worker:
        {"gloo": gloo_worker, "tcp": tcp_worker, "tcp_paced": tcp_worker}.get(args.allreduce, worker)(args)
        return
    if args.train:
        train_worker(args)
        return
    if os.geteuid() != 0:
        sys.exit("wan.py needs root (network namespaces)")
    profiles = ["wan"] if args.short else args.profile.split(",")
    if set(args.allreduce.split(",")) - {*ENGINES, ""}:
        sys.exit(f"--allreduce takes {', '.join(ENGINES)}, not {args.allreduce!r}")
    if args.short:
        args.rounds, args.floats, args.systems, args.target, args.cap = 3, parse_count("1M"), "sync_8bit", 0.9, 30.0
    if args.target is None:
        args.target = LM_TARGET if args.workload == "lm" else 0.95
    processes = args.peers + (1 if args.alone else 0)
    if args.cpus is not None and processes * args.cpus > (os.cpu_count() or 1):
        print(f"wan.py: {processes} processes x {args.cpus:g} cores is more than this machine's {os.cpu_count()}: "
              f"the caps will not bind; pass --cpus {0.9 * (os.cpu_count() or 1) / processes:.2f} or less",
              file=sys.stderr)
    import torch

    from potluck.cli.tasks import load_data
    # A kill (timeout, a CI step's end) ends us through the sweep below, not around it: the
    # namespaces stayed, with the workers in them.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        with tempfile.TemporaryDirectory() as tmp:
            data = str(Path(tmp) / "data.pt")
            if args.workload == "lm":  # this python's standard library, for every venv's workers alike
                torch.save(lm_data(), data)
            else:
                torch.save(load_data(), data)
            os.chmod(tmp, 0o755)
            for profile in profiles:
                seconds: dict[tuple[str, str], float] = {}
                for engine in [e for e in args.allreduce.split(",") if e]:
                    for compression in [c for c in args.compression.split(",") if c]:
                        if engine != "gloo" or compression == "none":  # (Gloo averages float32 only)
                            result = run_profile(args, profile, compression, engine)
                            seconds[engine, compression] = result["value"]
                            print(json.dumps(result), flush=True)
                for (engine, compression), value in seconds.items():
                    for reference in ("tcp", "tcp_paced"):
                        if engine.startswith("potluck") and (reference, compression) in seconds:
                            print(json.dumps({"metric": "allreduce_over_links", "profile": profile,
                                              "compression": compression, "unit": f"{engine}/{reference}",
                                              "value": round(value / seconds[reference, compression], 2)}), flush=True)
                if args.systems:
                    train_profile(args, profile, data)
    finally:
        sweep()


if __name__ == "__main__":
    main()
