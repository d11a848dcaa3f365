"""State download: exact, parallel, hash-verified, and it survives donors that die or lie."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import pytest
import torch

from potluck.averaging import Averager
from potluck.averaging.state_transfer import StateServer, download_state
from potluck.averaging.state_transfer.messages import (
    CHUNK_BYTES,
    MAX_CHUNK_BYTES,
    MAX_STATE_METADATA_BYTES,
    MAX_TENSORS,
    MIN_CHUNK_BYTES,
    ChunkReply,
    ChunkRequest,
    ChunkStreamOpen,
    DonorRecord,
    Manifest,
    ManifestRequest,
)
from potluck.averaging.state_transfer.server import SNAPSHOT_IDLE_SECONDS
from potluck.core.errors import AveragingError, MalformedMessage, RemoteError
from potluck.core.names import RunNames
from potluck.core.virtual_time import run_virtual
from potluck.net import Identity, TCPTransport
from potluck.net.emulated import EmulatedNetwork, EmulatedTransport
from tests.emulated_swarm import make_swarm

KiB, MiB = 2**10, 2**20
PREFIX = RunNames("test_run").averager("tensors")
CHUNK = 256 * KiB
# Donor upload cap on the emulated network: a few MB then take about a virtual second.
DONOR_UPLOAD = 4 * MiB


def make_state(seed: int) -> list[torch.Tensor]:
    """About 3.7 MB over many dtypes and odd sizes, so chunks straddle tensor boundaries."""
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randn(768, 1024, generator=g),
        torch.randn(301, 777, generator=g).to(torch.bfloat16),
        torch.randint(-2**62, 2**62, (10_001,), generator=g, dtype=torch.int64),
        torch.randn(3, 5, 7, generator=g).half(),
        torch.rand(33, generator=g) > 0.5,
        torch.empty(0, dtype=torch.uint8),
        torch.tensor(3.25, dtype=torch.float64),
        torch.randn(64, 65, generator=g)[:, ::2],  # not contiguous
    ]


def assert_exact(got: list[torch.Tensor], expected: list[torch.Tensor]) -> None:
    assert len(got) == len(expected)
    for a, b in zip(got, expected, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a, b)


class Swarm:
    """A newcomer and donors on one emulated network, each donor with a StateServer."""

    def __init__(self, net: EmulatedNetwork):
        self.net = net
        self.newcomer: EmulatedTransport | None = None
        self.donors: list[EmulatedTransport] = []
        self.servers: list[StateServer] = []

    @classmethod
    async def start(cls, states: list[tuple[int, list[torch.Tensor]]],
                    upload: float | None = DONOR_UPLOAD) -> Swarm:
        swarm = cls(EmulatedNetwork(latency=0.005))
        swarm.newcomer = swarm.net.transport()
        await swarm.newcomer.start()
        for version, tensors in states:
            donor = swarm.net.transport(upload=upload)
            await donor.start()
            swarm.servers.append(StateServer(
                donor, lambda v=version, ts=tensors: (v, {"epoch": v, "note": "hi"}, ts), PREFIX,
                chunk_bytes=CHUNK))
            swarm.newcomer.add_addresses(donor.peer_id, donor.addresses)
            swarm.donors.append(donor)
        return swarm

    @property
    def donor_ids(self) -> list[str]:
        return [d.peer_id for d in self.donors]

    async def close(self) -> None:
        for t in [self.newcomer, *self.donors]:
            await t.close()


async def donor_and_client() -> tuple[EmulatedTransport, EmulatedTransport]:
    """Two started peers on a fresh emulated network; the client knows the donor's address."""
    net = EmulatedNetwork()
    donor, client = net.transport(), net.transport()
    for t in (donor, client):
        await t.start()
    client.add_addresses(donor.peer_id, donor.addresses)
    return donor, client


