"""potluck side by side with torchft: wall time to a target test accuracy on the demo's workload.

The demo's CNN (`potluck.cli.demo.make_model`, same initial weights everywhere) on scikit-learn's
digits (`load_data`), Adam(lr=3e-3), a global batch of 256 samples, 4 peer processes of which
rank 2 computes 2x slower (it sleeps as long again after each backward pass):

  potluck         `potluck.Optimizer` in sync mode: target_batch_size=256, batch_size_per_step=32,
                  average_state_every=5, matchmaking_time=0.5 s, averaging_timeout=20 s; rank 3 is
                  in client mode (as if behind NAT: it dials out only).
  potluck_mean    the same with `aggregation="mean"` (the default of a run with an authority; an
                  open run's default is CenteredClip).
  potluck_delayed the same as potluck with `delay_updates=True` (each round averages in the
                  background while the next batches are computed; updates one step stale).
  potluck_diloco  `potluck.Optimizer` in diloco mode, local_steps=8 (an outer step per 256 local
                  samples of each peer; --local-steps), the same peers.
  potluck_diloco_mean  the same with `aggregation="mean"` (potluck_diloco runs the open run's
                  default, CenteredClip).
  torchft         torchft 0.2.0 (from the python of .venv-torchft: scripts/torchft-venv.sh): rank 0
                  runs the lighthouse (min_replicas=2, so it goes on when a peer fails); every peer
                  is a replica group of one process with its own TCPStore, a `torchft.Manager` over
                  a `ProcessGroupGloo` (timeouts 5 s), and `torchft.Optimizer` around Adam. Each step: zero_grad()
                  (starts the quorum), forward and backward on 64 samples (256 / 4), one average
                  all-reduce of all gradients, flattened into one tensor (as torchft's DDP
                  buckets them), through `Manager.allreduce`, step() (applied if the
                  step committed). No client mode: every replica must accept Gloo connections. The
                  step is synchronous, so the whole swarm moves at the slow peer's pace.
  torchft_diloco  torchft's DiLoCo (`torchft.local_sgd.DiLoCo`, the same Manager with a synchronous
                  quorum, as it requires) with potluck_diloco's settings: 32 samples per inner
                  Adam step, an outer step every 8 or --local-steps (SGD, lr 0.7, Nesterov momentum 0.9: potluck's
                  defaults, the paper's), the outer all-reduce of the whole model.

The processes, the common start and the time-to-accuracy measurement are benchmarks/training.py's
(`run_swarm`, `train_until_stopped`, `rows_for`): each process evaluates on the test set at every
new epoch (torchft: committed step) and at least every 0.5 s; a run's time is its first peer's.
Systems run one after another, --repeats times each, and the medians are compared.

Prints one JSON object per line, e.g.
  {"metric": "time_to_accuracy", "system": "torchft", "value": 9.1, "unit": "s", "repeat": 0, ...}
  {"metric": "time_to_accuracy_median", "system": "torchft", "value": 9.3, "unit": "s", ...}
  {"metric": "time_to_accuracy_ratio", "unit": "torchft/potluck", "value": 0.8, ...}

Usage: python benchmarks/torchft_compare.py [--quick] [--repeats 3] [--target 0.95] [--cap 90]
           [--systems potluck,potluck_mean,potluck_delayed,potluck_diloco,potluck_diloco_mean,torchft,
                      torchft_diloco]
           [--local-steps 8] [--torchft-python PATH]
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import tempfile
from datetime import timedelta
from pathlib import Path
from typing import Any

from peer_processes import parse_or_run_worker
from training import ROOT, emit, rows_for, run_swarm, say, train_until_stopped

DEFAULT_TORCHFT_PYTHON = ROOT / ".venv-torchft" / "bin" / "python"
PEERS = 4
SLOW_RANK, SLOWDOWN = 2, 2.0
CLIENT_RANK = 3  # potluck only
LR = 3e-3
GLOBAL_BATCH = 256
POTLUCK_LOCAL_BATCH = 32  # the demo's
AVERAGE_STATE_EVERY = 5
MATCHMAKING_TIME = 0.5
AVERAGING_TIMEOUT = 20.0  # s, potluck's
# s, torchft's collectives and quorums: its steps take ~0.1 s here, and at the end the last peers
# wait this long for those that already stopped
TORCHFT_TIMEOUT = 5.0
DILOCO_LOCAL_STEPS = 8  # 8 x 32 = 256 samples of each peer between outer steps
TORCHFT_MIN_REPLICAS = 2  # the lighthouse forms quorums of at least this many replica groups
TORCHFT_JOIN_TIMEOUT_MS = 1000  # for the first quorum, all four replicas are heartbeating by then
SYSTEMS = ("potluck", "potluck_mean", "potluck_delayed", "potluck_diloco", "potluck_diloco_mean", "torchft",
           "torchft_diloco")
DILOCO_OUTER_LR, DILOCO_OUTER_MOMENTUM = 0.7, 0.9  # potluck's defaults (modes.DiLoCo), the paper's


# == worker side ==================================================================================
class TorchftStep:
    """torchft's training step behind the interface `train_until_stopped` drives: zero_grad()
    starts the quorum, step() averages the gradients and applies them if the step commits. Holds
    the replica group's TCPStore: its server lives as long as the object does."""

    def __init__(self, manager: Any, optimizer: Any, params: list, store: Any):
        self.manager, self.optimizer, self.params, self.store = manager, optimizer, params, store

    @property
    def local_epoch(self) -> int:
        return self.manager.current_step()

    def zero_grad(self) -> None:
        self.optimizer.zero_grad()

    def step(self) -> None:
        # One flat all-reduce of all gradients, as torchft's DDP does with its buckets (this model's
        # 150 KB of gradients fit one 25 MB bucket); one collective per tensor would pay a round
        # trip per tensor.
        import torch
        grads = [p.grad for p in self.params if p.grad is not None]
        flat = torch.cat([g.reshape(-1) for g in grads])
        self.manager.allreduce(flat).wait()
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()
        self.optimizer.step()


