"""Matchmaking's wire messages: each malformed field is refused by name, and a peer that sends
garbage (a join request, a DHT declaration) gets a clear error while the others still form groups."""

from __future__ import annotations

import asyncio
import os
from typing import Any

import pytest
import torch

from potluck.averaging import Averager
from potluck.averaging.allreduce import Group
from potluck.averaging.allreduce.group import MAX_GROUP_SIZE
from potluck.averaging.allreduce.messages import MAX_REASON_CHARS
from potluck.averaging.matchmaking import (
    JOIN_REPLY,
    MAX_METADATA_BYTES,
    MAX_SCHEMA_CHARS,
    Declaration,
    FormedGroup,
    JoinAccepted,
    JoinFailed,
    JoinMoved,
    JoinRefused,
    JoinRequest,
)
from potluck.core.errors import MalformedMessage, RemoteError
from potluck.core.names import RunNames
from potluck.core.virtual_time import run_virtual
from potluck.dht import own_subkey
from potluck.net.identity import PeerID
from tests.emulated_swarm import make_swarm


def peer_ids(n: int) -> list[PeerID]:
    return [PeerID(os.urandom(32)) for _ in range(n)]


def refuses(parse: Any, wire: Any, field: str) -> None:
    """`parse(wire)` raises MalformedMessage whose field names `field` first."""
    with pytest.raises(MalformedMessage) as caught:
        parse(wire)
    assert caught.value.field.startswith(field), caught.value.field


def test_join_request_refuses_malformed_fields_by_name():
    good = JoinRequest("run.grads/epoch3.0/all", "schema", "node", (1e8, 5e7), {"samples": 3}, again=0.5)
    assert JoinRequest.from_wire(good.to_wire()) == good
    refuses(JoinRequest.from_wire, ["key"], "not a map")
    for key, value, field in (("key", 7, "'key'"), ("key", "k" * 513, "'key'"), ("schema", None, "'schema'"),
                              ("schema", "s" * (MAX_SCHEMA_CHARS + 1), "'schema'"),
                              ("role", "boss", "'role'"), ("bw", [1.0], "'bw'"), ("bw", [1.0, float("inf")], "'bw'"),
                              ("bw", [0, 1.0], "'bw'"), ("bw", "fast", "'bw'"), ("again", -1, "'again'"),
                              ("again", True, "'again'"), ("meta", "x" * (MAX_METADATA_BYTES + 1), "'meta'")):
        refuses(JoinRequest.from_wire, {**good.to_wire(), key: value}, field)


def test_declaration_refuses_malformed_fields_by_name():
    good = Declaration("a" * 32)
    assert Declaration.from_wire(good.to_wire()) == good
    assert "addrs" not in good.to_wire()  # peers are found by id, through their own signed records
    refuses(Declaration.from_wire, "declared", "not a map")
    for key, value, field in (("schema", None, "'schema'"), ("schema", "a" * (MAX_SCHEMA_CHARS + 1), "'schema'")):
        refuses(Declaration.from_wire, {**good.to_wire(), key: value}, field)


def a_group(total: int = 100) -> tuple[FormedGroup, PeerID]:
    peers = peer_ids(3)
    group = Group(os.urandom(16), tuple(peers), ("node", "client", "aux"), (60, 0, 40))
    return FormedGroup(group, ({"samples": 3}, None, 1.5), ((1e6, 2e6), (1e6, 1e6), (3e6, 3e6))), peers[1]


