"""Fault-tolerant butterfly all-reduce: every survivor ends with bit-identical tensors, or all fail.

The group's flat vector is split into one contiguous shard per reducing member. Every sender
streams its piece of each shard to that shard's reducer in chunks; the reducer averages a chunk as
soon as every expected sender's piece of it is in and streams the result back on the same stream,
so sending, reducing and receiving overlap.

Failures are settled by a coordinator (the first listening member that is alive):
  1. each reducer reports which senders delivered its whole shard;
  2. the coordinator decides the sender set S* (the intersection) and gives the shards of dead
     reducers to survivors; every reducer (re)computes its shards over exactly S*, and says FINAL;
  3. once every live receiver holds every shard FINAL, the coordinator commits; only then do
     members use the result.
A shard's value is a deterministic function of S* and the senders' pieces (fixed sender order,
separate multiply and add, so any peer recomputing it gets the same bits). Members long-poll the
coordinator; when its connection breaks they turn to the next one, which asks everyone where they
stand and adopts the newest decision (or commit) any of them saw. Every stage has a deadline.
"""

from __future__ import annotations

import asyncio
import logging
import math
import secrets
import weakref
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from potluck.averaging.accountability import (
    DIGEST_BYTES,
    VERIFY_BLOCK,
    ban_list,
    block_digests,
    blocks_digest,
    chunk_digest,
    final_message,
    piece_root,
    result_root,
    shard_digest,
)
from potluck.averaging.robust import aggregate, far_pieces
from potluck.averaging.role import Role
from potluck.compression.codec import Codec
from potluck.core import compat
from potluck.core.errors import AveragingError, EndOfStream, MalformedMessage, NetworkError, PotluckError, RemoteError
from potluck.core.runner import retrieve_exception
from potluck.core.tensors import all_finite
from potluck.core.wire import (
    bool_field,
    bytes_field,
    int_field,
    int_value,
    list_field,
    number_field,
    number_value,
    text_field,
    wire_map,
)
from potluck.net.connection import Stream
from potluck.net.identity import SIGNATURE_BYTES, PeerID
from potluck.net.transport import Transport

logger = logging.getLogger(__name__)

MODES = tuple(r.value for r in Role)  # the wire values of the roles: "node", "client", "aux"

# Elements per streamed chunk: 1 MiB of float32 pipelines well and amortizes per-message cost.
CHUNK_ELEMENTS = 2**18
# A sender that sends nothing for this long is excluded (it stalled or died silently).
SENDER_TIMEOUT = 10.0
# Streams may arrive before this peer has started the same step; they wait this long for it.
REGISTRATION_WAIT = 10.0
# After finishing, a member keeps answering "where do you stand" for this long, so a coordinator
# that took over late still learns that the step was committed.
LINGER_SECONDS = 15.0
# Groups a peer waits for at once before they start here (guards memory against junk group ids).
MAX_PENDING_GROUPS = 1000
# A client-mode peer whose connections with us were all lost this recently, and which has not
# come back, is presumed dead by a step that starts now: it may have died between forming the
# group and the step (a minute covers matchmaking and the snapshot). Peers remembered at most:
# one per peer met in that minute, bounded against churn.
LOST_MEMORY_SECONDS = 60.0
MAX_REMEMBERED_LOSSES = 1024
# Buffers kept for the next rounds: a member's snapshot and result and its reduced shard, for a
# vector of up to 32M floats (128 MiB). Reusing them keeps a long run from allocating (and the
# kernel from zeroing and faulting in, page by page) a model's worth of memory per round: that
# was a third of a 16M-float round's CPU. Larger vectors get fresh buffers every round.
MAX_POOLED_BYTES = 320 * 2**20
# Pooled buffers are sized up to a multiple of this many elements, so shards whose size changes
# a little between rounds (load balancing) still fit the buffers of the last round.
POOL_GRANULE = 2**16
# Stretches a step's receiving time is cut into for the download estimate: enough that the
# stretch where fast senders fill our link stands out from a slow sender's tail, few enough that
# each holds several chunks (a burst of chunks that sat in buffers is not a rate).
DOWNLOAD_BINS = 8
# Rounds of reassigning the shards of reducers that died after the first decision.
MAX_REPAIRS = 2
# A sender's weight (its own claim, e.g. its samples) counts for at most this many times the
# median weight of the senders of the chunk: a member claiming 1e30 weighs as much as two typical
# members, not all of them. Honest peers twice as fast as the median lose a little weight (in
# averaging, a slightly different mix of members that are all honest), nothing else.
MAX_WEIGHT_OVER_MEDIAN = 2.0
# A reducer names a sender (logs a warning: `ShardReducer`) whose claimed weight is above this many
# times that median. Honest weights are counts of the same kind (samples) over the same stretch
# of time: a thousand-fold is not a faster peer. Among fewer than 3 positive weights none is named
# (with two, a liar claiming almost nothing would be the median and make the honest one look huge).
NAMED_WEIGHT_OVER_MEDIAN = 1000.0

METHOD_PART = "potluck.allreduce.part"
METHOD_UPDATE = "potluck.allreduce.update"
METHOD_WAIT = "potluck.allreduce.wait"
METHOD_QUERY = "potluck.allreduce.query"
METHOD_VERIFY = "potluck.allreduce.verify"
# A member that checks a reducer's work waits this long for the reducer's pieces of one chunk
# (one chunk from every sender: a few MiB); a reducer that does not answer leaves the result
# unverified there, and that member does not use it.
VERIFY_TIMEOUT = 30.0
# A member that another member reports dead is asked where it stands, and counts as dead only if
# it does not answer within this long: the report is the reporter's word, and a false one would
# leave a live member out (and move its shard, maybe onto the reporter). Long enough for a loaded
# peer to answer one small request, short next to SENDER_TIMEOUT: a real death is acted on soon.
DEATH_PROBE_TIMEOUT = 2.0
# A coordinator that took over asks each member where it stands within this long.
QUERY_TIMEOUT = 5.0
# Aggregations computed coordinate by coordinate (see robust.py): a block of a chunk can be
# recomputed alone. Others (CenteredClip takes norms over the chunk) are checked a chunk at a time.
ELEMENTWISE = ("mean", "trimmed_mean")
# Codecs under which a block of a chunk encodes alone as it does inside the chunk: those that
# encode each value alone, and the blockwise ones whose blocks tile VERIFY_BLOCK. The others
# (scaled_fp16, uniform8, quantile8 scale by the whole chunk; codecs unknown here) are checked a
# chunk at a time: a block re-encoded alone would differ, and accuse honest reducers.
VALUEWISE_CODECS = ("none", "fp16", "sparse")
BLOCKWISE_CODECS = ("blockwise8", "blockwise4")


@dataclass(frozen=True)
class Group:
    """Who averages together and who reduces what; identical on every member."""

    group_id: bytes
    peers: tuple[PeerID, ...]
    modes: tuple[str, ...]
    part_sizes: tuple[int, ...]  # elements of the flat vector each member reduces (0: none)

    def __post_init__(self) -> None:
        n = len(self.peers)
        if not (len(self.modes) == len(self.part_sizes) == n) or n == 0:
            raise ValueError("group fields must have one entry per member")
        if any(m not in MODES for m in self.modes):
            raise ValueError(f"modes must be among {MODES}")
        if any(s < 0 for s in self.part_sizes) or any(
                s and m == "client" for s, m in zip(self.part_sizes, self.modes, strict=True)):
            raise ValueError("client-mode members cannot reduce")

    @property
    def total(self) -> int:
        return sum(self.part_sizes)

    @property
    def shards(self) -> list[int]:
        return [j for j, s in enumerate(self.part_sizes) if s]

    @property
    def receivers(self) -> list[int]:
        return [i for i, m in enumerate(self.modes) if m != "aux"]

    def bounds(self, shard: int) -> tuple[int, int]:
        start = sum(self.part_sizes[:shard])
        return start, start + self.part_sizes[shard]

    def coordinators(self) -> list[int]:
        """Succession order of coordinators: members that can be dialed."""
        return [i for i, m in enumerate(self.modes) if m != "client"]


@dataclass(frozen=True)
class Equivocation:
    """Proof that `reducer` sent two members different results of `shard` under one decision:
    its two signed FINALs. Anyone can check it with nothing but the group."""

    reducer: int
    shard: int
    version: int
    senders: tuple[int, ...]
    roots: tuple[bytes, bytes]
    signatures: tuple[bytes, bytes]

    def holds(self, group: Group) -> bool:
        key = group.peers[self.reducer]
        return self.roots[0] != self.roots[1] and all(
            key.verify(sig, final_message(group.group_id, self.shard, self.version, self.senders, root))
            for root, sig in zip(self.roots, self.signatures, strict=True))

    def to_wire(self) -> list:
        return [self.reducer, self.shard, self.version, list(self.senders), *self.roots, *self.signatures]

    @classmethod
    def from_wire(cls, msg: Any, what: str, n: int) -> Equivocation:
        if not isinstance(msg, (list, tuple)) or len(msg) != 8:
            raise MalformedMessage(what, "'eq' must be [reducer, shard, version, senders, 2 roots, 2 signatures]")
        def of(value: Any, size: int) -> bytes:
            return bytes_field({"eq": value}, "eq", what, size, exact=True)
        return cls(int_value(msg[0], "eq", what, 0, n), int_value(msg[1], "eq", what, 0, n),
                   int_value(msg[2], "eq", what, 0, 2**62), _members({"eq": msg[3]}, "eq", what, n),
                   (of(msg[4], DIGEST_BYTES), of(msg[5], DIGEST_BYTES)),
                   (of(msg[6], SIGNATURE_BYTES), of(msg[7], SIGNATURE_BYTES)))


