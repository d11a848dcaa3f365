"""Ravnest pipeline end to end: it learns as well as one process does; rings average whole stages;
`potluck demo --mode pipeline` and `potluck pipeline plan` work as a user runs them."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys

import pytest
import torch

from potluck.cli import demo_pipeline as demo
from potluck.cli.tasks import accuracy, load_data
from potluck.core.virtual_time import run_virtual
from potluck.pipeline.harness import launch_run
from potluck.pipeline.profiling import LayerCost
from potluck.pipeline.stage import PipelineConfig
from tests import forkserver
from tests.conftest import ROOT
from tests.emulated_swarm import make_swarm

UPDATES = 500
LEARNING_RATE = 2e-3


def decay(step: int) -> float:
    """Linear decay to 2%: the final weights settle, so one accuracy reading is representative."""
    return max(0.02, 1 - step / UPDATES)


def train_alone(x, y):
    model = torch.nn.Sequential(*demo.make_layers(range(demo.LAYERS)))
    opt = torch.optim.Adam(model.parameters(), LEARNING_RATE)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, decay)
    source = demo.digits_source(x, y, 0)
    for mb in range(UPDATES):
        xb, yb = source(mb)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(xb), yb).backward()
        opt.step()
        schedule.step()
    return model


async def until(run, condition, timeout: float) -> None:
    """Wait until `condition()` holds, woken by the workers' progress, with a deadline (virtual clock)."""
    await run.wait_until(condition, timeout)


async def digits_run(config: PipelineConfig, x, y, **kwargs):
    net, peers = await make_swarm(6, latency=0.002, bandwidth=None)
    costs = [LayerCost(1e-3, 4096, 512)] * demo.LAYERS
    run = await launch_run(peers, [[0, 1, 2], [3, 4, 5]], config, demo.make_layers,
                           demo.LAYERS, lambda p: torch.optim.Adam(p, LEARNING_RATE), sample=x[:4],
                           sources=[demo.digits_source(x, y, c) for c in range(2)], costs=costs, **kwargs)
    return peers, run


async def shutdown(peers, run) -> None:
    await run.close()
    for p in peers:
        await p.dht.ashutdown()
        await p.transport.close()


@pytest.mark.timeout(120)
def test_pipeline_trained_model_matches_one_process_accuracy():
    torch.set_num_threads(1)
    x, y, x_test, y_test = load_data()
    # Bound 2 (stage 0 runs one version behind): measured gaps after 500 updates were 0.0-0.6%.
    # At the demo's bound 4 they were 1.4-1.7% (docs/pipeline.md): too near 2% for a reliable test.
    config = PipelineConfig("acc", staleness_bound=2, average_every=demo.AVERAGE_EVERY)

    async def main():
        peers, run = await digits_run(config, x, y,
                                      scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, decay))
        firsts = [run.worker_of(c, 0) for c in range(2)]
        await until(run, lambda: all(w.stats.updates >= UPDATES for w in firsts), 100)
        model = demo.assemble([run.worker_of(0, s) for s in range(3)])
        rounds = min(w.stats.rounds_applied for w in run.workers.values())
        result = accuracy(model, x_test, y_test)
        await shutdown(peers, run)
        return result, rounds

    pipeline_accuracy, rounds = run_virtual(main())
    alone = accuracy(train_alone(x, y), x_test, y_test)
    assert rounds >= UPDATES // demo.AVERAGE_EVERY // 2  # the clusters did average
    assert alone > 0.9
    assert pipeline_accuracy >= alone - 0.02, (pipeline_accuracy, alone)


