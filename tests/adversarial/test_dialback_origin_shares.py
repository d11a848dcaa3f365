"""Issue 29: a public peer's dial-back slots (the reachability check, `nat.dialback`) were 8 in all
and one per caller id. Made-up ids that point their dial-backs at a listener that accepts TCP and
never answers TLS held every slot for 5 s each, so honest peers' checks got no answer (and a lying
server became the only answer: the precondition of the "false private" attack).

Slots are now shared per origin (`net.reachability.MAX_DIALBACKS_PER_SUBNET`), and a dial whose
far end does not answer (TCP and TLS) within `DIALBACK_ANSWER_TIMEOUT` is given up, freeing its
slot. Here one attacking host (127.0.0.1) asks under 1,000 made-up ids, a score at a time, for
dial-backs to its silent listener, while an honest peer on another /24 (127.0.1.1) gets its verdict:
public. Real TCP on the loopback interface: the silent listener is a real one. (The answer bound
on its own, and checks whose first servers are made-up liars: `test_reachability_across_origins`.)"""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from potluck.core.errors import NetworkError
from potluck.net import Identity, TCPTransport
from potluck.net.reachability import DIALBACK, DialbackService, check_reachability
from tests.adversarial.scene import running

MADE_UP_IDS = 1000
WORKERS = 20  # made-up callers asking at once
PAUSE_AFTER_REFUSAL = 0.2  # seconds; the ids last the whole test


@pytest.mark.timeout(120)
def test_made_up_ids_of_one_host_holding_dial_backs_leave_an_honest_peer_its_verdict(arun):
    async def main():
        server = TCPTransport(Identity.generate(), host="127.0.0.1")
        DialbackService(server).start()
        honest = TCPTransport(Identity.generate(), host="127.0.1.1")
        silent: list[asyncio.StreamWriter] = []

        async def never_answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            silent.append(writer)  # accepts TCP, never says a TLS word
            await reader.read()

        hole = await asyncio.start_server(never_answer, "127.0.0.1", 0)
        hole_address = f"/ip4/127.0.0.1/tcp/{hole.sockets[0].getsockname()[1]}"
        ids = iter([Identity.generate() for _ in range(MADE_UP_IDS)])
        asked = {"held": 0, "refused": 0}

        async def attacker() -> None:
            for identity in ids:
                fake = TCPTransport(identity, client_mode=True)
                try:
                    await fake.connect(server.addresses[0], timeout=10)
                    await fake.call(server.peer_id, DIALBACK, {"addrs": [hole_address]}, timeout=15)
                    asked["held"] += 1
                except NetworkError:
                    asked["refused"] += 1
                    await asyncio.sleep(PAUSE_AFTER_REFUSAL)
                finally:
                    await fake.close()

        async with running(server, honest):
            workers = [asyncio.ensure_future(attacker()) for _ in range(WORKERS)]
            try:
                while len(silent) < 2:  # the server is dialing the silent listener: slots are held
                    await asyncio.sleep(0.05)
                await honest.connect(server.addresses[0], timeout=10)
                report = await check_reachability(honest, [server.peer_id])
                assert report.verdict == "public", f"the honest peer got no verdict: {report}"
                assert asked["refused"] > 0  # the attack was on: made-up ids were turned away meanwhile
            finally:
                for worker in workers:
                    worker.cancel()
                await asyncio.gather(*workers, return_exceptions=True)
                hole.close()
                for writer in silent:
                    writer.close()
                with contextlib.suppress(Exception):
                    await hole.wait_closed()

    arun(main(), timeout=110)

