"""`AddressBook`: what a peer vouched for itself stays ahead of, and is never evicted by, hints."""

from __future__ import annotations

from potluck.net.address import Multiaddr
from potluck.net.address_book import MAX_ADDRESSES_PER_PEER, MAX_HINTS_PER_PEER, AddressBook
from potluck.net.identity import Identity

PEER = Identity.generate().peer_id
REAL = Multiaddr.parse("/ip4/10.0.0.1/tcp/4000")


def fakes(n: int) -> list[Multiaddr]:
    return [Multiaddr.parse(f"/ip4/192.0.2.{i}/tcp/9") for i in range(n)]


def test_a_flood_of_hints_never_pushes_out_a_vouched_address():
    book = AddressBook()
    book.add_vouched(PEER, [REAL])
    book.add_hints(PEER, fakes(3 * MAX_HINTS_PER_PEER))
    assert book.dial_order(PEER)[0] == REAL
    assert book.vouched(PEER) == [REAL]
    assert len(book.hints(PEER)) == MAX_HINTS_PER_PEER  # the per-peer cap still holds
    assert book.hints(PEER) == fakes(MAX_HINTS_PER_PEER)  # newest first: the given order, front first


def test_a_hint_the_peer_later_vouches_for_moves_ahead_and_is_not_listed_twice():
    book = AddressBook()
    book.add_hints(PEER, [REAL, *fakes(2)])
    assert book.vouched(PEER) == []
    book.add_vouched(PEER, [f"{REAL}/p2p/{PEER}"])  # the /p2p/ suffix is dropped
    assert book.dial_order(PEER) == [REAL, *fakes(2)]
    book.add_hints(PEER, [REAL])
    assert book.dial_order(PEER).count(REAL) == 1


def test_vouched_addresses_are_newest_first_and_capped():
    book = AddressBook()
    book.add_vouched(PEER, fakes(MAX_ADDRESSES_PER_PEER))
    book.add_vouched(PEER, [REAL])
    assert book.vouched(PEER)[0] == REAL
    assert len(book.vouched(PEER)) == MAX_ADDRESSES_PER_PEER
    assert PEER in book and Identity.generate().peer_id not in book
