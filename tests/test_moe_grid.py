"""Expert uids, DHT announcements and the beam search, on the emulated network in virtual time."""

from __future__ import annotations

import asyncio
import itertools
import random

import pytest

from potluck.cli.expert_server import expand_uids
from potluck.core.virtual_time import run_virtual
from potluck.moe.grid import ExpertLocation, GridDirectory, announce_experts, beam_search, grid_prefix, parse_uid
from tests.emulated_swarm import make_swarm


def test_uids_parse_into_a_name_and_grid_coordinates():
    assert parse_uid("ffn.3.14") == ("ffn", (3, 14))
    assert parse_uid("my.block.2") == ("my.block", (2,))
    assert parse_uid("solo") == ("solo", ())
    assert grid_prefix("ffn", (3,)) == "ffn.3." and grid_prefix("ffn.") == "ffn."
    for bad in ("", "3.4", "ffn..3", "ffn.3.", " ffn.1"):
        with pytest.raises(ValueError, match="malformed expert uid"):
            parse_uid(bad)


def test_uid_patterns_expand_to_grids():
    assert expand_uids(["ffn.[0:2].[1:3]"]) == ["ffn.0.1", "ffn.0.2", "ffn.1.1", "ffn.1.2"]
    assert expand_uids(["a.[0:2]", "a.1", "b.7"]) == ["a.0", "a.1", "b.7"]
    for bad in ("ffn.[2:2]", "ffn.[0:x]", "ffn..1", "ffn.[0:100000]"):
        with pytest.raises(ValueError):
            expand_uids([bad])


def brute_force(alive: set[tuple[int, int]], scores, b: int, k: int) -> list[tuple[int, int]]:
    ranked = sorted(alive, key=lambda c: -(scores[0][b][c[0]] + scores[1][b][c[1]]))
    return ranked[:k]


@pytest.mark.timeout(60)
def test_beam_search_returns_the_true_top_k_alive_experts_when_some_are_dead():
    grid, k = (6, 6), 4
    rng = random.Random(7)

    async def main():
        net, peers = await make_swarm(5)
        servers, client = peers[:4], peers[4]
        coords = list(itertools.product(range(grid[0]), range(grid[1])))
        rng.shuffle(coords)
        dead = set(coords[:14])  # their servers stopped refreshing: the announcements lapse
        now = client.dht.get_time()
        for i, server in enumerate(servers):
            mine = coords[i::len(servers)]
            for c in mine:
                location = ExpertLocation(f"ffn.{c[0]}.{c[1]}", server.transport.peer_id)
                ttl = 5.0 if c in dead else 600.0
                assert await announce_experts(server.dht, [location], now + ttl, timeout=10) > 0
        await asyncio.sleep(10.0)  # virtual time: the short announcements expire
        directory = GridDirectory(client.dht, cache_seconds=0.0, timeout=10)
        alive = set(coords) - dead
        server_ids = {s.transport.peer_id for s in servers}
        for trial in range(5):
            batch = 8
            scores = [[[rng.gauss(0, 1) for _ in range(g)] for _ in range(batch)] for g in grid]
            if trial == 0:  # the best coordinates of every dimension are dead: the search must go around them
                for b in range(batch):
                    scores[0][b][coords[0][0]] = scores[1][b][coords[0][1]] = 10.0
            found = await beam_search(directory.children, "ffn", scores, k, beam_size=2)
            for b in range(batch):
                uids = [loc.uid for _, loc in found[b]]
                expected = [f"ffn.{c[0]}.{c[1]}" for c in brute_force(alive, scores, b, k)]
                assert uids == expected
                for score, loc in found[b]:
                    c = parse_uid(loc.uid)[1]
                    assert score == pytest.approx(scores[0][b][c[0]] + scores[1][b][c[1]])
                    assert loc.peer_id in server_ids  # the id alone: the dial resolves its address
    run_virtual(main())


@pytest.mark.timeout(30)
def test_beam_search_returns_fewer_when_fewer_are_alive_and_ignores_garbage():
    children = {"ffn.": {0: 1, 5: 1}, "ffn.0.": {1: {"peer": "not a peer id"}, 2: "garbage"},
                "ffn.5.": {}}

    async def fetch(keys):
        return {key: children.get(key, {}) for key in keys}
    scores = [[[0.0] * 6], [[0.0] * 6]]
    assert asyncio.run(beam_search(fetch, "ffn", scores, 3)) == [[]]
