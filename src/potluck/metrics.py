"""Prometheus metrics: a small registry (counters, gauges, histograms with labels) and each peer's own.

A `Registry` renders the Prometheus text exposition format 0.0.4 (what every Prometheus server and
agent scrapes). `peer_metrics(transport)` is the registry of one peer, kept with its transport (like
its services), so two peers in one process count separately; averaging and the DHT record into it,
and the transport's connection and byte counts are read when scraped. `serve_metrics` serves a
registry at `/metrics` over HTTP (aiohttp) on the running event loop: `Peer(metrics_port=...)`.

Imports only `potluck.core`: every layer may record into it.
"""

from __future__ import annotations

import asyncio
import bisect
import logging
import math
import time
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from potluck.core.virtual_time import VirtualTimeLoop

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Label sets one metric keeps: labels here come from small fixed sets (failure kinds, DHT methods,
# a run's contributors), so more means a bug or someone feeding us names; beyond it new sets are
# dropped rather than grow memory and every scrape.
MAX_LABEL_SETS = 1000

# Bucket upper bounds (seconds, or members). An averaging round is matchmaking (seconds) plus an
# all-reduce (milliseconds on a LAN to minutes for a large model on home links).
ROUND_SECONDS_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
# Groups: 2 to MOSHPIT_MAX_GROUP (16) usually; DeDLOC-style runs average everyone at once.
GROUP_SIZE_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 32, 64, 128)
# A DHT request is one round trip: ~0.2 ms on loopback, tens of ms across the internet, up to the
# RPC timeout (seconds) for a peer that does not answer.
DHT_SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)
# A scrape is a GET without a body; a larger body is refused before it is read.
MAX_REQUEST_BODY = 1024

Labels = tuple[str, ...]
Callback = Callable[[], float | None | Iterable[tuple[Labels, float]]]


class _Metric:
    kind = ""

    def __init__(self, name: str, help: str, labels: Sequence[str] = (), callback: Callback | None = None):
        self.name, self.help, self.label_names = name, help, tuple(labels)
        self.callback = callback  # read at every scrape instead of stored values
        self._values: dict[Labels, Any] = {}

    def _key(self, labels: dict[str, str]) -> Labels | None:
        """The label values in declared order; None when the set is new and the cap is reached."""
        try:
            key = tuple(str(labels[n]) for n in self.label_names)
        except KeyError:
            key = None
        if key is None or len(labels) != len(key):
            raise ValueError(f"{self.name} has labels {self.label_names}, got {tuple(labels)}")
        if key not in self._values and len(self._values) >= MAX_LABEL_SETS:
            return None
        return key

    def _samples(self) -> Iterable[tuple[str, Labels, Labels, float]]:
        """(name suffix, extra label names, label values, value) of every series."""
        values: Iterable[tuple[Labels, float]]
        if self.callback is None:
            values = self._values.items()
        else:
            got = self.callback()
            values = [] if got is None else [((), got)] if isinstance(got, (int, float)) else list(got)[:MAX_LABEL_SETS]
        for key, value in values:
            yield "", (), key, value

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {_escape_help(self.help)}", f"# TYPE {self.name} {self.kind}"]
        for suffix, extra_names, key, value in self._samples():
            names = self.label_names + extra_names
            labels = ",".join(f'{n}="{_escape_label(v)}"' for n, v in zip(names, key, strict=True))
            lines.append(f"{self.name}{suffix}{{{labels}}} {_number(value)}" if labels
                         else f"{self.name}{suffix} {_number(value)}")
        return lines


class Counter(_Metric):
    """Only goes up (restarts from zero with the process)."""

    kind = "counter"

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        if amount < 0:
            raise ValueError("a counter only goes up")
        key = self._key(labels)
        if key is not None:
            self._values[key] = self._values.get(key, 0.0) + amount

    def value(self, **labels: str) -> float:
        return self._values.get(tuple(str(labels[n]) for n in self.label_names), 0.0)


class Gauge(_Metric):
    """A value that goes up and down."""

    kind = "gauge"

    def set(self, value: float, **labels: str) -> None:
        key = self._key(labels)
        if key is not None:
            self._values[key] = float(value)


class Histogram(_Metric):
    """Counts of observations at or below each bucket's upper bound, their sum and count."""

    kind = "histogram"

    def __init__(self, name: str, help: str, buckets: Sequence[float], labels: Sequence[str] = ()):
        if "le" in labels:
            raise ValueError("'le' is the bucket label of a histogram")
        if list(buckets) != sorted(set(buckets)) or not buckets:
            raise ValueError("buckets must be increasing")
        super().__init__(name, help, labels)
        self.buckets = tuple(float(b) for b in buckets) + (math.inf,)

    def observe(self, value: float, **labels: str) -> None:
        key = self._key(labels)
        if key is None:
            return
        series = self._values.get(key)
        if series is None:
            series = self._values[key] = [[0] * len(self.buckets), 0.0]  # per bucket (not cumulative), sum
        series[0][bisect.bisect_left(self.buckets, value)] += 1
        series[1] += value

    def count(self, **labels: str) -> int:
        found = self._values.get(tuple(str(labels[n]) for n in self.label_names))
        return 0 if found is None else sum(found[0])

    def _samples(self) -> Iterable[tuple[str, Labels, Labels, float]]:
        for key, (counts, total) in self._values.items():
            cumulative = 0
            for bound, count in zip(self.buckets, counts, strict=True):
                cumulative += count
                yield "_bucket", ("le",), (*key, _number(bound)), cumulative
            yield "_sum", (), key, total
            yield "_count", (), key, cumulative


