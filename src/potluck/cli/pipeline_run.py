"""`potluck pipeline run`: one node of a Ravnest run, the same command on every machine.

The node profiles itself and publishes its profile; once `--nodes N` profiles are in (or the nodes
a `--plan FILE` names), it computes the plan by the rule every node applies alike
(`pipeline.planning`), publishes it, and runs its stage; the controller role of each cluster goes
to the live member with the lowest peer id, and moves on when that node dies (`pipeline.node`). A
node that finds the run planned already (by nodes that answer) takes the newest published plan, as
a standby if it is not in it; the plan is re-planned when nodes join or die (`planning.replan`).
Every line it prints on stdout is one JSON object: `{"peer_id", "address"}` first, then
`{"plan"}`, then a progress row every `--report-every` seconds.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from potluck.cli.help import HelpFormatter
from potluck.cli.peer import add_peer_options, start_peer
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
    run.add_argument("--run-id", default="pipeline", help="the run this node joins (with --plan: the plan's)")
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
    run.add_argument("--save", metavar="DIR", help="at exit, save this node's layers to DIR/<peer id>.pt")
    run.set_defaults(run=run_pipeline)


def _emit(row: dict[str, Any]) -> None:
    print(json.dumps(row), flush=True)


def _wait_for_profiles(peer: Any, args: argparse.Namespace, wanted: list[str] | None, stop: StopSignal) -> list[Any]:
    """The run's profiles once those of `wanted` are in, else once --nodes are (sorted by peer id)."""
    from potluck.pipeline.profiling import fetch_profiles
    deadline = time.monotonic() + args.wait
    while True:
        profiles = peer.run(fetch_profiles(peer, args.run_id), timeout=60)
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


async def _running_plan(peer: Any, run_id: str, published: dict[str, Any]) -> Any:
    """The newest published plan (ties: the one most nodes published) whose nodes are running now:
    at least half of them answer a ping, asked again for up to RUNNING_WAIT (a node that has just
    published its plan starts its stage a moment later). None if none is: the plans are an earlier
    run's, left in the DHT under the same run id."""
    import asyncio

    from potluck.core.errors import NetworkError
    from potluck.pipeline.messages import Ping
    from potluck.pipeline.stage import call

    async def answers(node: str) -> bool:
        try:
            await call(peer.transport, node, f"{run_id}.pipe.ctl", Ping(), PING_TIMEOUT)
            return True
        except (NetworkError, TimeoutError):  # refused, unreachable or silent: not running
            return False

    counts: dict[str, tuple[int, Any]] = {}
    for plan in published.values():
        key = json.dumps(plan.to_wire(), sort_keys=True)
        counts[key] = (counts.get(key, (0, plan))[0] + 1, plan)
    plans = [plan for _, plan in sorted(counts.values(), key=lambda item: (-item[1].version, -item[0]))]
    loop = asyncio.get_running_loop()
    deadline = loop.time() + RUNNING_WAIT
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
    layers = spec.layers()
    sample = spec.sample(0)
    shapes = boundary_shapes(layers, list(sample.shape[1:]))
    if plan_file is not None:  # measured costs, the same file on every node
        costs, reference = list(plan_file.layer_costs), plan_file.reference_flops
    else:  # counted costs: the same numbers on every node
        costs, reference = model_costs(layers, sample), 1.0
    del layers
    stop = StopSignal()
    with start_peer(args) as peer:
        serve_probes(peer)
        _emit({"peer_id": peer.peer_id, "address": peer.addresses[0] if peer.addresses else None})
        memory = int(args.memory * 2**20) if args.memory else None
        profile = peer.run(profile_node(peer, list(peer.transport.connected_peers()), flops=args.flops,
                                        memory=memory), timeout=PROFILE_TIMEOUT)
        peer.run(publish_profile(peer, args.run_id, profile), timeout=30)
        demand = model_demand(costs, int(sample.shape[0]), args.staleness_bound, reference)
        if plan_file is not None:
            plan = RunPlan(1, tuple(tuple(sorted(s.peer for s in c)) for c in plan_file.clusters),
                           tuple(sorted(plan_file.standby)))
            profiles = _wait_for_profiles(peer, args, plan.nodes, stop)
        else:
            profiles = _wait_for_profiles(peer, args, None, stop)
            published = peer.run(fetch_plans(peer, args.run_id), timeout=30)
            # planned already (this node joins late, or restarts), unless by an earlier run of this id
            plan = (peer.run(_running_plan(peer, args.run_id, published), timeout=RUNNING_WAIT + 60)
                    if published else None)
            if plan is None:
                plan = plan_run(profiles[:args.nodes], demand, args.clusters)
        if peer.peer_id in plan.nodes:
            peer.run(publish_plan(peer, args.run_id, plan), timeout=30)
        _emit({"plan": plan.to_wire(), "joined_late": peer.peer_id not in plan.nodes})
        config = PipelineConfig(args.run_id, staleness_bound=args.staleness_bound, average_every=args.average_every)
        node = PipelineNode(peer, config, plan, spec.make_layers, len(costs), spec.make_optimizer,
                            source=spec.source, costs=costs, shapes=shapes,
                            profiles={p.peer_id: p for p in profiles}, reference_flops=reference,
                            loss_fn=spec.loss_fn, heartbeat=args.heartbeat, failure_timeout=args.failure_timeout,
                            demand=demand, clusters=args.clusters)
        peer.run(node.start(), timeout=START_TIMEOUT)
        started = last_published = time.monotonic()
        checked = False
        try:
            while not stop.wait(args.report_every):
                now = time.monotonic()
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
            peer.run(node.close(), timeout=START_TIMEOUT)
            if args.save:
                _save(node.worker, Path(args.save))
    return 0


def _save(worker: Any, directory: Path) -> None:
    """This node's layers and place: {"cluster", "layers": {index: state dict}} (none if standby)."""
    import torch
    directory.mkdir(parents=True, exist_ok=True)
    route = worker.route
    torch.save({"cluster": route.cluster if route else None,
                "layers": {i: layer.state_dict() for i, layer in worker.layers.items()} if route else {}},
               directory / f"{worker.peer_id}.pt")


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
