"""DHT records: what one key (or one subkey of a key) holds, and how it looks on the wire.

A record is `(key, subkey, value, expiration_time, signature, token)`. `value` is opaque bytes
(the output of `potluck.core.serialization.dumps`); nodes store and forward them without
decoding them except to validate. A key holds either one plain record (subkey None) or a
dictionary of records, one per subkey, each with its own expiration.

Keys are `str` or `bytes`; their id is SHA-1 of their msgpack encoding, so the str "a" and the
bytes b"a" are different keys. Subkeys are `str`, `bytes` or `int`.
"""

from __future__ import annotations

import functools
import hashlib
import re
from collections.abc import Mapping
from typing import Any, NamedTuple

import msgpack

from potluck.core.errors import IdentityError, MalformedMessage
from potluck.core.wire import Bytes, Field, Message, Number
from potluck.dht.errors import NotOwner
from potluck.net.identity import PeerID

__all__ = ["Key", "Record", "Subkey", "ValueWithExpiration", "key_id_of", "own_subkey", "owner_marker", "owners_of",
           "subkey_owner"]

Key = str | bytes
Subkey = str | bytes | int

# Keys and subkeys are names, not data: 1 KiB leaves room for an `[owner:<44 chars>]` marker and
# long expert uids while bounding what every node hashes, stores and sends for each record.
MAX_KEY_BYTES = 1024
# Ed25519 signatures are exactly 64 bytes (RFC 8032).
SIGNATURE_BYTES = 64
# Room for a membership token (DESIGN.md section 6); an Ed25519-signed token binding a peer id,
# an expiry and a run id fits in well under 1 KiB.
MAX_TOKEN_BYTES = 1024
# Domain separation: a record signature can never be mistaken for a handshake or other signature.
SIGNATURE_LABEL = "potluck/dht-record/1"

_BASE58 = "1-9A-HJ-NP-Za-km-z"
_OWNER_STR = re.compile(rf"\[owner:([{_BASE58}]*)\]")
_OWNER_BYTES = re.compile(rf"\[owner:([{_BASE58}]*)\]".encode())
_OWNER_ANY_STR = re.compile(r"\[owner:")
_OWNER_ANY_BYTES = re.compile(rb"\[owner:")
# Keys starting with this are reserved for peer records (`dht.peer_records`).
PEER_RECORD_PREFIX = "_peer."
# Owner markers remembered parsed: one per peer that owns records a node sees (~200 bytes each with
# the PeerID), so under 2 MiB.
OWNER_MARKERS_CACHED = 8192
# Peer record keys whose owner is remembered parsed (every store, find and hand-off of a record
# computes its key id): a key is ~60 bytes, so this is well under 1 MiB.
PEER_RECORD_KEYS_CACHED = 4096
_PEER_RECORD_KEY = re.compile(rf"{re.escape(PEER_RECORD_PREFIX)}\[owner:([{_BASE58}]+)\]")


class ValueWithExpiration(NamedTuple):
    """What `DHT.get` returns: the value and when it expires (in DHT time). For a key with
    subkeys, `value` is a dict {subkey: ValueWithExpiration}."""

    value: Any
    expiration_time: float


def encode_key(key: Key) -> bytes:
    """The canonical bytes of a key (its msgpack encoding), hashed for its id."""
    return msgpack.packb(key, use_bin_type=True)


def key_id_of(key: Key) -> int:
    """A key's 160-bit position in the id space. A peer record's key (`PEER_RECORD_PREFIX` + the
    owner's marker) sits at its owner's own node id, as in libp2p's peer routing: the nodes a
    peer finds when it joins (the lookup of its own id) are exactly its record's replicas, so it
    stores the record there with no second lookup and no new connections."""
    if not isinstance(key, (str, bytes)):
        raise TypeError(f"DHT keys are str or bytes, got {type(key).__name__}")
    if isinstance(key, str) and key.startswith(PEER_RECORD_PREFIX):
        owner = _peer_record_owner(key)
        if owner is not None:
            return int.from_bytes(hashlib.sha1(owner.to_bytes()).digest(), "big")
    return int.from_bytes(hashlib.sha1(encode_key(key)).digest(), "big")


@functools.lru_cache(maxsize=PEER_RECORD_KEYS_CACHED)
def _peer_record_owner(key: str) -> PeerID | None:
    """The owner of a well-formed peer record key; None for any other key under the prefix
    (which `dht.peer_records.PeerRecordValidator` refuses anyway)."""
    match = _PEER_RECORD_KEY.fullmatch(key)
    if match is None:
        return None
    try:
        return PeerID.from_string(match.group(1))
    except IdentityError:
        return None


def name_size(name: Key | Subkey | None) -> int:
    """Bytes a key or subkey takes (UTF-8 for str, 8 for ints)."""
    if name is None:
        return 0
    if isinstance(name, str):
        return len(name) if name.isascii() else len(name.encode("utf-8", "surrogatepass"))
    if isinstance(name, bytes):
        return len(name)
    return 8


def owner_marker(peer_id: PeerID | str) -> str:
    """The marker that makes a key or subkey writable only by `peer_id`, e.g.
    `f"progress.{run}{owner_marker(peer.peer_id)}"`."""
    return f"[owner:{peer_id}]"


def own_subkey(peer_id: PeerID) -> str:
    """The subkey under which `peer_id`, and only it, writes its entry of a per-peer dictionary
    (state donors, matchmaking declarations, progress, profiles, expert grid cells): the bare
    owner marker, so the DHT refuses it unless `peer_id` signed it."""
    return owner_marker(peer_id)