class TorchftDiLoCoStep:
    """torchft's DiLoCo behind the same interface: step() is the inner Adam step, whose hook
    (`DiLoCo`) runs the outer all-reduce and step every `sync_every` steps."""

    def __init__(self, manager: Any, inner: Any, diloco: Any, store: Any):
        self.manager, self.inner, self.diloco, self.store = manager, inner, diloco, store

    @property
    def local_epoch(self) -> int:
        return self.manager.current_step()

    def zero_grad(self) -> None:
        self.inner.zero_grad()

    def step(self) -> None:
        self.inner.step()


def torchft_peer(args: argparse.Namespace, model: Any, host: str = "127.0.0.1",
                 timeout_s: float = TORCHFT_TIMEOUT, diloco: bool = False,
                 sync_every: int = DILOCO_LOCAL_STEPS, lr: float = LR, outer_lr: float = DILOCO_OUTER_LR,
                 outer_momentum: float = DILOCO_OUTER_MOMENTUM) -> tuple[str | None, Any, list]:
    """A torchft replica group of one process whose servers (lighthouse on rank 0, TCPStore, manager,
    checkpoint server) are reached at `host`. Off loopback, set GLOO_SOCKET_IFNAME to `host`'s
    interface first: Gloo otherwise binds to what the machine's hostname resolves to. `diloco`:
    torchft's DiLoCo (an outer step every `sync_every` inner steps) instead of a gradient all-reduce
    per step; `lr`: Adam's; `outer_lr`, `outer_momentum`: DiLoCo's outer SGD (Nesterov)."""
    import torch
    import torchft
    from torch.distributed import TCPStore
    from torchft._torchft import LighthouseServer
    from torchft.checkpointing.http_transport import HTTPTransport

    class Transport(HTTPTransport):
        """torchft's checkpoint server, advertised at `host` (it says http://<hostname>:port, and this
        machine's hostname resolves to 127.0.0.1: in a network namespace, the recovering peer itself)."""

        def address(self) -> str:
            return f"http://{host}:{self._server.socket.getsockname()[1]}/checkpoint/"

    closers: list = []
    address = args.initial
    if args.rank == 0:
        lighthouse = LighthouseServer(bind=f"{host}:0", min_replicas=TORCHFT_MIN_REPLICAS,
                                      join_timeout_ms=TORCHFT_JOIN_TIMEOUT_MS)
        address = f"http://{host}:" + lighthouse.address().rsplit(":", 1)[1]
        closers.append(lighthouse.shutdown)
    store = TCPStore(host, 0, is_master=True, wait_for_workers=False)  # this replica group's
    timeout = timedelta(seconds=timeout_s)
    manager = torchft.Manager(pg=torchft.ProcessGroupGloo(timeout=timeout), min_replica_size=TORCHFT_MIN_REPLICAS,
                              load_state_dict=model.load_state_dict, state_dict=model.state_dict,
                              store_addr=host, store_port=store.port, lighthouse_addr=address,
                              replica_id=f"replica{args.rank}", rank=0, world_size=1, hostname=host,
                              timeout=timeout, quorum_timeout=timeout, init_sync=False,
                              checkpoint_transport=Transport(timeout=timeout, num_chunks=0),
                              use_async_quorum=not diloco)
    closers.insert(0, manager.shutdown)
    if diloco:
        from torchft.local_sgd import DiLoCo
        inner = torch.optim.Adam(model.parameters(), lr)
        outer = torch.optim.SGD(model.parameters(), lr=outer_lr, momentum=outer_momentum,
                                nesterov=outer_momentum > 0)  # (torch refuses Nesterov without momentum)
        wrapper = DiLoCo(manager, [model], inner, outer, sync_every=sync_every)
        wrapper.__enter__()
        closers.insert(0, lambda: wrapper.__exit__(None, None, None))
        return address, TorchftDiLoCoStep(manager, inner, wrapper, store), closers
    opt = TorchftStep(manager, torchft.Optimizer(manager, torch.optim.Adam(model.parameters(), lr)),
                      list(model.parameters()), store)
    return address, opt, closers


