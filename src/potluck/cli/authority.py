"""`potluck authority`: run a run's membership authority, and edit its policy file.

    potluck authority --run-id R --key FILE --policy FILE [--host H --port P]   # serve tokens
    potluck authority allow      --policy FILE PEER_ID [--name NAME]
    potluck authority add-invite --policy FILE --name NAME [--uses N]           # prints the code once
    potluck authority add-user   --policy FILE NAME [--max-identities N]        # password: prompt or $POTLUCK_PASSWORD
    potluck authority max-identities --policy FILE N [--user NAME]              # live peer ids per user name
    potluck authority revoke     --policy FILE PEER_ID

The running authority re-reads the policy file when it changes, so `revoke` takes effect at once.
"""

from __future__ import annotations

import argparse
import getpass
import logging
import os
from pathlib import Path

from potluck.cli.signals import StopSignal
from potluck.core.errors import MembershipError
from potluck.membership import Authority, Policy
from potluck.membership.authority import authority_gate
from potluck.net import Identity, TCPTransport
from potluck.peer import Peer

logger = logging.getLogger(__name__)

# How often the running authority looks at the policy file's modification time: a revocation made
# with `potluck authority revoke` is published within this many seconds.
POLICY_POLL_INTERVAL = 5.0


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "authority", help="run a run's membership authority (signed tokens), or edit its policy",
        description="Serve membership tokens for an authority-governed run: peers started with "
                    "`--authority <this address> --credential ...` get a signed token if the policy admits "
                    "them. The subcommands edit the policy file.")
    parser.add_argument("--run-id", help="the run this authority governs (required to serve)")
    parser.add_argument("--key", metavar="FILE", help="the authority's key file (created if missing); its "
                        "public key is the authority's peer id, which members pass as --authority")
    parser.add_argument("--policy", metavar="FILE", help="the policy file (JSON; created by the subcommands)")
    parser.add_argument("--host", default="0.0.0.0", help="interface to listen on (default: all)")
    parser.add_argument("--port", type=int, default=0, help="port to listen on (default: any free port)")
    parser.add_argument("--initial-peers", nargs="*", default=[], metavar="ADDR",
                        help="peers of the run's DHT to join (where the revocation list is published)")
    parser.set_defaults(run=run)
    actions = parser.add_subparsers(dest="action", metavar="ACTION")
    allow = actions.add_parser("allow", help="admit a peer id on its key alone")
    allow.add_argument("peer_id")
    allow.add_argument("--name", help="the member's name in tokens and logs (default: the peer id's start)")
    invite = actions.add_parser("add-invite", help="create an invite code (printed once; only its hash is stored)")
    invite.add_argument("--name", required=True, help="the name tokens of invited peers carry")
    invite.add_argument("--uses", type=int, default=1, help="how many peers may use it (default: 1)")
    user = actions.add_parser("add-user", help="add or reset a user name and password (scrypt-hashed)")
    user.add_argument("name")
    user.add_argument("--max-identities", type=int, metavar="N",
                      help="live peer ids this user may hold at once (default: the run's, 1 unless set)")
    limit = actions.add_parser("max-identities", help="how many live peer ids a user name may hold at once "
                               "(a new login beyond it replaces the name's oldest identity)")
    limit.add_argument("count", type=int)
    limit.add_argument("--user", help="for this user only (default: for the run, every user without its own)")
    revoke = actions.add_parser("revoke", help="revoke a peer id: no more tokens, and members refuse it")
    revoke.add_argument("peer_id")
    for sub_parser in (allow, invite, user, limit, revoke):
        sub_parser.add_argument("--policy", metavar="FILE", required=True, help="the policy file")


def run(args: argparse.Namespace) -> int:
    if args.action is not None:
        return edit_policy(args)
    missing = [flag for flag, value in (("--run-id", args.run_id), ("--key", args.key), ("--policy", args.policy))
               if not value]
    if missing:
        raise MembershipError(f"to serve tokens, `potluck authority` needs {', '.join(missing)} "
                              "(or a subcommand: allow, add-invite, add-user, max-identities, revoke)")
    policy_path = Path(args.policy)
    policy = Policy.load(policy_path)
    if not policy_path.exists():
        logger.warning("policy file %s does not exist yet: nobody is admitted until you add members", policy_path)
    stop = StopSignal()
    identity = Identity.load_or_create(args.key)
    # Guarded from the first connection: strangers may only ask for a token, never use the DHT.
    transport = TCPTransport(identity, host=args.host, port=args.port,
                             membership=authority_gate(identity.peer_id, args.run_id))
    with Peer(initial_peers=args.initial_peers, transport=transport) as peer:
        async def start() -> Authority:
            authority = Authority(peer.transport, args.run_id, policy, policy_path=policy_path, dht=peer.dht)
            authority.start_publishing()
            return authority

        authority = peer.run(start())
        print(f"authority of run {args.run_id!r}: {peer.peer_id}")
        print("members join with:")
        for addr in peer.addresses:
            print(f"  --authority {addr}")
        print("press Ctrl-C to stop", flush=True)
        seen = _mtime(policy_path)
        try:
            while not stop.wait(POLICY_POLL_INTERVAL):
                current = _mtime(policy_path)
                if current != seen:
                    seen = current
                    authority.policy = Policy.load(policy_path)
                    peer.run(authority.publish_revocations(), timeout=60)
                    logger.info("re-read the policy file %s", policy_path)
        finally:
            peer.run(authority.stop(), timeout=10)
    print("stopped", flush=True)
    return 0


def edit_policy(args: argparse.Namespace) -> int:
    policy = Policy.load(args.policy)
    if args.action == "allow":
        policy.allow_peer(args.peer_id, args.name or args.peer_id[:12])
        print(f"allowed {args.peer_id}")
    elif args.action == "add-invite":
        code = policy.add_invite(args.name, args.uses)
        print(f"invite code (shown only now; give it to the member): {code}")
        print(f"they join with: --credential invite:{code}")
    elif args.action == "add-user":
        password = os.environ.get("POTLUCK_PASSWORD") or getpass.getpass(f"password for {args.name}: ")
        policy.add_user(args.name, password)
        if args.max_identities is not None:
            policy.set_max_identities(args.max_identities, args.name)
        print(f"added user {args.name}; they join with: --credential password:{args.name} "
              "and the password in $POTLUCK_PASSWORD")
    elif args.action == "max-identities":
        policy.set_max_identities(args.count, args.user)
        print(f"{args.user or 'every user without its own setting'} may hold {args.count} live peer id(s) at once; "
              "a new login beyond that replaces the oldest")
    elif args.action == "revoke":
        policy.revoke(args.peer_id)
        print(f"revoked {args.peer_id}; a running authority publishes it within {POLICY_POLL_INTERVAL:g} s")
    policy.save(args.policy)
    return 0


def _mtime(path: Path) -> float | None:
    try:
        return path.stat().st_mtime
    except FileNotFoundError:
        return None
