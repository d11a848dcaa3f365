#!/usr/bin/env python3
"""The real-browser check of issue 18: a small swarm trains, `potluck monitor` follows it, and headless
Chromium shows its dashboard with the swarm's real numbers.

Steps, each reported in the JSON summary printed at the end (exit status 1 if one failed):
  chromium   Debian's `chromium` is there, or installed with apt-get (needs root).
  swarm      TRAINERS processes (scripts/browser/trainer.py) train a small model together with
             potluck.Optimizer and publish their loss (opt.report_metrics); the first is the others'
             initial peer.
  monitor    `potluck monitor` follows the run into a fresh ledger and serves the dashboard; the
             check waits until its API lists every trainer and MIN_LOSS_POINTS points of loss.
  browser    Chromium opens the dashboard once (no reload) and is driven over the DevTools protocol
             (aiohttp's websocket client): the page must take MIN_UPDATES live updates, its peers
             table must name exactly the peers the API names (every trainer among them), and its
             loss chart must grow while we watch, hold >= MIN_LOSS_POINTS points, and end at the very
             loss the API gives for its last point. A screenshot goes to docs/dashboard.png.

Usage: .venv/bin/python scripts/browser/dashboard_check.py [--screenshot PATH] [--keep-logs DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # scripts/checks_common.py
from checks_common import PYTHON, ROOT, CheckFailed, Processes, finish, log_folder, run_step, stop_on_signals  # noqa: E402

PROG = "dashboard_check"
RUN_ID = "dashcheck"
TRAINERS = 3
MIN_LOSS_POINTS = 4  # the ledger adds a history point every 5 s: 20 s of training
MIN_UPDATES = 3  # live updates the page must take without a reload (one a second)
WINDOW = (1280, 1150)  # the browser's viewport: the whole dashboard in one screenshot

# Deadlines (every wait has one; the whole check stays under three minutes).
CHECK_DEADLINE = 170.0  # processes, API and browser, to the summary
INSTALL_TIMEOUT = 300.0  # apt-get update + install chromium on a fresh CI machine (not in CHECK_DEADLINE)
START_TIMEOUT = 60.0  # a process getting ready (imports torch, joins the swarm)
DATA_TIMEOUT = 90.0  # the monitor's API showing every trainer and MIN_LOSS_POINTS losses
PAGE_TIMEOUT = 45.0  # the page showing what the API shows, and its chart growing
DEVTOOLS_TIMEOUT = 15.0  # one DevTools call or HTTP request
POLL = 0.5  # between looks at the API or the page
STOP_GRACE = 10.0  # SIGTERM to SIGKILL for our processes


# -- chromium -------------------------------------------------------------------------------------------
def find_chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


def ensure_chromium() -> dict:
    found = find_chromium()
    installed = False
    if found is None:
        if os.geteuid() != 0:
            raise CheckFailed("chromium is missing and installing it needs root: apt-get install chromium")
        print(f"{PROG}: installing chromium", file=sys.stderr, flush=True)
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        for command in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", "chromium"]):
            result = subprocess.run(command, capture_output=True, text=True, timeout=INSTALL_TIMEOUT, env=env)
            if result.returncode != 0:
                raise CheckFailed(f"`{' '.join(command)}` failed: {result.stderr.strip()[-2000:]}")
        found, installed = find_chromium(), True
        if found is None:
            raise CheckFailed("apt-get installed chromium but no chromium command is on PATH")
    version = subprocess.run([found, "--version"], capture_output=True, text=True, timeout=30).stdout.strip()
    return {"path": found, "version": version, "installed_now": installed}


# -- steps ------------------------------------------------------------------------------------------------
async def start_swarm(procs: Processes) -> dict:
    trainer = str(HERE / "trainer.py")
    await procs.spawn("trainer0", str(PYTHON), trainer, "0", "--run-id", RUN_ID, own_session=True)
    address = (await procs.read_until("trainer0", lambda s: s.startswith("address "), START_TIMEOUT)).split()[1]
    for i in range(1, TRAINERS):
        await procs.spawn(f"trainer{i}", str(PYTHON), trainer, str(i), "--run-id", RUN_ID, "--initial-peers", address,
                          own_session=True)
    ids = [(await procs.read_until(f"trainer{i}", lambda s: s.startswith("peer "), START_TIMEOUT)).split()[1]
           for i in range(TRAINERS)]
    return {"initial_peer": address, "trainers": ids}


async def start_monitor(procs: Processes, initial: str, db: Path) -> str:
    await procs.spawn("monitor", str(PYTHON), "-m", "potluck", "monitor", "--run-id", RUN_ID,
                      "--initial-peers", initial, "--db", str(db), "--host", "127.0.0.1", "--port", "0",
                      own_session=True)
    line = await procs.read_until("monitor", lambda s: s.startswith("dashboard:"), START_TIMEOUT)
    url = line.split(maxsplit=1)[1]
    if not url.startswith("http://"):
        raise CheckFailed(f"the monitor serves no dashboard: {line}")
    return url


async def get_json(session: aiohttp.ClientSession, url: str) -> Any:
    async with asyncio.timeout(DEVTOOLS_TIMEOUT), session.get(url) as response:
        if response.status != 200:
            raise CheckFailed(f"GET {url}: HTTP {response.status}: {await response.text()}")
        return await response.json()


async def wait_for(what: str, timeout: float, look: Callable[[], Awaitable[tuple[bool, Any]]]) -> Any:
    """Poll `look()` (-> (done, what it saw)) until done, within `timeout`; what it saw then."""
    deadline = time.monotonic() + timeout
    seen = None
    while time.monotonic() < deadline:
        done, seen = await look()
        if done:
            return seen
        await asyncio.sleep(POLL)
    raise CheckFailed(f"{what} within {timeout:.0f} s; last seen: {json.dumps(seen)[:1500]}")


def loss_points(history: list[dict]) -> list[dict]:
    return [p for p in history if p["loss"] is not None]


async def wait_for_data(session: aiohttp.ClientSession, url: str, trainers: list[str]) -> dict:
    async def look() -> tuple[bool, dict]:
        peers = await get_json(session, url + "api/peers")
        losses = loss_points(await get_json(session, url + "api/history"))
        online = {p["peer_id"] for p in peers if p["online"]}
        seen = {"online": sorted(online), "loss_points": len(losses)}
        return set(trainers) <= online and len(losses) >= MIN_LOSS_POINTS, seen
    return await wait_for(f"the API did not show all {TRAINERS} trainers online and {MIN_LOSS_POINTS} loss points",
                          DATA_TIMEOUT, look)


class DevTools:
    """The Chrome DevTools protocol over one page's websocket: `call(method, **params)`."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse):
        self.ws = ws
        self.next_id = 0

    async def call(self, method: str, **params: Any) -> dict:
        self.next_id += 1
        call_id = self.next_id
        async with asyncio.timeout(DEVTOOLS_TIMEOUT):
            await self.ws.send_json({"id": call_id, "method": method, "params": params})
            while True:  # events (none asked for) and answers to nothing else may come first
                message = await self.ws.receive()
                if message.type != aiohttp.WSMsgType.TEXT:
                    raise CheckFailed(f"the browser's DevTools connection ended ({message.type.name})")
                answer = json.loads(message.data)
                if answer.get("id") == call_id:
                    if "error" in answer:
                        raise CheckFailed(f"DevTools {method}: {answer['error']}")
                    return answer["result"]

    async def evaluate(self, expression: str) -> Any:
        result = await self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        if "exceptionDetails" in result:
            raise CheckFailed(f"the page's script failed: {result['exceptionDetails']}")
        return result["result"].get("value")


