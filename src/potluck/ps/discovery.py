"""Shard layouts through the DHT: shard servers announce themselves, workers discover the layout.

Every shard server publishes a `ServerAnnouncement` under `RunNames(run_id).ps_servers`, in its own
owner-signed subkey (`own_subkey`): the DHT refuses an entry there unless that peer signed it,
and readers take the announcer from the subkey, so nobody can announce a shard for another peer.
The announcement carries the layout's digest (the model's tensor shapes and dtypes, the shard
count, and the assignment `split_by_size` makes of them); a worker computes the same from its own
model and refuses announcements that differ (another --model, --shards, or potluck version)
rather than pushing gradients of the wrong shapes.

A primary started before its standby finds the standby's announcement (`standby_of` = itself),
copies its state to it (`ParameterServer.attach_replica`) and only then names it as its replica,
so a worker never fails over to a standby that has no copy. Workers wait until every shard has a
primary, and every primary that awaits a standby names one.

An announcement is renewed every ANNOUNCE_INTERVAL and lives ANNOUNCE_TTL: a dead server's entry
is gone within that. Any peer that can join the swarm can announce a shard of a run (see
docs/security.md); runs among strangers should be closed with `--authority`.

A worker whose model is not the servers' learns it at once rather than after its discovery
timeout: when no other peer announces its layout but others announce a complete layout of another
(every shard has a primary) for LAYOUT_MISMATCH_GRACE, `discover_layout` raises `ModelMismatch`
naming the first tensor that differs (the announcements carry the servers' model schema).
Likewise a worker of another --run-id, which finds no announcement of its run at all: when no
other peer has announced a server of its run for LAYOUT_MISMATCH_GRACE, it asks the peers it
joined through (`ask`, and only those) which runs they serve (`potluck.ps.runs`); if one serves
runs and none serves its own, `discover_layout` raises `RunNotFound` naming them. Peers that serve
no run, do not know the question (an older potluck) or answer nonsense leave it waiting as before.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import math
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence

import torch

from potluck.core.errors import MalformedMessage, PotluckError
from potluck.core.names import RunNames
from potluck.core.peer_like import PeerLike
from potluck.dht.records import own_subkey, owned_entries
from potluck.net.identity import PeerID
from potluck.optim.schema import ModelMismatch, ModelSignature, RunSchema
from potluck.ps.messages import ServerAnnouncement, ShardLayout, ShardRole
from potluck.ps.runs import ask_served_runs
from potluck.ps.server import ParameterServer, split_by_size

logger = logging.getLogger(__name__)

# An announcement lives this long unless renewed: how long a dead server's entry misleads newcomers.
ANNOUNCE_TTL = 30.0
# Renewal period, well inside the TTL so one lost store does not drop a live server.
ANNOUNCE_INTERVAL = 10.0
# How often a waiting worker (or a primary awaiting its standby) reads the announcements: one DHT
# read per second per waiting peer, while it waits only.
POLL_INTERVAL = 1.0
# How often a waiting peer says what it is still waiting for.
PROGRESS_INTERVAL = 5.0
# A worker that sees a complete layout of another model, and none of its own, this long stops with
# ModelMismatch: servers of its own model started with it announce within a second or two.
LAYOUT_MISMATCH_GRACE = 3.0
# How long a worker waits for the peers it joined through to say which runs they serve (they are
# connected already: one round trip), and how often it asks again while its run has no server.
RUNS_QUERY_TIMEOUT = 2.0
RUNS_QUERY_INTERVAL = 5.0
# Runs an error names, of those a peer serves (it may list MAX_SERVED_RUNS): one readable line.
RUNS_NAMED = 3


class LayoutNotFound(PotluckError):
    """The shard servers of a run did not all announce themselves before the deadline."""


class RunNotFound(LayoutNotFound):
    """No server announces the run, and the peers the worker joined through serve other runs only
    (a wrong --run-id, most likely)."""


def layout_digest(params: Sequence[torch.Tensor], num_shards: int) -> str:
    """What a worker and a server must agree on: each tensor's shape and dtype, and the split."""
    tensors = [[list(p.shape), str(p.dtype)] for p in params]
    assignment = split_by_size([p.numel() for p in params], num_shards)
    text = json.dumps({"tensors": tensors, "num_shards": num_shards, "assignment": assignment})
    return hashlib.sha256(text.encode()).hexdigest()


