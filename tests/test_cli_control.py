"""The `potluck` command's control flags and errors as a user meets them: -v/-q before or after the
subcommand, and one line (no traceback) for a mistake such as a port already in use."""

from __future__ import annotations

import ipaddress
import os
import socket
import sys

import pytest

from potluck.cli import build_parser
from potluck.cli.peer import join_addresses, routable_hosts
from tests import forkserver
from tests.conftest import ROOT


@pytest.mark.parametrize("argv", [["-v", "peer"], ["peer", "-v"], ["pipeline", "export", "d", "--out", "f", "-v"],
                                  ["-v", "ps", "worker", "--steps", "1"], ["ps", "worker", "--steps", "1", "-v"]])
def test_verbose_is_accepted_before_or_after_the_subcommand(argv):
    args = build_parser().parse_args(argv)
    assert args.verbose == 1 and not args.quiet


def test_quiet_is_accepted_and_the_default_is_neither():
    parser = build_parser()
    assert parser.parse_args(["peer", "-q"]).quiet and parser.parse_args(["-q", "peer"]).quiet
    plain = parser.parse_args(["peer"])
    assert not plain.quiet and not plain.verbose


@pytest.mark.timeout(60)
def test_a_port_in_use_is_one_line_without_a_traceback():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = forkserver.run([sys.executable, "-m", "potluck", "peer", "--host", "127.0.0.1", "--port", str(port)],
                              capture_output=True, text=True, cwd=ROOT, timeout=50,
                              env=dict(os.environ, PYTHONPATH=str(ROOT / "src")))
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 1 and len(lines) == 1, done.stderr
    assert lines[0].startswith("potluck peer: error:") and "--port" in lines[0] and "in use" in lines[0]


def test_a_peer_on_every_interface_prints_its_routable_addresses_before_loopback():
    own = ["/ip4/127.0.0.1/tcp/31337/p2p/PEER"]
    assert join_addresses(own, ["192.0.2.7", "fd00::2"], "0.0.0.0") == ["/ip4/192.0.2.7/tcp/31337/p2p/PEER", *own]
    assert join_addresses(own, ["192.0.2.7"], "127.0.0.1") == own  # listens on loopback only: nothing to add
    named = ["/ip4/192.0.2.7/tcp/1/p2p/P", "/ip4/127.0.0.1/tcp/1/p2p/P"]
    assert join_addresses(named, ["192.0.2.7"], "0.0.0.0") == named  # no address twice
    assert all(not ipaddress.ip_address(h).is_loopback for h in routable_hosts())
