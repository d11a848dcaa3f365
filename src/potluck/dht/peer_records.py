"""Peer records in the DHT: the one place where a peer's addresses are published and looked up.

Every (dialable) peer stores its signed `PeerRecord` (`potluck.net.peer_record`) under
`peer_record_key(peer_id)` = `"_peer.[owner:<peer id>]"`, whose id in the DHT is the peer's own
node id (`records.key_id_of`). The key is owner-marked, so the DHT's
own owner signature already stops anyone else from writing or squatting it; the value carries the
record's own signature too, so the transport can check what it dials without trusting the DHT.
`PeerRecordValidator` is installed on every DHT node: a record under a `_peer.` key that does not
parse, names another peer, disagrees with the DHT record's expiration or lives too long is refused
at parse time, by the writer and by every node that receives it.
"""

from __future__ import annotations

import hashlib
import threading
from typing import Any

from potluck.core.bounded import drop_oldest
from potluck.core.dht_time import Clock
from potluck.core.errors import MalformedMessage
from potluck.core.serialization import loads
from potluck.dht.errors import ExpirationTooFar, RecordRejected
from potluck.dht.records import PEER_RECORD_PREFIX, Record, owner_marker, owners_of
from potluck.dht.validation import CLOCK_SKEW_ALLOWANCE
from potluck.net.identity import PeerID
from potluck.net.peer_record import PeerRecord

__all__ = ["MAX_PEER_RECORD_TTL", "PARSED_PEER_RECORDS", "PEER_RECORD_PREFIX", "PEER_RECORD_TTL",
           "PeerRecordValidator", "is_peer_record_key", "peer_record_from_bytes", "peer_record_key"]

# A record lives 30 minutes and is re-signed every third of that: a dead peer's addresses linger
# at most this long (dials to them fail fast anyway), and one missed refresh is harmless.
PEER_RECORD_TTL = 30 * 60.0
# Nodes refuse peer records expiring further ahead: later expiration wins in storage, so a record
# signed for a day by a misconfigured run would hide a restarted peer's new addresses all day.
MAX_PEER_RECORD_TTL = 2 * 3600.0
# Peer records remembered as parsed and verified, per process, by a digest of their DHT value bytes;
# a record is ~150 bytes (one address), so this is ~2 MiB at most.
PARSED_PEER_RECORDS = 8192


def peer_record_key(peer_id: PeerID | str) -> str:
    """The DHT key of `peer_id`'s record (owner-marked: only that peer can write it)."""
    return f"{PEER_RECORD_PREFIX}{owner_marker(peer_id)}"


def is_peer_record_key(key: object) -> bool:
    return isinstance(key, str) and key.startswith(PEER_RECORD_PREFIX)


class PeerRecordValidator:
    """The rules of `_peer.` keys (see the module docstring); a `RecordValidator`."""

    def __init__(self, clock: Clock, max_ttl: float = MAX_PEER_RECORD_TTL):
        self.clock = clock
        self.max_ttl = max_ttl

    def validate(self, record: Record, value: Any) -> None:
        key = record.key
        if not is_peer_record_key(key):
            return
        owner = owners_of(key, record.subkey)
        if owner is None or key != peer_record_key(owner) or record.subkey is not None:
            raise RecordRejected(f"{PEER_RECORD_PREFIX!r} keys hold peer records only: "
                                 f"'{PEER_RECORD_PREFIX}[owner:<peer id>]' with no subkey")
        parsed = peer_record_from_bytes(record.value, value)
        if parsed.peer_id != owner:
            raise RecordRejected(f"the peer record under {key!r:.80} is {parsed.peer_id}'s, not its owner's")
        if parsed.expiration_time != record.expiration_time:
            raise RecordRejected("a peer record's signed expiration must equal the DHT record's")
        if record.expiration_time > self.clock() + self.max_ttl + CLOCK_SKEW_ALLOWANCE:
            raise ExpirationTooFar(f"peer records may live at most {self.max_ttl:.0f} s; re-sign them instead")


class _ParsedPeerRecords:
    """`PeerRecord.from_wire(loads(value))` by a BLAKE2b digest of `value`, for values that parsed: the
    same bytes always parse to the same record, and a peer record is checked each time it is stored
    on a node, returned by a lookup and resolved, always the same few hundred bytes. Oldest forgotten
    first past `max_entries`; what fails to parse is never remembered."""

    def __init__(self, max_entries: int = PARSED_PEER_RECORDS):
        self.max_entries = max_entries
        self._parsed: dict[bytes, PeerRecord] = {}
        self._lock = threading.Lock()

    def parse(self, value: bytes, decoded: Any = None) -> PeerRecord:
        digest = hashlib.blake2b(value, digest_size=32).digest()
        parsed = self._parsed.get(digest)
        if parsed is None:
            try:
                parsed = PeerRecord.from_wire(loads(value) if decoded is None else decoded)
            except MalformedMessage as e:
                raise RecordRejected(str(e)) from None
            with self._lock:
                self._parsed[digest] = parsed
                drop_oldest(self._parsed, self.max_entries)
        return parsed


_parsed_peer_records = _ParsedPeerRecords()


def peer_record_from_bytes(value: bytes, decoded: Any = None) -> PeerRecord:
    """The verified `PeerRecord` a DHT value holds (`decoded`: `loads(value)`, if the caller has it);
    raises RecordRejected. Remembered per process (see `_ParsedPeerRecords`)."""
    return _parsed_peer_records.parse(value, decoded)
