"""`StateServer`: a donor serves snapshots of its state to newcomers (see `download` for their side).

Asked for a manifest, it offers a snapshot of its state (a private copy made off the event loop,
so training goes on) and describes it: version, metadata, tensor specs, chunk size and the
SHA-256 of every chunk. Newcomers share snapshots: one per version, at most `max_snapshots` in
all, each freed once no stream serves it and it has been idle `SNAPSHOT_IDLE_SECONDS`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch

from potluck.averaging.state_transfer.download import CHUNK_TIMEOUT, MANIFEST_GRACE_SECONDS
from potluck.averaging.state_transfer.messages import (
    CHUNK_BYTES,
    MAX_CHUNK_BYTES,
    MAX_STATE_METADATA_BYTES,
    MIN_CHUNK_BYTES,
    SNAPSHOT_ID_BYTES,
    ChunkReply,
    ChunkRequest,
    ChunkStreamOpen,
    Manifest,
    ManifestRequest,
    dtype_name,
)
from potluck.core.digests import digest
from potluck.core.errors import DeadlineExceeded, EndOfStream, MalformedMessage
from potluck.core.names import AveragerNames
from potluck.core.wire import encoded_value
from potluck.net.connection import CallContext, Stream
from potluck.net.transport import Transport

__all__ = ["CHUNK_SEND_TIMEOUT", "MAX_SNAPSHOTS", "SNAPSHOT_CLAIM_SECONDS", "SNAPSHOT_IDLE_SECONDS", "StateGetter",
           "StateServer"]

logger = logging.getLogger(__name__)

StateGetter = Callable[[], tuple[int, Any, Sequence[torch.Tensor]]]

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
# A snapshot that is no longer current takes no new chunk stream once it is this old: a downloader
# that lost its stream may open another on the snapshot of its manifest (a download of a large
# state over a slow link takes minutes), but one that opened stream after stream, each asking a
# chunk a minute, held a stale snapshot for good, and with it the server's only slot: newcomers
# were offered a version hours old.
STALE_LEASE_SECONDS = 600.0
# A chunk stream whose downloader asks for nothing this long is closed (it has gone away).
CHUNK_STREAM_IDLE_SECONDS = 60.0
# A chunk the downloader does not take within this long (it stopped reading, so the stream's window
# stays full) ends its stream: a downloader that never reads keeps a snapshot alive no longer.
CHUNK_SEND_TIMEOUT = CHUNK_TIMEOUT


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
        specs = tuple((dtype_name(t.dtype), tuple(t.shape)) for t in tensors)
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
    hashes = tuple(digest(memory[start:start + chunk_bytes])
                   for start in range(0, flat.numel(), chunk_bytes))
    manifest = Manifest(version, specs, chunk_bytes, hashes, secrets.token_bytes(SNAPSHOT_ID_BYTES), metadata)
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

    def __init__(self, transport: Transport, get_state: StateGetter, names: AveragerNames, *,
                 lock: AbstractContextManager | None = None, chunk_bytes: int = CHUNK_BYTES,
                 max_snapshots: int = MAX_SNAPSHOTS, current_version: Callable[[], Any] | None = None):
        if not MIN_CHUNK_BYTES <= chunk_bytes <= MAX_CHUNK_BYTES:
            raise ValueError(f"chunk_bytes must be in [{MIN_CHUNK_BYTES}, {MAX_CHUNK_BYTES}], "
                             f"got {chunk_bytes}")
        if max_snapshots < 1:
            raise ValueError(f"max_snapshots must be >= 1, got {max_snapshots}")
        self.transport = transport
        self.manifest_method = names.manifest
        self.chunks_method = names.chunks
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
        # Drop it here: the copy below starts in another thread at once, and this frame must not
        # keep a snapshot dropped from the table alive while the state is copied anew.
        newest = None
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
                index = ChunkRequest.from_wire(message, num_chunks=num_chunks).index
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
        now = asyncio.get_running_loop().time()
        if now - snapshot.created > STALE_LEASE_SECONDS and not self._is_current(snapshot, now):
            raise LookupError("this snapshot is old and a newer state is on offer; ask for a new manifest")
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
