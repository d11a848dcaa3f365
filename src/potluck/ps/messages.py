"""The parameter server's wire messages, declared once (`potluck.core.wire.Message`).

Each class gets `to_wire()` (plain msgpack-able data) and `from_wire(msg, **context)`, which checks
types, sizes and ranges and raises `MalformedMessage(message, field)` naming the field; handlers
and clients only ever see these classes. Tensors are checked against the shard they belong to
(`like=` in the context: count, shape, dtype), so a wrong-sized gradient is refused before it
reaches the optimizer.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from potluck.core.errors import MalformedMessage
from potluck.core.names import MAX_RUN_ID_CHARS, check_run_id
from potluck.core.wire import Bool, Dict, Field, Int, List, Message, Nested, Text, number_value
from potluck.net.identity import PeerID
from potluck.net.wire import PeerIdField
from potluck.optim.schema import ModelSignature

__all__ = ["ParamsReply", "PullRequest", "PushRequest", "RegisterRequest", "ReplicaAck", "ReplicaUpdate",
           "RunsQuery", "ServedRuns", "ServerAnnouncement", "ShardLayout", "ShardRole"]

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
# Runs one peer says it serves shard servers of: the CLI serves one, a library host a few. The
# asker's own run comes first when served, so a longer list cut here still answers its question.
MAX_SERVED_RUNS = 16


# -- field types (the generic ones are potluck.core.wire's) ------------------------------------------
class ShardTensors(Field):
    """Exactly one tensor per tensor of the shard (`like` in the context), each of its shape and
    dtype (and finite, if `finite`: a NaN gradient would poison every later step)."""

    def __init__(self, key: str, *, finite: bool):
        super().__init__(key)
        self.finite = finite

    def check(self, value: Any, key: str, what: str, context: Mapping[str, Any]) -> tuple[torch.Tensor, ...]:
        like: Sequence[torch.Tensor] = context["like"]
        if not isinstance(value, (list, tuple)) or len(value) != len(like):
            count = len(value) if isinstance(value, (list, tuple)) else type(value).__name__
            raise MalformedMessage(what, f"{key!r} must be a list of {len(like)} tensors, got {count}")
        for i, (t, ref) in enumerate(zip(value, like, strict=True)):
            if not isinstance(t, torch.Tensor):
                raise MalformedMessage(what, f"{key!r}[{i}] is a {type(t).__name__}, not a tensor")
            if t.shape != ref.shape or t.dtype != ref.dtype:
                raise MalformedMessage(what, f"{key!r}[{i}] is {t.dtype} {tuple(t.shape)}; "
                                             f"expected {ref.dtype} {tuple(ref.shape)}")
            if self.finite and not torch.isfinite(t).all():
                raise MalformedMessage(what, f"{key!r}[{i}] has non-finite values")
        return tuple(value)


OptimizerSlots = dict[str, Any]  # slot name -> tensor or number


class OptimizerState(Field):
    """The optimizer's per-parameter state: one map of named slots per tensor of the shard (`like`
    in the context), or none at all; `load` in the standby checks nothing else, so this is the check."""

    encodes = True

    def __init__(self, key: str):
        super().__init__(key, default=())

    def check(self, value: Any, key: str, what: str, context: Mapping[str, Any]) -> tuple[OptimizerSlots, ...]:
        like: Sequence[torch.Tensor] = context["like"]
        if not isinstance(value, (list, tuple)) or len(value) not in (0, len(like)):
            raise MalformedMessage(what, f"{key!r} must be a list of {len(like)} maps (or empty)")
        return tuple(_optimizer_slots(s, ref, key, what) for s, ref in zip(value, like, strict=False))

    def encode(self, value: tuple[OptimizerSlots, ...]) -> list:
        return [dict(slots) for slots in value]


def _optimizer_slots(slots: Any, like: torch.Tensor, key: str, what: str) -> OptimizerSlots:
    """One parameter's optimizer state: named finite tensors no larger than the parameter (moments,
    a step count) or numbers."""
    if not isinstance(slots, Mapping):
        raise MalformedMessage(what, f"{key!r} entries must be maps")
    if len(slots) > MAX_OPTIMIZER_SLOTS:
        raise MalformedMessage(what, f"{key!r} entries must have at most {MAX_OPTIMIZER_SLOTS} slots")
    out: OptimizerSlots = {}
    for name, value in slots.items():
        if not isinstance(name, str) or len(name) > MAX_SLOT_NAME_CHARS:
            raise MalformedMessage(what, f"{key!r} slot names must be strings of at most {MAX_SLOT_NAME_CHARS} "
                                         "characters")
        if isinstance(value, torch.Tensor):
            if value.numel() > max(1, like.numel()) or (value.is_floating_point() and not torch.isfinite(value).all()):
                raise MalformedMessage(what, f"{key!r} slot {name!r} must be finite and no larger than its parameter")
            out[name] = value
        elif isinstance(value, int) and not isinstance(value, bool):
            out[name] = value  # a step counter kept as an int
        else:
            out[name] = number_value(value, key, what, signed=True)
    return out


class RunId(Field):
    """A run id (`check_run_id`: printable, no spaces, at most MAX_RUN_ID_CHARS): it is printed in
    errors, so a peer's bytes never reach the terminal as control characters."""

    def check(self, value: Any, key: str, what: str, context: Mapping[str, Any]) -> str:
        try:
            return check_run_id(value)
        except ValueError:
            raise MalformedMessage(what, f"{key!r} must be a run id: 1 to {MAX_RUN_ID_CHARS} printable "
                                         "characters without spaces") from None


