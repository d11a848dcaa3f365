"""`potluck.metrics`: the Prometheus text format, histograms, and each peer's own numbers."""

from __future__ import annotations

import asyncio
import urllib.request

import pytest
import torch

import potluck
from potluck.averaging import Averager
from potluck.core.errors import AveragingError
from potluck.core.virtual_time import run_virtual
from potluck.metrics import CONTENT_TYPE, MAX_LABEL_SETS, Registry, peer_metrics
from tests.emulated_swarm import make_swarm


def parse(text: str) -> dict[str, float]:
    """Series (name with its labels, as written) -> value; checks every line's shape."""
    series = {}
    for line in text.splitlines():
        if line.startswith("#"):
            assert line.startswith(("# HELP ", "# TYPE ")), line
            continue
        name, value = line.rsplit(" ", 1)
        series[name] = float(value)
    return series


def test_exposition_format_with_labels_escaping_and_callbacks() -> None:
    registry = Registry()
    failures = registry.counter("x_failures_total", "Failures\nby kind", labels=("kind",))
    failures.inc(kind="timeout")
    failures.inc(2, kind='say "hi"\\')
    gauge = registry.gauge("x_temperature", "A gauge")
    gauge.set(-1.5)
    live = [3]
    registry.gauge("x_live", "Read at scrape time", callback=lambda: live[0])
    registry.counter("x_gone_total", "A callback with nothing to say", callback=lambda: None)
    live[0] = 4
    assert registry.exposition() == (
        "# HELP x_failures_total Failures\\nby kind\n"
        "# TYPE x_failures_total counter\n"
        'x_failures_total{kind="timeout"} 1\n'
        'x_failures_total{kind="say \\"hi\\"\\\\"} 2\n'
        "# HELP x_temperature A gauge\n"
        "# TYPE x_temperature gauge\n"
        "x_temperature -1.5\n"
        "# HELP x_live Read at scrape time\n"
        "# TYPE x_live gauge\n"
        "x_live 4\n"
        "# HELP x_gone_total A callback with nothing to say\n"
        "# TYPE x_gone_total counter\n")
    with pytest.raises(ValueError, match="registered already"):
        registry.gauge("x_live", "again")
    with pytest.raises(ValueError, match="has labels"):
        failures.inc(reason="timeout")
    with pytest.raises(ValueError, match="only goes up"):
        failures.inc(-1, kind="timeout")


def test_histogram_buckets_are_cumulative_and_label_sets_are_capped() -> None:
    registry = Registry()
    latency = registry.histogram("x_seconds", "Latency", (0.1, 1, 10), labels=("method",))
    for value in (0.05, 0.1, 0.5, 20):
        latency.observe(value, method="find")
    series = parse(registry.exposition())
    assert series == {'x_seconds_bucket{method="find",le="0.1"}': 2, 'x_seconds_bucket{method="find",le="1"}': 3,
                      'x_seconds_bucket{method="find",le="10"}': 3, 'x_seconds_bucket{method="find",le="+Inf"}': 4,
                      'x_seconds_sum{method="find"}': 20.65, 'x_seconds_count{method="find"}': 4}
    for i in range(MAX_LABEL_SETS + 10):
        latency.observe(1, method=str(i))
    assert len(latency._values) == MAX_LABEL_SETS  # new label sets beyond the cap are dropped
    with pytest.raises(ValueError, match="increasing"):
        registry.histogram("x_bad", "Bad buckets", (1, 0.5))


@pytest.mark.timeout(30)
def test_averaging_rounds_and_failures_are_counted_per_peer() -> None:
    async def main():
        net, peers = await make_swarm(4)
        avgs = [Averager(p, [torch.ones(100) * i], "job", matchmaking_time=1.0) for i, p in enumerate(peers[:3])]
        await asyncio.gather(*(a.astep() for a in avgs))
        lonely = Averager(peers[3], [torch.zeros(4)], "alone", min_group_size=3, matchmaking_time=0.5)
        with pytest.raises(AveragingError):
            await lonely.astep()
        for p in peers[:3]:
            metrics = peer_metrics(p.transport)
            assert metrics.round_seconds.count(run="job", averager="tensors") == 1
            assert parse(metrics.registry.exposition())['potluck_averaging_group_size_sum{run="job",averager="tensors"}'] == 3
        # Each peer keeps its own numbers: only the lonely one failed, in matchmaking.
        failed = peer_metrics(peers[3].transport)
        assert failed.round_failures.value(run="alone", averager="tensors", kind="matchmaking") == 1
        assert failed.round_seconds.count(run="alone", averager="tensors") == 0
        assert peer_metrics(peers[0].transport).round_failures.value(run="alone", averager="tensors", kind="matchmaking") == 0
        # The DHT's requests were timed too (joining the swarm is a few finds).
        assert peer_metrics(peers[1].transport).dht_seconds.count(method="find") > 0
    run_virtual(main())


@pytest.mark.timeout(60)
def test_peer_serves_its_metrics_over_http() -> None:
    with potluck.Peer(host="127.0.0.1", client_mode=False, metrics_port=0) as a, \
            potluck.Peer(initial_peers=a.addresses, host="127.0.0.1", client_mode=False) as b:
        assert b.metrics_url is None
        for i in range(3):
            assert a.dht.store(f"key{i}", i, potluck.get_dht_time() + 60)
            assert b.dht.get(f"key{i}").value == i
        sent, received = a.stats.bytes_sent, a.stats.bytes_received
        with urllib.request.urlopen(a.metrics_url, timeout=10) as response:
            assert response.headers["Content-Type"] == CONTENT_TYPE
            series = parse(response.read().decode())
        assert series["potluck_connections_open"] >= 1
        assert 0 < sent <= series["potluck_bytes_sent_total"] <= a.stats.bytes_sent
        assert 0 < received <= series["potluck_bytes_received_total"] <= a.stats.bytes_received
        assert series['potluck_dht_request_seconds_count{method="store"}'] >= 3
        assert 0 < series['potluck_dht_request_seconds_sum{method="store"}'] < 30
        request = urllib.request.Request(a.metrics_url, data=b"x", method="POST")
        with pytest.raises(urllib.error.HTTPError, match="405"):
            urllib.request.urlopen(request, timeout=10)
        url = a.metrics_url
    with pytest.raises(urllib.error.URLError):  # closed with the peer
        urllib.request.urlopen(url, timeout=5)
