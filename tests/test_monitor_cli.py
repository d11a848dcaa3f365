"""`potluck status` and `potluck contributors` through the CLI (issue 18).

`status` joins two real peers (TCP, in this process) that publish progress as trainers do;
`contributors --csv` reads a ledger written from hand-made round records.
"""

from __future__ import annotations

import asyncio
import csv
import io
from pathlib import Path

import pytest

from potluck import Peer
from potluck.cli import main
from potluck.monitor.ledger import Ledger
from potluck.optim.progress import ProgressTracker, RoundRecord

RUN = "cli-run"


def test_status_prints_the_swarm_now_and_each_peer(capsys: pytest.CaptureFixture[str]) -> None:
    peers = [Peer(host="127.0.0.1")]
    peers.append(Peer([str(peers[0].addresses[0])], host="127.0.0.1"))
    trackers = [p.run(_tracker(p)) for p in peers]
    publishing = [asyncio.run_coroutine_threadsafe(_publish(t, epoch=7, samples=40 + 10 * i, sps=100.0 * (i + 1)),
                                                   p._runner.loop) for i, (p, t) in enumerate(zip(peers, trackers,
                                                                                                  strict=True))]
    try:
        assert main(["status", "--run-id", RUN, "--initial-peers", str(peers[0].addresses[0])]) == 0
    finally:
        for future in publishing:
            future.cancel()
        for peer in reversed(peers):
            peer.shutdown()
    out = capsys.readouterr().out
    # Both wait in a round: no ETA until they compute again, and the swarm's speed is what its
    # progress did between the two reads (nothing), not the 300 samples/s they say they compute.
    assert f"run '{RUN}': 2 peer(s) online, 0.0 samples/s, epoch 7, 90/256 samples\n" in out, out
    for i, peer in enumerate(peers):
        row = next(line for line in out.splitlines() if line.startswith(peer.peer_id))
        assert row.split()[1:] == ["-", "7", f"{100.0 * (i + 1):.1f}", "node"], row


async def _tracker(peer: Peer) -> ProgressTracker:
    return ProgressTracker(peer.dht, peer.transport, RUN, peer.peer_id, 256)


async def _publish(tracker: ProgressTracker, epoch: int, samples: int, sps: float) -> None:
    """Report as a trainer waiting in a round does (samples frozen: no extrapolation), until cancelled."""
    while True:
        await tracker.report(epoch, samples, sps, epoch, averaging=True)
        await asyncio.sleep(0.2)


def test_contributors_csv_lists_the_credit_of_a_monitors_database(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    db = tmp_path / "monitor.db"
    group = (("a", 60), ("b", 30), ("c", 10))
    with Ledger(db, RUN) as ledger:  # every member of one round records it alike
        ledger.observe(1.0, {}, {p: [RoundRecord(0, 0, group)] for p, _ in group})
    assert main(["contributors", "--db", str(db), "--csv"]) == 0
    rows = list(csv.DictReader(io.StringIO(capsys.readouterr().out)))
    assert [(r["peer_id"], int(r["samples"]), float(r["share"]), int(r["epochs"])) for r in rows] == \
        [("a", 60, 0.6, 1), ("b", 30, 0.3, 1), ("c", 10, 0.1, 1)]
    assert main(["contributors", "--db", str(tmp_path / "missing.db")]) == 1
    assert "no database at" in capsys.readouterr().err
