"""Every DHT key and RPC method of a run comes from `potluck.core.names`.

The swarm below runs every training mode and a user's Averager (with a state download) on the
emulated network, recording every key a peer stores or reads and every method it serves or calls;
each one that names a run must be what a template of `potluck.core.names` makes for that run.
"""

from __future__ import annotations

import asyncio
import re

import pytest
import torch

import potluck
from potluck.core import names
from potluck.core.dht_time import event_loop_clock
from potluck.core.names import TEMPLATES, RunNames, pattern
from potluck.dht.dht import DHT
from potluck.net.emulated import EmulatedNetwork
from potluck.net.transport import Transport
from potluck.optim import DiLoCo, Optimizer
from tests.emulated_swarm import run_on_shared_runner

RUNS = {"names-sync": {}, "names-moshpit": {"mode": "moshpit", "local_steps": 2},
        "names-diloco": {"mode": "diloco", "local_steps": 2},
        "names-stream": {"mode": DiLoCo(local_steps=4, fragments=2, outer_delay=1, outer_compression="blockwise4")}}
AVERAGER_RUN = "names-avg"


def test_each_template_names_what_run_names_makes_and_only_that():
    run = RunNames("a.b-run")
    made = {names.PROGRESS: run.progress, names.ROUNDS: run.rounds, names.PROGRESS_PUSH: run.progress_push,
            names.DECLARATIONS: run.averager("grads").declarations("epoch3.0"), names.DONORS: run.averager("x").donors,
            names.JOIN: run.averager("x").join, names.MANIFEST: run.averager("x").manifest,
            names.CHUNKS: run.averager("x").chunks, names.PIPELINE_PROFILES: run.pipeline.profiles,
            names.PIPELINE_LAYOUT: run.pipeline.layout, names.PIPELINE_PLAN: run.pipeline.plan,
            names.PIPELINE_FORWARD: run.pipeline.forward, names.PIPELINE_BACKWARD: run.pipeline.backward,
            names.PIPELINE_CONTROL: run.pipeline.control, names.PIPELINE_RING: run.pipeline.ring,
            names.PIPELINE_CLAIM: run.pipeline.claim, names.PIPELINE_REPORT: run.pipeline.report("c1"),
            names.PS_SERVERS: run.ps_servers, names.PS_SHARD: run.ps_shard(3, "push"),
            names.SWEEP_LEASES: run.sweep_leases("abc"), names.SWEEP_RESULTS: run.sweep_results("abc"),
            names.REVOKED: run.revoked("[owner:xyz]"), names.RELAYS: names.RELAYS,
            names.PS_RUNS: names.PS_RUNS}
    assert set(made) == set(TEMPLATES)
    for template, name in made.items():
        matching = [t for t in TEMPLATES if pattern(t).match(name)]
        assert matching == [template], (name, matching)  # one template per name: the key rules are unambiguous
    for bad in ("", "two words", "x" * 129, "tab\tbed"):
        with pytest.raises(ValueError, match="run id"):
            RunNames(bad)
    with pytest.raises(ValueError, match="averager's name"):
        run.averager("with.dot")


@pytest.mark.timeout(120)
def test_every_key_and_method_a_swarm_uses_comes_from_run_names(monkeypatch):
    used: set[str] = set()

    def recording(cls, name, index=1):
        original = getattr(cls, name)

        def record(self, *args, **kwargs):
            value = args[index - 1] if len(args) >= index else None
            if isinstance(value, str):
                used.add(value)
            return original(self, *args, **kwargs)
        monkeypatch.setattr(cls, name, record)
    for name in ("astore", "aget"):
        recording(DHT, name)
    for name in ("add_handler", "add_stream_handler"):
        recording(Transport, name)
    for name in ("call", "open_stream"):
        recording(Transport, name, index=2)

    run_on_shared_runner(_swarm(), timeout=120)
    ours = sorted(n for n in used if any(n.startswith(run) or run in n for run in [*RUNS, AVERAGER_RUN]))
    assert len(ours) > 20, ours  # the swarm did use its runs' names
    for name in ours:
        run = next(run for run in [*RUNS, AVERAGER_RUN] if re.search(re.escape(run) + r"(\.|\Z)", name))
        assert any(pattern(t, run=run).match(name) for t in TEMPLATES), f"{name!r} is not made by RunNames({run!r})"


async def _swarm() -> None:
    network = EmulatedNetwork(latency=0.01, seed=2)
    peers: list[potluck.Peer] = []
    for _ in range(3):
        peers.append(await potluck.Peer.create(peers[0].addresses if peers else [], transport=network.transport(),
                                               clock=event_loop_clock()))
    optimizers = []
    try:
        for run, options in RUNS.items():
            for peer in peers:
                torch.manual_seed(0)
                model = torch.nn.Linear(4, 2)
                opt = Optimizer(peer, run, model.parameters(), lambda p: torch.optim.SGD(p, 0.1), target_batch_size=16,
                                batch_size_per_step=4, load_state=peer is peers[-1], load_state_timeout=2,
                                matchmaking_time=0.3, start=False, **options)
                await opt.astart()
                optimizers.append((model, opt))

        async def train(model: torch.nn.Module, opt: Optimizer) -> None:
            while opt.local_epoch < 3:
                model(torch.randn(4, 4)).sum().backward()
                await asyncio.sleep(0.02)
                await opt.astep()
        await asyncio.gather(*(train(m, o) for m, o in optimizers))
        averagers = [potluck.Averager(p, [torch.full((8,), float(i))], AVERAGER_RUN, matchmaking_time=0.3)
                     for i, p in enumerate(peers)]
        await asyncio.gather(*(a.astep(timeout=10) for a in averagers[:2]))
        await averagers[2].aload_state_from_peers(10)
        for averager in averagers:
            averager.shutdown()
    finally:
        for _, opt in optimizers:
            opt.shutdown()
        for peer in peers:
            await peer.ashutdown()


def test_no_module_builds_a_run_name_of_its_own():
    """No f-string anywhere in the package joins a run id to a dotted name: that is RunNames' job."""
    import ast
    from pathlib import Path
    package = Path(potluck.__file__).parent
    built = []
    for path in package.rglob("*.py"):
        if path.name == "names.py" and path.parent.name == "core":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.JoinedStr):
                continue
            parts = node.values
            for before, after in zip(parts, parts[1:], strict=False):
                run = [p for p in (before, after) if isinstance(p, ast.FormattedValue) and "run" in ast.unparse(p.value)]
                text = [p for p in (before, after) if isinstance(p, ast.Constant) and isinstance(p.value, str)]
                if run and text and (text[0] is after and text[0].value.startswith(".")
                                     or text[0] is before and text[0].value.endswith(".")):
                    built.append(f"{path.relative_to(package)}:{node.lineno} {ast.unparse(node)}")
    assert not built, "build these with potluck.core.names.RunNames: " + "; ".join(built)