@dataclass
class Outcome:
    """What the coordinator has decided so far; `version` grows with each change."""

    version: int = 0
    senders: tuple[int, ...] = ()
    assignment: dict[int, int] = field(default_factory=dict)  # shard -> reducer member
    committed: bool = False
    aborted: str | None = None
    # shard -> digest of the pieces it averages (the senders' roots, see accountability.py),
    # for the shards whose reducer reported at the first decision
    digests: dict[int, bytes] = field(default_factory=dict)
    equivocation: Equivocation | None = None  # why the step was aborted, if a reducer equivocated

    def to_wire(self) -> dict:
        return {"v": self.version, "s": list(self.senders),
                "a": [[j, r] for j, r in sorted(self.assignment.items())],
                "c": self.committed, "x": self.aborted, "d": _digests_wire(self.digests),
                "eq": None if self.equivocation is None else self.equivocation.to_wire()}

    @classmethod
    def from_wire(cls, msg: Any, group: Group) -> Outcome:
        what, n = "averaging decision", len(group.peers)
        msg = wire_map(msg, what)
        assignment: dict[int, int] = {}
        for pair in list_field(msg, "a", what, n):
            if not isinstance(pair, (list, tuple)) or len(pair) != 2:
                raise MalformedMessage(what, "'a' entries must be [shard, reducer] pairs")
            assignment[int_value(pair[0], "a", what, 0, n)] = int_value(pair[1], "a", what, 0, n)
        return cls(int_field(msg, "v", what, 0, 2**62), _members(msg, "s", what, n), assignment,
                   bool_field(msg, "c", what), text_field(msg, "x", what, MAX_REASON_CHARS, optional=True),
                   _digests(msg.get("d", []), "d", what, n),
                   None if msg.get("eq") is None else Equivocation.from_wire(msg["eq"], what, n))


# Longest group id accepted from a peer (ours are 32-byte digests).
MAX_GROUP_ID_BYTES = 64
# Longest failure reason carried in a member's state (it is logged and passed on, never parsed).
MAX_REASON_CHARS = 1000


def _members(msg: Mapping, key: str, what: str, n: int) -> tuple[int, ...]:
    """At most `n` indices of members of an `n`-member group."""
    return tuple(list_field(msg, key, what, n, each=lambda v: int_value(v, key, what, 0, n)))


def _digests_wire(digests: Mapping[int, bytes]) -> list:
    return [[i, d] for i, d in sorted(digests.items())]


def _digests(value: Any, key: str, what: str, n: int) -> dict[int, bytes]:
    """At most `n` [member or shard index, digest] pairs."""
    digests: dict[int, bytes] = {}
    for pair in list_field({key: value}, key, what, n):
        if not isinstance(pair, (list, tuple)) or len(pair) != 2 or not isinstance(pair[1], bytes) \
                or len(pair[1]) != DIGEST_BYTES:
            raise MalformedMessage(what, f"'{key}' entries must be [index, digest] pairs")
        digests[int_value(pair[0], key, what, 0, n)] = pair[1]
    return digests


@dataclass(frozen=True)
class PartRequest:
    """Opens a sender's stream of one shard's piece to its reducer."""

    group_id: bytes
    shard: int
    sender: int
    weight: float
    abstain: bool

    def to_wire(self) -> dict:
        return {"g": self.group_id, "j": self.shard, "s": self.sender, "w": self.weight, "x": self.abstain}

    @classmethod
    def from_wire(cls, msg: Any) -> PartRequest:
        """Types and ranges that do not depend on the group (the handler checks the rest)."""
        what, big = "part request", 2**31
        msg = wire_map(msg, what)
        return cls(bytes_field(msg, "g", what, MAX_GROUP_ID_BYTES), int_field(msg, "j", what, 0, big),
                   int_field(msg, "s", what, 0, big), number_field(msg, "w", what), bool_field(msg, "x", what))


@dataclass(frozen=True)
class ResultChunk:
    """A reducer's averaged chunk `chunk` of the shard, encoded by the group's codec."""

    chunk: int
    payload: Any

    def to_wire(self) -> dict:
        return {"c": self.chunk, "d": self.payload}


@dataclass(frozen=True)
class ResultFinal:
    """The reducer's last message: the senders the shard averages, under outcome `version`, and
    its signature of the result it sent (see accountability.final_message)."""

    senders: tuple[int, ...]
    version: int
    signature: bytes

    def to_wire(self) -> dict:
        return {"final": list(self.senders), "v": self.version, "sig": self.signature}


def parse_result(msg: Any, chunks: int, members: int) -> ResultChunk | ResultFinal:
    """A message on a sender's result stream, checked against the shard's `chunks` and the
    group's `members`; the payload is checked when decoded."""
    what = "result"
    msg = wire_map(msg, what)
    if "final" in msg:
        return ResultFinal(_members(msg, "final", what, members), int_field(msg, "v", what, 0, 2**62),
                           bytes_field(msg, "sig", what, SIGNATURE_BYTES, exact=True))
    if "d" not in msg:
        raise MalformedMessage(what, "'d' is missing")
    return ResultChunk(int_field(msg, "c", what, 0, chunks), msg["d"])


@dataclass(frozen=True)
class SignedFinal:
    """A reducer's FINAL as one receiver got it: the decision, the senders, the root of the
    result it received, and the reducer's signature of them."""

    version: int
    senders: tuple[int, ...]
    root: bytes
    signature: bytes


@dataclass(frozen=True)
class MemberState:
    """Where one member stands in a step, for the coordinator: its index, the members it found
    dead, its reducers' reports (shard -> senders complete), the shards it has final results of,
    the outcome version it last saw and that outcome, and why a repair failed (if it did); for
    accountability, the roots of the pieces it sent (shard -> root) and of those its reducers
    received (shard -> sender -> root), and the outcome version whose results it has checked."""

    member: int
    dead: tuple[int, ...]
    reports: dict[int, tuple[int, ...]]
    final: tuple[int, ...]
    version: int
    outcome: Outcome
    failure: str | None = None
    sent: dict[int, bytes] = field(default_factory=dict)
    received: dict[int, dict[int, bytes]] = field(default_factory=dict)
    checked: int = 0
    finals: dict[int, SignedFinal] = field(default_factory=dict)  # shard -> what its reducer signed to me

    def to_wire(self) -> dict:
        return {"m": self.member, "dead": list(self.dead),
                "rep": [[j, list(c)] for j, c in sorted(self.reports.items())],
                "final": list(self.final), "v": self.version, "o": self.outcome.to_wire(), "fail": self.failure,
                "sent": _digests_wire(self.sent),
                "recv": [[j, _digests_wire(r)] for j, r in sorted(self.received.items())], "chk": self.checked,
                "fin": [[j, f.version, list(f.senders), f.root, f.signature] for j, f in sorted(self.finals.items())]}

    @classmethod
    def from_wire(cls, msg: Any, group: Group) -> MemberState:
        """Validate a member's state message (it comes from the network) against `group`."""
        what, n = "member state", len(group.peers)
        msg = wire_map(msg, what)
        parsed: dict[int, tuple[int, ...]] = {}
        for pair in list_field(msg, "rep", what, n):
            if not isinstance(pair, (list, tuple)) or len(pair) != 2:
                raise MalformedMessage(what, "'rep' entries must be [shard, senders] pairs")
            parsed[int_value(pair[0], "rep", what, 0, n)] = _members({"rep": pair[1]}, "rep", what, n)
        failure = text_field(msg, "fail", what, MAX_REASON_CHARS, optional=True)
        try:
            outcome = Outcome.from_wire(msg.get("o"), group)
        except MalformedMessage as e:
            raise MalformedMessage(what, f"'o': {e.field}") from None
        received: dict[int, dict[int, bytes]] = {}
        for pair in list_field(msg, "recv", what, n):
            if not isinstance(pair, (list, tuple)) or len(pair) != 2:
                raise MalformedMessage(what, "'recv' entries must be [shard, roots] pairs")
            received[int_value(pair[0], "recv", what, 0, n)] = _digests(pair[1], "recv", what, n)
        finals: dict[int, SignedFinal] = {}
        for entry in list_field(msg, "fin", what, n):
            if not isinstance(entry, (list, tuple)) or len(entry) != 5:
                raise MalformedMessage(what, "'fin' entries must be [shard, version, senders, root, signature]")
            finals[int_value(entry[0], "fin", what, 0, n)] = SignedFinal(
                int_value(entry[1], "fin", what, 0, 2**62), _members({"fin": entry[2]}, "fin", what, n),
                bytes_field({"fin": entry[3]}, "fin", what, DIGEST_BYTES, exact=True),
                bytes_field({"fin": entry[4]}, "fin", what, SIGNATURE_BYTES, exact=True))
        return cls(int_field(msg, "m", what, 0, n), _members(msg, "dead", what, n), parsed,
                   _members(msg, "final", what, n), int_field(msg, "v", what, 0, 2**62), outcome, failure,
                   _digests(msg.get("sent"), "sent", what, n), received, int_field(msg, "chk", what, 0, 2**62),
                   finals)


@dataclass(frozen=True)
class SyncRequest:
    """A member's wait for the coordinator's next decision, carrying where it stands."""

    group_id: bytes
    state: MemberState

    def to_wire(self) -> dict:
        return {"g": self.group_id, "st": self.state.to_wire()}

    @staticmethod
    def group_id_of(msg: Any) -> bytes:
        """The step it is about: needed first, as the state is checked against that step's group."""
        return bytes_field(wire_map(msg, "sync request"), "g", "sync request", MAX_GROUP_ID_BYTES)

    @classmethod
    def from_wire(cls, msg: Any, group: Group) -> SyncRequest:
        return cls(cls.group_id_of(msg), MemberState.from_wire(msg.get("st"), group))


@dataclass(frozen=True)
class SyncReply:
    """The coordinator's answer to a wait: its decision, and every member it knows dead (a
    member's reducers then stop waiting for their pieces: not every member sees every death)."""

    outcome: Outcome
    dead: tuple[int, ...]

    def to_wire(self) -> dict:
        return {"o": self.outcome.to_wire(), "dead": list(self.dead)}

    @classmethod
    def from_wire(cls, msg: Any, group: Group) -> SyncReply:
        what = "sync reply"
        msg = wire_map(msg, what)
        try:
            outcome = Outcome.from_wire(msg.get("o"), group)
        except MalformedMessage as e:
            raise MalformedMessage(what, f"'o': {e.field}") from None
        return cls(outcome, _members(msg, "dead", what, len(group.peers)))


