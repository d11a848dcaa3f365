"""Issue 14: one 16 MiB DHT store of nested empty arrays took 18 s of CPU inside the store handler
(16 M Python lists built before any field was checked), freezing the node for everyone. DHT
messages are now decoded within the same budget as frames (`core.serialization.unpackb_bounded`:
about one container per 8 bytes received), so the request is refused when the budget is spent, the
memory it costs is bounded by its size, and an honest call sent right behind it is answered."""

from __future__ import annotations

import asyncio
import struct
import time
import tracemalloc

import msgpack
import pytest
import torch

from potluck.core import serialization
from potluck.dht import DHT, DHTConfig, protocol
from potluck.dht.errors import RecordRejected
from potluck.dht.records import Record
from potluck.dht.validation import DEFAULT_MAX_VALUE_BYTES, MAX_VALUE_TENSORS, Limits, check_record
from potluck.net import Identity, TCPTransport

MiB = 2**20
BODY = 4 * MiB
# What refusing the request may cost in Python allocations: the request's bytes held a few times
# (receive buffer, frame, blob) plus the containers the budget lets it build (512 K empty lists,
# ~32 MiB). The old code built all 4 M lists: ~260 MiB.
MEMORY_BOUND = 96 * MiB
# The honest call's deadline behind the attack: generous for a loaded 2-core machine.
ROUND_TRIP_BOUND = 10.0


def empty_arrays_store() -> bytes:
    """A store request whose record list is 4 M empty arrays (one byte each)."""
    return b"\x81\xa7records\xdd" + BODY.to_bytes(4, "big") + b"\x90" * BODY


@pytest.mark.timeout(120)
def test_a_store_of_empty_arrays_is_refused_within_its_budget_and_the_node_keeps_answering(arun):
    async def main():
        server = TCPTransport(Identity.generate(), host="127.0.0.1")
        honest = TCPTransport(Identity.generate(), host="127.0.0.1")
        attacker = TCPTransport(Identity.generate(), host="127.0.0.1")
        for t in (server, honest, attacker):
            await t.start()
        node = DHT(server, config=DHTConfig(peer_record_ttl=None))
        await node.astart()
        try:
            sid = await honest.connect(server.addresses[0], timeout=10)
            await attacker.connect(server.addresses[0], timeout=10)
            request = empty_arrays_store()
            tracemalloc.start()
            try:
                before, _ = tracemalloc.get_traced_memory()
                tracemalloc.reset_peak()
                attack = asyncio.ensure_future(attacker.call(sid, protocol.STORE, request, timeout=60))
                start = time.monotonic()
                answer = await honest.call(sid, protocol.PING, protocol.PING_REQUEST, timeout=ROUND_TRIP_BOUND)
                round_trip = time.monotonic() - start
                refusal = await asyncio.gather(attack, return_exceptions=True)
                _, peak = tracemalloc.get_traced_memory()
            finally:
                tracemalloc.stop()
            assert peak - before < MEMORY_BOUND, f"the attack cost {(peak - before) / MiB:.0f} MiB"
            assert msgpack.unpackb(answer) == {"ok": True} and round_trip < ROUND_TRIP_BOUND
            assert "arrays and maps" in str(refusal[0]), refusal
            assert len(node.node.storage) == 0
        finally:
            await node.ashutdown()
            for t in (attacker, honest, server):
                await t.close()

    arun(main(), timeout=110)


def many_empty_tensors(n: int = 4500) -> bytes:
    """A potluck-serialized value of `n` empty tensors: about 64 KiB, the most a value may hold."""
    specs = [["bool", [0]] for _ in range(n)]
    body = msgpack.packb([msgpack.ExtType(1, msgpack.packb(i)) for i in range(n)])
    header = msgpack.packb([len(body), specs])
    return b"PLK1" + struct.pack("<I", len(header)) + header + body


@pytest.mark.timeout(60)
def test_a_value_of_thousands_of_empty_tensors_is_refused_before_any_is_built(monkeypatch):
    """Each tensor of a value costs its decoder an allocation (about 1 KB and 20 us even empty):
    256 values of 4,500 empty tensors in one 16 MB store took 12 s of a node's CPU to check, and
    every reader paid as much again. A DHT value may hold MAX_VALUE_TENSORS tensors."""
    built = []
    allocate = serialization.allocate
    monkeypatch.setattr(serialization, "allocate", lambda specs: built.append(len(specs)) or allocate(specs))
    value = many_empty_tensors()
    assert len(value) <= DEFAULT_MAX_VALUE_BYTES
    with pytest.raises(RecordRejected, match="tensors"):
        check_record(Record("key", None, value, 1000.0), Limits(), 900.0, [], skew=0.0)
    assert sum(built) <= MAX_VALUE_TENSORS
    few = serialization.dumps([torch.zeros(3) for _ in range(MAX_VALUE_TENSORS)])
    check_record(Record("key", None, few, 1000.0), Limits(), 900.0, [], skew=0.0)
