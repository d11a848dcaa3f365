"""Hyperparameter sweeps (`potluck.ps.sweep`): trial lists, leases through the DHT, re-runs."""

from __future__ import annotations

import asyncio
import json

import pytest

from potluck.core import compat
from potluck.core.errors import MalformedMessage
from potluck.core.names import RunNames
from potluck.core.virtual_time import run_virtual
from potluck.net.identity import Identity
from potluck.ps import SweepError, SweepSpec, Trial, TrialResult, run_sweep
from potluck.ps.sweep import MAX_ERROR_CHARS, MAX_METRICS, TrialLease, trial_subkey
from tests.emulated_swarm import make_swarm

LEASE = 6.0  # virtual seconds


def spec(**changes) -> SweepSpec:
    values = dict(run_id="t", space={"lr": [0.1, 0.01, 0.001], "width": [8, 16]}, fixed={"steps": 5})
    values.update(changes)
    return SweepSpec(**values)


async def score(params: dict) -> dict:
    await asyncio.sleep(1.0)  # models a trial's training time (virtual)
    return {"test_accuracy": params["lr"] * params["width"]}


@pytest.mark.timeout(30)
def test_grid_and_random_trial_lists_are_complete_deterministic_and_in_range():
    grid = spec().trial_list()
    assert len(grid) == 6 and [t.index for t in grid] == list(range(6))
    assert {(t.params["lr"], t.params["width"]) for t in grid} == {(a, b) for a in (0.1, 0.01, 0.001) for b in (8, 16)}
    assert all(t.params["steps"] == 5 for t in grid)
    space = {"lr": {"low": 1e-4, "high": 1e-1, "log": True}, "width": {"low": 4, "high": 64, "int": True},
             "opt": ["sgd", "adam"]}
    first = spec(kind="random", trials=20, seed=3, space=space).trial_list()
    assert first == spec(kind="random", trials=20, seed=3, space=space).trial_list()
    assert first != spec(kind="random", trials=20, seed=4, space=space).trial_list()
    assert all(1e-4 <= t.params["lr"] <= 1e-1 and 4 <= t.params["width"] <= 64 for t in first)
    assert all(isinstance(t.params["width"], int) and t.params["opt"] in ("sgd", "adam") for t in first)
    assert spec().sweep_id != spec(space={"lr": [0.5]}).sweep_id  # different trials never mix


@pytest.mark.timeout(30)
@pytest.mark.parametrize("changes, message", [
    ({"kind": "bayes"}, "kind must be"),
    ({"space": {}}, "non-empty space"),
    ({"space": {"lr": []}}, "empty list"),
    ({"space": {"lr": {"low": 1, "high": 0}}, "kind": "random", "trials": 3}, "low < high"),
    ({"space": {"lr": {"low": 0, "high": 1, "log": True}}, "kind": "random", "trials": 3}, "low > 0"),
    ({"space": {"lr": {"low": 0, "high": 1}}}, "in a grid sweep"),
    ({"space": {"lr": {"low": 0, "high": 1, "step": 2}}, "kind": "random", "trials": 3}, "unknown range keys"),
    ({"space": {"lr": {"low": 0, "high": 1, "log": "yes"}}, "kind": "random", "trials": 3}, "true or false"),
    ({"space": {"lr": {"low": True, "high": 2}}, "kind": "random", "trials": 3}, "low < high"),
    ({"kind": "random", "trials": 0}, "trials"),
    ({"kind": "random", "trials": "3"}, "trials must be an int"),
    ({"fixed": [1]}, "fixed must be a dict"),
])
def test_malformed_specs_get_clear_errors(changes, message):
    with pytest.raises(SweepError, match=message):
        spec(**changes)


@pytest.mark.timeout(30)
def test_spec_files_in_toml_and_json(tmp_path):
    (tmp_path / "s.toml").write_text('run_id = "a"\nkind = "grid"\n[space]\nlr = [0.1, 0.2]\n[fixed]\nsteps = 3\n')
    assert len(SweepSpec.from_file(tmp_path / "s.toml").trial_list()) == 2
    (tmp_path / "s.json").write_text(json.dumps({"run_id": "a", "space": {"lr": [1, 2, 3]}, "colour": 1}))
    with pytest.raises(SweepError, match="unknown keys.*colour"):
        SweepSpec.from_file(tmp_path / "s.json")
    (tmp_path / "bad.toml").write_text("name = ")
    with pytest.raises(SweepError, match="cannot read"):
        SweepSpec.from_file(tmp_path / "bad.toml")


