"""`potluck sweep CONFIG`: a hyperparameter sweep shared by every peer that runs the same config."""

from __future__ import annotations

import argparse
import concurrent.futures
import csv
import importlib
import json
import logging
import time
from pathlib import Path
from typing import Any

from potluck.cli.peer import add_peer_options, start_peer
from potluck.cli.signals import StopSignal
from potluck.ps.sweep import LEASE_SECONDS, SweepError, SweepSpec, TrialResult, run_sweep

logger = logging.getLogger(__name__)

REPORT_KEYS = ("sweep", "sweep_id", "metric", "goal", "trials", "best", "peers", "wall_seconds")
# The longest a sweep may run on this peer before it gives up waiting for the others' trials.
SWEEP_DEADLINE = 7 * 24 * 3600.0
EXAMPLE = """\
example config (TOML; JSON with the same keys works too):

  run_id = "digits-lr"     # peers that run the same config under one run_id share the trials
  kind = "grid"            # or "random", with trials = N and seed = S
  metric = "test_accuracy" # what the plot and the best row use
  goal = "max"
  [space]
  lr = [0.001, 0.003, 0.01, 0.03]
  hidden = [16, 64]        # random: lr = {low = 1e-4, high = 1e-1, log = true}
  [fixed]
  steps = 300

The built-in objective trains an MLP on scikit-learn's digits; its parameters: lr, batch_size,
steps, hidden, optimizer ("adam" | "sgd"), momentum, weight_decay, seed. It reports test_accuracy
and final_loss. --objective MODULE:FUNCTION uses yours: FUNCTION(params: dict) -> {metric: float}.
"""


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "sweep", help="run a hyperparameter sweep, shared with every peer that joins",
        description="Run the trials of a hyperparameter sweep (grid or random). Trials are handed out "
                    "through the DHT with leases: start the same command on other machines with "
                    "--initial-peers and they take trials too; a trial whose peer dies is re-run by "
                    "another. When every trial has a result, each peer writes DIR/results.csv, "
                    "DIR/results.json (one row per trial: index, params, metrics, peer, seconds), "
                    "DIR/sweep.png (the metric against each parameter) and DIR/report.json with: "
                    + ", ".join(REPORT_KEYS) + ".",
        epilog=EXAMPLE, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", help="the sweep's TOML or JSON file (see below)")
    parser.add_argument("--out", default="potluck-sweep", metavar="DIR", help="report folder (default: %(default)s)")
    parser.add_argument("--objective", default=None, metavar="MODULE:FUNCTION",
                        help="your own trial function instead of the built-in digits MLP")
    parser.add_argument("--lease", type=float, default=LEASE_SECONDS, metavar="SECONDS",
                        help="how long a claimed trial stays ours without renewal; a dead peer's trial "
                             "is re-run after this (default: %(default)s)")
    add_peer_options(parser)
    parser.set_defaults(run=run)


def digits_objective(params: dict[str, Any]) -> dict[str, float]:
    """Train a one-hidden-layer MLP on digits with `params`; its test accuracy and final loss."""
    import torch

    from potluck.cli.tasks import accuracy, load_data
    x, y, x_test, y_test = load_data()
    x, x_test = x.reshape(len(x), -1), x_test.reshape(len(x_test), -1)
    torch.manual_seed(int(params.get("seed", 0)))
    hidden = int(params.get("hidden", 32))
    model = torch.nn.Sequential(torch.nn.Linear(64, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 10))
    lr, decay = float(params.get("lr", 1e-2)), float(params.get("weight_decay", 0.0))
    name = params.get("optimizer", "adam")
    if name == "adam":
        opt = torch.optim.Adam(model.parameters(), lr, weight_decay=decay)
    elif name == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr, momentum=float(params.get("momentum", 0.9)),
                              weight_decay=decay)
    else:
        raise ValueError(f"optimizer must be 'adam' or 'sgd', not {name!r}")
    generator = torch.Generator().manual_seed(int(params.get("seed", 0)))
    batch = int(params.get("batch_size", 32))
    for _ in range(int(params.get("steps", 200))):
        b = torch.randint(0, len(y), (batch,), generator=generator)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x[b]), y[b]).backward()
        opt.step()
    with torch.no_grad():
        final_loss = float(torch.nn.functional.cross_entropy(model(x), y))
    return {"test_accuracy": accuracy(model, x_test, y_test), "final_loss": final_loss}


