"""Matchmaking: peers that want to average find each other through the DHT and form a group.

Every listening peer declares itself under the group key for one gathering window. The leader is
the declaration that expires first (ties: smallest peer id), i.e. the peer that started waiting
first; later arrivals cannot take its place. Others ask it to join with a long-poll call that
returns the finished group. Declarations take a moment to spread, so a peer may have led its own
group before it saw an earlier leader's record: it then hands its followers over (each is told to
ask the earlier leader) and joins that one itself, so a key's peers end in one group whenever they
can see each other. Client peers never lead (nobody can dial them); they only join.

A group meets again without the DHT: a member asks the leader of its last group directly, and a
leader whose caller knows that exactly that group's members take part (`members`) closes the
group as soon as they are back, with no declaration and no settling. A leader that is open to
newcomers turns its old members away, and they fall back to the DHT like everyone else; so does a
member whose leader does not gather in time (one that computes meanwhile is late, not gone: it is
asked again, `LATE_LEADER_FRACTION`). This saves the DHT's part of every epoch's
matchmaking in a stable swarm (most of a round on a fast network). Averagers that meet the same
peers can share that memory (`LastGroup`): Streaming DiLoCo's fragments meet through the DHT once.

The leader closes the group when it reaches `target_group_size` or its window ends, decides the
load split (DeDLOC's linear program over the members' measured bandwidths) and the member order,
and answers every follower with the same `Group`. Fewer than `min_group_size` members: everyone
gets a clear failure.

Anyone can declare under a key as its earliest peer, so a leader that gives us nothing usable is
not joined again for `HELD_LEADER_SECONDS`, nor is any peer of its subnet (our own network
excepted): one that holds a join past its window's end and half of BEGIN_SLACK without an answer
(an honest one answers when its window ends, and one held by an earlier leader gives that one up
by then to close its own gathering), one that fails a join before its window ends, and one that
forms a group it then takes no part in (`Averager`). Each held every follower, or failed its
round, round after round; such a subnet now costs a round per `HELD_LEADER_SECONDS` at most, and
its peers may still join ours. A refusal's `taken` list is not believed either.

Seats are shared per subnet, since ids are free: a full gathering that one subnet crowds (more than
half of the followers' seats, and more than one) stays open for `SEAT_FRACTION` of its window, and
a joiner from a subnet holding at least two seats fewer takes the seat of that subnet's latest
joiner. Made-up ids that join every leader the moment it declares (before honest followers, who
let declarations spread first) then keep about their subnet's share of each group instead of all
of it. Peers on our own network (loopback, private addresses) are exempt: a lab or a test swarm
on one host closes as soon as it is full.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from potluck.averaging.accountability import ban_list
from potluck.averaging.allreduce.group import MAX_GROUP_SIZE, ROLES, Group
from potluck.averaging.allreduce.messages import MAX_REASON_CHARS
from potluck.averaging.lapses import lapses
from potluck.averaging.load_balancing import balanced_parts, fair_split
from potluck.averaging.role import Role
from potluck.core import compat
from potluck.core.bounded import drop_oldest
from potluck.core.errors import (
    AveragingError,
    DeadlineExceeded,
    MalformedMessage,
    NetworkError,
    PotluckError,
    detached,
)
from potluck.core.names import AveragerNames
from potluck.core.wire import Choice, List, Message, Nested, Number, OneOf, Opaque, Text, Tuple
from potluck.dht.records import own_subkey, subkey_owner
from potluck.net.identity import PeerID
from potluck.net.origins import outside_subnet
from potluck.net.transport import Transport
from potluck.net.wire import PeerIdField

__all__ = [
    "Candidate", "Declaration", "FormedGroup", "JoinAccepted", "JoinFailed", "JoinMoved", "JoinRefused",
    "JOIN_REPLY", "JoinRequest", "Matchmaker", "Target",
]

logger = logging.getLogger(__name__)

# Part of the window spent letting declarations spread before the first read of the group key.
SETTLE_FRACTION = 0.05
# How often a waiting peer re-reads the group key (fraction of the window, with a floor).
POLL_FRACTION = 0.1
MIN_POLL_SECONDS = 0.05
# Part of the window a full gathering that one subnet crowds stays open for joiners of other
# subnets (see the module docstring): honest followers settle, read the key and ask within about
# a settle and a poll or two of the window's start. Only crowded gatherings wait for it.
SEAT_FRACTION = SETTLE_FRACTION + 2 * POLL_FRACTION
# How long a leader that gave us nothing usable (and its subnet) is not joined again (see the
# module docstring): one made-up id declared as the earliest peer otherwise wrecks every round.
# Long, since an honest leader does this only when it dies or shuts down; skipping an honest one
# only lets the next peer lead.
HELD_LEADER_SECONDS = 3600.0
# Leaders and subnets remembered so (each a short string and a float).
MAX_HELD_LEADERS = 1024
# After the leader's window closes, followers wait this long for the group to be sent.
BEGIN_SLACK = 5.0
# Encoded size of the metadata a member hands its group (`gather`: a few numbers and a digest in
# the optimizer); the leader sends every member's to everyone, so MAX_GROUP_SIZE of these at most.
MAX_METADATA_BYTES = 16 * 1024
# Longest tensor schema a join request or declaration may name (ours are 32 hex digits of a digest).
MAX_SCHEMA_CHARS = 64
# A returning member may ask before its leader has started gathering under the key; the leader
# holds such a request this long at most (only members of its last group can ask: at most
# MAX_GROUP_SIZE waiters, each a few hundred bytes).
REJOIN_WAIT = 5.0
# A returning member asks to be held for this part of its window; a leader that has not started
# gathering by then is late or gone, and the member uses the DHT in the rest of the window.
REJOIN_FRACTION = 0.5
# ... unless the leader has computed meanwhile (`LastGroup.computed`): it is late, not stalled or
# gone, and the member asks again, for this part of its window each time, until this part of it
# has passed. Over the emulated WAN a leader on a loaded machine began a round 0.53 s after a
# member whose hold was 0.5 s: the member gathered alone through the DHT while the leader, which
# gathers its last members without the DHT, waited out its window for it; the round failed, and
# two repairs followed (about 10 s). A stalled leader computes nothing, and is not waited for. A
# leader that says it computes and never gathers costs its members one round, as one that fails
# their joins does (they look for their next group through the DHT).
LATE_LEADER_FRACTION = 0.9
# Longest group key a join request may name (ours are an epoch, a part and a grid cell).
MAX_KEY_CHARS = 512
# Hand-overs a follower follows in one join: honest leaders hand over once each, to an earlier
# leader (a chain as long as the key's leaders that saw each other late, a few at most); the cap
# stops a hostile leader sending a follower round a ring of peers until the window ends.
MAX_HANDOVERS = 4


@dataclass
class LastGroup:
    """The last group we were in: its leader (ourselves if we led it), and its members if we led
    it. Matchmakers that meet the same peers may share one (Streaming DiLoCo's fragments: a later
    fragment's first round then meets without the DHT too)."""

    leader: PeerID | None = None
    members: frozenset[PeerID] = frozenset()
    # Whether a peer has computed (its progress moved) since a DHT time: tells a late leader from
    # a stalled one (LATE_LEADER_FRACTION). The optimizer's progress view; None: never known.
    computed: Callable[[PeerID, float], bool] | None = None


@dataclass(frozen=True)
class Candidate:
    """A peer in a gathering: who, in which role, its bandwidths (bytes/s, for the load split),
    and what it shares with the group."""

    peer_id: PeerID
    role: str
    upload: float
    download: float
    metadata: Any


# -- messages ---------------------------------------------------------------------------------------
class Declaration(Message, what="group declaration"):
    """A peer's record under a group key in the DHT (subkey: `own_subkey(its peer id)`, owner-signed,
    so nobody can declare in another peer's name): it gathers peers whose tensors have this
    `schema` until the record expires. Its addresses are not here: the transport
    resolves the peer id through the peer's own signed record in the DHT."""

    schema: str = Text("schema", MAX_SCHEMA_CHARS)


def _bandwidth() -> Tuple:
    """(upload, download) in bytes/s, as a member declared them."""
    return Tuple(None, (Number(positive=True), Number(positive=True)))


class JoinRequest(Message, what="join request"):
    """Asks a leader to take us into its gathering under `key`, in `role`, with our `bandwidth`
    (upload, download) and what we share with the group (`again`: a member of its last group
    rejoining, and how long it may be held before the leader gathers)."""

    key: str = Text("key", MAX_KEY_CHARS)
    schema: str = Text("schema", MAX_SCHEMA_CHARS)
    role: str = Choice("role", ROLES)
    bandwidth: tuple[float, float] = Tuple("bw", (Number(positive=True), Number(positive=True)))
    metadata: Any = Opaque("meta", MAX_METADATA_BYTES)
    again: float | None = Number("again", default=None)


class FormedGroup(Message, what="group"):
    """A group as every member receives it (the leader's announcement): the all-reduce plan plus
    everyone's metadata and declared (upload, download) bandwidths, from which every member
    checks the load split (members are named by peer id; the transport resolves their addresses).
    Checked against the receiver (context `me`: among its distinct members) and the `total`
    elements it averages (the part sizes add up to it)."""

    group: Group = Nested("g", Group)
    metadata: tuple[Any, ...] = List("meta", Opaque(None, MAX_METADATA_BYTES), MAX_GROUP_SIZE)
    bandwidths: tuple[tuple[float, float], ...] = List("bw", _bandwidth(), MAX_GROUP_SIZE)

    def validate(self, context: dict[str, Any]) -> None:
        g, total = self.group, context["total"]
        n = len(g.peers)
        if context["me"] not in g.peers or len(set(g.peers)) != n:
            raise self.refuse("'g': 'peers' must be distinct and include the receiver")
        if sum(g.part_sizes) != total:
            raise self.refuse(f"'g': 'parts' must add up to the {total} elements averaged")
        if len(self.metadata) != n:
            raise self.refuse(f"'meta' must be a list of {n} items")
        if len(self.bandwidths) != n:
            raise self.refuse(f"'bw' must be a list of {n} items")

    def unfair(self, leader: PeerID, me: Candidate) -> str | None:
        """Why this group breaks the rules a leader must follow, or None: it is led by `leader`,
        states our own role and bandwidths as we declared them (each member checks its own, so
        a leader can only misstate its own, which are clamped), and its split is the one the load
        balancing rule gives (no member, the leader included, above its bounded share)."""
        g = self.group
        i = g.peers.index(me.peer_id)
        if g.peers[0] != leader:
            return f"it is led by {g.peers[0]}, not by the peer that formed it"
        if g.roles[i] != me.role or self.bandwidths[i] != (me.upload, me.download):
            return (f"it states our role and bandwidths as {g.roles[i]}, {self.bandwidths[i]}, "
                    f"not {me.role}, {(me.upload, me.download)}")
        if not fair_split(list(g.part_sizes), list(g.roles), [b[0] for b in self.bandwidths],
                          [b[1] for b in self.bandwidths]):
            return f"its split {list(g.part_sizes)} breaks the load balancing rule for bandwidths {self.bandwidths}"
        return None


class JoinAccepted(Message, what="join reply"):
    """The leader's answer to a member once the group is formed."""

    group: FormedGroup = Nested("group", FormedGroup)


class JoinFailed(Message, what="join reply"):
    """The leader took us, but no group formed (e.g. fewer than min_group_size peers came)."""

    reason: str = Text("failed", MAX_REASON_CHARS)


class JoinMoved(Message, what="join reply"):
    """The leader handed its gathering over to an earlier leader: ask `leader` instead."""

    leader: PeerID = PeerIdField("moved", raw=True)


class JoinRefused(Message, what="join reply"):
    """The leader will not take us (a full group names its members, `taken`: for the record only,
    as a made-up leader can name anyone there)."""

    reason: str = Text("refused", MAX_REASON_CHARS)
    taken: tuple[PeerID, ...] = List("taken", PeerIdField(raw=True), MAX_GROUP_SIZE)


JoinReply = JoinAccepted | JoinRefused | JoinFailed | JoinMoved
# A leader's answer to our join request (context: `me` and `total`, see `FormedGroup`).
JOIN_REPLY = OneOf("join reply", JoinAccepted, JoinFailed, JoinMoved, JoinRefused)


# A group's size to close at: a number, None (the matchmaker's), or a function giving either now.
Target = int | Callable[[], int | None] | None


def _now(target: Target) -> int | None:
    return target() if callable(target) else target


@dataclass
class _Gathering:
    key: str
    schema: str
    target: int
    closes_at: float
    members: list[Candidate] = field(default_factory=list)
    # The group formed, or why none was, or the leader it was handed over to: a result, never an
    # exception (raised from a future, a stored error would tie its traceback's frames, which hold
    # this gathering, to it: a cycle).
    done: asyncio.Future[FormedGroup | str | JoinMoved] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future())
    ready: asyncio.Future | None = None  # the owner's own check; nobody joins before it passes
    keep: bool = False  # the last group meets again, without the DHT (see the module docstring)
    settled: asyncio.Event = field(default_factory=asyncio.Event)  # set while not joining someone
    seats_until: float = 0.0  # (DHT time) until when a crowded full gathering stays open
    # Each follower's subnet (None: our own network), and a future per seated follower that is set
    # when its seat goes to a joiner of a less represented subnet.
    subnets: dict[PeerID, str | None] = field(default_factory=dict)
    unseated: dict[PeerID, asyncio.Future[None]] = field(default_factory=dict)
    # Peers counted into `target` that did not come to a recent round of the caller's (`form_group`)
    no_shows: frozenset[PeerID] = frozenset()

    def __post_init__(self) -> None:
        self.settled.set()

    @property
    def full(self) -> bool:
        return len(self.members) >= self.target

    def closes(self, now: float) -> bool:
        """Whether to close now: the window is over, or the gathering is full and either meets
        again, holds no crowding subnet, or has been open long enough for other joiners; or only
        no-shows are missing and it has been open that long."""
        return now >= self.closes_at or (self.full and (self.keep or self._crowding() is None
                                                        or now >= self.seats_until)) \
            or (now >= self.seats_until and self._only_no_shows_missing())

    def _only_no_shows_missing(self) -> bool:
        """The members and the no-shows not among them make the target."""
        if not self.no_shows:
            return False
        missing = self.no_shows - {m.peer_id for m in self.members}
        return bool(missing) and len(self.members) + len(missing) >= self.target

    def _crowding(self) -> str | None:
        """The subnet (not our own network) holding more than half of the followers' seats, and
        more than one, or None."""
        held = Counter(s for s in self.subnets.values() if s is not None).most_common(1)
        return held[0][0] if held and held[0][1] > max(1, len(self.subnets) // 2) else None

    def unseat_for(self, subnet: str | None) -> bool:
        """Free a seat of a crowded full gathering for a joiner from `subnet`: the latest joiner
        of the subnet holding the most seats, if it holds at least two more than `subnet` (so
        seats never go back and forth). Whether one was freed."""
        crowding = self._crowding()
        if crowding is None or self.keep:
            return False
        held = Counter(self.subnets.values())
        if held[crowding] < held[subnet] + 2:
            return False
        victim = next(m for m in reversed(self.members[1:]) if self.subnets.get(m.peer_id) == crowding)
        self.members.remove(victim)
        del self.subnets[victim.peer_id]
        seat = self.unseated.pop(victim.peer_id, None)
        if seat is not None and not seat.done():
            seat.set_result(None)
        return True


class Matchmaker:
    """Forms groups for one averager (its `names`) on one peer."""

    def __init__(self, transport: Transport, dht: Any, names: AveragerNames, schema: str, total: int,
                 role: str = "node", target_group_size: int | None = None, min_group_size: int = 2):
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}")
        self.transport = transport
        self.dht = dht
        self.names = names
        self.schema = schema
        self.total = total  # elements averaged: equal for every member, since schemas match
        self.role = role
        self.client = role == Role.CLIENT or transport.client_mode
        self.target = min(target_group_size or MAX_GROUP_SIZE, MAX_GROUP_SIZE)
        self.min_group_size = min_group_size
        self._gatherings: dict[str, _Gathering] = {}
        self._opened = asyncio.Event()  # set (and replaced) whenever a gathering starts
        self.last = LastGroup()
        self.banned = ban_list(transport)
        self.lapses = lapses(transport)  # members that held up our steps as senders: not seated for a while
        self._held: dict[str, float] = {}  # "id:<peer>" or "subnet:<subnet>" -> loop time to skip it until
        self._declared: dict[PeerID, float] = {}  # when the leaders last read under our key close (DHT time)
        transport.add_handler(names.join, self._on_join)

    def close(self) -> None:
        self.transport.remove_handler(self.names.join)
        self.last.computed = None  # the owner's callback: a closed matchmaker asks nothing, holds nothing of it
        for gathering in self._gatherings.values():
            if not gathering.done.done():
                gathering.done.set_result("averager shut down")

    def _dht_key(self, group_key: str) -> str:
        return self.names.declarations(group_key)

    async def form_group(self, group_key: str, window: float, bandwidth: tuple[float, float],
                         metadata: Any = None, target: Target = None,
                         ready: asyncio.Future | None = None,
                         members: frozenset[PeerID] | None = None,
                         no_shows: frozenset[PeerID] = frozenset()) -> FormedGroup:
        """Find peers under `group_key` within `window` seconds and return the group formed; a
        leader closes the group early once it has `target` members (default: the matchmaker's;
        a callable is asked again at every poll: a view that settles during the window closes
        the group then, not at the window's end).

        `ready`, if given, is this peer's own preparation (e.g. checking its tensors), running
        meanwhile: no group is joined or formed, and nobody joins ours, until it succeeds; if it
        fails, its error is raised here and the peer takes part in no group.

        `members`: every peer that takes part, if the caller knows them: if they are the group
        we led last time, we wait for them only, without the DHT. Members of a last group always
        ask its leader first. `no_shows`: peers counted into `target` that did not come to a
        recent round; once only they are missing, a group we lead closes after `SEAT_FRACTION` of
        its window instead of waiting out the window for them."""
        keep = members is not None and self.last.leader == self.transport.peer_id and not self.client \
            and members == self.last.members
        if keep:  # full once they are all back
            target = min(_now(target) or self.target, len(members))
        try:
            formed = await self._form(group_key, window, bandwidth, metadata, target, ready, keep, no_shows)
        except BaseException:
            # No group: our last one may have gone on without us (we stalled, they met as fewer),
            # and leading it again off the DHT would wait for members who now look for each
            # other in the DHT, round after round. Next time we declare ourselves there.
            self.last.leader, self.last.members = None, frozenset()
            raise
        leader = formed.group.peers[0]
        self.last.leader = leader
        self.last.members = frozenset(formed.group.peers) if leader == self.transport.peer_id else frozenset()
        return formed

    async def _form(self, group_key: str, window: float, bandwidth: tuple[float, float], metadata: Any,
                    target: Target, ready: asyncio.Future | None, keep: bool,
                    no_shows: frozenset[PeerID] = frozenset()) -> FormedGroup:
        loop = asyncio.get_running_loop()
        give_up = loop.time() + window + BEGIN_SLACK
        upload, download = bandwidth
        role = Role.CLIENT.value if self.client else self.role
        me = Candidate(self.transport.peer_id, role, upload, download, metadata)
        leader = self.last.leader if self.last.leader != self.transport.peer_id else None
        if leader is not None:
            await _settle(0.0, ready)  # our own check first: a failing peer must not join
            rejoined = await self._rejoin(leader, group_key, me, window, give_up)
            if rejoined is not None:
                return rejoined
        gathering: _Gathering | None = None
        if not self.client:
            now = self.dht.get_time()
            size = min(_now(target) or self.target, MAX_GROUP_SIZE)
            gathering = _Gathering(group_key, self.schema, size, now + window, [me], ready=ready, keep=keep,
                                   seats_until=now + window * SEAT_FRACTION, no_shows=no_shows)
            self._gatherings[group_key] = gathering
            opened, self._opened = self._opened, asyncio.Event()
            opened.set()
            if keep:
                return await self._keep(gathering, ready, give_up)
            await self.dht.astore(self._dht_key(group_key), Declaration(self.schema).to_wire(),
                                  gathering.closes_at, subkey=own_subkey(self.transport.peer_id))
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
                    if callable(target):
                        gathering.target = min(target() or self.target, MAX_GROUP_SIZE)
                    if gathering.closes(self.dht.get_time()):
                        return self._close(gathering)
                if gathering is not None and len(gathering.members) > 1:
                    earlier = [p for p in await self._earlier_peers(group_key) if p not in tried]
                    if earlier and not gathering.done.done():
                        self._hand_over(gathering, earlier[0])
                        gathering = None  # from now on we only join, like a client
                        continue
                if gathering is None or len(gathering.members) == 1:
                    for leader in await self._earlier_peers(group_key):
                        if leader in tried or (gathering is not None and len(gathering.members) > 1):
                            continue
                        joined = await self._join_holding(gathering, leader, group_key, me, give_up, tried)
                        if joined is not None:
                            return joined
                        tried.add(leader)
                if gathering is not None:
                    left = gathering.seats_until - self.dht.get_time()  # (a crowded full one closes then)
                    try:
                        async with compat.timeout(poll if not gathering.full or left <= 0 else min(poll, left)):
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

    def _hand_over(self, gathering: _Gathering, leader: PeerID) -> None:
        """Stop gathering: our followers (and anyone still asking) are told to join `leader`, an
        earlier leader whose record reached us after they had joined us."""
        logger.debug("handing %d follower(s) under %r over to the earlier leader %s",
                     len(gathering.members) - 1, gathering.key, leader)
        self._gatherings.pop(gathering.key, None)
        gathering.done.set_result(JoinMoved(leader))
        gathering.settled.set()

    async def _rejoin(self, leader: PeerID, group_key: str, me: Candidate, window: float,
                      give_up: float) -> FormedGroup | None:
        """Ask our last leader to take us again (it may hold us REJOIN_FRACTION of our `window`
        before it gathers; again while it computes, up to LATE_LEADER_FRACTION); None if it will
        not (it is open to newcomers, stalled, or gone): then we use the DHT."""
        wait, until = window * REJOIN_FRACTION, self.dht.get_time() + window * LATE_LEADER_FRACTION
        computed = self.last.computed
        try:
            while True:
                asked = self.dht.get_time()
                joined = await self._join(leader, group_key, me, give_up, set(), rejoin_wait=wait)
                now = self.dht.get_time()
                # Held for the whole wait (a refusal for another reason comes at once), the leader
                # not gathering yet: late if it computed meanwhile.
                held = now - asked >= 0.9 * min(wait, REJOIN_WAIT)
                if joined is not None or computed is None or not held or not computed(leader, asked):
                    return joined
                wait = min(window * (1 - REJOIN_FRACTION) / 2, until - now)
                if wait <= 0:
                    return None
                logger.debug("our last leader %s is late but computing: asking again", leader)
        except AveragingError as e:
            logger.debug("rejoining %s failed: %s", leader, e)
            return None
        finally:
            self.last.leader = None  # asked once; it is set again by the group we end up in

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
        """Our gathering under `key`, waiting up to `wait` seconds for it to start; None at once
        if we gather another key now or start to meanwhile (this round's: a Moshpit member's next
        key is another row's or column's), so the member turns to the DHT without losing its wait."""
        gathering = self._gatherings.get(key)
        if gathering is None and not self._gatherings:
            with contextlib.suppress(TimeoutError):
                async with compat.timeout(wait):
                    await self._opened.wait()
            gathering = self._gatherings.get(key)
        return gathering

    async def _join_holding(self, gathering: _Gathering | None, leader: PeerID, group_key: str, me: Candidate,
                            give_up: float, tried: set[PeerID]) -> FormedGroup | None:
        """Try to join `leader`; meanwhile requests to join us wait for the outcome. A leader that
        has not answered half of BEGIN_SLACK after our own window's end (an honest one answers at
        the end of its window, earlier than ours) is given up, in time to close our own gathering
        for those waiting on it."""
        if gathering is not None:
            gathering.settled.clear()
            ours = asyncio.get_running_loop().time() + gathering.closes_at - self.dht.get_time()
            give_up = min(give_up, ours + BEGIN_SLACK / 2)
        joined = None
        try:
            joined = await self._join(leader, group_key, me, give_up, tried)
        finally:
            if gathering is not None:
                if joined is not None and not gathering.done.done():
                    gathering.done.set_result(joined)  # we are in that group now: waiters are refused
                gathering.settled.set()
        if joined is None and gathering is not None:
            await asyncio.sleep(0)  # the requests that waited take their seats before we may close
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
        candidates: dict[tuple[float, bytes], PeerID] = {}  # (expiration, id) -> peer: earliest leads
        self._declared = {}
        for subkey, entry in found.value.items():
            peer = subkey_owner(subkey)  # the peer that signed it; anything else declares nobody
            if peer is None:
                continue
            if entry.expiration_time <= now or peer == self.transport.peer_id or peer in self.banned \
                    or self._held_leader(peer):
                continue
            try:
                declared = Declaration.from_wire(entry.value)
            except MalformedMessage as e:
                logger.debug("ignoring %s's declaration under %r: %s", peer, group_key, e)
                continue
            if declared.schema != self.schema:
                continue
            order = (entry.expiration_time, peer.to_bytes())
            if me is not None and order >= me:
                continue  # later than us: it joins us, not the other way round
            candidates[order] = peer
            self._declared[peer] = entry.expiration_time
        return [candidates[order] for order in sorted(candidates)]

    async def _join(self, leader: PeerID, group_key: str, me: Candidate, give_up: float,
                    tried: set[PeerID], rejoin_wait: float | None = None, handovers: int = 0) -> FormedGroup | None:
        """Ask `leader` to take us; None if it refused (the caller tries another); a leader that
        handed its gathering over names the leader to ask next."""
        if self._held_leader(leader):
            return None
        request = JoinRequest(group_key, self.schema, me.role, (me.upload, me.download), me.metadata,
                              again=rejoin_wait).to_wire()
        loop = asyncio.get_running_loop()
        try:
            reply = await self.transport.call(leader, self.names.join, request,
                                              timeout=max(0.1, give_up - loop.time()))
        except DeadlineExceeded as e:
            closed = self._declared.get(leader)  # it had our request, and kept it past its own window:
            if closed is not None and self.dht.get_time() >= closed + BEGIN_SLACK / 2 \
                    and self.transport.is_connected(leader):
                self.hold_against(leader, "held our join request past its own window without an answer")
            logger.debug("join %s failed: %s", leader, e)
            return None
        except (NetworkError, PotluckError) as e:
            logger.debug("join %s failed: %s", leader, e)
            return None
        try:
            answer = JOIN_REPLY.from_wire(reply, me=self.transport.peer_id, total=self.total)
        except MalformedMessage as e:  # a broken or hostile leader: try another
            logger.warning("leader %s sent a %s; not joining it", leader, e)
            return None
        if isinstance(answer, JoinAccepted):
            unfair = answer.group.unfair(leader, me)
            if unfair is not None:
                self.banned.ban(leader, f"as leader, it sent us a group that {unfair}")
                return None
            caught = _banned_member(answer.group, self.banned)
            if caught is not None:
                logger.info("not averaging with the group of %s: it %s", leader, caught)
                return None
            return answer.group
        if isinstance(answer, JoinFailed):
            closed = self._declared.get(leader)
            if closed is None or self.dht.get_time() >= closed:
                raise AveragingError(f"group under {group_key!r} failed: {answer.reason}")
            # Before its window's end an honest leader fails nobody (but when it shuts down): a
            # made-up earliest leader failed every follower's round at once this way.
            self.hold_against(leader, f"failed our join before its window ended ({answer.reason!r})")
            return None
        if isinstance(answer, JoinMoved):
            tried.add(leader)
            if answer.leader in tried or answer.leader == self.transport.peer_id or handovers >= MAX_HANDOVERS:
                return None
            joined = await self._join(answer.leader, group_key, me, give_up, tried, rejoin_wait, handovers + 1)
            if joined is None:  # it will not take us: nor would it take the followers we may lead next
                tried.add(answer.leader)
            return joined
        tried.add(leader)  # (not its `taken`: a made-up earliest leader named every honest peer there)
        return None

    def _held_leader(self, peer: PeerID) -> bool:
        """Whether `peer`, or a peer of its subnet, gave us nothing usable as a leader lately, or
        held up a step of ours as a sender (`lapses`: we would not seat it either)."""
        now = asyncio.get_running_loop().time()
        return any(self._held.get(key, 0.0) > now for key in self._leader_keys(peer)) \
            or self.lapses.held(peer, self.transport.peer_origin(peer)) > 0

    def hold_against(self, leader: PeerID, what: str) -> None:
        """Join neither `leader` nor its subnet for HELD_LEADER_SECONDS: as a leader it `what`, which
        an honest one does not do (see the module docstring). Our last group is forgotten if it
        led it."""
        logger.warning("leader %s %s; not joining it or its subnet for %.0f s", leader, what, HELD_LEADER_SECONDS)
        if self.last.leader == leader:
            self.last.leader, self.last.members = None, frozenset()
        until = asyncio.get_running_loop().time() + HELD_LEADER_SECONDS
        for key in self._leader_keys(leader):
            self._held.pop(key, None)
            self._held[key] = until
        drop_oldest(self._held, MAX_HELD_LEADERS)

    def _leader_keys(self, peer: PeerID) -> list[str]:
        subnet = outside_subnet(self.transport.peer_origin(peer))
        return [f"id:{peer}"] + ([] if subnet is None else [f"subnet:{subnet}"])

    async def _on_join(self, request: Any, ctx: Any) -> dict:
        return (await self._answer_join(JoinRequest.from_wire(request), ctx)).to_wire()

    async def _answer_join(self, join: JoinRequest, ctx: Any) -> JoinReply:
        if ctx.peer_id in self.banned:
            return JoinRefused("this peer caught you lying earlier", ())
        if join.again is not None and ctx.peer_id not in self.last.members:
            return JoinRefused("not a member of our last group", ())
        gathering = self._gatherings.get(join.key) if join.again is None else \
            await self._gathering_for(join.key, min(join.again, REJOIN_WAIT))
        if gathering is None:
            return JoinRefused("not gathering a group under this key", ())
        if join.again is not None and not gathering.keep:
            return JoinRefused("open to newcomers: find the group through the DHT", ())
        if gathering.keep and ctx.peer_id not in self.last.members:  # its key is easy to guess
            return JoinRefused("this group meets again with its last members only", ())
        if join.schema != gathering.schema:
            return JoinRefused("different tensor schema (shapes, dtypes or compression differ)", ())
        held = self.lapses.held(ctx.peer_id, ctx.remote.origin)
        if held > 0:
            return JoinRefused(f"you (or your subnet) held up a recent step of ours as a sender; "
                               f"ask again in {held:.0f} s", ())
        # It cannot accept connections if it dialed us in client mode, whatever it says.
        role = Role.CLIENT.value if ctx.remote.client_mode else join.role
        if gathering.ready is not None:
            try:
                await asyncio.shield(gathering.ready)
            except Exception:  # noqa: BLE001 - the owner failed its own check: it forms no group
                return JoinRefused("this peer is not averaging this round", ())
        await gathering.settled.wait()  # we may be joining an earlier peer ourselves right now
        if gathering.done.done() and isinstance(gathering.done.result(), JoinMoved):
            return gathering.done.result()
        subnet = outside_subnet(ctx.remote.origin)
        if gathering.done.done():
            return JoinRefused("group is full or already formed", _taken(gathering))
        if any(m.peer_id == ctx.peer_id for m in gathering.members):
            return JoinRefused("already a member", ())
        if gathering.full and not gathering.unseat_for(subnet):
            return JoinRefused("group is full or already formed", _taken(gathering))
        gathering.members.append(Candidate(ctx.peer_id, role, *join.bandwidth, join.metadata))
        gathering.subnets[ctx.peer_id] = subnet
        if gathering.full and gathering.closes(self.dht.get_time()):
            self._close(gathering)  # (at its window's end the leader closes it: all waiting are in by then)
        seat = gathering.unseated[ctx.peer_id] = asyncio.get_running_loop().create_future()
        try:
            await asyncio.wait([gathering.done, seat], return_when=asyncio.FIRST_COMPLETED)
        finally:
            if gathering.unseated.get(ctx.peer_id) is seat:
                del gathering.unseated[ctx.peer_id]
        if not gathering.done.done():
            return JoinRefused("a joiner from a subnet holding fewer seats took yours", _taken(gathering))
        formed = gathering.done.result()
        if isinstance(formed, str):
            return JoinFailed(formed[:MAX_REASON_CHARS])
        if isinstance(formed, JoinMoved):
            return formed
        return JoinAccepted(formed)

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
        roles = [m.role for m in members]
        parts = balanced_parts(self.total, roles, [m.upload for m in members], [m.download for m in members])
        group = Group(os.urandom(16), tuple(m.peer_id for m in members), tuple(roles), tuple(parts))
        formed = FormedGroup(group, tuple(m.metadata for m in members), tuple((m.upload, m.download) for m in members))
        gathering.done.set_result(formed)
        return formed


def _taken(gathering: _Gathering) -> tuple[PeerID, ...]:
    """The members a refused joiner may skip: the group's, once formed."""
    if gathering.done.done() and isinstance(gathering.done.result(), FormedGroup):
        return gathering.done.result().group.peers
    return tuple(m.peer_id for m in gathering.members)


def _banned_member(formed: FormedGroup, banned: Any) -> str | None:
    """Why we will not average with this group: it holds a member we caught lying (or None)."""
    caught = [p for p in formed.group.peers if p in banned]
    return f"includes {caught[0]}, whom we caught lying: {banned.evidence(caught[0])}" if caught else None


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