def num_chunks(tensors: list[torch.Tensor]) -> int:
    total = sum(t.numel() * t.element_size() for t in tensors)
    return -(-total // CHUNK)


@pytest.mark.timeout(20)
def test_download_is_exact_and_uses_every_donor() -> None:
    state = make_state(0)
    expected = [t.clone() for t in state]

    async def main() -> None:
        swarm = await Swarm.start([(7, state)] * 3)
        seen: list[tuple[int, int]] = []

        def progress(done: int, total: int) -> None:
            if not seen:
                for t in state:  # training goes on: the donors' snapshots must not change
                    t.zero_()
            seen.append((done, total))

        version, metadata, tensors = await download_state(
            swarm.newcomer, swarm.donor_ids, PREFIX, timeout=60, progress=progress)
        assert version == 7 and metadata == {"epoch": 7, "note": "hi"}
        assert_exact(tensors, expected)
        served = [s.chunks_served for s in swarm.servers]
        assert all(n > 0 for n in served), served
        assert sum(served) >= num_chunks(state)
        total = sum(t.numel() * t.element_size() for t in expected)
        assert seen[-1] == (total, total) and len(seen) == num_chunks(state)
        await swarm.close()

    run_virtual(main())


@pytest.mark.timeout(20)
@pytest.mark.parametrize("silent", [False, True], ids=["killed", "powered_off"])
def test_donor_killed_mid_transfer_newcomer_still_gets_exact_state(silent: bool) -> None:
    state = make_state(1)

    async def main() -> None:
        swarm = await Swarm.start([(3, state)] * 3)
        victim = swarm.donors[1].peer_id
        crashed_at: list[int] = []

        def progress(done: int, total: int) -> None:
            if not crashed_at and done >= total // 3:
                crashed_at.append(done)
                swarm.net.crash(victim, silent=silent)

        loop = asyncio.get_running_loop()
        t0 = loop.time()
        version, _, tensors = await download_state(
            swarm.newcomer, swarm.donor_ids, PREFIX, timeout=120, progress=progress)
        assert version == 3
        assert_exact(tensors, state)
        total = sum(t.numel() * t.element_size() for t in state)
        assert crashed_at and crashed_at[0] < total  # it really died mid-transfer
        assert 0 < swarm.servers[1].chunks_served < num_chunks(state)
        if silent:  # the endgame fetched its lost chunks elsewhere instead of waiting them out
            assert loop.time() - t0 < 10
        await swarm.close()

    run_virtual(main())


@pytest.mark.timeout(20)
def test_newest_version_wins() -> None:
    old, new = make_state(2), make_state(3)

    async def main() -> None:
        swarm = await Swarm.start([(4, old), (5, new), (3, old), (5, new)])
        version, metadata, tensors = await download_state(swarm.newcomer, swarm.donor_ids, PREFIX, timeout=60)
        assert version == 5 and metadata["epoch"] == 5
        assert_exact(tensors, new)
        assert [s.chunks_served > 0 for s in swarm.servers] == [False, True, False, True]
        await swarm.close()

    run_virtual(main())


@pytest.mark.timeout(20)
def test_largest_group_of_agreeing_donors_wins_within_a_version() -> None:
    a, b = make_state(4), make_state(5)

    async def main() -> None:
        swarm = await Swarm.start([(9, a), (9, b), (9, b)])
        _, _, tensors = await download_state(swarm.newcomer, swarm.donor_ids, PREFIX, timeout=60)
        assert_exact(tensors, b)
        assert swarm.servers[0].chunks_served == 0
        await swarm.close()

    run_virtual(main())


@pytest.mark.timeout(20)
def test_a_tie_goes_to_the_callers_first_donors_never_to_the_higher_version_claimed() -> None:
    a, b = make_state(4), make_state(5)

    async def main() -> None:
        swarm = await Swarm.start([(3, a), (9, b)])
        version, _, tensors = await download_state(swarm.newcomer, swarm.donor_ids, PREFIX, timeout=60)
        assert version == 3
        assert_exact(tensors, a)
        await swarm.close()

    run_virtual(main())


@pytest.mark.timeout(20)
def test_the_callers_election_chooses_among_disagreeing_donors_or_refuses() -> None:
    a, b = make_state(4), make_state(5)

    async def main() -> None:
        swarm = await Swarm.start([(9, a), (9, b), (9, b), (9, a)])
        asked: list[list[list[str]]] = []

        async def second(groups: list[list[Any]]) -> int:
            asked.append(groups)
            return len(groups) - 1
        _, _, tensors = await download_state(swarm.newcomer, swarm.donor_ids, PREFIX, timeout=60, elect=second)
        assert_exact(tensors, b)
        ids = swarm.donor_ids
        assert asked == [[[ids[0], ids[3]], [ids[1], ids[2]]]]  # each state's holders, in the caller's order

        async def none(groups: list[list[Any]]) -> None:
            return None
        with pytest.raises(AveragingError, match="2 different states"):
            await download_state(swarm.newcomer, swarm.donor_ids, PREFIX, timeout=60, elect=none)
        with pytest.raises(AveragingError, match="1 different states"):  # the caller may refuse even one
            await download_state(swarm.newcomer, [ids[1], ids[2]], PREFIX, timeout=60, elect=none)
        asked.clear()
        agree = await download_state(swarm.newcomer, [ids[1], ids[2]], PREFIX, timeout=60, elect=second)
        assert_exact(agree[2], b)
        assert asked == [[[ids[1], ids[2]]]]  # ... and learns whose state it takes
        await swarm.close()

    run_virtual(main())


@pytest.mark.timeout(20)
def test_lying_donor_is_caught_by_hash_and_state_is_still_exact(caplog: pytest.LogCaptureFixture) -> None:
    state = make_state(6)
    total = sum(t.numel() * t.element_size() for t in state)

    async def main() -> None:
        swarm = await Swarm.start([(2, state)] * 3)
        liar, liar_server = swarm.donors[0], swarm.servers[0]
        lies: list[int] = []

        async def corrupt_chunks(stream: Any, ctx: Any) -> None:
            """Honest manifest (from the real server), garbage chunk bytes of the right size."""
            async for message in stream:
                index = message["i"]
                lies.append(index)
                size = min(CHUNK, total - index * CHUNK)
                await stream.send({"i": index, "data": torch.full((size,), 7, dtype=torch.uint8)})

        liar.add_stream_handler(liar_server.chunks_method, corrupt_chunks)
        with caplog.at_level(logging.WARNING, logger="potluck.averaging.state_transfer"):
            _, _, tensors = await download_state(swarm.newcomer, swarm.donor_ids, PREFIX, timeout=60)
        assert_exact(tensors, state)
        assert lies, "the liar was never asked, so the test proves nothing"
        assert any("does not match its hash" in r.getMessage() and str(liar.peer_id) in r.getMessage()
                   for r in caplog.records)
        await swarm.close()

    run_virtual(main())


@pytest.mark.timeout(20)
@pytest.mark.parametrize("bogus", [
    {"version": 99},  # an incomplete manifest
    "not a manifest",
    {"version": 99, "metadata": None, "specs": [["float32", [10]]], "chunk_bytes": 4096,
     "hashes": [b"\0" * 32] * 2, "snapshot": b"\0" * 16},  # 40 bytes need 1 hash, not 2
    {"version": 99, "metadata": None, "specs": [["float32", [2**40]]], "chunk_bytes": 4096,
     "hashes": [], "snapshot": b"\0" * 16},  # 4 TiB: over the size limit
    {"version": 99, "metadata": None, "specs": [["no_such_dtype", [10]]], "chunk_bytes": 4096,
     "hashes": [b"\0" * 32], "snapshot": b"\0" * 16},
    {"version": 99, "metadata": None, "specs": [["float32", [10]]], "chunk_bytes": 1,
     "hashes": [b"\0" * 32] * 40, "snapshot": b"\0" * 16},  # absurd chunk size
])
def test_donor_with_invalid_manifest_is_ignored(bogus: Any) -> None:
    state = make_state(7)

    async def main() -> None:
        swarm = await Swarm.start([(1, state), (1, state)])

        async def lie(request: Any, ctx: Any) -> Any:
            return bogus

        swarm.donors[0].add_handler(swarm.servers[0].manifest_method, lie)
        version, _, tensors = await download_state(swarm.newcomer, swarm.donor_ids, PREFIX, timeout=60)
        assert version == 1
        assert_exact(tensors, state)
        await swarm.close()

    run_virtual(main())


@pytest.mark.timeout(20)
def test_wrong_schema_is_refused_when_the_caller_says_what_it_expects() -> None:
    state = make_state(8)

    async def main() -> None:
        swarm = await Swarm.start([(1, state)])
        with pytest.raises(AveragingError, match="differ"):
            await download_state(swarm.newcomer, swarm.donor_ids, PREFIX, timeout=60,
                                 like=[torch.zeros(3)])
        _, _, tensors = await download_state(swarm.newcomer, swarm.donor_ids, PREFIX, timeout=60,
                                             like=state)
        assert_exact(tensors, state)
        await swarm.close()

    run_virtual(main())


@pytest.mark.timeout(20)
def test_all_donors_dead_before_start_raises_at_once() -> None:
    async def main() -> None:
        swarm = await Swarm.start([(1, make_state(9))] * 3)
        for donor in swarm.donor_ids:
            swarm.net.crash(donor)
        with pytest.raises(AveragingError, match="no donor offered"):
            await download_state(swarm.newcomer, swarm.donor_ids, PREFIX, timeout=30)
        await swarm.close()

    run_virtual(main())


@pytest.mark.timeout(20)
def test_all_donors_silent_raises_within_the_deadline() -> None:
    async def main() -> None:
        swarm = await Swarm.start([(1, make_state(9))] * 2)
        for donor in swarm.donors:  # connected, then gone without a word: calls just hang
            await swarm.newcomer.connect(donor.addresses[0], timeout=5)
            swarm.net.crash(donor.peer_id, silent=True)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        with pytest.raises(AveragingError, match="within 20"):
            await download_state(swarm.newcomer, swarm.donor_ids, PREFIX, timeout=20)
        assert loop.time() - t0 == pytest.approx(20, abs=0.01)
        await swarm.close()

    run_virtual(main())


@pytest.mark.timeout(20)
def test_all_donors_dying_mid_transfer_raises() -> None:
    state = make_state(10)

    async def main() -> None:
        swarm = await Swarm.start([(1, state)] * 2)

        crashed: list[bool] = []

        def progress(done: int, total: int) -> None:
            if done >= total // 3 and not crashed:
                crashed.append(True)
                for donor in swarm.donor_ids:
                    swarm.net.crash(donor)

        loop = asyncio.get_running_loop()
        t0 = loop.time()
        with pytest.raises(AveragingError, match="dropped out after"):
            await download_state(swarm.newcomer, swarm.donor_ids, PREFIX, timeout=60, progress=progress)
        assert loop.time() - t0 < 60
        await swarm.close()

    run_virtual(main())


@pytest.mark.timeout(20)
def test_bad_requests_get_clear_errors_and_the_server_keeps_serving() -> None:
    state = make_state(11)

    async def main() -> None:
        swarm = await Swarm.start([(1, state)], upload=None)
        client, server = swarm.newcomer, swarm.servers[0]
        donor = swarm.donor_ids[0]

        async def first_reply(open_request: Any, *messages: Any) -> Any:
            stream = await client.open_stream(donor, server.chunks_method, open_request, timeout=10)
            for message in messages:
                await stream.send(message)
            try:
                return await stream.recv(timeout=10)
            finally:
                stream.abort()

        with pytest.raises(RemoteError, match="malformed manifest request: not a list of 0 items"):
            await client.call(donor, server.manifest_method, {"give": "me everything"}, timeout=10)
        manifest = Manifest.from_wire(await client.call(donor, server.manifest_method, ManifestRequest().to_wire(),
                                                        timeout=10))
        snapshot = manifest.snapshot
        with pytest.raises(RemoteError, match="malformed chunk stream request: not a map"):
            await first_reply("garbage")
        with pytest.raises(RemoteError, match="malformed chunk stream request: 'snapshot' must be 16 bytes"):
            await first_reply({"snapshot": b"short"})
        with pytest.raises(RemoteError, match="unknown or expired snapshot"):
            await first_reply({"snapshot": b"\1" * 16})
        for bad in ({"i": len(manifest.hashes)}, {"i": -1}, {"i": "0"}, {"i": True}, {"index": 0}):
            with pytest.raises(RemoteError, match=r"malformed chunk request: 'i' must be an integer in \[0, "):
                await first_reply({"snapshot": snapshot}, bad)
        with pytest.raises(RemoteError, match="malformed chunk request: not a map"):
            await first_reply({"snapshot": snapshot}, [0])
        reply = ChunkReply.from_wire(await first_reply({"snapshot": snapshot}, {"i": 0}), index=0, size=CHUNK)
        assert reply.index == 0 and reply.data.numel() == CHUNK

        await asyncio.sleep(SNAPSHOT_IDLE_SECONDS + 1)  # virtual time: the snapshot expires
        with pytest.raises(RemoteError, match="unknown or expired snapshot"):
            await first_reply(ChunkStreamOpen(snapshot).to_wire(), ChunkRequest(0).to_wire())

        _, _, tensors = await download_state(client, [donor], PREFIX, timeout=60)
        assert_exact(tensors, state)
        await swarm.close()

    run_virtual(main())


@pytest.mark.timeout(20)
def test_newcomers_arriving_together_share_one_snapshot() -> None:
    calls: list[int] = []
    state = make_state(12)

    def get_state() -> tuple[int, Any, list[torch.Tensor]]:
        calls.append(1)
        return 1, None, state

    async def main() -> None:
        net = EmulatedNetwork()
        donor, a, b = net.transport(), net.transport(), net.transport()
        for t in (donor, a, b):
            await t.start()
            t.add_addresses(donor.peer_id, donor.addresses)
        server = StateServer(donor, get_state, PREFIX)
        first, second = await asyncio.gather(
            a.call(donor.peer_id, server.manifest_method, ManifestRequest().to_wire(), timeout=10),
            b.call(donor.peer_id, server.manifest_method, ManifestRequest().to_wire(), timeout=10))
        assert Manifest.from_wire(first).snapshot == Manifest.from_wire(second).snapshot and len(calls) == 1
        for t in (donor, a, b):
            await t.close()

    run_virtual(main())


@pytest.mark.timeout(20)
def test_a_newer_version_is_offered_at_once_not_a_young_snapshot_of_the_old_one() -> None:
    """A peer catching up must get the epoch that exists now, not the one it already has."""
    version = [1]
    states = {1: make_state(1), 2: make_state(2)}

    async def main() -> None:
        donor, client = await donor_and_client()
        StateServer(donor, lambda: (version[0], {"epoch": version[0]}, states[version[0]]), PREFIX,
                    current_version=lambda: version[0])
        got, metadata, tensors = await download_state(client, [donor.peer_id], PREFIX, timeout=10)
        assert (got, metadata) == (1, {"epoch": 1})
        version[0] = 2  # well within SNAPSHOT_REUSE_SECONDS of the first snapshot
        got, metadata, tensors = await download_state(client, [donor.peer_id], PREFIX, timeout=10)
        assert (got, metadata) == (2, {"epoch": 2})
        assert_exact(tensors, states[2])
        for t in (donor, client):
            await t.close()

    run_virtual(main())


@pytest.mark.timeout(20)
def test_state_server_reports_a_broken_get_state_to_the_caller() -> None:
    async def main() -> None:
        donor, client = await donor_and_client()
        bad: Callable[[], Any] = lambda: (1, None, ["not a tensor"])  # noqa: E731
        server = StateServer(donor, bad, PREFIX)
        with pytest.raises(AveragingError, match="torch.Tensor"):
            await download_state(client, [donor.peer_id], PREFIX, timeout=10)
        for metadata, words in (("x" * (MAX_STATE_METADATA_BYTES + 1), "must encode to at most"),
                                (object(), "cannot be encoded")):
            server.close()
            server = StateServer(donor, lambda m=metadata: (1, m, [torch.zeros(3)]), PREFIX)
            with pytest.raises(AveragingError, match=f"metadata that cannot be sent: .*{words}"):
                await download_state(client, [donor.peer_id], PREFIX, timeout=10)
        for t in (donor, client):
            await t.close()

    run_virtual(main())


@pytest.mark.timeout(20)
def test_download_over_real_tcp(arun: Callable[..., Any]) -> None:
    state = make_state(13)

    async def main() -> None:
        newcomer = TCPTransport(Identity.generate(), host="127.0.0.1")
        donors = [TCPTransport(Identity.generate(), host="127.0.0.1") for _ in range(3)]
        servers = []
        try:
            for t in (newcomer, *donors):
                await t.start()
            for donor in donors:
                servers.append(StateServer(donor, lambda: (11, {"step": 11}, state), PREFIX, chunk_bytes=CHUNK))
                newcomer.add_addresses(donor.peer_id, donor.addresses)
            version, metadata, tensors = await download_state(
                newcomer, [d.peer_id for d in donors], PREFIX, timeout=15)
            assert version == 11 and metadata == {"step": 11}
            assert_exact(tensors, state)
            assert all(s.chunks_served > 0 for s in servers)
        finally:
            for t in (newcomer, *donors):
                await t.close()

    arun(main(), timeout=15)


# -- downloading straight into the caller's tensors ------------------------------------------------
def as_bytes(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Every tensor's bytes end to end (a copy), as the wire lays out the state."""
    return torch.cat([t.contiguous().reshape(-1).view(torch.uint8) for t in tensors])


def empty_like_state(state: list[torch.Tensor]) -> list[torch.Tensor]:
    """Contiguous destination tensors shaped like `state`, filled with a recognisable pattern."""
    return [torch.full(t.shape, 1, dtype=t.dtype) for t in state]


@pytest.mark.timeout(20)
def test_download_writes_straight_into_the_given_tensors() -> None:
    state = make_state(14)

    async def main() -> None:
        swarm = await Swarm.start([(7, state)] * 2)
        into = empty_like_state(state)
        addresses = [t.data_ptr() for t in into]
        version, _, tensors = await download_state(swarm.newcomer, swarm.donor_ids, PREFIX, timeout=60, into=into)
        assert version == 7
        assert all(got is mine for got, mine in zip(tensors, into, strict=True))
        assert [t.data_ptr() for t in into] == addresses
        assert_exact(into, [t.contiguous() for t in state])
        # Matrices as transposed views: not contiguous, so staged, then copied in when complete.
        strided = [torch.zeros(t.shape[::-1], dtype=t.dtype).t() if t.dim() == 2 else torch.zeros_like(t)
                   for t in state]
        await download_state(swarm.newcomer, swarm.donor_ids, PREFIX, timeout=60, into=strided)
        assert_exact(strided, state)
        await swarm.close()

    run_virtual(main())


@pytest.mark.timeout(20)
def test_download_into_tensors_leaves_them_untouched_when_every_donor_lies() -> None:
    state = make_state(15)
    total = sum(t.numel() * t.element_size() for t in state)

    async def main() -> None:
        swarm = await Swarm.start([(2, state)] * 2)

        async def corrupt_chunks(stream: Any, ctx: Any) -> None:
            async for message in stream:
                size = min(CHUNK, total - message["i"] * CHUNK)
                await stream.send({"i": message["i"], "data": torch.full((size,), 7, dtype=torch.uint8)})

        for donor, server in zip(swarm.donors, swarm.servers, strict=True):
            donor.add_stream_handler(server.chunks_method, corrupt_chunks)
        into = empty_like_state(state)
        before = as_bytes(into)
        with pytest.raises(AveragingError, match="dropped out after 0/"):
            await download_state(swarm.newcomer, swarm.donor_ids, PREFIX, timeout=60, into=into)
        assert torch.equal(as_bytes(into), before)
        await swarm.close()

    run_virtual(main())


@pytest.mark.timeout(20)
def test_download_into_tensors_writes_only_whole_verified_chunks_when_donors_die_mid_way() -> None:
    """Straight into the tensors means no undo: a failed download leaves each chunk either as it
    was or exactly the donors' (never torn, never unverified)."""
    state = make_state(16)

    async def main() -> None:
        swarm = await Swarm.start([(1, state)] * 2)

        def progress(done: int, total: int) -> None:
            if done >= total // 3:
                for donor in swarm.donor_ids:
                    swarm.net.crash(donor)

        into = empty_like_state(state)
        before, expected = as_bytes(into), as_bytes(state)
        with pytest.raises(AveragingError, match="dropped out after"):
            await download_state(swarm.newcomer, swarm.donor_ids, PREFIX, timeout=60, into=into,
                                 progress=progress)
        after = as_bytes(into)
        new = 0
        for start in range(0, after.numel(), CHUNK):
            chunk = after[start:start + CHUNK]
            if torch.equal(chunk, expected[start:start + CHUNK]):
                new += 1
            else:
                assert torch.equal(chunk, before[start:start + CHUNK])
        assert 0 < new < num_chunks(state)  # written in place, and the download really failed part-way
        await swarm.close()

    run_virtual(main())


@pytest.mark.timeout(30)
def test_averager_whose_download_failed_keeps_its_version_and_offers_no_torn_state() -> None:
    """The averager downloads into its own tensors; if that fails part-way it keeps its version
    and refuses to serve the mixed tensors until its version changes."""
    donor_state = [torch.randn(700_000), torch.randn(900_000)]  # 6.4 MB: 4 chunks of CHUNK_BYTES

    async def main() -> None:
        net, peers = await make_swarm(3)
        donor = Averager(peers[0], donor_state, "torn")
        donor.round = 5
        await donor.announce_state()
        flat = as_bytes(donor_state)

        async def two_chunks_then_die(stream: Any, ctx: Any) -> None:
            """Honest chunks (the real server made the manifest), then the donor crashes."""
            async for message in stream:
                i = message["i"]
                if i >= 2:
                    net.crash(peers[0].transport.peer_id)
                    return
                await stream.send({"i": i, "data": flat[i * CHUNK_BYTES:(i + 1) * CHUNK_BYTES].clone()})

        peers[0].transport.add_stream_handler(donor.state_server.chunks_method, two_chunks_then_die)
        newcomer = Averager(peers[1], [torch.zeros(700_000), torch.zeros(900_000)], "torn")
        newcomer.state_metadata = "mine"
        with pytest.raises(AveragingError):
            await newcomer.aload_state_from_peers(timeout=20)
        assert (newcomer.round, newcomer.state_metadata) == (0, "mine")
        assert as_bytes(newcomer._tensors)[:CHUNK_BYTES].equal(flat[:CHUNK_BYTES])  # written in place

        other = peers[2]
        ask = newcomer.state_server.manifest_method
        with pytest.raises(RemoteError, match="being replaced"):
            await other.transport.call(peers[1].transport.peer_id, ask, ManifestRequest().to_wire(), timeout=10)
        newcomer.round += 1  # its tensors are whole again (e.g. an averaging step overwrote them)
        manifest = await other.transport.call(peers[1].transport.peer_id, ask, ManifestRequest().to_wire(), timeout=10)
        assert manifest["version"] == 1

    run_virtual(main())


# -- the messages, one malformed field at a time ------------------------------------------------------
def refuses(parse: Callable[[Any], Any], wire: Any, field: str) -> None:
    """`parse(wire)` raises MalformedMessage whose field names `field` first."""
    with pytest.raises(MalformedMessage) as caught:
        parse(wire)
    assert caught.value.field.startswith(field), caught.value.field


def test_manifest_refuses_malformed_fields_by_name() -> None:
    good = Manifest(3, (("float32", (10, 1000)), ("int8", ())), 16 * KiB, (b"\1" * 32, b"\2" * 32, b"\3" * 32),
                    b"\0" * 16, {"epoch": 3})
    assert good.sizes == (40_000, 1)
    assert Manifest.from_wire(good.to_wire()) == good
    assert ManifestRequest.from_wire(ManifestRequest().to_wire()) == ManifestRequest()
    for anything in ({"give": "me everything"}, ["more"], None):
        refuses(ManifestRequest.from_wire, anything, "not a list of 0 items")
    refuses(Manifest.from_wire, [good.to_wire()], "not a map")
    refuses(lambda w: Manifest.from_wire(w, max_bytes=40_000), good.to_wire(), "'specs'")
    for key, value, field in (
            ("version", -1, "'version'"), ("version", "3", "'version'"), ("version", True, "'version'"),
            ("chunk_bytes", MIN_CHUNK_BYTES - 1, "'chunk_bytes'"), ("chunk_bytes", MAX_CHUNK_BYTES + 1, "'chunk_bytes'"),
            ("snapshot", b"\0" * 15, "'snapshot'"), ("snapshot", "id", "'snapshot'"),
            ("specs", "float32", "'specs'"), ("specs", [["no_such_dtype", [10]]], "'specs'"),
            ("specs", [["float32", [2**40]]], "'specs'"), ("specs", [["int8", []]] * (MAX_TENSORS + 1), "'specs'"),
            ("hashes", [b"\1" * 32] * 2, "'hashes'"), ("hashes", [b"\1" * 32] * 4, "'hashes'"),
            ("hashes", [b"\1" * 32, b"\2" * 32, b"short"], "'hashes'"), ("hashes", None, "'hashes'"),
            ("metadata", "x" * (MAX_STATE_METADATA_BYTES + 1), "'metadata'")):
        refuses(Manifest.from_wire, {**good.to_wire(), key: value}, field)


def test_chunk_messages_refuse_malformed_fields_by_name() -> None:
    assert ChunkStreamOpen.from_wire(ChunkStreamOpen(b"\7" * 16).to_wire()) == ChunkStreamOpen(b"\7" * 16)
    refuses(ChunkStreamOpen.from_wire, b"\7" * 16, "not a map")
    refuses(ChunkStreamOpen.from_wire, {"snapshot": b"\7" * 17}, "'snapshot'")
    assert ChunkRequest.from_wire(ChunkRequest(4).to_wire(), num_chunks=5) == ChunkRequest(4)
    refuses(lambda w: ChunkRequest.from_wire(w, num_chunks=5), 4, "not a map")
    for index in (5, -1, 2.0, None):
        refuses(lambda w: ChunkRequest.from_wire(w, num_chunks=5), {"i": index}, "'i'")
    data = torch.zeros(100, dtype=torch.uint8)
    reply = ChunkReply.from_wire(ChunkReply(3, data).to_wire(), index=3, size=100)
    assert reply.index == 3 and reply.data is data
    refuses(lambda w: ChunkReply.from_wire(w, index=3, size=100), None, "not a map")
    refuses(lambda w: ChunkReply.from_wire(w, index=3, size=100), {"i": 2, "data": data}, "'i'")
    for bad in (data[:99], data.float(), data.view(10, 10), b"\0" * 100, None):
        refuses(lambda w: ChunkReply.from_wire(w, index=3, size=100), {"i": 3, "data": bad}, "'data'")


def test_donor_record_refuses_malformed_fields_by_name() -> None:
    good = DonorRecord(7)
    assert DonorRecord.from_wire(good.to_wire()) == good
    assert "addrs" not in good.to_wire()  # donors are found by id, through their own signed records
    refuses(DonorRecord.from_wire, [7], "not a map")
    for key, value, field in (("version", -1, "'version'"), ("version", 1.5, "'version'"), ("version", None, "'version'")):
        refuses(DonorRecord.from_wire, {**good.to_wire(), key: value}, field)
