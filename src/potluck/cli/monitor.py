"""`potluck monitor`, `potluck status` and `potluck contributors`: watch a run and credit its volunteers.

`monitor` follows a run as a client-mode peer that trains nothing (`potluck.monitor.follower`),
keeps its contribution ledger in a SQLite file (`potluck.monitor.ledger`; a restart resumes from
it) and serves the dashboard (`potluck.monitor.web`, where installed). `status` joins a run for a
moment and prints the swarm now; `contributors` prints the credit a monitor's database holds.
"""

from __future__ import annotations

import argparse
import csv
import math
import sys
import time
from pathlib import Path
from typing import Any

from potluck.cli.help import HelpFormatter
from potluck.cli.peer import add_identity_options
from potluck.cli.signals import StopSignal
from potluck.core.errors import PotluckError
from potluck.monitor.follower import POLL_INTERVAL, POLL_TIMEOUT, FollowedRun, Follower
from potluck.monitor.ledger import Ledger
from potluck.monitor.views import Contributor, MonitorView, PeerState, SwarmNow
from potluck.peer import Peer

# `monitor` prints a progress line this often (seconds); the dashboard shows the rest live.
PRINT_INTERVAL = 30.0
# `status` reads the run this many times, POLL_INTERVAL apart: the first read after joining may
# miss records the DHT is still storing, and two give the peers' speeds a moment to show.
STATUS_POLLS = 2
# Web server start and stop give up after this (seconds).
WEB_TIMEOUT = 30.0


def add_join_options(parser: argparse.ArgumentParser) -> None:
    """How the monitor's peer joins the run (it never listens: a client-mode peer)."""
    parser.add_argument("--run-id", required=True, help="the run to follow, as its trainers name it")
    parser.add_argument("--initial-peers", nargs="+", required=True, metavar="ADDR",
                        help="addresses of peers in the run (/ip4/.../tcp/.../p2p/<peer id>)")
    add_identity_options(parser)


def join(args: argparse.Namespace) -> Peer:
    return Peer(initial_peers=args.initial_peers, client_mode=True, identity_path=args.identity,
                insecure=args.insecure, authority=args.authority, credential=args.credential)


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "monitor", help="follow a run: a contribution ledger and a live dashboard",
        description="Follow a run as a peer that trains nothing: record who is online, how fast the swarm "
                    "goes, each epoch, the metrics trainers publish and the samples each peer was really "
                    "averaged with into a SQLite file (a restart resumes from it), and serve a live "
                    "dashboard. In a run with an --authority, members' names come from their membership "
                    "tokens. Stop it with Ctrl-C.",
        formatter_class=HelpFormatter)
    add_join_options(parser)
    parser.add_argument("--db", required=True, metavar="FILE", help="the ledger's database (created if missing)")
    parser.add_argument("--host", default="127.0.0.1",
                        help="interface of the dashboard (default: this machine only; 0.0.0.0 for all)")
    parser.add_argument("--port", type=int, default=8080, help="port of the dashboard")
    parser.set_defaults(run=run_monitor)

    parser = sub.add_parser(
        "status", help="print a run's swarm now: peers, speed, epoch, ETA",
        description="Join a run for a moment and print the swarm as its peers report it: peers online, "
                    "samples per second, the epoch and the ETA of its global batch, and one row per peer.",
        formatter_class=HelpFormatter)
    add_join_options(parser)
    parser.set_defaults(run=run_status)

    parser = sub.add_parser(
        "contributors", help="print the credit a monitor's database holds (a table or CSV)",
        description="Print each peer's credit from a `potluck monitor` database: the samples it was really "
                    "averaged with, its online hours, its share of the run and the epochs it contributed to.",
        formatter_class=HelpFormatter)
    parser.add_argument("--db", required=True, metavar="FILE", help="the database `potluck monitor --db` wrote")
    parser.add_argument("--csv", action="store_true", help="CSV with a header row instead of a table")
    parser.set_defaults(run=run_contributors)


