"""The all-reduce's wire: its RPC methods and every message they carry, declared once.

Bounds that depend on the group are read from the context: `n`, its number of members
(`MemberState.from_wire(msg, n=len(group.peers))`); a result stream's messages also take the
shard's number of `chunks`, and a reducer's answer to a check the `chunks` of the shard and the
`blocks` of the chunk checked. A sender's pieces travel as its codec's payloads, with no
message around them (see the reducer).
"""

from __future__ import annotations

from typing import Any

import msgpack

from potluck.averaging.accountability import DIGEST_BYTES, decision_message, final_message
from potluck.averaging.allreduce.group import MAX_GROUP_ID_BYTES, Group
from potluck.core.errors import MalformedMessage
from potluck.core.wire import Bool, Bytes, Dict, Field, Int, List, Message, Nested, Number, Raw, Text, Tuple
from potluck.net.identity import SIGNATURE_BYTES

__all__ = [
    "MAX_REASON_CHARS", "METHOD_PART", "METHOD_QUERY", "METHOD_VERIFY", "METHOD_WAIT", "Equivocation",
    "MemberState", "Outcome", "PartRequest", "PieceBlock", "PieceSeal", "PiecesReply", "ResultChunk", "ResultFinal",
    "SignedFinal", "StepRef", "SyncReply", "SyncRequest", "VerifyRequest", "parse_result",
]

METHOD_PART = "potluck.allreduce.part"  # a stream: a sender's piece of a shard in, the results out
METHOD_WAIT = "potluck.allreduce.wait"  # a member's long poll of the coordinator
METHOD_QUERY = "potluck.allreduce.query"  # "where do you stand", from a coordinator that took over
METHOD_VERIFY = "potluck.allreduce.verify"  # a member checking a reducer's work

# Longest failure reason carried in a member's state (it is logged and passed on, never parsed).
MAX_REASON_CHARS = 1000
# Decision versions and chunk indices: counters, far below these.
MAX_VERSION = 2**62
MAX_INDEX = 2**31


def _member(key: str | None = None) -> Int:
    """The index of a member of the group (or of its shard: one per member)."""
    return Int(key, 0, "n")


def _members(key: str | None = None) -> List:
    """At most `n` indices of members of the group."""
    return List(key, _member(), "n")


def _digest(key: str | None = None) -> Bytes:
    return Bytes(key, DIGEST_BYTES, exact=True)


def _signature(key: str | None = None) -> Bytes:
    return Bytes(key, SIGNATURE_BYTES, exact=True)


class Payload(Field):
    """A codec's payload: passed on as received, and checked when decoded; it must be there."""

    def check(self, value: Any, key: str, what: str, context: Any) -> Any:
        if value is None:
            raise MalformedMessage(what, f"{key!r} is missing")
        return value

    def fast(self, v: str) -> str | None:
        return f"{v} is not None"


class Equivocation(Message, what="equivocation", positional=True):
    """Proof that `reducer` sent two members different results of `shard` under one decision:
    its two signed FINALs. Anyone can check it with nothing but the group."""

    reducer: int = _member()
    shard: int = _member()
    version: int = Int(None, 0, MAX_VERSION)
    senders: tuple[int, ...] = _members()
    roots: tuple[bytes, bytes] = Tuple(None, (_digest(), _digest()))
    signatures: tuple[bytes, bytes] = Tuple(None, (_signature(), _signature()))

    def holds(self, group: Group) -> bool:
        key = group.peers[self.reducer]
        return self.roots[0] != self.roots[1] and all(
            key.verify(sig, final_message(group.group_id, self.shard, self.version, self.senders, root))
            for root, sig in zip(self.roots, self.signatures, strict=True))


