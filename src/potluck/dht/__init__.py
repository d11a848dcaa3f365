"""`potluck.dht`: the Kademlia DHT every other part uses to find peers, experts, groups and progress.

Owns the routing table (`routing`), local record storage with expiration and subkeys (`storage`),
record rules: limits, owner signatures and schemas (`validation`), the lookup state machine
(`lookup`), the wire messages (`protocol`), the node that drives them over a transport (`node`),
each peer's signed address record and its lookup for the transport (`peer_records`) and the
user-facing `DHT` (`dht`). Imports only from `potluck.core` and `potluck.net`.
"""

from potluck.core.dht_time import event_loop_clock, get_dht_time
from potluck.dht.dht import DHT
from potluck.dht.errors import BadRequest, DHTError, ExpirationTooFar, NotOwner, RecordRejected, ValueTooLarge
from potluck.dht.node import DHTConfig, DHTNode
from potluck.dht.peer_records import peer_record_key
from potluck.dht.records import (
    Record,
    ValueWithExpiration,
    key_id_of,
    own_subkey,
    owned_entries,
    owner_marker,
    subkey_owner,
)
from potluck.dht.validation import RecordValidator, SchemaValidator

__all__ = [
    "DHT", "BadRequest", "DHTConfig", "DHTError", "DHTNode", "ExpirationTooFar", "NotOwner", "Record",
    "RecordRejected", "RecordValidator", "SchemaValidator", "ValueTooLarge", "ValueWithExpiration",
    "event_loop_clock", "get_dht_time", "key_id_of", "own_subkey", "owned_entries", "owner_marker", "peer_record_key",
    "subkey_owner",
]