@dataclass
class TransferStats:
    """This member's uploads to and downloads from other peers during one step, for its
    bandwidth estimates.

    `busy_seconds` is the time during which at least one send to another peer was in flight
    (a send returns once the transport has taken the frame: on the emulated network, when this
    peer's upload of it is done). Waiting for data to reduce or for slower peers is not busy
    time, so bytes / busy time measures this peer's own upload, not the group's pace.
    Sends to itself (a member reducing its own shard) count for neither.
    """

    sent_bytes: int = 0
    busy_seconds: float = 0.0
    in_flight: int = 0
    busy_since: float = 0.0
    received_bytes: int = 0
    # (previous arrival, this arrival, bytes) of each chunk received from another peer after the
    # first of its stream: how long that chunk was on its way to us. One per chunk of the step.
    arrivals: list[tuple[float, float, int]] = field(default_factory=list)

    @property
    def upload(self) -> float | None:
        """Measured bytes/s, or None if nothing was sent."""
        return self.sent_bytes / self.busy_seconds if self.sent_bytes and self.busy_seconds > 0 else None

    def received(self, channel: Any, previous: float | None, nbytes: int) -> float | None:
        """Count a chunk that just arrived on `channel`, whose last chunk arrived at `previous`
        (None: this is its first, and how long that one took is unknown); returns the time to
        pass as `previous` next time. Chunks from ourselves count for nothing."""
        if getattr(channel, "loopback", False):
            return None
        now = asyncio.get_running_loop().time()
        if previous is not None:
            self.received_bytes += nbytes
            self.arrivals.append((previous, now, nbytes))
        return now

    @property
    def download(self) -> float | None:
        """Measured bytes/s received: the busiest stretch of the step. Each chunk after its
        stream's first is spread evenly over the time since the previous one (how long it was
        on its way); the step is cut into DOWNLOAD_BINS stretches, and the fullest one gives
        the rate. A slow sender stretches the step but not the stretch where fast senders
        filled our link; waiting for a stream to start is not counted."""
        if not self.received_bytes or not self.arrivals:
            return None
        begin = min(a for a, _, _ in self.arrivals)
        width = (max(b for _, b, _ in self.arrivals) - begin) / DOWNLOAD_BINS
        if width <= 0:
            return None
        filled = [0.0] * DOWNLOAD_BINS
        for start, stop, nbytes in self.arrivals:
            if stop <= start:
                continue  # arrived with the previous chunk: its bytes show in no stretch
            rate = nbytes / (stop - start)
            first, last = int((start - begin) / width), min(DOWNLOAD_BINS - 1, int((stop - begin) / width))
            for k in range(first, last + 1):
                overlap = min(stop, begin + (k + 1) * width) - max(start, begin + k * width)
                filled[k] += rate * max(0.0, overlap)
        return max(filled) / width if max(filled) > 0 else None

    async def send(self, channel: Any, message: Any) -> None:
        if channel.loopback:  # this member's own shard: it never leaves the process
            await channel.send(message)
            return
        loop = asyncio.get_running_loop()
        if self.in_flight == 0:
            self.busy_since = loop.time()
        self.in_flight += 1
        try:
            await channel.send(message)
            self.sent_bytes += _payload_bytes(message)
        finally:
            self.in_flight -= 1
            if self.in_flight == 0:
                self.busy_seconds += loop.time() - self.busy_since


def _payload_bytes(message: Any) -> int:
    """Bytes of the tensors in a (possibly nested) message dict; small fields are ignored."""
    if isinstance(message, torch.Tensor):
        return message.numel() * message.element_size()
    if isinstance(message, dict):
        return sum(_payload_bytes(v) for v in message.values() if isinstance(v, (dict, torch.Tensor)))
    return 0