class Outcome(Message, what="averaging decision", frozen=False):
    """What the coordinator has decided so far; `version` grows with each change."""

    version: int = Int("v", 0, MAX_VERSION)
    senders: tuple[int, ...] = _members("s")
    assignment: dict[int, int] = Dict("a", _member(), _member(), "n", default_factory=None)  # shard -> reducer
    committed: bool = Bool("c")
    aborted: str | None = Text("x", MAX_REASON_CHARS, default=None)
    # shard -> digest of the pieces it averages (the senders' roots, see accountability.py),
    # for the shards whose reducer reported at the first decision
    digests: dict[int, bytes] = Dict("d", _member(), _digest(), "n")
    equivocation: Equivocation | None = Nested("eq", Equivocation, default=None)  # why it aborted, if so
    # The coordinator that made it, and its signature of it (`decision_message`): a member shows the
    # decisions it follows to a coordinator that takes over, which must not take a member's word.
    by: int | None = Int("by", 0, "n", default=None)
    signature: bytes | None = Bytes("sig", SIGNATURE_BYTES, exact=True, default=None)

    def message(self, group_id: bytes) -> bytes:
        """What its coordinator signs (see `accountability.decision_message`)."""
        proof = b"" if self.equivocation is None else msgpack.packb(self.equivocation.to_wire(), use_bin_type=True)
        return decision_message(group_id, self.version, self.senders, self.assignment, self.committed,
                                self.aborted, self.digests, proof)

    def decided_by(self, group: Group, coordinator: int) -> bool:
        """Whether `coordinator`, or a coordinator before it in the group's order (one it took over
        from), signed this decision as it stands; the first, before any decision, decides nothing."""
        if self.version == 0 and not (self.committed or self.aborted):
            return True
        order = group.coordinators()
        return self.by in order and coordinator in order and order.index(self.by) <= order.index(coordinator) \
            and self.signature is not None and group.peers[self.by].verify(self.signature, self.message(group.group_id))

    @classmethod
    def first(cls, assignment: dict[int, int]) -> Outcome:
        """Before any decision: every shard with the reducer the group gave it."""
        return cls(0, (), assignment, False)

    @classmethod
    def aborting(cls, version: int, reason: str, equivocation: Equivocation | None = None) -> Outcome:
        return cls(version, (), {}, False, reason, equivocation=equivocation)


class PartRequest(Message, what="part request"):
    """Opens a sender's stream of one shard's piece to its reducer. Its bounds do not depend on
    the group (the handler checks the rest once it has found the step)."""

    group_id: bytes = Bytes("g", MAX_GROUP_ID_BYTES)
    shard: int = Int("j", 0, MAX_INDEX)
    sender: int = Int("s", 0, MAX_INDEX)
    weight: float = Number("w")
    abstain: bool = Bool("x")


class PieceSeal(Message, what="piece seal"):
    """A sender's last message on its piece's stream: its signature of the piece's root (see
    accountability.seal_message), which lets any member check what it sent."""

    signature: bytes = _signature("seal")


class ResultFinal(Message, what="result"):
    """The reducer's last message: the senders the shard averages, under outcome `version`, and
    its signature of the result it sent (see accountability.final_message)."""

    senders: tuple[int, ...] = _members("final")
    version: int = Int("v", 0, MAX_VERSION)
    signature: bytes = _signature("sig")


class ResultChunk(Message, what="result"):
    """A reducer's averaged chunk `chunk` of the shard, encoded by the group's codec."""

    chunk: int = Int("c", 0, "chunks")
    payload: Any = Payload("d")


def parse_result(msg: Any, chunks: int, n: int) -> ResultChunk | ResultFinal:
    """A message on a sender's result stream: its FINAL if it says so, else a chunk (of a shard
    of `chunks` chunks, in a group of `n` members). The chunks are the hot path: one call each,
    straight to their declared parse."""
    if msg.__class__ is dict and "final" not in msg:
        return ResultChunk.from_wire(msg, chunks=chunks)
    return ResultFinal.from_wire(msg, n=n)


class SignedFinal(Message, what="signed final", positional=True):
    """A reducer's FINAL as one receiver got it: the decision, the senders, the root of the
    result it received, and the reducer's signature of them."""

    version: int = Int(None, 0, MAX_VERSION)
    senders: tuple[int, ...] = _members()
    root: bytes = _digest()
    signature: bytes = _signature()