# -- where the servers are ---------------------------------------------------------------------------
class ShardLayout(Message, what="shard layout"):
    """Which server holds which parameters: `assignment[i]` is parameter i's shard, and
    `servers[k]` the peers that serve shard k, primary first, then its standbys. Workers receive
    it from whoever started the servers (a file, the DHT, ...), so it is parsed like any message."""

    assignment: tuple[int, ...] = List("assignment", Int(None, 0, MAX_SHARDS), MAX_LAYOUT_TENSORS)
    servers: tuple[tuple[PeerID, ...], ...] = List("servers", List(None, PeerIdField(), MAX_SERVERS_PER_SHARD),
                                                   MAX_SHARDS)

    def indices(self, shard: int) -> list[int]:
        return [i for i, s in enumerate(self.assignment) if s == shard]

    @property
    def num_shards(self) -> int:
        return len(self.servers)

    def validate(self, context: Mapping[str, Any]) -> None:
        if not self.servers:
            raise self.refuse("'servers' must name at least one shard")
        if not all(self.servers):
            raise self.refuse(f"'servers' entries must list 1 to {MAX_SERVERS_PER_SHARD} peer ids")
        if any(shard >= len(self.servers) for shard in self.assignment):
            raise self.refuse(f"'assignment' must be an integer in [0, {len(self.servers)})")


# -- in the DHT: who serves which shard ----------------------------------------------------------
class ShardRole(Message, what="shard role"):
    """One shard a peer serves: as its primary (`standby_of` None; `replica`: the standby it copies
    its state to, once attached; `await_standby`: workers wait for that standby before starting),
    or as the standby of primary `standby_of`. `num_shards` in the context bounds `shard`."""

    shard: int = Int("shard", 0, lambda context: context.get("num_shards", MAX_SHARDS))
    standby_of: PeerID | None = PeerIdField("standby_of", default=None)
    replica: PeerID | None = PeerIdField("replica", default=None)
    await_standby: bool = Bool("await_standby", default=False)


