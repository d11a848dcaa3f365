"""The monitor shows a peer of another model as refused (issue 29): never online, never counted in
the swarm, never credited; on the dashboard's API (an emulated swarm as it trains) and in
`potluck status` (real peers over TCP in this process)."""

from __future__ import annotations

import asyncio
import json
import urllib.request

import pytest
import torch

import potluck
from potluck import Peer
from potluck.cli import main
from potluck.core.dht_time import event_loop_clock
from potluck.monitor.follower import FollowedRun, Follower
from potluck.monitor.ledger import Ledger
from potluck.monitor.web import start_web
from potluck.net.emulated import EmulatedNetwork
from potluck.optim import Optimizer
from potluck.optim.progress import ProgressTracker, RoundRecord
from potluck.optim.schema import ModelMismatch
from tests.emulated_swarm import run_on_shared_runner

RUN = "watched"
BATCH, TARGET = 8, 64


def make_model(hidden: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 2))


async def watched_swarm() -> dict:
    """Two peers train together and a third with a wider model joins them; a monitor follows the
    run and serves its dashboard. What the API said while the third was in, and after it stopped."""
    network = EmulatedNetwork(latency=0.01, seed=2)
    peers = []
    for _ in range(4):
        peers.append(await potluck.Peer.create(peers[0].addresses if peers else [], transport=network.transport(),
                                               clock=event_loop_clock()))
    *trainers, monitor = peers
    models = [make_model(h) for h in (8, 8, 16)]
    opts = [Optimizer(p, RUN, m.parameters(), lambda ps: torch.optim.SGD(ps, 0.1), target_batch_size=TARGET,
                      batch_size_per_step=BATCH, load_state=False, start=False) for p, m in zip(trainers, models)]
    ledger = Ledger(":memory:", RUN, history_interval=0.25)
    follower = Follower(monitor, RUN, ledger, poll_interval=0.25)
    following = asyncio.ensure_future(follower.run())
    server = await start_web(FollowedRun(ledger, follower), "127.0.0.1", 0)
    loop = asyncio.get_running_loop()
    stopped: list[str] = []

    async def train(i: int, seconds: float) -> None:
        generator = torch.Generator().manual_seed(i)
        end = loop.time() + seconds
        try:
            while loop.time() < end:
                x = torch.randn(BATCH, 4, generator=generator)
                torch.nn.functional.cross_entropy(models[i](x), (x[:, 0] > 0).long()).backward()
                await asyncio.sleep(0.02)
                await opts[i].astep()
        except ModelMismatch as e:
            stopped.append(str(e))

    def read() -> dict:
        def get(path: str) -> object:
            with urllib.request.urlopen(server.url + "api/" + path, timeout=10) as response:
                return json.loads(response.read())
        return {"swarm": get("swarm"), "peers": get("peers"), "contributors": get("contributors")}

    try:
        for opt in opts:
            await opt.astart()
        honest = asyncio.gather(train(0, 6.0), train(1, 6.0))
        await asyncio.sleep(0.5)  # the honest pair has met; the wrong peer joins a run under way
        await train(2, 3.0)
        reads = [await loop.run_in_executor(None, read)]
        await honest
        await asyncio.sleep(1.0)  # every record of the wrong peer has expired by now
        reads.append(await loop.run_in_executor(None, read))
        return {"reads": reads, "stopped": stopped, "ids": [p.peer_id for p in trainers]}
    finally:
        await server.close()
        following.cancel()
        await asyncio.gather(following, return_exceptions=True)
        follower.close()
        ledger.close()
        for opt in opts:
            opt.shutdown()
        for peer in peers:
            await peer.ashutdown()


@pytest.mark.timeout(60)
def test_the_dashboard_shows_a_peer_of_another_model_as_refused_and_never_counts_it():
    """Before, the wrong peer was counted online (with 0 samples) for as long as it ran, and nothing
    said why it did not train. Now its row says it is refused and why, during its run and after it
    stopped, and it is neither online nor in the swarm's count nor a contributor."""
    result = run_on_shared_runner(watched_swarm(), timeout=60)
    *honest, wrong = result["ids"]
    assert len(result["stopped"]) == 1  # the wrong peer was told
    for read in result["reads"]:
        rows = {p["peer_id"]: p for p in read["peers"]}
        assert rows[wrong]["refused"] and "model or settings differ" in rows[wrong]["refused"]
        assert not rows[wrong]["online"]
        assert all(rows[p]["refused"] is None for p in honest)
        assert wrong not in {c["peer_id"] for c in read["contributors"]}
    assert result["reads"][0]["swarm"]["peers_online"] == 2
    assert {p["peer_id"] for p in result["reads"][0]["peers"] if p["online"]} == set(honest)


async def _tracker(peer: Peer, fingerprint: str) -> ProgressTracker:
    return ProgressTracker(peer.dht, peer.transport, RUN, peer.peer_id, 256, fingerprint=fingerprint)


async def _publish(tracker: ProgressTracker, partners: list[str]) -> None:
    """Report as a trainer does, with a round completed with `partners` (none: no round), until cancelled."""
    if partners:
        await tracker.record_round(RoundRecord(3, 0, tuple((p, 32) for p in sorted(partners)), round="r3"))
    while True:
        await tracker.report(3, 16, 100.0, 3)
        await asyncio.sleep(0.2)


def test_status_lists_a_peer_of_another_model_as_refused_not_online(capsys: pytest.CaptureFixture[str]) -> None:
    """`potluck status`: two peers of one schema completed a round together; a third publishes
    progress under another. It is not counted online, and is listed as refused, with the reason."""
    peers = [Peer(host="127.0.0.1")]
    peers += [Peer([str(peers[0].addresses[0])], host="127.0.0.1") for _ in range(2)]
    ids = [p.peer_id for p in peers]
    fingerprints = ["a" * 32, "a" * 32, "b" * 32]
    trackers = [p.run(_tracker(p, f)) for p, f in zip(peers, fingerprints, strict=True)]
    publishing = [asyncio.run_coroutine_threadsafe(_publish(t, ids[:2] if i < 2 else []), p._runner.loop)
                  for i, (p, t) in enumerate(zip(peers, trackers, strict=True))]
    try:
        assert main(["status", "--run-id", RUN, "--initial-peers", str(peers[0].addresses[0])]) == 0
    finally:
        for future in publishing:
            future.cancel()
        for peer in reversed(peers):
            peer.shutdown()
    out = capsys.readouterr().out
    assert f"run '{RUN}': 2 peer(s) online" in out, out
    refused = [line for line in out.splitlines() if line.startswith("refused: ")]
    assert len(refused) == 1 and ids[2] in refused[0] and "model or settings differ" in refused[0], out
    assert not any(line.startswith(ids[2]) for line in out.splitlines())
