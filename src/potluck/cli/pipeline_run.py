"""`potluck pipeline run`: one node of a Ravnest run, the same command on every machine.

The node profiles itself and publishes its profile; once `--nodes N` profiles are in (or the nodes
a `--plan FILE` names), it computes the plan by the rule every node applies alike
(`pipeline.planning`), publishes it, and runs its stage; the controller role of each cluster goes
to the live member with the lowest peer id, and moves on when that node dies (`pipeline.node`). A
node that finds the run planned already (by nodes that answer) takes the newest published plan, as
a standby if it is not in it; the plan is re-planned when nodes join or die (`planning.replan`).
Every line it prints on stdout is one JSON object: `{"peer_id", "address"}` first, then
`{"plan"}`, then a progress row every `--report-every` seconds.

A node's profile names its model (`potluck.optim.schema`: the layers' parameters, the layer count
and the input shape). Nodes leave out the profiles of nodes of another model (never planned in,
never a standby); a node that finds no other node of its model but a running plan whose nodes all
train another model stops at once with one line naming the first tensor that differs.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from potluck.cli.help import HelpFormatter
from potluck.cli.peer import add_peer_options, join_addresses, routable_hosts, start_peer
from potluck.cli.signals import StopSignal
from potluck.cli.spec import RunSpec, SpecError, add_spec_options

# A node republishes its profile and plan this often (well inside their 300 s TTLs).
REPUBLISH_SECONDS = 60.0
# How often a node waiting for the run's other profiles reads them again.
POLL_SECONDS = 1.0
# Profiling this node (its FLOP/s and a probe to each peer it knows) must finish within this.
PROFILE_TIMEOUT = 120.0
# Starting or stopping the node's worker and election.
START_TIMEOUT = 60.0
# A node that finds plans published asks their nodes whether they run, each within this, for up to
# RUNNING_WAIT (a stage starts a moment after its node publishes the plan; an earlier run's plan
# left in the DHT costs a newly started node this long).
PING_TIMEOUT = 3.0
RUNNING_WAIT = 10.0
# A --duration run ends this long before its end on every node (at most half the run): nodes start
# their stages within a few seconds of each other (they plan once the last profile is in, read every
# POLL_SECONDS) and all were given the same --duration, so when the first one stops, the others
# already know that it finished and do not take it for a failure, re-plan or promote a standby.
ENDING_SECONDS = 10.0


def add_run_parser(commands: argparse._SubParsersAction) -> None:
    run = commands.add_parser(
        "run", help="run one node of a pipeline run (the same command on every machine)",
        description="Profile this node, publish the profile, and once --nodes profiles are in (or the nodes "
                    "--plan names), plan the run by a rule every node computes alike, take this node's stage, "
                    "and train until Ctrl-C (or --duration). Each cluster's controller is its live node with "
                    "the lowest peer id; if it dies, the next takes over. Prints one JSON object per line.",
        formatter_class=HelpFormatter)
    add_peer_options(run)
    add_spec_options(run)
    run.add_argument("--run-id", default="pipeline",
                     help="the run this node joins (with --plan: the plan's); name yours, so that two runs in one "
                          "swarm stay apart (default: %(default)s; the first row says when it is the default)")
    run.add_argument("--nodes", type=int, help="plan once this many nodes have published their profiles")
    run.add_argument("--plan", metavar="FILE",
                     help="use this plan (`potluck pipeline plan --write-plan`): its nodes, run id, spec, layer "
                          "costs and staleness bound (stages are re-derived from the costs)")
    run.add_argument("--clusters", type=int, help="number of clusters (default: as many as memory allows)")
    run.add_argument("--flops", type=float, help="override the measured FLOP/s")
    run.add_argument("--memory", type=float, help="override free memory, in MiB")
    run.add_argument("--staleness-bound", type=int, default=4, help="micro-batches in flight per cluster")
    run.add_argument("--average-every", type=int, default=5, help="average across clusters every this many updates")
    run.add_argument("--heartbeat", type=float, default=1.0, help="seconds between liveness checks")
    run.add_argument("--failure-timeout", type=float, default=3.0, help="a node that does not answer within "
                                                                        "this is taken for dead")
    run.add_argument("--wait", type=float, default=600.0, help="seconds to wait for the run's other nodes")
    run.add_argument("--duration", type=float, default=0.0, help="stop after this many seconds (0: at Ctrl-C)")
    run.add_argument("--report-every", type=float, default=2.0, help="seconds between progress rows")
    run.add_argument("--save", metavar="DIR",
                     help="at exit, save this node's layers to DIR/<peer id>.pt; give every node the same DIR "
                          "(or copy the files into one) and `potluck pipeline export DIR` makes one model file")
    run.add_argument("--resume", metavar="FILE",
                     help="start from this model file (as `potluck pipeline export` writes it) instead of "
                          "--seed's initial parameters; give it to every node")
    run.set_defaults(run=run_pipeline)


def _emit(row: dict[str, Any]) -> None:
    print(json.dumps(row), flush=True)


def _model_schema(layers: list[Any], sample: Any) -> Any:
    """The run schema of a pipeline's model: every layer's parameters (named as in one
    `nn.Sequential` of the layers), the layer count and the input shape."""
    from torch import nn

    from potluck.optim.schema import RunSchema
    named = list(nn.Sequential(*layers).named_parameters())
    return RunSchema.of([p for _, p in named], [n for n, _ in named],
                        {"layers": len(layers), "input": list(sample.shape[1:])})


def _of_model(profile: Any, schema: Any) -> bool:
    """Whether `profile` is of a node of our model (one that names none counts: an older potluck)."""
    return profile.model is None or profile.model.fingerprint == schema.fingerprint


def _check_model(peer: Any, run_id: str, schema: Any, profiles: list[Any]) -> None:
    """ModelMismatch if a plan runs (at least half its nodes answer) whose nodes all train
    another model than `schema` (by their `profiles`), none of them ours."""
    from potluck.optim.schema import ModelMismatch
    from potluck.pipeline.planning import fetch_plans
    by_id = {p.peer_id: p for p in profiles}
    published = peer.run(fetch_plans(peer, run_id), timeout=30)
    foreign = {owner: plan for owner, plan in published.items()
               if all(n in by_id and not _of_model(by_id[n], schema) for n in plan.nodes)}
    running = peer.run(_running_plan(peer, run_id, foreign, wait=0.0), timeout=60) if foreign else None
    if running is not None:
        theirs = next(by_id[n].model for n in running.nodes if by_id[n].model is not None)
        difference = theirs.difference(schema, "the run's")
        raise ModelMismatch(f"run {run_id!r}: its nodes train another model than this node's: {difference}; "
                            "give this node the run's --model and --data (the same run spec)")


def _wait_for_profiles(peer: Any, args: argparse.Namespace, wanted: list[str] | None, stop: StopSignal,
                       schema: Any) -> list[Any]:
    """The run's profiles of our model once those of `wanted` are in, else once --nodes are
    (sorted by peer id); ModelMismatch once a plan of another model runs while no other node of
    ours has a profile (`_check_model`)."""
    from potluck.pipeline.profiling import fetch_profiles
    deadline = time.monotonic() + args.wait
    while True:
        everyone = peer.run(fetch_profiles(peer, args.run_id), timeout=60)
        profiles = [p for p in everyone if _of_model(p, schema)]
        if len(profiles) < len(everyone) and all(p.peer_id == peer.peer_id for p in profiles):
            _check_model(peer, args.run_id, schema, everyone)  # alone with our model: are we the odd one?
        if wanted is not None:
            found = [p for p in profiles if p.peer_id in wanted]
            if len(found) == len(wanted):
                return found
        elif len(profiles) >= args.nodes:
            return profiles
        if time.monotonic() > deadline or stop.wait(POLL_SECONDS):
            have = len(found) if wanted is not None else len(profiles)
            raise SpecError(f"only {have} of {len(wanted) if wanted is not None else args.nodes} node profiles "
                            f"of run {args.run_id!r} appeared within {args.wait:.0f} s")


async def _running_plan(peer: Any, run_id: str, published: dict[str, Any], wait: float = RUNNING_WAIT) -> Any:
    """The newest published plan (ties: the one most nodes published) whose nodes are running now:
    at least half of them answer a ping, asked again for up to `wait` seconds (a node that has just
    published its plan starts its stage a moment later). None if none is: the plans are an earlier
    run's, left in the DHT under the same run id."""
    import asyncio

    from potluck.core.errors import NetworkError
    from potluck.core.names import RunNames
    from potluck.pipeline.messages import Ping
    from potluck.pipeline.stage import call

    async def answers(node: str) -> bool:
        try:
            await call(peer.transport, node, RunNames(run_id).pipeline.control, Ping(), PING_TIMEOUT)
            return True
        except (NetworkError, TimeoutError):  # refused, unreachable or silent: not running
            return False

    counts: dict[str, tuple[int, Any]] = {}
    for plan in published.values():
        key = json.dumps(plan.to_wire(), sort_keys=True)
        counts[key] = (counts.get(key, (0, plan))[0] + 1, plan)
    plans = [plan for _, plan in sorted(counts.values(), key=lambda item: (-item[1].version, -item[0]))]
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait
    while True:
        for plan in plans:
            nodes = [n for n in plan.nodes if n != peer.peer_id]
            alive = await asyncio.gather(*(answers(n) for n in nodes))
            if 2 * sum(alive) >= len(nodes):
                return plan
        if loop.time() > deadline:
            return None
        await asyncio.sleep(POLL_SECONDS)


