"""`AllReduceService`: the all-reduce's RPC handlers on one transport, and the steps under way.

One service per transport serves every averager on it: it starts each step's `AllReduceRun`,
dispatches the other members' streams and calls to the run of their step (streams may arrive
before this member has started it: they wait a little), keeps what a finished step leaves for a
while (a coordinator that took over late still learns it was committed), and presumes dead the
client members it lost every connection with. It implements the `RunService` its runs call.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import torch

from potluck.averaging.accountability import ban_list
from potluck.averaging.allreduce.buffers import BufferPool
from potluck.averaging.allreduce.group import Group
from potluck.averaging.allreduce.member import REGISTRATION_WAIT, AllReduceRun, Pieces
from potluck.averaging.allreduce.messages import (
    METHOD_PART,
    METHOD_QUERY,
    METHOD_VERIFY,
    METHOD_WAIT,
    MemberState,
    Outcome,
    PartRequest,
    PiecesReply,
    StepRef,
    SyncReply,
    SyncRequest,
    VerifyRequest,
)
from potluck.averaging.allreduce.reduction import decode_chunk
from potluck.averaging.lapses import lapses
from potluck.averaging.role import Role
from potluck.core import compat
from potluck.core.bounded import drop_oldest
from potluck.core.errors import AveragingError, MalformedMessage
from potluck.core.tensors import all_finite
from potluck.net.connection import CallContext, Stream
from potluck.net.identity import PeerID
from potluck.net.origins import Origin, Shares
from potluck.net.transport import Transport

__all__ = ["LINGER_SECONDS", "AllReduceService"]

# After finishing, a member keeps answering "where do you stand" for this long, so a coordinator
# that took over late still learns that the step was committed.
LINGER_SECONDS = 15.0
# Requests that came before their step started here (a member's piece or its wait for the
# coordinator, ahead of our own start) waiting at once, each at most REGISTRATION_WAIT. Any
# caller can name a group id that never starts, so they are shared per origin as connections are
# (`net.origins`): one host holds at most a quarter however many ids it makes up, and an honest
# member's early request still finds room. A member of a group of 64 sends a reducer at most two
# early requests per step (its piece, its wait), so a host's quarter covers the groups one host
# runs; a peer id's share covers its groups with us.
MAX_EARLY_REQUESTS = 1024
EARLY_REQUESTS_PER_SUBNET = 256
EARLY_REQUESTS_PER_IP = 256
EARLY_REQUESTS_PER_PEER = 32
# A client member whose connections with us were all lost this recently, and which has not
# come back, is presumed dead by a step that starts now: it may have died between forming the
# group and the step (a minute covers matchmaking and the snapshot). Peers remembered at most:
# one per peer met in that minute, bounded against churn.
LOST_MEMORY_SECONDS = 60.0
MAX_REMEMBERED_LOSSES = 1024
# A member that checks a reducer's work waits this long for the reducer's pieces of one chunk
# (one chunk from every sender: a few MiB); a reducer that does not answer leaves the result
# unverified there, and that member does not use it.
VERIFY_TIMEOUT = 30.0


@dataclass(frozen=True)
class _Tombstone:
    """What a finished run leaves while it lingers: where this member stood, for a coordinator
    that took over late. A few small fields, never the run's tensors."""

    group: Group
    outcome: Outcome
    state: MemberState


@dataclass
class _Early:
    """A step that has not started here yet, and how many requests wait for it."""

    started: asyncio.Event = field(default_factory=asyncio.Event)
    waiting: int = 0


