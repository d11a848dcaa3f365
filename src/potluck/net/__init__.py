"""Networking: peer identity, addresses, the wire format, connections and transports.

Imports only from `potluck.core`. Layers above use `Transport` (calls, streams, address book)
and cannot tell the real TCP/TLS transport from the emulated network. They name peers by id: a
dial to an id with no known address resolves the peer's signed `PeerRecord` through the resolver
the DHT registers.
"""

from potluck.net.address import Multiaddr
from potluck.net.connection import CallContext, Connection, Stream
from potluck.net.emulated import EmulatedNetwork, EmulatedTransport
from potluck.net.identity import Identity, PeerID
from potluck.net.peer_record import PeerRecord
from potluck.net.tcp import TCPTransport
from potluck.net.transport import Transport

__all__ = [
    "CallContext", "Connection", "EmulatedNetwork", "EmulatedTransport", "Identity", "Multiaddr", "PeerID",
    "PeerRecord", "Stream", "TCPTransport", "Transport",
]