def test_group_announcement_refuses_malformed_fields_by_name():
    good, me = a_group()
    assert FormedGroup.from_wire(good.to_wire(), me=me, total=100) == good
    wire = good.to_wire()
    parse = lambda w: FormedGroup.from_wire(w, me=me, total=100)  # noqa: E731
    refuses(parse, [wire], "not a map")
    refuses(lambda w: FormedGroup.from_wire(w, me=peer_ids(1)[0], total=100), wire, "'g': 'peers'")  # not a member
    refuses(lambda w: FormedGroup.from_wire(w, me=me, total=99), wire, "'g': 'parts'")  # other tensors than ours
    peers = wire["g"]["peers"]
    for key, value, field in (  # the group's own fields
            ("id", "group", "'id'"), ("id", b"g" * 65, "'id'"),
            ("peers", None, "'peers'"), ("peers", [*peers[:2], b"short"], "'peers'"),
            ("peers", [peers[0], me.to_bytes(), peers[0]], "'peers'"),
            ("peers", [me.to_bytes()] + [os.urandom(32) for _ in range(MAX_GROUP_SIZE)], "'peers'"),
            ("roles", ["node", "client"], "'roles'"), ("roles", ["node", "client", "boss"], "'roles'"),
            ("parts", [60, 0], "'parts'"), ("parts", [60, 0, 30], "'parts'"), ("parts", [110, 0, -10], "'parts'"),
            ("parts", [60, True, 39], "'parts'"), ("parts", [50, 10, 40], "'parts'")):  # a client cannot reduce
        refuses(parse, {**wire, "g": {**wire["g"], key: value}}, f"'g': {field}")
    for key, value, field in (
            ("meta", [None, None], "'meta'"), ("meta", [None, None, "x" * (MAX_METADATA_BYTES + 1)], "'meta'"),
            ("bw", [[1e6, 1e6]] * 2, "'bw'"), ("bw", [[1e6, 1e6], [1e6], [1e6, 1e6]], "'bw'"),
            ("bw", [[1e6, 1e6], [1e6, -1.0], [1e6, 1e6]], "'bw'")):
        refuses(parse, {**wire, key: value}, field)


def test_join_reply_refuses_malformed_fields_by_name():
    formed, me = a_group()
    for reply in (JoinAccepted(formed), JoinFailed("only 1 peer(s) gathered"), JoinMoved(formed.group.peers[1]),
                  JoinRefused("group is full or already formed", tuple(formed.group.peers)), JoinRefused("no", ())):
        assert JOIN_REPLY.from_wire(reply.to_wire(), me=me, total=100) == reply
    parse = lambda w: JOIN_REPLY.from_wire(w, me=me, total=100)  # noqa: E731
    refuses(parse, None, "not a map")
    wire = formed.to_wire()
    refuses(parse, {"group": {**wire, "g": {**wire["g"], "id": None}}}, "'group': 'g': 'id'")  # the group's own checks
    refuses(parse, {"failed": 7}, "'failed'")
    refuses(parse, {"failed": "x" * (MAX_REASON_CHARS + 1)}, "'failed'")
    refuses(parse, {"moved": "someone"}, "'moved'")
    refuses(parse, {"refused": None, "taken": []}, "'refused'")
    refuses(parse, {"refused": "full"}, "'taken'")
    refuses(parse, {"refused": "full", "taken": [b"short"]}, "'taken'")
    refuses(parse, {"refused": "full", "taken": [os.urandom(32)] * (MAX_GROUP_SIZE + 1)}, "'taken'")


@pytest.mark.timeout(60)
def test_malformed_join_requests_get_a_clear_error_and_the_leader_still_forms_its_group():
    async def main():
        net, peers = await make_swarm(4)
        rogue = peers[3].transport
        avgs = [Averager(p, [torch.full((8,), float(i))], "garbled", matchmaking_time=1.0)
                for i, p in enumerate(peers[:3])]
        steps = asyncio.gather(*(a.astep(timeout=20) for a in avgs))
        await asyncio.sleep(0.3)  # the gathering is open now
        errors = []
        for garbage in ("join me", {"key": "all", "schema": avgs[0].schema, "role": "node", "bw": [1e8]},
                        {**JoinRequest("all", avgs[0].schema, "node", (1e8, 1e8)).to_wire(), "meta": "x" * 10**6}):
            for p in peers[:3]:
                with pytest.raises(RemoteError) as caught:
                    await rogue.call(p.transport.peer_id, RunNames("garbled").averager("tensors").join, garbage, timeout=5)
                errors.append(str(caught.value))
        assert all("MalformedMessage" in e and "malformed join request" in e for e in errors)
        assert any("'bw'" in e for e in errors) and any("'meta'" in e for e in errors)
        results = await steps
        assert [r.group_size for r in results] == [3, 3, 3]
        assert all(torch.equal(a._tensors[0], torch.full((8,), 1.0)) for a in avgs)
    run_virtual(main())


