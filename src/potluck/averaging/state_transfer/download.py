"""`download_state`: a newcomer fetches the newest model state from several donors at once.

It asks every donor for a manifest and groups the donors by the state they offer (version,
metadata and every chunk's hash). The caller's `elect` chooses among the states (the
Optimizer weighs each state by the rounds its witnesses recorded its holders in: see
`potluck.optim.vouching`) or refuses to; without one, the state the most donors agree on (ties to
the caller's first donors, never to the highest version claimed). Then it fetches chunks from
that whole group at once, each written into place
(`into`: the caller's own tensors) as soon as its hash matches. Each donor's worker takes the
next chunk from one shared queue, so faster donors serve more. A donor that fails, stalls or
sends bytes that do not match the hash is dropped and its chunks go back to the queue. Once the
queue is empty, idle workers also fetch chunks still in flight elsewhere (the "endgame"), so a
slow or silently dead donor cannot hold up the last chunks.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import itertools
import logging
from collections import Counter, deque
from collections.abc import Awaitable, Callable, Collection, Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch

from potluck.averaging.state_transfer.messages import (
    MAX_STATE_BYTES,
    REQUESTS_IN_FLIGHT,
    ChunkReply,
    ChunkRequest,
    ChunkStreamOpen,
    Manifest,
    ManifestRequest,
    dtype_name,
)
from potluck.core import compat, serialization
from potluck.core.digests import digest
from potluck.core.errors import AveragingError, ConnectionLost, MalformedMessage, NetworkError, SerializationError
from potluck.core.names import AveragerNames
from potluck.net.identity import PeerID
from potluck.net.transport import Transport

__all__ = ["CHUNK_TIMEOUT", "MANIFEST_GRACE_SECONDS", "PARALLEL_DONORS", "Election", "ManifestCheck", "download_state"]

logger = logging.getLogger(__name__)

ProgressCallback = Callable[[int, int], None]
ManifestCheck = Callable[[Manifest], None]  # raises ValueError (saying why) to refuse a donor's manifest
# Chooses among the states the donors offer: given each state's holders (every group in the
# caller's order of its donors, each group in that order too), the index of the state to take, or
# None to take none (the download then fails and the caller keeps its own state). Called with
# one state too, when the donors that answered agree: the caller learns whose state it takes
# (the Optimizer follows their epoch), and may still refuse it.
Election = Callable[[list[list[PeerID]]], Awaitable[int | None]]

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
            return ChunkReply.from_wire(reply, index=index, size=end - start).data
        except MalformedMessage as e:
            raise _DonorMisbehaved(str(e)) from None

    def _matches(self, index: int, data: torch.Tensor) -> bool:
        return digest(data.numpy()) == self.manifest.hashes[index]

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
            manifest = Manifest.from_wire(reply, max_bytes=max_bytes)
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


async def _choose(answers: dict[PeerID, Manifest], donors: list[PeerID],
                  elect: Election | None) -> tuple[Manifest, dict[PeerID, bytes]]:
    """The state to take: the one `elect` chooses (without it, the only one offered, or the one
    the most donors agree on; ties to the caller's first donors, never to the version a donor
    claims). Returns one of its manifests and each holder's snapshot id; raises AveragingError if
    `elect` refuses to choose."""
    groups: dict[tuple, list[PeerID]] = {}
    for donor in donors:  # the caller's order
        manifest = answers.get(donor)
        if manifest is not None:
            groups.setdefault(manifest.content, []).append(donor)
    states = list(groups.values())
    if elect is None:
        chosen: int | None = max(range(len(states)), key=lambda i: (len(states[i]), -i))
    else:
        chosen = await elect([list(group) for group in states])
        if chosen is not None and not 0 <= chosen < len(states):
            raise ValueError(f"the election chose state {chosen} of {len(states)}")
    if chosen is None:
        offers = ", ".join(f"{d} (version {answers[d].version})" for group in states for d in group)
        raise AveragingError(f"the donors offer {len(states)} different states and none is backed by more than "
                             f"the others ({offers})")
    holders = states[chosen]
    outvoted = [d for group in states if group is not holders for d in group]
    if outvoted:
        logger.warning("state download: %d donor(s) agree on version %d; not using the states that %s offer",
                       len(holders), answers[holders[0]].version,
                       ", ".join(f"{d} (version {answers[d].version})" for d in outvoted))
    return answers[holders[0]], {donor: answers[donor].snapshot for donor in holders}


async def download_state(transport: Transport, donors: Sequence[PeerID], names: AveragerNames, timeout: float,
                         *, parallel: int = PARALLEL_DONORS, like: Sequence[torch.Tensor] | None = None,
                         into: Sequence[torch.Tensor] | None = None, lock: AbstractContextManager | None = None,
                         max_bytes: int = MAX_STATE_BYTES, progress: ProgressCallback | None = None,
                         vouched: Collection[PeerID] | None = None,
                         check: ManifestCheck | None = None,
                         elect: Election | None = None) -> tuple[int, Any, list[torch.Tensor]]:
    """Download a state `donors` offer from the averager `names`: `(version, metadata, tensors)`.
    `elect`, if given, chooses among the states offered (or refuses: AveragingError), even one;
    without it, the state the most donors agree on, ties going to the caller's first donors.

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
    like_specs = None if like is None else [[dtype_name(t.dtype), list(t.shape)] for t in like]
    failures: dict[PeerID, str] = {}
    download: _Download | None = None
    deadline = asyncio.get_running_loop().time() + timeout
    try:
        async with compat.timeout_at(deadline):
            answers = await _ask_manifests(transport, donors, names.manifest, max_bytes,
                                           like_specs, check, failures)
            if not answers:
                raise AveragingError(f"cannot download the state: no donor offered one ({_why(failures)})")
            manifest, holders = await _choose(answers, donors, elect)
            try:
                if into is None:
                    targets = serialization.allocate([[n, list(s)] for n, s in manifest.specs])
                else:
                    targets = [t if t.device.type == "cpu" and t.is_contiguous()
                               else torch.empty(t.shape, dtype=t.dtype) for t in into]
            except (SerializationError, MemoryError, RuntimeError) as e:
                raise AveragingError(f"cannot allocate the state to download: {e}") from e
            download = _Download(transport, names.chunks, manifest, targets, lock, holders,
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
