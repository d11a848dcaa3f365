"""The state download's wire: its limits and every message, declared once.

The state's tensors are laid end to end as raw bytes; chunk i is bytes [i*C, (i+1)*C) of that.
A donor describes one snapshot of its state in a `Manifest`; a downloader opens a chunk stream
of it (`ChunkStreamOpen`) and asks for chunks (`ChunkRequest`), each answered in order
(`ChunkReply`). A donor says it has a state to give with a `DonorRecord` in the DHT.
"""

from __future__ import annotations

import logging
from functools import cached_property
from typing import Any

import torch

from potluck.core import serialization
from potluck.core.digests import DIGEST_BYTES
from potluck.core.errors import MalformedMessage, SerializationError
from potluck.core.wire import Bytes, Field, Int, List, Message, Opaque, Raw
from potluck.dht.records import subkey_owner
from potluck.net.connection import STREAM_WINDOW
from potluck.net.identity import PeerID

__all__ = [
    "CHUNK_BYTES", "HASH_BYTES", "MAX_CHUNK_BYTES", "MAX_STATE_BYTES", "MAX_STATE_METADATA_BYTES", "MAX_TENSORS",
    "MAX_VERSION", "MIN_CHUNK_BYTES", "REQUESTS_IN_FLIGHT", "SNAPSHOT_ID_BYTES", "ChunkReply", "ChunkRequest",
    "ChunkStreamOpen", "DonorRecord", "Manifest", "ManifestRequest", "dtype_name", "read_donors",
]

logger = logging.getLogger(__name__)

# Chunk requests a downloader keeps outstanding per donor: one on the wire while the next is asked
# for hides the round trip; more would only pile up in the donor's send queue.
REQUESTS_IN_FLIGHT = 2
# Bytes per chunk a server cuts its state into: big enough that per-message cost vanishes, small
# enough that a dropped donor costs little rework.
CHUNK_BYTES = 2 * 2**20
# Smallest chunk accepted: smaller ones make the hash list and per-message overhead dominate.
MIN_CHUNK_BYTES = 4 * 2**10
# Largest chunk accepted: all chunks in flight on one stream must fit its flow-control window.
MAX_CHUNK_BYTES = STREAM_WINDOW // REQUESTS_IN_FLIGHT
# Largest state a downloader allocates by default (a donor's manifest could claim any size);
# more than a volunteer's machine holds in memory. Pass `max_bytes` for bigger states.
MAX_STATE_BYTES = 64 * 2**30
# Random snapshot ids: long enough never to collide or be guessed.
SNAPSHOT_ID_BYTES = 16
# A chunk's digest (potluck.core.digests).
HASH_BYTES = DIGEST_BYTES
# Encoded size of a state's metadata: it rides in every manifest, and is small (the optimizer's is
# an epoch number); a donor refuses to offer more, a newcomer to accept more.
MAX_STATE_METADATA_BYTES = 2**20
# Tensors a state may hold: as many as one message may carry (each is one spec in the manifest).
MAX_TENSORS = serialization.MAX_BUFFERS
# A donor's state version in its DHT record and manifest: a step counter, far below this.
MAX_VERSION = 2**62


def dtype_name(dtype: torch.dtype) -> str:
    """A tensor dtype's name on the wire (TypeError for one that cannot be sent)."""
    name = str(dtype).removeprefix("torch.")
    if serialization.WIRE_DTYPES.get(name) is not dtype:
        raise TypeError(f"tensors of dtype {dtype} cannot be sent")
    return name


class TensorSpecs(Field):
    """Each tensor's (dtype name, shape), at most MAX_TENSORS; on the wire as [dtype, shape] pairs."""

    encodes = True

    def check(self, value: Any, key: str, what: str, context: Any) -> tuple[tuple[str, tuple[int, ...]], ...]:
        try:
            serialization.nbytes_of(value)
        except SerializationError as e:
            raise MalformedMessage(what, f"{key!r} must be [dtype, shape] pairs: {e}") from None
        return tuple((name, tuple(shape)) for name, shape in value)

    def encode(self, value: Any) -> list:
        return [[name, list(shape)] for name, shape in value]


