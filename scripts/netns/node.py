"""The NAT check's potluck roles that have no CLI command; run inside a namespace by nat_check.py.

  node.py call-expert  call a remote expert (forward and backward), check the answers against a
                       local copy built with the server's seed, and report the connection's path
  node.py donate       hold an Averager's state and offer it to newcomers; prints "ready <peer id>"
  node.py download     a newcomer: download that state and check every value

A client role prints one JSON line at the end: {"ok": ..., ...}. Logs go to stderr.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from potluck import Peer
from potluck.averaging import Averager
from potluck.cli.signals import StopSignal
from potluck.moe import RemoteExpert
from potluck.moe.experts import make_expert
from potluck.net.identity import PeerID

EXPERT_TYPE = "ffn"
EXPERT_SEED = 0  # `potluck expert-server --seed 0`: its first expert is built right after manual_seed(0)
ROWS = 4  # rows of the input batch sent to the expert
STATE_ELEMENTS = 1 << 20  # 4 MiB of float32: the donated state
STATE_SEED = 7
RETRY_SECONDS = 1.0  # between attempts while the server or donor is not yet findable
# How long after the first call we wait for hole punching to go direct: longer than the server's
# whole punch (net.holepunch: three tries of a few seconds each) takes to fail.
PUNCH_WAIT = 20.0
DONOR_LIFETIME = 600.0  # a donor nobody stops ends by itself


def expected_state() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(STATE_SEED)
    return [torch.randn(STATE_ELEMENTS, generator=generator), torch.randn(3, 5, generator=generator)]


def start_peer(args: argparse.Namespace) -> Peer:
    return Peer(initial_peers=args.initial_peers, host=args.host)


def paths(peer: Peer, target: PeerID) -> list[str]:
    """How our open connections to `target` go, one per connection: "relayed" or "direct", and
    "bulk" for one opened for a single bulk stream (kept a while once idle) rather than calls."""
    async def look() -> list[str]:
        return [("relayed" if c.relayed else "direct") + (" bulk" if c.remote.bulk else "")
                for c in peer.transport.open_connections() if c.peer_id == target]
    return peer.run(look(), timeout=5)


def retry(what: Callable[[], Any], deadline: float) -> tuple[Any, int]:
    """`what()` until it works or `deadline` passes (then its last error); returns (result, attempts)."""
    attempts = 0
    while True:
        attempts += 1
        try:
            return what(), attempts
        except Exception as e:  # noqa: BLE001 - reported in the summary if it never works
            if time.monotonic() + RETRY_SECONDS > deadline:
                raise RuntimeError(f"failed after {attempts} attempts: {type(e).__name__}: {e}") from e
            logging.info("attempt %d: %s: %s", attempts, type(e).__name__, e)
            time.sleep(RETRY_SECONDS)


def call_expert(args: argparse.Namespace) -> dict:
    deadline = time.monotonic() + args.timeout
    x = torch.randn(ROWS, args.hidden, generator=torch.Generator().manual_seed(1))
    grad = torch.randn(ROWS, args.hidden, generator=torch.Generator().manual_seed(2))
    torch.manual_seed(EXPERT_SEED)
    local, _ = make_expert(EXPERT_TYPE, args.hidden)
    x_local = x.clone().requires_grad_()
    y_local = local(x_local)
    y_local.backward(grad)
    with start_peer(args) as peer:
        expert = RemoteExpert(peer, args.uid)

        def call() -> float:
            start = time.monotonic()
            x_remote = x.clone().requires_grad_()
            y_remote = expert(x_remote)
            y_remote.backward(grad)
            if not torch.allclose(y_remote, y_local, atol=1e-5):
                raise AssertionError("the expert's forward answer differs from the local copy's")
            if not torch.allclose(x_remote.grad, x_local.grad, atol=1e-5):
                raise AssertionError("the expert's backward answer differs from the local copy's")
            return time.monotonic() - start

        first, attempts = retry(call, deadline)
        server = expert.location.peer_id
        first_paths = paths(peer, server)
        waited = time.monotonic()
        while "direct" not in paths(peer, server) and time.monotonic() < min(waited + PUNCH_WAIT, deadline):
            time.sleep(0.1)
        direct_after = time.monotonic() - waited if "direct" in paths(peer, server) else None
        relayed_closed_after = None
        if direct_after is not None:  # the relayed connection closes once idle
            while "relayed" in paths(peer, server) and time.monotonic() < min(waited + PUNCH_WAIT, deadline):
                time.sleep(0.1)
            if "relayed" not in paths(peer, server):
                relayed_closed_after = time.monotonic() - waited
        second = call()
        final = paths(peer, server)
        return {"ok": True, "reachability": peer.transport.reachability, "attempts": attempts,
                "first_call_s": round(first, 3), "first_call_paths": first_paths,
                "direct_after_s": None if direct_after is None else round(direct_after, 2),
                "relayed_closed_after_s": None if relayed_closed_after is None else round(relayed_closed_after, 2),
                "second_call_s": round(second, 3), "final_paths": final,
                "path": "direct" if "direct" in final else "relayed"}


def donate(args: argparse.Namespace) -> dict:
    stop = StopSignal()
    deadline = time.monotonic() + args.timeout
    with start_peer(args) as peer:
        averager = Averager(peer, expected_state(), args.run_id)
        averager.state_metadata = {"donor": peer.peer_id}
        while not peer.addresses:
            if time.monotonic() > deadline:
                return {"ok": False, "error": f"no address to donate from within {args.timeout:.0f} s "
                                              f"(reachability: {peer.transport.reachability})"}
            time.sleep(0.1)
        peer.run(averager.announce_state(), timeout=30)
        print(f"ready {peer.peer_id} {' '.join(peer.addresses)}", flush=True)
        stop.wait(DONOR_LIFETIME)
        return {"ok": True}


def download(args: argparse.Namespace) -> dict:
    deadline = time.monotonic() + args.timeout
    expected = expected_state()
    with start_peer(args) as peer:
        averager = Averager(peer, [torch.zeros_like(t) for t in expected], args.run_id)
        start = time.monotonic()
        (version, metadata), attempts = retry(
            lambda: averager.load_state_from_peers(timeout=max(1.0, deadline - time.monotonic())), deadline)
        seconds = time.monotonic() - start
        with averager.get_tensors() as got:
            if not all(torch.equal(a, b) for a, b in zip(got, expected, strict=True)):
                return {"ok": False, "error": "the downloaded state differs from the donor's"}
        donor = PeerID.from_string(metadata["donor"])
        size = sum(t.numel() * t.element_size() for t in expected)
        return {"ok": True, "reachability": peer.transport.reachability, "attempts": attempts,
                "version": version, "bytes": size, "download_s": round(seconds, 3),
                "paths_to_donor": paths(peer, donor)}


ROLES = {"call-expert": call_expert, "donate": donate, "download": download}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("role", choices=sorted(ROLES))
    parser.add_argument("--host", required=True, help="this host's address (listen here)")
    parser.add_argument("--initial-peers", nargs="+", required=True)
    parser.add_argument("--timeout", type=float, required=True, help="seconds for the whole role")
    parser.add_argument("--uid", help="call-expert: the expert's uid")
    parser.add_argument("--hidden", type=int, help="call-expert: the expert's width")
    parser.add_argument("--run-id", help="donate, download: the averaging run")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")  # as the CLI's
    try:
        report = ROLES[args.role](args)
    except Exception as e:  # noqa: BLE001 - the summary says what went wrong; the log has the trace
        logging.exception("%s failed", args.role)
        report = {"ok": False, "error": f"{type(e).__name__}: {e}"}
    print(json.dumps(report), flush=True)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
