"""Runs that last for days: a finished round, stream or connection is freed by reference counting.

Python frees objects in a reference cycle only when the cyclic GC runs, and a long run makes
enough garbage between collections that the process grows for minutes (and glibc then keeps the
heap). These tests turn the GC off and keep whatever it would have had to free (DEBUG_SAVEALL):
no potluck object, coroutine or tensor may be in it after rounds, streams and connections end.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import socket
import sys
import types
import weakref

import pytest
import torch

import potluck
from potluck.averaging import Averager
from potluck.averaging.allreduce import AllReduceRun, AllReduceService, BufferPool
from potluck.averaging.allreduce.buffers import POOL_GRANULE
from potluck.averaging.matchmaking import Matchmaker
from potluck.core.dht_time import event_loop_clock
from potluck.core.errors import AveragingError, PeerUnreachable
from potluck.core.names import RunNames
from potluck.core.runner import acquire_runner, release_runner
from potluck.core.virtual_time import run_virtual, virtual_time_loop
from potluck.net import Identity, TCPTransport
from potluck.net.emulated import EmulatedNetwork
from potluck.net.transport import IDLE_BULK_SECONDS
from potluck.optim import Optimizer
from tests.conftest import LOOP_KINDS
from tests.emulated_swarm import make_swarm
from tests.test_allreduce import CODEC, average, make_group, swarm, weighted_mean

# A lingering tombstone is a few small fields (group, outcome, state): far below one chunk.
MAX_TOMBSTONE_BYTES = 16 * 1024
ROUNDS = 3


@contextlib.contextmanager
def gc_saving_garbage():
    """The GC off and what it would free kept in gc.garbage; settings restored afterwards."""
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    gc.collect()
    gc.garbage.clear()
    try:
        yield
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        if enabled:
            gc.enable()


def _ours(obj: object) -> bool:
    if isinstance(obj, torch.Tensor):
        return True
    if isinstance(obj, (types.CoroutineType, types.FrameType)):
        code = obj.cr_code if isinstance(obj, types.CoroutineType) else obj.f_code
        return "potluck" in code.co_filename
    return (type(obj).__module__ or "").startswith("potluck.")


def cyclic_garbage() -> list[str]:
    """Potluck objects (and tensors) that only the cyclic GC could free, since the last call;
    the first entry, if any, shows one of their cycles."""
    gc.collect()
    ours = [o for o in gc.garbage if _ours(o)]
    found = sorted({f"{type(o).__module__}.{type(o).__qualname__}" for o in ours})
    cycles = (one_cycle(o, gc.garbage) for o in ours)
    found[:0] = [next((c for c in cycles if c), "")] if ours else []
    gc.garbage.clear()
    return found


def one_cycle(start: object, garbage: list) -> str:
    """A path of references from `start` back to itself through `garbage` (for the message),
    or "" if `start` is only referenced from a cycle."""
    ids = {id(o) for o in garbage}
    came_from: dict[int, object] = {id(start): None}
    frontier = [start]
    while frontier:
        nxt = []
        for obj in frontier:
            for ref in gc.get_referents(obj):
                if ref is start:
                    path = [obj]
                    while came_from[id(path[-1])] is not None:
                        path.append(came_from[id(path[-1])])
                    return "cycle: " + " -> ".join(_name(o) for o in reversed(path))
                if id(ref) in ids and id(ref) not in came_from:
                    came_from[id(ref)] = obj
                    nxt.append(ref)
        frontier = nxt
    return ""


def _name(obj: object) -> str:
    if isinstance(obj, types.FrameType):
        return f"frame {obj.f_code.co_name}"
    return type(obj).__qualname__


def deep_size(root: object) -> tuple[int, bool]:
    """Bytes reachable from `root` (stopping at shared things: types, modules, functions), and
    whether a tensor is among them."""
    seen: set[int] = set()
    todo, total, tensor = [root], 0, False
    while todo:
        obj = todo.pop()
        if id(obj) in seen or isinstance(obj, (type, types.ModuleType, types.FunctionType)):
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            tensor = True
            total += obj.numel() * obj.element_size()
        total += sys.getsizeof(obj)
        todo.extend(gc.get_referents(obj))
    return total, tensor


async def watch_run(service: AllReduceService, gid: bytes) -> weakref.ref:
    """A weak reference to the run of `gid` on `service`, once it has started."""
    while gid not in service.runs:
        await asyncio.sleep(0)
    return weakref.ref(service.runs[gid])


async def rounds_leave_nothing(services, transports, crash=(), net=None, size=50_000) -> None:
    n = len(transports)
    roles = ["node"] * n
    for r in range(ROUNDS):
        gid = b"round%d" % r
        group = make_group(transports, roles, size, gid=gid)
        vectors = [torch.randn(size) for _ in range(n)]
        weights = [1.0 + i / n for i in range(n)]  # within 2x of each other: no weight is bounded
        survivors = [i for i in range(n) if i not in crash]
        watch = asyncio.ensure_future(watch_run(services[survivors[0]], gid))
        results = await average(services, group, vectors, weights, crash_at=0.05, crash=crash, net=net)
        run = await watch
        assert run() is None, "the run outlived its round"
        for i in survivors:
            assert torch.allclose(results[i], weighted_mean(vectors, weights, survivors), atol=1e-5)
            tombstone = services[i].finished[gid]
            size_bytes, has_tensor = deep_size(tombstone)
            assert not has_tensor and size_bytes < MAX_TOMBSTONE_BYTES, (size_bytes, has_tensor)
        del results, vectors
        await asyncio.sleep(0.5)  # virtual time: handlers of the last frames finish
        assert cyclic_garbage() == []
        if crash:
            return  # the crashed peer is gone; one round shows it


@pytest.mark.timeout(60)
def test_finished_rounds_leave_no_cyclic_garbage():
    async def main():
        net, transports, services = await swarm(4)
        with gc_saving_garbage():
            await rounds_leave_nothing(services, transports)
    run_virtual(main())


@pytest.mark.timeout(60)
def test_round_with_a_peer_dying_midway_leaves_no_cyclic_garbage():
    async def main():
        net, transports, services = await swarm(5, bandwidth=10e6)
        with gc_saving_garbage():
            await rounds_leave_nothing(services, transports, crash=[3], net=net, size=200_000)
    run_virtual(main())


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", LOOP_KINDS)
def test_rounds_over_tls_leave_no_cyclic_garbage(arun, kind):
    async def main():
        transports = [TCPTransport(Identity.generate(), host="127.0.0.1") for _ in range(3)]
        for t in transports:
            await t.start()
        for t in transports:
            for u in transports:
                if u is not t:
                    t.add_addresses(u.peer_id, u.addresses)
        services = [AllReduceService(t) for t in transports]
        try:
            with gc_saving_garbage():
                for r in range(ROUNDS):
                    group = make_group(transports, ["node"] * 3, 300_000, gid=b"tls%d" % r)
                    vectors = [torch.randn(300_000) for _ in range(3)]
                    results = await average(services, group, vectors, [1.0, 2.0, 3.0], chunk=2**16)
                    assert not isinstance(results[0], BaseException), __import__("traceback").format_exception(results[0])
                    assert torch.allclose(results[0], weighted_mean(vectors, [1.0, 2.0, 3.0], range(3)), atol=1e-5)
                    del results, vectors
                    assert cyclic_garbage() == []
        finally:
            for t in transports:
                await t.close()
    arun(main(), kind=kind)


def free_port() -> int:
    """A local TCP port nobody listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def echo_stream(stream, ctx):
    async for message in stream:
        await stream.send(message)