def potluck_peer(args: argparse.Namespace, model: Any) -> tuple[str | None, Any, list]:
    import torch

    import potluck
    client = args.rank == CLIENT_RANK
    peer = potluck.Peer(host="127.0.0.1", initial_peers=[args.initial] if args.initial else [], client_mode=client)
    mode = {"potluck": {}, "potluck_mean": {"aggregation": "mean"},
            "potluck_delayed": {"delay_updates": True},
            "potluck_diloco": {"mode": "diloco", "local_steps": args.local_steps},
            "potluck_diloco_mean": {"mode": "diloco", "local_steps": args.local_steps,
                                    "aggregation": "mean"}}[args.worker]
    opt = potluck.Optimizer(peer, "torchft-compare", model.parameters(), lambda p: torch.optim.Adam(p, LR),
                            target_batch_size=GLOBAL_BATCH, batch_size_per_step=POTLUCK_LOCAL_BATCH,
                            role=potluck.Role.CLIENT if client else potluck.Role.NODE,
                            average_state_every=AVERAGE_STATE_EVERY, matchmaking_time=MATCHMAKING_TIME,
                            averaging_timeout=AVERAGING_TIMEOUT, **mode)
    return (peer.addresses[0] if peer.addresses else None), opt, [opt.shutdown, peer.shutdown]


def run_worker(args: argparse.Namespace) -> None:
    import torch

    from potluck.cli.tasks import make_model
    torch.set_num_threads(1)
    data = torch.load(args.data)
    model = make_model()
    if args.worker == "torchft":
        address, opt, closers = torchft_peer(args, model)
        zero_grad, batch = opt.zero_grad, GLOBAL_BATCH // PEERS
    elif args.worker == "torchft_diloco":
        address, opt, closers = torchft_peer(args, model, diloco=True, sync_every=args.local_steps)
        zero_grad, batch = opt.zero_grad, POTLUCK_LOCAL_BATCH  # potluck_diloco's inner batches
    else:
        address, opt, closers = potluck_peer(args, model)
        zero_grad, batch = None, POTLUCK_LOCAL_BATCH  # potluck's step consumes the gradients
    say(event="ready", address=address, version=None)
    train_until_stopped(args, model, opt, zero_grad, closers, data, local_batch=batch,
                        slowdown=SLOWDOWN if args.rank == SLOW_RANK else 1.0)