@pytest.mark.timeout(60)
def test_a_target_given_as_a_function_is_asked_again_while_the_group_gathers():
    """A caller that learns the group's size during the window (a view that settles) closes the
    group then: three peers with a 4 s window, whose target says "unknown" until 1 s in and 3
    from then on, form their group of three about 1 s in; a fixed unknown target waits out the
    window."""
    async def main(target: Any) -> tuple[list[int], float]:
        _, peers = await make_swarm(3)
        avgs = [Averager(p, [torch.full((8,), float(i))], "asked", matchmaking_time=4.0) for i, p in enumerate(peers)]
        loop = asyncio.get_running_loop()
        start = loop.time()
        results = await asyncio.gather(*(a.astep(timeout=20, target_group_size=target(start)) for a in avgs))
        return [r.group_size for r in results], loop.time() - start

    sizes, took = run_virtual(main(lambda start: lambda: 3 if asyncio.get_running_loop().time() - start >= 1.0 else None))
    assert sizes == [3, 3, 3] and 1.0 <= took < 1.5, took
    sizes, took = run_virtual(main(lambda start: None))
    assert sizes == [3, 3, 3] and took >= 4.0, took


@pytest.mark.timeout(60)
def test_a_malformed_declaration_in_the_dht_is_ignored():
    """A record under the group key that declares garbage, stored before anyone else's (so it would
    lead), is skipped: the honest peers form their group without it."""
    async def main():
        net, peers = await make_swarm(4)
        rogue = peers[3]
        avgs = [Averager(p, [torch.full((8,), float(i))], "declared", matchmaking_time=1.0)
                for i, p in enumerate(peers[:3])]
        bogus = {"schema": ["not a schema"] * 100}
        assert await rogue.dht.astore(RunNames("declared").averager("tensors").declarations("all"), bogus, rogue.dht.get_time() + 0.5,
                                      subkey=own_subkey(rogue.transport.peer_id))
        results = await asyncio.gather(*(a.astep(timeout=20) for a in avgs))
        assert [r.group_size for r in results] == [3, 3, 3]
        assert str(rogue.transport.peer_id) not in results[0].peers
    run_virtual(main())


async def three_peers_and_a_hostile_leader(run_id: str, answer: Any) -> tuple[list[Averager], Any, list]:
    """Three honest averagers and a fourth peer declared first under their key (so it leads), that
    answers every join request with `answer(ctx)`; returns the averagers, that peer, and who asked it."""
    net, peers = await make_swarm(4)
    rogue = peers[3]
    avgs = [Averager(p, [torch.full((8,), float(i))], run_id, matchmaking_time=1.0) for i, p in enumerate(peers[:3])]
    asked: list = []

    async def hostile(request: Any, ctx: Any) -> dict:
        asked.append(ctx.peer_id)
        return answer(ctx)

    rogue.transport.add_handler(RunNames(run_id).averager("tensors").join, hostile)
    assert await rogue.dht.astore(RunNames(run_id).averager("tensors").declarations("all"), Declaration(avgs[0].schema).to_wire(),
                                  rogue.dht.get_time() + 0.9, subkey=own_subkey(rogue.transport.peer_id))
    return avgs, rogue, asked


@pytest.mark.timeout(60)
def test_peers_skip_a_leader_that_answers_with_a_malformed_group(caplog):
    """A hostile peer declares itself first and answers every join with a broken group: each
    follower logs what was wrong, tries the next leader, and the honest peers still group."""
    async def main():
        avgs, rogue, asked = await three_peers_and_a_hostile_leader("hostile", lambda ctx: {"group": {"g": {"id": "not bytes"}}})
        with caplog.at_level("WARNING", logger="potluck.averaging.matchmaking"):
            results = await asyncio.gather(*(a.astep(timeout=20) for a in avgs))
        assert [r.group_size for r in results] == [3, 3, 3]
        assert asked, "nobody asked the hostile leader, so the test proves nothing"
        assert any("malformed join reply: 'group': 'g': 'id'" in r.getMessage() for r in caplog.records)
    run_virtual(main())