def _most_chunks(context: Any) -> int:
    """Chunks a state within the downloader's `max_bytes` has at most."""
    return -(-context.get("max_bytes", MAX_STATE_BYTES) // MIN_CHUNK_BYTES)


class ManifestRequest(Message, what="manifest request", positional=True):
    """Asks a donor for a manifest of its current state; it carries nothing (an empty list)."""


class Manifest(Message, what="manifest"):
    """A donor's description of one snapshot of its state: what to download and how to check it.
    Checked strictly, refusing states over the downloader's `max_bytes` (context; default
    MAX_STATE_BYTES)."""

    version: int = Int("version", 0, MAX_VERSION)
    specs: tuple[tuple[str, tuple[int, ...]], ...] = TensorSpecs("specs")  # (dtype name, shape) of each tensor
    chunk_bytes: int = Int("chunk_bytes", MIN_CHUNK_BYTES, MAX_CHUNK_BYTES + 1)
    hashes: tuple[bytes, ...] = List("hashes", Bytes(None, HASH_BYTES, exact=True), _most_chunks)  # of each chunk
    snapshot: bytes = Bytes("snapshot", SNAPSHOT_ID_BYTES, exact=True)  # the snapshot's id, to open a chunk stream
    metadata: Any = Opaque("metadata", MAX_STATE_METADATA_BYTES)

    def validate(self, context: Any) -> None:
        max_bytes = context.get("max_bytes", MAX_STATE_BYTES)
        total = self.total_bytes
        if total > max_bytes:
            raise self.refuse(f"'specs' describe {total} bytes of state, over the limit of {max_bytes}")
        chunks = -(-total // self.chunk_bytes)
        if len(self.hashes) != chunks:
            raise self.refuse(f"'hashes' must be {chunks} {HASH_BYTES}-byte SHA-256 digests, one per chunk")

    @cached_property
    def sizes(self) -> tuple[int, ...]:
        """Bytes of each tensor."""
        return tuple(serialization.nbytes_of([[name, list(shape)] for name, shape in self.specs]))

    @property
    def total_bytes(self) -> int:
        return sum(self.sizes)

    @property
    def content(self) -> tuple:
        """What donors must agree on to offer the same state: its bytes and what they say of it
        (the metadata, encoded: it is checked to encode within MAX_STATE_METADATA_BYTES)."""
        return self.version, serialization.dumps(self.metadata), self.specs, self.chunk_bytes, self.hashes

    def chunk_range(self, index: int) -> tuple[int, int]:
        start = index * self.chunk_bytes
        return start, min(start + self.chunk_bytes, self.total_bytes)


class ChunkStreamOpen(Message, what="chunk stream request"):
    """Opens a chunk stream of the snapshot a manifest named."""

    snapshot: bytes = Bytes("snapshot", SNAPSHOT_ID_BYTES, exact=True)


class ChunkRequest(Message, what="chunk request"):
    """Asks for chunk `index` of the stream's snapshot (context: the snapshot's `num_chunks`)."""

    index: int = Int("i", 0, "num_chunks")


class ChunkReply(Message, what="chunk"):
    """Chunk `index`'s bytes (checked against the manifest's hash by the downloader); as the
    answer to a request for chunk `index` (context) of `size` (context) bytes."""

    index: int = Int("i", "index", lambda context: context["index"] + 1)
    data: torch.Tensor = Raw("data", torch.Tensor, "a chunk's raw bytes (a uint8 tensor)")  # uint8, 1-D

    def validate(self, context: Any) -> None:
        data, size = self.data, context["size"]
        if data.dtype != torch.uint8 or data.dim() != 1 or data.numel() != size:
            raise self.refuse(f"'data' must be chunk {self.index}'s {size} raw bytes (a uint8 tensor)")


class DonorRecord(Message, what="donor record"):
    """A peer's record under the averager's donors key (`AveragerNames.donors`) in the DHT
    (subkey: `own_subkey(its peer id)`, so only it can write it and readers take the donor from
    the signed subkey): it offers its state of `version` to newcomers. Its addresses are not
    here: the transport resolves the peer id through the peer's own signed record in the DHT."""

    version: int = Int("version", 0, MAX_VERSION)


def read_donors(found: Any, me: PeerID) -> dict[PeerID, int]:
    """The donors in a DHT read of the donors key (None, or a dict of subkeys): each donor
    other than `me` -> the version it offers. Only a donor's own signed entry names it: any other
    subkey, and any malformed record, is skipped, so nobody can offer a state in a donor's name."""
    donors: dict[PeerID, int] = {}
    for subkey, entry in (found.value.items() if found is not None and isinstance(found.value, dict) else ()):
        peer_id = subkey_owner(subkey)
        if peer_id is None:
            logger.debug("ignoring a state record under a subkey that no donor signed")
            continue
        try:
            record = DonorRecord.from_wire(entry.value)
        except MalformedMessage as e:
            logger.debug("ignoring a state record by %s: %s", peer_id, e)
            continue
        if peer_id != me:
            donors[peer_id] = record.version
    return donors
