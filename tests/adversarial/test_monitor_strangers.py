"""Made-up ids publishing progress and round records do not grow a monitor's database without end.

The ledger kept a row per peer id ever reported, with its metrics, and every signer's round
records, credited or not: 2,000 new ids a poll grew the file by about 9 MiB a poll, for as long as
the attacker liked. Now only the witnesses' round records are stored (nothing else is credited),
and past MAX_PEERS peers those never credited and seen least recently are forgotten."""

from __future__ import annotations

from pathlib import Path

from potluck.monitor import ledger as ledger_module
from potluck.monitor.ledger import Ledger
from potluck.optim.progress import PeerProgress, RoundRecord

WITNESS, HONEST = "witness", "honest"


def test_made_up_reporters_do_not_grow_the_ledger(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(ledger_module, "MAX_PEERS", 500, raising=False)
    with Ledger(tmp_path / "m.db", "run", witnesses={WITNESS}) as ledger:
        for poll in range(10):
            made_up = [f"made-up-{poll}-{i}" for i in range(200)]
            reports = {p: PeerProgress(p, poll, 0, 1.0, float(poll), metrics=(("loss", 9.9),), metrics_time=float(poll))
                       for p in [*made_up, WITNESS, HONEST]}
            record = RoundRecord(poll, 0, ((WITNESS, 32), (HONEST, 32)), round=f"r{poll}")
            fake = RoundRecord(poll, 0, tuple((p, 10**6) for p in made_up[:8]), round=f"f{poll}")
            ledger.observe(float(poll), reports, {WITNESS: [record], HONEST: [record],
                                                  **{p: [fake] for p in made_up}})
        assert ledger._scalar("SELECT COUNT(*) FROM peers") <= 500
        assert ledger._scalar("SELECT COUNT(*) FROM rounds") == 10  # the witness's only
        assert ledger._scalar("SELECT COUNT(DISTINCT peer_id) FROM metrics") <= 500
        assert ledger.credits() == {WITNESS: 320, HONEST: 320}
        kept = {c.peer_id for c in ledger.contributors()}
        assert {WITNESS, HONEST} <= kept
