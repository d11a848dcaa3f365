"""Matchmaking: peers that want to average find each other through the DHT and form a group.

Every listening peer declares itself under the group key for one gathering window. The leader is
the declaration that expires first (ties: smallest peer id), i.e. the peer that started waiting
first; later arrivals cannot take its place. Others ask it to join with a long-poll call that
returns the finished group. A leader that discovers an earlier leader hands its followers over
and joins that one, so a key's peers end in one group whenever they can see each other. Peers in
client mode never lead (nobody can dial them); they only join.

A group meets again without the DHT: a member asks the leader of its last group directly, and a
leader whose caller knows that exactly that group's members take part (`members`) closes the
group as soon as they are back, with no declaration and no settling. A leader that is open to
newcomers turns its old members away, and they fall back to the DHT like everyone else; so does a
member whose leader does not gather in time. This saves the DHT's part of every epoch's
matchmaking in a stable swarm (most of a round on a fast network).

The leader closes the group when it reaches `target_group_size` or its window ends, decides the
load split (DeDLOC's linear program over the members' measured bandwidths) and the member order,
and answers every follower with the same `Group`. Fewer than `min_group_size` members: everyone
gets a clear failure.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
from dataclasses import dataclass, field
from typing import Any

from potluck.averaging.allreduce import MODES, Group
from potluck.averaging.load_balancing import optimal_fractions, part_sizes
from potluck.core import compat
from potluck.core.errors import AveragingError, MalformedMessage, NetworkError, PotluckError, detached
from potluck.net.identity import PeerID
from potluck.net.transport import Transport

logger = logging.getLogger(__name__)

METHOD_JOIN = "potluck.averaging.join"
# Part of the window spent letting declarations spread before the first read of the group key.
SETTLE_FRACTION = 0.05
# How often a waiting peer re-reads the group key (fraction of the window, with a floor).
POLL_FRACTION = 0.1
MIN_POLL_SECONDS = 0.05
# After the leader's window closes, followers wait this long for the group to be sent.
BEGIN_SLACK = 5.0
# Bounds on what a join request may carry (it comes from the network).
MAX_METADATA_BYTES = 16 * 1024
# Addresses kept per member from a group message.
MAX_ADDRESSES = 8
# A leader refuses groups larger than this whatever a follower asks (protects its memory/CPU).
MAX_GROUP_SIZE = 1024
# A returning member may ask before its leader has started gathering under the key; the leader
# holds such a request this long at most (only members of its last group can ask: at most
# MAX_GROUP_SIZE waiters, each a few hundred bytes).
REJOIN_WAIT = 5.0
# A returning member asks to be held for this part of its window; a leader that has not started
# gathering by then is late or gone, and the member uses the DHT in the rest of the window.
REJOIN_FRACTION = 0.5
# Longest group key a join request may name (ours are a prefix, an epoch and a grid cell).
MAX_KEY_CHARS = 512


@dataclass(frozen=True)
class FormedGroup:
    """A group as every member receives it: the all-reduce plan plus everyone's metadata."""

    group: Group
    metadata: tuple[Any, ...]
    addresses: tuple[tuple[str, ...], ...]  # how to reach each member (empty for client mode)


@dataclass(frozen=True)
class Candidate:
    """A peer in a gathering: who, in which role, its bandwidths (bytes/s, for the load split),
    what it shares with the group, and how to reach it."""

    peer_id: PeerID
    role: str
    upload: float
    download: float
    metadata: Any
    addresses: tuple[str, ...]


