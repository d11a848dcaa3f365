"""Network origins and fair shares (`potluck.net.origins`): one host's identities share one quota."""

from __future__ import annotations

import pytest

from potluck.net.address import Multiaddr
from potluck.net.origins import Origin, Shares, origin_of


def test_an_origin_is_the_ip_and_its_subnet_and_names_stand_for_themselves():
    assert origin_of("203.0.113.7") == Origin("203.0.113.7", "203.0.113.0/24")
    assert origin_of(Multiaddr.tcp("203.0.113.7", 31337)) == origin_of("203.0.113.7")
    assert origin_of("::ffff:203.0.113.7") == origin_of("203.0.113.7")  # IPv4 seen through an IPv6 socket
    assert origin_of("2001:db8:1:2::7") == Origin("2001:db8:1:2::7", "2001:db8:1::/48")
    assert origin_of("peer-3") == Origin("peer-3", "peer-3")  # the emulated network's names
    assert Origin.relayed("R").subnet == "relay:R"


def test_made_up_identities_from_one_host_get_the_hosts_share_and_no_more():
    shares = Shares("relay circuits", 64, per_subnet=16, per_ip=8, per_peer=4)
    attacker, honest = origin_of("198.51.100.9"), origin_of("203.0.113.7")
    taken = 0
    for fake in range(1000):
        if shares.refusal(attacker, f"fake-{fake}") is None:
            shares.claim(attacker, f"fake-{fake}")
            taken += 1
    assert taken == 8 and "too many relay circuits from 198.51.100.9 (its share: 8 of 64)" in shares.refusal(attacker, "another")
    assert shares.refusal(honest, "honest") is None
    neighbour = origin_of("198.51.100.10")  # the same /24: the subnet's share is what is left
    for fake in range(1000):
        if shares.refusal(neighbour, f"n-{fake}") is None:
            shares.claim(neighbour, f"n-{fake}")
    assert shares.held_by(attacker) == 16 and shares.refusal(honest, "honest") is None
    for fake in range(8):
        shares.release(attacker, f"fake-{fake}")
    assert shares.held == 8 and shares.refusal(attacker, "again") is None


def test_shares_must_nest():
    with pytest.raises(ValueError):
        Shares("x", 8, per_subnet=4, per_ip=8, per_peer=1)
