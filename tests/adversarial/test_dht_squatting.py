"""Issue 14, "A DHT strangers cannot squat": per-peer dictionary entries in the DHT (state donors,
matchmaking declarations, progress, expert announcements) are owner-signed and read only as their
signer's. A stranger's entry written under another peer's subkey, unsigned or signed by the
stranger, with the longest expiry the DHT allows (so the later-expiration rule would keep it over
the honest re-announcements), neither displaces that peer's entry nor is read as it.

Everything runs on the emulated network in virtual time; the squats are stored before the honest
peers announce, so any honest write to the same subkey would be refused."""

from __future__ import annotations

import asyncio

import pytest
import torch

from potluck.averaging import Averager
from potluck.averaging.matchmaking import Declaration
from potluck.core.errors import AveragingError
from potluck.core.names import RunNames
from potluck.core.virtual_time import run_virtual
from potluck.dht import RecordRejected, owner_marker
from potluck.dht.key_kinds import KEY_KINDS
from potluck.moe.grid import ExpertLocation, GridDirectory, announce_experts
from potluck.optim.progress import ProgressTracker
from tests.emulated_swarm import add_peer, make_swarm

# As far ahead as the DHT lets anyone store (its maximum TTL is 24 hours).
SQUAT_TTL = 23 * 3600.0


async def squat(stranger, key, value, subkey) -> bool:
    """Store a squatting entry as far ahead as the nodes allow for its kind of key; True if it
    landed. False: the nodes refuse it outright (`dht.key_kinds`: an unsigned entry under a per-peer
    key), the first line of defence; what lands tests the readers, the second."""
    ttl = min([SQUAT_TTL] + [kind.max_ttl for kind in KEY_KINDS if kind.pattern.search(key)])
    try:
        return await stranger.dht.astore(key, value, stranger.dht.get_time() + ttl, subkey=subkey)
    except RecordRejected:
        return False


@pytest.mark.timeout(60)
def test_a_strangers_entry_under_a_donors_subkey_is_not_read_as_the_donor_and_newcomers_still_load():
    async def main():
        net, peers = await make_swarm(3)
        donors, stranger = peers[:2], peers[2]
        key = RunNames("squat").averager("tensors").donors
        for donor in donors:
            donor_id = donor.transport.peer_id
            # unsigned, under the donor's plain id (the old subkey), claiming a newer state in a broken shape
            await squat(stranger, key, {"version": "99"}, str(donor_id))
            # signed by the stranger, under a subkey that starts with the donor's id
            await squat(stranger, key, {"version": 99}, f"{donor_id}{owner_marker(stranger.transport.peer_id)}")
        avgs = [Averager(p, [torch.randn(64)], "squat", matchmaking_time=0.5) for p in donors]
        results = await asyncio.gather(*(a.astep(timeout=20) for a in avgs))
        assert [r.group_size for r in results] == [2, 2]  # each donor announces its state after the step

        newcomer = Averager(await add_peer(net, peers), [torch.zeros(64)], "squat")
        try:
            version, _ = await newcomer.aload_state_from_peers(timeout=20)
        except AveragingError as e:
            pytest.fail(f"the newcomer found no donor: {e}")
        assert version == 1 and torch.equal(newcomer._tensors[0], avgs[0]._tensors[0])
        found = await stranger.dht.aget(key, latest=True)
        for donor in donors:  # the donor's own entry is there, with its own version
            mine = found.value.get(owner_marker(donor.transport.peer_id))
            assert mine is not None and mine.value == {"version": 1}
    run_virtual(main())


@pytest.mark.timeout(60)
def test_declarations_squatted_under_other_peers_ids_do_not_stop_a_group_from_forming():
    """The stranger declares, in every honest peer's name, a gathering that closes in 23 hours: read
    as theirs, each honest peer would look later than every other, nobody would join anybody, and no
    group would form."""
    async def main():
        net, peers = await make_swarm(4)
        honest, stranger = peers[:3], peers[3]
        avgs = [Averager(p, [torch.full((8,), float(i))], "match", matchmaking_time=1.0)
                for i, p in enumerate(honest)]
        declared = Declaration(avgs[0].schema).to_wire()
        for p in honest:
            victim = p.transport.peer_id
            await squat(stranger, RunNames("match").averager("tensors").declarations("all"), declared, str(victim))
            await squat(stranger, RunNames("match").averager("tensors").declarations("all"), declared, f"{victim}{owner_marker(stranger.transport.peer_id)}")
        results = await asyncio.gather(*(a.astep(timeout=20) for a in avgs), return_exceptions=True)
        assert [getattr(r, "group_size", r) for r in results] == [3, 3, 3]
        assert all(torch.equal(a._tensors[0], torch.full((8,), 1.0)) for a in avgs)
    run_virtual(main())


