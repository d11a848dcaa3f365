"""The parameter server's wire messages, as typed values checked once, at parse time.

Each class has `to_wire()` (plain msgpack-able data) and `from_wire()`, which checks types, sizes
and ranges and raises `MalformedMessage(message, field)` naming the field; handlers and clients
only ever see these classes. Tensors are checked against the shard they belong to (count, shape,
dtype), so a wrong-sized gradient is refused before it reaches the optimizer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from potluck.core.errors import AddressError, IdentityError, MalformedMessage
from potluck.net.address import MAX_ADDRESS_CHARS, Multiaddr
from potluck.net.identity import PeerID

__all__ = ["ParamsReply", "PullRequest", "PushRequest", "RegisterRequest", "ReplicaAck", "ReplicaUpdate",
           "ServerAddresses", "ShardLayout"]

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
# Addresses kept per server: a server gains nothing by listing more (a transport dials a handful).
MAX_SERVER_ADDRESSES = 8


# -- field checks --------------------------------------------------------------------------------
def _map(msg: Any, what: str) -> dict:
    if not isinstance(msg, dict):
        raise MalformedMessage(what, "not a map")
    return msg


def _int(msg: dict, key: str, what: str, low: int, high: int) -> int:
    value = msg.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value < high:
        raise MalformedMessage(what, f"{key!r} must be an integer in [{low}, {high})")
    return value


def _list(msg: dict, key: str, what: str, max_items: int) -> list:
    value = msg.get(key)
    if not isinstance(value, list) or len(value) > max_items:
        raise MalformedMessage(what, f"{key!r} must be a list of at most {max_items} items")
    return value


def _peer_id(value: Any, key: str, what: str) -> PeerID:
    try:
        return PeerID.from_string(value)
    except IdentityError as e:
        raise MalformedMessage(what, f"{key!r} must hold peer ids: {e}") from None


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
        msg = _map(msg, what)
        servers = _list(msg, "servers", what, MAX_SHARDS)
        if not servers:
            raise MalformedMessage(what, "'servers' must name at least one shard")
        parsed = []
        for shard in servers:
            if not isinstance(shard, list) or not 1 <= len(shard) <= MAX_SERVERS_PER_SHARD:
                raise MalformedMessage(what, f"'servers' entries must list 1 to {MAX_SERVERS_PER_SHARD} peer ids")
            parsed.append(tuple(_peer_id(p, "servers", what) for p in shard))
        assignment = _list(msg, "assignment", what, MAX_LAYOUT_TENSORS)
        shards = [_int({"assignment": a}, "assignment", what, 0, len(parsed)) for a in assignment]
        return cls(tuple(shards), tuple(parsed))


@dataclass(frozen=True)
class ServerAddresses:
    """Where one server can be dialed, handed to workers with the layout (until peers publish
    their own addresses, workers are told them)."""

    peer_id: PeerID
    addresses: tuple[Multiaddr, ...]

    def to_wire(self) -> dict:
        return {"peer": str(self.peer_id), "addrs": [str(a) for a in self.addresses]}

    @classmethod
    def from_wire(cls, msg: Any) -> ServerAddresses:
        what = "server addresses"
        msg = _map(msg, what)
        addresses = []
        for text in _list(msg, "addrs", what, MAX_SERVER_ADDRESSES):
            try:
                if not isinstance(text, str) or len(text) > MAX_ADDRESS_CHARS:
                    raise AddressError(f"not a string of at most {MAX_ADDRESS_CHARS} characters")
                addresses.append(Multiaddr.parse(text))
            except (AddressError, IdentityError) as e:
                raise MalformedMessage(what, f"'addrs' must hold addresses: {e}") from None
        return cls(_peer_id(msg.get("peer"), "peer", what), tuple(addresses))


# -- worker -> server ------------------------------------------------------------------------------
@dataclass(frozen=True)
class RegisterRequest:
    """A worker joins the run: it waits at the start barrier, then gets the parameters."""

    def to_wire(self) -> dict:
        return {}

    @classmethod
    def from_wire(cls, msg: Any) -> RegisterRequest:
        _map(msg, "register request")
        return cls()


@dataclass(frozen=True)
class PullRequest:
    """A worker asks for the current parameters without pushing anything."""

    def to_wire(self) -> dict:
        return {}

    @classmethod
    def from_wire(cls, msg: Any) -> PullRequest:
        _map(msg, "pull request")
        return cls()


@dataclass(frozen=True)
class PushRequest:
    """A worker's gradients for one shard, computed on the parameters of server step `step`."""

    step: int
    grads: tuple[torch.Tensor, ...]

    def to_wire(self) -> dict:
        return {"step": self.step, "grads": list(self.grads)}

    @classmethod
    def from_wire(cls, msg: Any, like: Sequence[torch.Tensor], latest_step: int) -> PushRequest:
        """Checked against the shard's parameters `like` and the server's current step (a worker
        cannot have computed on parameters the server has not made yet)."""
        what = "push"
        msg = _map(msg, what)
        step = _int(msg, "step", what, 0, latest_step + 1)
        return cls(step, _tensors(msg, "grads", what, like, finite=True))


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
        msg = _map(msg, what)
        dropped = msg.get("dropped")
        if not isinstance(dropped, bool):
            raise MalformedMessage(what, "'dropped' must be a boolean")
        return cls(_int(msg, "step", what, 0, MAX_STEP), _tensors(msg, "params", what, like, finite=False), dropped)


# -- primary -> standby -------------------------------------------------------------------------------
@dataclass(frozen=True)
class ReplicaUpdate:
    """A primary's state after step `step`, copied to its standby before it answers the workers:
    the parameters and the workers it serves (the standby takes them over with it)."""

    step: int
    params: tuple[torch.Tensor, ...]
    workers: tuple[PeerID, ...]

    def to_wire(self) -> dict:
        return {"step": self.step, "params": list(self.params), "workers": [str(w) for w in self.workers]}

    @classmethod
    def from_wire(cls, msg: Any, like: Sequence[torch.Tensor]) -> ReplicaUpdate:
        what = "replica update"
        msg = _map(msg, what)
        step = _int(msg, "step", what, 0, MAX_STEP)
        params = _tensors(msg, "params", what, like, finite=True)
        workers = tuple(_peer_id(w, "workers", what) for w in _list(msg, "workers", what, MAX_WORKERS))
        return cls(step, params, workers)


@dataclass(frozen=True)
class ReplicaAck:
    """The standby's answer: False once it has taken over (a late copy from the old primary)."""

    accepted: bool

    def to_wire(self) -> dict:
        return {"accepted": self.accepted}

    @classmethod
    def from_wire(cls, msg: Any) -> ReplicaAck:
        accepted = _map(msg, "replica ack").get("accepted")
        if not isinstance(accepted, bool):
            raise MalformedMessage("replica ack", "'accepted' must be a boolean")
        return cls(accepted)