# What the page shows, read from the ids and data- attributes the dashboard gives its elements
# (null while the page is still loading).
PAGE_STATE = """(() => {
  const status = document.getElementById('status');
  if (!status || document.readyState !== 'complete') return null;
  const path = document.querySelector('#loss-chart path.line');
  return {
    updates: Number(status.dataset.updates),
    status: status.textContent,
    peers: [...document.querySelectorAll('#peers tr[data-peer]')].map((r) => r.dataset.peer),
    peers_online: document.getElementById('peers-online').textContent,
    epoch: document.getElementById('epoch').textContent,
    contributors: [...document.querySelectorAll('#contributors tr[data-contributor]')]
      .map((r) => r.dataset.contributor),
    loss_points: path ? Number(path.dataset.points) : 0,
    loss_last: path ? Number(path.dataset.last) : null,
    loss_last_time: path ? Number(path.dataset.lastTime) : null,
    loss_path_commands: path ? (path.getAttribute('d').match(/[ML]/g) || []).length : 0,
  };
})()"""


async def open_browser(procs: Processes, chromium: str, profile: Path) -> str:
    """Start headless Chromium; its DevTools HTTP endpoint."""
    await procs.spawn("chromium", chromium, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                      "--disable-dev-shm-usage", "--hide-scrollbars", f"--user-data-dir={profile}",
                      f"--window-size={WINDOW[0]},{WINDOW[1]}", "--remote-debugging-address=127.0.0.1",
                      "--remote-debugging-port=0", "about:blank", own_session=True)
    # Chromium names its DevTools endpoint on stderr (our log file), not stdout.
    deadline = time.monotonic() + START_TIMEOUT
    log = procs.log_dir / "chromium.log"
    while time.monotonic() < deadline:
        found = re.search(r"DevTools listening on ws://([\d.]+:\d+)/", log.read_text(errors="replace"))
        if found:
            return f"http://{found.group(1)}"
        if procs.procs["chromium"].returncode is not None:
            break
        await asyncio.sleep(0.2)
    raise CheckFailed(f"chromium did not open its DevTools endpoint:\n{procs.log_tail('chromium')}")


