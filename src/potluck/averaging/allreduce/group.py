"""`Group`: who averages together, in which role, and who reduces which part of the vector.

Matchmaking forms it (the leader decides it and sends it to every member), the all-reduce runs
over it; every member holds the same one. Members are told apart by their index in `peers`.
"""

from __future__ import annotations

from potluck.averaging.role import Role
from potluck.core.wire import Bytes, Choice, Int, List, Message
from potluck.net.identity import PeerID
from potluck.net.wire import PeerIdField

__all__ = ["MAX_GROUP_ID_BYTES", "MAX_GROUP_SIZE", "ROLES", "Group"]

ROLES = tuple(r.value for r in Role)  # the wire values of the roles: "node", "client", "aux"

# Longest group id accepted from a peer (ours are 32-byte digests).
MAX_GROUP_ID_BYTES = 64
# A leader refuses groups larger than this whatever a follower asks (protects its memory/CPU).
MAX_GROUP_SIZE = 1024


class Group(Message, what="group"):
    """Who averages together and who reduces what; identical on every member. Checked whether
    built here or received: one role and one part size per member, and no client reducing."""

    group_id: bytes = Bytes("id", MAX_GROUP_ID_BYTES)
    peers: tuple[PeerID, ...] = List("peers", PeerIdField(raw=True), MAX_GROUP_SIZE)
    roles: tuple[str, ...] = List("roles", Choice(choices=ROLES), MAX_GROUP_SIZE)
    part_sizes: tuple[int, ...] = List("parts", Int(), MAX_GROUP_SIZE)  # elements each member reduces (0: none)

    def __post_init__(self) -> None:
        n = len(self.peers)
        if n == 0:
            raise self.refuse("'peers' must name at least one member")
        if len(self.roles) != n or any(r not in ROLES for r in self.roles):
            raise self.refuse(f"'roles' must be a list of {n} roles among {list(ROLES)}")
        if len(self.part_sizes) != n or any(s < 0 for s in self.part_sizes):
            raise self.refuse(f"'parts' must be a list of {n} sizes >= 0")
        if any(s and r == Role.CLIENT for s, r in zip(self.part_sizes, self.roles, strict=True)):
            raise self.refuse("'parts': client members cannot reduce")

    @property
    def total(self) -> int:
        return sum(self.part_sizes)

    @property
    def shards(self) -> list[int]:
        return [j for j, s in enumerate(self.part_sizes) if s]

    @property
    def receivers(self) -> list[int]:
        return [i for i, r in enumerate(self.roles) if r != Role.AUX]

    def bounds(self, shard: int) -> tuple[int, int]:
        start = sum(self.part_sizes[:shard])
        return start, start + self.part_sizes[shard]

    def coordinators(self) -> list[int]:
        """Succession order of coordinators: members that can be dialed."""
        return [i for i, r in enumerate(self.roles) if r != Role.CLIENT]
