"""`potluck peer`: a long-running peer that others bootstrap from."""

from __future__ import annotations

import argparse
import ipaddress
import logging
import re
import socket

from potluck.cli.signals import StopSignal
from potluck.peer import Peer

logger = logging.getLogger(__name__)

# How often a running peer logs its DHT status (at INFO: `potluck -v peer`).
STATUS_INTERVAL = 60.0


def add_peer_options(parser: argparse.ArgumentParser) -> None:
    """Options every command that starts a peer shares."""
    parser.add_argument("--initial-peers", nargs="*", default=[], metavar="ADDR",
                        help="addresses of peers already in the swarm, as printed by their "
                             "`potluck peer` (e.g. /ip4/203.0.113.7/tcp/31337/p2p/<peer id>)")
    parser.add_argument("--host", default="0.0.0.0", help="interface to listen on (default: all)")
    parser.add_argument("--port", type=int, default=0, help="port to listen on (default: any free port)")
    parser.add_argument("--client-mode", action="store_true",
                        help="force client mode: do not listen, only dial out (default: check at start "
                             "whether others can connect, and become a client or use a relay if not)")
    add_identity_options(parser)
    parser.add_argument("--announce", nargs="*", default=None, metavar="ADDR",
                        help="addresses to advertise instead of the listening ones (port forwarding)")
    parser.add_argument("--metrics-port", type=int, default=None, metavar="PORT",
                        help="serve this peer's Prometheus metrics at http://HOST:PORT/metrics (0: any free "
                             "port; see docs/monitoring.md)")
    parser.set_defaults(relay=False)  # `potluck peer` adds --relay


def add_identity_options(parser: argparse.ArgumentParser) -> None:
    """Who the peer is and how it proves it: shared with `potluck monitor`'s client-mode peer."""
    parser.add_argument("--identity", metavar="PATH",
                        help="key file; created if missing, so the peer id stays the same across restarts")
    parser.add_argument("--insecure", action="store_true",
                        help="plain TCP without TLS: only for trusted networks")
    parser.add_argument("--authority", metavar="ADDR",
                        help="join an authority-governed run: the authority's address as `potluck authority` "
                             "prints it (/ip4/.../tcp/.../p2p/<id>), or its peer id if it is an initial peer")
    parser.add_argument("--credential", metavar="CRED", default=None,
                        help="what to show the authority: 'peer' (an allowlisted identity; the default), "
                             "'invite:CODE', or 'password:NAME' with the password in $POTLUCK_PASSWORD")


def start_peer(args: argparse.Namespace) -> Peer:
    return Peer(initial_peers=args.initial_peers, host=args.host, port=args.port,
                client_mode=True if args.client_mode else None, identity_path=args.identity,
                insecure=args.insecure, announce=args.announce,
                authority=args.authority, credential=args.credential, relay=args.relay,
                metrics_port=args.metrics_port)


# Addresses whose route this machine looks up (no packet is sent) to learn the address it would use
# to reach another machine: documentation ranges (RFC 5737, RFC 3849), so nothing is ever dialed.
ROUTE_PROBES = ("198.51.100.1", "2001:db8::1")


def routable_hosts() -> list[str]:
    """This machine's addresses that other machines route to (not loopback): the source address of
    its default routes. gethostname() often resolves to loopback only."""
    hosts = []
    for probe in ROUTE_PROBES:
        family = socket.AF_INET6 if ":" in probe else socket.AF_INET
        try:
            with socket.socket(family, socket.SOCK_DGRAM) as s:
                s.connect((probe, 9))  # UDP connect: a route lookup, nothing is sent
                host = s.getsockname()[0]
        except OSError:  # no route of this family
            continue
        if not ipaddress.ip_address(host).is_loopback and host not in hosts:
            hosts.append(host)
    return hosts


def join_addresses(addresses: list[str], hosts: list[str], listen_host: str) -> list[str]:
    """`addresses` (the peer's own), plus one per routable host of this machine it does not name
    yet, when the peer listens on every interface: what a user on another machine joins with."""
    listen = ipaddress.ip_address(listen_host)
    if not addresses or not listen.is_unspecified:
        return list(addresses)
    found = re.fullmatch(r"/ip([46])/([^/]+)(/tcp/\d+/p2p/\S+)", addresses[0])
    if found is None:
        return list(addresses)
    named = {re.match(r"/ip[46]/([^/]+)", a).group(1) for a in addresses if a.startswith("/ip")}
    extra = [f"/ip{listen.version}/{h}{found.group(3)}" for h in hosts
             if h not in named and ipaddress.ip_address(h).version == listen.version]
    return extra + list(addresses)


def print_join_addresses(peer: Peer, listen_host: str) -> None:
    """The lines a user copies to another machine, routable addresses first, loopback last."""
    for addr in join_addresses(peer.addresses, routable_hosts(), listen_host):
        print(f"  --initial-peers {addr}")


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "peer", help="run a long-lived peer (a bootstrap node for others)",
        description="Run a long-lived peer and print the addresses other peers can join with. "
                    "Stop it with Ctrl-C.")
    add_peer_options(parser)
    parser.add_argument("--relay", action="store_true",
                        help="also relay connections to peers behind NAT (only while this peer is publicly "
                             "reachable); relays announce themselves in the DHT")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    stop = StopSignal()
    with start_peer(args) as peer:
        print(f"peer id: {peer.peer_id}")
        if peer.membership is not None:
            print(f"member {peer.membership.name!r} of run {peer.membership.run_id!r}")
        if peer.addresses:
            print("other peers can join with:")
            print_join_addresses(peer, args.host)
        print(peer.reachability_summary)
        if peer.metrics_url is not None:
            print(f"metrics: {peer.metrics_url}")
        if args.relay and peer.transport.reachability == "public":
            print("relaying for peers behind NAT")
        print("press Ctrl-C to stop", flush=True)
        while not stop.wait(STATUS_INTERVAL):
            node = peer.dht.node
            logger.info("dht: %d peers in the routing table, %d keys stored (%d bytes)",
                        len(node.routing), len(node.storage), node.storage.total_bytes)
    print("stopped", flush=True)
    return 0