async def echo(request, ctx):
    return request


async def open_and_close_many(a, b, gone_address: str) -> None:
    """Streams, calls and whole connections opened and closed, some of them failing."""
    b.add_stream_handler("echo", echo_stream)
    b.add_handler("echo", echo)
    gone = Identity.generate().peer_id
    a.add_addresses(gone, [gone_address])
    for i in range(10):
        stream = await a.open_stream(b.peer_id, "echo", timeout=10)
        await stream.send({"i": i, "t": torch.randn(1000)})
        assert (await stream.recv())["i"] == i
        await stream.close()
        with contextlib.suppress(Exception):
            await stream.recv()
        aborted = await a.open_stream(b.peer_id, "echo", timeout=10)
        aborted.abort("test")
        assert await a.call(b.peer_id, "echo", i, timeout=10) == i
        with contextlib.suppress(Exception):
            await a.call(b.peer_id, "missing", timeout=10)
        for conn in list(a._all):
            conn.close("test closes every connection")
        with contextlib.suppress(Exception):
            await aborted.recv()
        with contextlib.suppress(PeerUnreachable):  # a peer that is gone: the dial fails
            await a.call(gone, "echo", i, timeout=10)
        del stream, aborted


@pytest.mark.timeout(60)
def test_streams_we_abort_leave_the_connection_at_once():
    """An aborted stream waited on the connection for a frame of the other side's to let go of it;
    a handler that never answers the cancel (it only stops) sends none, so every stream aborted on
    a shared connection stayed for the connection's life."""
    async def main():
        net, (a, b), _ = await swarm(2)

        async def silent(stream, ctx):
            await asyncio.sleep(3600)
        b.add_stream_handler("silent", silent)
        for _ in range(5):
            stream = await a.open_stream(b.peer_id, "silent", timeout=10, dedicated=False)
            stream.abort("the caller gave up")
        await asyncio.sleep(1.0)
        assert [len(c._streams) for c in a.open_connections()] == [0]
        assert [len(c._streams) for c in b.open_connections()] == [0]
    run_virtual(main())


