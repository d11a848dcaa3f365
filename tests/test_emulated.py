"""The emulated network and the virtual clock: round trips, the timing model, failures, cleanup."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Coroutine
from typing import Any

import pytest
import torch

from potluck.core import compat
from potluck.core.errors import (
    ConnectionLost,
    DeadlineExceeded,
    HandshakeError,
    MessageTooLarge,
    PeerUnreachable,
)
from potluck.core.runner import LoopRunner
from potluck.core.virtual_time import run_virtual, virtual_time_loop
from potluck.net.emulated import EmulatedNetwork, EmulatedTransport

MiB = 2**20
# Virtual timings repeat exactly; they exceed the model's only by the frames' headers (a few
# hundred bytes in all, microseconds at these bandwidths).
HEADERS = 1e-4


def vrun(coro: Coroutine[Any, Any, Any]) -> Any:
    return run_virtual(coro)


async def started(net: EmulatedNetwork, n: int, **kwargs: Any) -> list[EmulatedTransport]:
    peers = [net.transport(**kwargs) for _ in range(n)]
    for peer in peers:
        await peer.start()
        peer.add_handler("echo", _echo)
    return peers


async def _echo(request: Any, ctx: Any) -> Any:
    return request


def introduce(a: EmulatedTransport, b: EmulatedTransport) -> None:
    a.add_addresses(b.peer_id, b.addresses)


async def close_all(*peers: EmulatedTransport) -> None:
    for peer in peers:
        await peer.close()


# -- the virtual clock ---------------------------------------------------------------------------
@pytest.mark.timeout(10)
def test_virtual_sleep_takes_no_wall_time() -> None:
    async def main() -> float:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        await asyncio.sleep(3600)
        return loop.time() - t0

    assert vrun(main()) == pytest.approx(3600)  # a real hour would run into the test's timeout


@pytest.mark.timeout(10)
def test_clock_stands_still_while_executor_work_runs() -> None:
    async def main() -> float:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        job = loop.run_in_executor(None, time.sleep, 0.2)
        # If the clock jumped (or ran at real speed) during the 0.2 s job, this would time out.
        await asyncio.wait_for(job, timeout=0.1)
        return loop.time() - t0

    assert vrun(main()) < 0.1


@pytest.mark.timeout(10)
@pytest.mark.parametrize("work_seconds", [0.0, 0.02])
def test_executor_results_come_back_once_the_instant_is_done(work_seconds: float) -> None:
    # Handed back as soon as the thread finished, a result landed among the callbacks of its
    # instant wherever the host's threads put it, and a scenario's events came in another order
    # from run to run. Now it comes after them, however long the job took.
    async def main() -> list[str]:
        loop, events = asyncio.get_running_loop(), []

        async def chatter() -> None:
            for _ in range(200):
                events.append("tick")
                await asyncio.sleep(0)

        async def job() -> None:
            await loop.run_in_executor(None, time.sleep, work_seconds)
            events.append(f"job at {loop.time()}")
        await asyncio.gather(job(), chatter())
        return events

    assert vrun(main()) == ["tick"] * 200 + ["job at 0.0"]


@pytest.mark.timeout(10)
def test_virtual_loop_in_a_runner_wakes_for_other_threads() -> None:
    runner = LoopRunner(loop_factory=virtual_time_loop, name="virtual-test-loop")
    try:
        before = runner.loop.time()
        runner.run(asyncio.sleep(60), timeout=5)  # submitted from this thread while idle
        assert runner.loop.time() - before == pytest.approx(60)
    finally:
        runner.shutdown()


# -- round trips ---------------------------------------------------------------------------------
@pytest.mark.timeout(30)
@pytest.mark.parametrize("clock", ["virtual", "real"])
def test_unary_and_stream_round_trip_byte_exact(clock: str, arun: Any) -> None:
    async def main() -> None:
        net = EmulatedNetwork(latency=0.001)
        a, b = await started(net, 2, upload=50e6, download=50e6)

        async def double(stream: Any, ctx: Any) -> None:
            async for message in stream:
                await stream.send({"echo": message, "twice": message["t"] * 2})

        b.add_stream_handler("double", double)
        introduce(a, b)
        payload = {"t": torch.randn(3, 1000), "raw": bytes(range(256)) * 10, "n": [1, 2.5, "x"]}
        reply = await a.call(b.peer_id, "echo", payload)
        assert torch.equal(reply["t"], payload["t"]) and reply["t"].dtype == torch.float32
        assert reply["raw"] == payload["raw"] and reply["n"] == payload["n"]

        sent = [{"t": torch.arange(i * 100, dtype=torch.int64)} for i in range(1, 6)]
        async with await a.open_stream(b.peer_id, "double") as stream:
            for message in sent:
                await stream.send(message)
            await stream.close()
            replies = [m async for m in stream]
        assert len(replies) == len(sent)
        for message, reply in zip(sent, replies, strict=True):
            assert torch.equal(reply["echo"]["t"], message["t"])
            assert torch.equal(reply["twice"], message["t"] * 2)
        await close_all(a, b)

    vrun(main()) if clock == "virtual" else arun(main())


@pytest.mark.timeout(10)
def test_receiver_gets_fresh_tensors_not_the_senders() -> None:
    async def main() -> None:
        net = EmulatedNetwork()
        a, b = await started(net, 2)
        received: list[torch.Tensor] = []

        async def keep(request: torch.Tensor, ctx: Any) -> None:
            received.append(request)

        b.add_handler("keep", keep)
        introduce(a, b)
        tensor = torch.ones(100)
        await a.call(b.peer_id, "keep", tensor)
        tensor.zero_()
        assert received[0] is not tensor and torch.equal(received[0], torch.ones(100))
        await close_all(a, b)

    vrun(main())


# -- the timing model ----------------------------------------------------------------------------
async def _one_way_times(chunked: bool) -> tuple[float, float]:
    """Seconds from sending 64 MiB (one message or 4 MiB chunks) to its arrival, and the model."""
    net = EmulatedNetwork(latency=0.02)
    a = net.transport(upload=100e6)
    b = net.transport(download=200e6, max_frame_size=65 * MiB)
    await a.start()
    await b.start()
    loop = asyncio.get_running_loop()
    arrived = loop.create_future()

    async def sink(request: Any, ctx: Any) -> None:
        arrived.set_result(loop.time())

    async def sink_stream(stream: Any, ctx: Any) -> None:
        async for _ in stream:
            pass
        arrived.set_result(loop.time())

    b.add_handler("sink", sink)
    b.add_stream_handler("sink", sink_stream)
    introduce(a, b)
    await a.connect(b.addresses[0])
    if chunked:
        chunk = torch.zeros(4 * MiB, dtype=torch.uint8)
        stream = await a.open_stream(b.peer_id, "sink")
        t0 = loop.time()
        for _ in range(16):
            await stream.send(chunk)
        await stream.close()
    else:
        t0 = loop.time()
        await a.call(b.peer_id, "sink", torch.zeros(64 * MiB, dtype=torch.uint8), timeout=60)
    elapsed = await arrived - t0
    await close_all(a, b)
    return elapsed, 64 * MiB / 100e6 + 0.02


@pytest.mark.timeout(60)
@pytest.mark.parametrize("chunked", [False, True], ids=["one-message", "4MiB-chunks"])
def test_transfer_takes_size_over_bandwidth_plus_latency(chunked: bool) -> None:
    elapsed, expected = vrun(_one_way_times(chunked))
    assert expected <= elapsed <= expected + HEADERS


async def _timed_call(a: Any, b: Any, payload: torch.Tensor) -> float:
    """Seconds from sending `payload` in one call from `a` until `b`'s handler has it
    (the connection is set up first, so only the transfer is timed)."""
    await a.start()
    await b.start()
    loop = asyncio.get_running_loop()
    arrivals: list[float] = []

    async def sink(request: Any, ctx: Any) -> None:
        arrivals.append(loop.time())

    b.add_handler("sink", sink)
    introduce(a, b)
    await a.call(b.peer_id, "sink", b"warm-up")
    t0 = loop.time()
    await a.call(b.peer_id, "sink", payload, timeout=60)
    await close_all(a, b)
    return arrivals[-1] - t0


@pytest.mark.timeout(30)
def test_transfer_timing_holds_on_the_real_clock(arun: Any) -> None:
    """On an ordinary loop the network waits for real: a frame never arrives before the model
    says. How little it overshoots depends on the host's load; benchmarks/transport.py measures it."""
    net = EmulatedNetwork(latency=0.02)
    elapsed = arun(_timed_call(net.transport(upload=80e6), net.transport(), torch.zeros(8 * MiB, dtype=torch.uint8)))
    assert elapsed >= 8 * MiB / 80e6 + 0.02 - 1e-6  # a timer fires at most 1 ns (the clock tick) early