@pytest.mark.timeout(60)
def test_multi_ring_round_leaves_every_stage_at_the_exact_mean_across_clusters():
    torch.set_num_threads(1)
    x, y, _, _ = load_data()
    config = PipelineConfig("avg", staleness_bound=2, average_every=0)

    async def main():
        peers, run = await digits_run(config, x, y)
        firsts = [run.worker_of(c, 0) for c in range(2)]
        await until(run, lambda: all(w.stats.updates >= 20 for w in firsts), 30)
        for w in firsts:
            w.schedule.injection_paused = True  # drain the pipelines so weights stand still
        workers = list(run.workers.values())
        await until(run, lambda: all(w.idle for w in workers), 30)
        before = {i: [[p.detach().clone() for p in run.worker_of(c, 0).layers.get(i, torch.nn.Linear(1, 1))
                       .parameters()] for c in range(2)] for i in range(0)}
        layers_before = {}
        for c in range(2):
            for s in range(3):
                for i, layer in run.worker_of(c, s).layers.items():
                    layers_before[(c, i)] = [p.detach().clone() for p in layer.parameters()]
        applied = await asyncio.gather(*(w.average_round() for w in workers))
        layers_after = {}
        for c in range(2):
            for s in range(3):
                for i, layer in run.worker_of(c, s).layers.items():
                    layers_after[(c, i)] = [p.detach().clone() for p in layer.parameters()]
        await shutdown(peers, run)
        return applied, layers_before, layers_after, before

    applied, layers_before, layers_after, _ = run_virtual(main())
    assert all(applied)
    for i in range(demo.LAYERS):
        for p0, p1, a0, a1 in zip(layers_before[(0, i)], layers_before[(1, i)], layers_after[(0, i)],
                                  layers_after[(1, i)]):
            assert not torch.equal(p0, p1)  # the clusters had drifted apart...
            assert torch.equal(a0, a1)  # ...and now hold identical weights...
            assert torch.allclose(a0, (p0 + p1) / 2, atol=1e-6)  # ...their exact mean


def _potluck(*args: str, timeout: float) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), OMP_NUM_THREADS="1")
    return forkserver.run([sys.executable, "-m", "potluck", *args], env=env, capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.scenario
@pytest.mark.timeout(160)
def test_pipeline_demo_runs_recovers_and_writes_its_report(tmp_path):
    """Seven processes of `potluck pipeline run`, one killed with SIGKILL."""
    proc = _potluck("demo", "--mode", "pipeline", "--duration", "12", "--out", str(tmp_path), timeout=150)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "report.json").read_text())
    assert len(report["stage_utilization"]) == 6 and all(0 < u <= 1 for u in report["stage_utilization"].values())
    assert report["max_staleness_observed"] <= report["staleness_bound"]
    assert report["test_accuracy"] > 0.5  # it learned (chance is 0.1), even on a loaded machine
    assert report["recoveries"] and report["recoveries"][0]["fetched_from"]
    assert report["recoveries"][0]["dead"] == report["killed"] and len(report["clusters"]) == 2
    assert (tmp_path / "pipeline.png").stat().st_size > 5_000
    assert "cluster 0:" in proc.stdout and "loss" in proc.stdout


@pytest.mark.timeout(90)
def test_pipeline_plan_prints_clusters_and_stages_for_profiles_in_the_dht(tmp_path):
    import potluck
    from potluck.pipeline.profiling import NodeProfile, publish_profile
    costs = [{"seconds": 1e-3, "param_bytes": 1000, "activation_bytes": 100}] * 6
    (tmp_path / "costs.json").write_text(json.dumps(costs))
    peers = [potluck.Peer(host="127.0.0.1")]
    try:
        peers += [potluck.Peer(initial_peers=peers[0].addresses, host="127.0.0.1") for _ in range(5)]
        # a copy needs 36600 B (6000 B of weights x (state 4 + 2 stashes) + activations); 15000 B each: clusters of 3
        for i, p in enumerate(peers):
            profile = NodeProfile(p.peer_id, flops=1e9 * (1 + i % 2), memory=15000)
            assert p.run(publish_profile(p, "plan-test", profile), timeout=30)
        proc = _potluck("pipeline", "plan", "--host", "127.0.0.1", "--initial-peers", peers[0].addresses[0],
                        "--run-id", "plan-test", "--layer-costs", str(tmp_path / "costs.json"),
                        "--reference-flops", "1e9", "--micro-batch", "1", "--staleness-bound", "1", "--json",
                        timeout=80)
    finally:
        for p in peers:
            p.shutdown()
    assert proc.returncode == 0, proc.stderr[-3000:]
    plan = json.loads(proc.stdout)
    assert len(plan["clusters"]) == 2 and not plan["standby"]
    for cluster in plan["clusters"]:
        assert len(cluster["stages"]) == 3 and cluster["memory"] >= plan["model"]["memory_needed"]
        covered = [i for s in cluster["stages"] for i in range(s["layers"][0], s["layers"][1] + 1)]
        assert covered == list(range(6))
    # the clusters are balanced: each gets speed 1+2+1 or 2+1+2, never 1+1+1 vs 2+2+2
    speeds = sorted(round(c["throughput"]) for c in plan["clusters"])
    assert speeds[0] >= 4 * 1e9 / (6 * 1e-3 * 1e9) - 1