@dataclass(frozen=True)
class JoinRequest:
    """Asks a leader to take us into its gathering under `key` (`again`: a member of its last
    group rejoining, and how long it may be held before the leader gathers)."""

    key: str
    schema: str
    role: str
    upload: float
    download: float
    metadata: Any = None
    again: float | None = None

    def to_wire(self) -> dict:
        wire = {"key": self.key, "schema": self.schema, "mode": self.role, "bw": [self.upload, self.download],
                "meta": self.metadata}
        if self.again is not None:
            wire["again"] = self.again
        return wire

    @classmethod
    def from_wire(cls, msg: Any) -> JoinRequest:
        what = "join request"
        if not isinstance(msg, dict):
            raise MalformedMessage(what, "not a map")
        key, schema, role = msg.get("key"), msg.get("schema"), msg.get("mode")
        bw, again = msg.get("bw"), msg.get("again")
        if not isinstance(key, str) or len(key) > MAX_KEY_CHARS:
            raise MalformedMessage(what, f"'key' must be a string of at most {MAX_KEY_CHARS} characters")
        if not isinstance(schema, str):
            raise MalformedMessage(what, "'schema' must be a string")
        if role not in MODES:
            raise MalformedMessage(what, f"'mode' must be one of {list(MODES)}")
        if not (isinstance(bw, list) and len(bw) == 2 and all(
                isinstance(b, (int, float)) and not isinstance(b, bool) and 0 < b < math.inf for b in bw)):
            raise MalformedMessage(what, "'bw' must be [upload, download], positive finite numbers")
        if again is not None and not (isinstance(again, (int, float)) and not isinstance(again, bool)
                                      and 0 <= again < math.inf):
            raise MalformedMessage(what, "'again' must be a non-negative number of seconds")
        return cls(key, schema, role, float(bw[0]), float(bw[1]), msg.get("meta"),
                   None if again is None else float(again))


@dataclass
class _Gathering:
    key: str
    schema: str
    target: int
    closes_at: float
    members: list[Candidate] = field(default_factory=list)
    # The group formed, or why none was: a result, never an exception (raised from a future,
    # a stored error would tie its traceback's frames, which hold this gathering, to it: a cycle).
    done: asyncio.Future[FormedGroup | str] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future())
    ready: asyncio.Future | None = None  # the owner's own check; nobody joins before it passes
    keep: bool = False  # the last group meets again, without the DHT (see the module docstring)
    settled: asyncio.Event = field(default_factory=asyncio.Event)  # set while not joining someone

    def __post_init__(self) -> None:
        self.settled.set()

    @property
    def full(self) -> bool:
        return len(self.members) >= self.target