class ServerAnnouncement(Message, what="shard server announcement"):
    """What a shard server publishes under its own signed subkey of the run's servers key: the
    layout it serves (`digest` of the model's tensors, the shard count and the assignment, so a
    worker with another model or shard count refuses it), its roles, and its model's schema
    (`model`, `potluck.optim.schema`: a worker of another model is told which tensor differs)."""

    digest: str = Text("digest", DIGEST_CHARS)
    num_shards: int = Int("num_shards", 1, MAX_SHARDS + 1)
    roles: tuple[ShardRole, ...] = List("roles", Nested(None, ShardRole), MAX_ROLES)
    model: ModelSignature | None = Nested("model", ModelSignature, default=None)

    def validate(self, context: Mapping[str, Any]) -> None:
        if any(role.shard >= self.num_shards for role in self.roles):
            raise self.refuse(f"'roles': 'shard' must be an integer in [0, {self.num_shards})")


# -- any peer -> a peer that serves shards, whatever their runs (core.names.PS_RUNS) -----------------
class RunsQuery(Message, what="served runs query"):
    """Which parameter-server runs do you serve? Asked by a worker of run `run_id` that finds no
    server of its run (`ps.discovery`): its own run is listed first if served."""

    run_id: str = RunId("run")


class ServedRuns(Message, what="served runs"):
    """The runs a peer serves shard servers of (the asker's first, if among them; the rest sorted,
    at most MAX_SERVED_RUNS)."""

    runs: tuple[str, ...] = List("runs", RunId(), MAX_SERVED_RUNS)

    def validate(self, context: Mapping[str, Any]) -> None:
        if len(set(self.runs)) != len(self.runs):
            raise self.refuse("'runs' must not repeat a run")


# -- worker -> server ------------------------------------------------------------------------------
class RegisterRequest(Message, what="register request"):
    """A worker joins the run: it waits at the start barrier, then gets the parameters."""


class PullRequest(Message, what="pull request"):
    """A worker asks for the current parameters without pushing anything."""


class PushRequest(Message, what="push"):
    """A worker's gradients for one shard, computed on the parameters of server step `step`.
    `seq` numbers the worker's pushes (the same when it sends one again to a standby): a server
    applies a push only if its `seq` is above the worker's last applied one. None: not numbered.
    Checked against the shard's parameters (`like`) and the server's current step (`latest_step`:
    a worker cannot have computed on parameters the server has not made yet)."""

    step: int = Int("step", 0, lambda context: context["latest_step"] + 1)
    grads: tuple[torch.Tensor, ...] = ShardTensors("grads", finite=True)
    seq: int | None = Int("seq", 0, MAX_STEP, default=None)


# -- server -> worker ---------------------------------------------------------------------------------
class ParamsReply(Message, what="parameters reply"):
    """The shard's parameters after server step `step`; `dropped`: the push this answers was not
    used (backup consistency: it was computed on parameters a finished round had replaced).
    Checked against the worker's own copies (`like`); values are not checked for finiteness: the
    server is the authority on them, and the worker has no better parameters to keep."""

    step: int = Int("step", 0, MAX_STEP)
    params: tuple[torch.Tensor, ...] = ShardTensors("params", finite=False)
    dropped: bool = Bool("dropped", default=False)


# -- primary -> standby -------------------------------------------------------------------------------
class ReplicaUpdate(Message, what="replica update"):
    """A primary's state after step `step`, copied to its standby before it answers the workers:
    the parameters, the optimizer's per-parameter state (Adam's moments and step counts: without
    them a takeover would restart the optimizer), the workers it serves (the standby takes them
    over with it), and each worker's last applied push (its `PushRequest.seq`, so a push sent again
    to the standby after the primary applied it is not applied twice)."""

    step: int = Int("step", 0, MAX_STEP)
    params: tuple[torch.Tensor, ...] = ShardTensors("params", finite=True)
    workers: tuple[PeerID, ...] = List("workers", PeerIdField(), MAX_WORKERS)
    optimizer: tuple[OptimizerSlots, ...] = OptimizerState("optimizer")  # one per parameter; (): none sent
    last_push: dict[PeerID, int] = Dict("last_push", PeerIdField(), Int(None, 0, MAX_STEP), MAX_WORKERS, pairs=False)


class ReplicaAck(Message, what="replica ack"):
    """The standby's answer: False once it has taken over (a late copy from the old primary)."""

    accepted: bool = Bool("accepted")
