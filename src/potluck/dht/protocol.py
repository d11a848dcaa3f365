"""The DHT's RPC messages: building them, and parsing what arrives with every field checked.

Each request and response travels as one msgpack blob (`bytes`): a find answer names hundreds of
small items, and msgpack's C codec handles them in one call. Messages (ids are 20-byte big-endian):
- `dht.ping`  {}                                   -> {"ok": True}
- `dht.find`  {"ids": [id...], "values": bool, "stop": bool[, "rec": record]}
                -> {"peers": [[peer id bytes, [addr...]]...], "results": [[[peer index...], [record...]]...]
                    [, "rec": True | False | "error"]}
  one result per id: the peers closest to it that the node knows (indices into "peers"), and
  the records it holds for that key (only when "values" is true). With "stop" (the asker stops
  at the first value, Kademlia's FIND_VALUE), a node that holds records sends them instead of peers.
  "rec" is the asker's own peer record, sent along the lookup of its own id when it joins: that
  lookup visits the record's replicas (it sits at the asker's id), so storing it costs no extra
  calls; the answer says, as for a store, whether the node holds it;
- `dht.store` {"records": [record...]}             -> {"results": [True | False | "error"...]}
  one result per record: held, refused by the later-expiration rule, or why it was refused.
A record is `Record.to_wire()`. A malformed request is answered with a `BadRequest` error.
"""

from __future__ import annotations

import functools
from typing import Any

import msgpack

from potluck.core.errors import AddressError, IdentityError, SerializationError
from potluck.core.serialization import unpackb_bounded
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


@functools.lru_cache(maxsize=65536)
def _peer(raw: bytes) -> tuple[PeerID, int]:
    """A peer id and its node id, parsed once: answers name the same peers over and over."""
    peer_id = PeerID(raw)
    return peer_id, node_id_of(peer_id)


@functools.lru_cache(maxsize=65536)
def _address(text: str) -> Multiaddr:
    """Parse an address; the same few thousand addresses recur in every answer."""
    return Multiaddr.parse(text)


def _id_bytes(value: object, what: str) -> int:
    if not isinstance(value, bytes) or len(value) != ID_BYTES:
        raise BadRequest(f"{what} must be a {ID_BYTES}-byte id")
    return int.from_bytes(value, "big")


def _field(message: object, name: str, kind: type | tuple[type, ...], what: str) -> Any:
    if not isinstance(message, dict):
        raise BadRequest(f"{what} must be a dict, got {type(message).__name__}")
    value = message.get(name)
    if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
        raise BadRequest(f"{what}[{name!r}] is missing or has the wrong type")
    return value


# -- find ---------------------------------------------------------------------------------------
def find_request(ids: list[int], values: bool, stop: bool = False, own_record: Record | None = None) -> bytes:
    message: dict[str, Any] = {"ids": [i.to_bytes(ID_BYTES, "big") for i in ids], "values": values, "stop": stop}
    if own_record is not None:
        message["rec"] = own_record.to_wire()
    return encode(message)


def parse_find_request(blob: object) -> tuple[list[int], bool, bool, Record | None]:
    """(ids, values, stop, the asker's own record or None) of a find request."""
    message = decode(blob, "find request")
    ids = _field(message, "ids", list, "find request")
    if len(ids) > MAX_FIND_IDS:
        raise BadRequest(f"a find request names at most {MAX_FIND_IDS} ids, got {len(ids)}")
    values = _field(message, "values", bool, "find request")
    stop = _field(message, "stop", bool, "find request")
    own = Record.from_wire(message["rec"]) if "rec" in message else None
    return [_id_bytes(i, "each id") for i in ids], values, stop, own


def find_response(peers: list[tuple[PeerID, list[Multiaddr]]], results: list[tuple[list[int], list[Record]]],
                  held: bool | str | None = None) -> bytes:
    message: dict[str, Any] = {
        "peers": [[p.to_bytes(), [str(a) for a in addrs]] for p, addrs in peers],
        "results": [[indices, [r.to_wire() for r in records]] for indices, records in results]}
    if held is not None:
        message["rec"] = held
    return encode(message)


NearPeer = tuple[PeerID, int, list[Multiaddr]]  # peer id, node id, addresses
FindResult = tuple[list[NearPeer], list[Record]]  # per asked id: nearest peers, records


def parse_find_response(blob: object, n_ids: int) -> tuple[list[FindResult], bool | str | None]:
    """Per asked id: (nearest peers as (peer id, node id, addresses), records); and whether the
    node holds the asker's own record, if one was sent (None if not). Raises BadRequest on any
    flaw; the caller treats that as a failed peer."""
    message = decode(blob, "find response")
    held = message.get("rec") if isinstance(message, dict) else None
    if held is not None and not isinstance(held, (bool, str)):
        raise BadRequest("find response: 'rec' is a bool or an error message")
    raw_peers = _field(message, "peers", list, "find response")
    results = _field(message, "results", list, "find response")
    if len(raw_peers) > MAX_PEERS_PER_ANSWER:
        raise BadRequest("find response names too many peers")
    if len(results) != n_ids:
        raise BadRequest(f"find response has {len(results)} results for {n_ids} ids")
    peers = []
    for item in raw_peers:
        if not isinstance(item, list) or len(item) != 2 or not isinstance(item[1], list):
            raise BadRequest("a peer entry is [peer id bytes, [address...]]")
        try:
            if not isinstance(item[0], bytes):
                raise BadRequest("a peer id is 32 bytes")
            peer_id, node_id = _peer(item[0])
            addrs = [_address(a) for a in item[1][:MAX_ADDRESSES_PER_PEER]]
        except (IdentityError, AddressError, TypeError) as e:
            raise BadRequest(f"bad peer entry: {e}") from None
        peers.append((peer_id, node_id, addrs))
    parsed = []
    for result in results:
        if not isinstance(result, list) or len(result) != 2:
            raise BadRequest("a find result is [[peer index...], [record...]]")
        indices, records = result
        if not isinstance(indices, list) or not isinstance(records, list):
            raise BadRequest("a find result is [[peer index...], [record...]]")
        if len(indices) > MAX_PEERS_PER_ID or len(records) > MAX_RECORDS_PER_KEY:
            raise BadRequest("find result too long")
        nearest = []
        for index in indices:
            if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < len(peers):
                raise BadRequest("peer index out of range")
            nearest.append(peers[index])
        parsed.append((nearest, [Record.from_wire(r) for r in records]))
    return parsed, held


# -- store --------------------------------------------------------------------------------------
def store_request(records: list[Record]) -> bytes:
    return encode({"records": [r.to_wire() for r in records]})


def store_response(results: list[bool | str]) -> bytes:
    return encode({"results": results})


def parse_store_request(blob: object) -> list[Record]:
    message = decode(blob, "store request")
    records = _field(message, "records", list, "store request")
    if len(records) > MAX_STORE_RECORDS:
        raise BadRequest(f"a store request carries at most {MAX_STORE_RECORDS} records, got {len(records)}")
    return [Record.from_wire(r) for r in records]


def parse_store_response(blob: object, n_records: int) -> list[bool | str]:
    message = decode(blob, "store response")
    results = _field(message, "results", list, "store response")
    if len(results) != n_records:
        raise BadRequest(f"store response has {len(results)} results for {n_records} records")
    for r in results:
        if not isinstance(r, (bool, str)):
            raise BadRequest("each store result is a bool or an error message")
    return results


PING_REQUEST = encode({})
PING_RESPONSE = encode({"ok": True})


def parse_ping(blob: object) -> None:
    if decode(blob, "ping") != {}:
        raise BadRequest("a ping carries an empty map")