@pytest.mark.timeout(30)
def test_slow_receiver_download_is_the_bottleneck() -> None:
    """A fast sender into a slow receiver: the receiver's download, not the upload, sets the time."""
    net = EmulatedNetwork(latency=0.02)
    sender, receiver = net.transport(upload=200e6), net.transport(download=40e6, max_frame_size=17 * MiB)
    elapsed = vrun(_timed_call(sender, receiver, torch.zeros(16 * MiB, dtype=torch.uint8)))
    expected = 16 * MiB / 40e6 + 0.02
    assert expected <= elapsed <= expected + HEADERS


@pytest.mark.timeout(30)
def test_per_link_latency_is_honoured() -> None:
    """set_latency changes one link only; the others keep the network's default latency."""
    async def main() -> dict[str, tuple[float, float]]:
        net = EmulatedNetwork(latency=0.01)
        a, b, c = (net.transport(upload=100e6) for _ in range(3))
        for peer in (a, b, c):
            await peer.start()
        net.set_latency(a.peer_id, b.peer_id, 0.25)
        loop = asyncio.get_running_loop()
        times: dict[str, tuple[float, float]] = {}
        payload = torch.zeros(4 * MiB, dtype=torch.uint8)
        for name, dst in (("far", b), ("near", c)):
            arrivals: list[float] = []

            async def sink(request: Any, ctx: Any, arrivals: list[float] = arrivals) -> None:
                arrivals.append(loop.time())

            dst.add_handler("sink", sink)
            t0 = loop.time()
            await a.connect(dst.addresses[0])
            dial = loop.time() - t0
            t0 = loop.time()
            await a.call(dst.peer_id, "sink", payload, timeout=60)
            times[name] = (dial, arrivals[-1] - t0)
        await close_all(a, b, c)
        return times

    times = vrun(main())
    transfer = 4 * MiB / 100e6
    for name, latency in (("far", 0.25), ("near", 0.01)):
        dial, one_way = times[name]
        assert dial == pytest.approx(2 * latency), name
        assert transfer + latency <= one_way <= transfer + latency + HEADERS, name


