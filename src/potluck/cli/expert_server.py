"""`potluck expert-server`: host a grid of experts for mixture-of-experts layers on other peers."""

from __future__ import annotations

import argparse
import itertools
import logging
import re
import sys

from potluck.cli.help import HelpFormatter
from potluck.cli.peer import add_peer_options, print_join_addresses, start_peer
from potluck.cli.signals import StopSignal

logger = logging.getLogger(__name__)

# How often a running server prints what its experts have done.
STATUS_INTERVAL = 30.0
# A pattern expanding to more experts than this is almost certainly a typo (and would not fit in memory).
MAX_EXPERTS = 4096

_RANGE = re.compile(r"^\[(\d+):(\d+)\]$")
OPTIMIZERS = ("adam", "sgd", "none")


def expand_uids(patterns: list[str]) -> list[str]:
    """`ffn.[0:2].[0:3]` -> ffn.0.0 ... ffn.1.2: each `[a:b]` part is the range a..b-1."""
    uids: list[str] = []
    for pattern in patterns:
        choices = []
        for part in pattern.split("."):
            if m := _RANGE.match(part):
                lo, hi = int(m.group(1)), int(m.group(2))
                if lo >= hi:
                    raise ValueError(f"empty range {part} in {pattern!r}")
                choices.append([str(i) for i in range(lo, hi)])
            elif part and "[" not in part and "]" not in part:
                choices.append([part])
            else:
                raise ValueError(f"cannot read {part!r} in {pattern!r}: use names, numbers and ranges like [0:4]")
        count = 1
        for c in choices:
            count *= len(c)
        if len(uids) + count > MAX_EXPERTS:
            raise ValueError(f"{pattern!r} expands to too many experts (limit {MAX_EXPERTS})")
        uids.extend(".".join(combo) for combo in itertools.product(*choices))
    return list(dict.fromkeys(uids))


def resumed_line(resumed: dict[str, int], experts: int, directory: str) -> str:
    """What a (re)started server loaded from --checkpoint-dir, in one line."""
    if not resumed:
        return f"no checkpoints in {directory}: every expert starts from its initial weights"
    shown = ", ".join(f"{uid} ({n} updates)" for uid, n in sorted(resumed.items())[:4])
    more = f", ... ({len(resumed)} in all)" if len(resumed) > 4 else ""
    fresh = f"; {experts - len(resumed)} start from their initial weights" if len(resumed) < experts else ""
    return f"resumed from {directory}: {shown}{more}{fresh}"


def register(sub: argparse._SubParsersAction) -> None:
    from potluck.moe.experts import expert_types
    parser = sub.add_parser(
        "expert-server", help="host experts for remote mixture-of-experts layers",
        description="Host a grid of experts, announce them in the DHT and train them with the gradients "
                    "that clients send back. Expert uids are a name and grid coordinates, e.g. ffn.3.14; "
                    "--experts 'ffn.[0:4].[0:4]' serves the 16 experts ffn.0.0 ... ffn.3.3 ([a:b] is the "
                    "range a..b-1). Clients find them with RemoteMixtureOfExperts(peer, in_features, "
                    "grid_size=(4, 4), uid_prefix='ffn', k_best=...). Stop with Ctrl-C (saves checkpoints).",
        formatter_class=HelpFormatter)
    parser.add_argument("--experts", nargs="+", required=True, metavar="PATTERN",
                        help="uid patterns to serve, e.g. 'ffn.[0:4].[0:4]' (quote them for the shell)")
    parser.add_argument("--expert-type", default="ffn", choices=expert_types(), help="built-in expert type")
    parser.add_argument("--hidden", type=int, default=512, help="expert width (input and output features)")
    parser.add_argument("--optimizer", choices=OPTIMIZERS, default="adam", help="how experts learn ('none': frozen)")
    parser.add_argument("--lr", type=float, default=1e-3, help="learning rate of the experts' optimizer")
    parser.add_argument("--max-batch-size", type=int, default=4096, help="rows per call and per batch")
    parser.add_argument("--checkpoint-dir", metavar="DIR",
                        help="save each expert here periodically and at exit; resume from it at start")
    parser.add_argument("--checkpoint-interval", type=float, default=60.0, help="seconds between checkpoints")
    parser.add_argument("--announce-ttl", type=float, default=30.0,
                        help="seconds an announcement stays valid in the DHT (refreshed every third of it)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the initial expert weights")
    parser.add_argument("--device", default=None, help="where the experts run, e.g. cuda (default: cpu)")
    add_peer_options(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import torch

    from potluck.moe import ExpertServer
    try:
        uids = expand_uids(args.experts)
    except ValueError as e:
        print(f"potluck expert-server: {e}", file=sys.stderr)
        return 2
    if args.client_mode:
        print("potluck expert-server: an expert server must accept connections; drop --client-mode", file=sys.stderr)
        return 2
    optimizer = {"adam": lambda p: torch.optim.Adam(p, args.lr), "sgd": lambda p: torch.optim.SGD(p, args.lr),
                 "none": None}[args.optimizer]
    stop = StopSignal()
    with start_peer(args) as peer, ExpertServer.from_type(
            peer, uids, args.expert_type, args.hidden, optimizer, seed=args.seed, max_batch_size=args.max_batch_size,
            checkpoint_dir=args.checkpoint_dir, checkpoint_interval=args.checkpoint_interval,
            announce_ttl=args.announce_ttl, device=args.device) as server:
        shown = ", ".join(uids[:4]) + (f", ... ({len(uids)} in all)" if len(uids) > 4 else "")
        print(f"serving {len(uids)} {args.expert_type} experts (hidden {args.hidden}): {shown}")
        if args.checkpoint_dir:
            print(resumed_line(server.resumed, len(uids), args.checkpoint_dir))
        print(f"peer id: {peer.peer_id}")
        print_join_addresses(peer, args.host)
        print("ready; press Ctrl-C to stop", flush=True)
        while not stop.wait(STATUS_INTERVAL):
            stats = server.stats.values()
            print(f"forward calls {sum(s.forward_calls for s in stats)}, backward calls "
                  f"{sum(s.backward_calls for s in stats)}, rows {sum(s.rows for s in stats)}, "
                  f"updates {sum(s.updates for s in stats)}, rejected {sum(s.rejected for s in stats)}",
                  flush=True)
    print("stopped", flush=True)
    return 0
