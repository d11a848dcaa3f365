"""DHT records of an authority-governed run: an owner-signed record must carry its owner's token.

The owner's signature covers the token (`dht.records.Record.signed_bytes`), so a token cannot be
lifted onto another record. A record is refused if its token is missing, forged, for another run
or another peer, or revoked. Expiry is checked with RECORD_TOKEN_GRACE: the token proves membership
when the record was signed, and a record may live up to the DHT's 24 h; revocation is what voids a
member's records at once.
"""

from __future__ import annotations

from typing import Any

from potluck.core.errors import MalformedMessage, MembershipError
from potluck.dht.errors import RecordRejected
from potluck.dht.records import Record, owners_of
from potluck.dht.validation import DEFAULT_MAX_TTL
from potluck.net.membership import MembershipGate, MembershipToken

__all__ = ["RECORD_TOKEN_GRACE", "MembershipRecordValidator", "UnauthorizedRecord"]

# How long after its token expired a record is still accepted: the DHT's longest record lifetime,
# so a record signed while its owner was a member lives out its lifetime (unless revoked).
RECORD_TOKEN_GRACE = DEFAULT_MAX_TTL


class UnauthorizedRecord(RecordRejected):
    """An owner-signed record whose owner is not a member of the run (no or bad token)."""


class MembershipRecordValidator:
    """A `dht.validation.RecordValidator`: owner-signed records need a token of the run (see above)."""

    def __init__(self, gate: MembershipGate):
        self.gate = gate

    def validate(self, record: Record, value: Any) -> None:
        owner = owners_of(record.key, record.subkey)
        if owner is None or owner == self.gate.authority:
            return
        if record.token is None:
            raise UnauthorizedRecord(f"{record.key!r:.120} is signed by {owner}, which attached no membership "
                                     "token; only members of this run may write owned records")
        try:
            token = MembershipToken.from_wire(record.token)
            token.verify(self.gate.authority, owner, self.gate.clock() - RECORD_TOKEN_GRACE,
                         run_id=self.gate.run_id, revocations=self.gate.revocations)
        except (MalformedMessage, MembershipError) as e:
            raise UnauthorizedRecord(f"{record.key!r:.120} is signed by {owner}, not a member of this run: "
                                     f"{e}") from None
