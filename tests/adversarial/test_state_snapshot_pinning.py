"""A downloader must not keep a donor's stale snapshot, and its only slot, for good.

A donor holds MAX_SNAPSHOTS (1) copies of its state for newcomers; a copy in use by a chunk stream
is kept, and a newcomer that asks while every slot is in use is offered the newest held (a
version behind, perhaps). A downloader that asked a chunk a minute (inside the stream's idle
limit) and opened a fresh stream on the same snapshot before each stream's hour ran out held
version 1 while the donor moved on: newcomers got version 1 three hours later. A snapshot that is
no longer current takes no new stream once STALE_LEASE_SECONDS old."""

from __future__ import annotations

import asyncio

import pytest
import torch

from potluck.averaging.state_transfer import ManifestRequest, StateServer, download_state
from potluck.averaging.state_transfer.messages import MAX_CHUNK_BYTES
from potluck.core.errors import PotluckError
from potluck.core.names import RunNames
from potluck.core.virtual_time import run_virtual
from potluck.net.emulated import EmulatedNetwork

PREFIX = RunNames("pin").averager("tensors")


@pytest.mark.timeout(60)
def test_a_downloader_cannot_keep_a_stale_snapshot_on_offer():
    async def main():
        net = EmulatedNetwork(latency=0.005)
        donor, pinner, newcomer = net.transport(), net.transport(), net.transport()
        for t in (donor, pinner, newcomer):
            await t.start()
        for t in (pinner, newcomer):
            t.add_addresses(donor.peer_id, donor.addresses)
        version = [1]
        state = [torch.randint(0, 255, (8 * MAX_CHUNK_BYTES,), dtype=torch.uint8)]
        server = StateServer(donor, lambda: (version[0], None, state), PREFIX, current_version=lambda: version[0],
                             chunk_bytes=MAX_CHUNK_BYTES)
        manifest = await pinner.call(donor.peer_id, server.manifest_method, ManifestRequest().to_wire(), timeout=10)

        async def trickle() -> None:  # a chunk a minute, inside the stream's idle limit
            try:
                stream = await pinner.open_stream(donor.peer_id, server.chunks_method,
                                                  {"snapshot": manifest["snapshot"]}, timeout=None)
                for i in range(10**6):
                    await stream.send({"i": i % 8})
                    await stream.recv(timeout=30)
                    await asyncio.sleep(55)
            except PotluckError:
                pass
        streams = [asyncio.ensure_future(trickle())]
        got = []
        for _ in range(3):
            version[0] += 1  # the donor's state moves on
            await asyncio.sleep(3000)
            streams.append(asyncio.ensure_future(trickle()))  # a fresh stream before the last one's hour ends
            await asyncio.sleep(600)
            got.append((await download_state(newcomer, [donor.peer_id], PREFIX, timeout=60))[0])
        for task in streams:
            task.cancel()
        await asyncio.gather(*streams, return_exceptions=True)
        server.close()
        assert got[-1] == version[0], f"newcomers got versions {got} while the donor was at {version[0]}"
    run_virtual(main())