@pytest.mark.timeout(30)
def test_dial_costs_a_round_trip_and_carries_the_handshake() -> None:
    async def main() -> None:
        net = EmulatedNetwork(latency=0.03)
        a = net.transport(max_frame_size=1 * MiB)
        b, c = net.transport(), net.transport()
        for peer in (a, b, c):
            await peer.start()
        loop = asyncio.get_running_loop()

        async def info(request: Any, ctx: Any) -> Any:
            r = ctx.remote
            return [[str(x) for x in r.addresses], r.client_mode, r.max_frame_size, r.bulk]

        async def info_stream(stream: Any, ctx: Any) -> None:
            await stream.send(ctx.remote.bulk)

        b.add_handler("info", info)
        b.add_stream_handler("info", info_stream)
        t0 = loop.time()
        assert await a.connect(b.addresses[0]) == b.peer_id
        assert loop.time() - t0 == pytest.approx(2 * 0.03)
        assert await a.call(b.peer_id, "info") == [[str(a.addresses[0])], False, 1 * MiB, False]
        async with await a.open_stream(b.peer_id, "info") as stream:
            assert await stream.recv() is True  # a dedicated (bulk) connection
        impostor = b.addresses[0].with_peer_id(c.peer_id)
        with pytest.raises(HandshakeError):
            await a.connect(impostor)
        await close_all(a, b, c)

    vrun(main())


@pytest.mark.timeout(10)
def test_oversized_frame_is_refused_and_the_connection_survives() -> None:
    async def main() -> None:
        net = EmulatedNetwork(latency=0.01)
        a = net.transport()
        b = net.transport(max_frame_size=1 * MiB)
        for peer in (a, b):
            await peer.start()
            peer.add_handler("echo", _echo)
        introduce(a, b)
        with pytest.raises(MessageTooLarge):
            await a.call(b.peer_id, "echo", torch.zeros(2 * MiB, dtype=torch.uint8))
        assert await a.call(b.peer_id, "echo", 5) == 5
        await close_all(a, b)

    vrun(main())


