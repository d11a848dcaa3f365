"""The DHT's RPC messages, declared (`potluck.core.wire.Message`): every field checked as it arrives.

Each request and response travels as one msgpack blob (`bytes`): a find answer names hundreds of
small items, and msgpack's C codec handles them in one call. `write(message)` makes the blob and
`read(Message, blob, **context)` checks it, raising `BadRequest` (what a node answers a malformed
request with, and what makes an asker drop a peer that answered one). Messages (ids are 20-byte
big-endian):
- `dht.ping`  `Ping` {}                                    -> `Pong` {"ok": True}
- `dht.find`  `FindRequest` {"ids": [id...], "values": bool, "stop": bool[, "rec": record]}
                -> `FindResponse` {"peers": [[peer id bytes, [addr...]]...],
                                   "results": [[[peer index...], [record...]]...][, "rec": True | False | "error"]}
  one result per id: the peers closest to it that the node knows (indices into "peers"), and
  the records it holds for that key (only when "values" is true). With "stop" (the asker stops
  at the first value, Kademlia's FIND_VALUE), a node that holds records sends them instead of peers.
  "rec" is the asker's own peer record, sent along the lookup of its own id when it joins: that
  lookup visits the record's replicas (it sits at the asker's id), so storing it costs no extra
  calls; the answer says, as for a store, whether the node holds it;
- `dht.store` `StoreRequest` {"records": [record...]}      -> `StoreResponse` {"results": [True | False | "error"...]}
  one result per record: held, refused by the later-expiration rule, or why it was refused.
A record is `Record.to_wire()`.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

import msgpack

from potluck.core.errors import AddressError, IdentityError, MalformedMessage, SerializationError
from potluck.core.serialization import unpackb_bounded
from potluck.core.wire import Bool, Field, Int, List, Message, Nested, Raw
from potluck.dht.errors import BadRequest
from potluck.dht.records import Record
from potluck.dht.routing import ID_BYTES, node_id_of
from potluck.net.address import Multiaddr
from potluck.net.identity import PeerID
from potluck.net.transport import MAX_ADDRESSES_PER_PEER

PING = "dht.ping"
FIND = "dht.find"
STORE = "dht.store"

# Ids per find request: with at most 1 MiB of records per key (storage.DEFAULT_MAX_KEY_BYTES)
# an answer stays far below the 64 MiB frame limit.
MAX_FIND_IDS = 32
# Peers one answer may name per id; k rarely exceeds 20, and more only costs the sender.
MAX_PEERS_PER_ID = 64
# Distinct peers one find answer may describe (MAX_FIND_IDS * a bucket, with headroom).
MAX_PEERS_PER_ANSWER = 1024
# Records per store request: 256 values of 64 KiB are 16 MiB, well below the frame limit.
MAX_STORE_RECORDS = 256
# Records one find answer may carry for one key (a dictionary of many subkeys).
MAX_RECORDS_PER_KEY = 16_384

# Peers (with their addresses) remembered parsed, per process: answers name the same peers again and
# again, and parsing one takes ~10 us. An entry is ~300 bytes for a peer with one address (2.5 MiB
# in all) and at most ~20 KB (MAX_ADDRESSES_PER_PEER addresses of MAX_ADDRESS_CHARS): 160 MiB, what
# the per-address cache this replaced could be made to hold. An emulated swarm of more peers in one
# process parses some again.
NEAR_PEERS_CACHED = 8192

M = TypeVar("M", bound=Message)
# A peer a find answer names: its id, node id and addresses (a plain tuple: an answer names dozens).
NearPeer = tuple[PeerID, int, tuple[Multiaddr, ...]]


def encode(message: Any) -> bytes:
    return msgpack.packb(message, use_bin_type=True)


def decode(blob: object, what: str) -> Any:
    """The message inside a blob; BadRequest if it is not one."""
    if not isinstance(blob, bytes):
        raise BadRequest(f"a DHT {what} is one msgpack blob (bytes), got {type(blob).__name__}")
    try:
        # Within the decoding budget: a 16 MiB store of nested empty arrays built 16 M lists
        # (5 s of CPU, ~1 GB) inside the handler before any field was checked.
        return unpackb_bounded(blob, raw=False, strict_map_key=False)
    except SerializationError as e:
        raise BadRequest(f"a DHT {what} is refused: {e}") from None
    except (ValueError, TypeError, OverflowError, msgpack.UnpackException) as e:
        raise BadRequest(f"a DHT {what} is not valid msgpack: {e}") from None


def write(message: Message) -> bytes:
    """The blob of a message."""
    return msgpack.packb(message.to_wire(), use_bin_type=True)


def read(kind: type[M], blob: object, **context: Any) -> M:
    """The `kind` message inside a blob, every field checked (`context`: its bounds, e.g. how many
    ids were asked); BadRequest names the first flaw."""
    message = decode(blob, kind.WHAT)
    try:
        return kind.from_wire(message, **context) if context else kind.from_wire(message)
    except MalformedMessage as e:
        raise BadRequest(str(e)) from None


@functools.lru_cache(maxsize=NEAR_PEERS_CACHED)
def _near_peer(raw: bytes, *addresses: str) -> NearPeer:
    """A peer an answer names, parsed once: answers name the same peers over and over."""
    peer_id = PeerID(raw)
    return peer_id, node_id_of(peer_id), tuple(map(Multiaddr.parse, addresses))


class NodeIdField(Field):
    """A 160-bit id (a key's or a node's), on the wire as its big-endian bytes; read as an int."""

    encodes = True

    def check(self, value: Any, key: str, what: str, context: Mapping[str, Any]) -> int:
        if value.__class__ is not bytes or len(value) != ID_BYTES:
            raise MalformedMessage(what, f"{key!r} must hold {ID_BYTES}-byte ids")
        return int.from_bytes(value, "big")

    def check_items(self, values: list, key: str, what: str, context: Mapping[str, Any]) -> tuple[int, ...]:
        ids = [int.from_bytes(v, "big") for v in values if v.__class__ is bytes and len(v) == ID_BYTES]
        return tuple(ids) if len(ids) == len(values) else super().check_items(values, key, what, context)

    def encode(self, value: int) -> bytes:
        return value.to_bytes(ID_BYTES, "big")

    def encode_items(self, values: Sequence[int]) -> list[bytes]:
        return [v.to_bytes(ID_BYTES, "big") for v in values]


class NearPeersField(Field):
    """The peers a find answer names, each [peer id bytes, [address...]] on the wire (its first
    MAX_ADDRESSES_PER_PEER addresses are read); read as `NearPeer`s. One loop for the whole list,
    each entry parsed once per process: the hottest field of the DHT."""

    encodes = True

    def check(self, value: Any, key: str, what: str, context: Mapping[str, Any]) -> tuple[NearPeer, ...]:
        if value.__class__ is not list or len(value) > MAX_PEERS_PER_ANSWER:
            raise MalformedMessage(what, f"{key!r} must be a list of at most {MAX_PEERS_PER_ANSWER} items")
        peers: list[NearPeer] = []
        append = peers.append
        try:
            for item in value:
                if item.__class__ is not list or len(item) != 2:
                    raise TypeError("an entry is not a pair")
                raw, texts = item
                if raw.__class__ is not bytes or texts.__class__ is not list:
                    raise TypeError("an entry is not [bytes, list]")
                if len(texts) > MAX_ADDRESSES_PER_PEER:
                    texts = texts[:MAX_ADDRESSES_PER_PEER]
                append(_near_peer(raw, *texts))
        except (IdentityError, AddressError, TypeError) as e:
            raise MalformedMessage(what, f"{key!r} entries must be [peer id bytes, [address...]]: {e}") from None
        return tuple(peers)

    def inline(self, v: str, names: dict[str, Any]) -> tuple[str, list[str]]:
        return f"{v}.__class__ is list and not {v}", [f"{v} = ()"]  # (an answer that found records)

    def encode(self, value: Any) -> list:
        return [[peer_id.to_bytes(), [str(a) for a in addresses]] for peer_id, _, addresses in value]

    def encoder(self, expr: str, names: dict[str, Any]) -> str:
        return f"[[p.to_bytes(), [str(a) for a in addresses]] for p, _, addresses in {expr}]"


def _outcome(key: str | None = None, **options: Any) -> Raw:
    """What a node says of a record it was given: True (held), False (a later one is), or why it
    refused it."""
    return Raw(key, kind=(bool, str), kind_name="True, False or why a record was refused", **options)


class Ping(Message, what="ping", exact=True):
    """Are you there? (an empty map)"""


class Pong(Message, what="ping answer"):
    """Here ({"ok": True})."""

    ok: bool = Bool()


class FindRequest(Message, what="find request"):
    """Who is near these ids (and, with `values`, what do you hold under them)? See the module
    docstring for `stop` and `own_record`."""

    ids: tuple[int, ...] = List("ids", NodeIdField(), MAX_FIND_IDS)
    values: bool = Bool()
    stop: bool = Bool()
    own_record: Record | None = Nested("rec", Record, default=None)

    def __post_init__(self) -> None:
        # One id asked 32 times drew its records 32 times: a request of 726 bytes got an answer of
        # 30 MB (a lookup asks each id once).
        if len(set(self.ids)) != len(self.ids):
            raise self.refuse("'ids' must not ask for an id twice")


class FindResult(Message, what="find result", positional=True):
    """One asked id's part of a find answer: indices into the answer's peers, and records."""

    nearest: tuple[int, ...] = List(item=Int(None, 0, MAX_PEERS_PER_ANSWER), max_items=MAX_PEERS_PER_ID)
    records: tuple[Record, ...] = List(item=Nested(None, Record), max_items=MAX_RECORDS_PER_KEY)


class FindResponse(Message, what="find response"):
    """`from_wire(msg, n_ids=<ids asked>)`: one result per id."""

    peers: tuple[NearPeer, ...] = NearPeersField()
    results: tuple[FindResult, ...] = List(item=Nested(None, FindResult), length="n_ids")
    held: bool | str | None = _outcome("rec", default=None)

    def validate(self, context: Mapping[str, Any]) -> None:
        named = len(self.peers)
        for result in self.results:
            if result.nearest and max(result.nearest) >= named:
                raise self.refuse("'results' must name peers that 'peers' holds")


class StoreRequest(Message, what="store request"):
    """Hold these records."""

    records: tuple[Record, ...] = List(item=Nested(None, Record), max_items=MAX_STORE_RECORDS)


class StoreResponse(Message, what="store response"):
    """`from_wire(msg, n_records=<records sent>)`: one outcome per record."""

    results: tuple[bool | str, ...] = List(item=_outcome(), length="n_records")


PING_REQUEST = write(Ping())
PING_RESPONSE = write(Pong(ok=True))
