"""The monitor's web server (`potluck.monitor.web`): JSON API, live events, /metrics, and its limits;
against a hand-made view, and against the real Ledger following an emulated swarm as it trains."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import urllib.request
from collections.abc import AsyncIterator

import aiohttp
import pytest
import torch

import potluck
from potluck.core.dht_time import event_loop_clock
from potluck.metrics import CONTENT_TYPE, Registry, peer_metrics
from potluck.monitor import web
from potluck.monitor.follower import Follower
from potluck.monitor.ledger import Ledger
from potluck.monitor.views import Contributor, EpochRow, HistoryPoint, PeerState, SwarmNow
from potluck.monitor.web import WebServer, start_web
from potluck.net.emulated import EmulatedNetwork
from potluck.optim import Optimizer
from tests.emulated_swarm import run_on_shared_runner


class FakeView:
    """A MonitorView of hand-made rows; tests change them between requests."""

    def __init__(self) -> None:
        self.now = SwarmNow("demo", 1000.0, 2, 12.5, 3, 40, 128, 7.0)
        self.peer_rows = [PeerState("peerA", "alice", True, 3, 8.0, False, 900.0, 1000.0),
                          PeerState("peerB", None, False, 2, 4.5, True, 950.0, 990.0)]
        self.contributor_rows = [Contributor("peerA", "alice", 300, 0.5, 0.75, 3),
                                 Contributor("peerB", None, 100, 0.25, 0.25, 1)]
        self.epoch_rows = [EpochRow(2, 995.0, 128, (2,), 0, {"loss": 0.5}),
                           EpochRow(1, 980.0, 128, (2,), 1, {"loss": 0.9})]
        self.points = [HistoryPoint(990.0 + i, 2, 2, 10.0 + i, 1.0 - 0.1 * i) for i in range(5)]
        self.epochs_asked: list[int] = []

    def swarm_now(self) -> SwarmNow:
        return self.now

    def peers(self) -> list[PeerState]:
        return list(self.peer_rows)

    def contributors(self) -> list[Contributor]:
        return list(self.contributor_rows)

    def epochs(self, limit: int = 100) -> list[EpochRow]:
        self.epochs_asked.append(limit)
        return self.epoch_rows[:limit]

    def history(self, since: float | None = None) -> list[HistoryPoint]:
        return [p for p in self.points if since is None or p.time > since]


async def get_json(session: aiohttp.ClientSession, url: str) -> object:
    async with session.get(url) as response:
        assert response.status == 200, await response.text()
        return await response.json()


@contextlib.asynccontextmanager
async def served(view: FakeView,
                 registry: Registry | None = None) -> AsyncIterator[tuple[WebServer, aiohttp.ClientSession]]:
    """`view` served on a free local port, and a client session; both closed after."""
    server = await start_web(view, "127.0.0.1", 0, registry=registry)
    try:
        async with aiohttp.ClientSession() as session:
            yield server, session
    finally:
        await server.close()


async def next_event(response: aiohttp.ClientResponse) -> tuple[str | None, dict]:
    """The next SSE event's id and data."""
    event_id, data = None, None
    while True:
        line = (await response.content.readline()).decode().rstrip("\n")
        if line.startswith("id: "):
            event_id = line[4:]
        elif line.startswith("data: "):
            data = json.loads(line[6:])
        elif line == "" and data is not None:
            return event_id, data


def test_api_answers_with_the_views_rows(arun) -> None:
    view = FakeView()
    view.points.append(HistoryPoint(995.0, 3, 2, 11.0, math.nan))  # no loss published: null in JSON

    async def main():
        async with served(view) as (server, s):
            assert server.url == f"http://127.0.0.1:{server.port}/"
            url = server.url
            assert await get_json(s, url + "api/swarm") == view.now.to_json()
            assert await get_json(s, url + "api/peers") == [p.to_json() for p in view.peer_rows]
            assert await get_json(s, url + "api/contributors") == [c.to_json() for c in view.contributor_rows]
            assert await get_json(s, url + "api/epochs?limit=1") == [view.epoch_rows[0].to_json()]
            assert view.epochs_asked == [1]
            history = await get_json(s, url + "api/history")
            assert [p["time"] for p in history] == [990.0, 991.0, 992.0, 993.0, 994.0, 995.0]
            assert history[-1]["loss"] is None and history[0]["loss"] == 1.0
            assert [p["time"] for p in await get_json(s, url + "api/history?since=993")] == [994.0, 995.0]
            for bad in ("api/history?since=x", "api/history?since=nan", "api/epochs?limit=0",
                        "api/epochs?limit=2.5", "api/epochs?limit=100000"):
                async with s.get(url + bad) as response:
                    assert response.status == 400, bad
            async with s.get(url) as response:  # the dashboard and its files
                page = await response.text()
                assert response.status == 200 and 'id="loss-chart"' in page and 'id="peers-online"' in page
            for name in ("dashboard.js", "dashboard.css"):
                async with s.get(url + "static/" + name) as response:
                    assert response.status == 200 and len(await response.read()) > 500
    arun(main())


