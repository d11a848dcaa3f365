"""The monitor's web side: a live dashboard, a JSON API and Prometheus metrics, in one aiohttp server.

It runs on the event loop the monitor's peer already runs on (aiohttp is asyncio-native; see
docs/design.md, Dependencies) and only reads a `MonitorView`, calling it on that loop: the view's
methods must be quick (the ledger answers from SQLite in milliseconds).

Routes (GET only; anything else is answered 405):
- `/`: the dashboard (static files under `static/`: HTML, CSS and hand-written JavaScript that
  draws its charts as SVG; nothing is fetched from elsewhere).
- `/api/swarm`, `/api/peers`, `/api/contributors`, `/api/epochs?limit=N`, `/api/history?since=T`:
  the view's rows as JSON (`to_json()`; NaN and infinities become null). A peer row's `refused`
  says why a peer is not counted (another model or settings than the run's), else null; the
  dashboard shows such a peer as "refused", with the reason on hover.
- `/api/events`: Server-Sent Events, one every EVENT_INTERVAL: the swarm now, peers,
  contributors, recent epochs, and the history points since the client's last event (all of them
  in the first; a reconnecting browser sends `Last-Event-ID` and gets only what it missed).
- `/metrics`: the run as Prometheus gauges (from the view) and the monitor peer's own registry.
"""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path
from typing import Any

from aiohttp import web

from potluck.core import compat
from potluck.metrics import CONTENT_TYPE, QuietBadRequests, Registry
from potluck.monitor.views import HistoryPoint, MonitorView

STATIC = Path(__file__).parent / "static"

# Live dashboards open at once (SSE streams). Each holds a connection and gets an event every
# EVENT_INTERVAL from the peer's own event loop; a run is watched by its organizers, a handful of
# people, and more clients are refused (503; the JSON API still answers them).
MAX_EVENT_CLIENTS = 32
# How often the dashboard is updated: progress records in the DHT change about this often.
EVENT_INTERVAL = 1.0
# A client that does not take an event within this long is dropped (its writes would queue).
EVENT_WRITE_TIMEOUT = 10.0
# History points one answer carries (the newest): one a second is 2.5 hours of chart, and a
# longer run's chart needs no finer grain than a screen's width; bounds each answer's size.
MAX_HISTORY_POINTS = 10_000
# Epoch rows one answer may ask for, and what the events carry.
MAX_EPOCHS = 1000
EVENT_EPOCHS = 10
# Contributors named in /metrics labels (the top by samples): a label per peer is a series per
# peer in Prometheus; larger runs read the full table at /api/contributors.
MAX_LABELLED_CONTRIBUTORS = 100
# Requests are small GETs: a request line of a URL with one number, headers a browser sends
# (aiohttp's own default, which allows a localhost's other sites' cookies), no body.
MAX_REQUEST_LINE = 2048
MAX_HEADER_FIELD = 8190
MAX_HEADERS = 64
MAX_REQUEST_BODY = 1024
# How long close() lets open requests finish (SSE streams are ended first).
CLOSE_GRACE = 2.0