@pytest.mark.timeout(60)
def test_bulk_connections_to_many_peers_leave_no_entry_once_idle_or_closed():
    """A dedicated (bulk) connection goes back to a per-peer idle pool after its stream and is
    closed after IDLE_BULK_SECONDS; the pool kept an empty list for every peer ever streamed to
    (about 300 bytes and the peer id each, for good)."""
    async def main():
        net, transports, _ = await swarm(21)
        client, servers = transports[0], transports[1:]
        for i, server in enumerate(servers):
            server.add_stream_handler("echo", echo_stream)
            for _ in range(2):  # the second stream reuses the idle connection of the first
                stream = await client.open_stream(server.peer_id, "echo", timeout=10, dedicated=True)
                await stream.send({"i": i})
                assert (await stream.recv())["i"] == i
                await stream.close()
                await asyncio.sleep(0.1)
            if i % 2:
                await server.close()  # half the peers go away: their idle connections close
        await asyncio.sleep(IDLE_BULK_SECONDS + 1)
        assert client._bulk_idle == {}
    run_virtual(main())


@pytest.mark.timeout(60)
def test_closed_streams_and_connections_leave_no_cyclic_garbage_emulated():
    async def main():
        net, transports, services = await swarm(2)
        with gc_saving_garbage():
            await open_and_close_many(*transports, "/emu/nobody")
            await asyncio.sleep(1.0)  # virtual time: the closes reach the other side
            assert cyclic_garbage() == []
    run_virtual(main())


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", LOOP_KINDS)
def test_closed_streams_and_connections_leave_no_cyclic_garbage_tls(arun, kind):
    async def main():
        a = TCPTransport(Identity.generate(), host="127.0.0.1")
        b = TCPTransport(Identity.generate(), host="127.0.0.1")
        await a.start()
        await b.start()
        a.add_addresses(b.peer_id, b.addresses)
        try:
            with gc_saving_garbage():
                await open_and_close_many(a, b, f"/ip4/127.0.0.1/tcp/{free_port()}")
                while a._links or b._links:  # every socket has gone through connection_lost
                    await asyncio.sleep(0.01)
                assert cyclic_garbage() == []
        finally:
            await a.close()
            await b.close()
    arun(main(), kind=kind)