def test_metrics_show_the_run_and_the_monitor_peers_registry(arun) -> None:
    view = FakeView()
    registry = Registry()
    registry.counter("potluck_bytes_sent_total", "Bytes sent").inc(42)

    async def main():
        async with served(view, registry) as (server, s), s.get(server.url + "metrics") as response:
            assert response.headers["Content-Type"] == CONTENT_TYPE
            text = await response.text()
        series = dict(line.rsplit(" ", 1) for line in text.splitlines() if not line.startswith("#"))
        assert series['potluck_run_peers_online{run="demo"}'] == "2"
        assert series['potluck_run_samples_per_second{run="demo"}'] == "12.5"
        assert series['potluck_run_epoch{run="demo"}'] == "3"
        assert series['potluck_run_eta_seconds{run="demo"}'] == "7"
        assert series['potluck_contributor_samples{run="demo",peer="peerA",name="alice"}'] == "300"
        assert series['potluck_contributor_samples{run="demo",peer="peerB",name=""}'] == "100"
        assert series["potluck_bytes_sent_total"] == "42"
    arun(main())


def test_events_push_the_swarm_and_only_new_history_points(arun, monkeypatch) -> None:
    monkeypatch.setattr(web, "EVENT_INTERVAL", 0.05)
    view = FakeView()

    async def main():
        async with served(view) as (server, s):
            async with s.get(server.url + "api/events") as response:
                assert response.headers["Content-Type"] == "text/event-stream"
                event_id, first = await next_event(response)
                assert first["swarm"] == view.now.to_json()
                assert [p["peer_id"] for p in first["peers"]] == ["peerA", "peerB"]
                assert [c["samples"] for c in first["contributors"]] == [300, 100]
                assert [e["epoch"] for e in first["epochs"]] == [2, 1]
                assert len(first["history"]) == 5 and event_id == "994.0"
                # The swarm moves on: the next events carry the new numbers and only the new point.
                view.now = SwarmNow("demo", 1001.0, 3, 20.0, 4, 0, 128, None)
                view.points.append(HistoryPoint(1001.0, 4, 3, 20.0, 0.4))
                while True:
                    event_id, event = await next_event(response)
                    if event["history"]:
                        break
                assert [p["time"] for p in event["history"]] == [1001.0] and event_id == "1001.0"
                assert event["swarm"]["peers_online"] == 3 and event["swarm"]["eta_seconds"] is None
                _, event = await next_event(response)
                assert event["history"] == []
            # A reconnecting browser says the last event it saw: it gets only what came after.
            async with s.get(server.url + "api/events", headers={"Last-Event-ID": "993.0"}) as response:
                _, event = await next_event(response)
                assert [p["time"] for p in event["history"]] == [994.0, 1001.0]
    arun(main())


def test_limits_get_only_capped_event_clients_and_small_requests(arun, monkeypatch, caplog) -> None:
    """Requests over the limits are refused, and logged below ERROR (anyone can send them)."""
    monkeypatch.setattr(web, "MAX_EVENT_CLIENTS", 2)
    monkeypatch.setattr(web, "EVENT_INTERVAL", 0.05)
    view = FakeView()

    async def main():
        async with served(view) as (server, s):
            url = server.url
            for method in ("POST", "PUT", "DELETE"):
                async with s.request(method, url + "api/swarm", data=b"x" * 100) as response:
                    assert response.status == 405
            async with s.post(url + "api/swarm", data=b"x" * (web.MAX_REQUEST_BODY * 4)) as response:
                assert response.status in (405, 413)
            with caplog.at_level(logging.DEBUG):
                async with s.get(url + "api/history?since=" + "1" * web.MAX_REQUEST_LINE) as response:
                    assert response.status in (400, 414)
            assert any("Error handling request" in r.getMessage() for r in caplog.records)
            assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
            async with s.get(url + "static/../web.py") as response:
                assert response.status in (403, 404)
            streams = [await s.get(url + "api/events") for _ in range(2)]
            for stream in streams:
                await next_event(stream)
            async with s.get(url + "api/events") as response:
                assert response.status == 503  # the cap; the API still answers
            assert (await get_json(s, url + "api/swarm"))["run_id"] == "demo"
            streams[0].close()
            for _ in range(100):  # the server notices the closed stream at its next write
                async with s.get(url + "api/events") as response:
                    if response.status == 200:
                        break
                await asyncio.sleep(0.05)
            else:
                pytest.fail("a closed stream's slot was never freed")
            streams[1].close()
    arun(main())


SWARM_RUN, SWARM_BATCH, SWARM_TARGET = "web", 8, 64