# == parent side ==================================================================================
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="target 0.9, cap 12 s, one run each of potluck and torchft: about a minute")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--target", type=float, default=0.95, help="test accuracy to reach")
    parser.add_argument("--cap", type=float, default=90.0, help="seconds of training per run at most")
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--local-steps", type=int, default=DILOCO_LOCAL_STEPS,
                        help="inner steps per outer step of potluck_diloco and torchft_diloco alike")
    parser.add_argument("--torchft-python", default=str(DEFAULT_TORCHFT_PYTHON))
    args = parse_or_run_worker(parser, run_worker, SYSTEMS, data=True)
    if args is None:
        return
    if args.quick:
        args.target, args.cap, args.repeats, args.systems = 0.9, 12.0, 1, "potluck,torchft"
    import torch

    from potluck.cli.tasks import load_data
    common = {"target": args.target, "cap_s": args.cap, "global_batch": GLOBAL_BATCH, "lr": LR, "optimizer": "Adam",
              "slow_rank": SLOW_RANK, "slowdown": SLOWDOWN, "torch_threads_per_process": 1,
              "local_steps": args.local_steps,
              "schedule": "systems run one after another", "date": datetime.date.today().isoformat(),
              "machine": f"{platform.machine()} {os.cpu_count()} cores, {platform.python_version()}",
              "command": " ".join(["python", "benchmarks/torchft_compare.py", *sys.argv[1:]])}
    medians: dict[str, float | None] = {}
    with tempfile.TemporaryDirectory() as tmp:
        data = str(Path(tmp) / "digits.pt")
        torch.save(load_data(), data)  # the torchft venv has no scikit-learn: every process loads this
        for system in args.systems.split(","):
            torchft = system.startswith("torchft")
            python = args.torchft_python if torchft else sys.executable
            params = {"system": system, "peers": PEERS, **common, **({} if torchft else {"client_rank": CLIENT_RANK})}
            if not Path(python).exists():
                emit({"metric": "time_to_accuracy", "value": None, "unit": "s", **params,
                      "error": f"no {python}; create it with scripts/torchft-venv.sh"})
                continue
            base = [python, __file__, "--worker", system, "--data", data, "--target", str(args.target),
                    "--local-steps", str(args.local_steps)]
            times: list[float | None] = []
            for repeat in range(args.repeats):
                try:
                    raw = run_swarm(lambda rank, initial, base=base: [*base, "--rank", str(rank),
                                                                      *(["--initial", initial] if initial else [])],
                                    PEERS, args.cap)
                except Exception as e:  # noqa: BLE001 - report and go on
                    emit({"metric": "time_to_accuracy", "value": None, "unit": "s", "repeat": repeat, **params,
                          "error": f"{type(e).__name__}: {e}"[-3000:]})
                    times.append(None)
                    continue
                rows, first = rows_for(system, PEERS, raw, {**common, "repeat": repeat})
                times.append(first)
                for row in rows:
                    emit(row)
            reached = [t for t in times if t is not None]
            medians[system] = statistics.median(reached) if len(reached) == len(times) and times else None
            emit({"metric": "time_to_accuracy_median", "value": medians[system] and round(medians[system], 2),
                  "unit": "s", "runs": [t and round(t, 2) for t in times], **params})
    for theirs in ("torchft", "torchft_diloco"):
        for other in ("potluck", "potluck_mean", "potluck_delayed", "potluck_diloco", "potluck_diloco_mean"):
            if medians.get(theirs) and medians.get(other):
                emit({"metric": "time_to_accuracy_ratio", "value": round(medians[theirs] / medians[other], 2),
                      "unit": f"{theirs}/{other}", "measured": "median over median; above 1: potluck is faster",
                      "peers": PEERS, **common})


if __name__ == "__main__":
    main()
