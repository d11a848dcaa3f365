"""CPU time of one reducer's aggregation (`potluck.averaging.robust.aggregate`), per shard.

Over the emulated WAN every peer shares its cores with training, so what a reducer spends on its
shard of a round comes out of the steps (docs/benchmarks.md, "The split at delay 8"). Each row:
N pieces of SIZE float32 values, honest ones alike (a common change plus 10% noise), the first
piece's norm SCALE times the others' (a peer with more inner steps: CenteredClip then iterates
longer), the best of REPEATS calls on one thread, as CPU milliseconds.

    python benchmarks/aggregation.py [--pieces 4] [--size 787500] [--scales 1,1.3,2] [--repeats 7]

The defaults: one peer's shard of a Streaming DiLoCo fragment of the lm workload (3.15M values,
four peers).
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import time

import torch

from potluck.averaging.robust import AGGREGATIONS, aggregate


def pieces_of(n: int, size: int, scale: float, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    common = torch.randn(size, generator=g) * 1e-3
    pieces = [common + 1e-4 * torch.randn(size, generator=g) for _ in range(n)]
    pieces[0] = pieces[0] * scale
    return pieces


def best_cpu_ms(kind: str, pieces: list[torch.Tensor], repeats: int) -> float:
    """The best CPU time of `repeats` calls (after one to warm up); "mean": the plain mean."""
    out, weights = torch.empty_like(pieces[0]), [1.0] * len(pieces)

    def call() -> None:
        if kind == "mean":
            torch.mean(torch.stack(pieces), dim=0)
        else:
            aggregate(kind, pieces, weights, out)
    call()
    best = float("inf")
    for _ in range(repeats):
        start = time.thread_time()
        call()
        best = min(best, time.thread_time() - start)
    return best * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pieces", type=int, default=4)
    parser.add_argument("--size", type=int, default=787_500)
    parser.add_argument("--scales", default="1,1.3,2", help="the first piece's norm over the others', comma-separated")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(1)
    for scale in (float(s) for s in args.scales.split(",")):
        pieces = pieces_of(args.pieces, args.size, scale)
        for kind in AGGREGATIONS:
            ms = best_cpu_ms(kind, pieces, args.repeats)
            print(json.dumps({"metric": "aggregation_cpu", "aggregation": kind, "pieces": args.pieces,
                              "size": args.size, "scale": scale, "value": round(ms, 2), "unit": "ms",
                              "machine": platform.machine(), "date": datetime.date.today().isoformat()}), flush=True)


if __name__ == "__main__":
    main()
