"""`Transport.watch_disconnects`: who hears that a peer is gone, and when (emulated network)."""

from __future__ import annotations

from potluck.core.virtual_time import run_virtual
from potluck.net.emulated import EmulatedNetwork


async def _pair(client_mode: bool = False):
    net = EmulatedNetwork(latency=0.001)
    server, other = net.transport(), net.transport(client_mode=client_mode)
    await server.start()
    await other.start()
    lost: list = []
    server.watch_disconnects(lost.append)
    await other.connect(server.addresses[0])
    return net, server, other, lost


def test_a_crashed_peer_is_reported_once_its_last_connection_is_lost():
    async def main():
        net, server, client, lost = await _pair(client_mode=True)
        net.crash(client.peer_id)
        assert lost == [client.peer_id]
    run_virtual(main())


def test_closing_a_connection_ourselves_is_not_a_disconnect():
    async def main():
        net, server, client, lost = await _pair()
        await server.close()
        assert lost == []
    run_virtual(main())


def test_a_watcher_removed_hears_nothing():
    async def main():
        net, server, client, lost = await _pair(client_mode=True)
        server.unwatch_disconnects(lost.append)
        net.crash(client.peer_id)
        assert lost == []
    run_virtual(main())
