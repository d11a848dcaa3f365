"""Members that lapsed as senders: who cost a group of ours a step's time, remembered for a while.

A member takes a seat in a group and then never sends its pieces, stalls past the sender timeout,
or trickles them until the reducers leave it out (`allreduce.reducer`, STRAGGLER_FACTOR): the
step is cut short of the timeout now, but without a memory the same member (or another id of its
subnet) takes a seat again the next round, and every round pays. So a reducer's lapses are
recorded per peer id and per subnet, and this peer's gatherings do not seat them for a while
(`Matchmaker`): `FIRST_HOLD_SECONDS` after a first lapse, doubling with each lapse while held, up
to `MAX_HOLD_SECONDS`. An honest member that crashed once costs its subnet a minute of our seats;
a subnet that lapses again and again is held for an hour. Peers on our own network (loopback,
private addresses) are exempt, as from every other per-subnet rule of matchmaking: a lab or a test
swarm on one host is one subnet. Ids are free, so the subnet is what counts; the id alone is held
too, for a peer that moves, and alone for a peer met through a relay (the relay's peers are not
one party).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from potluck.core.bounded import drop_oldest
from potluck.net.identity import PeerID
from potluck.net.origins import UNKNOWN_ORIGIN, outside_subnet

__all__ = ["FIRST_HOLD_SECONDS", "MAX_HOLD_SECONDS", "MAX_LAPSED", "Lapses", "lapses"]

logger = logging.getLogger(__name__)

# How long a first lapse keeps a peer and its subnet out of our gatherings: a few rounds, so an
# honest member that crashed once costs little, while every lapse during a hold doubles it.
FIRST_HOLD_SECONDS = 60.0
# The longest hold (as HELD_LEADER_SECONDS for leaders): a subnet then costs a step an hour.
MAX_HOLD_SECONDS = 3600.0
# Peer ids and subnets remembered (each a short string and two floats).
MAX_LAPSED = 1024


class Lapses:
    """Peers (and subnets) held out of this peer's gatherings for lapsing as senders."""

    def __init__(self, cap: int = MAX_LAPSED):
        self.cap = cap
        self._held: dict[str, tuple[float, float]] = {}  # "id:<peer>" / "subnet:<s>" -> (until, hold)

    def note(self, peer: PeerID, origin: Any, why: str) -> None:
        """`peer` (seen at `origin`) lapsed as a sender in a step of ours, `why`."""
        subnet = outside_subnet(origin)
        if subnet is None:
            return  # our own network: see the module docstring
        now = asyncio.get_running_loop().time()
        longest = 0.0
        # Its id alone where we never met it (an unknown origin is nobody's subnet) or met it
        # through a relay (which carries many unrelated peers).
        alone = origin == UNKNOWN_ORIGIN or origin.is_relayed
        for key in (f"id:{peer}",) + (() if alone else (f"subnet:{subnet}",)):
            until, hold = self._held.pop(key, (0.0, 0.0))
            hold = min(MAX_HOLD_SECONDS, 2 * hold) if until > now else FIRST_HOLD_SECONDS
            self._held[key] = (now + hold, hold)
            longest = max(longest, hold)
        drop_oldest(self._held, self.cap)
        logger.warning("member %s (%s) %s; not seating it or its subnet for %.0f s", peer, subnet, why, longest)

    def held(self, peer: PeerID, origin: Any) -> float:
        """Seconds until `peer`, joining from `origin`, may take a seat again (0: it may now)."""
        subnet = outside_subnet(origin)
        if subnet is None:
            return 0.0
        now = asyncio.get_running_loop().time()
        keys = (f"id:{peer}", f"subnet:{subnet}")
        return max(0.0, *(self._held.get(key, (0.0, 0.0))[0] - now for key in keys))


def lapses(transport: Any) -> Lapses:
    """The lapses record of the peer behind `transport` (one per transport, like its ban list)."""
    record = transport.services.get("lapses")
    if record is None:
        record = transport.services["lapses"] = Lapses()
    return record