@pytest.mark.timeout(30)
@pytest.mark.parametrize("changes, field", [
    ({"metrics": [1.0]}, "'metrics'"),
    ({"metrics": {"acc": "high"}}, "'metrics'"),
    ({"metrics": {"acc": True}}, "'metrics'"),
    ({"metrics": {f"m{i}": 1.0 for i in range(MAX_METRICS + 1)}}, "'metrics'"),
    ({"metrics": {"x" * 1000: 1.0}}, "'metrics'"),
    ({"seconds": -1.0}, "'seconds'"),
    ({"seconds": float("nan")}, "'seconds'"),
    ({"seconds": "1"}, "'seconds'"),
    ({"error": 5}, "'error'"),
    ({"error": "x" * (MAX_ERROR_CHARS + 1)}, "'error'"),
    ({"peer": "not a peer id"}, "'peer'"),
    ({"peer": None}, "'peer'"),
])
def test_malformed_trial_results_are_refused_naming_the_field(changes, field):
    trial = Trial(3, {"lr": 0.1})
    result = TrialResult(3, trial.params, {"acc": 0.5}, Identity.generate().peer_id, 1.25)
    good = result.to_wire()
    assert TrialResult.from_wire(good, trial=trial) == result  # the parameters come from the trial itself
    with pytest.raises(MalformedMessage) as caught:
        TrialResult.from_wire({**good, **changes}, trial=trial)
    assert caught.value.field.startswith(field), caught.value
    with pytest.raises(MalformedMessage, match="not a map"):
        TrialResult.from_wire([good], trial=trial)
    with pytest.raises(MalformedMessage) as caught:
        TrialLease.from_wire({"holder": 12345, "since": 0.0}, expires=10.0)
    assert caught.value.field.startswith("'holder'")
    with pytest.raises(MalformedMessage) as caught:
        TrialLease.from_wire({"holder": str(Identity.generate().peer_id), "since": "now"}, expires=10.0)
    assert caught.value.field.startswith("'since'")


@pytest.mark.timeout(60)
def test_trials_of_a_killed_peer_are_rerun_and_every_trial_appears_exactly_once():
    async def scenario():
        net, peers = await make_swarm(3)
        sweep = spec()
        claimed = asyncio.Event()

        async def dies_mid_trial(params: dict) -> dict:
            claimed.set()
            await asyncio.Event().wait()  # never finishes: its peer is killed meanwhile
            return {}

        victim = asyncio.create_task(run_sweep(peers[2], sweep, dies_mid_trial, lease_seconds=LEASE))
        async with compat.timeout(30):
            await claimed.wait()
        victim.cancel()
        net.crash(peers[2].transport.peer_id)
        outcomes = await asyncio.gather(*(run_sweep(p, sweep, score, lease_seconds=LEASE) for p in peers[:2]))
        for p in peers[:2]:
            await p.dht.ashutdown()
            await p.transport.close()
        return outcomes, peers[2].transport.peer_id
    (first, second), victim = run_virtual(scenario())
    assert first == second  # both peers end with the same table
    assert [r.index for r in first] == list(range(6))  # every trial exactly once, in order
    assert all(r.peer != victim for r in first)  # the victim's trial was re-run by another
    assert {r.peer for r in first} == {r.peer for r in second} and len({r.peer for r in first}) == 2
    for r in first:
        assert r.metrics["test_accuracy"] == pytest.approx(r.params["lr"] * r.params["width"])


@pytest.mark.timeout(60)
def test_malformed_records_from_another_peer_are_ignored_and_the_trial_is_run():
    async def scenario():
        net, peers = await make_swarm(2)
        sweep = spec(space={"lr": [0.1, 0.2], "width": [1]})
        key = RunNames(sweep.run_id).sweep_results(sweep.trials_digest)
        now = peers[1].dht.get_time()
        other = peers[1].transport.peer_id
        await peers[1].dht.astore(key, "garbage", now + 1.0, subkey=trial_subkey(0, other))  # not a result
        await peers[1].dht.astore(key, {"metrics": {}}, now + 1.0, subkey=trial_subkey(99, other))  # no such trial
        await peers[1].dht.astore(key, {"metrics": {"a": 1.0}, "peer": "nobody", "seconds": 0.0, "error": None},
                                  now + 1.0, subkey=trial_subkey(1, other))  # not a peer id
        await peers[1].dht.astore(RunNames(sweep.run_id).sweep_leases(sweep.trials_digest), 12345, now + 1.0,
                                  subkey=trial_subkey(1, other))  # not a lease
        results = await run_sweep(peers[0], sweep, score, lease_seconds=LEASE)
        for p in peers:
            await p.dht.ashutdown()
            await p.transport.close()
        return results
    results = run_virtual(scenario())
    assert [r.index for r in results] == [0, 1]
    assert all("test_accuracy" in r.metrics for r in results)


@pytest.mark.timeout(60)
def test_a_failing_trial_is_recorded_with_its_error_not_retried_forever():
    async def scenario():
        net, peers = await make_swarm(1)
        calls = []

        async def objective(params: dict) -> dict:
            calls.append(params["lr"])
            if params["lr"] == 0.2:
                raise ValueError("diverged")
            return {"test_accuracy": 1.0}
        results = await run_sweep(peers[0], spec(space={"lr": [0.1, 0.2]}), objective, lease_seconds=LEASE)
        await peers[0].dht.ashutdown()
        await peers[0].transport.close()
        return results, calls
    results, calls = run_virtual(scenario())
    assert sorted(calls) == [0.1, 0.2]
    assert results[1].error == "ValueError: diverged" and results[1].metrics == {}