def subkey_owner(subkey: Subkey) -> PeerID | None:
    """Whose entry `subkey` is: the peer it names, when it is exactly `own_subkey(that peer)`;
    None otherwise. Readers of per-peer dictionaries take the writer from here and skip entries it
    returns None for, so a signed entry can never be read as another peer's."""
    if not isinstance(subkey, str):
        return None
    try:
        owner = owners_of("", subkey)
    except NotOwner:
        return None
    return owner if owner is not None and subkey == own_subkey(owner) else None


def owned_entries(found: Any) -> list[tuple[PeerID, Any]]:
    """(owner, value) of each entry of a per-peer dictionary (a `get` result) that its owner
    signed, in stored order; an absent value, a plain record and unsigned subkeys give nothing."""
    value = getattr(found, "value", None)
    if not isinstance(value, dict):
        return []
    return [(owner, getattr(entry, "value", None)) for subkey, entry in value.items()
            if (owner := subkey_owner(subkey)) is not None]


def _owners_in(name: Key | Subkey | None) -> list[str]:
    if isinstance(name, str):
        if not _OWNER_ANY_STR.search(name):
            return []
        found = _OWNER_STR.findall(name)
        if len(found) != len(_OWNER_ANY_STR.findall(name)):
            raise NotOwner(f"{name[:100]!r} has a malformed [owner:...] marker")
        return found
    if isinstance(name, bytes):
        if not _OWNER_ANY_BYTES.search(name):
            return []
        found = _OWNER_BYTES.findall(name)
        if len(found) != len(_OWNER_ANY_BYTES.findall(name)):
            raise NotOwner(f"{name[:100]!r} has a malformed [owner:...] marker")
        return [f.decode("ascii") for f in found]
    return []


def owners_of(key: Key, subkey: Subkey | None) -> PeerID | None:
    """The peer a record's key or subkey names as its owner, if any.

    Raises NotOwner when the markers are malformed or name more than one peer: such a record
    could never be validly signed, so it is refused outright.
    """
    in_key, in_subkey = _owners_in(key), _owners_in(subkey)
    if not (in_key or in_subkey):
        return None  # the common case, asked of every record stored or read: no sets built
    names = set(in_key) | set(in_subkey)
    if len(names) > 1:
        raise NotOwner("a key and its subkey name different owners; a record has one owner")
    return _marked_peer(names.pop())


@functools.lru_cache(maxsize=OWNER_MARKERS_CACHED)
def _marked_peer(text: str) -> PeerID:
    """The peer id an owner marker holds (parsed once per text: every store, read and hand-off of
    an owned record asks, and base58 decoding is most of the cost). Errors are not cached."""
    try:
        return PeerID.from_string(text)
    except IdentityError as e:
        raise NotOwner(f"the [owner:...] marker does not hold a valid peer id: {e}") from None


class Name(Field):
    """A record's key (str or bytes) or, with `ints`, its subkey (str, bytes or a 64-bit int), of
    at most MAX_KEY_BYTES (`name_size`)."""

    def __init__(self, key: str | None = None, *, ints: bool = False, **options: Any):
        super().__init__(key, **options)
        self.kinds = (str, bytes, int) if ints else (str, bytes)
        self.kinds_named = "str, bytes or int" if ints else "str or bytes"

    def check(self, value: Any, key: str, what: str, context: Mapping[str, Any]) -> Key | Subkey:
        if value.__class__ is bool or not isinstance(value, self.kinds):
            raise MalformedMessage(what, f"{key!r} must be {self.kinds_named}, got {type(value).__name__}")
        if name_size(value) > MAX_KEY_BYTES:
            raise MalformedMessage(what, f"{key!r} must take at most {MAX_KEY_BYTES} bytes")
        if isinstance(value, int) and not -(2**63) <= value < 2**63:
            raise MalformedMessage(what, f"{key!r} must fit in 64 bits")
        return value

    def fast(self, v: str) -> str:
        # A short str needs no size check: UTF-8 takes at most 4 bytes a character.
        return f"{v}.__class__ is str and len({v}) <= {MAX_KEY_BYTES // 4}"


class Value(Field):
    """A record's value: bytes, of any size here (`validation` bounds it, per node)."""

    def check(self, value: Any, key: str, what: str, context: Mapping[str, Any]) -> bytes:
        if not isinstance(value, bytes):
            raise MalformedMessage(what, f"{key!r} must be bytes, got {type(value).__name__}")
        return value

    def fast(self, v: str) -> str:
        return f"{v}.__class__ is bytes"


class Record(Message, what="DHT record", positional=True):
    """One stored value: a plain value (subkey None) or one entry of a key's dictionary. On the
    wire `[key, subkey, value, expiration_time, signature, token]`; `from_wire` checks every
    field's type and bound, and semantic rules (size limit, expiration, signature, schema) are
    `validation`'s job."""

    key: Key = Name()
    subkey: Subkey | None = Name(ints=True, optional=True)
    value: bytes = Value()
    expiration_time: float = Number(signed=True)
    signature: bytes | None = Bytes(max_bytes=SIGNATURE_BYTES, exact=True, default=None)
    # The owner's membership token in an authority-governed run (`net.membership`).
    token: bytes | None = Bytes(max_bytes=MAX_TOKEN_BYTES, default=None)

    def signed_bytes(self) -> bytes:
        """What an owner signs: key, subkey, value, expiration and its membership token (so a token
        cannot be moved onto another record, nor stripped), under a domain label."""
        return msgpack.packb([SIGNATURE_LABEL, self.key, self.subkey, self.value,
                              float(self.expiration_time), self.token], use_bin_type=True)

    def stored_bytes(self) -> int:
        """Bytes this record costs a node (without bookkeeping overhead)."""
        return (len(self.value) + name_size(self.key) + name_size(self.subkey)
                + len(self.signature or b"") + len(self.token or b""))
