"""The parameter server's wire messages, as typed values checked once, at parse time.

Each class has `to_wire()` (plain msgpack-able data) and `from_wire()`, which checks types, sizes
and ranges and raises `MalformedMessage(message, field)` naming the field; handlers and clients
only ever see these classes. Tensors are checked against the shard they belong to (count, shape,
dtype), so a wrong-sized gradient is refused before it reaches the optimizer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from potluck.core.errors import MalformedMessage
from potluck.core.wire import bool_field, int_field, int_value, list_field, number_value, text_field, wire_map
from potluck.net.identity import PeerID
from potluck.net.wire import peer_id_value

__all__ = ["ParamsReply", "PullRequest", "PushRequest", "RegisterRequest", "ReplicaAck", "ReplicaUpdate",
           "ServerAnnouncement", "ShardLayout", "ShardRole"]

# Server steps never wrap in a run and must fit msgpack's int64.
MAX_STEP = 2**62
# Parameter tensors a layout places: large transformers have a few thousand; this is room to spare
# while keeping a hostile layout's assignment list small.
MAX_LAYOUT_TENSORS = 100_000
# Shards of one run: one per server, and a server per peer of the largest swarms we aim at.
MAX_SHARDS = 4096
# Servers per shard, primary first: the decentralized form uses two (primary and one standby).
MAX_SERVERS_PER_SHARD = 8
# Workers a replica update lists (the primary's whole membership, copied every step).
MAX_WORKERS = 10_000
# Named state slots of one parameter in an optimizer (Adam has 3, AMSGrad 4): room for others'.
MAX_OPTIMIZER_SLOTS = 16
# A slot's name ("exp_avg", "momentum_buffer", ...).
MAX_SLOT_NAME_CHARS = 64
# Shard roles one peer announces: a primary and a standby in the decentralized form; room for more.
MAX_ROLES = 8
# A layout digest: sha256 in hex.
DIGEST_CHARS = 64


# -- field checks (the generic ones are potluck.core.wire's) ---------------------------------------
def _tensors(msg: dict, key: str, what: str, like: Sequence[torch.Tensor], *,
             finite: bool) -> tuple[torch.Tensor, ...]:
    """`msg[key]`: exactly one tensor per tensor of `like`, each of its shape and dtype (and
    finite, if asked: a NaN gradient would poison every later step)."""
    values = msg.get(key)
    if not isinstance(values, list) or len(values) != len(like):
        count = len(values) if isinstance(values, list) else type(values).__name__
        raise MalformedMessage(what, f"{key!r} must be a list of {len(like)} tensors, got {count}")
    for i, (t, ref) in enumerate(zip(values, like, strict=True)):
        if not isinstance(t, torch.Tensor):
            raise MalformedMessage(what, f"{key!r}[{i}] is a {type(t).__name__}, not a tensor")
        if t.shape != ref.shape or t.dtype != ref.dtype:
            raise MalformedMessage(what, f"{key!r}[{i}] is {t.dtype} {tuple(t.shape)}; "
                                         f"expected {ref.dtype} {tuple(ref.shape)}")
        if finite and not torch.isfinite(t).all():
            raise MalformedMessage(what, f"{key!r}[{i}] has non-finite values")
    return tuple(values)


# -- where the servers are ---------------------------------------------------------------------------
@dataclass(frozen=True)
class ShardLayout:
    """Which server holds which parameters: `assignment[i]` is parameter i's shard, and
    `servers[k]` the peers that serve shard k, primary first, then its standbys. Workers receive
    it from whoever started the servers (a file, the DHT, ...), so it is parsed like any message."""

    assignment: tuple[int, ...]
    servers: tuple[tuple[PeerID, ...], ...]

    def indices(self, shard: int) -> list[int]:
        return [i for i, s in enumerate(self.assignment) if s == shard]

    @property
    def num_shards(self) -> int:
        return len(self.servers)

    def to_wire(self) -> dict:
        return {"assignment": list(self.assignment), "servers": [[str(p) for p in s] for s in self.servers]}

    @classmethod
    def from_wire(cls, msg: Any) -> ShardLayout:
        what = "shard layout"
        msg = wire_map(msg, what)
        servers = list_field(msg, "servers", what, MAX_SHARDS)
        if not servers:
            raise MalformedMessage(what, "'servers' must name at least one shard")
        parsed = []
        for shard in servers:
            if not isinstance(shard, list) or not 1 <= len(shard) <= MAX_SERVERS_PER_SHARD:
                raise MalformedMessage(what, f"'servers' entries must list 1 to {MAX_SERVERS_PER_SHARD} peer ids")
            parsed.append(tuple(peer_id_value(p, "servers", what) for p in shard))
        shards = list_field(msg, "assignment", what, MAX_LAYOUT_TENSORS,
                            each=lambda a: int_value(a, "assignment", what, 0, len(parsed)))
        return cls(tuple(shards), tuple(parsed))


# -- in the DHT: who serves which shard ----------------------------------------------------------
@dataclass(frozen=True)
class ShardRole:
    """One shard a peer serves: as its primary (`standby_of` None; `replica`: the standby it copies
    its state to, once attached; `await_standby`: workers wait for that standby before starting),
    or as the standby of primary `standby_of`."""

    shard: int
    standby_of: PeerID | None = None
    replica: PeerID | None = None
    await_standby: bool = False

    def to_wire(self) -> dict:
        return {"shard": self.shard, "standby_of": str(self.standby_of) if self.standby_of else None,
                "replica": str(self.replica) if self.replica else None, "await_standby": self.await_standby}

    @classmethod
    def from_wire(cls, msg: Any, num_shards: int) -> ShardRole:
        what = "shard role"
        msg = wire_map(msg, what)
        standby_of, replica = (peer_id_value(msg[k], k, what) if msg.get(k) is not None else None
                               for k in ("standby_of", "replica"))
        return cls(int_field(msg, "shard", what, 0, num_shards), standby_of, replica,
                   bool_field(msg, "await_standby", what))


@dataclass(frozen=True)
class ServerAnnouncement:
    """What a shard server publishes under its own signed subkey of the run's servers key: the
    layout it serves (`digest` of the model's tensors, the shard count and the assignment, so a
    worker with another model or shard count refuses it) and its roles."""

    digest: str
    num_shards: int
    roles: tuple[ShardRole, ...]

    def to_wire(self) -> dict:
        return {"digest": self.digest, "num_shards": self.num_shards, "roles": [r.to_wire() for r in self.roles]}

    @classmethod
    def from_wire(cls, msg: Any) -> ServerAnnouncement:
        what = "shard server announcement"
        msg = wire_map(msg, what)
        num_shards = int_field(msg, "num_shards", what, 1, MAX_SHARDS + 1)
        roles = list_field(msg, "roles", what, MAX_ROLES, each=lambda r: ShardRole.from_wire(r, num_shards))
        return cls(text_field(msg, "digest", what, DIGEST_CHARS), num_shards, tuple(roles))


# -- worker -> server ------------------------------------------------------------------------------
@dataclass(frozen=True)
class RegisterRequest:
    """A worker joins the run: it waits at the start barrier, then gets the parameters."""

    def to_wire(self) -> dict:
        return {}

    @classmethod
    def from_wire(cls, msg: Any) -> RegisterRequest:
        wire_map(msg, "register request")
        return cls()


@dataclass(frozen=True)
class PullRequest:
    """A worker asks for the current parameters without pushing anything."""

    def to_wire(self) -> dict:
        return {}

    @classmethod
    def from_wire(cls, msg: Any) -> PullRequest:
        wire_map(msg, "pull request")
        return cls()


@dataclass(frozen=True)
class PushRequest:
    """A worker's gradients for one shard, computed on the parameters of server step `step`.
    `seq` numbers the worker's pushes (the same when it sends one again to a standby): a server
    applies a push only if its `seq` is above the worker's last applied one. None: not numbered."""

    step: int
    grads: tuple[torch.Tensor, ...]
    seq: int | None = None

    def to_wire(self) -> dict:
        wire = {"step": self.step, "grads": list(self.grads)}
        if self.seq is not None:
            wire["seq"] = self.seq
        return wire

    @classmethod
    def from_wire(cls, msg: Any, like: Sequence[torch.Tensor], latest_step: int) -> PushRequest:
        """Checked against the shard's parameters `like` and the server's current step (a worker
        cannot have computed on parameters the server has not made yet)."""
        what = "push"
        msg = wire_map(msg, what)
        step = int_field(msg, "step", what, 0, latest_step + 1)
        grads = _tensors(msg, "grads", what, like, finite=True)
        seq = msg.get("seq")
        return cls(step, grads, None if seq is None else int_value(seq, "seq", what, 0, MAX_STEP))