async def browser_step(procs: Processes, session: aiohttp.ClientSession, chromium: str, url: str,
                       trainers: list[str], profile: Path, screenshot: Path) -> dict:
    endpoint = await open_browser(procs, chromium, profile)
    targets = await get_json(session, endpoint + "/json/list")
    page = next((t for t in targets if t.get("type") == "page"), None)
    if page is None:
        raise CheckFailed(f"chromium has no page to drive: {targets}")
    async with session.ws_connect(page["webSocketDebuggerUrl"], max_msg_size=64 * 1024 * 1024) as ws:
        tools = DevTools(ws)
        await tools.call("Emulation.setDeviceMetricsOverride", width=WINDOW[0], height=WINDOW[1],
                         deviceScaleFactor=1, mobile=False)
        await tools.call("Page.navigate", url=url)

        async def page_state() -> dict | None:
            return await tools.evaluate(PAGE_STATE)

        first = await wait_for("the page took no live update", PAGE_TIMEOUT,
                               lambda: _look(page_state, lambda s: s is not None and s["updates"] >= 1))

        async def matches_api() -> tuple[bool, dict]:
            state = await page_state()
            if state is None:
                raise CheckFailed("the page was reloaded or left while we watched it")
            api_peers = {p["peer_id"] for p in await get_json(session, url + "api/peers")}
            losses = loss_points(await get_json(session, url + "api/history"))
            at = [p for p in losses if p["time"] == state["loss_last_time"]]
            shown = [p for p in losses if state["loss_last_time"] is not None and p["time"] <= state["loss_last_time"]]
            checks = {
                "live_updates": state["updates"] >= first["updates"] + MIN_UPDATES,
                "peers_table_is_the_api's": set(state["peers"]) == api_peers,
                "every_trainer_in_the_table": set(trainers) <= set(state["peers"]),
                "loss_chart_grew": state["loss_points"] > first["loss_points"],
                "loss_points": state["loss_points"] >= MIN_LOSS_POINTS
                and state["loss_points"] == state["loss_path_commands"] == len(shown),
                "last_loss_is_the_api's": len(at) == 1 and math.isclose(at[0]["loss"], state["loss_last"],
                                                                       rel_tol=1e-12),
            }
            return all(checks.values()), {"checks": checks, "page": state, "api_peers": sorted(api_peers),
                                          "api_loss_points": len(losses)}

        seen = await wait_for("the page did not show the API's numbers", PAGE_TIMEOUT, matches_api)
        shot = await tools.call("Page.captureScreenshot", format="png")
        screenshot.parent.mkdir(parents=True, exist_ok=True)
        screenshot.write_bytes(base64.b64decode(shot["data"]))
    state = seen["page"]
    return {"updates_seen": state["updates"] - first["updates"], "peers_in_table": len(state["peers"]),
            "peers_online_shown": state["peers_online"], "epoch_shown": state["epoch"],
            "loss_points": {"first": first["loss_points"], "last": state["loss_points"]},
            "last_loss": state["loss_last"], "contributors_shown": len(state["contributors"]),
            "screenshot": str(screenshot)}


