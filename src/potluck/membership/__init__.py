"""Membership of an authority-governed run (DeDLOC's authentication): who may join.

The authority (`Authority`, `potluck authority`) checks a credential against its `Policy` and
issues signed, expiring `MembershipToken`s; members (`MembershipClient`) fetch and renew them and
follow the authority's signed revocation list in the DHT. The token format and the handshake check
live in `potluck.net.membership`, so the transport can use them without importing this package.

Imports `core`, `net` and `dht` (the revocation list's key); nothing above.
"""

from potluck.membership.authority import TOKEN_METHOD, Authority, revocation_key
from potluck.membership.client import MembershipClient, parse_authority
from potluck.membership.policy import Credential, IdentityReplaced, Policy, PolicyError
from potluck.membership.records import MembershipRecordValidator
from potluck.net.membership import MembershipGate, MembershipToken, RevocationList

__all__ = [
    "TOKEN_METHOD", "Authority", "Credential", "IdentityReplaced", "MembershipClient", "MembershipGate",
    "MembershipRecordValidator", "MembershipToken", "Policy", "PolicyError", "RevocationList", "parse_authority",
    "revocation_key",
]