# -- server -> worker ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class ParamsReply:
    """The shard's parameters after server step `step`; `dropped`: the push this answers was not
    used (backup mode: it was computed on parameters a finished round had replaced)."""

    step: int
    params: tuple[torch.Tensor, ...]
    dropped: bool = False

    def to_wire(self) -> dict:
        return {"step": self.step, "params": list(self.params), "dropped": self.dropped}

    @classmethod
    def from_wire(cls, msg: Any, like: Sequence[torch.Tensor]) -> ParamsReply:
        """Checked against the worker's own copies `like` of the shard's parameters. Values are
        not checked for finiteness: the server is the authority on them, and the worker has no
        better parameters to keep."""
        what = "parameters reply"
        msg = wire_map(msg, what)
        dropped = bool_field(msg, "dropped", what)
        return cls(int_field(msg, "step", what, 0, MAX_STEP), _tensors(msg, "params", what, like, finite=False),
                   dropped)


# -- primary -> standby -------------------------------------------------------------------------------
OptimizerSlots = dict[str, Any]  # slot name -> tensor or number


@dataclass(frozen=True)
class ReplicaUpdate:
    """A primary's state after step `step`, copied to its standby before it answers the workers:
    the parameters, the optimizer's per-parameter state (Adam's moments and step counts: without
    them a takeover would restart the optimizer), the workers it serves (the standby takes them
    over with it), and each worker's last applied push (its `PushRequest.seq`, so a push sent again
    to the standby after the primary applied it is not applied twice)."""

    step: int
    params: tuple[torch.Tensor, ...]
    workers: tuple[PeerID, ...]
    optimizer: tuple[OptimizerSlots, ...] = ()  # one per parameter; () sends none (the standby keeps its own)
    last_push: dict[PeerID, int] = field(default_factory=dict)

    def to_wire(self) -> dict:
        return {"step": self.step, "params": list(self.params), "workers": [str(w) for w in self.workers],
                "optimizer": [dict(slots) for slots in self.optimizer],
                "last_push": {str(w): s for w, s in self.last_push.items()}}

    @classmethod
    def from_wire(cls, msg: Any, like: Sequence[torch.Tensor]) -> ReplicaUpdate:
        what = "replica update"
        msg = wire_map(msg, what)
        step = int_field(msg, "step", what, 0, MAX_STEP)
        params = _tensors(msg, "params", what, like, finite=True)
        workers = tuple(list_field(msg, "workers", what, MAX_WORKERS, each=lambda w: peer_id_value(w, "workers", what)))
        optimizer = msg.get("optimizer", [])
        if not isinstance(optimizer, list) or len(optimizer) not in (0, len(like)):
            raise MalformedMessage(what, f"'optimizer' must be a list of {len(like)} maps (or empty)")
        slots = tuple(_optimizer_slots(s, ref, what) for s, ref in zip(optimizer, like, strict=True)) \
            if optimizer else ()
        pushes = wire_map(msg.get("last_push", {}), what)
        if len(pushes) > MAX_WORKERS:
            raise MalformedMessage(what, f"'last_push' must list at most {MAX_WORKERS} workers")
        last_push = {peer_id_value(w, "last_push", what): int_value(s, "last_push", what, 0, MAX_STEP)
                     for w, s in pushes.items()}
        return cls(step, params, workers, slots, last_push)