class Registry:
    """A set of metrics rendered together; names are unique within it."""

    def __init__(self) -> None:
        self._metrics: dict[str, _Metric] = {}

    def _add(self, metric: _Metric) -> Any:
        if metric.name in self._metrics:
            raise ValueError(f"metric {metric.name!r} is registered already")
        self._metrics[metric.name] = metric
        return metric

    def counter(self, name: str, help: str, labels: Sequence[str] = (), callback: Callback | None = None) -> Counter:
        return self._add(Counter(name, help, labels, callback))

    def gauge(self, name: str, help: str, labels: Sequence[str] = (), callback: Callback | None = None) -> Gauge:
        return self._add(Gauge(name, help, labels, callback))

    def histogram(self, name: str, help: str, buckets: Sequence[float], labels: Sequence[str] = ()) -> Histogram:
        return self._add(Histogram(name, help, buckets, labels))

    def exposition(self) -> str:
        """Every metric in the text format 0.0.4 (serve it with CONTENT_TYPE)."""
        return "".join(line + "\n" for metric in self._metrics.values() for line in metric.render())


class PeerMetrics:
    """What one peer measures: averaging rounds, DHT requests, connections, bytes on the wire."""

    def __init__(self, transport: Any):
        ref = weakref.ref(transport)  # the transport holds us (in its services): no cycle back
        r = self.registry = Registry()
        self.round_seconds = r.histogram("potluck_averaging_round_seconds",
                                         "Duration of averaging rounds that succeeded (matchmaking + all-reduce)",
                                         ROUND_SECONDS_BUCKETS, labels=("run", "averager"))
        self.group_size = r.histogram("potluck_averaging_group_size", "Members of each successful averaging round",
                                      GROUP_SIZE_BUCKETS, labels=("run", "averager"))
        self.round_failures = r.counter("potluck_averaging_failures_total",
                                        "Averaging rounds that failed, by kind (matchmaking, allreduce, timeout)",
                                        labels=("run", "averager", "kind"))
        self.dht_seconds = r.histogram("potluck_dht_request_seconds", "Round-trip time of answered DHT requests",
                                       DHT_SECONDS_BUCKETS, labels=("method",))
        self.dht_failures = r.counter("potluck_dht_request_failures_total",
                                      "DHT requests that failed (no answer in time, refused, malformed)",
                                      labels=("method",))
        r.gauge("potluck_connections_open", "Open connections to other peers (calls, bulk streams, relayed)",
                callback=lambda: None if (t := ref()) is None else len(t.open_connections()))
        r.counter("potluck_bytes_sent_total", "Bytes this peer put on the wire (frames, all connections)",
                  callback=lambda: None if (t := ref()) is None else t.stats.bytes_sent)
        r.counter("potluck_bytes_received_total", "Bytes this peer took off the wire (frames, all connections)",
                  callback=lambda: None if (t := ref()) is None else t.stats.bytes_received)


def peer_metrics(transport: Any) -> PeerMetrics:
    """The metrics of the peer behind `transport` (one per transport, like its services)."""
    metrics = transport.services.get("metrics")
    if metrics is None:
        metrics = transport.services["metrics"] = PeerMetrics(transport)
    return metrics


def stopwatch() -> Callable[[], float]:
    """Seconds since the call, on the running loop's clock if it is virtual (simulated durations),
    else `time.perf_counter`: uvloop's `loop.time()` moves in whole milliseconds, and a loopback
    round trip read 0."""
    loop = asyncio.get_running_loop()
    clock = loop.time if isinstance(loop, VirtualTimeLoop) else time.perf_counter
    start = clock()
    return lambda: clock() - start


class MetricsServer:
    """An HTTP server answering GET /metrics; `close()` stops it."""

    def __init__(self, runner: Any, url: str, port: int):
        self._runner, self.url, self.port = runner, url, port

    async def close(self) -> None:
        await self._runner.cleanup()


async def serve_metrics(render: Callable[[], str], host: str, port: int) -> MetricsServer:
    """Serve `render()` at http://host:port/metrics (port 0 picks one) on the running loop."""
    from aiohttp import web  # only peers that serve metrics pay for importing it

    async def metrics(_request: web.Request) -> web.Response:
        return web.Response(body=render().encode(), headers={"Content-Type": CONTENT_TYPE})

    app = web.Application(client_max_size=MAX_REQUEST_BODY)
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app, access_log=None, logger=QuietBadRequests(__name__))
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound = runner.addresses[0][1]
    shown = "127.0.0.1" if host in ("0.0.0.0", "") else host
    return MetricsServer(runner, f"http://{shown}:{bound}/metrics", bound)


class QuietBadRequests(logging.LoggerAdapter):
    """aiohttp's server logger (`AppRunner(logger=...)`): a request that is not valid HTTP (a
    scanner, a line over our limits) is its sender's problem, so it is logged at DEBUG without a
    traceback. aiohttp logs those at ERROR with a traceback each, and anyone who can reach a
    public metrics or dashboard port could flood the log with them. Errors of our handlers stay
    errors."""

    def __init__(self, name: str):
        super().__init__(logging.getLogger(name), {})

    def exception(self, msg: object, *args: Any, exc_info: Any = True, **kwargs: Any) -> None:
        from aiohttp.http_exceptions import HttpProcessingError
        if isinstance(exc_info, HttpProcessingError):
            self.logger.debug("%s: %s", msg % args if args else msg, exc_info)
        else:
            self.logger.error(msg, *args, exc_info=exc_info, **kwargs)


def _number(value: float) -> str:
    value = float(value)
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return str(int(value)) if value.is_integer() and abs(value) < 1e15 else repr(value)


def _escape_help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def _escape_label(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')
