"""An averaging peer in its own process, for tests that kill peers with a signal.

Prints its address (or "client"), then its peer id; waits for a line on stdin; averages once;
prints "allreduce-start" when the all-reduce begins and a JSON result line at the end.
"""

import argparse
import hashlib
import json
import sys

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
    args = parser.parse_args()

    original = AllReduceService.run

    async def announced(self, *a, **kw):
        print("allreduce-start", flush=True)
        return await original(self, *a, **kw)
    AllReduceService.run = announced

    initial = [args.initial_peer] if args.initial_peer else []
    with potluck.Peer(initial_peers=initial, host="127.0.0.1", client_mode=args.client) as peer:
        print(peer.addresses[0] if peer.addresses else "client", flush=True)
        print(peer.peer_id, flush=True)
        avg = Averager(peer, [vector_of(args.index, args.size)], "killtest", target_group_size=args.group,
                       min_group_size=2, matchmaking_time=2.0, sender_timeout=3.0, allreduce_timeout=30.0)
        sys.stdin.readline()
        try:
            result = avg.step(weight=args.index + 1)
        except potluck.PotluckError as e:
            print(json.dumps({"ok": False, "error": str(e)}), flush=True)
            return
        with avg.get_tensors() as tensors:
            digest = hashlib.sha256(tensors[0].numpy().tobytes()).hexdigest()
            sample = tensors[0][:1000].tolist()
        print(json.dumps({"ok": True, "digest": digest, "contributors": result.contributors,
                          "sample": sample}), flush=True)
        avg.shutdown()


if __name__ == "__main__":
    main()
