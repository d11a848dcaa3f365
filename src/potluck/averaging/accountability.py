"""Holding the members of an averaging group to account: who was caught lying, and the digests
that let a member check a reducer's work.

A peer's ban list holds the members it caught lying itself (never on another peer's word, which
could be a lie too); matchmaking neither joins nor admits them, for the rest of the run. Its
exclusions hold the members whose pieces its reducers found statistically not honest
(`averaging.suspicion`): they stay in its groups, but no step it reduces a shard of counts their
pieces. A statistic can be wrong about an honest member, and refusing groups with one would split
the honest peers (a member that excluded it would meet only those that had not); leaving its
pieces out costs the step one contribution, and the member that judged it keeps averaging with
everyone else.

Digests bind what was sent: a sender's piece of a shard is hashed chunk by chunk, the chunk
hashes and its weight into one root; the coordinator's decision carries, per shard, one digest
over the roots of the senders it averages (see `allreduce`). A member that later asks the
reducer for the pieces of one chunk can then tell whether they are the pieces the senders sent,
and whether the reducer's result is what they average to.

Seals make that proof hold for anyone: a sender ends its piece's stream with its signature of
the root (`seal_message`), and its reducer refuses a piece whose seal does not match what came.
One block of the piece, the block digests of its chunk, the piece's chunk digests, weight and
seal (`SealedBlock`, `sealed_block`) then show any member of the group what that sender sent,
whoever relays them: a reducer cannot pin a piece on a sender, and a sender cannot disown its
piece. The seal also covers the metadata the sender joined the group with (`claim_digest`), so
what it claimed about its piece (potluck.optim's verified mode: how many samples are behind it)
is bound to the piece too.
"""

from __future__ import annotations

import hashlib
import logging
import struct
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
import torch

from potluck.core.bounded import drop_oldest
from potluck.core.digests import digest
from potluck.net.identity import PeerID

logger = logging.getLogger(__name__)

# Peers a ban list remembers; the longest-banned is forgotten first. Each entry is a few hundred
# bytes, and every ban cost its liar a caught step, so a flood of throwaway identities cannot
# grow the list faster than it fails steps.
MAX_BANNED = 1024
# Longest piece of evidence kept with a ban (it is logged in full when the ban is made).
MAX_EVIDENCE_CHARS = 500
# Bytes of every digest (SHA-256).
DIGEST_BYTES = 32
# Elements per digested block of a chunk (16 KiB of float32). A member that checks a reducer's
# work fetches one block from every sender (every aggregation reduces a block alone), not a whole chunk,
# in the codec's form where exact (allreduce.reduction.wire_form): the check then costs
# (reducers - 1) x senders x one block per member and step (~2 KiB under 4 bits), not a chunk.
VERIFY_BLOCK = 2**12


class BanList:
    """Peers this peer holds to account, with what it saw; shared by its averagers (`ban_list`:
    caught lying, `exclusions`: found not honest by its reducers' statistics)."""

    def __init__(self, cap: int = MAX_BANNED, consequence: str = "from averaging"):
        self.cap = cap
        self.consequence = consequence
        self._banned: dict[PeerID, str] = {}

    def ban(self, peer: PeerID, evidence: str) -> None:
        if peer not in self._banned:
            logger.warning("excluding %s %s for the rest of the run: %s", peer, self.consequence, evidence)
        self._banned.pop(peer, None)
        self._banned[peer] = evidence[:MAX_EVIDENCE_CHARS]
        drop_oldest(self._banned, self.cap)

    def __contains__(self, peer: object) -> bool:
        return peer in self._banned

    def __iter__(self) -> Iterator[PeerID]:
        return iter(list(self._banned))

    def evidence(self, peer: PeerID) -> str | None:
        return self._banned.get(peer)

    def __len__(self) -> int:
        return len(self._banned)


def ban_list(transport: Any) -> BanList:
    """The ban list of the peer behind `transport` (one per transport, like its services)."""
    banned = transport.services.get("banned")
    if banned is None:
        banned = transport.services["banned"] = BanList()
    return banned


def exclusions(transport: Any) -> BanList:
    """The members whose pieces the reducers of the peer behind `transport` no longer count
    (statistical verdicts: they stay in its groups; see the module)."""
    excluded = transport.services.get("excluded")
    if excluded is None:
        excluded = transport.services["excluded"] = BanList(consequence="from the averages this peer reduces")
    return excluded


def block_digests(values: torch.Tensor) -> list[bytes]:
    """Digests of the float32 bits of `values`, one per VERIFY_BLOCK elements (the bulk of an
    all-reduce's hashing: potluck.core.digests)."""
    data = memoryview(values.detach().to("cpu", torch.float32).reshape(-1).contiguous().numpy()).cast("B")
    step = 4 * VERIFY_BLOCK
    return [digest(data[i:i + step]) for i in range(0, max(len(data), 1), step)]


def blocks_digest(digests: Sequence[bytes]) -> bytes:
    h = hashlib.sha256(b"potluck.chunk")
    for d in digests:
        h.update(d)
    return h.digest()


def chunk_digest(chunk: torch.Tensor) -> bytes:
    """Digest of a chunk's float32 bits (as the reducer decoded them), over its blocks' digests,
    so that one block can be checked against it with the other blocks' digests alone."""
    return blocks_digest(block_digests(chunk))