@pytest.mark.timeout(60)
def test_pipeline_plan_explains_itself_from_a_profiles_file(tmp_path):
    from potluck.pipeline.profiling import NodeProfile
    profiles = [NodeProfile(f"node{i}", flops=1e9, memory=10**7).to_wire() for i in range(3)]
    (tmp_path / "profiles.json").write_text(json.dumps(profiles))
    costs = [{"seconds": 1e-3, "param_bytes": 1000, "activation_bytes": 100}] * 4
    (tmp_path / "costs.json").write_text(json.dumps(costs))
    proc = _potluck("pipeline", "plan", "--profiles", str(tmp_path / "profiles.json"), "--layer-costs",
                    str(tmp_path / "costs.json"), "--reference-flops", "1e9", "--clusters", "1", timeout=50)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "1 clusters" in proc.stdout and "stage 2:" in proc.stdout and "limited by compute" in proc.stdout
    missing = _potluck("pipeline", "plan", "--profiles", str(tmp_path / "costs.json"), timeout=50)
    assert missing.returncode != 0 and "profile" in (missing.stdout + missing.stderr)


@pytest.mark.timeout(120)
def test_stage_process_killed_with_sigkill_is_replaced_over_real_tcp():
    """Five nodes in this process, one stage node in its own process; SIGKILL that process."""
    import potluck
    from potluck.pipeline.harness import RemoteNode
    torch.set_num_threads(1)
    x, y, _, _ = load_data()
    config = PipelineConfig("sigkill", staleness_bound=demo.STALENESS_BOUND, average_every=demo.AVERAGE_EVERY)
    peers = [potluck.Peer(host="127.0.0.1")]
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), OMP_NUM_THREADS="1")
    # cluster 0's controller runs on its first local node, peers[0]: the only peer the worker obeys
    spec = json.dumps({"initial_peer": peers[0].addresses[0], "cluster": 0, "run_id": config.run_id,
                       "controller": peers[0].peer_id})
    proc = forkserver.Popen([sys.executable, "-m", "potluck", "demo", "--mode", "pipeline", "--worker", spec],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    run = None
    try:
        peers += [potluck.Peer(initial_peers=peers[0].addresses, host="127.0.0.1") for _ in range(4)]
        line = proc.stdout.readline()
        assert line, proc.stderr.read()[-3000:]
        remote = json.loads(line)
        nodes = [peers[0], peers[1], RemoteNode(remote["peer_id"]), *peers[2:]]
        costs = [LayerCost(1e-3, 4096, 512)] * demo.LAYERS
        run = peers[0].run(launch_run(
            nodes, [[0, 1, 2], [3, 4, 5]], config, demo.make_layers, demo.LAYERS,
            lambda p: torch.optim.Adam(p, demo.LEARNING_RATE), sample=x[:4],
            sources=[demo.digits_source(x, y, c) for c in range(2)], costs=costs, heartbeat=0.5,
            failure_timeout=2.0), timeout=60)
        c0 = run.controllers[0]
        other = {p for p, _, _ in run.controllers[1].stages}
        mine = [w for p, w in run.workers.items() if p in {q for q, _, _ in c0.stages}]
        peers[0].run(run.wait_until(lambda: all(w.stats.backwards >= 20 for w in mine), 60), timeout=70)
        proc.kill()  # SIGKILL: the kernel resets its connections
        peers[0].run(run.wait_until(lambda: bool(c0.events), 30), timeout=40)
        event = c0.events[0]
        assert event.dead == remote["peer_id"]
        assert event.fetched_from and set(event.fetched_from.values()) <= other
        assert remote["peer_id"] not in {p for p, _, _ in c0.stages} and len(c0.stages) == 2
        first = run.worker_of(0, 0)
        before = first.stats.updates
        peers[0].run(run.wait_until(lambda: first.stats.updates >= before + 20, 30), timeout=40)
    finally:
        if run is not None:
            peers[0].run(run.close(), timeout=30)
        for p in reversed(peers):
            p.shutdown()
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)
        for stream in (proc.stdin, proc.stdout, proc.stderr):
            stream.close()
