"""Relays through the DHT: public relays announce themselves, NATed peers reserve on a few.

A relay (`potluck peer --relay`: a public peer running `net.relay.RelayService`) stores an entry
under RELAYS_KEY with its own subkey, signed by itself (`own_subkey`), so nobody can announce for
another peer or remove its entry; the value lists its addresses, vouched by that signature.

A peer the reachability check found private keeps up to WANTED_RELAYS reservations
(`RelayReservations`): it reads the announced relays, reserves on some (`net.relay.reserve`),
sets its circuit addresses (`transport.set_relayed_addresses`, which makes the DHT republish its
peer record at once), renews each reservation halfway to its expiry, and when a relay's
connection is lost (`transport.watch_disconnects`) drops its addresses and reserves elsewhere.
A later re-check that finds the peer public releases them all (`release`).

Anyone can announce relays (an entry costs one made-up id), and a relay can grant and renew a
reservation yet never forward a hop: each dial to us then waits out its circuit address first, and
with all our relays such, nobody reaches us. So, as the reachability check picks its servers
(`net.reachability.spread_by_origin`), a search tries relays spread over network origins: one of
each subnet (`net.origins`) we hold no reservation on, before a second of any. A relay's subnet
is that of its live connection if we have one, else of its announced address; an announcement
that names another subnet than the connection then comes from is found out once we reserve, and
that relay is passed over while relays of other subnets are left to try. Many relay ids of one
host then hold at most one of our slots (a swarm whose relays share one subnet, e.g. a test on
one machine, still reserves on WANTED_RELAYS of them).
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections import Counter

from potluck.core import compat, names
from potluck.core.bounded import drop_oldest
from potluck.core.errors import MalformedMessage, NetworkError
from potluck.dht import DHT, DHTError, own_subkey, owned_entries
from potluck.net.address import Multiaddr
from potluck.net.identity import PeerID
from potluck.net.origins import UNKNOWN_ORIGIN, origin_of, rounds_by_subnet
from potluck.net.relay import Reservation, release, reserve
from potluck.net.transport import Transport
from potluck.net.wire import addresses_to_wire, addresses_value

__all__ = ["RELAYS_KEY", "RelayAnnouncer", "RelayReservations", "read_relays"]

logger = logging.getLogger(__name__)

# The DHT key every peer knows: one owner-signed entry per relay.
RELAYS_KEY = names.RELAYS
# A relay's entry lives this long and is re-stored every third of it: a dead relay drops out of
# the list within minutes, and a live one costs one DHT store every few minutes.
RELAY_ENTRY_TTL = 600.0
# Reservations a NATed peer holds: two, so that when one relay dies the other still carries its
# connections while a replacement is found (libp2p's AutoRelay also defaults to a few).
WANTED_RELAYS = 2
# Relays tried per search (spread over subnets, see the module docstring): bounds the dials one
# search costs when many are announced or many refuse (full, or dead with their entry not yet
# expired).
MAX_TRIED_PER_SEARCH = 8
# A relay that refused, did not answer, or was passed over (on a subnet we hold a relay on) is not
# tried again for this long: the next searches try others first.
RELAY_RETRY_SECONDS = 60.0
# With fewer reservations than wanted, search again this often (new relays may have appeared).
SEARCH_INTERVAL = 30.0
# Each reservation is renewed once this fraction of its life is left (never closer to the end
# than RENEW_MARGIN): time for a retry or two if the relay is slow.
RENEW_AT_FRACTION = 0.5
RENEW_MARGIN = 10.0
# Deadline of one reservation call and of reading the relay list.
RESERVE_TIMEOUT = 10.0
READ_TIMEOUT = 10.0
# Relays remembered as having failed recently (the oldest are forgotten first).
MAX_FAILED_REMEMBERED = 256


async def read_relays(dht: DHT, exclude: PeerID | None = None,
                      timeout: float = READ_TIMEOUT) -> dict[PeerID, tuple[Multiaddr, ...]]:
    """The announced relays and their addresses (entries not signed by their relay are skipped)."""
    try:
        async with compat.timeout(timeout):
            found = await dht.aget(RELAYS_KEY, latest=True)
    except (TimeoutError, NetworkError, DHTError) as e:
        logger.debug("could not read the relay list: %s", e)
        return {}
    relays: dict[PeerID, tuple[Multiaddr, ...]] = {}
    for owner, value in owned_entries(found):
        if owner == exclude:
            continue
        try:
            texts = addresses_value(value, "addrs", "relay entry")
        except MalformedMessage:
            continue
        relays[owner] = tuple(Multiaddr.parse(t) for t in texts)
    return relays


class RelayAnnouncer:
    """Keeps this relay's entry under RELAYS_KEY while it is public (a relay must be dialable)."""

    def __init__(self, transport: Transport, dht: DHT):
        self.transport, self.dht = transport, dht
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        """Announce now (so peers starting next find this relay), then every third of the TTL."""
        await self.announce()
        self._task = asyncio.ensure_future(self._run())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def announce(self) -> bool:
        addresses = [a for a in self.transport.addresses if not a.is_circuit]
        if self.transport.reachability != "public" or not addresses:
            return False
        try:
            return await self.dht.astore(RELAYS_KEY, list(addresses_to_wire(addresses)),
                                         self.dht.get_time() + RELAY_ENTRY_TTL,
                                         subkey=own_subkey(self.transport.peer_id))
        except (NetworkError, DHTError) as e:
            logger.warning("could not announce this relay: %s", e)
            return False

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(RELAY_ENTRY_TTL / 3)
            await self.announce()