async def announce(peer: PeerLike, run_id: str, announcement: ServerAnnouncement) -> bool:
    dht = peer.dht
    return await dht.astore(RunNames(run_id).ps_servers, announcement.to_wire(), dht.get_time() + ANNOUNCE_TTL,
                            subkey=own_subkey(peer.transport.peer_id))


async def read_announcements(peer: PeerLike, run_id: str) -> dict[PeerID, ServerAnnouncement]:
    """Every live announcement of the run, by announcer (unsigned and malformed entries skipped)."""
    found = await peer.dht.aget(RunNames(run_id).ps_servers, latest=True)
    out: dict[PeerID, ServerAnnouncement] = {}
    for owner, value in owned_entries(found):
        try:
            out[owner] = ServerAnnouncement.from_wire(value)
        except MalformedMessage as e:
            logger.warning("skipping the shard server announcement of %s: %s", owner, e)
    return out


def assemble_layout(announcements: dict[PeerID, ServerAnnouncement],
                    params: Sequence[torch.Tensor]) -> tuple[ShardLayout | None, str]:
    """The layout the announcements give a model with `params`, or None and what is missing.
    Deterministic: every worker that reads the same announcements gets the same layout."""
    digests: dict[int, str] = {}
    matching: dict[PeerID, ServerAnnouncement] = {}
    refused = 0
    for peer, ann in announcements.items():
        if ann.num_shards not in digests:
            digests[ann.num_shards] = layout_digest(params, ann.num_shards)
        if ann.digest == digests[ann.num_shards]:
            matching[peer] = ann
        else:
            refused += 1
    mismatch = (f" ({refused} announce a layout that does not match this model: another --model, --shards "
                "or potluck version)") if refused else ""
    if not matching:
        return None, "no shard server has announced itself yet" + mismatch
    counts = Counter(a.num_shards for a in matching.values())
    num_shards = min(counts, key=lambda n: (-counts[n], n))  # the count most servers announce
    primaries: dict[int, list[tuple[PeerID, ShardRole]]] = {}
    standbys: set[tuple[int, PeerID, PeerID]] = set()  # (shard, primary, standby)
    for peer, ann in matching.items():
        if ann.num_shards != num_shards:
            continue
        for role in ann.roles:
            if role.standby_of is None:
                primaries.setdefault(role.shard, []).append((peer, role))
            else:
                standbys.add((role.shard, role.standby_of, peer))
    servers, missing = [], []
    for shard in range(num_shards):
        if shard not in primaries:
            missing.append(f"shard {shard} has no server")
            continue
        primary, role = min(primaries[shard], key=lambda pr: str(pr[0]))  # several: the same choice everywhere
        standby = role.replica if (shard, primary, role.replica) in standbys else None
        if role.await_standby and standby is None:
            missing.append(f"shard {shard}'s server waits for its standby")
            continue
        servers.append((primary,) + ((standby,) if standby is not None else ()))
    if missing:
        return None, "; ".join(missing) + mismatch
    assignment = split_by_size([p.numel() for p in params], num_shards)
    return ShardLayout(tuple(assignment), tuple(servers)), ""


async def _wait_for(find: Callable[[dict[PeerID, ServerAnnouncement]], tuple[object, str]], peer: PeerLike,
                    run_id: str, timeout: float, progress: Callable[[str], None],
                    check: Callable[[dict[PeerID, ServerAnnouncement]], Awaitable[None]] | None = None) -> object:
    """Read the announcements every POLL_INTERVAL until `find` returns a value (`check`, if given,
    sees those that gave none, and may raise); say what is missing every PROGRESS_INTERVAL;
    LayoutNotFound after `timeout` seconds."""
    loop = asyncio.get_running_loop()
    deadline, said = loop.time() + timeout, -math.inf
    while True:
        anns = await read_announcements(peer, run_id)
        found, missing = find(anns)
        if found is not None:
            return found
        if check is not None:
            await check(anns)
        now = loop.time()
        if now >= deadline:
            raise LayoutNotFound(f"run {run_id!r}: no complete shard layout after {timeout:.0f} s: {missing}")
        if now - said >= PROGRESS_INTERVAL:
            progress(f"waiting for the shard servers of run {run_id!r}: {missing}")
            said = now
        await asyncio.sleep(POLL_INTERVAL)


