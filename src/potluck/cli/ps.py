"""`potluck ps`: parameter-server training across processes and machines.

`potluck ps server` serves one shard of a user's model (or stands by for it); `potluck ps worker`
trains against the servers. Servers announce themselves and the layout in the DHT
(`potluck.ps.discovery`); workers find them there, so nobody passes a layout by hand. With
`--serve-shard K` a worker also serves shard K and stands by for shard K-1 (the fully
decentralized form). See docs/ps.md.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import time
from collections.abc import Sequence
from typing import Any

from potluck.cli.help import OldName
from potluck.cli.peer import add_peer_options, print_join_addresses, start_peer
from potluck.cli.signals import StopSignal
from potluck.cli.spec import RunSpec, add_spec_options

# How long a worker waits for every shard to have a server, and a standby for its primary.
DISCOVERY_TIMEOUT = 120.0
# How often a server prints its step (and notices a takeover, which it prints at once).
STATUS_SECONDS = 5.0
# How often the main thread looks at its servers: the delay before a takeover is printed.
WATCH_SECONDS = 0.2
# A serving worker that has done its steps keeps serving until no worker has called it for this
# long: the others may still need its shard for their last rounds and final pull.
LINGER_IDLE_SECONDS = 3.0


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "ps", help="parameter-server training across machines: shard servers and workers",
        description="Parameter-server training of a user's model (--model, --data: see `potluck ps worker --help`). "
                    "Start `ps server` once per shard (and optionally a standby per shard) and `ps worker` once per "
                    "worker, all with the same --run-id, --model, --seed and --shards and --initial-peers of any "
                    "peer of the swarm. Servers announce the layout in the DHT; workers find it there. Or run only "
                    "workers with --serve-shard: every worker serves one shard and keeps a standby copy of another.")
    commands = parser.add_subparsers(dest="ps_command", metavar="SUBCOMMAND")
    server = commands.add_parser(
        "server", help="serve one shard of the model (or stand by for it)",
        description="Serve shard K of N of the model's parameters until Ctrl-C. The parameters are split by size; "
                    "every server and worker computes the same split from --model and --shards. With --standby-of, "
                    "keep a copy of the shard's state (parameters and optimizer statistics, after every step) and "
                    "take over when its primary dies.")
    add_peer_options(server)
    _run_options(server)
    server.add_argument("--shard", type=int, required=True, help="which shard (0 to N-1)")
    server.add_argument("--standby-of", metavar="PEER|auto",
                        help="be the standby of the shard's primary: its peer id, or 'auto' to find it in the DHT")
    server.add_argument("--await-standby", action="store_true",
                        help="(primary) workers wait until a standby of this shard has a copy of its state "
                             "(without it, a standby that comes later is used by workers that start later)")
    add_spec_options(server)
    server.set_defaults(run=run_server)
    worker = commands.add_parser(
        "worker", help="train against the run's shard servers (found in the DHT)",
        description="Find the run's shard servers in the DHT (waiting, with progress messages, until every shard "
                    "has one), then train --steps steps: compute gradients on this worker's batches, push them, "
                    "load the servers' parameters. A shard whose server dies is continued on its standby. Prints "
                    "the sha256 of the final parameters.")
    add_peer_options(worker)
    _run_options(worker)
    worker.add_argument("--steps", type=int, required=True, help="pushes to make")
    worker.add_argument("--rank", type=int, default=0,
                        help="this worker's index, which picks its batches from --data (default: 0)")
    worker.add_argument("--serve-shard", type=int, metavar="K",
                        help="also serve shard K (with its standby on the worker serving K+1) and stand by for "
                             "shard K-1: the decentralized form (give every worker a different K, 0 to N-1)")
    worker.add_argument("--discovery-timeout", type=float, default=DISCOVERY_TIMEOUT,
                        help="seconds to wait for every shard to have a server (default: %(default)s)")
    worker.add_argument("--save", metavar="FILE",
                        help="at the end, save the final model (the servers' parameters) to FILE: a state dict "
                             "of nn.Sequential(*your layers), for torch.load and load_state_dict")
    add_spec_options(worker)
    worker.set_defaults(run=run_worker)
    parser.set_defaults(run=lambda args: (parser.print_help(), 2)[1])


def _run_options(parser: argparse.ArgumentParser) -> None:
    from potluck.ps.server import CONSISTENCY_MODELS, WORKER_TIMEOUT
    parser.add_argument("--run-id", default="ps",
                        help="the training run: the same on every server and worker; name yours, so that two "
                             "runs in one swarm stay apart (default: %(default)s)")
    parser.add_argument("--resume", metavar="FILE",
                        help="start from this model file (a state dict, as `ps worker --save` writes it) instead "
                             "of --seed's initial parameters")
    parser.add_argument("--shards", type=int, default=1,
                        help="N, the shards the parameters are split into (servers, and workers with --serve-shard; "
                             "other workers read it from the servers' announcements) (default: %(default)s)")
    parser.add_argument("--workers", type=int, default=1,
                        help="workers of the run: servers wait for this many before the first step and serve no "
                             "more (default: %(default)s)")
    parser.add_argument("--consistency", choices=CONSISTENCY_MODELS, default="sync",
                        help="what a server waits for before it answers a push: sync: one step per round with "
                             "every worker's gradient; async: each push applied alone; ssp: async within a "
                             "staleness bound; backup: rounds without the slowest (default: %(default)s)")
    parser.add_argument("--mode", dest="consistency", choices=CONSISTENCY_MODELS, action=OldName, new="--consistency")
    parser.add_argument("--worker-timeout", type=float, default=WORKER_TIMEOUT,
                        help="seconds of silence after which a worker is dropped (default: %(default)s)")


def params_digest(params: Sequence[Any]) -> str:
    """sha256 of the parameters' bytes, in order: two runs end equal iff their digests are."""
    h = hashlib.sha256()
    for p in params:
        h.update(p.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def _model(spec: RunSpec, args: argparse.Namespace) -> Any:
    """The model as nn.Sequential of the spec's layers, from --resume's file if given."""
    import torch
    from torch import nn

    from potluck.cli.spec import SpecError
    model = nn.Sequential(*spec.layers())
    if args.resume:
        try:
            model.load_state_dict(torch.load(args.resume, map_location="cpu", weights_only=True))
        except (RuntimeError, ValueError, KeyError, OSError) as e:
            raise SpecError(f"--resume {args.resume}: not a model file of this --model: "
                            f"{str(e).splitlines()[0]}") from None
        print(f"resumed the model from {args.resume}", flush=True)
    return model


def _print_run(args: argparse.Namespace) -> None:
    """Says which run this process joins: a default run id is said, never silent."""
    default = " (the default: give --run-id to name your own)" if args.run_id == "ps" else ""
    print(f"run {args.run_id!r}{default}", flush=True)


def _check_shards(args: argparse.Namespace, shard: int) -> None:
    from potluck.ps.messages import MAX_SHARDS
    if not 1 <= args.shards <= MAX_SHARDS or not 0 <= shard < args.shards:
        raise SystemExit(f"potluck ps: need 1 <= --shards <= {MAX_SHARDS} and 0 <= shard < --shards "
                         f"(got shard {shard} of {args.shards})")


def _config(args: argparse.Namespace) -> Any:
    from potluck.ps.server import ServerConfig
    return ServerConfig(consistency=args.consistency, num_workers=args.workers, worker_timeout=args.worker_timeout)


async def _serve(peer: Any, args: argparse.Namespace, spec: RunSpec, model: Any,
                 shards: list[tuple[int, str | None]], await_standby: bool) -> tuple[Any, asyncio.Task]:
    """Start one ParameterServer per (shard, standby_of) on this peer and keep them announced.
    Primaries first, so a standby waiting for its primary never waits for this very peer."""
    from potluck.net.identity import PeerID
    from potluck.optim.schema import RunSchema
    from potluck.ps.discovery import ShardHost, find_primary, layout_digest
    from potluck.ps.server import ParameterServer, split_by_size
    names, params = zip(*model.named_parameters(), strict=True)
    digest = layout_digest(params, args.shards)
    assignment = split_by_size([p.numel() for p in params], args.shards)
    host = ShardHost(peer, args.run_id, [], digest, args.shards, await_standby=await_standby,
                     schema=RunSchema.of(params, names))
    task = asyncio.create_task(host.keep_announced())
    for shard, standby_of in sorted(shards, key=lambda s: s[1] is not None):
        primary = None
        if standby_of == "auto":
            primary = await find_primary(peer, args.run_id, shard, digest, args.shards, DISCOVERY_TIMEOUT,
                                         progress=lambda m: print(m, flush=True))
        elif standby_of is not None:
            primary = PeerID.from_string(standby_of)
        mine = [p for p, s in zip(params, assignment, strict=True) if s == shard]
        server = ParameterServer(peer, args.run_id, mine, spec.make_optimizer, _config(args), shard=shard,
                                 standby_of=primary)
        host.servers.append(server)
        if await_standby and primary is None:
            host.awaiting.add(shard)
        role = f"standby of {primary}" if primary is not None else "primary"
        print(f"serving shard {shard} of {args.shards} of run {args.run_id!r} ({role}): {len(mine)} tensors, "
              f"{sum(p.numel() for p in mine)} parameters", flush=True)
    return host, task


class _Watcher:
    """Prints what the servers do: steps now and then, a takeover at once."""

    def __init__(self, servers: Sequence[Any]):
        self.servers = servers
        self.standby = {id(s): s.standby for s in servers}
        self.printed = -STATUS_SECONDS

    def check(self, now: float) -> None:
        for s in self.servers:
            if self.standby[id(s)] and not s.standby:
                print(f"shard {s.shard}: took over from {s.primary} at step {s.step}", flush=True)
            self.standby[id(s)] = s.standby
        if now - self.printed >= STATUS_SECONDS:
            self.printed = now
            for s in self.servers:
                if not s.standby:
                    print(f"shard {s.shard}: step {s.step}, {len(s.workers)} workers"
                          + (f", standby {s.replica}" if s.replica else ""), flush=True)


def _print_peer(peer: Any, host: str) -> None:
    print(f"peer id: {peer.peer_id}")
    print_join_addresses(peer, host)
    print(peer.reachability_summary, flush=True)


def run_server(args: argparse.Namespace) -> int:
    _check_shards(args, args.shard)
    spec = RunSpec.from_args(args)
    model = _model(spec, args)
    with start_peer(args) as peer:
        _print_peer(peer, args.host)
        _print_run(args)
        host, task = peer.run(_serve(peer, args, spec, model, [(args.shard, args.standby_of)], args.await_standby),
                              DISCOVERY_TIMEOUT + 30)
        stop = StopSignal()  # from here Ctrl-C stops cleanly; before, it interrupts the wait at once
        watcher = _Watcher(host.servers)
        while not stop.wait(WATCH_SECONDS):
            watcher.check(time.monotonic())
        peer.run(_cancel(task), 10)
    print("stopped", flush=True)
    return 0


def _idle_seconds(servers: Sequence[Any]) -> float:
    """Seconds since a worker last called any of `servers` (0 while one is in a call); run on the loop."""
    now = asyncio.get_running_loop().time()
    states = [w for s in servers for w in s.workers.values()]
    if any(w.in_call for w in states):
        return 0.0
    return now - max((w.last_seen for w in states), default=now)


async def _aidle(servers: Sequence[Any]) -> float:
    return _idle_seconds(servers)


async def _cancel(task: asyncio.Task) -> None:
    task.cancel()


def _save_model(model: Any, path: str) -> None:
    """The model's state dict, written whole or not at all (a crash mid-write leaves the old file)."""
    import os

    import torch
    tmp = f"{path}.tmp"
    torch.save(model.state_dict(), tmp)
    os.replace(tmp, path)
    print(f"saved the model to {path} (load: model.load_state_dict(torch.load({path!r})))", flush=True)


def run_worker(args: argparse.Namespace) -> int:
    from potluck.ps.discovery import discover_layout
    from potluck.ps.worker import PSWorker
    if args.serve_shard is not None:
        _check_shards(args, args.serve_shard)
    spec = RunSpec.from_args(args)
    model = _model(spec, args)
    params = list(model.parameters())
    with start_peer(args) as peer:
        _print_peer(peer, args.host)
        _print_run(args)
        host = task = None
        if args.serve_shard is not None:
            k, n = args.serve_shard, args.shards
            roles = [(k, None)] + ([((k - 1) % n, "auto")] if n > 1 else [])
            host, task = peer.run(_serve(peer, args, spec, model, roles, await_standby=n > 1),
                                  DISCOVERY_TIMEOUT + 30)
        layout = peer.run(discover_layout(peer, args.run_id, params, args.discovery_timeout,
                                          progress=lambda m: print(m, flush=True),
                                          names=[n for n, _ in model.named_parameters()],
                                          ask=peer.initial_peer_ids), args.discovery_timeout + 30)
        for k, servers in enumerate(layout.servers):
            print(f"shard {k}: server {servers[0]}" + (f", standby {servers[1]}" if len(servers) > 1 else ""),
                  flush=True)
        worker = PSWorker(peer, args.run_id, layout, params)
        worker.register()
        stop = StopSignal()  # from here Ctrl-C ends the steps, then the final pull; before, it interrupts at once
        source, loss_fn = spec.source(args.rank), spec.loss_fn
        watcher = _Watcher(host.servers) if host is not None else None
        for step in range(args.steps):
            if stop.is_set():
                break
            x, y = source(step)
            model.zero_grad(set_to_none=True)
            loss = loss_fn(model(x), y)
            loss.backward()
            worker.push()
            print(f"step {step + 1}/{args.steps}: loss {loss.item():.4f}", flush=True)
            if watcher is not None:
                watcher.check(time.monotonic())
        worker.pull()
        print(f"done: server steps {worker.client.steps}; final parameters sha256 {params_digest(params)}",
              flush=True)
        if args.save:
            _save_model(model, args.save)
        if host is not None:
            print("still serving for the other workers until they are done", flush=True)
            while not stop.wait(WATCH_SECONDS) and peer.run(_aidle(host.servers), 10) < LINGER_IDLE_SECONDS:
                watcher.check(time.monotonic())
            peer.run(_cancel(task), 10)
    return 0
