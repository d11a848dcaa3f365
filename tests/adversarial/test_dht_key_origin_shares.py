"""Made-up ids of one subnet cannot push every honest entry out of one DHT key, nor keep new
ones out.

A key's dictionary holds at most `DEFAULT_MAX_KEY_BYTES` (1 MiB). When it was full, the entries
expiring soonest went first, and an entry expiring sooner than everything held was refused: ids
of one /24 storing entries with the key kind's longest lifetime (a matchmaking declaration may
live 10 minutes; an honest one lives for its window, seconds) pushed out an honest declaration
already held and refused the next, so no honest group could form on that key; the same for
progress records (60 s against 3 s), donors and relays. Now the subnet holding the most of the
key pays first, as for the node's whole budget (the audit's figures: 2,334 made-up declarations
stored, then refused; the honest ones kept and stored)."""

from __future__ import annotations

import msgpack

from potluck.averaging.matchmaking import Declaration
from potluck.dht.records import Record, own_subkey
from potluck.dht.storage import Storage
from potluck.net.identity import Identity
from potluck.net.origins import Origin

NOW = 1000.0
KEY_ID = 7
KEY = "run.avg.tensors.match.epoch12.0/all"
HONEST = Origin("198.51.100.7", "198.51.100.0/24")
ATTACKER = Origin("203.0.113.9", "203.0.113.0/24")
VALUE = msgpack.packb(Declaration("0" * 32).to_wire(), use_bin_type=True)


def _store(storage: Storage, origin: Origin, lifetime: float) -> tuple[bool, str]:
    peer = Identity.generate().peer_id
    record = Record(KEY, own_subkey(peer), VALUE, NOW + lifetime, b"\0" * 64)
    return storage.store(KEY_ID, record, NOW, peer, origin), own_subkey(peer)


def _flood(storage: Storage) -> int:
    """Ten-minute declarations from made-up ids of one /24 until the key takes no more."""
    for n in range(20_000):
        if not _store(storage, ATTACKER, 600.0)[0]:
            return n
    raise AssertionError("the key never filled")


def test_a_subnet_filling_a_key_with_long_lived_entries_pushes_out_no_honest_entry():
    storage = Storage()
    stored, honest = _store(storage, HONEST, 5.0)
    assert stored
    made_up = _flood(storage)
    assert made_up > 1000  # it did fill the key
    assert honest in {r.subkey for r in storage.get(KEY_ID, NOW)}, "the honest declaration was pushed out"
    assert _store(storage, HONEST, 5.0)[0], "a new honest declaration was refused"
    assert not _store(storage, ATTACKER, 600.0)[0]  # the filler is still held to what it has


def test_an_honest_entry_finds_room_in_a_key_one_subnet_filled_first():
    storage = Storage()
    _flood(storage)
    assert _store(storage, HONEST, 3.0)[0]