class BufferPool:
    """Float32 buffers reused from round to round (see MAX_POOLED_BYTES), largest kept first."""

    def __init__(self, max_bytes: int = MAX_POOLED_BYTES):
        self.max_bytes = max_bytes
        self._free: list[torch.Tensor] = []
        self._bytes = 0

    def take(self, numel: int) -> torch.Tensor:
        """A buffer of at least `numel` elements (its contents are arbitrary)."""
        fits = [i for i, b in enumerate(self._free) if b.numel() >= numel]  # largest first
        if not fits:
            # The largest buffer that is too small is most likely one this request outgrew (a
            # shard that load balancing made larger): drop it, so that the pool holds what rounds
            # use now rather than filling up to its bound with stale sizes.
            # It grew once, so it may grow again: leave it an eighth more room.
            if self._free:
                self._bytes -= self._free.pop(0).numel() * 4
                numel += numel // 8
            return torch.empty(-(-max(numel, 1) // POOL_GRANULE) * POOL_GRANULE, dtype=torch.float32)
        buffer = self._free.pop(fits[-1])  # the smallest that fits
        self._bytes -= buffer.numel() * 4
        return buffer

    def give(self, buffer: torch.Tensor) -> None:
        """Return a buffer from `take` (or a view of one) once nothing uses it any more."""
        if buffer._base is not None:
            buffer = buffer._base
        self._free.append(buffer)
        self._bytes += buffer.numel() * 4
        self._free.sort(key=torch.Tensor.numel, reverse=True)
        while self._bytes > self.max_bytes:
            self._bytes -= self._free.pop().numel() * 4


def _weighted_chunk(pieces: dict[int, list[torch.Tensor]], weights: dict[int, float], senders: tuple[int, ...],
                    c: int, out: torch.Tensor, scratch: torch.Tensor) -> None:
    """Write into `out` the average of chunk `c` over `senders`, computed the same way on every peer.

    A running mean in a fixed order: every peer that re-reduces gets the same bits, and peers
    that all hold the same values get exactly those values back (so averaging never makes
    identical replicas drift apart by rounding). `scratch` (at least `out`'s size) holds the
    intermediate terms, so nothing is allocated per chunk.
    """
    equal = sum(weights[s] for s in senders) <= 0  # all weights zero: a plain mean
    term = scratch[:out.numel()]
    mean: torch.Tensor | None = None  # the first piece itself until a second one comes
    seen = 0.0
    for s in senders:
        weight = 1.0 if equal else weights[s]
        if weight <= 0:
            continue
        piece = pieces[s][c]
        if mean is None:
            mean = piece
        else:  # separate ops (no fused multiply-add) for identical bits everywhere
            torch.sub(piece, mean, out=term)
            term.mul_(weight / (seen + weight))
            mean = torch.add(mean, term, out=out)
        seen += weight
    if mean is None:
        out.zero_()
    elif mean is not out:
        out.copy_(mean)


def bounded_weights(weights: Mapping[int, float], senders: tuple[int, ...]) -> dict[int, float]:
    """The weights `senders` count with: each at most MAX_WEIGHT_OVER_MEDIAN times the lower
    median of their positive weights (zero weights, meaning "leave me out", are no evidence of a
    typical weight). A function of the weights this reducer was told and of `senders` only, so
    every peer that reduces the same chunk over the same senders gets the same bits. A sender
    that tells different reducers different weights is bounded in each shard all the same.
    (Weights are finite and >= 0: PartRequest refuses others.)"""
    positive = sorted(weights[s] for s in senders if weights[s] > 0)
    if not positive:
        return {s: weights[s] for s in senders}
    cap = MAX_WEIGHT_OVER_MEDIAN * positive[(len(positive) - 1) // 2]
    return {s: min(weights[s], cap) for s in senders}


def reduce_chunk(aggregation: str, pieces: Mapping[int, Any], weights: Mapping[int, float], senders: tuple[int, ...],
                 c: int, out: torch.Tensor, scratch: torch.Tensor, measure: bool = False) -> dict[int, float]:
    """Chunk `c` reduced over `senders` into `out`, with their bounded weights, by the group's
    aggregation (see `potluck.averaging.robust`): as every reducer computes it, and every member
    that checks a reducer's work. With `measure` and a robust aggregation: each sender's distance
    from the robust centre (the mean has none, and measuring against it would cost a pass)."""
    bounded = bounded_weights(weights, senders)
    if aggregation == "mean":
        _weighted_chunk(pieces, bounded, senders, c, out, scratch)
        return {}
    distances = aggregate(aggregation, [pieces[s][c] for s in senders], [bounded[s] for s in senders], out, measure)
    return {senders[i]: d for i, d in distances.items()}


def blatant_senders(weights: Mapping[int, float], distances: Mapping[int, float],
                    senders: tuple[int, ...]) -> dict[int, str]:
    """Senders of a chunk whose contribution is blatantly not an honest one, with the evidence: a
    claimed weight above NAMED_WEIGHT_OVER_MEDIAN times the lower median of the positive weights,
    or a piece farther from the robust centre than OUTLIER_FACTOR times the median distance
    (`robust.far_pieces`; `distances` as `reduce_chunk` measures them)."""
    named: dict[int, str] = {}
    positive = sorted(weights[s] for s in senders if weights[s] > 0)
    if len(positive) >= 3:
        median = positive[(len(positive) - 1) // 2]
        for s in senders:
            if weights[s] > NAMED_WEIGHT_OVER_MEDIAN * median:
                named[s] = f"it claimed weight {weights[s]:.3g}, {weights[s] / median:.3g} x the median {median:.3g}"
    median, far = far_pieces(distances)
    for s in far:
        evidence = (f"its piece is {distances[s]:.3g} from the robust centre, {distances[s] / median:.3g} x the "
                    f"median distance {median:.3g}")
        named[s] = f"{named[s]}; {evidence}" if s in named else evidence
    return named


def _encode(codec: Any, t: torch.Tensor) -> Any:
    return codec.encode(t)


def _decode(codec: Any, payload: Any, numel: int) -> torch.Tensor:
    """One chunk as a flat float32 tensor, refusing malformed data. No copy when the codec
    sends float32: a received chunk is kept as it came off the wire."""
    t = codec.decode(payload)
    if not isinstance(t, torch.Tensor) or t.numel() != numel:
        raise AveragingError(f"chunk has the wrong size (expected {numel} elements)")
    # Codec.decode refuses NaN/inf: one pass over the chunk, not two
    checked = getattr(type(codec), "decode", None) is Codec.decode and t.dtype == torch.float32
    t = t.reshape(-1).to(torch.float32)
    if not checked and not all_finite(t):  # whatever the codec: the all-reduce never spreads NaN/inf
        raise AveragingError("chunk contains NaN or infinity")
    return t


class ShardReducer:
    """Reduces one shard: collects pieces, averages chunks, streams results back to senders.

    It is owned by its run and reaches back to it through a weak reference (it only reports to
    it), so a finished run is freed by reference counting, never left in a cycle for the GC.
    """

    def __init__(self, run: AllReduceRun, shard: int, exact: tuple[int, ...] | None):
        self._run = weakref.ref(run)
        self.shard = shard
        self.codec = run.codec
        self.aggregation = run.aggregation
        self.chunk = run.chunk
        self.sender_timeout = run.sender_timeout
        self.stats = run.stats
        self.pool = run.pool
        start, end = run.group.bounds(shard)
        self.size = end - start
        self.chunks = max(1, math.ceil(self.size / run.chunk))
        self.exact = exact  # set for a replacement reducer: reduce over exactly these senders
        self.expected = set(exact) if exact is not None else set(run.group.receivers)
        self.pieces: dict[int, list[torch.Tensor]] = {}  # sender -> its chunks, as received
        self.weights: dict[int, float] = {}
        self.received: dict[int, int] = {}  # sender -> chunks received
        self.complete: set[int] = set()
        self.failed: set[int] = set()
        self.reduced_with: dict[int, tuple[int, ...]] = {}
        self.named: dict[int, str] = {}  # sender -> why it is blatantly not honest (warned once per step)
        self.results: dict[int, torch.Tensor] = {}
        self.outboxes: dict[int, asyncio.Queue] = {}
        self.reported = False
        self.final_senders: tuple[int, ...] | None = None
        self.final_version = 0
        self.final_signature = b""
        self.closed = False
        self.changed = asyncio.Event()
        self._serving: dict[int, tuple[Any, asyncio.Task]] = {}  # sender -> (channel, writer)
        # Pooled memory: the reduced shard (results are slices of it) and one chunk of scratch.
        self._buffers = [self.pool.take(self.size), self.pool.take(self.chunk)]
        self.reduced, self.scratch = self._buffers[0][:self.size], self._buffers[1]
        self._absent_timer: asyncio.TimerHandle | None = asyncio.get_running_loop().call_later(
            run.sender_timeout, self._expire_absent)

    def _mark_dead(self, member: int) -> None:
        run = self._run()
        if run is not None:
            run.mark_dead(member)

    def _expire_absent(self) -> None:
        """Senders that never connected are excluded like stalled ones."""
        self._absent_timer = None  # a fired handle still holds this bound method: drop the cycle
        for s in sorted(self.expected - set(self.received) - self.failed - self.complete):
            self._fail(s, "never connected")
            self._mark_dead(s)

    def _stop_timer(self) -> None:
        if self._absent_timer is not None:
            self._absent_timer.cancel()
            self._absent_timer = None

    def close(self) -> None:
        """The run is over: stop serving and let go of every buffer."""
        self.closed = True
        self._stop_timer()
        for channel, writer in list(self._serving.values()):
            writer.cancel()
            channel.abort("the averaging step is over here")
        self._serving.clear()
        self.outboxes.clear()
        self.pieces.clear()
        self.results.clear()
        for buffer in self._buffers:
            self.pool.give(buffer)
        self._buffers.clear()

    def _live(self) -> list[int]:
        return sorted(self.expected - self.failed)

    def _chunk_range(self, c: int) -> tuple[int, int]:
        return c * self.chunk, min(self.size, (c + 1) * self.chunk)

    async def serve(self, sender: int, weight: float, abstain: bool, channel: Any) -> None:
        """Handle one sender's stream: read its pieces, and send it results until FINAL."""
        if self.closed:
            raise AveragingError("the averaging step is over here")
        outbox: asyncio.Queue = asyncio.Queue()
        self.outboxes[sender] = outbox
        for c in sorted(self.results):  # a late receiver gets what was already reduced
            outbox.put_nowait(ResultChunk(c, _encode(self.codec, self.results[c])))
        if self.final_senders is not None:
            outbox.put_nowait(ResultFinal(self.final_senders, self.final_version, self.final_signature))
        writer = asyncio.ensure_future(self._write(outbox, channel))
        self._serving[sender] = (channel, writer)
        try:
            if abstain or sender not in self.expected or sender in self.received:
                if sender not in self.received:
                    self._fail(sender, "abstains" if abstain else "not expected")
                await _drain_quietly(channel)
            else:
                await self._read(sender, weight, channel)
            await writer
        finally:
            writer.cancel()
            self._serving.pop(sender, None)
            self.outboxes.pop(sender, None)
            if sender in self.expected and sender not in self.complete and sender not in self.failed:
                self._fail(sender, "its connection was closed")  # the handler task was cancelled
            if not (writer.done() and not writer.cancelled() and writer.result()):
                self._mark_dead(sender)  # it never got FINAL: the coordinator must not wait for it

    async def _read(self, sender: int, weight: float, channel: Any) -> None:
        self.weights[sender] = weight
        self.pieces[sender] = []
        self.received[sender] = 0
        last = None  # when its previous chunk arrived (for our download estimate)
        try:
            while True:
                msg = await channel.recv(timeout=self.sender_timeout)
                if self.closed:
                    return
                c = self.received[sender]
                if c >= self.chunks:
                    raise AveragingError("sent more chunks than the shard has")
                lo, hi = self._chunk_range(c)
                self.pieces[sender].append(_decode(self.codec, msg, hi - lo))
                last = self.stats.received(channel, last, 4 * (hi - lo))
                self.received[sender] = c + 1
                self._try_reduce(c)
        except EndOfStream:
            if self.received[sender] == self.chunks:
                self.complete.add(sender)
                self._progress()
            else:
                self._fail(sender, f"ended after {self.received[sender]} of {self.chunks} chunks")
        except (NetworkError, PotluckError) as e:
            self._fail(sender, str(e))
            if isinstance(e, NetworkError):
                self._mark_dead(sender)

    async def _write(self, outbox: asyncio.Queue, channel: Any) -> bool:
        """Send results to one receiver; True once its FINAL is sent."""
        try:
            while True:
                msg = await outbox.get()
                await self.stats.send(channel, msg.to_wire())
                if isinstance(msg, ResultFinal):
                    await channel.close()
                    return True
        except (NetworkError, PotluckError):
            return False

    def sender_died(self, sender: int) -> None:
        if sender in self.expected and sender not in self.complete:
            self._fail(sender, "it died")

    def _fail(self, sender: int, reason: str) -> None:
        if sender in self.failed or sender in self.complete or self.closed:
            return
        logger.debug("shard %d excludes sender %d: %s", self.shard, sender, reason)
        self.failed.add(sender)
        for c in range(self.chunks):
            self._try_reduce(c)
        self._progress()

    def _try_reduce(self, c: int) -> None:
        """Provisionally average chunk `c` once every live sender's piece of it is in."""
        if self.exact is not None or c in self.reduced_with or self.final_senders is not None:
            return  # a replacement reducer only ever reduces over the decided senders
        live = tuple(self._live())
        if not all(self.received.get(s, 0) > c for s in live):
            return
        lo, hi = self._chunk_range(c)
        result = self.reduced[lo:hi]
        self._reduce(live, c, result)
        self.reduced_with[c] = live
        self.results[c] = result
        payload = ResultChunk(c, _encode(self.codec, result))
        for box in self.outboxes.values():
            box.put_nowait(payload)

    def _reduce(self, senders: tuple[int, ...], c: int, out: torch.Tensor) -> None:
        """Write chunk `c` reduced over `senders` into `out` (see `reduce_chunk`), and name the
        senders whose contribution is blatantly not honest (`blatant_senders`). Named, not banned:
        a ban is for a lie proven by a member's own signatures; this is a statistic, and an honest
        peer that is broken or far behind (stale parameters) could meet it. The result already
        bounds what the sender does (bounded weights, robust aggregation)."""
        distances = reduce_chunk(self.aggregation, self.pieces, self.weights, senders, c, out, self.scratch,
                                 measure=True)
        named = blatant_senders(self.weights, distances, senders)
        run = self._run()
        for s in sorted(named.keys() - self.named.keys()):
            self.named[s] = named[s]
            if run is not None:
                logger.warning("reducer of shard %d: sender %d (%s) is not an honest member: %s (chunk %d; "
                               "its contribution is bounded, it is not banned)",
                               self.shard, s, run.group.peers[s], named[s], c)

    def _progress(self) -> None:
        """Report to the coordinator once every expected sender is settled."""
        self.changed.set()
        if not self.reported and self.expected <= (self.complete | self.failed):
            self.reported = True
            run = self._run()
            if run is not None:
                run.on_report(self.shard, sorted(self.complete))

    def finalize(self, senders: tuple[int, ...], version: int) -> None:
        """Recompute chunks not reduced over exactly `senders`, then send FINAL."""
        if self.final_senders is not None or self.closed:
            return
        missing = [s for s in senders if s not in self.complete]
        if missing:
            run = self._run()
            if run is not None:
                run.on_repair_failed(self.shard, missing)
            return
        for c in range(self.chunks):
            if self.reduced_with.get(c) != senders:
                lo, hi = self._chunk_range(c)
                self.results[c] = self.reduced[lo:hi]
                self._reduce(senders, c, self.results[c])
                self.reduced_with[c] = senders
                payload = ResultChunk(c, _encode(self.codec, self.results[c]))
                for box in self.outboxes.values():
                    box.put_nowait(payload)
        run = self._run()
        if run is not None:
            self.final_signature = run.sign_final(self.shard, senders, version, self.results)
        self.final_senders, self.final_version = senders, version
        for box in self.outboxes.values():
            box.put_nowait(ResultFinal(senders, version, self.final_signature))
        self._stop_timer()


def _as_received(codec: Any, t: torch.Tensor, payload: Any = None) -> torch.Tensor:
    """What a peer decodes from `t` encoded by `codec` (`payload`, if already encoded): `t`
    itself for float32 under "none", which sends the values as they are (no second pass)."""
    if getattr(codec, "name", None) == "none" and t.dtype == torch.float32:
        return t
    return _decode(codec, _encode(codec, t) if payload is None else payload, t.numel())


def _encodes_blocks_alone(codec: Any) -> bool:
    """Whether a VERIFY_BLOCK-aligned block of a chunk decodes alone as it does in the chunk."""
    name = getattr(codec, "name", None)
    return name in VALUEWISE_CODECS or (name in BLOCKWISE_CODECS and VERIFY_BLOCK % codec.block == 0)


def _wire_form(codec: Any, values: torch.Tensor) -> tuple[Any, bool]:
    """A block of a sender's piece (as the reducer decoded it), for a member that checks the
    reducer: in the codec's form when that decodes back to exactly these values (a block of a
    blockwise code, a sparse piece), else as float32; and which of the two. The check then costs
    about what the sender sent (1/8 of the float32 values under 4 bits), and binds as before:
    the member decodes and digests the values either way."""
    if getattr(codec, "name", None) != "none" and not getattr(codec, "stateful", False):
        try:
            payload = _encode(codec, values)
            if torch.equal(_decode(codec, payload, values.numel()), values):
                return payload, True
        except PotluckError:
            pass  # not representable in the codec: float32 it is
    return values, False


async def _drain_quietly(channel: Any) -> None:
    try:
        async for _ in channel:
            pass
    except (NetworkError, PotluckError):
        pass


class AllReduceRun:
    """One member's part in one all-reduce step."""

    def __init__(self, service: AllReduceService, group: Group, me: int, vector: torch.Tensor | None,
                 weight: float, codec: Any, timeout: float, sender_timeout: float = SENDER_TIMEOUT,
                 chunk: int = CHUNK_ELEMENTS, stats: TransferStats | None = None, pool: BufferPool | None = None,
                 aggregation: str = "mean"):
        self.service = service
        self.group = group
        self.me = me
        self.mode = group.modes[me]
        self.abstain = vector is None or not math.isfinite(weight) or weight < 0
        if self.mode != "aux" and vector is not None and vector.numel() != group.total:
            raise AveragingError(f"local vector has {vector.numel()} elements, the group expects {group.total}")
        self.vector = vector
        self.weight = 0.0 if self.abstain else float(weight)
        self.codec = codec
        self.aggregation = aggregation  # how my reducers combine pieces; the group agreed on it
        self.chunk = chunk
        self.sender_timeout = sender_timeout
        self.stats = stats if stats is not None else TransferStats()
        self.pool = pool if pool is not None else BufferPool()
        self.refused: str | None = None  # why the codec refused my own data (I then abstain)
        loop = asyncio.get_running_loop()
        self.deadline = loop.time() + timeout
        self.result = self.pool.take(group.total)[:group.total] if self.mode != "aux" else None
        self.final: set[int] = set()
        self.dead: set[int] = set()
        self.reports: dict[int, list[int]] = {}  # my shards' reports (sent with every update)
        # Accountability (see accountability.py): roots of the pieces I sent (shard -> root) and
        # of those my reducers received (shard -> sender -> root); chunk digests of the pieces my
        # reducers hold, for members that check my work; the outcome version whose results I
        # checked, and what I found: a reducer caught, or results I could not check.
        self.sent: dict[int, bytes] = {}
        self.received: dict[int, dict[int, bytes]] = {}
        self._chunk_digests: dict[tuple[int, int], list[bytes]] = {}
        self.checked = 0
        self._checking = 0
        self.finals: dict[int, SignedFinal] = {}
        self.checked_by: set[tuple[int, int, int]] = set()  # (member, shard, version) I answered a check of
        self.caught: str | None = None
        self.unverified: str | None = None
        self.reducers: dict[int, ShardReducer] = {}
        self.exchanges: dict[int, tuple[int, asyncio.Task]] = {}  # shard -> (reducer, task)
        self.outcome = Outcome(assignment={j: j for j in group.shards})
        self.state_changed = asyncio.Event()
        self.coordinator = Coordinator(self)
        self.repair_failed: str | None = None
        self.tasks: set[asyncio.Task] = set()
        self._reducer_waiters: dict[int, asyncio.Future[ShardReducer]] = {}
        for j in group.shards:
            if j == me:
                self.reducers[j] = ShardReducer(self, j, None)

    def spawn(self, coro: Any) -> asyncio.Task:
        """Start a sub-task owned by this run; all are cancelled when the run ends."""
        task = asyncio.ensure_future(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

    async def reducer(self, shard: Any) -> ShardReducer:
        """The reducer of `shard` here, waiting briefly if a decision is about to create it."""
        if not isinstance(shard, int):
            raise AveragingError("malformed shard id")
        if shard in self.reducers:
            return self.reducers[shard]
        if shard not in self.group.shards:
            raise AveragingError(f"shard {shard} does not exist")
        waiter = self._reducer_waiters.setdefault(shard, asyncio.get_running_loop().create_future())
        try:
            async with compat.timeout(REGISTRATION_WAIT):
                return await asyncio.shield(waiter)
        except TimeoutError:
            raise AveragingError(f"shard {shard} is not reduced here") from None

    def _add_reducer(self, shard: int, senders: tuple[int, ...]) -> ShardReducer:
        red = self.reducers[shard] = ShardReducer(self, shard, senders)
        red.reported = True  # a replacement does not report: it finalizes or declares the repair failed
        waiter = self._reducer_waiters.pop(shard, None)
        if waiter is not None and not waiter.done():
            waiter.set_result(red)
        self.spawn(self._finalize_exact(red))
        return red

    # -- the member's side ------------------------------------------------------------------------
    async def run(self) -> tuple[torch.Tensor | None, tuple[int, ...]]:
        """Take part until commit; returns the averaged vector (None for aux members) and the
        members whose tensors it averages."""
        try:
            async with compat.timeout_at(self.deadline):
                if self.mode != "aux":
                    for j in self.group.shards:
                        self._start_exchange(j, j)
                self.coordinator.maybe_take_over()
                await self._follow_outcomes()
        except TimeoutError:
            raise AveragingError("averaging step did not finish before its deadline") from None
        finally:
            self._close()
        if self.outcome.aborted:
            raise AveragingError(f"averaging step aborted: {self.outcome.aborted}")
        if self.mode != "aux" and not set(self.outcome.assignment) <= self.final:
            raise AveragingError("the group committed without this peer (it was presumed dead)")
        if self.refused is not None:
            raise AveragingError(f"this peer's tensors could not be sent ({self.refused}); "
                                 "the others averaged without them")
        if self.caught is not None or self.unverified is not None:
            raise AveragingError(f"not using this step's result: {self.caught or self.unverified}")
        return self.result, self.outcome.senders

    def _close(self) -> None:
        """Stop everything of this run and drop what could hold it in a cycle (tasks whose
        tracebacks reference its frames), so it is freed by reference counting once returned."""
        for task in self.tasks:
            task.cancel()
        self.tasks.clear()
        self.exchanges.clear()
        for red in self.reducers.values():
            red.close()
        self.coordinator.close()
        for waiter in self._reducer_waiters.values():
            waiter.cancel()
        self._reducer_waiters.clear()

    def _start_exchange(self, shard: int, reducer: int) -> None:
        old = self.exchanges.get(shard)
        if old is not None:
            if old[0] == reducer:
                return
            old[1].cancel()
        self.exchanges[shard] = (reducer, self.spawn(self._exchange(shard, reducer)))

    async def _exchange(self, shard: int, reducer: int) -> None:
        """Send my piece of `shard` to its reducer and receive the averaged shard back."""
        start, end = self.group.bounds(shard)
        in_set = self.outcome.version == 0 or self.me in self.outcome.senders
        abstain = self.abstain or not in_set
        request = PartRequest(self.group.group_id, shard, self.me, self.weight, abstain)
        try:
            channel = await self.service.open(self, reducer, request)
            sender = self.spawn(self._send_piece(channel, shard, start, end, abstain))
            last = None  # when the previous result chunk arrived (for our download estimate)
            try:
                chunks = max(1, math.ceil((end - start) / self.chunk))
                async for raw in channel:
                    msg = parse_result(raw, chunks, len(self.group.peers))
                    if isinstance(msg, ResultFinal):
                        self._check_signature(shard, reducer, msg)
                        self.final.add(shard)
                        self._changed()
                        self._maybe_check()
                        break
                    lo = start + msg.chunk * self.chunk
                    hi = min(end, lo + self.chunk)
                    self.result[lo:hi] = _decode(self.codec, msg.payload, hi - lo)
                    last = self.stats.received(channel, last, 4 * (hi - lo))
            finally:
                sender.cancel()
        except (NetworkError, PotluckError) as e:
            # Unreachable or sending malformed results: either way the shard must move elsewhere.
            logger.debug("exchange of shard %d with member %d failed: %s", shard, reducer, e)
            self.mark_dead(reducer)

    async def _send_piece(self, channel: Any, shard: int, start: int, end: int, abstain: bool) -> None:
        """Stream my piece of one shard, and note its root (what the reducer will have received).
        If the codec refuses a chunk (NaN/inf, out of its range), I abstain: the stream ends
        early, so the reducer excludes me at once instead of waiting for the sender timeout,
        and nothing of the refused data is sent."""
        try:
            if not abstain:
                digests: list[bytes] | None = []
                for lo in range(start, end, self.chunk):
                    hi = min(end, lo + self.chunk)
                    try:
                        payload = _encode(self.codec, self.vector[lo:hi])
                    except Exception as e:  # noqa: BLE001 - any codec failure: abstain, never hang
                        self._refuse(f"{type(e).__name__}: {e}")
                        break
                    await self.stats.send(channel, payload)
                    if digests is not None:
                        try:
                            digests.append(chunk_digest(_as_received(self.codec, self.vector[lo:hi], payload)))
                        except PotluckError:
                            digests = None  # the reducer refuses this chunk as well: I send no root
                else:
                    if digests is not None and shard not in self.sent:
                        self.sent[shard] = piece_root(self.weight, digests)
                        self._changed()
            await channel.close()
        except (NetworkError, PotluckError):
            pass  # the receiving side settles what it got

    def _refuse(self, reason: str) -> None:
        """My own data cannot be encoded: take no part as a sender from now on."""
        if self.refused is None:
            logger.warning("member %d abstains: its data was refused by the codec: %s", self.me, reason)
            self.refused = reason
        self.abstain = True

    def mark_dead(self, member: int) -> None:
        if member != self.me and member not in self.dead:
            self.dead.add(member)
            self.note_dead_senders((member,))
            self._changed()

    def note_dead_senders(self, members: tuple[int, ...]) -> None:
        """My reducers stop waiting for the pieces of members known dead: at once, not at the
        sender timeout."""
        for red in list(self.reducers.values()):
            for member in members:
                red.sender_died(member)

    def on_report(self, shard: int, complete: list[int]) -> None:
        logger.debug("member %d: shard %d complete senders %s", self.me, shard, complete)
        self.reports[shard] = complete
        red = self.reducers[shard]
        self.received[shard] = {s: piece_root(red.weights[s], self.chunk_digests(red, s)) for s in complete}
        self._changed()

    def chunk_digests(self, red: ShardReducer, sender: int) -> list[bytes]:
        """Digests of the chunks of `sender`'s piece that my reducer `red` holds."""
        key = (red.shard, sender)
        if key not in self._chunk_digests:
            self._chunk_digests[key] = [chunk_digest(p) for p in red.pieces[sender]]
        return self._chunk_digests[key]

    def sign_final(self, shard: int, senders: tuple[int, ...], version: int,
                   results: Mapping[int, torch.Tensor]) -> bytes:
        """My signature, as reducer of `shard`, of the result I send (as receivers decode it)."""
        digests = [chunk_digest(_as_received(self.codec, results[c])) for c in sorted(results)]
        message = final_message(self.group.group_id, shard, version, senders, result_root(digests))
        return self.service.transport.identity.sign(message)

    def _check_signature(self, shard: int, reducer: int, final: ResultFinal) -> None:
        """Keep the reducer's signature of the result I received, to show the coordinator; a
        signature that does not match what I received means the reducer sent me something else
        than it signed: I ban it, and the shard moves to another reducer."""
        start, end = self.group.bounds(shard)
        root = result_root([chunk_digest(self.result[lo:min(end, lo + self.chunk)])
                            for lo in range(start, end, self.chunk)])
        message = final_message(self.group.group_id, shard, final.version, final.senders, root)
        if not self.group.peers[reducer].verify(final.signature, message):
            self.service.banned.ban(self.group.peers[reducer],
                                    f"as reducer of shard {shard}, it signed a result other than the one it sent me")
            raise AveragingError(f"member {reducer}'s signature does not match its result of shard {shard}")
        self.finals[shard] = SignedFinal(final.version, final.senders, root, final.signature)

    def _maybe_check(self) -> None:
        """Once I hold every shard's final result under a decision, check the reducers' work."""
        version = self.outcome.version
        if self.mode != "aux" and version > self._checking and not (self.outcome.committed or self.outcome.aborted) \
                and set(self.outcome.assignment) <= self.final:
            self._checking = version
            self.spawn(self._check(self.outcome))

    async def _check(self, outcome: Outcome) -> None:
        """Recompute one random chunk of every other reducer's shard from the pieces it used,
        BTARD-style. The chunk is drawn here after the results came, so a reducer cannot know
        which of its chunks anyone checks; a reducer caught is banned, and I do not use the result."""
        async def one(shard: int, reducer: int) -> None:
            try:
                problem = await self._check_shard(outcome, shard, reducer)
            except (NetworkError, PotluckError, TimeoutError) as e:
                self.unverified = f"member {reducer}'s result for shard {shard} could not be checked: {e}"
                return
            if problem is not None:
                self.caught = f"member {reducer} ({self.group.peers[reducer]}) {problem}"
                self.service.banned.ban(self.group.peers[reducer], f"as reducer of shard {shard}, it {problem}")
        await asyncio.gather(*(one(j, r) for j, r in sorted(outcome.assignment.items()) if r != self.me))
        self.checked = max(self.checked, outcome.version)
        self._changed()

    async def _check_shard(self, outcome: Outcome, shard: int, reducer: int) -> str | None:
        """What is wrong with `reducer`'s result of a random block of `shard` (None: nothing)."""
        start, end = self.group.bounds(shard)
        chunks = max(1, math.ceil((end - start) / self.chunk))
        c = secrets.randbelow(chunks)
        lo, hi = start + c * self.chunk, min(end, start + (c + 1) * self.chunk)
        blocks = math.ceil((hi - lo) / VERIFY_BLOCK)
        alone = self.aggregation in ELEMENTWISE and _encodes_blocks_alone(self.codec)
        first, count = (secrets.randbelow(blocks), 1) if alone else (0, blocks)
        lo, hi = lo + first * VERIFY_BLOCK, min(hi, lo + (first + count) * VERIFY_BLOCK)
        pieces = await self.service.pieces(self, reducer, shard, (c, first, count), (chunks, blocks), hi - lo)
        where = f"chunk {c}, block {first}"
        if tuple(sorted(pieces)) != outcome.senders:
            return f"answered with the pieces of members {sorted(pieces)}, not of {list(outcome.senders)}"
        for _, digests, blocks_of_c, piece in pieces.values():
            if blocks_digest(blocks_of_c) != digests[c] or block_digests(piece) != blocks_of_c[first:first + count]:
                return f"answered with pieces that do not match their digests ({where})"
        roots = {s: piece_root(w, digests) for s, (w, digests, _, _) in pieces.items()}
        if shard in outcome.digests and shard_digest(roots) != outcome.digests[shard]:
            return f"answered with pieces other than those the senders sent ({where})"
        if self.me in roots and shard in self.sent and roots[self.me] != self.sent[shard]:
            return f"answered with a piece of mine other than the one I sent ({where})"
        out = torch.empty(hi - lo)
        weights = {s: w for s, (w, _, _, _) in pieces.items()}
        reduce_chunk(self.aggregation, {s: {c: p} for s, (_, _, _, p) in pieces.items()}, weights, outcome.senders, c,
                     out, torch.empty(hi - lo))
        expected = _as_received(self.codec, out)
        if not torch.equal(expected, self.result[lo:hi]):
            error = (expected - self.result[lo:hi]).abs().max().item()
            return f"sent a result that is not what its pieces reduce to ({where}: off by up to {error:.3g})"
        return None

    def on_repair_failed(self, shard: int, missing: list[int]) -> None:
        self.repair_failed = f"shard {shard} lost senders {missing} during repair"
        self._changed()

    def _changed(self) -> None:
        self.state_changed.set()
        self.coordinator.poke()

    def state(self) -> MemberState:
        """What I know, for the coordinator."""
        return MemberState(self.me, tuple(sorted(self.dead)), {j: tuple(c) for j, c in self.reports.items()},
                           tuple(sorted(self.final)), self.outcome.version, self.outcome, self.repair_failed,
                           dict(self.sent), dict(self.received), self.checked, dict(self.finals))

    async def _follow_outcomes(self) -> None:
        """Send my state to the coordinator and apply its decisions until commit or abort."""
        while not (self.outcome.committed or self.outcome.aborted):
            coordinator = self.current_coordinator()
            if coordinator is None:
                self.outcome.aborted = "no coordinator left alive"
                return
            self.state_changed.clear()
            if coordinator == self.me:
                self.coordinator.update(self.state())
                waiter = asyncio.ensure_future(self.coordinator.wait_newer(self.outcome.version, self.dead))
            else:
                waiter = asyncio.ensure_future(self.service.sync(self, coordinator))
            changed = asyncio.ensure_future(self.state_changed.wait())
            try:
                await asyncio.wait([waiter, changed], return_when=asyncio.FIRST_COMPLETED)
            finally:
                changed.cancel()
                if not waiter.done():
                    waiter.cancel()
                waiter.add_done_callback(retrieve_exception)  # superseded by a newer attempt
            if waiter.done() and not waiter.cancelled():
                error = waiter.exception()
                if error is None:
                    reply = waiter.result()
                    for member in reply.dead:
                        self.mark_dead(member)
                    self.apply(reply.outcome)
                elif isinstance(error, RemoteError):
                    await asyncio.sleep(0.05)  # it has not yet seen what we saw; ask again shortly
                elif isinstance(error, NetworkError):
                    self.mark_dead(coordinator)
                else:
                    # A new error: raising the stored one would tie its traceback (this frame) to
                    # the waiter that stores it, a cycle holding the whole run.
                    raise AveragingError(f"coordination failed: {error}") from error

    def current_coordinator(self) -> int | None:
        for i in self.group.coordinators():
            if i not in self.dead:
                return i
        return None

    def apply(self, outcome: Outcome) -> None:
        """Adopt a newer decision: finalize my shards, and follow shards that moved."""
        terminal = outcome.committed or outcome.aborted
        if outcome.version < self.outcome.version and not terminal:
            return
        previous = self.outcome
        self.outcome = outcome
        proof = outcome.equivocation
        if proof is not None and proof.holds(self.group):
            self.service.banned.ban(self.group.peers[proof.reducer],
                                    f"as reducer of shard {proof.shard}, it signed two different results of it")
        if terminal or outcome.version == previous.version:
            return
        self._maybe_check()
        for shard, reducer in outcome.assignment.items():
            if reducer == self.me:
                red = self.reducers.get(shard)
                if red is None:
                    self._add_reducer(shard, outcome.senders)
                elif red.exact is None:
                    red.finalize(outcome.senders, outcome.version)
            if self.mode != "aux" and previous.assignment.get(shard) != reducer:
                self.final.discard(shard)
                self.finals.pop(shard, None)
                self._start_exchange(shard, reducer)

    async def _finalize_exact(self, red: ShardReducer) -> None:
        """A replacement reducer: wait for every sender of S*, then reduce and send FINAL."""
        senders = red.exact
        while red.final_senders is None:
            if set(senders) <= red.complete:
                red.finalize(senders, self.outcome.version)
            elif red.failed & set(senders):
                self.on_repair_failed(red.shard, sorted(red.failed & set(senders)))
                return
            else:
                red.changed.clear()
                await red.changed.wait()


class Coordinator:
    """Turns members' reports into decisions; active only on the current coordinator.

    Owned by its run, it reaches the run through a weak proxy, so the two form no cycle.
    """

    def __init__(self, run: AllReduceRun):
        self.run = weakref.proxy(run)
        self.active = False
        self.states: dict[int, MemberState] = {}
        self.outcome = Outcome(assignment=dict(run.outcome.assignment))
        self.repairs = 0
        self.late = False  # the report deadline passed: decide with what came in
        self.newer = asyncio.Event()
        self._probes: dict[int, asyncio.Task] = {}  # member reported dead -> the check that it is
        self._refuted: set[tuple[int, int]] = set()  # (reporter, member) reports found false here
        self._timer: asyncio.TimerHandle | None = None

    def maybe_take_over(self) -> None:
        if self.run.current_coordinator() == self.run.me and not self.active:
            self.active = True
            if self.run.outcome.version > self.outcome.version:
                self.outcome = self.run.outcome
            loop = asyncio.get_running_loop()
            # Reports must come in while senders can still be waited for; then decide without them.
            self._timer = loop.call_at(min(self.run.deadline, loop.time() + 2 * self.run.sender_timeout + 5),
                                       self._report_deadline)
            if self.run.me != self.run.group.coordinators()[0]:
                self.run.spawn(self._query_everyone())

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def poke(self) -> None:
        self.maybe_take_over()
        if self.active:
            self.update(self.run.state())

    async def _query_everyone(self) -> None:
        """A coordinator that took over asks the listening members where they stand (members in
        client mode cannot be dialed; they sync on their own). A failed query proves nothing."""
        async def ask(i: int) -> None:
            try:
                state = await self.run.service.query(self.run, i)
            except (NetworkError, PotluckError):
                return
            if state is not None:
                self.update(state)
        await asyncio.gather(*(ask(i) for i in self.run.group.coordinators() if i != self.run.me))

    async def wait_newer(self, version: int, known: Collection[int]) -> SyncReply:
        """Wait for a decision newer than `version`, or a death not among `known` (the waiter's
        dead and itself: a member presumed dead must not be woken by its own death)."""
        while not (self.outcome.version > version or self.outcome.committed or self.outcome.aborted
                   or not self.run.dead <= set(known)):
            self.newer.clear()
            await self.newer.wait()
        return SyncReply(self.outcome, tuple(sorted(self.run.dead)))

    def update(self, state: MemberState) -> None:
        """Merge a member's state and decide what can be decided."""
        self.newer.set()  # waiters check again: a death may be news to them
        self.states[state.member] = state
        self.maybe_take_over()
        order = self.run.group.coordinators()
        ahead = order[:order.index(self.run.me)] if self.run.me in order else []
        for member in state.dead:
            # Until I coordinate, only deaths that would make me the coordinator concern me: my
            # coordinator tells me the others (and a client-mode member cannot be asked from here).
            if member != self.run.me and member not in self.run.dead and (self.active or member in ahead) \
                    and (state.member, member) not in self._refuted and member not in self._probes:
                self._probes[member] = self.run.spawn(self._probe(member, state.member))
        if not self.active:
            return
        adopted = state.outcome
        if adopted.committed and not self.outcome.committed:
            self._publish(adopted)
            return
        if adopted.version > self.outcome.version:
            self.outcome = adopted
        if state.failure:
            if self._holds_repair(state.member):
                self._publish(Outcome(self.outcome.version + 1, aborted=state.failure))
                return
            self.run.service.banned.ban(self.run.group.peers[state.member],
                                        f"reported a failed repair of a part it does not hold: {state.failure!r}")
        self._decide()

    async def _probe(self, member: int, reporter: int) -> None:
        """Act on `reporter`'s word that `member` is dead only once `member` fails to say where it
        stands: every member must converge on one coordinator, so a real death counts everywhere,
        but a false report must not leave a live member out or move its shard. A report found
        false is dropped (an honest reporter may have lost only its own link to the member, or
        been sent garbage by it: no ban), and that reporter's word on that member is not asked
        for again in this step (see `_cut_off` for what it costs the reporter)."""
        try:
            alive = await self.run.service.query(self.run, member, DEATH_PROBE_TIMEOUT) is not None
        except (NetworkError, PotluckError, TimeoutError):
            alive = False
        finally:
            self._probes.pop(member, None)
        if alive:
            self._refuted.add((reporter, member))
            logger.warning("member %d (%s) reported member %d (%s) dead, but it answered: it stays in the step",
                           reporter, self.run.group.peers[reporter], member, self.run.group.peers[member])
            self.poke()  # the reporter may no longer be waited for
        else:
            self.run.mark_dead(member)

    def _holds_repair(self, member: int) -> bool:
        """Whether `member` reduces a shard given to it by a repair: only such a reducer can find
        a sender missing after the decision, so only its failure report may end the step."""
        out = self.outcome
        return out.version > 0 and any(r == member and r != j for j, r in out.assignment.items())

    def _report_deadline(self) -> None:
        self._timer = None  # a fired handle still holds this bound method: drop the cycle
        self.late = True
        if self.outcome.version == 0 and not (self.outcome.committed or self.outcome.aborted):
            for j, reducer in self.outcome.assignment.items():
                if not self._reported(j) and reducer != self.run.me:
                    self.run.dead.add(reducer)
            self._decide()

    def _reported(self, shard: int) -> bool:
        return any(shard in s.reports for s in self.states.values())

    def _decide(self) -> None:
        out = self.outcome
        if out.committed or out.aborted:
            return
        dead = self.run.dead
        live_reducers = [j for j in self.run.group.shards if j not in dead and self.run.group.modes[j] != "client"]
        if out.version == 0:
            if not all(self._reported(j) or out.assignment[j] in dead for j in out.assignment):
                return
            if not live_reducers:
                self._publish(Outcome(1, aborted="every reducer died"))
                return
            complete: set[int] | None = None
            for s in self.states.values():
                for j, c in s.reports.items():
                    if out.assignment.get(j) not in dead:
                        complete = set(c) if complete is None else complete & set(c)
            agreed = self._agreed(tuple(sorted((complete or set()) - dead)))
            if agreed is None:
                return  # senders' roots are still on their way
            senders, digests = agreed
            if not senders:
                self._publish(Outcome(1, aborted="no sender delivered to every reducer"))
                return
            self._publish(Outcome(1, senders, self._reassign(dict(out.assignment), live_reducers), digests=digests))
            return
        # After a decision: commit once every live receiver holds every shard.
        cut = self._cut_off()
        receivers = [i for i in self.run.group.receivers if i not in dead and i not in cut]
        shards = set(out.assignment)
        holding = [i for i in receivers if i in self.states and set(self.states[i].final) >= shards
                   and self.states[i].checked >= out.version]
        if len(holding) == len(receivers):
            proof = self._equivocation(receivers)
            if proof is not None:
                self._publish(Outcome(out.version + 1, equivocation=proof,
                                      aborted=f"member {proof.reducer} sent members different results of shard "
                                              f"{proof.shard}"))
                return
            self._publish(Outcome(out.version, out.senders, out.assignment, committed=True, digests=out.digests))
            return
        lost = {j for j, r in out.assignment.items() if r in dead}
        if lost:
            if self.repairs >= MAX_REPAIRS or not live_reducers:
                self._publish(Outcome(out.version + 1, aborted="reducers kept dying"))
                return
            if any(s in dead for s in out.senders):
                self._publish(Outcome(out.version + 1, aborted="a reducer and a sender it needed both died"))
                return
            self.repairs += 1
            self._publish(Outcome(out.version + 1, out.senders, self._reassign(dict(out.assignment), live_reducers),
                                  digests=out.digests))

    def _cut_off(self) -> set[int]:
        """Receivers not waited for: each reported a reducer dead that answered me, and lacks its
        shard (a liar, or a member that lost its link to that reducer: it fails alone, at once,
        rather than holding everyone up until the deadline)."""
        out = self.outcome
        return {reporter for reporter, member in self._refuted if reporter in self.states and any(
            r == member and j not in self.states[reporter].final for j, r in out.assignment.items())}

    def _equivocation(self, receivers: list[int]) -> Equivocation | None:
        """Proof that a reducer signed different results of one shard for different receivers, from
        the FINALs they show me (a receiver showing a signature that does not hold is lying: it is
        banned, and what it showed is ignored)."""
        group, out = self.run.group, self.outcome
        for j, r in sorted(out.assignment.items()):
            seen: dict[tuple[int, tuple[int, ...]], dict[bytes, bytes]] = {}  # (version, senders) -> root -> sig
            for i in receivers:
                final = self.states[i].finals.get(j)
                if final is None or self.states[i].version < out.version:
                    continue  # it may not know yet that the shard moved to `r`
                message = final_message(group.group_id, j, final.version, final.senders, final.root)
                if not group.peers[r].verify(final.signature, message):
                    self.run.service.banned.ban(group.peers[i], f"it showed a FINAL of shard {j} that its reducer "
                                                                f"{group.peers[r]} did not sign")
                    continue
                seen.setdefault((final.version, final.senders), {}).setdefault(final.root, final.signature)
            for (version, senders), roots in seen.items():
                if len(roots) < 2:
                    continue
                (a, sig_a), (b, sig_b) = list(roots.items())[:2]
                proof = Equivocation(r, j, version, senders, (a, b), (sig_a, sig_b))
                self.run.service.banned.ban(group.peers[r], f"as reducer of shard {j}, it signed two different "
                                                            "results of it")
                return proof
        return None

    def _agreed(self, senders: tuple[int, ...]) -> tuple[tuple[int, ...], dict[int, bytes]] | None:
        """The senders whose own roots match what every reporting reducer received from them, and
        per reported shard the digest of those roots; None while a sender's roots may still come.
        A mismatch means the sender or the reducer lies; either way the sender is left out (as a
        reducer could already leave it out by calling it incomplete), and it is logged."""
        received: dict[int, dict[int, bytes]] = {}
        for state in self.states.values():
            for j in state.reports:
                if self.outcome.assignment.get(j) == state.member and state.member not in self.run.dead:
                    received[j] = state.received.get(j, {})
        agreed = []
        for s in senders:
            sent = self.states[s].sent if s in self.states else {}
            if not set(received) <= set(sent):
                if not self.late:
                    return None
                continue
            disputed = [j for j in received if received[j].get(s) != sent[j]]
            if disputed:
                logger.warning("member %d (%s) and the reducers of shards %s disagree on what it sent; "
                               "it is left out of this step", s, self.run.group.peers[s], disputed)
                continue
            agreed.append(s)
        digests = {j: shard_digest({s: self.states[s].sent[j] for s in agreed}) for j in received}
        return tuple(agreed), digests

    def _reassign(self, assignment: dict[int, int], live: list[int]) -> dict[int, int]:
        """Give each dead reducer's shard to the next live reducer after it (deterministic)."""
        n = len(self.run.group.peers)
        for j, r in assignment.items():
            if r in self.run.dead:
                for step in range(1, n + 1):
                    candidate = (r + step) % n
                    if candidate in live:
                        assignment[j] = candidate
                        break
        return assignment

    def _publish(self, outcome: Outcome) -> None:
        logger.debug("coordinator %d decides %s (dead: %s)", self.run.me, outcome, sorted(self.run.dead))
        self.outcome = outcome
        self.newer.set()
        if outcome.committed or outcome.aborted:
            self.close()
        if outcome.version > self.run.outcome.version or outcome.committed or outcome.aborted:
            self.run.apply(outcome)
            self.run.state_changed.set()


# A reducer's answer to a check: sender -> (weight, its chunk digests, the block digests of the
# chunk checked, the values of the blocks checked). On the wire the values travel in the codec's
# form where it is exact (see _wire_form).
Pieces = dict[int, tuple[float, list[bytes], list[bytes], torch.Tensor]]


@dataclass(frozen=True)
class _Tombstone:
    """What a finished run leaves while it lingers: where this member stood, for a coordinator
    that took over late. A few small fields, never the run's tensors."""

    group: Group
    outcome: Outcome
    state: MemberState


class AllReduceService:
    """The handlers for all-reduce on one transport, dispatching to the runs under way."""

    def __init__(self, transport: Transport):
        self.transport = transport
        self.runs: dict[bytes, AllReduceRun] = {}
        self.finished: dict[bytes, _Tombstone] = {}
        self.pool = BufferPool()
        self.banned = ban_list(transport)
        self._arrived: dict[bytes, asyncio.Event] = {}
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
        """A member in client mode that we lost every connection with has died, as far as any
        step can tell: it cannot be dialed, and a live one keeps the connections it opened.
        Without this, the others would wait for its piece or its FINAL reports until a deadline.
        (Members that listen are not presumed dead: a failed dial or stream proves it.)"""
        self._lost.pop(peer_id, None)
        self._lost[peer_id] = asyncio.get_running_loop().time()
        while len(self._lost) > MAX_REMEMBERED_LOSSES:
            del self._lost[next(iter(self._lost))]
        for run in list(self.runs.values()):
            if peer_id in run.group.peers:
                member = run.group.peers.index(peer_id)
                if run.group.modes[member] == "client":
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
        self._arrived.setdefault(gid, asyncio.Event()).set()
        now = asyncio.get_running_loop().time()
        for i, (peer, mode) in enumerate(zip(group.peers, group.modes, strict=True)):
            lost = self._lost.get(peer)
            if mode == "client" and lost is not None and now - lost < LOST_MEMORY_SECONDS \
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

    def _forget(self, gid: bytes) -> None:
        self.finished.pop(gid, None)
        self._arrived.pop(gid, None)
        self._linger.pop(gid, None)

    async def _find(self, gid: Any) -> AllReduceRun | _Tombstone:
        """The run of `gid` here (waiting briefly for it to start), or what is left of it."""
        if not isinstance(gid, bytes):
            raise AveragingError("malformed group id")
        event = self._arrived.get(gid)
        if event is None:
            if len(self._arrived) > MAX_PENDING_GROUPS:
                raise AveragingError("too many pending groups")
            event = self._arrived[gid] = asyncio.Event()
        try:
            async with compat.timeout(REGISTRATION_WAIT):
                await event.wait()
        except TimeoutError:
            self._arrived.pop(gid, None)
            raise AveragingError("unknown averaging group") from None
        found = self.runs.get(gid) or self.finished.get(gid)
        if found is None:
            raise AveragingError("unknown averaging group")
        return found

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
        run = await self._find(request.group_id)
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
            return SyncReply.from_wire(reply, run.group)
        except MalformedMessage as e:
            raise AveragingError(str(e)) from None  # its coordinator misbehaves: not a network failure

    async def _on_wait(self, request: Any, ctx: Any) -> dict:
        run = await self._find(SyncRequest.group_id_of(request))
        state = SyncRequest.from_wire(request, run.group).state
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

    async def query(self, run: AllReduceRun, member: int, timeout: float = QUERY_TIMEOUT) -> MemberState | None:
        reply = await self.transport.call(run.group.peers[member], METHOD_QUERY, run.group.group_id, timeout=timeout)
        return MemberState.from_wire(reply, run.group) if reply is not None else None

    async def _on_query(self, request: Any, ctx: Any) -> dict | None:
        if not isinstance(request, bytes):
            return None
        run = self.runs.get(request)
        if run is not None:
            return run.state().to_wire()
        tombstone = self.finished.get(request)
        return None if tombstone is None else tombstone.state.to_wire()

    async def pieces(self, run: AllReduceRun, reducer: int, shard: int, where: tuple[int, int, int],
                     sizes: tuple[int, int], numel: int) -> Pieces:
        """`reducer`'s pieces of `where` = (chunk, first block, blocks) of `shard`, whose (chunks,
        blocks in that chunk) are `sizes`: sender -> (weight, its chunk digests, the block
        digests of that chunk, the values of those blocks)."""
        left = max(0.1, min(VERIFY_TIMEOUT, run.deadline - asyncio.get_running_loop().time()))
        c, first, count = where
        chunks, blocks = sizes
        request = {"g": run.group.group_id, "m": run.me, "j": shard, "c": c, "b": first, "k": count}
        reply = await self.transport.call(run.group.peers[reducer], METHOD_VERIFY, request, timeout=left)
        what, n = "pieces", len(run.group.peers)
        pieces: Pieces = {}
        for entry in list_field({"p": reply.get("p") if isinstance(reply, dict) else None}, "p", what, n):
            if not isinstance(entry, (list, tuple)) or len(entry) != 6 or not isinstance(entry[5], bool):
                raise AveragingError("malformed pieces: entries must be [sender, weight, digests, blocks, values, "
                                     "encoded]")
            digests = list_field({"d": entry[2]}, "d", what, chunks, length=chunks)
            of_c = list_field({"d": entry[3]}, "d", what, blocks, length=blocks)
            if any(not isinstance(d, bytes) or len(d) != DIGEST_BYTES for d in [*digests, *of_c]):
                raise AveragingError("malformed pieces: digests must be 32-byte strings")
            piece = _decode(run.codec, entry[4], numel) if entry[5] else entry[4]  # see _wire_form
            if not isinstance(piece, torch.Tensor) or piece.dtype != torch.float32 or piece.numel() != numel \
                    or not all_finite(piece):
                raise AveragingError(f"malformed pieces: each piece must be {numel} finite float32s")
            pieces[int_value(entry[0], "p", what, 0, n)] = (number_value(entry[1], "p", what), digests, of_c,
                                                            piece.reshape(-1))
        return pieces

    async def _on_verify(self, request: Any, ctx: Any) -> dict:
        """A member checks my work as a reducer: my pieces of some blocks of a chunk of a shard I
        finalized, with the digests that bind them to what their senders sent."""
        what = "verify request"
        msg = wire_map(request, what)
        run = self.runs.get(bytes_field(msg, "g", what, MAX_GROUP_ID_BYTES))
        if run is None:
            raise AveragingError("no such step under way here")
        n = len(run.group.peers)
        member = self._member(run, ctx.peer_id, int_field(msg, "m", what, 0, n))
        red = run.reducers.get(int_field(msg, "j", what, 0, n))
        c = int_field(msg, "c", what, 0, 2**31)
        if red is None or red.final_senders is None or c >= red.chunks:
            raise AveragingError("no final result of that chunk here")
        blocks = math.ceil((min(red.size, (c + 1) * red.chunk) - c * red.chunk) / VERIFY_BLOCK)
        first = int_field(msg, "b", what, 0, blocks)
        count = int_field(msg, "k", what, 1, blocks - first + 1)
        if (member, red.shard, red.final_version) in run.checked_by:
            raise AveragingError("this member checked that result already")  # one check each: no amplification
        run.checked_by.add((member, red.shard, red.final_version))
        values = slice(first * VERIFY_BLOCK, (first + count) * VERIFY_BLOCK)
        return {"p": [[s, red.weights[s], run.chunk_digests(red, s), block_digests(red.pieces[s][c]),
                       *_wire_form(run.codec, red.pieces[s][c][values])] for s in red.final_senders]}
