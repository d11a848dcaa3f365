"""`potluck pipeline`: Ravnest planning from the command line.

`potluck pipeline node` runs a node that profiles itself (compute, memory, links to the peers it
knows) and keeps its profile published in the DHT. `potluck pipeline plan` reads every profile
of a run from the DHT (or a JSON file) and prints the clusters and stages it would form, and why.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from potluck.cli.help import HelpFormatter
from potluck.cli.peer import add_peer_options, start_peer
from potluck.cli.pipeline_run import add_run_parser
from potluck.cli.signals import StopSignal
from potluck.cli.spec import DEMO_MODEL, RunSpec, SpecError, add_spec_options

# A node republishes its profile this often (well inside profiling.PROFILE_TTL).
REPUBLISH_SECONDS = 60.0


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("pipeline", help="Ravnest model-parallel training: profile nodes, plan clusters",
                            description="Plan and inspect asynchronous pipeline training (Ravnest).")
    commands = parser.add_subparsers(dest="pipeline_command", metavar="SUBCOMMAND")
    node = commands.add_parser("node", help="profile this node and keep its profile published in the DHT",
                               description="Measure this node's compute (matmul FLOP/s), free memory and its "
                                           "links to the peers it knows, publish the profile under the run id, "
                                           "and keep it published until Ctrl-C.")
    add_peer_options(node)
    node.add_argument("--run-id", default="pipeline", help="run the profile belongs to")
    node.add_argument("--flops", type=float, help="override the measured FLOP/s")
    node.add_argument("--memory", type=float, help="override free memory, in MiB")
    node.set_defaults(run=run_node)
    plan = commands.add_parser(
        "plan", help="print the clusters and stages for the profiles in the DHT, and why",
        description="Read every node profile of the run (from the DHT via --initial-peers, or --profiles FILE), "
                    "group the nodes into clusters that each hold the model (maximizing the slowest cluster's "
                    "throughput), split the model into stages per cluster, and explain the result. The model "
                    "(--model, default the demo's 6-block MLP) is profiled here on a micro-batch from --data, "
                    "unless --layer-costs gives measured costs. --write-plan saves the plan for "
                    "`potluck pipeline run --plan`.",
        formatter_class=HelpFormatter)
    add_peer_options(plan)
    plan.add_argument("--run-id", default="pipeline", help="run whose profiles to read")
    plan.add_argument("--profiles", metavar="FILE", help="JSON list of node profiles instead of the DHT")
    plan.add_argument("--layer-costs", metavar="FILE",
                      help="JSON list of {seconds, param_bytes, activation_bytes} per layer (seconds measured "
                           "on a node with --reference-flops)")
    plan.add_argument("--reference-flops", type=float, help="FLOP/s of the node that measured --layer-costs")
    plan.add_argument("--clusters", type=int, help="number of clusters (default: as many as memory allows)")
    plan.add_argument("--staleness-bound", type=int, default=4, help="micro-batches in flight per cluster")
    plan.add_argument("--micro-batch", type=int,
                      help="samples per micro-batch (default: the --data batch size, else 32)")
    plan.add_argument("--json", action="store_true", help="print the plan as JSON")
    plan.add_argument("--write-plan", metavar="FILE",
                      help="write the plan (run spec, layer costs, clusters and stages by peer id) as JSON")
    add_spec_options(plan)
    plan.set_defaults(run=run_plan)
    add_run_parser(commands)
    export = commands.add_parser(
        "export", help="assemble the layers a run's nodes saved (`pipeline run --save DIR`) into one model file",
        description="Read the files `potluck pipeline run --save DIR` wrote (one per node: its layers and its "
                    "cluster), take one cluster whose nodes together saved every layer (the clusters hold "
                    "copies of the model, averaged every --average-every updates), and write one state dict of "
                    "nn.Sequential(*your layers) to --out: load it with plain PyTorch, "
                    "`model.load_state_dict(torch.load(FILE))`, or start a run from it with --resume FILE.")
    export.add_argument("directory", metavar="DIR", help="the folder of the nodes' saved files")
    export.add_argument("--out", required=True, metavar="FILE", help="the model file to write")
    export.add_argument("--cluster", help="the cluster to take (default: the first complete one)")
    export.set_defaults(run=run_export)
    parser.set_defaults(run=lambda args: (parser.print_help(), 2)[1])


def run_node(args: argparse.Namespace) -> int:
    from potluck.pipeline.profiling import profile_node, publish_profile, serve_probes
    stop = StopSignal()
    with start_peer(args) as peer:
        serve_probes(peer)
        memory = int(args.memory * 2**20) if args.memory else None
        print(f"peer id: {peer.peer_id}")
        for addr in peer.addresses:
            print(f"  --initial-peers {addr}")
        while True:
            others = [p for p in peer.transport.connected_peers()]
            profile = peer.run(profile_node(peer, others, flops=args.flops, memory=memory), timeout=120)
            peer.run(publish_profile(peer, args.run_id, profile), timeout=30)
            print(f"published: {profile.flops / 1e9:.1f} GFLOP/s, {profile.memory / 2**20:.0f} MiB free, "
                  f"{len(profile.bandwidth)} links probed", flush=True)
            if stop.wait(REPUBLISH_SECONDS):
                break
    return 0


# Micro-batch size planned for when neither --micro-batch nor --data says (the demo's).
DEFAULT_MICRO_BATCH = 32


def _load_costs(args: argparse.Namespace, spec: RunSpec) -> tuple[list[Any], float, int]:
    """(layer costs, FLOP/s of the node that measured them, samples per micro-batch)."""
    from potluck.pipeline.profiling import LayerCost, measure_flops, profile_layers
    if args.layer_costs:
        raw = json.loads(Path(args.layer_costs).read_text())
        costs = [LayerCost.from_wire(c) for c in raw]
        return costs, args.reference_flops or 1.0, args.micro_batch or DEFAULT_MICRO_BATCH
    import torch
    if spec.data is not None:
        sample = spec.sample()
    elif spec.model == DEMO_MODEL:
        sample = torch.randn(args.micro_batch or DEFAULT_MICRO_BATCH, 1, 8, 8)  # the demo's digits
    else:
        raise SpecError(f"--model {spec.model!r} needs --data to be profiled on (or --layer-costs)")
    costs = profile_layers(spec.layers(), sample)
    return costs, measure_flops(), args.micro_batch or sample.shape[0]


def _profiles(args: argparse.Namespace) -> list[Any]:
    from potluck.pipeline.profiling import NodeProfile, fetch_profiles
    if args.profiles:
        return [NodeProfile.from_wire(p) for p in json.loads(Path(args.profiles).read_text())]
    with start_peer(args) as peer:
        return peer.run(fetch_profiles(peer, args.run_id), timeout=60)


def make_plan(profiles: list[Any], costs: list[Any], reference_flops: float, clusters: int | None,
              staleness_bound: int, micro_batch: int) -> dict[str, Any]:
    """The plan and its reasons, as plain data (what `plan --json` prints)."""
    from potluck.pipeline.clustering import ModelDemand, cluster_throughput, form_clusters
    from potluck.pipeline.partition import STATE_FACTOR, partition_layers
    params = sum(c.param_bytes for c in costs)
    memory = params * (STATE_FACTOR + 2) + sum(c.activation_bytes for c in costs) * micro_batch * staleness_bound
    demand = ModelDemand(work=sum(c.seconds for c in costs) * reference_flops,
                         activation_bytes=max(c.activation_bytes for c in costs), memory=memory)
    plan = form_clusters(profiles, demand, clusters)
    by_id = {p.peer_id: p for p in profiles}
    out: dict[str, Any] = {"model": {"layers": len(costs), "memory_needed": memory,
                                     "seconds_per_sample": sum(c.seconds for c in costs)},
                           "objective_samples_per_second": plan.objective, "clusters": [],
                           "standby": plan.standby}
    for members, throughput in zip(plan.clusters, plan.throughputs, strict=True):
        nodes = [by_id[m] for m in members]
        compute = sum(n.flops for n in nodes) / demand.work
        part = partition_layers(costs, nodes, reference_flops, in_flight=staleness_bound)
        out["clusters"].append({
            "throughput": throughput, "limited_by": "compute" if throughput >= compute * (1 - 1e-9) else "a slow link",
            "memory": sum(n.memory for n in nodes),
            "stages": [{"peer": s.peer_id, "layers": [s.start, s.end - 1], "period_per_sample": p}
                       for s, p in zip(part.stages, part.periods, strict=True)]})
        assert abs(cluster_throughput(nodes, demand) - throughput) < 1e-9 * max(1.0, throughput)
    return out


def _write_plan(path: Path, args: argparse.Namespace, spec: RunSpec, costs: list[Any], reference: float,
                micro_batch: int, plan: dict[str, Any]) -> None:
    from potluck.cli.plan_file import PlanFile, PlannedStage
    clusters = tuple(tuple(PlannedStage(s["peer"], s["layers"][0], s["layers"][1] + 1) for s in c["stages"])
                     for c in plan["clusters"])
    PlanFile(args.run_id, spec, tuple(costs), reference, micro_batch, args.staleness_bound, clusters,
             tuple(plan["standby"])).write(path)
    print(f"plan written to {path} (for `potluck pipeline run --plan {path}`)", file=sys.stderr)


def run_plan(args: argparse.Namespace) -> int:
    spec = RunSpec.from_args(args)
    spec.check()
    profiles = _profiles(args)
    if not profiles:
        print(f"no node profiles found for run {args.run_id!r}: start nodes with `potluck pipeline node "
              f"--run-id {args.run_id} --initial-peers ...` first")
        return 1
    costs, reference, micro_batch = _load_costs(args, spec)
    plan = make_plan(profiles, costs, reference, args.clusters, args.staleness_bound, micro_batch)
    if args.write_plan:
        _write_plan(Path(args.write_plan), args, spec, costs, reference, micro_batch, plan)
    if args.json:
        print(json.dumps(plan, indent=1))
        return 0
    need = plan["model"]["memory_needed"]
    print(f"{len(profiles)} nodes; the model needs {need / 2**20:.1f} MiB per copy (weights, grads, optimizer "
          f"state, stashes, {args.staleness_bound} micro-batches of activations)")
    print(f"{len(plan['clusters'])} clusters, maximizing the slowest cluster's throughput "
          f"({plan['objective_samples_per_second']:.1f} samples/s): every cluster holds the model, and the rings "
          "between clusters move at the pace of the slowest one")
    for c, cluster in enumerate(plan["clusters"]):
        print(f"cluster {c}: {cluster['throughput']:.1f} samples/s, limited by {cluster['limited_by']}; "
              f"{cluster['memory'] / 2**20:.1f} MiB >= {need / 2**20:.1f} MiB")
        for s, stage in enumerate(cluster["stages"]):
            a, b = stage["layers"]
            print(f"  stage {s}: {stage['peer'][:12]}  layers {a}-{b}  "
                  f"{stage['period_per_sample'] * 1e6:.1f} us/sample")
    if plan["standby"]:
        print(f"standby ({len(plan['standby'])}): " + ", ".join(p[:12] for p in plan["standby"])
              + " (would not raise the slowest cluster; replaces a node that fails)")
    return 0


def run_export(args: argparse.Namespace) -> int:
    import pickle

    import torch
    files = sorted(Path(args.directory).glob("*.pt"))
    saved = []
    for path in files:
        try:
            data = torch.load(path, map_location="cpu", weights_only=True)
        except (pickle.UnpicklingError, RuntimeError, EOFError, OSError, ValueError) as e:  # another file: go on
            print(f"skipping {path.name}: not a saved pipeline node ({str(e).splitlines()[0][:80]})", file=sys.stderr)
            continue
        if isinstance(data, dict) and {"cluster", "layers", "total_layers"} <= data.keys():
            saved.append((path, data))
    clusters: dict[str, dict[int, Any]] = {}
    totals: dict[str, int] = {}
    for _, data in saved:
        if data["cluster"] is not None:
            clusters.setdefault(data["cluster"], {}).update(data["layers"])
            totals[data["cluster"]] = int(data["total_layers"])
    complete = sorted(c for c, layers in clusters.items() if sorted(layers) == list(range(totals[c])))
    if args.cluster is not None:
        complete = [c for c in complete if c == args.cluster]
    if not complete:
        have = ", ".join(f"{c}: layers {sorted(layers)} of {totals[c]}" for c, layers in sorted(clusters.items()))
        raise SpecError(f"no {'cluster ' + repr(args.cluster) if args.cluster else 'cluster'} in {args.directory} "
                        f"has every layer saved ({have or f'{len(saved)} saved nodes, none in a cluster'}): "
                        "give every node of the run `--save` with this folder")
    cluster = complete[0]
    state = {f"{i}.{key}": value for i, layer in sorted(clusters[cluster].items()) for key, value in layer.items()}
    out = Path(args.out)
    torch.save(state, out)
    print(f"{out}: layers 0-{totals[cluster] - 1} of cluster {cluster} ({len(state)} tensors); load with "
          f"nn.Sequential(*layers).load_state_dict(torch.load({str(out)!r}))")
    return 0