def run_pipeline(args: argparse.Namespace) -> int:
    import torch

    from potluck.optim.schema import ModelSignature
    from potluck.pipeline.node import PipelineNode
    from potluck.pipeline.partition import boundary_shapes
    from potluck.pipeline.planning import (
        RunPlan,
        disagreeing,
        fetch_plans,
        model_costs,
        model_demand,
        plan_run,
        publish_plan,
    )
    from potluck.pipeline.profiling import profile_node, publish_profile, serve_probes
    from potluck.pipeline.stage import PipelineConfig

    if (args.nodes is None) == (args.plan is None):
        raise SpecError("give --nodes N (plan once N nodes are in) or --plan FILE")
    torch.set_num_threads(1)
    plan_file = None
    if args.plan:
        from potluck.cli.plan_file import PlanFile
        plan_file = PlanFile.read(Path(args.plan))
        args.run_id, args.staleness_bound = plan_file.run_id, plan_file.staleness_bound
    spec = RunSpec.from_args(args) if plan_file is None else plan_file.spec
    make_layers = spec.make_layers if not args.resume else _resumed(spec, args.resume)
    layers = make_layers(range(len(spec.layers())))
    sample = spec.sample(0)
    shapes = boundary_shapes(layers, list(sample.shape[1:]))
    schema = _model_schema(layers, sample)
    if plan_file is not None:  # measured costs, the same file on every node
        costs, reference = list(plan_file.layer_costs), plan_file.reference_flops
    else:  # counted costs: the same numbers on every node
        costs, reference = model_costs(layers, sample), 1.0
    del layers
    stop = StopSignal()
    with start_peer(args) as peer:
        serve_probes(peer)
        addresses = join_addresses(peer.addresses, routable_hosts(), args.host)  # routable ones first
        _emit({"peer_id": peer.peer_id, "address": addresses[0] if addresses else None, "addresses": addresses,
               "run_id": args.run_id, "default_run_id": args.run_id == "pipeline"})
        memory = int(args.memory * 2**20) if args.memory else None
        profile = peer.run(profile_node(peer, list(peer.transport.connected_peers()), flops=args.flops,
                                        memory=memory), timeout=PROFILE_TIMEOUT)
        profile.model = ModelSignature.of(schema)
        peer.run(publish_profile(peer, args.run_id, profile), timeout=30)
        demand = model_demand(costs, int(sample.shape[0]), args.staleness_bound, reference)
        if plan_file is not None:
            plan = RunPlan(1, tuple(tuple(sorted(s.peer for s in c)) for c in plan_file.clusters),
                           tuple(sorted(plan_file.standby)))
            profiles = _wait_for_profiles(peer, args, plan.nodes, stop, schema)
        else:
            profiles = _wait_for_profiles(peer, args, None, stop, schema)
            ours = {p.peer_id for p in profiles}
            published = {owner: plan for owner, plan in peer.run(fetch_plans(peer, args.run_id), timeout=30).items()
                         if any(n in ours for n in plan.nodes)}  # not a plan of another model's nodes
            # planned already (this node joins late, or restarts), unless by an earlier run of this id
            plan = (peer.run(_running_plan(peer, args.run_id, published), timeout=RUNNING_WAIT + 60)
                    if published else None)
            if plan is None:
                plan = plan_run(profiles[:args.nodes], demand, args.clusters)
        if peer.peer_id in plan.nodes:
            peer.run(publish_plan(peer, args.run_id, plan), timeout=30)
        _emit({"plan": plan.to_wire(), "joined_late": peer.peer_id not in plan.nodes})
        config = PipelineConfig(args.run_id, staleness_bound=args.staleness_bound, average_every=args.average_every,
                                model=schema.fingerprint)
        node = PipelineNode(peer, config, plan, make_layers, len(costs), spec.make_optimizer,
                            source=spec.source, costs=costs, shapes=shapes,
                            profiles={p.peer_id: p for p in profiles}, reference_flops=reference,
                            loss_fn=spec.loss_fn, heartbeat=args.heartbeat, failure_timeout=args.failure_timeout,
                            demand=demand, clusters=args.clusters)
        peer.run(node.start(), timeout=START_TIMEOUT)
        started = last_published = time.monotonic()
        checked = False
        ending = started + args.duration - min(ENDING_SECONDS, args.duration / 2) if args.duration else None
        try:
            while not stop.wait(args.report_every):
                now = time.monotonic()
                if ending is not None and now >= ending and not node.ending:
                    peer.run(_end(node), timeout=START_TIMEOUT)
                if node.plan != plan:  # re-planned
                    plan = node.plan
                    _emit({"plan": plan.to_wire(), "replanned": True})
                _emit(_progress(node, now - started))
                if not checked:  # every node has published its plan by now, or is late: check once
                    checked = True
                    others = disagreeing(plan, peer.run(fetch_plans(peer, args.run_id), timeout=30))
                    if others:
                        _emit({"warning": f"{len(others)} nodes computed a different plan", "nodes": others})
                if now - last_published > REPUBLISH_SECONDS:
                    last_published = now
                    peer.run(publish_profile(peer, args.run_id, profile), timeout=30)
                    if peer.peer_id in node.plan.nodes:
                        peer.run(publish_plan(peer, args.run_id, node.plan), timeout=30)
                if args.duration and now - started >= args.duration:
                    break
        finally:
            final = _progress(node, time.monotonic() - started)
            peer.run(_end(node), timeout=START_TIMEOUT)
            peer.run(node.close(), timeout=START_TIMEOUT)
            if args.save:
                final["saved"] = str(_save(node.worker, Path(args.save), args.run_id, len(costs)))
            _emit({"final": True, **final, "stopped_by": "signal" if stop.is_set() else "duration"})
    return 0


