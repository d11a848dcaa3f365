"""Made-up ids named far once each must not pile up in a reducer's list of suspects.

A member named blatantly not honest in a step is left out of that step and stays a suspect
until a later step of its clears it. An id that never sends again was never cleared: a group of
made-up ids, each sending one far piece and leaving, grew `SuspicionLedger.suspects` without
end (its neighbour, the record of far namings, was already capped). Suspects are now capped as
well, the oldest forgotten first."""

from __future__ import annotations

import pytest
import torch

from potluck.averaging.accountability import BanList
from potluck.averaging.suspicion import MAX_REMEMBERED, SuspicionLedger


@pytest.mark.timeout(30)
def test_made_up_ids_named_far_once_each_leave_a_bounded_list_of_suspects():
    ledger = SuspicionLedger(BanList())
    honest = ["honest0", "honest1", "honest2"]
    for step in range(3 * MAX_REMEMBERED // 2):
        liar = f"made-up-{step}"  # a new id every step, named far in its only step
        ledger.record(0, [*honest, liar], [torch.zeros(512)] * 4, named_far=[liar])
        assert liar in ledger.left_out([*honest, liar])  # it is still left out of its step
    assert len(ledger.suspects) <= MAX_REMEMBERED
    assert not ledger.left_out(honest) and len(ledger.excluded) == 0