# -- scale and determinism -----------------------------------------------------------------------
@pytest.mark.timeout(60)
def test_200_peers_call_5_random_others_in_virtual_time() -> None:
    latency, n_peers, fanout = 0.05, 200, 5

    async def main() -> float:
        net = EmulatedNetwork(latency=latency, seed=7)
        peers = [net.transport(upload=1e6, download=1e6) for _ in range(n_peers)]
        for peer in peers:
            await peer.start()
            peer.add_handler("square", _square_from(peer))
        rng = random.Random(7)
        loop = asyncio.get_running_loop()
        t0 = loop.time()

        async def call(caller: EmulatedTransport, callee: EmulatedTransport, x: int) -> None:
            introduce(caller, callee)
            reply = await caller.call(callee.peer_id, "square", {"x": x, "pad": bytes(1000)})
            assert reply == {"by": str(callee.peer_id), "sq": x * x}

        async with compat.TaskGroup() as group:
            for caller in peers:
                for callee in rng.sample([p for p in peers if p is not caller], fanout):
                    group.create_task(call(caller, callee, rng.randrange(10**6)))
        elapsed = loop.time() - t0
        await close_all(*peers)
        return elapsed

    elapsed = vrun(main())
    assert 4 * latency <= elapsed < 60.0  # a dial round trip plus a call round trip, at least


def _square_from(peer: EmulatedTransport) -> Any:
    async def square(request: dict, ctx: Any) -> dict:
        return {"by": str(peer.peer_id), "sq": request["x"] ** 2}
    return square


async def _mixed_scenario(seed: int) -> list[tuple[str, str, float]]:
    """Peers with mixed bandwidths trade calls and streams; returns completions in order."""
    net = EmulatedNetwork(latency=0.01, seed=seed)
    rng = random.Random(seed)
    peers = [net.transport(upload=rng.choice([1e6, 5e6, None]), download=rng.choice([2e6, None]))
             for _ in range(8)]
    for peer in peers:
        await peer.start()
        peer.add_handler("echo", _echo)
        peer.add_stream_handler("drain", _drain)
    net.set_latency(peers[0].peer_id, peers[1].peer_id, 0.2)
    loop = asyncio.get_running_loop()
    done: list[tuple[str, str, float]] = []

    async def exchange(a: EmulatedTransport, b: EmulatedTransport, size: int, stream: bool) -> None:
        introduce(a, b)
        if stream:
            async with await a.open_stream(b.peer_id, "drain") as s:
                for _ in range(3):
                    await s.send(torch.zeros(size, dtype=torch.uint8))
        else:
            await a.call(b.peer_id, "echo", torch.zeros(size, dtype=torch.uint8))
        done.append((str(a.peer_id), str(b.peer_id), loop.time()))

    async with compat.TaskGroup() as group:
        for a in peers:
            for b in rng.sample([p for p in peers if p is not a], 3):
                group.create_task(exchange(a, b, rng.randrange(1, 200_000), rng.random() < 0.3))
    await close_all(*peers)
    return done


async def _drain(stream: Any, ctx: Any) -> None:
    async for _ in stream:
        pass


@pytest.mark.timeout(60)
def test_same_scenario_gives_identical_virtual_times() -> None:
    first, second = vrun(_mixed_scenario(3)), vrun(_mixed_scenario(3))
    assert first == second
    assert len({t for _, _, t in first}) > 1  # the scenario really has distinct timings