def _optimizer_slots(slots: Any, like: torch.Tensor, what: str) -> OptimizerSlots:
    """One parameter's optimizer state: named finite tensors no larger than the parameter (moments,
    a step count) or numbers; `load` in the standby checks nothing else, so this is the check."""
    slots = wire_map(slots, what)
    if len(slots) > MAX_OPTIMIZER_SLOTS:
        raise MalformedMessage(what, f"'optimizer' entries must have at most {MAX_OPTIMIZER_SLOTS} slots")
    out: OptimizerSlots = {}
    for name, value in slots.items():
        if not isinstance(name, str) or len(name) > MAX_SLOT_NAME_CHARS:
            raise MalformedMessage(what, f"'optimizer' slot names must be strings of at most {MAX_SLOT_NAME_CHARS} "
                                         "characters")
        if isinstance(value, torch.Tensor):
            if value.numel() > max(1, like.numel()) or (value.is_floating_point() and not torch.isfinite(value).all()):
                raise MalformedMessage(what, f"'optimizer' slot {name!r} must be finite and no larger than its "
                                             "parameter")
            out[name] = value
        elif isinstance(value, int) and not isinstance(value, bool):
            out[name] = value  # a step counter kept as an int
        else:
            out[name] = number_value(value, "optimizer", what, signed=True)
    return out


@dataclass(frozen=True)
class ReplicaAck:
    """The standby's answer: False once it has taken over (a late copy from the old primary)."""

    accepted: bool

    def to_wire(self) -> dict:
        return {"accepted": self.accepted}

    @classmethod
    def from_wire(cls, msg: Any) -> ReplicaAck:
        return cls(bool_field(wire_map(msg, "replica ack"), "accepted", "replica ack"))