class MemberState(Message, what="member state"):
    """Where one member stands in a step, for the coordinator: its index, the members it found
    dead, its reducers' reports (shard -> senders complete), the shards it has final results of,
    the outcome version it last saw and that outcome, and why a repair failed (if it did); for
    accountability, the roots of the pieces it sent (shard -> root) and of those its reducers
    received (shard -> sender -> root), the outcome version whose results it has checked, and, as
    a reducer, whose checks of its FINALs it answered (shard -> (the FINAL's version, members)),
    which lets the coordinator commit while those members finish their checks."""

    member: int = _member("m")
    dead: tuple[int, ...] = _members("dead")
    reports: dict[int, tuple[int, ...]] = Dict("rep", _member(), _members(), "n", default_factory=None)
    final: tuple[int, ...] = _members("final")
    version: int = Int("v", 0, MAX_VERSION)
    outcome: Outcome = Nested("o", Outcome)
    failure: str | None = Text("fail", MAX_REASON_CHARS, default=None)
    sent: dict[int, bytes] = Dict("sent", _member(), _digest(), "n")
    received: dict[int, dict[int, bytes]] = Dict("recv", _member(), Dict(None, _member(), _digest(), "n"), "n")
    checked: int = Int("chk", 0, MAX_VERSION, default=0)
    finals: dict[int, SignedFinal] = Dict("fin", _member(), Nested(None, SignedFinal), "n")  # what reducers signed me
    answered: dict[int, tuple[int, tuple[int, ...]]] = Dict("ans", _member(), Tuple(None, (Int(None, 0, MAX_VERSION),
                                                                                           _members())), "n")


class StepRef(Message, what="averaging request"):
    """The step a request is about, read first: the rest is checked against that step's group."""

    group_id: bytes = Bytes("g", MAX_GROUP_ID_BYTES)


class SyncRequest(Message, what="sync request"):
    """A member's wait for the coordinator's next decision, carrying where it stands."""

    group_id: bytes = Bytes("g", MAX_GROUP_ID_BYTES)
    state: MemberState = Nested("st", MemberState)


class SyncReply(Message, what="sync reply"):
    """The coordinator's answer to a wait: its decision, and every member it knows dead (a
    member's reducers then stop waiting for their pieces: not every member sees every death)."""

    outcome: Outcome = Nested("o", Outcome)
    dead: tuple[int, ...] = _members("dead")


class VerifyRequest(Message, what="verify request"):
    """A member (`member`) asks a reducer for its pieces of `count` blocks from block `first` of
    chunk `chunk` of `shard`, whose FINAL it holds under `version` (the reducer checks the block
    bounds against its chunk, and answers only for that FINAL: an early one may have been
    replaced by the decision's meanwhile)."""

    group_id: bytes = Bytes("g", MAX_GROUP_ID_BYTES)
    member: int = _member("m")
    shard: int = _member("j")
    chunk: int = Int("c", 0, MAX_INDEX)
    first: int = Int("b", 0, MAX_INDEX)
    count: int = Int("k", 1, MAX_INDEX)
    version: int = Int("v", 0, MAX_VERSION)


class PieceBlock(Message, what="piece", positional=True):
    """One sender's piece of the blocks checked, as the reducer holds it: the sender, its weight,
    its chunk digests, the block digests of the chunk checked, and the blocks' values, in the
    codec's form (`encoded`) where that is exact, else as float32 (checked once decoded); and
    the sender's seal of the piece (accountability.sealed_block checks them all together)."""

    sender: int = _member()
    weight: float = Number()
    digests: tuple[bytes, ...] = List(None, _digest(), "chunks", length="chunks")
    blocks: tuple[bytes, ...] = List(None, _digest(), "blocks", length="blocks")
    values: Any = Raw()
    encoded: bool = Bool()
    seal: bytes = _signature()


class PiecesReply(Message, what="pieces"):
    """A reducer's answer to a check: one `PieceBlock` per sender of the shard."""

    pieces: tuple[PieceBlock, ...] = List("p", Nested(None, PieceBlock), "n")