async def swarm_served_mid_run() -> list[dict]:
    """Two trainers on the emulated network (virtual clock), a monitor peer following them into a
    Ledger and serving it; twice while they train, the API and /metrics are read over real HTTP from a
    thread (the virtual clock stands still meanwhile) next to the ledger's own answers."""
    network = EmulatedNetwork(latency=0.01, seed=5)
    peers: list[potluck.Peer] = []
    for _ in range(3):
        peers.append(await potluck.Peer.create(peers[0].addresses if peers else [], transport=network.transport(),
                                               clock=event_loop_clock()))
    *trainers, monitor = peers
    optimizers = []
    for peer in trainers:
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 2)
        opt = Optimizer(peer, SWARM_RUN, model.parameters(), lambda p: torch.optim.SGD(p, 0.1),
                        target_batch_size=SWARM_TARGET, batch_size_per_step=SWARM_BATCH, load_state=False, start=False)
        optimizers.append((opt, model))
    ledger = Ledger(":memory:", SWARM_RUN, history_interval=0.25)
    follower = Follower(monitor, SWARM_RUN, ledger, poll_interval=0.25)
    following = asyncio.ensure_future(follower.run())
    server = await start_web(ledger, "127.0.0.1", 0, registry=peer_metrics(monitor.transport).registry)

    async def train(opt: Optimizer, model: torch.nn.Module, seed: int, epochs: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        while opt.local_epoch < epochs:
            x = torch.randn(SWARM_BATCH, 4, generator=generator)
            loss = torch.nn.functional.cross_entropy(model(x), (x[:, 0] > 0).long())
            loss.backward()
            opt.report_metrics(loss=loss.item())
            await asyncio.sleep(0.02)
            await opt.astep()

    def read() -> dict:
        def get(path: str) -> bytes:
            with urllib.request.urlopen(server.url + path, timeout=10) as response:
                return response.read()
        truth = {"swarm": ledger.swarm_now().to_json(), "peers": [p.to_json() for p in ledger.peers()],
                 "contributors": [c.to_json() for c in ledger.contributors()],
                 "history": [p.to_json() for p in ledger.history()]}
        served = {name: json.loads(get("api/" + name)) for name in truth}
        return {"truth": truth, "served": served, "metrics": get("metrics").decode()}

    loop = asyncio.get_running_loop()
    reads = []
    try:
        for opt, _ in optimizers:
            await opt.astart()
        for epochs in (2, 4):  # read mid-run, then later in the same run
            await asyncio.wait_for(asyncio.gather(*(train(opt, model, i, epochs)
                                                    for i, (opt, model) in enumerate(optimizers))), 60)
            await asyncio.sleep(0.5)  # the monitor polls the round records of the last epoch
            reads.append(await loop.run_in_executor(None, read))
        reads.append({"trainers": [p.peer_id for p in trainers]})
        return reads
    finally:
        await server.close()
        following.cancel()
        await asyncio.gather(following, return_exceptions=True)
        follower.close()
        ledger.close()
        for opt, _ in optimizers:
            opt.shutdown()
        for peer in peers:
            await peer.ashutdown()


@pytest.mark.timeout(60)
def test_api_and_metrics_answer_with_the_ledgers_numbers_while_a_swarm_trains() -> None:
    first, later, names = run_on_shared_runner(swarm_served_mid_run(), timeout=60)
    trainers = set(names["trainers"])
    for read in (first, later):
        assert read["served"] == read["truth"]  # the API is the ledger, as it was at that moment
        assert {p["peer_id"] for p in read["served"]["peers"] if p["online"]} == trainers
        lines = read["metrics"].splitlines()
        swarm = read["truth"]["swarm"]
        assert f'potluck_run_epoch{{run="{SWARM_RUN}"}} {swarm["epoch"]}' in lines
        for c in read["truth"]["contributors"]:
            assert f'potluck_contributor_samples{{run="{SWARM_RUN}",peer="{c["peer_id"]}",name=""}} {c["samples"]}' in lines
        # the monitor peer's own registry: it reads the run through DHT finds
        assert any(line.startswith('potluck_dht_request_seconds_count{method="find"} ') and float(line.split()[-1]) > 0
                   for line in lines)
    # The numbers moved on between the two reads: more epochs, more credit, more history with losses.
    assert later["truth"]["swarm"]["epoch"] > first["truth"]["swarm"]["epoch"] >= 1
    credit = {c["peer_id"]: c["samples"] for c in first["truth"]["contributors"]}
    assert set(credit) == trainers and all(n > 0 for n in credit.values())
    assert all(c["samples"] > credit[c["peer_id"]] for c in later["truth"]["contributors"])
    losses = [p["loss"] for p in later["served"]["history"] if p["loss"] is not None]
    assert len(losses) > len([p for p in first["served"]["history"] if p["loss"] is not None]) >= 2
