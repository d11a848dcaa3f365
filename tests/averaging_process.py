"""An averaging peer in its own process, for tests that kill peers with a signal.

Prints its address (or "client"), then its peer id; waits for a line on stdin; averages once;
prints "allreduce-start {group}" when the all-reduce begins (the group tells the test who
reduces which shard, so it can pick its victims by role) and a JSON result line at the end.
With --out, writes the averaged vector there (raw float32) so the test can check every shard.
"""

import argparse
import hashlib
import json
import sys
import time

import torch

import potluck
from potluck.averaging import Averager
from potluck.averaging.allreduce import AllReduceService


def vector_of(index: int, size: int) -> torch.Tensor:
    return torch.randn(size, generator=torch.Generator().manual_seed(index))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("index", type=int)
    parser.add_argument("--size", type=int, default=1_000_000)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--client", action="store_true")
    parser.add_argument("--initial-peer", default=None)
    parser.add_argument("--allreduce-timeout", type=float, default=30.0)
    parser.add_argument("--sender-timeout", type=float, default=3.0)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    original = AllReduceService.run
    timing = {}

    async def announced(self, group, *a, **kw):
        print("allreduce-start " + json.dumps({"peers": [str(p) for p in group.peers], "roles": list(group.roles),
                                               "part_sizes": list(group.part_sizes)}), flush=True)
        timing["start"] = time.monotonic()
        try:
            return await original(self, group, *a, **kw)
        finally:
            timing["seconds"] = time.monotonic() - timing["start"]
    AllReduceService.run = announced

    initial = [args.initial_peer] if args.initial_peer else []
    with potluck.Peer(initial_peers=initial, host="127.0.0.1", client_mode=args.client) as peer:
        print(peer.addresses[0] if peer.addresses else "client", flush=True)
        print(peer.peer_id, flush=True)
        avg = Averager(peer, [vector_of(args.index, args.size)], "killtest", target_group_size=args.group,
                       min_group_size=2, matchmaking_time=2.0, sender_timeout=args.sender_timeout,
                       allreduce_timeout=args.allreduce_timeout)
        sys.stdin.readline()
        try:
            result = avg.step(weight=args.index + 1)
        except potluck.PotluckError as e:
            print(json.dumps({"ok": False, "error": str(e), "allreduce_seconds": timing.get("seconds")}), flush=True)
            return
        with avg.get_tensors() as tensors:
            vector = tensors[0].detach().clone()
        if args.out:
            vector.numpy().tofile(args.out)
        digest = hashlib.sha256(vector.numpy().tobytes()).hexdigest()
        print(json.dumps({"ok": True, "digest": digest, "contributors": result.contributors,
                          "allreduce_seconds": timing["seconds"]}), flush=True)
        avg.shutdown()


if __name__ == "__main__":
    main()
