"""State download: a newcomer fetches the newest model state from several peers at once.

A donor runs a `StateServer`. Asked for a manifest, it offers a snapshot of its state (a private
copy made off the event loop, so training goes on) and describes it: version, metadata, tensor
specs, chunk size and the SHA-256 of every chunk. Newcomers share snapshots: one per version, at
most `max_snapshots` in all, each freed once no stream serves it and it has been idle
`SNAPSHOT_IDLE_SECONDS`. A newcomer (`download_state`) asks every donor for a manifest, picks
the state that the most donors agree on (version, metadata and every chunk's hash; the newest of
equally large groups), never merely the highest version claimed, then fetches chunks from that
whole group at once, each written into place (`into`: the caller's own tensors)
as soon as its hash matches. Each donor's worker takes the next chunk from one shared queue, so
faster donors serve more. A donor that fails, stalls or sends bytes that do not match the hash
is dropped and its chunks go back to the queue. Once the queue is empty, idle workers also fetch
chunks still in flight elsewhere (the "endgame"), so a slow or silently dead donor cannot hold
up the last chunks.

Donors are other peers, and one may lie. The caller can say which donors it trusts (`vouched`:
e.g. live peers in its progress view; identities it never heard of do not count) and check each
manifest (`check`: e.g. that its version is no further ahead than the swarm supports); donors
left out or refused are logged, as are donors outvoted by a larger group, and any donor whose
chunk does not match its hash. See docs/security.md for what this does and does not stop.

Wire (method names derive from a prefix, so several averagers coexist on one peer), one typed
message each, checked by its `from_wire`:
- `<prefix>.state.manifest` (unary): `ManifestRequest` (None), answered with a `Manifest`.
- `<prefix>.state.chunks` (stream): opened with `ChunkStreamOpen` (a snapshot id); every
  `ChunkRequest` (a chunk index) is answered, in order, with a `ChunkReply` (index, uint8 tensor).
The state's tensors are laid end to end as raw bytes; chunk i is bytes [i*C, (i+1)*C) of that.
A donor says it has a state to give with a `DonorRecord` in the DHT (the `Averager` reads them).
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import hashlib
import itertools
import logging
import secrets
from collections import Counter, deque
from collections.abc import Callable, Collection, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch

from potluck.core import compat, serialization
from potluck.core.errors import (
    AveragingError,
    ConnectionLost,
    DeadlineExceeded,
    EndOfStream,
    MalformedMessage,
    NetworkError,
    SerializationError,
)
from potluck.core.wire import bytes_field, encoded_value, int_field, list_field, wire_map
from potluck.dht.records import subkey_owner
from potluck.net.connection import STREAM_WINDOW, CallContext, Stream
from potluck.net.identity import PeerID
from potluck.net.transport import Transport

__all__ = [
    "CHUNK_BYTES",
    "MAX_STATE_BYTES",
    "PARALLEL_DONORS",
    "ChunkReply",
    "ChunkRequest",
    "ChunkStreamOpen",
    "DonorRecord",
    "Manifest",
    "ManifestCheck",
    "ManifestRequest",
    "StateServer",
    "chunks_method",
    "download_state",
    "manifest_method",
    "read_donors",
]

logger = logging.getLogger(__name__)

StateGetter = Callable[[], tuple[int, Any, Sequence[torch.Tensor]]]
ProgressCallback = Callable[[int, int], None]
ManifestCheck = Callable[["Manifest"], None]  # raises ValueError (saying why) to refuse a donor's manifest

# -- limits and timeouts ---------------------------------------------------------------------------
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
# Donors fetched from at once; others wait as spares. Once the newcomer's download link is full,
# more donors add little, and each costs its donor a stream.
PARALLEL_DONORS = 4
# A donor copies and hashes its whole state before it answers (~1 GB/s): this covers tens of GB.
MANIFEST_TIMEOUT = 60.0
# After the first manifest arrives, others are awaited this much longer; donors with similar
# states answer within about the same time, and one lagging further is left out, not waited for.
MANIFEST_GRACE_SECONDS = 5.0
# A donor that takes longer than this for one chunk is dropped (2 MiB at 35 KB/s); its chunks go
# to the others.
CHUNK_TIMEOUT = 60.0
# A donor whose connection is lost mid-download is dialed again this many times before it is
# dropped: behind NAT its relay may have died, and the redial goes through another of its relays
# (a donor that is really gone fails that dial at once, or within the dial deadline if silent).
DONOR_RECONNECTS = 1
# In the endgame, at most this many donors fetch the same chunk: enough to route around one slow
# donor without flooding the newcomer's link with duplicates.
ENDGAME_COPIES = 2
# Snapshots a server holds at once; each costs as much memory as the state. A newcomer that asks
# while every one is in use gets the newest of them (a consistent state, perhaps a version behind:
# the newcomer compares versions across donors) instead of a further copy.
MAX_SNAPSHOTS = 1
# A snapshot no chunk stream uses is freed this long after its last use. It covers the gap between
# handing out a manifest and the downloader's streams (MANIFEST_GRACE_SECONDS and a connection),
# and lets newcomers arriving shortly after each other share one copy.
SNAPSHOT_IDLE_SECONDS = 20.0
# A manifest handed out holds its snapshot this long for the downloader's chunk stream: its grace for
# other donors' manifests and a dial. A downloader that never opens one (it chose other donors'
# state, or refused ours) must not keep a stale snapshot on offer: one that is on offer only by
# such claims is replaced once they lapse, and offering it again does not extend them.
SNAPSHOT_CLAIM_SECONDS = MANIFEST_GRACE_SECONDS + 5.0
# Without `current_version`, a snapshot this young is offered again instead of copying the state
# once more: newcomers that arrive together share one copy, yet a newer state is offered soon.
SNAPSHOT_REUSE_SECONDS = 2.0
# Random snapshot ids: long enough never to collide or be guessed.
SNAPSHOT_ID_BYTES = 16
# A chunk stream whose downloader asks for nothing this long is closed (it has gone away).
CHUNK_STREAM_IDLE_SECONDS = 60.0
# A chunk the downloader does not take within this long (it stopped reading, so the stream's window
# stays full) ends its stream: a downloader that never reads keeps a snapshot alive no longer.
CHUNK_SEND_TIMEOUT = CHUNK_TIMEOUT
# SHA-256 digest length.
HASH_BYTES = hashlib.sha256().digest_size
# Encoded size of a state's metadata: it rides in every manifest, and is small (the optimizer's is
# an epoch number); a donor refuses to offer more, a newcomer to accept more.
MAX_STATE_METADATA_BYTES = 2**20
# Tensors a state may hold: as many as one message may carry (each is one spec in the manifest).
MAX_TENSORS = serialization.MAX_BUFFERS
# A donor's state version in its DHT record and manifest: a step counter, far below this.
MAX_VERSION = 2**62


def manifest_method(prefix: str) -> str:
    """The unary method a `StateServer` with this prefix answers manifest requests on."""
    return f"{_check_prefix(prefix)}.state.manifest"


def chunks_method(prefix: str) -> str:
    """The stream method a `StateServer` with this prefix serves chunks on."""
    return f"{_check_prefix(prefix)}.state.chunks"


def _check_prefix(prefix: str) -> str:
    if not isinstance(prefix, str) or not prefix:
        raise ValueError(f"prefix must be a non-empty str, got {prefix!r}")
    return prefix


def _dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if serialization.WIRE_DTYPES.get(name) is not dtype:
        raise TypeError(f"tensors of dtype {dtype} cannot be sent")
    return name


# -- messages ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ManifestRequest:
    """Asks a donor for a manifest of its current state (it carries nothing: None on the wire)."""

    def to_wire(self) -> None:
        return None

    @classmethod
    def from_wire(cls, msg: Any) -> ManifestRequest:
        if msg is not None:
            raise MalformedMessage("manifest request", "it takes no arguments (send None)")
        return cls()


@dataclass(frozen=True)
class Manifest:
    """A donor's description of one snapshot of its state: what to download and how to check it."""

    version: int
    metadata: Any
    specs: tuple[tuple[str, tuple[int, ...]], ...]  # (dtype name, shape) of each tensor
    sizes: tuple[int, ...]  # bytes of each tensor (derived from `specs`; not on the wire)
    chunk_bytes: int
    hashes: tuple[bytes, ...]  # SHA-256 of each chunk
    snapshot: bytes  # the snapshot's id, to open a chunk stream of it

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

    def to_wire(self) -> dict:
        return {"version": self.version, "metadata": self.metadata, "specs": [[n, list(s)] for n, s in self.specs],
                "chunk_bytes": self.chunk_bytes, "hashes": list(self.hashes), "snapshot": self.snapshot}

    @classmethod
    def from_wire(cls, msg: Any, max_bytes: int = MAX_STATE_BYTES) -> Manifest:
        """Check a donor's manifest strictly, refusing states over `max_bytes`."""
        what = "manifest"
        msg = wire_map(msg, what)
        version = int_field(msg, "version", what, 0, MAX_VERSION)
        chunk_bytes = int_field(msg, "chunk_bytes", what, MIN_CHUNK_BYTES, MAX_CHUNK_BYTES + 1)
        snapshot = bytes_field(msg, "snapshot", what, SNAPSHOT_ID_BYTES, exact=True)
        raw_specs = list_field(msg, "specs", what, MAX_TENSORS)
        try:
            sizes = serialization.nbytes_of(raw_specs)
        except SerializationError as e:
            raise MalformedMessage(what, f"'specs' must be [dtype, shape] pairs: {e}") from None
        total = sum(sizes)
        if total > max_bytes:
            raise MalformedMessage(what, f"'specs' describe {total} bytes of state, over the limit of {max_bytes}")
        num_chunks = -(-total // chunk_bytes)
        hashes = list_field(msg, "hashes", what, num_chunks, length=num_chunks)
        if not all(isinstance(h, bytes) and len(h) == HASH_BYTES for h in hashes):
            raise MalformedMessage(what, f"'hashes' must be {HASH_BYTES}-byte SHA-256 digests, one per chunk")
        specs = tuple((name, tuple(shape)) for name, shape in raw_specs)
        metadata = encoded_value(msg.get("metadata"), "metadata", what, MAX_STATE_METADATA_BYTES)
        return cls(version, metadata, specs, tuple(sizes), chunk_bytes, tuple(hashes), snapshot)


@dataclass(frozen=True)
class ChunkStreamOpen:
    """Opens a chunk stream of the snapshot a manifest named."""

    snapshot: bytes

    def to_wire(self) -> dict:
        return {"snapshot": self.snapshot}

    @classmethod
    def from_wire(cls, msg: Any) -> ChunkStreamOpen:
        what = "chunk stream request"
        return cls(bytes_field(wire_map(msg, what), "snapshot", what, SNAPSHOT_ID_BYTES, exact=True))


@dataclass(frozen=True)
class ChunkRequest:
    """Asks for chunk `index` of the stream's snapshot."""

    index: int

    def to_wire(self) -> dict:
        return {"i": self.index}

    @classmethod
    def from_wire(cls, msg: Any, num_chunks: int) -> ChunkRequest:
        what = "chunk request"
        return cls(int_field(wire_map(msg, what), "i", what, 0, num_chunks))


@dataclass(frozen=True)
class ChunkReply:
    """Chunk `index`'s bytes (checked against the manifest's hash by the downloader)."""

    index: int
    data: torch.Tensor  # uint8, 1-D

    def to_wire(self) -> dict:
        return {"i": self.index, "data": self.data}

    @classmethod
    def from_wire(cls, msg: Any, index: int, size: int) -> ChunkReply:
        """The reply to a request for chunk `index`, of `size` bytes."""
        what = "chunk"
        msg = wire_map(msg, what)
        int_field(msg, "i", what, index, index + 1)
        data = msg.get("data")
        if not isinstance(data, torch.Tensor) or data.dtype != torch.uint8 or data.dim() != 1 or data.numel() != size:
            raise MalformedMessage(what, f"'data' must be chunk {index}'s {size} raw bytes (a uint8 tensor)")
        return cls(index, data)


@dataclass(frozen=True)
class DonorRecord:
    """A peer's record under `<prefix>.state` in the DHT (subkey: `own_subkey(its peer id)`, so only
    it can write it and readers take the donor from the signed subkey): it offers its state of
    `version` to newcomers. Its addresses are not here: the transport resolves the peer id
    through the peer's own signed record in the DHT."""

    version: int

    def to_wire(self) -> dict:
        return {"version": self.version}

    @classmethod
    def from_wire(cls, msg: Any) -> DonorRecord:
        what = "donor record"
        msg = wire_map(msg, what)
        return cls(int_field(msg, "version", what, 0, MAX_VERSION))


def read_donors(found: Any, me: PeerID) -> dict[PeerID, int]:
    """The donors in a DHT read of `<prefix>.state` (None, or a dict of subkeys): each donor
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


# -- the server --------------------------------------------------------------------------------------
@dataclass(eq=False)
class _Snapshot:
    """A private copy of the state, laid out as one byte vector, with a hash per chunk.

    It references nothing else, and only the server's table holds it for longer than a request
    takes (chunks are sent as copies), so it is freed the moment the server drops it.
    """

    manifest: Manifest  # what a downloader is told of it
    flat: torch.Tensor  # uint8, every tensor's bytes end to end
    created: float = 0.0
    last_used: float = 0.0  # when a manifest of it was handed out or a stream of it ended
    streams: int = 0  # chunk streams serving it now
    key: Any = None  # `current_version()` when it was taken (see StateServer)
    claims: int = 0  # manifests handed out whose downloader has not opened a stream yet
    claimed_until: float = 0.0  # claims lapse then (SNAPSHOT_CLAIM_SECONDS)

    @property
    def snapshot_id(self) -> bytes:
        return self.manifest.snapshot

    @property
    def version(self) -> int:
        return self.manifest.version

    @property
    def idle(self) -> bool:
        return self.streams == 0

    def chunk(self, index: int) -> torch.Tensor:
        """A copy of chunk `index`: what a stalled stream or transport holds is this chunk, never
        (through a view) the whole snapshot."""
        start, end = self.manifest.chunk_range(index)
        return self.flat[start:end].clone()


def _take_snapshot(get_state: StateGetter, lock: AbstractContextManager | None, chunk_bytes: int,
                   current_version: Callable[[], Any] | None) -> _Snapshot:
    """Copy and hash the state (in a worker thread: it costs time proportional to its size)."""
    with lock if lock is not None else contextlib.nullcontext():
        key = None if current_version is None else current_version()
        state = get_state()
        if not isinstance(state, (tuple, list)) or len(state) != 3:
            raise TypeError("get_state() must return (version, metadata, tensors)")
        version, metadata, tensors = state
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise TypeError(f"get_state() returned version {version!r}; it must be an int >= 0")
        tensors = list(tensors)
        if not all(isinstance(t, torch.Tensor) for t in tensors):
            raise TypeError("get_state() must return a sequence of torch.Tensor as its tensors")
        specs = tuple((_dtype_name(t.dtype), tuple(t.shape)) for t in tensors)
        sizes = [t.numel() * t.element_size() for t in tensors]
        flat = torch.empty(sum(sizes), dtype=torch.uint8)
        offset = 0
        for t, size in zip(tensors, sizes, strict=True):
            source = t.detach().resolve_conj().resolve_neg().contiguous()  # a copy only if strided
            flat[offset:offset + size].copy_(source.reshape(-1).view(torch.uint8))
            offset += size
    try:
        encoded_value(metadata, "metadata", "state", MAX_STATE_METADATA_BYTES)
    except MalformedMessage as e:
        raise TypeError(f"get_state() returned metadata that cannot be sent: {e}") from e
    memory = flat.numpy()
    hashes = tuple(hashlib.sha256(memory[start:start + chunk_bytes]).digest()
                   for start in range(0, flat.numel(), chunk_bytes))
    manifest = Manifest(version, metadata, specs, tuple(sizes), chunk_bytes, hashes,
                        secrets.token_bytes(SNAPSHOT_ID_BYTES))
    return _Snapshot(manifest, flat, key=key)


class StateServer:
    """Serves this peer's state to newcomers: manifests of snapshots, then chunks of them.

    `get_state()` returns `(version, metadata, tensors)`; it is called from a worker thread, and
    the tensors are copied there right away, with `lock` (if given) held around both, so a
    trainer that updates the tensors under the same lock never yields a torn snapshot.

    `current_version()` (optional, cheap) returns a key that changes whenever the state does (read
    under `lock` with the state): a snapshot is offered only while the key is the one it was taken
    at. Memory: at most `max_snapshots` copies of the state, at most one per key when
    `current_version` is given. A snapshot lives while a chunk stream serves it, and
    `SNAPSHOT_IDLE_SECONDS` after its last use; every wait of a stream is bounded
    (`CHUNK_STREAM_IDLE_SECONDS`, `CHUNK_SEND_TIMEOUT`), so a downloader that stops reading
    cannot keep one alive. Beyond that, each stream holds at most its flow-control window of chunk
    copies in flight.
    """

    def __init__(self, transport: Transport, get_state: StateGetter, prefix: str, *,
                 lock: AbstractContextManager | None = None, chunk_bytes: int = CHUNK_BYTES,
                 max_snapshots: int = MAX_SNAPSHOTS, current_version: Callable[[], Any] | None = None):
        if not MIN_CHUNK_BYTES <= chunk_bytes <= MAX_CHUNK_BYTES:
            raise ValueError(f"chunk_bytes must be in [{MIN_CHUNK_BYTES}, {MAX_CHUNK_BYTES}], "
                             f"got {chunk_bytes}")
        if max_snapshots < 1:
            raise ValueError(f"max_snapshots must be >= 1, got {max_snapshots}")
        self.transport = transport
        self.manifest_method = manifest_method(prefix)
        self.chunks_method = chunks_method(prefix)
        self.chunks_served = 0  # chunks sent so far (for statistics and tests)
        self._get_state = get_state
        # Cheap: a key of the state now. A snapshot of an older state is not offered again (a
        # peer catching up must not get the epoch it already has).
        self._current_version = current_version
        self._lock = lock
        self._chunk_bytes = chunk_bytes
        self._max_snapshots = max_snapshots
        self._snapshots: dict[bytes, _Snapshot] = {}
        self._building: asyncio.Future[_Snapshot] | None = None
        self._sweeper: asyncio.TimerHandle | None = None  # frees the next idle snapshot due
        self._streams: set[Stream] = set()  # chunk streams being served, aborted by close()
        self._withheld: Any = None  # see replacing()
        self._closed = False
        transport.add_handler(self.manifest_method, self._serve_manifest)
        transport.add_stream_handler(self.chunks_method, self._serve_chunks)

    @property
    def snapshot_bytes(self) -> int:
        """Bytes of state copies this server holds now."""
        return sum(s.flat.numel() for s in self._snapshots.values())

    def close(self) -> None:
        """Stop serving, end the chunk streams and free the snapshots."""
        self._closed = True
        self.transport.remove_handler(self.manifest_method)
        self.transport.remove_handler(self.chunks_method)
        for stream in list(self._streams):
            stream.abort("the state server closed")
        self._snapshots.clear()
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None

    @contextlib.contextmanager
    def replacing(self) -> Iterator[None]:
        """Offer no new snapshot while the block overwrites the tensors (a download into them).

        If the block raises, the tensors may hold parts of two states: none is offered until
        `current_version()` changes (or the next `replacing()` block succeeds).
        """
        self._withheld = -1 if self._current_version is None else self._current_version()
        yield
        self._withheld = None

    async def _serve_manifest(self, request: Any, ctx: CallContext) -> dict:
        return (await self._manifest(ManifestRequest.from_wire(request))).to_wire()

    async def _manifest(self, request: ManifestRequest) -> Manifest:
        if self._withheld is not None:
            if self._current_version is None or self._current_version() == self._withheld:
                raise LookupError("this peer's state is being replaced; ask another peer")
            self._withheld = None
        snapshot = await self._current_snapshot()
        now = asyncio.get_running_loop().time()
        if self._is_current(snapshot, now):  # a stale one is not held longer for newcomers
            snapshot.claims += 1
            snapshot.claimed_until = now + SNAPSHOT_CLAIM_SECONDS
        self._used(snapshot)
        return snapshot.manifest

    async def _current_snapshot(self) -> _Snapshot:
        """The snapshot to offer now: the newest if it is still current, else a fresh copy if
        the budget allows, else the newest (every one is in use). Concurrent requests share one."""
        offered = self._offer_held()
        if offered is not None:
            return offered
        return await asyncio.shield(self._building)

    def _offer_held(self) -> _Snapshot | None:
        """A snapshot held now to offer, or None once a fresh one is being taken. (Not part of
        the coroutine above: its frame would keep a dropped snapshot alive while copying anew.)"""
        loop = asyncio.get_running_loop()
        newest = max(self._snapshots.values(), key=lambda s: s.created, default=None)
        if newest is not None and self._is_current(newest, loop.time()):
            return newest
        if self._building is None:
            now = loop.time()
            for key in [k for k, s in self._snapshots.items() if s.idle and not (s.claims and now < s.claimed_until)]:
                del self._snapshots[key]  # nobody is using or about to use it
            if len(self._snapshots) >= self._max_snapshots:
                newest = max(self._snapshots.values(), key=lambda s: s.created)
                logger.debug("state server: every snapshot is in use; offering version %d", newest.version)
                return newest
            self._building = loop.run_in_executor(None, _take_snapshot, self._get_state, self._lock,
                                                  self._chunk_bytes, self._current_version)
            self._building.add_done_callback(self._snapshot_taken)
        return None

    def _is_current(self, snapshot: _Snapshot, now: float) -> bool:
        if self._current_version is not None:
            return self._current_version() == snapshot.key
        return now - snapshot.created < SNAPSHOT_REUSE_SECONDS

    def _snapshot_taken(self, future: asyncio.Future[_Snapshot]) -> None:
        self._building = None
        if future.cancelled():
            return
        if future.exception() is not None:
            logger.warning("could not snapshot the state: %s", future.exception())
            return
        if not self._closed:
            snapshot = future.result()
            snapshot.created = snapshot.last_used = asyncio.get_running_loop().time()
            self._snapshots[snapshot.snapshot_id] = snapshot

    def _used(self, snapshot: _Snapshot) -> None:
        snapshot.last_used = asyncio.get_running_loop().time()
        self._arm_sweeper()

    def _arm_sweeper(self) -> None:
        """Schedule the freeing of the idle snapshot due first (one timer for all)."""
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        due = [s.last_used + SNAPSHOT_IDLE_SECONDS for s in self._snapshots.values() if s.idle]
        if due and not self._closed:
            self._sweeper = asyncio.get_running_loop().call_at(min(due), self._sweep)

    def _sweep(self) -> None:
        self._sweeper = None
        now = asyncio.get_running_loop().time()
        for key in [k for k, s in self._snapshots.items()
                    if s.idle and now - s.last_used >= SNAPSHOT_IDLE_SECONDS]:
            del self._snapshots[key]
        self._arm_sweeper()

    async def _serve_chunks(self, stream: Stream, ctx: CallContext) -> None:
        # This frame holds the snapshot's id, never the snapshot: a failed stream's exception,
        # traceback and frames (which may live until a garbage collection) cannot keep it alive.
        snapshot_id = ChunkStreamOpen.from_wire(stream.request).snapshot
        num_chunks = self._lease(snapshot_id)
        self._streams.add(stream)
        try:
            while True:
                try:
                    message = await stream.recv(timeout=CHUNK_STREAM_IDLE_SECONDS)
                except (EndOfStream, DeadlineExceeded):
                    return  # the downloader is done, or gone
                index = ChunkRequest.from_wire(message, num_chunks).index
                self.chunks_served += 1
                try:
                    await stream.send(ChunkReply(index, self._chunk(snapshot_id, index)).to_wire(),
                                      timeout=CHUNK_SEND_TIMEOUT)
                except DeadlineExceeded:
                    logger.info("state server: %s stopped reading chunks; closing its stream", stream.peer_id)
                    return
        finally:
            self._streams.discard(stream)
            self._unlease(snapshot_id)

    def _lease(self, snapshot_id: bytes) -> int:
        """Keep the snapshot alive for one more stream; returns its number of chunks."""
        snapshot = self._snapshots.get(snapshot_id)
        if snapshot is None:
            raise LookupError("unknown or expired snapshot; ask for a new manifest")
        snapshot.streams += 1
        snapshot.claims = max(0, snapshot.claims - 1)
        self._arm_sweeper()
        return len(snapshot.manifest.hashes)

    def _chunk(self, snapshot_id: bytes, index: int) -> torch.Tensor:
        snapshot = self._snapshots.get(snapshot_id)  # leased, so gone only if the server closed
        if snapshot is None:
            raise LookupError("the state server has closed")
        return snapshot.chunk(index)

    def _unlease(self, snapshot_id: bytes) -> None:
        snapshot = self._snapshots.get(snapshot_id)  # gone if the server closed
        if snapshot is not None:
            snapshot.streams -= 1
            self._used(snapshot)


# -- the downloader ----------------------------------------------------------------------------------
class _DonorMisbehaved(Exception):
    """A donor answered something that is not the chunk it was asked for."""


class _Download:
    """Fetches one manifest's chunks from a group of donors holding it (work-stealing)."""

    def __init__(self, transport: Transport, method: str, manifest: Manifest, tensors: list[torch.Tensor],
                 lock: AbstractContextManager | None, donors: dict[PeerID, bytes], parallel: int,
                 progress: ProgressCallback | None, failures: dict[PeerID, str], deadline: float):
        self.transport = transport
        self._deadline = deadline  # loop time: bounds each donor's stream
        self.method = method
        self.manifest = manifest
        self.tensors = tensors  # contiguous CPU tensors shaped as the manifest says: chunks land in them
        self._lock = lock if lock is not None else contextlib.nullcontext()  # held while writing them
        self._byte_views = [t.detach().view(-1).view(torch.uint8) for t in tensors]
        self._starts = list(itertools.accumulate(manifest.sizes, initial=0))
        self.num_chunks = len(manifest.hashes)
        self._queue: deque[int] = deque(range(self.num_chunks))
        self._fetchers: Counter[int] = Counter()  # chunk -> workers that asked for it
        self._claimed: set[int] = set()  # chunks stored or being stored
        self._done = 0
        self._bytes_done = 0
        self.served: Counter[PeerID] = Counter()
        self.failures = failures
        self._snapshots = donors  # each donor's own snapshot id for the same content
        self._initial = list(donors)[:parallel]
        self._spares = deque(list(donors)[parallel:])
        self._progress = progress
        self._changed = asyncio.Event()
        self._finished = asyncio.Event()
        self._alive = 0

    @property
    def complete(self) -> bool:
        return self._done == self.num_chunks

    @property
    def chunks_done(self) -> int:
        return self._done

    async def run(self) -> None:
        """Return once every chunk is stored or every donor has failed."""
        if self.complete:
            return
        async with compat.TaskGroup() as group:
            workers = [group.create_task(self._worker(donor)) for donor in self._initial]
            self._alive = len(workers)
            await self._finished.wait()
            for worker in workers:
                worker.cancel()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def _worker(self, donor: PeerID | None) -> None:
        reconnects = 0
        try:
            while donor is not None and not self.complete:
                try:
                    await self._fetch_from(donor)
                except ConnectionLost as e:
                    if reconnects < DONOR_RECONNECTS:
                        reconnects += 1
                        logger.info("state download: lost the connection to donor %s (%s); dialing again", donor, e)
                    else:
                        donor, reconnects = self._drop(donor, e), 0
                except (NetworkError, _DonorMisbehaved) as e:
                    donor, reconnects = self._drop(donor, e), 0
        finally:
            self._alive -= 1
            if self._alive == 0 or self.complete:
                self._finished.set()

    def _drop(self, donor: PeerID, error: Exception) -> PeerID | None:
        """Give up on `donor`; the spare donor to fetch from instead, if any."""
        self.failures[donor] = str(error) or type(error).__name__
        logger.warning("state download: dropping donor %s: %s", donor, error)
        return self._spares.popleft() if self._spares else None

    async def _fetch_from(self, donor: PeerID) -> None:
        """Fetch chunks from `donor` until the download is complete; raise if the donor fails."""
        loop = asyncio.get_running_loop()
        stream = await self.transport.open_stream(donor, self.method, ChunkStreamOpen(self._snapshots[donor]).to_wire(),
                                                  timeout=max(0.0, self._deadline - loop.time()))
        asked: deque[int] = deque()
        try:
            while not self.complete:
                changed = self._changed
                while len(asked) < REQUESTS_IN_FLIGHT:
                    index = self._next_chunk(asked)
                    if index is None:
                        break
                    asked.append(index)
                    self._fetchers[index] += 1
                    await stream.send(ChunkRequest(index).to_wire(), timeout=CHUNK_TIMEOUT)
                if not asked:
                    await changed.wait()  # others hold the rest; wake if they fail or finish
                    continue
                reply = await stream.recv(timeout=CHUNK_TIMEOUT)
                index = asked[0]
                data = self._check_reply(reply, index)
                asked.popleft()
                self._answered(index)
                if index in self._claimed:  # another donor delivered it first (endgame): still checked,
                    if not await loop.run_in_executor(None, self._matches, index, data):  # so a liar is caught
                        raise _DonorMisbehaved(f"chunk {index} does not match its hash in the manifest")
                    continue
                self._claimed.add(index)
                if not await loop.run_in_executor(None, self._store, index, data):
                    self._claimed.discard(index)
                    self._requeue_if_orphaned(index)
                    raise _DonorMisbehaved(f"chunk {index} does not match its hash in the manifest")
                self._done += 1
                self._bytes_done += data.numel()
                self.served[donor] += 1
                if self._progress is not None:
                    try:
                        self._progress(self._bytes_done, self.manifest.total_bytes)
                    except Exception:  # noqa: BLE001 - a broken progress display must not stop the download
                        logger.exception("state download: the progress callback failed")
                self._notify()
        finally:
            for index in asked:
                self._answered(index)
                self._requeue_if_orphaned(index)
            stream.abort("download complete" if self.complete else "donor dropped")

    def _next_chunk(self, asked: deque[int]) -> int | None:
        """The next chunk this worker should ask for: from the queue, else an endgame copy."""
        if self._queue:
            return self._queue.popleft()
        if asked:
            return None  # endgame copies only from idle workers
        candidates = [i for i, n in self._fetchers.items()
                      if 0 < n < ENDGAME_COPIES and i not in self._claimed]
        return min(candidates, key=lambda i: (self._fetchers[i], i)) if candidates else None

    def _answered(self, index: int) -> None:
        """One worker no longer waits for `index` (it got it, or gave up on it)."""
        self._fetchers[index] -= 1
        if self._fetchers[index] <= 0:
            del self._fetchers[index]

    def _requeue_if_orphaned(self, index: int) -> None:
        """Put `index` back in the queue if it is neither stored nor being fetched by anyone."""
        if index not in self._fetchers and index not in self._claimed and index not in self._queue:
            self._queue.appendleft(index)  # first out: the download waits for it
            self._notify()

    def _check_reply(self, reply: Any, index: int) -> torch.Tensor:
        start, end = self.manifest.chunk_range(index)
        try:
            return ChunkReply.from_wire(reply, index, end - start).data
        except MalformedMessage as e:
            raise _DonorMisbehaved(str(e)) from None

    def _matches(self, index: int, data: torch.Tensor) -> bool:
        return hashlib.sha256(data.numpy()).digest() == self.manifest.hashes[index]

    def _store(self, index: int, data: torch.Tensor) -> bool:
        """Verify a chunk against its hash, then copy it into place (in a worker thread); the
        hash reads the received bytes where they are."""
        if not self._matches(index, data):
            return False
        start, end = self.manifest.chunk_range(index)
        k = bisect.bisect_right(self._starts, start) - 1
        position = start
        with self._lock:
            while position < end:
                stop = min(end, self._starts[k + 1])
                if stop > position:
                    base = self._starts[k]
                    self._byte_views[k][position - base:stop - base].copy_(data[position - start:stop - start])
                    position = stop
                k += 1
        return True


async def _ask_manifests(transport: Transport, donors: list[PeerID], method: str, max_bytes: int,
                         like: list | None, check: ManifestCheck | None,
                         failures: dict[PeerID, str]) -> dict[PeerID, Manifest]:
    """Ask every donor for a manifest at once; wait a short grace after the first one arrives."""
    loop = asyncio.get_running_loop()

    async def ask(donor: PeerID) -> Manifest | None:
        try:
            reply = await transport.call(donor, method, ManifestRequest().to_wire(), timeout=MANIFEST_TIMEOUT)
            manifest = Manifest.from_wire(reply, max_bytes)
            if like is not None and [[n, list(s)] for n, s in manifest.specs] != like:
                raise ValueError("its tensors' dtypes or shapes differ from ours")
        except (NetworkError, ValueError) as e:
            failures[donor] = f"manifest: {e}"
            logger.info("state download: no manifest from %s: %s", donor, e)
            return None
        try:
            if check is not None:
                check(manifest)
        except ValueError as e:
            failures[donor] = f"refused: {e}"
            logger.warning("state download: refusing donor %s: %s", donor, e)
            return None
        return manifest

    tasks = {asyncio.ensure_future(ask(donor)): donor for donor in donors}
    pending = set(tasks)
    answers: dict[PeerID, Manifest] = {}
    grace_until: float | None = None
    try:
        while pending:
            wait = None if grace_until is None else max(0.0, grace_until - loop.time())
            done, pending = await asyncio.wait(pending, timeout=wait, return_when=asyncio.FIRST_COMPLETED)
            if not done:
                break
            for task in done:
                manifest = task.result()
                if manifest is not None:
                    answers[tasks[task]] = manifest
                    if grace_until is None:
                        grace_until = loop.time() + MANIFEST_GRACE_SECONDS
    finally:
        for task in pending:
            task.cancel()
            failures.setdefault(tasks[task], "manifest: too slow")
        await asyncio.gather(*pending, return_exceptions=True)
    return answers


def _choose(answers: dict[PeerID, Manifest], donors: list[PeerID]) -> tuple[Manifest, dict[PeerID, bytes]]:
    """The state the most donors agree on (the newest of equally large groups, then the caller's
    first donors'), not the highest version claimed: a lone donor's version or bytes cannot
    outvote two that agree. Returns one of its manifests and each holder's snapshot id."""
    groups: dict[tuple, list[PeerID]] = {}
    for donor in donors:  # the caller's order: its first donors are preferred
        manifest = answers.get(donor)
        if manifest is not None:
            groups.setdefault(manifest.content, []).append(donor)
    holders = max(groups.values(), key=lambda group: (len(group), answers[group[0]].version))
    outvoted = [d for group in groups.values() if group is not holders for d in group]
    if outvoted:
        logger.warning("state download: %d donor(s) agree on version %d; not using the states that %s offer",
                       len(holders), answers[holders[0]].version,
                       ", ".join(f"{d} (version {answers[d].version})" for d in outvoted))
    return answers[holders[0]], {donor: answers[donor].snapshot for donor in holders}


async def download_state(transport: Transport, donors: Sequence[PeerID], prefix: str, timeout: float,
                         *, parallel: int = PARALLEL_DONORS, like: Sequence[torch.Tensor] | None = None,
                         into: Sequence[torch.Tensor] | None = None, lock: AbstractContextManager | None = None,
                         max_bytes: int = MAX_STATE_BYTES, progress: ProgressCallback | None = None,
                         vouched: Collection[PeerID] | None = None,
                         check: ManifestCheck | None = None) -> tuple[int, Any, list[torch.Tensor]]:
    """Download the state most of `donors` agree on under `prefix`: `(version, metadata, tensors)`.

    Chunks come from every donor of the chosen state at once (`parallel` at a time) and are
    checked against the manifest's hashes as they arrive; a donor that dies or lies is dropped
    and the others carry on. `like`, if given, refuses donors whose tensors differ in dtype or
    shape. `vouched`, if given: only these donors count (others are logged and skipped). `check`,
    if given, is called with each donor's manifest and refuses that donor by raising ValueError.
    `progress` is called on the event loop with (bytes done, bytes total) after each chunk.
    Raises `AveragingError` if no donor answers, all donors fail, or `timeout` seconds pass.

    `into` (tensors that also act as `like`): write each chunk straight into them once its hash
    matches, and return them; the download then needs no memory beyond the chunks in flight.
    Only verified bytes are written, but a download that fails part-way leaves them holding part
    of the new state. (A tensor that is not contiguous on the CPU is received into a staging copy
    and copied in once the download is complete.) `lock`, if given, is held around each write
    into them. Without `into`, fresh tensors are allocated (the caller's stay untouched on failure,
    at the cost of one more copy of the state).
    """
    if not timeout > 0:
        raise ValueError(f"timeout must be > 0 seconds, got {timeout!r}")
    if parallel < 1:
        raise ValueError(f"parallel must be >= 1, got {parallel}")
    if into is not None:
        if like is not None:
            raise ValueError("give `like` or `into`, not both (`into` says what to expect)")
        into = list(into)
        like = into
    donors = [d for d in dict.fromkeys(donors) if d != transport.peer_id]
    if vouched is not None:
        unknown = [d for d in donors if d not in vouched]
        if unknown:
            logger.warning("state download: skipping donor(s) nobody vouches for: %s", ", ".join(map(str, unknown)))
        donors = [d for d in donors if d in vouched]
    if not donors:
        raise AveragingError("cannot download the state: no donors given")
    like_specs = None if like is None else [[_dtype_name(t.dtype), list(t.shape)] for t in like]
    failures: dict[PeerID, str] = {}
    download: _Download | None = None
    deadline = asyncio.get_running_loop().time() + timeout
    try:
        async with compat.timeout_at(deadline):
            answers = await _ask_manifests(transport, donors, manifest_method(prefix), max_bytes,
                                           like_specs, check, failures)
            if not answers:
                raise AveragingError(f"cannot download the state: no donor offered one ({_why(failures)})")
            manifest, holders = _choose(answers, donors)
            try:
                if into is None:
                    targets = serialization.allocate([[n, list(s)] for n, s in manifest.specs])
                else:
                    targets = [t if t.device.type == "cpu" and t.is_contiguous()
                               else torch.empty(t.shape, dtype=t.dtype) for t in into]
            except (SerializationError, MemoryError, RuntimeError) as e:
                raise AveragingError(f"cannot allocate the state to download: {e}") from e
            download = _Download(transport, chunks_method(prefix), manifest, targets, lock, holders,
                                 parallel, progress, failures, deadline)
            await download.run()
    except TimeoutError:
        got = "" if download is None else f"; {download.chunks_done}/{download.num_chunks} chunks done"
        raise AveragingError(f"state download did not finish within {timeout} s{got} "
                             f"({_why(failures) or 'donors too slow'})") from None
    if not download.complete:
        raise AveragingError(f"state download failed: every donor of version {manifest.version} dropped out "
                             f"after {download.chunks_done}/{download.num_chunks} chunks ({_why(failures)})")
    logger.info("downloaded state version %d (%d bytes) from %s", manifest.version, manifest.total_bytes,
                ", ".join(f"{d}: {n} chunks" for d, n in download.served.items()) or "nobody (empty)")
    if into is None:
        return manifest.version, manifest.metadata, targets
    staged = [(t, s) for t, s in zip(into, targets, strict=True) if s is not t]
    if staged:
        await asyncio.get_running_loop().run_in_executor(None, _copy_staged, staged, lock)
    return manifest.version, manifest.metadata, into


def _copy_staged(staged: list[tuple[torch.Tensor, torch.Tensor]], lock: AbstractContextManager | None) -> None:
    """Copy the completed staging tensors into their destinations (in a worker thread)."""
    with lock if lock is not None else contextlib.nullcontext(), torch.no_grad():
        for destination, staging in staged:
            destination.copy_(staging)


def _why(failures: dict[PeerID, str]) -> str:
    return "; ".join(f"{donor}: {reason}" for donor, reason in failures.items())