class WebServer:
    """A running monitor web server: `url`, `port`, `await close()`."""

    def __init__(self, view: MonitorView, registry: Registry | None):
        self.view = view
        self.registry = registry
        self.url = ""
        self.port = 0
        self._runner: web.AppRunner | None = None
        self._streams = 0  # SSE clients connected now
        self._closing = asyncio.Event()
        self._snapshot: tuple[float, dict[str, Any]] | None = None  # (loop time, event fields) shared by streams

    def app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_REQUEST_BODY)
        routes = {"/": self._index, "/api/swarm": self._swarm, "/api/peers": self._peers,
                  "/api/contributors": self._contributors, "/api/epochs": self._epochs,
                  "/api/history": self._history, "/api/events": self._events, "/metrics": self._metrics}
        for path, handler in routes.items():
            app.router.add_get(path, handler)
        app.router.add_static("/static/", STATIC, show_index=False, follow_symlinks=False)
        return app

    async def start(self, host: str, port: int) -> None:
        """Listen at http://host:port/ (port 0 picks one) on the running event loop; sets `port`
        and `url`."""
        runner = web.AppRunner(self.app(), access_log=None, logger=QuietBadRequests(__name__),
                               shutdown_timeout=CLOSE_GRACE, max_line_size=MAX_REQUEST_LINE,
                               max_field_size=MAX_HEADER_FIELD, max_headers=MAX_HEADERS)
        await runner.setup()
        try:
            await web.TCPSite(runner, host, port).start()
        except BaseException:
            await runner.cleanup()
            raise
        self._runner = runner
        self.port = runner.addresses[0][1]
        shown = "127.0.0.1" if host in ("0.0.0.0", "", "::") else host
        self.url = f"http://{shown}:{self.port}/"

    async def close(self) -> None:
        """Stop: live streams end at once, other requests get CLOSE_GRACE to finish."""
        self._closing.set()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    # -- pages and API -------------------------------------------------------------------------------
    async def _index(self, _request: web.Request) -> web.StreamResponse:
        return web.FileResponse(STATIC / "index.html")

    async def _swarm(self, _request: web.Request) -> web.Response:
        return _json(self.view.swarm_now().to_json())

    async def _peers(self, _request: web.Request) -> web.Response:
        return _json([p.to_json() for p in self.view.peers()])

    async def _contributors(self, _request: web.Request) -> web.Response:
        return _json([c.to_json() for c in self.view.contributors()])

    async def _epochs(self, request: web.Request) -> web.Response:
        limit = _number_param(request, "limit", 100.0)
        if limit is None or not 1 <= limit <= MAX_EPOCHS or not limit.is_integer():
            raise web.HTTPBadRequest(text=f"limit is a whole number from 1 to {MAX_EPOCHS}")
        return _json([e.to_json() for e in self.view.epochs(limit=int(limit))])

    async def _history(self, request: web.Request) -> web.Response:
        return _json([p.to_json() for p in self._new_points(_number_param(request, "since", None))])

    def _new_points(self, since: float | None) -> list[HistoryPoint]:
        points = [p for p in self.view.history(since) if since is None or p.time > since]
        return points[-MAX_HISTORY_POINTS:]

    async def _metrics(self, _request: web.Request) -> web.Response:
        text = _run_metrics(self.view).exposition()
        if self.registry is not None:
            text += self.registry.exposition()
        return web.Response(body=text.encode(), headers={"Content-Type": CONTENT_TYPE})

    # -- live updates ----------------------------------------------------------------------------------
    async def _events(self, request: web.Request) -> web.StreamResponse:
        if self._streams >= MAX_EVENT_CLIENTS:
            raise web.HTTPServiceUnavailable(text=f"at most {MAX_EVENT_CLIENTS} live dashboards at once; "
                                                  "reload later, or read /api/*")
        since = _float(request.headers.get("Last-Event-ID"))
        self._streams += 1
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                               "X-Accel-Buffering": "no"})
        try:
            await response.prepare(request)
            while not self._closing.is_set():
                points = self._new_points(since)
                if points:
                    since = points[-1].time
                event = {**self._shared_fields(), "history": [p.to_json() for p in points]}
                data = json.dumps(_finite(event), separators=(",", ":"))
                message = (f"id: {since!r}\n" if since is not None else "") + f"data: {data}\n\n"
                async with compat.timeout(EVENT_WRITE_TIMEOUT):
                    await response.write(message.encode())
                await _wait(self._closing, EVENT_INTERVAL)
        except (ConnectionError, TimeoutError):
            pass  # the client left or stalled: the stream just ends
        finally:
            self._streams -= 1
        return response

    def _shared_fields(self) -> dict[str, Any]:
        """What every stream sends this tick, read from the view once per EVENT_INTERVAL."""
        now = asyncio.get_running_loop().time()
        if self._snapshot is None or now - self._snapshot[0] >= EVENT_INTERVAL / 2:
            view = self.view
            self._snapshot = (now, {"swarm": view.swarm_now().to_json(),
                                    "peers": [p.to_json() for p in view.peers()],
                                    "contributors": [c.to_json() for c in view.contributors()],
                                    "epochs": [e.to_json() for e in view.epochs(limit=EVENT_EPOCHS)]})
        return self._snapshot[1]


async def start_web(view: MonitorView, host: str, port: int, registry: Registry | None = None) -> WebServer:
    """Serve the dashboard, API and metrics of `view` at http://host:port/ (port 0 picks one) on the
    running event loop; `registry` (the monitor peer's, `potluck.metrics.peer_metrics`) is added to
    /metrics."""
    server = WebServer(view, registry)
    await server.start(host, port)
    return server


def _run_metrics(view: MonitorView) -> Registry:
    """The run as the view sees it now, as Prometheus gauges."""
    now = view.swarm_now()
    registry = Registry()
    run = {"run": now.run_id}
    for name, help, value in (
            ("potluck_run_peers_online", "Peers of the run online now", now.peers_online),
            ("potluck_run_samples_per_second", "The swarm's samples per second (sum over live peers)",
             now.samples_per_second),
            ("potluck_run_epoch", "The newest epoch a live peer reports", now.epoch),
            ("potluck_run_epoch_samples", "Samples accumulated towards the current epoch's global batch", now.samples),
            ("potluck_run_target_batch_size", "Samples in a global batch", now.target_batch_size),
            ("potluck_run_eta_seconds", "Estimated seconds until the global batch is full", now.eta_seconds)):
        if value is not None:
            registry.gauge(name, help, labels=("run",)).set(value, **run)
    credited = registry.gauge("potluck_contributor_samples", "Samples credited to a peer (really averaged)",
                              labels=("run", "peer", "name"))
    online = registry.gauge("potluck_contributor_online_hours", "Hours a peer was seen online",
                            labels=("run", "peer", "name"))
    top = sorted(view.contributors(), key=lambda c: -c.samples)[:MAX_LABELLED_CONTRIBUTORS]
    for c in top:
        labels = {**run, "peer": c.peer_id, "name": c.name or ""}
        credited.set(c.samples, **labels)
        online.set(c.online_hours, **labels)
    return registry


def _json(data: Any) -> web.Response:
    return web.json_response(_finite(data), dumps=lambda d: json.dumps(d, separators=(",", ":")))


def _finite(data: Any) -> Any:
    """NaN and infinities as null: JSON has no such numbers, and browsers refuse them."""
    if isinstance(data, float):
        return data if math.isfinite(data) else None
    if isinstance(data, dict):
        return {k: _finite(v) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return [_finite(v) for v in data]
    return data


def _float(text: str | None) -> float | None:
    try:
        value = float(text) if text is not None else None
    except ValueError:
        return None
    return value if value is not None and math.isfinite(value) else None


def _number_param(request: web.Request, name: str, default: float | None) -> float | None:
    text = request.query.get(name)
    if text is None:
        return default
    value = _float(text)
    if value is None:
        raise web.HTTPBadRequest(text=f"{name} must be a finite number")
    return value


async def _wait(event: asyncio.Event, seconds: float) -> None:
    """Sleep `seconds`, or less if `event` is set meanwhile."""
    try:
        async with compat.timeout(seconds):
            await event.wait()
    except TimeoutError:
        pass