def foreign_layout(announcements: dict[PeerID, ServerAnnouncement], params: Sequence[torch.Tensor],
                   me: PeerID) -> ServerAnnouncement | None:
    """An announcement of a complete layout of another model than `params`' (each shard has a
    primary among the announcements of that digest), if no peer but `me` announces a layout of
    `params`; None otherwise."""
    digests: dict[int, str] = {}
    others: dict[tuple[str, int], list[ServerAnnouncement]] = {}
    for peer, ann in announcements.items():
        if ann.num_shards not in digests:
            digests[ann.num_shards] = layout_digest(params, ann.num_shards)
        if ann.digest == digests[ann.num_shards]:
            if peer != me:
                return None  # a server of our model: we wait for the rest of its layout
        elif peer != me:
            others.setdefault((ann.digest, ann.num_shards), []).append(ann)
    for (_, num_shards), anns in sorted(others.items()):
        primaries = {r.shard for a in anns for r in a.roles if r.standby_of is None}
        if primaries == set(range(num_shards)):
            return next((a for a in anns if a.model is not None), anns[0])
    return None


async def discover_layout(peer: PeerLike, run_id: str, params: Sequence[torch.Tensor], timeout: float,
                          progress: Callable[[str], None] = logger.info,
                          names: Sequence[str | None] | None = None, ask: Sequence[PeerID] = ()) -> ShardLayout:
    """Wait (at most `timeout` seconds) until the run's servers announce a complete layout that
    matches `params` (named `names`, for errors), and return it. ModelMismatch if the servers
    serve another model, RunNotFound if none serves this run and the peers `ask` (those this
    worker joined through) serve others (see the module docstring)."""
    loop = asyncio.get_running_loop()
    since: list[float] = []  # when a complete layout of another model was first seen (none of ours since)

    def find(anns: dict[PeerID, ServerAnnouncement]) -> tuple[ShardLayout | None, str]:
        layout, missing = assemble_layout(anns, params)
        other = None if layout is not None else foreign_layout(anns, params, peer.transport.peer_id)
        if other is None:
            since.clear()
        elif not since:
            since.append(loop.time())
        elif loop.time() - since[0] >= LAYOUT_MISMATCH_GRACE:
            difference = "their layout's digest is not yours (servers of an older potluck name no tensor)" \
                if other.model is None else other.model.difference(RunSchema.of(params, names), "the servers'",
                                                                   names=False)
            raise ModelMismatch(f"run {run_id!r}: the shard servers serve another model than this worker's: "
                                f"{difference}; give this worker the servers' --model (and --seed)")
        return layout, missing
    check = _run_check(peer, run_id, ask) if ask else None
    layout = await _wait_for(find, peer, run_id, timeout, progress, check)
    assert isinstance(layout, ShardLayout)
    return layout


def _run_check(peer: PeerLike, run_id: str,
               ask: Sequence[PeerID]) -> Callable[[dict[PeerID, ServerAnnouncement]], Awaitable[None]]:
    """What `discover_layout` does with announcements that give no layout: once no other peer has
    announced a server of the run for LAYOUT_MISMATCH_GRACE, ask the peers `ask` which runs they
    serve (every RUNS_QUERY_INTERVAL), and raise RunNotFound if one serves runs and none serves ours."""
    loop = asyncio.get_running_loop()
    me = peer.transport.peer_id
    since: list[float] = []  # when no other peer announced a server of the run (none since)
    asked_at = [-math.inf]

    async def check(anns: dict[PeerID, ServerAnnouncement]) -> None:
        now = loop.time()
        if any(p != me for p in anns):
            since.clear()
            return
        if not since:
            since.append(now)
        if now - since[0] < LAYOUT_MISMATCH_GRACE or now - asked_at[0] < RUNS_QUERY_INTERVAL:
            return
        asked_at[0] = now
        served = await ask_served_runs(peer.transport, ask, run_id, RUNS_QUERY_TIMEOUT)
        if not served or any(run_id in runs for runs in served.values()):
            return
        other, runs = min(served.items(), key=lambda pr: str(pr[0]))
        named = ", ".join(repr(r) for r in runs[:RUNS_NAMED]) + (
            f" and {len(runs) - RUNS_NAMED} more" if len(runs) > RUNS_NAMED else "")
        raise RunNotFound(f"run {run_id!r}: no shard server announces this run, and the peer {other} this worker "
                          f"joined through serves parameter-server run{'s' if len(runs) > 1 else ''} {named} "
                          "only; give this worker the same --run-id as the servers")
    return check