async def _look(read: Callable[[], Awaitable[dict | None]],
                done: Callable[[dict | None], bool]) -> tuple[bool, dict | None]:
    state = await read()
    return done(state), state


async def check(log_dir: Path, chromium: str, screenshot: Path, summary: dict) -> None:
    """Run the steps, filling `summary` as they end (what ended stays there if the deadline hits)."""
    procs = Processes(log_dir, STOP_GRACE)
    try:
        async with aiohttp.ClientSession() as session:
            swarm = await run_step(summary, "swarm", lambda: start_swarm(procs))
            if swarm is None:
                return

            async def monitor() -> dict:
                url = await start_monitor(procs, swarm["initial_peer"], log_dir / "ledger.db")
                seen = await wait_for_data(session, url, swarm["trainers"])
                return {"url": url, **seen}
            found = await run_step(summary, "monitor", monitor)
            if found is not None:
                await run_step(summary, "browser", lambda: browser_step(
                    procs, session, chromium, found["url"], swarm["trainers"], log_dir / "chromium-profile",
                    screenshot))
    finally:
        await procs.stop_all()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--screenshot", default=str(ROOT / "docs" / "dashboard.png"), metavar="PATH",
                        help="where to save the dashboard's screenshot (default: docs/dashboard.png)")
    parser.add_argument("--keep-logs", metavar="DIR", help="keep the processes' logs and the ledger here (default: "
                                                           "a temporary folder, removed at the end)")
    args = parser.parse_args()
    if not PYTHON.exists():
        print(f"{PROG}: {PYTHON} is missing: run ./scripts/test.sh or scripts/venv.sh first", file=sys.stderr)
        return 2
    stop_on_signals(PROG)
    start = time.monotonic()
    summary: dict = {"steps": {}}
    with log_folder(args.keep_logs, "dashboard-check-") as log_dir:
        try:
            summary["steps"]["chromium"] = {"ok": True, **ensure_chromium(),
                                            "seconds": round(time.monotonic() - start, 2)}
            asyncio.run(asyncio.wait_for(check(log_dir, summary["steps"]["chromium"]["path"],
                                               Path(args.screenshot).resolve(), summary), CHECK_DEADLINE))
        except (CheckFailed, TimeoutError, subprocess.TimeoutExpired) as e:
            summary["error"] = str(e) or f"the check did not finish within {CHECK_DEADLINE:.0f} s"
    return finish(PROG, summary, start, complete=len(summary["steps"]) == 4)


if __name__ == "__main__":
    sys.exit(main())