# -- failures ------------------------------------------------------------------------------------
@pytest.mark.timeout(30)
def test_loud_crash_fails_calls_and_streams_at_once_and_refuses_dials() -> None:
    async def main() -> None:
        net = EmulatedNetwork(latency=0.01)
        a, b = await started(net, 2)
        handling = asyncio.Event()

        async def hang(request: Any, ctx: Any) -> None:
            handling.set()
            await asyncio.Event().wait()

        async def hold(stream: Any, ctx: Any) -> None:
            await stream.send(await stream.recv())
            await asyncio.Event().wait()

        b.add_handler("hang", hang)
        b.add_stream_handler("hold", hold)
        introduce(a, b)
        address = b.addresses[0]
        loop = asyncio.get_running_loop()
        call = asyncio.create_task(a.call(b.peer_id, "hang", timeout=60))
        stream = await a.open_stream(b.peer_id, "hold", timeout=60)
        await stream.send("ping")
        assert await stream.recv() == "ping"
        await handling.wait()

        t0 = loop.time()
        net.crash(b.peer_id)
        with pytest.raises(ConnectionLost):
            await call
        with pytest.raises(ConnectionLost):
            await stream.recv()
        assert loop.time() == t0  # at once, not after a deadline
        with pytest.raises(PeerUnreachable):
            await a.connect(address)
        with pytest.raises(PeerUnreachable):
            await a.call(b.peer_id, "echo", 1, timeout=5)
        assert loop.time() == t0
        await close_all(a, b)

    vrun(main())


@pytest.mark.timeout(30)
def test_silent_crash_surfaces_only_at_the_deadline_or_keepalive() -> None:
    async def main() -> None:
        net = EmulatedNetwork(latency=0.01)
        a, b = await started(net, 2)
        (watcher,) = await started(net, 1, keepalive_interval=1.0, keepalive_timeout=3.0)
        for peer in (a, watcher):
            introduce(peer, b)
            assert await peer.call(b.peer_id, "echo", 1) == 1
        address = b.addresses[0]
        loop = asyncio.get_running_loop()

        net.crash(b.peer_id, silent=True)
        t0 = loop.time()
        with pytest.raises(ConnectionLost, match="keepalive"):
            await watcher.call(b.peer_id, "echo", 3, timeout=60)
        # 3 s of silence, noticed at the keepalive's next 1 s tick: long before the deadline
        assert 3.0 <= loop.time() - t0 <= 3.0 + 1.0

        t0 = loop.time()
        with pytest.raises(DeadlineExceeded):
            await a.call(b.peer_id, "echo", 2, timeout=5)
        assert loop.time() - t0 == pytest.approx(5)
        assert a.is_connected(b.peer_id)  # nothing was signalled

        t0 = loop.time()
        with pytest.raises(PeerUnreachable):
            await a.connect(address, timeout=3)
        assert loop.time() - t0 == pytest.approx(3)

        await close_all(a, b, watcher)

    vrun(main())


@pytest.mark.timeout(30)
def test_partition_times_out_calls_and_dials_until_healed() -> None:
    async def main() -> None:
        net = EmulatedNetwork(latency=0.01)
        a, b, c, d = await started(net, 4)
        for peer in (b, c, d):
            introduce(a, peer)
        assert await a.call(b.peer_id, "echo", 0) == 0
        loop = asyncio.get_running_loop()

        net.partition([a.peer_id], [b.peer_id, d.peer_id])
        t0 = loop.time()
        with pytest.raises(DeadlineExceeded):
            await a.call(b.peer_id, "echo", 1, timeout=4)
        assert loop.time() - t0 == pytest.approx(4)
        t0 = loop.time()
        with pytest.raises(PeerUnreachable):
            await a.connect(d.addresses[0], timeout=2)
        assert loop.time() - t0 == pytest.approx(2)
        assert await a.call(c.peer_id, "echo", 2) == 2  # outside the partition

        net.heal()
        assert await a.call(b.peer_id, "echo", 3) == 3
        assert await a.call(d.peer_id, "echo", 4) == 4
        await close_all(a, b, c, d)

    vrun(main())


# -- client mode and teardown --------------------------------------------------------------------
@pytest.mark.timeout(10)
def test_client_mode_peer_is_reachable_only_over_its_own_connections() -> None:
    async def main() -> None:
        net = EmulatedNetwork(latency=0.01)
        (node,) = await started(net, 1)
        (client,) = await started(net, 1, client_mode=True)
        assert client.addresses == []
        with pytest.raises(PeerUnreachable):
            await node.call(client.peer_id, "echo", 1, timeout=1)
        seen = []

        async def hello(request: Any, ctx: Any) -> str:
            seen.append(ctx.remote.client_mode)
            return "hi"

        node.add_handler("hello", hello)
        introduce(client, node)
        assert await client.call(node.peer_id, "hello") == "hi"
        assert seen == [True]
        assert await node.call(client.peer_id, "echo", 7) == 7  # back over the client's link
        await close_all(node, client)

    vrun(main())