# -- monitor ----------------------------------------------------------------------------------------------
def run_monitor(args: argparse.Namespace) -> int:
    stop = StopSignal()
    ledger = Ledger(args.db, args.run_id)
    try:
        with join(args) as peer:
            follower = Follower(peer, args.run_id, ledger)
            server = _start_web(peer, FollowedRun(ledger, follower), args.host, args.port)
            print(f"monitoring run {args.run_id!r} into {args.db} as peer {peer.peer_id}")
            print(f"dashboard: {server.url}")
            print("press Ctrl-C to stop", flush=True)
            last_print = 0.0
            try:
                while not stop.is_set():
                    now = peer.run(follower.poll(), POLL_TIMEOUT + 5)
                    if now is not None and time.monotonic() - last_print >= PRINT_INTERVAL:
                        print(progress_line(now), flush=True)
                        last_print = time.monotonic()
                    stop.wait(POLL_INTERVAL)
            finally:
                follower.close()
                peer.run(server.close(), WEB_TIMEOUT)
    finally:
        ledger.close()
    print("stopped", flush=True)
    return 0


def _start_web(peer: Peer, view: MonitorView, host: str, port: int) -> Any:
    """The dashboard's server on the peer's event loop; its /metrics include the monitor peer's own."""
    from potluck.metrics import peer_metrics
    from potluck.monitor.web import start_web

    try:
        return peer.run(start_web(view, host, port, registry=peer_metrics(peer.transport).registry), WEB_TIMEOUT)
    except OSError as e:
        raise PotluckError(f"cannot serve the dashboard on {host}:{port} ({e}): pick another --port") from None


def progress_line(now: SwarmNow) -> str:
    batch = f"{now.samples}/{now.target_batch_size}" if now.target_batch_size else f"{now.samples}"
    eta = f", ETA {now.eta_seconds:.1f} s" if now.eta_seconds is not None and math.isfinite(now.eta_seconds) else ""
    return (f"run {now.run_id!r}: {now.peers_online} peer(s) online, {now.samples_per_second:.1f} samples/s, "
            f"epoch {now.epoch}, {batch} samples{eta}")


# -- status -------------------------------------------------------------------------------------------------
def run_status(args: argparse.Namespace) -> int:
    with Ledger(":memory:", args.run_id) as ledger, join(args) as peer:
        follower = Follower(peer, args.run_id, ledger)
        try:
            now = None
            for i in range(STATUS_POLLS):
                if i:
                    time.sleep(POLL_INTERVAL)
                now = peer.run(follower.poll(), POLL_TIMEOUT + 5) or now
        finally:
            follower.close()
        if now is None:
            raise PotluckError(f"could not read run {args.run_id!r} from the DHT: check --initial-peers")
        print(progress_line(now))
        peers = [p for p in ledger.peers() if p.online]
        refused = follower.refused_peers()
        if not peers:
            print(f"no peer of run {args.run_id!r} is online (is --run-id the one the trainers use?)")
        else:
            print(peers_table(peers))
        for p in refused:
            print(f"refused: {p.peer_id}: {p.refused}")
    return 0


def peers_table(peers: list[PeerState]) -> str:
    rows = [("peer", "name", "epoch", "samples/s", "role")]
    rows += [(p.peer_id, p.name or "-", str(p.epoch), f"{p.samples_per_second:.1f}",
              "client" if p.client_mode else "node") for p in peers]
    return _table(rows, right=(2, 3))


# -- contributors ------------------------------------------------------------------------------------------
def run_contributors(args: argparse.Namespace) -> int:
    if not Path(args.db).is_file():
        raise PotluckError(f"no database at {args.db}: give the file `potluck monitor --db` writes")
    with Ledger(args.db) as ledger:
        contributors = ledger.contributors()
    if args.csv:
        write_csv(contributors, sys.stdout)
    elif not contributors:
        print("nobody has been seen yet")
    else:
        print(_table([("peer", "name", "samples", "online hours", "share", "epochs")]
                     + [(c.peer_id, c.name or "-", str(c.samples), f"{c.online_hours:.2f}", f"{100 * c.share:.1f}%",
                         str(c.epochs)) for c in contributors], right=(2, 3, 4, 5)))
    return 0


def write_csv(contributors: list[Contributor], out: Any) -> None:
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(["peer_id", "name", "samples", "online_hours", "share", "epochs"])
    for c in contributors:
        writer.writerow([c.peer_id, c.name or "", c.samples, f"{c.online_hours:.4f}", f"{c.share:.6f}", c.epochs])


def _table(rows: list[tuple[str, ...]], right: tuple[int, ...] = ()) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.rjust(w) if i in right else cell.ljust(w)
                               for i, (cell, w) in enumerate(zip(row, widths, strict=True))).rstrip()
                     for row in rows)