def load_objective(text: str | None) -> Any:
    if text is None:
        return digits_objective
    module, _, name = text.partition(":")
    if not module or not name:
        raise SweepError(f"--objective must look like MODULE:FUNCTION, got {text!r}")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise SweepError(f"cannot load objective {text!r}: {e}") from e


def run(args: argparse.Namespace) -> int:
    import torch
    torch.set_num_threads(1)  # one trial at a time per peer; leave the other cores to other peers
    spec = SweepSpec.from_file(args.config)
    objective = load_objective(args.objective)
    trials = spec.trial_list()
    stop = StopSignal()
    started = time.time()
    with start_peer(args) as peer:
        print(f"sweep {spec.run_id!r}: {len(trials)} trials; peer id {peer.peer_id}")
        for addr in peer.addresses[:1]:
            print(f"other peers can join with: potluck sweep {args.config} --initial-peers {addr}", flush=True)

        def on_result(result: TrialResult) -> None:
            shown = ", ".join(f"{k}={v:.4g}" for k, v in result.metrics.items()) or result.error
            print(f"trial {result.index} of {len(trials)} {result.params}: {shown} ({result.seconds:.1f} s)",
                  flush=True)
        future = peer.submit(run_sweep(peer, spec, objective, lease_seconds=args.lease, on_result=on_result))
        while not future.done():
            if stop.is_set() or time.time() - started > SWEEP_DEADLINE:
                future.cancel()
                print("stopped: this peer's unfinished trial goes to another peer once its lease expires")
                return 130
            concurrent.futures.wait([future], timeout=0.5)
        results = future.result()
    write_report(Path(args.out), spec, results, time.time() - started)
    best = _best(spec, results)
    if best is not None:
        print(f"best: trial {best.index} {best.params}: {spec.metric}={best.metrics[spec.metric]:.4g}")
    print(f"wrote {args.out}/results.csv, results.json, sweep.png, report.json")
    return 0


def _best(spec: SweepSpec, results: list[TrialResult]) -> TrialResult | None:
    scored = [r for r in results if spec.metric in r.metrics]
    pick = max if spec.goal == "max" else min
    return pick(scored, key=lambda r: r.metrics[spec.metric]) if scored else None


def write_report(out: Path, spec: SweepSpec, results: list[TrialResult], wall_seconds: float) -> dict[str, Any]:
    """results.csv, results.json, sweep.png and report.json in `out`; returns the report."""
    out.mkdir(parents=True, exist_ok=True)
    params = sorted({k for r in results for k in r.params})
    metrics = sorted({k for r in results for k in r.metrics})
    with open(out / "results.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["index", *params, *metrics, "peer", "seconds", "error"])
        for r in results:
            writer.writerow([r.index, *(r.params.get(p) for p in params), *(r.metrics.get(m) for m in metrics),
                             str(r.peer), r.seconds, r.error or ""])
    (out / "results.json").write_text(json.dumps([r.to_record() for r in results], indent=1))
    best = _best(spec, results)
    report = {"sweep": spec.run_id, "sweep_id": spec.sweep_id, "metric": spec.metric, "goal": spec.goal,
              "trials": len(results), "best": best.to_record() if best is not None else None,
              "peers": sorted({str(r.peer) for r in results}), "wall_seconds": round(wall_seconds, 2)}
    (out / "report.json").write_text(json.dumps(report, indent=1))
    _plot(out / "sweep.png", spec, [r for r in results if spec.metric in r.metrics])
    return report


def _plot(path: Path, spec: SweepSpec, results: list[TrialResult]) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    names = [n for n in sorted(spec.space) if all(isinstance(r.params.get(n), (int, float)) for r in results)]
    names = names or sorted(spec.space)
    fig, axes = plt.subplots(1, len(names), figsize=(4 * len(names), 3.2), squeeze=False)
    for ax, name in zip(axes[0], names, strict=True):
        xs = [r.params.get(name) for r in results]
        ax.scatter([str(x) if not isinstance(x, (int, float)) else x for x in xs],
                   [r.metrics[spec.metric] for r in results])
        if all(isinstance(x, (int, float)) and x > 0 for x in xs) and len(set(xs)) > 1 \
                and max(xs) / min(xs) > 50:
            ax.set_xscale("log")
        ax.set_xlabel(name)
        ax.set_ylabel(spec.metric)
    fig.suptitle(f"sweep {spec.run_id}: {len(results)} trials")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