async def find_primary(peer: PeerLike, run_id: str, shard: int, digest: str, num_shards: int, timeout: float,
                       progress: Callable[[str], None] = logger.info) -> PeerID:
    """The primary of `shard` (for a standby started with `--standby-of auto`)."""
    def find(anns: dict[PeerID, ServerAnnouncement]) -> tuple[PeerID | None, str]:
        found = sorted((p for p, a in anns.items() if a.digest == digest and a.num_shards == num_shards
                        and any(r.shard == shard and r.standby_of is None for r in a.roles)), key=str)
        return (found[0] if found else None), f"shard {shard} has no primary server yet"
    primary = await _wait_for(find, peer, run_id, timeout, progress)
    assert isinstance(primary, PeerID)
    return primary


class ShardHost:
    """Keeps this peer's shard servers announced, and attaches standbys that announce themselves
    to the primaries among them (see the module docstring). Run `keep_announced` as a task."""

    def __init__(self, peer: PeerLike, run_id: str, servers: Sequence[ParameterServer], digest: str,
                 num_shards: int, *, await_standby: bool = False, schema: RunSchema | None = None):
        self.peer, self.run_id, self.servers = peer, run_id, list(servers)
        self.digest, self.num_shards = digest, num_shards
        # The model's schema, announced so that a worker of another model learns which tensor differs.
        self.model = None if schema is None else ModelSignature.of(schema)
        # Primaries that workers wait for until they have a standby (standbys promoted later do not).
        self.awaiting = {s.shard for s in self.servers if await_standby and not s.standby}

    def announcement(self) -> ServerAnnouncement:
        roles = tuple(ShardRole(s.shard, standby_of=s.primary) if s.standby else
                      ShardRole(s.shard, replica=s.replica, await_standby=s.shard in self.awaiting)
                      for s in self.servers)
        return ServerAnnouncement(self.digest, self.num_shards, roles, self.model)

    def _wanting(self, awaited_only: bool) -> list[ParameterServer]:
        """Primaries without a standby (`awaited_only`: those workers wait for)."""
        return [s for s in self.servers if not s.standby and s.replica is None
                and (s.shard in self.awaiting or not awaited_only)]

    async def attach_standbys(self, awaited_only: bool = False) -> None:
        """Adopt the standbys that announce themselves for this peer's primaries."""
        wanting = self._wanting(awaited_only)
        if not wanting:
            return
        me = self.peer.transport.peer_id
        anns = await read_announcements(self.peer, self.run_id)
        for server in wanting:
            candidates = sorted((p for p, a in anns.items() if a.digest == self.digest and any(
                r.shard == server.shard and r.standby_of == me for r in a.roles)), key=str)
            if candidates and await server.attach_replica(candidates[0]):
                logger.info("ps %s/%d: standby %s attached", self.run_id, server.shard, candidates[0])

    async def keep_announced(self) -> None:
        """Announce now and on every change (a server added, a standby attached, a takeover), renew
        every ANNOUNCE_INTERVAL; until cancelled."""
        loop = asyncio.get_running_loop()
        published, renew_at = None, 0.0
        while True:
            try:
                renew = loop.time() >= renew_at
                # Every tick for the standbys workers wait for; others at each renewal.
                await self.attach_standbys(awaited_only=not renew)
                current = self.announcement()
                if current != published or renew:
                    if await announce(self.peer, self.run_id, current):
                        published, renew_at = current, loop.time() + ANNOUNCE_INTERVAL
            except PotluckError as e:  # the DHT is unreachable for now: try again at the next tick
                logger.warning("ps %s: announcing the shard servers failed: %s", self.run_id, e)
            await asyncio.sleep(POLL_INTERVAL)