def piece_root(weight: float, chunk_digests: Sequence[bytes]) -> bytes:
    """One sender's piece of one shard: its weight and the digests of its chunks, in order."""
    h = hashlib.sha256(b"potluck.piece")
    h.update(struct.pack("<d", weight))
    for d in chunk_digests:
        h.update(d)
    return h.digest()


def shard_digest(roots: dict[int, bytes]) -> bytes:
    """What a shard averages: the roots of its senders, in member order."""
    h = hashlib.sha256(b"potluck.shard")
    for sender in sorted(roots):
        h.update(struct.pack("<I", sender))
        h.update(roots[sender])
    return h.digest()


def result_root(chunk_digests: Sequence[bytes]) -> bytes:
    """A reducer's result of one shard: the digests of its chunks as receivers decode them."""
    h = hashlib.sha256(b"potluck.result")
    for d in chunk_digests:
        h.update(d)
    return h.digest()


def claim_digest(metadata: Any) -> bytes:
    """Digest of what a member told its group when it joined (its `gather` metadata), which its
    seals cover: what it claimed (say, the samples behind its piece) is then bound to what it
    sent. msgpack keeps maps in order and packs tuples as lists, so every member gets the same."""
    return hashlib.sha256(b"potluck.claim" + msgpack.packb(metadata, use_bin_type=True)).digest()


def seal_message(group_id: bytes, shard: int, sender: int, root: bytes, claim: bytes) -> bytes:
    """What a sender signs at the end of its piece of `shard` (its root), as member `sender` of
    the step `group_id` that joined it with the metadata of digest `claim`."""
    h = hashlib.sha256(b"potluck.seal")
    h.update(struct.pack("<I", len(group_id)) + group_id)
    h.update(struct.pack("<QQ", shard, sender))
    h.update(root)
    h.update(claim)
    return h.digest()


@dataclass(frozen=True)
class SealedBlock:
    """Blocks `first`... of chunk `chunk` of `sender`'s piece of `shard`, decoded, with what
    proves that `sender` sent them (see `sealed_block`); `offset`: where they start in the
    averaged vector."""

    shard: int
    sender: int
    chunk: int
    first: int
    offset: int
    weight: float
    digests: tuple[bytes, ...]
    blocks: tuple[bytes, ...]
    values: torch.Tensor
    seal: bytes


def sealed_block(group: Any, claim: bytes, block: SealedBlock) -> str | None:
    """Why `block`'s values are not proven to be what its sender sent in the step of `group`,
    having joined it with the metadata of digest `claim` (None: they are): the blocks' digests,
    the chunk's, the piece's root and the sender's seal of it must all agree."""
    digests, blocks = block.digests, block.blocks
    if not 0 <= block.chunk < len(digests) or blocks_digest(blocks) != digests[block.chunk]:
        return "the block digests are not those of the chunk"
    count = -(-block.values.numel() // VERIFY_BLOCK)
    if block_digests(block.values) != list(blocks[block.first:block.first + count]):
        return "the values are not those of the blocks"
    root = piece_root(block.weight, digests)
    if not group.peers[block.sender].verify(block.seal, seal_message(group.group_id, block.shard, block.sender,
                                                                     root, claim)):
        return "the sender did not seal that piece"
    return None


def decision_message(group_id: bytes, version: int, senders: Sequence[int], assignment: Mapping[int, int],
                     committed: bool, aborted: str | None, digests: Mapping[int, bytes], proof: bytes) -> bytes:
    """What a coordinator signs with each decision of the step `group_id` (the fields of its
    `Outcome`; `proof`: its equivocation proof packed, or empty), so that a coordinator taking over
    can tell a decision its predecessor made from one a member made up."""
    h = hashlib.sha256(b"potluck.decision")
    h.update(struct.pack("<I", len(group_id)) + group_id)
    h.update(struct.pack("<QQ?", version, len(senders), committed) + struct.pack(f"<{len(senders)}I", *senders))
    h.update(struct.pack("<Q", len(assignment)))
    for shard in sorted(assignment):
        h.update(struct.pack("<II", shard, assignment[shard]))
    reason = (aborted or "").encode()
    h.update(struct.pack("<?I", aborted is not None, len(reason)) + reason)
    h.update(struct.pack("<Q", len(digests)))
    for shard in sorted(digests):
        h.update(struct.pack("<II", shard, len(digests[shard])) + digests[shard])
    h.update(struct.pack("<I", len(proof)) + proof)
    return h.digest()


def final_message(group_id: bytes, shard: int, version: int, senders: Sequence[int], root: bytes) -> bytes:
    """What a reducer signs with its FINAL: this result of `shard`, over `senders`, under the
    decision `version` of the step `group_id`. Two valid signatures on different roots for the
    same step, shard and version prove that the reducer told members different things."""
    h = hashlib.sha256(b"potluck.final")
    h.update(struct.pack("<I", len(group_id)) + group_id)
    h.update(struct.pack("<QQ", shard, version))
    h.update(struct.pack(f"<{len(senders)}I", *senders))
    h.update(root)
    return h.digest()