@pytest.mark.timeout(10)
def test_orderly_close_reaches_the_other_side_one_latency_later() -> None:
    async def main() -> None:
        net = EmulatedNetwork(latency=0.05)
        a, b = await started(net, 2)
        loop = asyncio.get_running_loop()
        ended = loop.create_future()

        async def echo_stream(stream: Any, ctx: Any) -> None:
            try:
                async for message in stream:
                    await stream.send(message)
            finally:
                ended.set_result(loop.time())

        b.add_stream_handler("echo", echo_stream)
        introduce(a, b)
        stream = await a.open_stream(b.peer_id, "echo")
        await stream.send("hello")
        assert await stream.recv() == "hello"  # the handler is running
        t0 = loop.time()
        stream.connection.close("done here")
        with pytest.raises(ConnectionLost):
            await stream.recv()
        assert loop.time() == t0  # this side knows at once
        assert await ended == pytest.approx(t0 + 0.05)  # the other side one latency later
        await close_all(a, b)

    vrun(main())


@pytest.mark.timeout(10)
def test_transport_close_leaves_no_pending_tasks() -> None:
    async def main() -> None:
        net = EmulatedNetwork(latency=0.01)
        a, b = await started(net, 2, keepalive_interval=1.0)

        async def hang(request: Any, ctx: Any) -> None:
            await asyncio.Event().wait()

        async def hold(stream: Any, ctx: Any) -> None:
            await asyncio.Event().wait()

        b.add_handler("hang", hang)
        b.add_stream_handler("hold", hold)
        introduce(a, b)
        await a.call(b.peer_id, "echo", 1)
        call = asyncio.create_task(a.call(b.peer_id, "hang", timeout=60))
        stream = await a.open_stream(b.peer_id, "hold")
        await stream.send("x")
        await close_all(a, b)
        with pytest.raises(ConnectionLost):
            await call
        me = asyncio.current_task()
        others = [t for t in asyncio.all_tasks() if t is not me]
        if others:
            _, pending = await asyncio.wait(others, timeout=0.5)
            assert not pending, pending

    vrun(main())


@pytest.mark.timeout(10)
def test_calls_to_self_take_no_virtual_time_and_end_with_a_crash() -> None:
    async def main() -> None:
        net = EmulatedNetwork(latency=0.05)
        (a,) = await started(net, 1, upload=MiB, download=MiB)
        held = asyncio.Event()

        async def hold(stream: Any, ctx: Any) -> None:
            held.set()
            await asyncio.Event().wait()

        a.add_stream_handler("hold", hold)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        payload = torch.randn(MiB)  # 4 MiB: four seconds of this peer's upload, were it sent
        assert await a.call(a.peer_id, "echo", payload, timeout=5) is payload
        assert loop.time() == t0  # neither bandwidth nor latency: it never leaves the peer
        stream = await a.open_stream(a.peer_id, "hold", timeout=60)
        await held.wait()
        net.crash(a.peer_id)
        with pytest.raises(ConnectionLost):
            await stream.recv(timeout=5)
        with pytest.raises(PeerUnreachable, match="crashed"):
            await a.call(a.peer_id, "echo", 1, timeout=5)
        await a.close()

    vrun(main())


def test_a_stream_read_to_its_end_after_both_sides_closed_is_forgotten_by_its_connection() -> None:
    """The other side sends its last message and END before we read it (an all-reduce part's final
    result): once we read that message, the connection must drop the stream, or every part stream
    of a long run stays on the connection."""
    async def main() -> None:
        net = EmulatedNetwork(latency=0.01)
        a, b = await started(net, 2)

        async def reply(stream: Any, ctx: Any) -> None:
            await stream.send("final")  # and END when the handler returns

        b.add_stream_handler("reply", reply)
        introduce(a, b)
        for _ in range(5):
            stream = await a.open_stream(b.peer_id, "reply", timeout=60)
            await stream.close()
            await asyncio.sleep(1.0)  # "final" and END have both arrived, unread
            assert await stream.recv() == "final"
        (conn,) = [c for c in a.open_connections() if c.peer_id == b.peer_id]
        assert conn._streams == {}
        await close_all(a, b)

    vrun(main())