@pytest.mark.timeout(60)
def test_a_progress_subkey_naming_the_victim_but_signed_by_an_attacker_is_not_the_victims_progress():
    async def main():
        net, peers = await make_swarm(3)
        victim, attacker, reader = peers
        victim_id = str(victim.transport.peer_id)
        trackers = [ProgressTracker(p.dht, p.transport, "run", str(p.transport.peer_id), 256)
                    for p in (victim, reader)]
        await trackers[0].report(epoch=1, samples=10, samples_per_second=5.0, done=1)
        fake = {"epoch": 99, "samples": 10**6, "sps": 1e6, "time": attacker.dht.get_time(), "client": False,
                "done": 99, "averaging": False, "idle": False, "part": 0}
        # the DHT accepts it (the attacker signs it: the marker names the attacker)
        assert await attacker.dht.astore("run.progress", fake, attacker.dht.get_time() + 3.0,
                                         subkey=f"{victim_id}{owner_marker(attacker.transport.peer_id)}")
        reports = await trackers[1].fetch()
        assert reports is not None
        assert all(r.epoch != 99 for r in reports.values()), "the attacker's record was read as someone's progress"
        assert reports[victim_id].epoch == 1 and reports[victim_id].samples == 10
        assert str(attacker.transport.peer_id) not in reports  # it reported nothing of its own either
        for tracker in trackers:
            tracker.close()
    run_virtual(main())


@pytest.mark.timeout(60)
def test_a_stranger_cannot_replace_an_experts_uid_or_grid_announcement():
    async def main():
        net, peers = await make_swarm(3)
        server, stranger, client = peers
        uid, fake = "ffn.1.2", {"peer": str(stranger.transport.peer_id)}
        marker = owner_marker(stranger.transport.peer_id)
        # unsigned entries where the announcements go (the uid's dictionary, the grid prefixes' old
        # int subkeys, the server's plain id), and entries the stranger signed but which name the server
        squats = [(uid, fake, str(server.transport.peer_id)), (uid, fake, 0), ("ffn.1.", fake, 2), ("ffn.", 1, 1),
                  ("ffn.1.", {"peer": str(server.transport.peer_id)}, f"2{marker}"),
                  (uid, {"peer": str(server.transport.peer_id)}, marker),
                  # and in its own name, a day ahead: "the newest announcement wins" must not be won
                  # for a day by announcing far ahead (readers skip past moe.grid.ANNOUNCE_HORIZON)
                  (uid, fake, marker), ("ffn.1.", fake, f"2{marker}")]
        for key, value, subkey in squats:
            await squat(stranger, key, value, subkey)
        location = ExpertLocation(uid, server.transport.peer_id)
        await announce_experts(server.dht, [location], server.dht.get_time() + 600.0, timeout=10)

        from potluck.moe.expert import alocate  # the lookup RemoteExpert makes
        assert await alocate(client.dht, uid) == location
        directory = GridDirectory(client.dht, cache_seconds=0.0, timeout=10)
        children = await directory.children(["ffn.", "ffn.1."])
        assert children["ffn.1."] == {2: location}
        assert 1 in children["ffn."]
    run_virtual(main())


@pytest.mark.timeout(60)
def test_a_stranger_can_neither_block_a_sweep_trial_with_a_day_long_lease_nor_plant_its_result():
    from potluck.ps import SweepSpec, run_sweep

    async def score(params: dict) -> dict:
        await asyncio.sleep(1.0)  # a trial's training time (virtual)
        return {"test_accuracy": params["lr"]}

    async def main():
        net, peers = await make_swarm(2)
        honest, stranger = peers
        sweep = SweepSpec(run_id="squat", space={"lr": [0.1, 0.2]})
        leases, results = RunNames(sweep.run_id).sweep_leases(sweep.trials_digest), RunNames(sweep.run_id).sweep_results(sweep.trials_digest)
        mine = owner_marker(stranger.transport.peer_id)
        fake = {"metrics": {"test_accuracy": 99.0}, "peer": str(honest.transport.peer_id), "seconds": 0.0,
                "error": None}
        squats = [(leases, str(stranger.transport.peer_id), 0),  # an unsigned lease on trial 0
                  (leases, {"holder": str(stranger.transport.peer_id), "since": -1e9}, f"0{mine}"),  # its own, a day long
                  (results, fake, 1),  # an unsigned result of trial 1 in the honest peer's name
                  (results, fake, f"1{mine}")]  # a signed one, still in the honest peer's name
        for key, value, subkey in squats:
            await squat(stranger, key, value, subkey)
        try:  # virtual seconds: the squatted lease would hold trial 0 for 23 hours
            return await asyncio.wait_for(run_sweep(honest, sweep, score, lease_seconds=6.0), 600.0)
        except TimeoutError:
            pytest.fail("the sweep never finished: a squatted lease blocked a trial")
    done = run_virtual(main())
    assert [(r.index, r.metrics) for r in done] == [(0, {"test_accuracy": 0.1}), (1, {"test_accuracy": 0.2})]


@pytest.mark.timeout(60)
def test_a_pipeline_profile_is_read_only_from_the_node_it_describes():
    from potluck.core.names import RunNames
    from potluck.pipeline.profiling import NodeProfile, fetch_profiles, publish_profile

    async def main():
        net, peers = await make_swarm(3)
        victim, stranger, reader = peers
        victim_id = str(victim.transport.peer_id)
        fake = NodeProfile(victim_id, flops=1e18, memory=1).to_wire()  # "fast, but holds nothing"
        key = RunNames("run").pipeline.profiles
        for subkey in (victim_id, owner_marker(stranger.transport.peer_id)):  # unsigned; signed by the stranger
            await squat(stranger, key, fake, subkey)
        await publish_profile(victim, "run", NodeProfile(victim_id, flops=1e9, memory=2**30))
        return await fetch_profiles(reader, "run")
    profiles = run_virtual(main())
    assert [(p.flops, p.memory) for p in profiles] == [(1e9, 2**30)]
