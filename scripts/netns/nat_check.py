#!/usr/bin/env python3
"""The real-network NAT check of issue 16, in Linux network namespaces (run as root).

Topology (every namespace is named PREFIX + role; the whole set is removed at the end, whatever
happens, and leftovers of an earlier crashed run are removed first):

    relay 198.51.100.1 ─┐                 ┌─ boot 198.51.100.4
                        ├─ inet (a bridge: the "internet", 198.51.100.0/24)
    nat-a 198.51.100.2 ─┤                 ├─ nat-b 198.51.100.3
      │ MASQUERADE,                       │  (the same)
      │ drops unsolicited                 │
      ├─ a1 10.1.0.11    nat-c 198.51.100.5 ─┐ (random ports)    ├─ b1 10.2.0.11
      └─ a2 10.1.0.12                        └─ c1 10.3.0.11     └─ b2 10.2.0.12

The routers behave like home routers: outgoing connections are masqueraded, and anything
arriving on the WAN side that does not belong to a connection started inside is dropped. nat-a
and nat-b keep a connection's source port when it is free (Linux's default: an endpoint-
independent, port-preserving mapping, which hole punching needs); nat-c picks a random port for
every connection (`--random-fully`: like a symmetric NAT, where punching cannot work).

Steps, each reported in the JSON summary printed at the end (exit status 1 if one failed):
  tcp_sanity  plain TCP: a NATed host reaches the public one and is seen as its router's
              address; nobody outside can open a connection to a NATed host.
  public      `potluck peer` starts on boot and `potluck peer --relay` on relay; both are the
              others' initial peers.
  expert      a1 hosts an expert (`potluck expert-server`); b1 and c1, behind the other NATs,
              call it (forward and backward, answers checked against a local copy) and report
              whether their connection ended up direct (hole punched) or relayed: b1's must end
              direct, c1's relayed (the punch fails and the relay keeps working).
  state       a2 donates averaged state (potluck.Averager); b2, a newcomer behind the other NAT,
              downloads it and checks every value.

Usage: sudo .venv/bin/python scripts/netns/nat_check.py [--keep-logs DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # scripts/checks_common.py
from checks_common import PYTHON, CheckFailed, Processes, finish, log_folder, run_step, stop_on_signals  # noqa: E402

PROG = "nat_check"

# Every namespace this check makes starts with this; leftovers with it are removed before a run.
PREFIX = "potluck-nat-"
PUBLIC_NET = "198.51.100"  # TEST-NET-2: a documentation range, never routed anywhere real
PUBLIC_HOSTS = {"relay": f"{PUBLIC_NET}.1", "boot": f"{PUBLIC_NET}.4"}
PEER_PORT = 4001
PROBE_PORT = 4000
EXPERT_UID = "natcheck.0"
EXPERT_HIDDEN = 32
RUN_ID = "natcheck"
# Who calls a1's expert, and how its connection must end: b1's NAT keeps ports (punching works),
# c1's picks random ones (punching fails; the relay carries the calls).
EXPECTED_PATH = {"b1": "direct", "c1": "relayed"}

# Deadlines (every wait has one; the whole check stays well under five minutes).
CHECK_DEADLINE = 240.0  # the whole check, topology to summary
COMMAND_TIMEOUT = 20.0  # one ip / iptables / apt-get step (apt-get gets INSTALL_TIMEOUT)
INSTALL_TIMEOUT = 180.0  # apt-get update + install iptables on a fresh CI machine
PROBE_TIMEOUT = 2.0  # a plain TCP connect that must fail: dropped SYNs hang until this
START_TIMEOUT = 60.0  # a potluck process getting ready (imports torch, joins, reserves a relay slot)
TASK_TIMEOUT = 90.0  # a client role finishing its calls or download (retries inside)
STOP_GRACE = 5.0  # SIGTERM to SIGKILL for our processes


@dataclass
class Site:
    """A private network behind a NAT router."""

    router: str
    public_ip: str
    subnet: str  # first three octets; the router is .1
    hosts: dict[str, str] = field(default_factory=dict)  # namespace -> address
    random_ports: bool = False  # a fresh random port per connection (symmetric-like) instead of keeping it


SITES = [Site("nat-a", f"{PUBLIC_NET}.2", "10.1.0", {"a1": "10.1.0.11", "a2": "10.1.0.12"}),
         Site("nat-b", f"{PUBLIC_NET}.3", "10.2.0", {"b1": "10.2.0.11", "b2": "10.2.0.12"}),
         Site("nat-c", f"{PUBLIC_NET}.5", "10.3.0", {"c1": "10.3.0.11"}, random_ports=True)]
HOST_IP = {name: ip for site in SITES for name, ip in site.hosts.items()} | PUBLIC_HOSTS


TOOLS = {"ip": "iproute2", "iptables": "iptables"}  # command -> the Debian package that has it


def ns(name: str) -> str:
    return PREFIX + name


def sh(*args: str, timeout: float = COMMAND_TIMEOUT) -> str:
    result = subprocess.run(args, capture_output=True, text=True, timeout=timeout)
    if result.returncode != 0:
        raise CheckFailed(f"`{' '.join(args)}` failed: {result.stderr.strip() or result.stdout.strip()}")
    return result.stdout


def in_ns(name: str, *args: str) -> str:
    return sh("ip", "netns", "exec", ns(name), *args)


# -- topology -----------------------------------------------------------------------------------------
def ensure_tools() -> None:
    """Install what a fresh CI machine may lack (Debian packages)."""
    missing = [package for tool, package in TOOLS.items() if shutil.which(tool) is None]
    if missing:
        print(f"{PROG}: installing {' '.join(missing)}", file=sys.stderr, flush=True)
        os.environ["DEBIAN_FRONTEND"] = "noninteractive"
        sh("apt-get", "update", "-qq", timeout=INSTALL_TIMEOUT)
        sh("apt-get", "install", "-y", "-qq", *missing, timeout=INSTALL_TIMEOUT)


def our_namespaces() -> list[str]:
    listed = sh("ip", "netns", "list")
    return [line.split()[0] for line in listed.splitlines() if line.startswith(PREFIX)]


def remove_namespaces() -> None:
    """Kill what runs in our namespaces (ours, or an earlier crashed run's) and delete them."""
    names = our_namespaces()
    pids = [int(p) for name in names for p in sh("ip", "netns", "pids", name).split()]
    for sig, wait in ((signal.SIGTERM, STOP_GRACE), (signal.SIGKILL, 1.0)):
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and any(_alive(p) for p in pids):
            time.sleep(0.1)
    for name in names:
        subprocess.run(["ip", "netns", "delete", name], capture_output=True, timeout=COMMAND_TIMEOUT)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def link(a: str, a_if: str, b: str, b_if: str) -> None:
    sh("ip", "link", "add", "name", a_if, "netns", ns(a), "type", "veth", "peer", "name", b_if, "netns", ns(b))


def up(name: str, *interfaces: str) -> None:
    for interface in ("lo", *interfaces):
        sh("ip", "-n", ns(name), "link", "set", interface, "up")


def build_topology() -> None:
    names = ["inet", *PUBLIC_HOSTS] + [s.router for s in SITES] + [h for s in SITES for h in s.hosts]
    for name in names:
        sh("ip", "netns", "add", ns(name))
    sh("ip", "-n", ns("inet"), "link", "add", "name", "br0", "type", "bridge")
    up("inet", "br0")
    # the public segment
    for name, ip in [*PUBLIC_HOSTS.items()] + [(s.router, s.public_ip) for s in SITES]:
        port = f"to-{name}"
        inside = "eth0" if name in PUBLIC_HOSTS else "wan"
        link("inet", port, name, inside)
        sh("ip", "-n", ns("inet"), "link", "set", port, "master", "br0")
        up("inet", port)
        sh("ip", "-n", ns(name), "addr", "add", f"{ip}/24", "dev", inside)
        up(name, inside)
    # the private networks
    for site in SITES:
        r = site.router
        sh("ip", "-n", ns(r), "link", "add", "name", "lan", "type", "bridge")
        sh("ip", "-n", ns(r), "addr", "add", f"{site.subnet}.1/24", "dev", "lan")
        up(r, "lan")
        for host, ip in site.hosts.items():
            port = f"to-{host}"
            link(r, port, host, "eth0")
            sh("ip", "-n", ns(r), "link", "set", port, "master", "lan")
            up(r, port)
            sh("ip", "-n", ns(host), "addr", "add", f"{ip}/24", "dev", "eth0")
            up(host, "eth0")
            sh("ip", "-n", ns(host), "route", "add", "default", "via", f"{site.subnet}.1")
        in_ns(r, "sh", "-c", "echo 1 > /proc/sys/net/ipv4/ip_forward")  # per namespace
        rules = [["-t", "nat", "-A", "POSTROUTING", "-o", "wan", "-j", "MASQUERADE",
                  *(["--random-fully"] if site.random_ports else [])]]
        for chain in ("INPUT", "FORWARD"):  # a home router: only answers to what was started inside
            rules += [["-A", chain, "-i", "wan", "-m", "conntrack", "--ctstate", "ESTABLISHED,RELATED",
                       "-j", "ACCEPT"],
                      ["-A", chain, "-i", "wan", "-j", "DROP"]]
        for rule in rules:
            in_ns(r, "iptables", *rule)


# -- processes ----------------------------------------------------------------------------------------
async def spawn(procs: Processes, name: str, host: str, *args: str) -> None:
    """Our Python with `args` in `host`'s namespace."""
    await procs.spawn(name, "ip", "netns", "exec", ns(host), str(PYTHON), *args, stdin=asyncio.subprocess.PIPE)


async def result(procs: Processes, name: str, timeout: float) -> dict:
    """A node.py role's final JSON line."""
    line = await procs.read_until(name, lambda s: s.startswith("{"), timeout)
    return json.loads(line)


# -- steps ----------------------------------------------------------------------------------------------
async def probe(procs: Processes, name: str, host: str, target: str, port: int) -> dict:
    await spawn(procs, name, host, str(HERE / "probe.py"), "connect", target, str(port), str(PROBE_TIMEOUT))
    return await result(procs, name, PROBE_TIMEOUT + 10)


async def tcp_sanity(procs: Processes) -> dict:
    """A NATed host reaches the relay host and is seen as its router; nobody reaches it unasked."""
    site_a = SITES[0]
    for name, host in (("listen-relay", "relay"), ("listen-a1", "a1")):
        await spawn(procs, name, host, str(HERE / "probe.py"), "listen", HOST_IP[host], str(PROBE_PORT), "60")
        await procs.read_until(name, lambda s: s == "listening", 10)
    out = await probe(procs, "a1-to-relay", "a1", HOST_IP["relay"], PROBE_PORT)
    if not out["ok"]:
        raise CheckFailed(f"a1 (behind NAT) could not reach the public host: {out['error']}")
    if not out["seen_as"].startswith(site_a.public_ip + ":"):
        raise CheckFailed(f"a1 reached the public host as {out['seen_as']}, not as its router {site_a.public_ip}")
    refused = {}
    for name, host, target in (("relay-to-nat-a", "relay", site_a.public_ip), ("relay-to-a1", "relay", HOST_IP["a1"]),
                               ("b1-to-nat-a", "b1", site_a.public_ip)):
        answer = await probe(procs, name, host, target, PROBE_PORT)
        if answer["ok"]:
            raise CheckFailed(f"{host} opened a connection to {target}:{PROBE_PORT} behind NAT A: the NAT lets "
                              "unsolicited connections in")
        refused[f"{host}->{target}"] = answer["error"]
    return {"a1_seen_by_relay_as": out["seen_as"], "unsolicited_refused": refused}


async def start_public(procs: Processes, host: str, *options: str) -> str:
    """A public `potluck peer` on `host`; its address."""
    await spawn(procs, host, host, "-m", "potluck", "-v", "peer", "--host", HOST_IP[host], "--port", str(PEER_PORT),
                *options)
    line = await procs.read_until(host, lambda s: s.startswith("--initial-peers") and HOST_IP[host] in s,
                                  START_TIMEOUT)
    return line.split()[1]


async def public_peers(procs: Processes) -> list[str]:
    boot = await start_public(procs, "boot")
    return [boot, await start_public(procs, "relay", "--relay", "--initial-peers", boot)]


async def expert_step(procs: Processes, initial: list[str]) -> dict:
    await spawn(procs, "expert-server", "a1", "-m", "potluck", "-v", "expert-server", "--experts", EXPERT_UID,
                "--hidden", str(EXPERT_HIDDEN), "--optimizer", "none", "--seed", "0",
                "--host", HOST_IP["a1"], "--initial-peers", *initial)
    await procs.read_until("expert-server", lambda s: s.startswith("ready"), START_TIMEOUT)

    async def call_from(host: str) -> dict:
        await spawn(procs, f"caller-{host}", host, str(HERE / "node.py"), "call-expert", "--host", HOST_IP[host],
                    "--initial-peers", *initial, "--uid", EXPERT_UID, "--hidden", str(EXPERT_HIDDEN),
                    "--timeout", str(TASK_TIMEOUT))
        report = await result(procs, f"caller-{host}", TASK_TIMEOUT + 30)
        if report["ok"] and report["path"] != EXPECTED_PATH[host]:
            report |= {"ok": False, "error": f"the connection ended {report['path']}, expected "
                                             f"{EXPECTED_PATH[host]}"}
        return report

    reports = dict(zip(EXPECTED_PATH, await asyncio.gather(*map(call_from, EXPECTED_PATH)), strict=True))
    return {"ok": all(r["ok"] for r in reports.values()), **reports}


async def state_step(procs: Processes, initial: list[str]) -> dict:
    await spawn(procs, "donor", "a2", str(HERE / "node.py"), "donate", "--host", HOST_IP["a2"],
                "--initial-peers", *initial, "--run-id", RUN_ID, "--timeout", str(START_TIMEOUT))
    line = await procs.read_until("donor", lambda s: s.startswith(("ready", "{")), START_TIMEOUT + 10)
    if line.startswith("{"):
        raise CheckFailed(f"the donor failed: {json.loads(line)['error']}")
    await spawn(procs, "newcomer", "b2", str(HERE / "node.py"), "download", "--host", HOST_IP["b2"],
                "--initial-peers", *initial, "--run-id", RUN_ID, "--timeout", str(TASK_TIMEOUT))
    return await result(procs, "newcomer", TASK_TIMEOUT + 30)


async def check(log_dir: Path, summary: dict) -> None:
    """Run the steps, filling `summary` as they end (what ended stays there if the deadline hits)."""
    procs = Processes(log_dir, STOP_GRACE)
    try:
        await run_step(summary, "topology", lambda: asyncio.to_thread(build_topology))
        if summary["steps"]["topology"]["ok"]:
            await run_step(summary, "tcp_sanity", lambda: tcp_sanity(procs))
            initial = await run_step(summary, "public", lambda: public_peers(procs))
            if initial is not None:
                await asyncio.gather(run_step(summary, "expert", lambda: expert_step(procs, initial)),
                                     run_step(summary, "state", lambda: state_step(procs, initial)))
    finally:
        await procs.stop_all()
        summary["hole_punches"] = punch_reports(log_dir)


PUNCH_LOG = "INFO potluck.net.holepunch: "  # as the CLI and node.py format their log lines


def punch_reports(log_dir: Path) -> dict[str, list[str]]:
    """What the peers logged about hole punches (net.holepunch: each one's outcome and time)."""
    found = {}
    for path in sorted(log_dir.glob("*.log")):
        lines = [line.split(PUNCH_LOG, 1)[1] for line in path.read_text(errors="replace").splitlines()
                 if PUNCH_LOG in line]
        if lines:
            found[path.stem] = lines
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keep-logs", metavar="DIR", help="keep the processes' logs here (default: a temporary "
                                                           "folder, removed at the end)")
    args = parser.parse_args()
    if os.geteuid() != 0:
        print(f"{PROG}: needs root (it creates network namespaces and NAT rules)", file=sys.stderr)
        return 2
    if not PYTHON.exists():
        print(f"{PROG}: {PYTHON} is missing: run ./scripts/test.sh or scripts/venv.sh first", file=sys.stderr)
        return 2
    stop_on_signals(PROG)
    start = time.monotonic()
    summary: dict = {"steps": {}}
    with log_folder(args.keep_logs, "nat-check-") as log_dir:
        try:
            ensure_tools()
            remove_namespaces()
            asyncio.run(asyncio.wait_for(check(log_dir, summary), CHECK_DEADLINE))
        except (CheckFailed, TimeoutError) as e:
            summary["error"] = str(e) or f"the check did not finish within {CHECK_DEADLINE:.0f} s"
        finally:
            remove_namespaces()
    return finish(PROG, summary, start, complete=bool(summary["steps"]))


if __name__ == "__main__":
    sys.exit(main())