class Matchmaker:
    """Forms groups for one averager (one prefix) on one peer."""

    def __init__(self, transport: Transport, dht: Any, prefix: str, schema: str, total: int, mode: str = "node",
                 target_group_size: int | None = None, min_group_size: int = 2):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}")
        self.transport = transport
        self.dht = dht
        self.prefix = prefix
        self.schema = schema
        self.total = total  # elements averaged: equal for every member, since schemas match
        self.mode = mode
        self.client = mode == "client" or transport.client_mode
        self.target = min(target_group_size or MAX_GROUP_SIZE, MAX_GROUP_SIZE)
        self.min_group_size = min_group_size
        self._gatherings: dict[str, _Gathering] = {}
        self._opened = asyncio.Event()  # set (and replaced) whenever a gathering starts
        self.leader: PeerID | None = None  # of the last group we were in (ourselves if we led it)
        self._last_members: frozenset[PeerID] = frozenset()  # of the last group we led
        transport.add_handler(f"{METHOD_JOIN}.{prefix}", self._on_join)

    def close(self) -> None:
        self.transport.remove_handler(f"{METHOD_JOIN}.{self.prefix}")
        for gathering in self._gatherings.values():
            if not gathering.done.done():
                gathering.done.set_result("averager shut down")

    def _dht_key(self, group_key: str) -> str:
        return f"{self.prefix}.match.{group_key}"

    async def form_group(self, group_key: str, window: float, bandwidth: tuple[float, float],
                         metadata: Any = None, target: int | None = None,
                         ready: asyncio.Future | None = None,
                         members: frozenset[PeerID] | None = None) -> FormedGroup:
        """Find peers under `group_key` within `window` seconds and return the group formed; a
        leader closes the group early once it has `target` members (default: the matchmaker's).

        `ready`, if given, is this peer's own preparation (e.g. checking its tensors), running
        meanwhile: no group is joined or formed, and nobody joins ours, until it succeeds; if it
        fails, its error is raised here and the peer takes part in no group.

        `members`: every peer that takes part, if the caller knows them: if they are the group
        we led last time, we wait for them only, without the DHT. Members of a last group always
        ask its leader first."""
        keep = members is not None and self.leader == self.transport.peer_id and not self.client \
            and members == self._last_members
        if keep:  # full once they are all back
            target = min(target or self.target, len(members))
        formed = await self._form(group_key, window, bandwidth, metadata, target, ready, keep)
        self.leader = formed.group.peers[0]
        self._last_members = frozenset(formed.group.peers) if self.leader == self.transport.peer_id else frozenset()
        return formed

    async def _form(self, group_key: str, window: float, bandwidth: tuple[float, float], metadata: Any,
                    target: int | None, ready: asyncio.Future | None, keep: bool) -> FormedGroup:
        loop = asyncio.get_running_loop()
        give_up = loop.time() + window + BEGIN_SLACK
        addresses = tuple(str(a) for a in self.transport.addresses)
        me = Candidate(self.transport.peer_id, "client" if self.client else self.mode, bandwidth[0], bandwidth[1],
                       metadata, addresses)
        leader = self.leader if self.leader != self.transport.peer_id else None
        if leader is not None:
            await _settle(0.0, ready)  # our own check first: a failing peer must not join
            rejoined = await self._rejoin(leader, group_key, me, window * REJOIN_FRACTION, give_up)
            if rejoined is not None:
                return rejoined
        gathering: _Gathering | None = None
        if not self.client:
            closes_at = self.dht.get_time() + window
            size = min(target or self.target, MAX_GROUP_SIZE)
            gathering = _Gathering(group_key, self.schema, size, closes_at, [me], ready=ready, keep=keep)
            self._gatherings[group_key] = gathering
            opened, self._opened = self._opened, asyncio.Event()
            opened.set()
            if keep:
                return await self._keep(gathering, ready, give_up)
            await self.dht.astore(self._dht_key(group_key), {"schema": self.schema, "addrs": list(addresses)},
                                  closes_at, subkey=str(self.transport.peer_id))
        try:
            tried: set[PeerID] = set()
            poll = max(MIN_POLL_SECONDS, window * POLL_FRACTION)
            # Peers of one round start at about the same time; let their declarations land in the
            # DHT before choosing a leader, or everyone sees only themselves and the key splinters.
            await _settle(window * SETTLE_FRACTION, ready)
            while loop.time() < give_up:
                if gathering is not None:
                    if gathering.done.done():
                        return _formed(gathering)
                    if gathering.full or self.dht.get_time() >= gathering.closes_at:
                        return self._close(gathering)
                if gathering is None or len(gathering.members) == 1:
                    for leader in await self._earlier_peers(group_key):
                        if leader in tried or (gathering is not None and len(gathering.members) > 1):
                            continue
                        joined = await self._join_holding(gathering, leader, group_key, me, give_up, tried)
                        if joined is not None:
                            return joined
                        tried.add(leader)
                if gathering is not None:
                    try:
                        async with compat.timeout(poll):
                            await asyncio.shield(gathering.done)
                    except TimeoutError:
                        pass
                else:
                    tried.clear()  # a client keeps trying every leader until the deadline
                    await asyncio.sleep(poll)
            raise AveragingError(f"no group formed under {group_key!r} in time")
        finally:
            if gathering is not None:
                self._gatherings.pop(group_key, None)
                if not gathering.done.done():
                    gathering.done.set_result("the leader gave up")
                gathering.settled.set()

    async def _rejoin(self, leader: PeerID, group_key: str, me: tuple, wait: float,
                      give_up: float) -> FormedGroup | None:
        """Ask our last leader to take us again (it may hold us `wait` seconds before it gathers);
        None if it will not (it is open to newcomers, late, or gone): then we use the DHT."""
        try:
            return await self._join(leader, group_key, me, give_up, set(), rejoin_wait=wait)
        except AveragingError as e:
            logger.debug("rejoining %s failed: %s", leader, e)
            return None
        finally:
            self.leader = None  # asked once; it is set again by the group we end up in

    async def _keep(self, gathering: _Gathering, ready: asyncio.Future | None, give_up: float) -> FormedGroup:
        """Lead the last group again: close it once its members are back or the window ends."""
        loop = asyncio.get_running_loop()
        try:
            await _settle(0.0, ready)
            left = gathering.closes_at - self.dht.get_time()
            if not gathering.full and left > 0:
                with contextlib.suppress(TimeoutError):
                    async with compat.timeout(min(left, max(0.0, give_up - loop.time()))):
                        await asyncio.shield(gathering.done)
            return self._close(gathering)
        finally:
            self._gatherings.pop(gathering.key, None)
            if not gathering.done.done():
                gathering.done.set_result("the leader gave up")

    async def _gathering_for(self, key: str, wait: float) -> _Gathering | None:
        """Our gathering under `key`, waiting up to `wait` seconds for it to start."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait
        while (gathering := self._gatherings.get(key)) is None:
            left = deadline - loop.time()
            if left <= 0:
                return None
            with contextlib.suppress(TimeoutError):
                async with compat.timeout(left):
                    await self._opened.wait()
        return gathering

    async def _join_holding(self, gathering: _Gathering | None, leader: PeerID, group_key: str, me: tuple,
                            give_up: float, tried: set[PeerID]) -> FormedGroup | None:
        """Try to join `leader`; meanwhile requests to join us wait for the outcome."""
        if gathering is not None:
            gathering.settled.clear()
        joined = None
        try:
            joined = await self._join(leader, group_key, me, give_up, tried)
        finally:
            if gathering is not None:
                if joined is not None and not gathering.done.done():
                    gathering.done.set_result(joined)  # we are in that group now: waiters are refused
                gathering.settled.set()
        return joined

    async def _earlier_peers(self, group_key: str) -> list[PeerID]:
        """Peers declared under the key that are earlier than us, earliest first.

        Peers only ever join earlier peers, so waiting on one another can never form a cycle.
        """
        try:
            found = await self.dht.aget(self._dht_key(group_key), latest=True)
        except (NetworkError, PotluckError) as e:
            logger.debug("reading group key failed: %s", e)
            return []
        if found is None or not isinstance(found.value, dict):
            return []
        now = self.dht.get_time()
        mine = self._gatherings.get(group_key)
        me = None if mine is None else (mine.closes_at, self.transport.peer_id.to_bytes())
        candidates = []
        for subkey, entry in found.value.items():
            try:
                peer = PeerID.from_string(subkey)
            except (PotluckError, TypeError, ValueError):
                continue
            value = entry.value
            if entry.expiration_time <= now or peer == self.transport.peer_id or not isinstance(value, dict) \
                    or value.get("schema") != self.schema:
                continue
            order = (entry.expiration_time, peer.to_bytes())
            if me is not None and order >= me:
                continue  # later than us: it joins us, not the other way round
            try:
                self.transport.add_addresses(peer, [str(a) for a in list(value.get("addrs") or [])[:MAX_ADDRESSES]])
            except (PotluckError, TypeError, ValueError):
                continue
            candidates.append((order, peer))
        return [peer for _, peer in sorted(candidates, key=lambda c: c[0])]

    async def _join(self, leader: PeerID, group_key: str, me: Candidate, give_up: float,
                    tried: set[PeerID], rejoin_wait: float | None = None) -> FormedGroup | None:
        """Ask `leader` to take us; None if it refused (the caller tries another). A full group
        names its members, so we skip all of them at once."""
        request = JoinRequest(group_key, self.schema, me.role, me.upload, me.download, me.metadata,
                              again=rejoin_wait).to_wire()
        loop = asyncio.get_running_loop()
        try:
            reply = await self.transport.call(leader, f"{METHOD_JOIN}.{self.prefix}", request,
                                              timeout=max(0.1, give_up - loop.time()))
        except (NetworkError, PotluckError) as e:
            logger.debug("join %s failed: %s", leader, e)
            return None
        if isinstance(reply, dict) and "group" in reply:
            formed = _group_from_wire(reply["group"], self.transport.peer_id)
            for peer, addrs in zip(formed.group.peers, formed.addresses, strict=True):
                if peer != self.transport.peer_id:
                    self.transport.add_addresses(peer, addrs)
            return formed
        if isinstance(reply, dict) and isinstance(reply.get("taken"), list):
            for raw in reply["taken"][:MAX_GROUP_SIZE]:
                with contextlib.suppress(PotluckError, TypeError, ValueError):
                    tried.add(PeerID(raw))
        if isinstance(reply, dict) and "failed" in reply:
            raise AveragingError(f"group under {group_key!r} failed: {reply['failed']}")
        return None

    async def _on_join(self, request: Any, ctx: Any) -> dict:
        join = JoinRequest.from_wire(request)
        if join.again is not None and ctx.peer_id not in self._last_members:
            return {"refused": "not a member of our last group"}
        gathering = self._gatherings.get(join.key) if join.again is None else \
            await self._gathering_for(join.key, min(join.again, REJOIN_WAIT))
        if gathering is None:
            return {"refused": "not gathering a group under this key"}
        if join.again is not None and not gathering.keep:
            return {"refused": "open to newcomers: find the group through the DHT"}
        if join.schema != gathering.schema:
            return {"refused": "different tensor schema (shapes, dtypes or compression differ)"}
        # It cannot accept connections if it dialed us in client mode, whatever it says.
        role = "client" if ctx.remote.client_mode else join.role
        if gathering.ready is not None:
            try:
                await asyncio.shield(gathering.ready)
            except Exception:  # noqa: BLE001 - the owner failed its own check: it forms no group
                return {"refused": "this peer is not averaging this round"}
        await gathering.settled.wait()  # we may be joining an earlier peer ourselves right now
        if gathering.full or gathering.done.done():
            taken = [m.peer_id.to_bytes() for m in gathering.members]
            if gathering.done.done() and isinstance(gathering.done.result(), FormedGroup):
                taken = [p.to_bytes() for p in gathering.done.result().group.peers]
            return {"refused": "group is full or already formed", "taken": taken}
        if any(m.peer_id == ctx.peer_id for m in gathering.members):
            return {"refused": "already a member"}
        gathering.members.append(Candidate(ctx.peer_id, role, join.upload, join.download, join.metadata,
                                           tuple(str(a) for a in ctx.remote.addresses)))
        if gathering.full:
            self._close(gathering)
        formed = await asyncio.shield(gathering.done)
        if isinstance(formed, str):
            return {"failed": formed}
        return {"group": _group_to_wire(formed)}

    def _close(self, gathering: _Gathering) -> FormedGroup:
        """Decide the group: member order, load split, id; answer every follower."""
        if gathering.done.done():
            return _formed(gathering)
        members = gathering.members
        if len(members) < self.min_group_size:
            gathering.done.set_result(f"only {len(members)} peer(s) gathered under {gathering.key!r}; "
                                      f"min_group_size is {self.min_group_size}")
            return _formed(gathering)
        # The leader first, then the others by id, not by when their requests came in: reducers
        # add parts in member order, so a group of the same peers averages to the same bits.
        members = [members[0], *sorted(members[1:], key=lambda m: m.peer_id.to_bytes())]
        modes = [m.role for m in members]
        fractions = optimal_fractions(modes, [m.upload for m in members], [m.download for m in members])
        group = Group(os.urandom(16), tuple(m.peer_id for m in members), tuple(modes),
                      tuple(part_sizes(self.total, fractions)))
        formed = FormedGroup(group, tuple(m.metadata for m in members), tuple(m.addresses for m in members))
        gathering.done.set_result(formed)
        return formed


def _formed(gathering: _Gathering) -> FormedGroup:
    """The group of a finished gathering; raises a fresh error if none was formed."""
    formed = gathering.done.result()
    if isinstance(formed, str):
        raise AveragingError(formed)
    return formed


async def _settle(seconds: float, ready: asyncio.Future | None) -> None:
    """Sleep `seconds`, and until `ready` is done; raise at once if `ready` fails."""
    sleep = asyncio.ensure_future(asyncio.sleep(seconds))
    try:
        if ready is not None:
            await asyncio.wait([ready, sleep], return_when=asyncio.FIRST_COMPLETED)  # its error at once
            await asyncio.wait([ready])
            if not ready.cancelled() and ready.exception() is not None:
                raise detached(ready.exception())  # the stored one would tie `ready` to these frames
            ready.result()
        await sleep
    finally:
        sleep.cancel()


def _group_to_wire(formed: FormedGroup) -> dict:
    g = formed.group
    return {"id": g.group_id, "peers": [p.to_bytes() for p in g.peers], "modes": list(g.modes),
            "parts": list(g.part_sizes), "meta": list(formed.metadata),
            "addrs": [list(a) for a in formed.addresses]}


def _group_from_wire(msg: Any, me: PeerID) -> FormedGroup:
    try:
        group = Group(bytes(msg["id"]), tuple(PeerID(p) for p in msg["peers"]), tuple(msg["modes"]),
                      tuple(int(p) for p in msg["parts"]))
        metadata = tuple(msg["meta"])
        addresses = tuple(tuple(str(a) for a in addrs[:MAX_ADDRESSES]) for addrs in msg["addrs"])
        if not (len(metadata) == len(addresses) == len(group.peers)) or me not in group.peers \
                or len(set(group.peers)) != len(group.peers):
            raise ValueError("inconsistent group")
        return FormedGroup(group, metadata, addresses)
    except (KeyError, TypeError, ValueError, PotluckError) as e:
        raise AveragingError(f"the leader sent a malformed group: {e}") from None