async def _end(node: Any) -> None:
    node.end()


def _resumed(spec: RunSpec, path: str) -> Any:
    """`spec.make_layers`, but with the parameters of the model file at `path` (a state dict of
    nn.Sequential(*layers), as `potluck pipeline export` writes it)."""
    import torch
    from torch import nn
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
        nn.Sequential(*spec.layers()).load_state_dict(state)
    except (RuntimeError, ValueError, KeyError, OSError) as e:
        raise SpecError(f"--resume {path}: not a model file of this --model: {str(e).splitlines()[0]}") from None

    def make_layers(indices: Any) -> list[Any]:
        layers = spec.layers()
        nn.Sequential(*layers).load_state_dict(state)
        return [layers[i] for i in indices]
    return make_layers


def _save(worker: Any, directory: Path, run_id: str, total_layers: int) -> Path:
    """This node's layers and place (`potluck pipeline export` reads these files):
    {"run_id", "cluster", "total_layers", "layers": {index: state dict}} (no layers if standby)."""
    import torch
    directory.mkdir(parents=True, exist_ok=True)
    route = worker.route
    path = directory / f"{worker.peer_id}.pt"
    torch.save({"run_id": run_id, "cluster": route.cluster if route else None, "total_layers": total_layers,
                "layers": {i: layer.state_dict() for i, layer in worker.layers.items()} if route else {}}, path)
    return path


def _progress(node: Any, elapsed: float) -> dict[str, Any]:
    """One progress row: this node's place, counters and loss (the last stage's is the cluster's), and
    the recoveries made by the controllers it holds or held."""
    worker = node.worker
    route, report = worker.route, worker.report()
    row: dict[str, Any] = {"time": round(elapsed, 2), "controls": sorted(node.controllers),
                           "recoveries": [{"cluster": cluster, "dead": e.dead, "epoch": e.epoch,
                                           "recovery_s": round(e.recovered_at - e.detected_at, 3),
                                           "fetched_from": {str(k): v for k, v in e.fetched_from.items()}}
                                          for cluster, e in node.recoveries()]}
    if route is None:
        return {**row, "role": "standby"}
    return {**row, "role": "stage", "cluster": route.cluster, "stage": route.stage, "last": route.last,
            "layers": [route.start, route.end], "epoch": route.epoch, "updates": report.updates,
            "loss": report.loss, "rounds_applied": report.rounds_applied, "busy_seconds": report.busy_seconds,
            "max_in_flight": report.max_in_flight, "max_version_lag": report.max_version_lag}