def test_run_is_freed_without_the_gc_when_its_round_fails_early():
    """A run refused at once (a second run of the same group) holds nothing either."""
    async def main():
        net, transports, services = await swarm(2)
        group = make_group(transports, ["node"] * 2, 1000, gid=b"dup")
        with gc_saving_garbage():
            first = asyncio.ensure_future(services[0].run(group, torch.randn(1000), 1.0, CODEC, timeout=5.0,
                                                          sender_timeout=1.0))
            await asyncio.sleep(0)
            with pytest.raises(AveragingError, match="already running"):
                await services[0].run(group, torch.randn(1000), 1.0, CODEC, timeout=5.0)
            await first  # its partner never came: it averages alone
            assert cyclic_garbage() == []
            assert not any(isinstance(o, AllReduceRun) for o in gc.get_objects())
    run_virtual(main())


@pytest.mark.timeout(60)
def test_matchmaking_formed_or_failed_leaves_no_cyclic_garbage_nor_gatherings():
    """Groups formed, and a gathering that fails (too few peers): nothing stays behind."""
    async def main():
        net, peers = await make_swarm(3)
        makers = [Matchmaker(p.transport, p.dht, RunNames("life").averager("tensors"), "schema", 1000, min_group_size=2) for p in peers]
        with gc_saving_garbage():
            for r in range(ROUNDS):
                formed = await asyncio.gather(*(m.form_group(f"k{r}", 1.0, (1e6, 1e6)) for m in makers))
                assert len({f.group.group_id for f in formed}) == 1
                with pytest.raises(AveragingError, match="min_group_size"):
                    await makers[0].form_group(f"alone{r}", 0.5, (1e6, 1e6))
                del formed
                await asyncio.sleep(1.0)  # virtual time: the last replies are sent
                assert cyclic_garbage() == []
            assert all(not m._gatherings for m in makers)
        for m in makers:
            m.close()
    run_virtual(main())


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["sync", "diloco", "streaming"])
def test_an_optimizers_rounds_and_its_shutdown_leave_no_cyclic_garbage(mode):
    """Three peers train a few epochs: their rounds leave nothing for the GC, and an optimizer
    shut down and dropped is freed at once (its context, averagers, state server and last group
    with it), not when the GC next runs; so is its peer, shut down after it."""
    options = {"sync": dict(average_state_every=1), "diloco": dict(mode="diloco", local_steps=4),
               "streaming": dict(mode="diloco", local_steps=4, fragments=2)}[mode]
    torch.optim.SGD([torch.zeros(1)], 0.1)  # torch's lazy imports on a first optimizer, outside the watch

    async def main():
        network = EmulatedNetwork(latency=0.01, seed=1)
        peers: list[potluck.Peer] = []
        for _ in range(3):
            peers.append(await potluck.Peer.create(peers[0].addresses if peers else [], transport=network.transport(),
                                                   clock=event_loop_clock()))
        models = [torch.nn.Linear(8, 2) for _ in peers]
        optimizers = [Optimizer(peer, "life", model.parameters(), lambda p: torch.optim.SGD(p, 0.1),
                                target_batch_size=64, batch_size_per_step=8, start=False, **options)
                      for peer, model in zip(peers, models, strict=True)]

        async def train(model, opt, epochs: int, seconds: float) -> None:
            while opt.local_epoch < epochs:
                model(torch.randn(8, 8)).square().mean().backward()
                await asyncio.sleep(seconds)
                await opt.astep()
        try:
            with gc_saving_garbage():
                for opt in optimizers:
                    await opt.astart()
                for epochs in (2, 5):  # the first groups form, then the steady rounds
                    await asyncio.gather(*(train(m, o, epochs, 0.02 * (1 + i))
                                           for i, (m, o) in enumerate(zip(models, optimizers, strict=True))))
                    assert cyclic_garbage() == []
                watched = [weakref.ref(o) for o in optimizers] + [weakref.ref(o.context) for o in optimizers]
                for opt in optimizers:
                    opt.shutdown()
                await asyncio.sleep(1.0)  # virtual time: the background tasks end
                del optimizers, opt
                assert [w for w in watched if w() is not None] == []
                assert cyclic_garbage() == []
                while peers:
                    await peers.pop().ashutdown()
                assert cyclic_garbage() == []
        finally:  # (peers left up would keep the shared loop from the next test)
            for peer in peers:
                await peer.ashutdown()
    runner = acquire_runner(virtual_time_loop)  # (a Peer runs on potluck's loop)
    try:
        runner.run(main(), timeout=100)
    finally:
        release_runner()


