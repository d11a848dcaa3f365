"""Rules every record must pass, at the caller before sending and at every node that receives it.

- limits: value size, how far ahead it may expire;
- owner signatures: a key or subkey containing `[owner:<peer id>]` needs that peer's signature
  over (key, subkey, value, expiration), so nobody else can write or overwrite it;
- the value must decode (`potluck.core.serialization.loads`): nodes never hold garbage;
- optional validators, e.g. `SchemaValidator` (pydantic models per key prefix).
"""

from __future__ import annotations

import hashlib
import math
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from potluck.core.bounded import drop_oldest
from potluck.core.errors import SerializationError
from potluck.core.serialization import loads
from potluck.dht.errors import ExpirationTooFar, NotOwner, RecordRejected, ValueTooLarge
from potluck.dht.records import MAX_KEY_BYTES, Key, Record, name_size, owners_of
from potluck.net.identity import SIGNATURE_BYTES, Identity, PeerID

if TYPE_CHECKING:
    from pydantic import BaseModel

__all__ = ["Limits", "RecordValidator", "SchemaValidator", "VerifiedSignatures", "check_record", "sign_record"]

# 64 KiB: DHT values are directory entries (addresses, small dicts, progress counters). Bulk data
# travels peer to peer; a cap keeps every replica cheap to store, send and validate.
DEFAULT_MAX_VALUE_BYTES = 64 * 1024
# Tensors one value may hold: a directory entry holds a few if any, and each costs its decoder an
# allocation (4,500 empty ones fit in 64 KiB: 256 such values in one store request took 12 s of
# the node's CPU to check, and every reader paid as much again).
MAX_VALUE_TENSORS = 64
# 24 hours, the record lifetime of the Kademlia paper: a record must be re-stored at least daily,
# so the records of a squatter or of a peer that left do not occupy the network for long.
DEFAULT_MAX_TTL = 24 * 3600.0
# Nodes accept records this much further ahead than the caller's own check allows: peers'
# wall clocks differ (NTP keeps them within a second; unsynchronised machines drift by minutes).
CLOCK_SKEW_ALLOWANCE = 300.0
# Owner signatures remembered as verified, per process: each is a 32-byte digest (~100 bytes with
# its dict slot), so this is at most ~2 MiB, and it holds every record of a swarm of thousands.
VERIFIED_SIGNATURES = 16384


@dataclass(frozen=True)
class Limits:
    """The limits a node enforces; every node of a swarm should use the same ones."""

    max_value_bytes: int = DEFAULT_MAX_VALUE_BYTES
    max_ttl: float = DEFAULT_MAX_TTL


class RecordValidator(Protocol):
    """A custom rule: raise `RecordRejected` to refuse a record (its value already decoded)."""

    def validate(self, record: Record, value: Any) -> None: ...


class SchemaValidator:
    """Values of keys starting with a prefix must match a pydantic model (each subkey's value
    too, for dictionary keys). Example: `SchemaValidator({"expert.": ExpertInfo})`."""

    def __init__(self, schemas: Mapping[Key, type[BaseModel]]):
        from pydantic import BaseModel

        for prefix, model in schemas.items():
            if not isinstance(prefix, (str, bytes)):
                raise TypeError(f"schema prefixes are str or bytes, got {type(prefix).__name__}")
            if not (isinstance(model, type) and issubclass(model, BaseModel)):
                raise TypeError(f"the schema for {prefix!r} must be a pydantic model class")
        self.schemas = dict(schemas)

    def validate(self, record: Record, value: Any) -> None:
        from pydantic import ValidationError

        for prefix, model in self.schemas.items():
            if type(prefix) is type(record.key) and record.key.startswith(prefix):
                try:
                    model.model_validate(value)
                except ValidationError as e:
                    first = e.errors()[0] if e.errors() else {}
                    where = ".".join(str(p) for p in first.get("loc", ())) or "value"
                    raise RecordRejected(
                        f"value for {record.key!r:.120} does not match schema {model.__name__} "
                        f"for prefix {prefix!r}: {where}: {first.get('msg', e)}") from None


