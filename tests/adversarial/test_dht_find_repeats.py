"""A find request must not ask for one id many times over.

Each id of a find request draws the records stored under it; one id asked 32 times (the most a
request may ask) drew them 32 times: 726 bytes of request, 30 MB of answer (a reflector, and a
pile of answers held for a caller that does not read them). A lookup asks each id once, so a
request that repeats one is refused."""

from __future__ import annotations

import msgpack
import pytest

from potluck.core.errors import RemoteError
from potluck.core.serialization import dumps
from potluck.dht import DHT, DHTConfig, key_id_of, protocol
from potluck.dht.records import Record
from potluck.net.identity import Identity
from potluck.net.tcp import TCPTransport
from tests.adversarial.scene import running


@pytest.mark.timeout(60)
def test_a_find_asking_one_id_many_times_is_refused(arun):
    async def main():
        server = TCPTransport(Identity.generate(), host="127.0.0.1")
        attacker = TCPTransport(Identity.generate(), host="127.0.0.1")
        async with running(server, attacker):
            dht = await DHT.create(server, initial_peers=[], config=DHTConfig(peer_record_ttl=None))
            try:
                await attacker.connect(server.addresses[0], timeout=10)
                now = dht.get_time()
                records = [Record("big.key", dumps(f"s{i}"), dumps(b"\0" * 60_000), now + 600) for i in range(16)]
                await attacker.call(server.peer_id, protocol.STORE, protocol.write(protocol.StoreRequest(records)),
                                    timeout=30)
                key = key_id_of("big.key")
                once = await attacker.call(server.peer_id, protocol.FIND,
                                           protocol.write(protocol.FindRequest((key,), True, False)), timeout=30)
                assert len(once) > 16 * 60_000  # the records are there, once
                hostile = protocol.FindRequest((key,), True, False).to_wire()
                hostile["ids"] = hostile["ids"] * 32  # (our own FindRequest refuses to be built so)
                with pytest.raises(RemoteError, match="twice"):
                    await attacker.call(server.peer_id, protocol.FIND, msgpack.packb(hostile, use_bin_type=True),
                                        timeout=30)
            finally:
                await dht.ashutdown()
    arun(main(), timeout=50)