class RelayReservations:
    """Holds up to `wanted` relay reservations for a NATed peer (see the module docstring)."""

    def __init__(self, transport: Transport, dht: DHT, wanted: int = WANTED_RELAYS):
        self.transport, self.dht, self.wanted = transport, dht, wanted
        self.held: dict[PeerID, Reservation] = {}
        self._renew_at: dict[PeerID, float] = {}  # relay -> loop time to renew its reservation
        self._failed: dict[PeerID, float] = {}  # relay -> loop time until which it is not tried
        self._wake = asyncio.Event()
        self._first = asyncio.Event()  # set once a reservation is held (or a search came up empty)
        self._rng = random.Random(transport.peer_id.to_bytes())
        self._task: asyncio.Task | None = None

    @property
    def relays(self) -> list[PeerID]:
        return list(self.held)

    def start(self) -> None:
        self.transport.watch_disconnects(self._disconnected)
        self._task = asyncio.ensure_future(self._run())

    async def wait_first(self, timeout: float) -> bool:
        """Wait (at most `timeout`) for the first search to end; whether a relay is held."""
        try:
            async with compat.timeout(timeout):
                await self._first.wait()
        except TimeoutError:
            pass
        return bool(self.held)

    async def close(self) -> None:
        self.transport.unwatch_disconnects(self._disconnected)
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def release(self) -> None:
        """Stop and give up every reservation: this peer turned out public, others dial it directly
        (the relays stop piping to us; a slot ends with its connection or at its expiry)."""
        await self.close()
        for relay in list(self.held):
            self._drop(relay)

    def _disconnected(self, peer: PeerID) -> None:
        if peer in self.held:
            logger.info("lost relay %s; looking for another", peer)
            self._drop(peer)
            self._wake.set()

    def _drop(self, relay: PeerID) -> None:
        self.held.pop(relay, None)
        self._renew_at.pop(relay, None)
        release(self.transport, relay)
        self._publish()

    def _publish(self) -> None:
        self.transport.set_relayed_addresses([a for r in self.held.values() for a in r.addresses])

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            self._wake.clear()
            await self._renew_due(loop.time())
            if len(self.held) < self.wanted:
                await self._search()
            self._first.set()
            await self._sleep(self._next_wake(loop.time()))

    async def _sleep(self, seconds: float) -> None:
        try:
            async with compat.timeout(seconds):
                await self._wake.wait()
        except TimeoutError:
            pass

    def _hold(self, reservation: Reservation) -> None:
        now = asyncio.get_running_loop().time()
        left = reservation.expires - now
        self.held[reservation.relay] = reservation
        self._renew_at[reservation.relay] = reservation.expires - max(RENEW_MARGIN, RENEW_AT_FRACTION * left)
        self._publish()

    def _next_wake(self, now: float) -> float:
        """Seconds until the next renewal, or the next search while short of relays."""
        wake = min(self._renew_at.values(), default=now + SEARCH_INTERVAL)
        if len(self.held) < self.wanted:
            wake = min(wake, now + SEARCH_INTERVAL)
        return max(1.0, wake - now)

    async def _renew_due(self, now: float) -> None:
        for relay in [r for r, at in self._renew_at.items() if at <= now]:
            try:
                self._hold(await reserve(self.transport, relay, RESERVE_TIMEOUT))
            except (NetworkError, MalformedMessage) as e:
                logger.info("relay %s did not renew our reservation (%s); looking for another", relay, e)
                self._failed_now(relay)
                self._drop(relay)

    async def _search(self) -> None:
        loop = asyncio.get_running_loop()
        candidates = await read_relays(self.dht, exclude=self.transport.peer_id)
        now = loop.time()
        fresh = [r for r in candidates if r not in self.held and self._failed.get(r, 0.0) <= now]
        self._rng.shuffle(fresh)  # which relay of a subnet comes first
        order = self._spread(fresh, candidates)
        for i, relay in enumerate(order[:MAX_TRIED_PER_SEARCH]):
            if len(self.held) >= self.wanted:
                break
            self.transport.add_addresses(relay, candidates[relay])
            try:
                reservation = await reserve(self.transport, relay, RESERVE_TIMEOUT)
            except (NetworkError, MalformedMessage) as e:
                logger.debug("relay %s: no reservation (%s)", relay, e)
                self._failed_now(relay)
                continue
            held = set(self._held_subnets())
            if (self.transport.peer_origin(relay).subnet in held
                    and any(self._subnet(r, candidates[r]) not in held for r in order[i + 1:])):
                # A second relay on a subnet we hold (its announcement may have said otherwise)
                # while relays of other subnets are left to try (in this search or the next): one
                # host must not hold both slots.
                logger.info("relay %s is on the subnet of a relay we hold; trying another", relay)
                release(self.transport, relay)
                self._failed_now(relay)
                continue
            logger.info("reserved a slot on relay %s", relay)
            self._hold(reservation)

    def _subnet(self, relay: PeerID, announced: tuple[Multiaddr, ...]) -> str:
        """Where `relay` is: its live connection's subnet if we have one (where its bytes really
        come from), else its first announced IP (or emulated) address's (what it claims)."""
        if self.transport.is_connected_directly(relay):
            return self.transport.peer_origin(relay).subnet
        first = next((a for a in announced if a.kind in ("ip4", "ip6", "emu")), None)
        return (UNKNOWN_ORIGIN if first is None else origin_of(first)).subnet

    def _held_subnets(self) -> list[str]:
        """The subnet of each relay we hold (from its live connection)."""
        return [self.transport.peer_origin(r).subnet for r in self.held]

    def _spread(self, relays: list[PeerID], candidates: dict[PeerID, tuple[Multiaddr, ...]]) -> list[PeerID]:
        """`relays` in the order to try: round robin over subnets, counting the relays we hold (so
        subnets we hold none on come first), each round in random order: however many ids one
        subnet announces, it gets one place in a round."""
        rounds = rounds_by_subnet(relays, lambda r: self._subnet(r, candidates[r]), Counter(self._held_subnets()))
        for r in rounds:
            self._rng.shuffle(r)
        return [relay for r in rounds for relay in r]

    def _failed_now(self, relay: PeerID) -> None:
        self._failed.pop(relay, None)
        self._failed[relay] = asyncio.get_running_loop().time() + RELAY_RETRY_SECONDS
        drop_oldest(self._failed, MAX_FAILED_REMEMBERED)