class AllReduceService:
    """The handlers for all-reduce on one transport, dispatching to the runs under way."""

    def __init__(self, transport: Transport):
        self.transport = transport
        self.runs: dict[bytes, AllReduceRun] = {}
        self.finished: dict[bytes, _Tombstone] = {}
        self.pool = BufferPool()
        self.banned = ban_list(transport)
        self.lapses = lapses(transport)
        self._early: dict[bytes, _Early] = {}  # steps not started here yet that requests wait for
        self._early_shares = Shares("requests waiting for their step to start", MAX_EARLY_REQUESTS,
                                    per_subnet=EARLY_REQUESTS_PER_SUBNET, per_ip=EARLY_REQUESTS_PER_IP,
                                    per_peer=EARLY_REQUESTS_PER_PEER)
        self._linger: dict[bytes, asyncio.TimerHandle] = {}
        self._lost: dict[PeerID, float] = {}  # peer -> loop time its last connection was lost
        transport.add_stream_handler(METHOD_PART, self._on_part)
        transport.add_handler(METHOD_WAIT, self._on_wait)
        transport.add_handler(METHOD_QUERY, self._on_query)
        transport.add_handler(METHOD_VERIFY, self._on_verify)
        transport.watch_disconnects(self._on_disconnect)

    def close(self) -> None:
        for method in (METHOD_PART, METHOD_WAIT, METHOD_QUERY, METHOD_VERIFY):
            self.transport.remove_handler(method)
        self.transport.unwatch_disconnects(self._on_disconnect)
        for timer in self._linger.values():
            timer.cancel()
        self._linger.clear()
        self.finished.clear()

    def _on_disconnect(self, peer_id: PeerID) -> None:
        """A client member that we lost every connection with has died, as far as any
        step can tell: it cannot be dialed, and a live one keeps the connections it opened.
        Without this, the others would wait for its piece or its FINAL reports until a deadline.
        (Members that listen are not presumed dead: a failed dial or stream proves it.)"""
        self._lost.pop(peer_id, None)
        self._lost[peer_id] = asyncio.get_running_loop().time()
        drop_oldest(self._lost, MAX_REMEMBERED_LOSSES)
        for run in list(self.runs.values()):
            if peer_id in run.group.peers:
                member = run.group.peers.index(peer_id)
                if run.group.roles[member] == Role.CLIENT:
                    run.mark_dead(member)

    async def run(self, group: Group, vector: torch.Tensor | None, weight: float, codec: Any,
                  timeout: float, **kwargs: Any) -> tuple[torch.Tensor | None, tuple[int, ...]]:
        """Take part in one all-reduce step with `group`; see the module docstring. The result
        is a buffer of `self.pool`: give it back once read."""
        me = group.peers.index(self.transport.peer_id)
        gid = group.group_id
        if gid in self.runs or gid in self.finished:
            raise AveragingError("this group id is already running here")
        run = AllReduceRun(self, group, me, vector, weight, codec, timeout, pool=self.pool, **kwargs)
        self.runs[gid] = run
        early = self._early.pop(gid, None)
        if early is not None:
            early.started.set()
        now = asyncio.get_running_loop().time()
        for i, (peer, role) in enumerate(zip(group.peers, group.roles, strict=True)):
            lost = self._lost.get(peer)
            if role == Role.CLIENT and lost is not None and now - lost < LOST_MEMORY_SECONDS \
                    and not self.transport.is_connected(peer):
                run.mark_dead(i)  # gone since it joined the group (see _on_disconnect)
        try:
            return await run.run()
        except BaseException:
            if run.result is not None:  # written only by the run's tasks, all cancelled by now
                self.pool.give(run.result)
            raise
        finally:
            del self.runs[gid]
            self.finished[gid] = _Tombstone(group, run.outcome, run.state())
            loop = asyncio.get_running_loop()
            self._linger[gid] = loop.call_later(LINGER_SECONDS, self._forget, gid)

    def group_of(self, gid: bytes) -> Group | None:
        """The group of a step under way here, or finished within LINGER_SECONDS (None: neither)."""
        run = self.runs.get(gid)
        if run is not None:
            return run.group
        tombstone = self.finished.get(gid)
        return None if tombstone is None else tombstone.group

    def _forget(self, gid: bytes) -> None:
        self.finished.pop(gid, None)
        self._linger.pop(gid, None)

    async def _find(self, gid: bytes, ctx: CallContext) -> AllReduceRun | _Tombstone:
        """The run of `gid` here (waiting briefly for it to start), or what is left of it."""
        found = self.runs.get(gid) or self.finished.get(gid)
        if found is None:
            await self._wait_for(gid, ctx.remote.origin, ctx.peer_id)
            found = self.runs.get(gid) or self.finished.get(gid)
        if found is None:
            raise AveragingError("unknown averaging group")
        return found

    async def _wait_for(self, gid: bytes, origin: Origin, caller: PeerID) -> None:
        """Wait up to REGISTRATION_WAIT for step `gid` to start here, holding one of the caller's
        origin's shares. The entry goes with its last waiter however that one ends (its deadline,
        a cancellation, a lost connection): junk group ids leave nothing behind."""
        refusal = self._early_shares.refusal(origin, caller)
        if refusal is not None:
            raise AveragingError(refusal)
        early = self._early.setdefault(gid, _Early())
        self._early_shares.claim(origin, caller)
        early.waiting += 1
        try:
            async with compat.timeout(REGISTRATION_WAIT):
                await early.started.wait()
        except TimeoutError:
            raise AveragingError("unknown averaging group") from None
        finally:
            self._early_shares.release(origin, caller)
            early.waiting -= 1
            if not early.waiting and self._early.get(gid) is early:
                del self._early[gid]

    def _member(self, run: AllReduceRun | _Tombstone, peer_id: PeerID, claimed: Any) -> int:
        if not isinstance(claimed, int) or not 0 <= claimed < len(run.group.peers) \
                or run.group.peers[claimed] != peer_id:
            raise AveragingError("caller is not the group member it claims to be")
        return claimed

    async def open(self, run: AllReduceRun, reducer: int, request: PartRequest) -> Stream:
        """A stream to `reducer`'s part handler; to this member itself, through the loopback."""
        left = max(0.1, run.deadline - asyncio.get_running_loop().time())
        return await self.transport.open_stream(run.group.peers[reducer], METHOD_PART, request.to_wire(),
                                                timeout=left)

    async def _on_part(self, stream: Any, ctx: Any) -> None:
        request = PartRequest.from_wire(stream.request)
        run = await self._find(request.group_id, ctx)
        if isinstance(run, _Tombstone):
            raise AveragingError("this averaging step is over here")
        sender = self._member(run, ctx.peer_id, request.sender)
        reducer = await run.reducer(request.shard)
        await reducer.serve(sender, request.weight, request.abstain, stream)

    async def sync(self, run: AllReduceRun, coordinator: int) -> SyncReply:
        left = max(0.1, run.deadline - asyncio.get_running_loop().time())
        reply = await self.transport.call(run.group.peers[coordinator], METHOD_WAIT,
                                          SyncRequest(run.group.group_id, run.state()).to_wire(), timeout=left)
        try:
            return SyncReply.from_wire(reply, n=len(run.group.peers))
        except MalformedMessage as e:
            raise AveragingError(str(e)) from None  # its coordinator misbehaves: not a network failure

    async def _on_wait(self, request: Any, ctx: Any) -> dict:
        run = await self._find(StepRef.from_wire(request).group_id, ctx)
        state = SyncRequest.from_wire(request, n=len(run.group.peers)).state
        self._member(run, ctx.peer_id, state.member)
        if isinstance(run, _Tombstone):
            if not (run.outcome.committed or run.outcome.aborted):
                raise AveragingError("this member has left the step")
            return SyncReply(run.outcome, ()).to_wire()
        coordinator = run.coordinator
        coordinator.update(state)
        if not coordinator.active:
            raise AveragingError("not the coordinator")
        reply = await coordinator.wait_newer(state.version, {*state.dead, state.member})
        return reply.to_wire()

    async def query(self, run: AllReduceRun, member: int, timeout: float) -> MemberState | None:
        reply = await self.transport.call(run.group.peers[member], METHOD_QUERY, StepRef(run.group.group_id).to_wire(),
                                          timeout=timeout)
        return MemberState.from_wire(reply, n=len(run.group.peers)) if reply is not None else None

    async def _on_query(self, request: Any, ctx: Any) -> dict | None:
        """Where this member stands in a step, or None if it knows no such step (nor the request)."""
        try:
            gid = StepRef.from_wire(request).group_id
        except MalformedMessage:
            return None
        run = self.runs.get(gid)
        if run is not None:
            return run.state().to_wire()
        tombstone = self.finished.get(gid)
        return None if tombstone is None else tombstone.state.to_wire()

    def sign(self, message: bytes) -> bytes:
        return self.transport.identity.sign(message)

    def lapsed(self, peer: PeerID, why: str) -> None:
        self.lapses.note(peer, self.transport.peer_origin(peer), why)


    async def pieces(self, run: AllReduceRun, reducer: int, shard: int, where: tuple[int, int, int],
                     sizes: tuple[int, int], numel: int, version: int) -> Pieces:
        """`reducer`'s pieces of `where` = (chunk, first block, blocks) of `shard`, as it reduced
        them for its FINAL under `version`, whose (chunks, blocks in that chunk) are `sizes`:
        sender -> (weight, its chunk digests, the block digests of that chunk, the values of those
        blocks, decoded: they travel in the codec's form where it is exact, see
        `reduction.wire_form`; its seal of the piece)."""
        left = max(0.1, min(VERIFY_TIMEOUT, run.deadline - asyncio.get_running_loop().time()))
        c, first, count = where
        chunks, blocks = sizes
        request = VerifyRequest(run.group.group_id, run.me, shard, c, first, count, version)
        reply = await self.transport.call(run.group.peers[reducer], METHOD_VERIFY, request.to_wire(), timeout=left)
        pieces: Pieces = {}
        for entry in PiecesReply.from_wire(reply, n=len(run.group.peers), chunks=chunks, blocks=blocks).pieces:
            piece = decode_chunk(run.codec, entry.values, numel) if entry.encoded else entry.values
            if not isinstance(piece, torch.Tensor) or piece.dtype != torch.float32 or piece.numel() != numel \
                    or not all_finite(piece):
                raise AveragingError(f"malformed pieces: each piece must be {numel} finite float32s")
            pieces[entry.sender] = (entry.weight, list(entry.digests), list(entry.blocks), piece.reshape(-1),
                                    entry.seal)
        return pieces

    async def _on_verify(self, request: Any, ctx: Any) -> dict:
        """A member checks my work as a reducer (see `AllReduceRun.answer_check`)."""
        run = self.runs.get(StepRef.from_wire(request).group_id)
        if run is None:
            raise AveragingError("no such step under way here")
        check = VerifyRequest.from_wire(request, n=len(run.group.peers))
        self._member(run, ctx.peer_id, check.member)
        return run.answer_check(check).to_wire()
