"""One node allowed to send ring data cannot fill a pipeline node's ring mailbox and lock out the
parts of everyone else.

Parts of rounds ahead of the receiver's wait in its mailbox after their calls are over (so the
transport no longer counts them). The mailbox held at most 4,096 parts (`MAX_BUFFERED`), of any
size, first come: one sender's far-round parts of made-up rings (one of them 16 MiB) made the
receiver refuse an honest part of the current round ("ring mailbox is full"). Now the parts and
their bytes (`MAX_BUFFERED_BYTES`) are capped, and when the mailbox is full the sender holding the
most loses its oldest part; that sender itself is refused."""

from __future__ import annotations

import pytest
import torch

from potluck.core.errors import PotluckError
from potluck.core.virtual_time import run_virtual
from potluck.net.emulated import EmulatedNetwork
from potluck.pipeline import ring
from potluck.pipeline.ring import PartKey, RingAllReduce, RingPart


class _Peer:
    def __init__(self, transport):
        self.transport = transport


def _part(round_id: int, members: str, values: int) -> dict:
    return RingPart(PartKey(round_id, 0, 1, 0, members, 0, 0), torch.zeros(values)).to_wire()


@pytest.mark.parametrize("full", ["parts", "bytes"])
def test_a_sender_filling_the_ring_mailbox_loses_its_own_parts_not_others(monkeypatch, full):
    if full == "parts":
        monkeypatch.setattr(ring, "MAX_BUFFERED", 64)
        flood, values = 64, 1
    else:
        monkeypatch.setattr(ring, "MAX_BUFFERED_BYTES", 4 * 2**20, raising=False)
        flood, values = 4, 2**18  # four 1 MiB parts

    async def main():
        net = EmulatedNetwork(latency=0.001)
        victim, attacker, honest = (net.transport(upload=1e9, download=1e9) for _ in range(3))
        for t in (victim, attacker, honest):
            await t.start()
        await attacker.connect(victim.addresses[0], 5)
        await honest.connect(victim.addresses[0], 5)
        mailbox = RingAllReduce(_Peer(victim), "run", "ping")
        for i in range(flood):  # far-round parts of made-up rings, nobody will read them
            await attacker.call(victim.peer_id, mailbox.method, _part(2, f"made-up-{i}", values), timeout=5)
        assert len(mailbox._mailbox) == flood
        with pytest.raises(PotluckError, match="holds the most"):
            await attacker.call(victim.peer_id, mailbox.method, _part(2, "one-more", values), timeout=5)
        await honest.call(victim.peer_id, mailbox.method, _part(0, "a,b", values), timeout=5)
        held = {sender for _, sender in mailbox._mailbox}
        assert str(honest.peer_id) in held and len(mailbox._mailbox) == flood
        with pytest.raises(PotluckError, match="holds the most"):  # the honest part stays
            await attacker.call(victim.peer_id, mailbox.method, _part(2, "again", values), timeout=5)
        assert str(honest.peer_id) in {sender for _, sender in mailbox._mailbox}
        mailbox.finish_round(2)
        assert not mailbox._mailbox and not mailbox._held  # nothing kept once the rounds are over

    run_virtual(main())