class VerifiedSignatures:
    """Which (signer, signature, data) triples already verified, so a record seen again costs a hash
    instead of an Ed25519 verification. A record arrives many times: from each replica that hands it
    on, in the answer of every lookup that finds it, and, in an emulated swarm, at every node of the
    process. Verification is deterministic, so a triple that verified once verifies again; only
    successes are kept, under a BLAKE2b digest of the whole triple (signer and signature have fixed
    lengths, so the concatenation is unambiguous), oldest forgotten first past `max_entries`."""

    def __init__(self, max_entries: int = VERIFIED_SIGNATURES):
        self.max_entries = max_entries
        self._seen: dict[bytes, None] = {}
        self._lock = threading.Lock()  # DHTs of one process may run on several threads' loops

    def verify(self, signer: PeerID, signature: bytes, data: bytes) -> bool:
        """`signer.verify(signature, data)`, remembered when it succeeds."""
        if not isinstance(signature, bytes) or len(signature) != SIGNATURE_BYTES:
            return signer.verify(signature, data)  # unusual input: checked, never remembered
        digest = hashlib.blake2b(signer.to_bytes() + signature + data, digest_size=32).digest()
        if digest in self._seen:
            return True
        if not signer.verify(signature, data):
            return False
        with self._lock:
            self._seen[digest] = None
            drop_oldest(self._seen, self.max_entries)
        return True

    def __len__(self) -> int:
        return len(self._seen)


verified_signatures = VerifiedSignatures()


def check_names(key: Any, subkey: Any) -> None:
    """Types and sizes of a key and subkey given by a user (the wire parser checks its own)."""
    if not isinstance(key, (str, bytes)):
        raise RecordRejected(f"DHT keys are str or bytes, got {type(key).__name__}")
    if subkey is not None and (isinstance(subkey, bool) or not isinstance(subkey, (str, bytes, int))):
        raise RecordRejected(f"subkeys are str, bytes or int, got {type(subkey).__name__}")
    for what, name in (("key", key), ("subkey", subkey)):
        if isinstance(name, str):
            try:
                name.encode("utf-8")
            except UnicodeEncodeError:
                raise RecordRejected(f"the {what} is not valid UTF-8 text") from None
        if name_size(name) > MAX_KEY_BYTES:
            raise RecordRejected(f"the {what} is {name_size(name)} bytes; the limit is {MAX_KEY_BYTES}")
    if isinstance(subkey, int) and not -(2**63) <= subkey < 2**63:
        raise RecordRejected("integer subkeys must fit in 64 bits")


def check_record(record: Record, limits: Limits, now: float,
                 validators: Sequence[RecordValidator] = (), *, skew: float = CLOCK_SKEW_ALLOWANCE) -> Any:
    """Refuse a record that breaks any rule (raises a `RecordRejected` subclass that says which);
    returns the decoded value. `skew` is 0 at the caller and CLOCK_SKEW_ALLOWANCE at nodes."""
    size = len(record.value)
    if size > limits.max_value_bytes:
        raise ValueTooLarge(f"value for {record.key!r:.120} is {size} bytes serialized; the DHT limit "
                            f"is {limits.max_value_bytes} bytes: store a reference (e.g. a peer id) and "
                            "send the data peer to peer instead")
    if not math.isfinite(record.expiration_time):
        raise RecordRejected("expiration_time must be a finite number of seconds (DHT time)")
    if record.expiration_time > now + limits.max_ttl + skew:
        raise ExpirationTooFar(
            f"expiration_time is {record.expiration_time - now:.0f} s ahead of DHT time; records may "
            f"live at most {limits.max_ttl:.0f} s: re-store them before they expire instead")
    owner = owners_of(record.key, record.subkey)
    if owner is not None:
        if record.signature is None:
            raise NotOwner(f"{record.key!r:.120} is owned by {owner}; the record carries no signature")
        if not verified_signatures.verify(owner, record.signature, record.signed_bytes()):
            raise NotOwner(f"{record.key!r:.120} is owned by {owner}; the signature does not verify "
                           "(forged, or signed by another peer)")
    elif record.signature is not None or record.token is not None:
        raise RecordRejected("only records whose key or subkey names an [owner:...] carry a signature or a "
                             "membership token")
    try:
        value = loads(record.value, max_buffers=MAX_VALUE_TENSORS)
    except SerializationError as e:
        raise RecordRejected(f"value for {record.key!r:.120} is not potluck-serialized data: {e}") from None
    for validator in validators:
        validator.validate(record, value)
    return value


def sign_record(record: Record, identity: Identity, token: bytes | None = None) -> Record:
    """Attach our signature (and our membership `token`, which it covers) if the record names us as
    owner; refuse if it names someone else."""
    owner = owners_of(record.key, record.subkey)
    if owner is None:
        return record
    if owner != identity.peer_id:
        raise NotOwner(f"{record.key!r:.120} is owned by {owner}; only that peer can store it "
                       f"(this peer is {identity.peer_id})")
    record = Record(record.key, record.subkey, record.value, record.expiration_time, None, token)
    signature = identity.sign(record.signed_bytes())
    return Record(record.key, record.subkey, record.value, record.expiration_time, signature, token)