@pytest.mark.timeout(60)
def test_a_leader_that_sees_an_earlier_leader_late_hands_its_followers_over():
    """The earliest peer's declaration reaches the DHT late (a slow store), after a later peer
    has already taken a follower: that leader hands its follower over to the earlier one and
    joins it too, so the key's three peers form one group, not a pair and a peer alone."""
    async def main():
        net, peers = await make_swarm(4)
        first = peers[0]
        store = first.dht.astore

        async def slow_declaration(key: str, *args: Any, **kwargs: Any) -> Any:
            if ".match." in key:
                await asyncio.sleep(0.3)  # its window runs from before this
            return await store(key, *args, **kwargs)

        first.dht.astore = slow_declaration
        avgs = [Averager(p, [torch.full((8,), float(i))], "late", matchmaking_time=1.0)
                for i, p in enumerate(peers[:3])]
        handed = []
        for a in avgs:
            hand_over = a.matchmaker._hand_over
            a.matchmaker._hand_over = lambda g, leader, h=hand_over: (handed.append(leader), h(g, leader))

        async def start(i: int) -> Any:
            await asyncio.sleep(0.01 * i)  # peers[0] first: its declaration expires first
            return await avgs[i].astep(timeout=20)

        results = await asyncio.gather(*(start(i) for i in range(3)))
        assert handed == [first.transport.peer_id], "nobody led before seeing the first peer: the test proves nothing"
        assert [r.group_size for r in results] == [3, 3, 3]
        assert all(torch.equal(a._tensors[0], torch.full((8,), 1.0)) for a in avgs)
    run_virtual(main())


@pytest.mark.timeout(60)
def test_peers_follow_a_hostile_leaders_hand_over_only_so_far_and_still_group():
    """A hostile peer declares itself first and answers every join by handing the follower over
    to the latest honest peer: followers go there, that peer hands them on to the earliest
    honest leader, and the three honest peers still form one group."""
    async def main():
        avgs, rogue, asked = await three_peers_and_a_hostile_leader(
            "moved", lambda ctx: JoinMoved(avgs[2].transport.peer_id).to_wire())

        async def start(i: int) -> Any:
            await asyncio.sleep(0.01 * i)
            return await avgs[i].astep(timeout=20)

        results = await asyncio.gather(*(start(i) for i in range(3)))
        assert asked, "nobody asked the hostile leader, so the test proves nothing"
        assert [r.group_size for r in results] == [3, 3, 3]
        assert str(rogue.transport.peer_id) not in results[0].peers
    run_virtual(main())


@pytest.mark.timeout(60)
def test_followers_handed_over_to_a_peer_that_refuses_them_regroup_without_it():
    """A hostile peer's declaration lands late but earliest, so the leader that already has a
    follower hands it over; the hostile peer refuses everyone, and the honest three still group."""
    async def main():
        net, peers = await make_swarm(4)
        rogue = peers[0]
        avgs = [Averager(p, [torch.full((8,), float(i))], "refusing", matchmaking_time=1.0)
                for i, p in enumerate(peers[1:])]
        asked = []

        async def refuse(request: Any, ctx: Any) -> dict:
            asked.append(ctx.peer_id)
            return JoinRefused("not today", ()).to_wire()

        rogue.transport.add_handler(RunNames("refusing").averager("tensors").join, refuse)
        expires = rogue.dht.get_time() + 0.9  # before every honest peer's window ends: it would lead

        async def declare_late() -> None:
            await asyncio.sleep(0.3)  # after the honest peers have grouped up
            assert await rogue.dht.astore(RunNames("refusing").averager("tensors").declarations("all"), Declaration(avgs[0].schema).to_wire(), expires,
                                          subkey=own_subkey(rogue.transport.peer_id))

        async def start(i: int) -> Any:
            await asyncio.sleep(0.01 * i)
            return await avgs[i].astep(timeout=20)

        results, _ = await asyncio.gather(asyncio.gather(*(start(i) for i in range(3))), declare_late())
        assert asked, "nobody was handed over to the hostile peer, so the test proves nothing"
        assert [r.group_size for r in results] == [3, 3, 3]
        assert all(torch.equal(a._tensors[0], torch.full((8,), 1.0)) for a in avgs)
    run_virtual(main())