@pytest.mark.timeout(60)
def test_reducer_and_result_buffers_are_reused_across_rounds_within_the_pool_bound():
    """A long run allocates no new reducer or result memory per round, and keeps at most the
    pool's bound."""
    async def main():
        net, transports, services = await swarm(3)
        pooled = []
        for r in range(ROUNDS):
            group = make_group(transports, ["node"] * 3, 100_000, gid=b"pool%d" % r)
            results = await average(services, group, [torch.randn(100_000) for _ in range(3)], [1.0] * 3)
            for service, result in zip(services, results, strict=True):
                service.pool.give(result)  # as the Averager does once it has copied the result out
            pool = services[0].pool
            pooled.append(sorted(b.data_ptr() for b in pool._free))
            assert 0 < pool._bytes <= pool.max_bytes
        assert pooled[0] == pooled[1] == pooled[2]
    run_virtual(main())


@pytest.mark.timeout(60)
def test_averager_steps_reuse_their_snapshot_and_result_buffers():
    """Steps of an Averager take their flat snapshot and result from the pool and give them back:
    after the first step, no model-sized buffer is allocated (and faulted in) per round."""
    async def main():
        net, peers = await make_swarm(3)
        avgs = [Averager(p, [torch.randn(50_000), torch.randn(7, 7)], "pool", matchmaking_time=0.5) for p in peers]
        pooled = []
        for _ in range(ROUNDS):
            await asyncio.gather(*(a.astep() for a in avgs))
            pooled.append(sorted(b.data_ptr() for b in avgs[0].service.pool._free))
        assert len(pooled[0]) >= 4  # snapshot, result, reduced shard, scratch
        assert pooled[0] == pooled[1] == pooled[2]
        assert all(torch.equal(a._tensors[0], avgs[0]._tensors[0]) for a in avgs)
    run_virtual(main())


def test_buffer_pool_drops_a_buffer_that_requests_outgrew():
    pool = BufferPool()
    small = pool.take(POOL_GRANULE)
    pool.give(small[:10])  # a view goes back as its whole buffer
    assert pool.take(1) is small
    pool.give(small)
    larger = pool.take(2 * POOL_GRANULE)
    assert larger.numel() > 2 * POOL_GRANULE  # grown once: room to grow a little more
    pool.give(larger)
    assert pool._free == [larger] and pool._bytes == larger.numel() * 4


def test_buffer_pool_keeps_the_largest_buffers_within_its_bound():
    pool = BufferPool(max_bytes=3 * POOL_GRANULE * 4)
    buffers = [pool.take(POOL_GRANULE * k) for k in (1, 2, 1, 1)]
    for b in buffers:
        pool.give(b)
    assert pool._bytes <= pool.max_bytes
    assert pool.take(POOL_GRANULE + 1) is buffers[1]  # the smallest that fits
