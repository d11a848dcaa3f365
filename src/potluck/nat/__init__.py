"""`potluck.nat`: serving from behind NAT. Relays announce themselves in the DHT; a peer found
private by the reachability check (`net.reachability`) reserves slots on a few of them and
publishes circuit addresses (`relays`). Imports from `potluck.core`, `potluck.net` and `potluck.dht`.
"""

from potluck.nat.relays import RELAYS_KEY, RelayAnnouncer, RelayReservations

__all__ = ["RELAYS_KEY", "RelayAnnouncer", "RelayReservations"]
