"""Moshpit averaging with churn: emulated peers on a grid, a fraction of them crashing before each
round; how fast do the survivors agree, and how far do they end from the mean?

P emulated peers (virtual clock, one process) are placed one per cell of a d-dimensional grid
(default 10x10x10 = 1,000 peers, target_group_size = 10): in round r each peer averages with the
peers that share all its coordinates but the one of dimension r mod d, then moves along that
dimension. With no churn, d rounds give every peer the exact global mean. Before each round a
fraction of the live peers (default 1%, at least one) crashes (`EmulatedNetwork.crash`: its
connections reset, its DHT records become unreachable); a crash can hit a peer that a group is
counting on, and the group must exclude it.

Why 10x10x10 and not 32x32: 1,000 = 10^3 fills the grid exactly, so without churn the exact
mean is reached in 3 rounds (a clean reference); groups of 10 keep each all-reduce and each
matchmaking small, as in the Moshpit paper's setting of many small groups; and three dimensions
show several rounds of mixing before the error reaches the churn floor.

The error measures (each peer holds a vector of D float32 from N(0, 1)), after each round, over
the peers alive at that point (the survivors):
- spread: max_i max_k |x_i[k] - mean_survivors(x)[k]|: how far the survivors are from agreeing.
  Peers that leave take no information away from this measure, so it should shrink
  geometrically until float32 rounding.
- error_vs_initial_mean: max_i max_k |x_i[k] - m0[k]|, m0 the mean of all P initial vectors:
  the goal of averaging. Leavers carry away values that were already mixed into everyone else's,
  so this stops shrinking at a floor of the order of (leavers / P) times the spread at the time
  they left; it does not go to zero.
- error_vs_survivors_initial_mean: the same against the mean of the survivors' initial vectors.

Prints one JSON object per line per round (metric moshpit_round: value = spread, plus the other
measures, survivors, failed steps, group sizes, virtual and wall seconds), a summary line, and
saves a log-scale plot of the errors per round (default docs/moshpit.png).

Usage: python benchmarks/moshpit.py [--quick] [--grid 10,10,10] [--rounds 8] [--leave 0.01]
           [--dim 16] [--plot docs/moshpit.png] [--wall-limit 3600]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import datetime
import json
import math
import os
import platform
import random
import sys
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "src"))

from emulated_swarm import make_swarm  # noqa: E402

from potluck.averaging import Averager  # noqa: E402
from potluck.core.virtual_time import run_virtual  # noqa: E402

# Emulated links: a data-centre-like latency and bandwidth; the vectors are small, so neither
# matters much for the error (it is a function of who met whom), only for the virtual time.
LATENCY = 0.002
BANDWIDTH = 100e6
# Virtual seconds a leader gathers its group, and a silent sender is waited for (crashed peers
# reset their connections, so most exclusions are immediate).
MATCHMAKING_TIME = 1.0
SENDER_TIMEOUT = 1.0
ALLREDUCE_TIMEOUT = 20.0


def cells(grid: tuple[int, ...]) -> list[tuple[int, ...]]:
    out = [()]
    for size in grid:
        out = [c + (i,) for c in out for i in range(size)]
    return out


async def scenario(args: argparse.Namespace, common: dict) -> list[dict]:
    grid = tuple(args.grid)
    n = math.prod(grid)
    target = max(grid)
    rng = random.Random(args.seed)
    t0 = time.perf_counter()
    net, peers = await make_swarm(n, latency=LATENCY, bandwidth=BANDWIDTH)
    loop = asyncio.get_running_loop()
    generator = torch.Generator().manual_seed(args.seed)
    initial = torch.randn(n, args.dim, generator=generator)
    avgs = [Averager(p, [initial[i].clone()], "moshpit", target_group_size=target, min_group_size=2, grid=grid,
                     coordinates=c, matchmaking_time=MATCHMAKING_TIME, sender_timeout=SENDER_TIMEOUT,
                     allreduce_timeout=ALLREDUCE_TIMEOUT, allow_state_sharing=False)
            for i, (p, c) in enumerate(zip(peers, cells(grid), strict=True))]
    setup_wall = time.perf_counter() - t0
    m0 = initial.double().mean(0)
    alive = list(range(n))
    params = {"peers": n, "grid": "x".join(map(str, grid)), "target_group_size": target, "leave_fraction": args.leave,
              "dim": args.dim, "latency_s": LATENCY, "matchmaking_time": MATCHMAKING_TIME, **common}

    def measures(round_: int, extra: dict) -> dict:
        values = torch.stack([avgs[i]._tensors[0] for i in alive]).double()
        survivors_mean = values.mean(0)
        survivors_initial = initial[alive].double().mean(0)
        return {"metric": "moshpit_round", "round": round_,
                "value": (values - survivors_mean).abs().max().item(), "unit": "abs (spread)",
                "error_vs_initial_mean": (values - m0).abs().max().item(),
                "error_vs_survivors_initial_mean": (values - survivors_initial).abs().max().item(),
                "survivors": len(alive), **extra, **params}

    rows = [measures(0, {"left": 0, "setup_wall_seconds": round(setup_wall, 1)})]
    emit(rows[-1])
    for r in range(1, args.rounds + 1):
        leaving = rng.sample(alive, max(1, round(args.leave * len(alive)))) if args.leave > 0 else []
        for i in leaving:
            net.crash(peers[i].transport.peer_id)
            avgs[i].shutdown()
        alive = [i for i in alive if i not in set(leaving)]
        wall, virtual = time.perf_counter(), loop.time()
        results = await asyncio.gather(*(avgs[i].astep() for i in alive), return_exceptions=True)
        sizes = collections.Counter(res.group_size for res in results if not isinstance(res, BaseException))
        failures = collections.Counter(type(res).__name__ for res in results if isinstance(res, BaseException))
        rows.append(measures(r, {
            "left": len(leaving), "failed_steps": sum(failures.values()), "failures": dict(failures),
            "group_sizes": {str(k): v for k, v in sorted(sizes.items())},
            "virtual_seconds": round(loop.time() - virtual, 2), "wall_seconds": round(time.perf_counter() - wall, 1)}))
        emit(rows[-1])
    return rows


def emit(row: dict) -> None:
    print(json.dumps(row), flush=True)


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rounds = [r["round"] for r in rows]
    floor = 1e-9  # float32 can reach an exact 0 spread; keep the point on the log axis
    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=120)
    ax.semilogy(rounds, [max(r["value"], floor) for r in rows], "o-", label="spread among survivors")
    ax.semilogy(rounds, [max(r["error_vs_initial_mean"], floor) for r in rows], "s--",
                label="distance to the initial global mean")
    ax.semilogy(rounds, [max(r["error_vs_survivors_initial_mean"], floor) for r in rows], "^:",
                label="distance to the survivors' initial mean")
    ax.set_xlabel("round (0 = before averaging)")
    ax.set_ylabel("max abs error over survivors and coordinates")
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


def watchdog(seconds: float, common: dict) -> None:
    """The scenario runs in this process on a virtual clock; bound its wall time for real."""
    def expire() -> None:
        emit({"metric": "moshpit_round", "value": None, "unit": "abs (spread)",
              "error": f"did not finish within {seconds:.0f} s of wall time", **common})
        os._exit(2)
    timer = threading.Timer(seconds, expire)
    timer.daemon = True
    timer.start()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="125 peers on 5x5x5, 6 rounds: under a minute")
    parser.add_argument("--grid", default="10,10,10", help="grid sizes; peers = their product")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--leave", type=float, default=0.01, help="fraction of live peers crashing before each round")
    parser.add_argument("--dim", type=int, default=16, help="floats per peer")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--plot", default=str(ROOT / "docs" / "moshpit.png"), help="'' for no plot")
    parser.add_argument("--wall-limit", type=float, default=3600.0, help="give up after this many real seconds")
    args = parser.parse_args()
    if args.quick:
        if args.grid == parser.get_default("grid"):
            args.grid = "5,5,5"
        if args.rounds == parser.get_default("rounds"):
            args.rounds = 6
        args.wall_limit = min(args.wall_limit, 120.0)
        if args.plot == parser.get_default("plot"):
            args.plot = ""  # the figure in docs/ comes from the full run
    args.grid = [int(g) for g in args.grid.split(",")]
    common = {"date": datetime.date.today().isoformat(),
              "machine": f"{platform.machine()} {os.cpu_count()} cores, {platform.python_version()}",
              "command": " ".join(["python", "benchmarks/moshpit.py", *sys.argv[1:]]), "clock": "virtual"}
    watchdog(args.wall_limit, common)
    t0 = time.perf_counter()
    rows = run_virtual(scenario(args, common))
    wall = time.perf_counter() - t0
    spreads = [r["value"] for r in rows]
    # Geometric rate: the median over rounds of spread[r] / spread[r-1], while above float32 noise.
    ratios = [b / a for a, b in zip(spreads, spreads[1:], strict=False) if a > 1e-6 and b > 0]
    emit({"metric": "moshpit_spread_ratio_per_round", "value": round(sorted(ratios)[len(ratios) // 2], 4)
          if ratios else None, "unit": "ratio (median over rounds)", "final_spread": spreads[-1],
          "final_error_vs_initial_mean": rows[-1]["error_vs_initial_mean"], "rounds": len(rows) - 1,
          "peers": rows[0]["peers"], "grid": rows[0]["grid"], "leave_fraction": args.leave,
          "wall_seconds": round(wall, 1), **common})
    if args.plot:
        title = (f"Moshpit: {rows[0]['peers']} emulated peers, grid {rows[0]['grid']}, "
                 f"{args.leave:.0%} leave before each round")
        plot(rows, Path(args.plot), title)
        print(f"plot saved to {args.plot}", file=sys.stderr)


if __name__ == "__main__":
    main()
