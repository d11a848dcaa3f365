"""`potluck pipeline run` across real processes on 127.0.0.1, started exactly as a user would, on a
user model defined in a test module (tests/user_model.py): deterministic planning, one controller
per cluster by the election rule, takeover when the controller's node is SIGKILLed (the same on the
emulated network, loud and silent: tests/test_pipeline_election.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from potluck.pipeline.planning import model_costs, model_demand
from tests import forkserver, user_model

ROOT = Path(__file__).resolve().parents[1]
STALENESS_BOUND = 4
# A copy of the model needs more than one node's memory, and two nodes hold it: 3-node clusters
# survive the loss of one node without a standby.
MEMORY_FRACTION = 0.6
# The loss (label-smoothed cross-entropy over 4 classes: 1.39 at chance) every cluster must reach.
TARGET_LOSS = 0.8


# The run spec of the tests' nodes: the user's model, data and loss.
USER_MODEL = ["--model", "tests.user_model:make_layers", "--data", "tests.user_model:batches", "--loss",
              "tests.user_model:loss", "--lr", "0.01", "--staleness-bound", str(STALENESS_BOUND)]


def _memory_mib() -> float:
    layers = user_model.make_layers()
    sample = next(user_model.batches(0, 0))[0]
    demand = model_demand(model_costs(layers, sample), sample.shape[0], STALENESS_BOUND)
    return demand.memory * MEMORY_FRACTION / 2**20


@pytest.mark.timeout(30)
def test_every_node_computes_the_same_plan_from_the_same_profiles():
    import random

    from potluck.core.errors import MalformedMessage
    from potluck.net.identity import Identity
    from potluck.pipeline.planning import RunPlan, plan_run
    from potluck.pipeline.profiling import NodeProfile
    layers = user_model.make_layers()
    sample = next(user_model.batches(0, 0))[0]
    costs = model_costs(layers, sample)
    assert costs == model_costs(user_model.make_layers(), sample)  # counted, not timed
    demand = model_demand(costs, sample.shape[0], STALENESS_BOUND)
    ids = [str(Identity.generate().peer_id) for _ in range(7)]
    profiles = [NodeProfile(p, 1e6, int(demand.memory * MEMORY_FRACTION)) for p in ids]
    plans = {plan_run(random.Random(seed).sample(profiles, 7), demand, 2) for seed in range(3)}
    assert len(plans) == 1
    plan = plans.pop()
    assert [len(c) for c in plan.clusters] == [3, 3] and len(plan.standby) == 1 and sorted(plan.nodes) == sorted(ids)
    assert RunPlan.from_wire(plan.to_wire()) == plan
    with pytest.raises(MalformedMessage, match="once"):
        RunPlan.from_wire({"version": 1, "clusters": [[ids[0]], [ids[0]]], "standby": []})


class Node:
    """One `potluck pipeline run` process; every JSON row it prints is kept."""

    def __init__(self, args: list[str], log: Path):
        self.log = log
        env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), OMP_NUM_THREADS="1")
        self.proc = forkserver.Popen([sys.executable, "-m", "potluck", "pipeline", "run", *args], cwd=ROOT,
                                     stdout=subprocess.PIPE, stderr=log.open("w"), text=True, env=env)
        self.rows: list[dict] = []
        self.lock = threading.Lock()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            try:
                row = json.loads(line)
            except ValueError:
                continue
            with self.lock:
                self.rows.append(row)

    def find(self, key: str) -> dict | None:
        with self.lock:
            return next((r for r in self.rows if key in r), None)

    def progress(self) -> list[dict]:
        with self.lock:
            return [r for r in self.rows if "role" in r]

    @property
    def peer_id(self) -> str:
        return self.find("peer_id")["peer_id"]


def _wait(condition, timeout: float, nodes: list[Node], what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            logs = "\n".join(f"--- {n.log.name}\n{n.log.read_text()[-1500:]}" for n in nodes)
            raise AssertionError(f"timed out waiting for {what}\n{logs}")
        time.sleep(0.2)


@pytest.fixture
def swarm(tmp_path):
    """start(n, extra) -> n nodes of one run (the first is every other's initial peer); all killed after."""
    nodes: list[Node] = []

    def start(n: int, extra: list[str], own: list[list[str]] | None = None) -> list[Node]:
        """`extra`: options of every node; `own[i]`: node i's own."""
        own = own or [[] for _ in range(n)]
        common = ["--host", "127.0.0.1", "--flops", "1e6", "--memory", str(_memory_mib()), "--heartbeat", "0.5",
                  "--failure-timeout", "1.5", "--report-every", "0.5", *extra]
        nodes.append(Node([*common, *own[0]], tmp_path / "node0.log"))
        _wait(lambda: nodes[0].find("address"), 60, nodes, "the first node's address")
        address = nodes[0].find("address")["address"]
        for i in range(1, n):
            nodes.append(Node([*common, *own[i], "--initial-peers", address], tmp_path / f"node{i}.log"))
        _wait(lambda: all(node.find("plan") for node in nodes), 90, nodes, "every node's plan")
        return nodes

    start.nodes = nodes  # nodes started by the test itself join them here, to be killed after
    yield start
    for node in nodes:
        if node.proc.poll() is None:
            node.proc.kill()
        node.proc.wait(timeout=30)


def _controllers(nodes: list[Node]) -> dict[str, str]:
    """{cluster: the peer id of the node whose newest row says it controls it}."""
    out = {}
    for node in nodes:
        rows = node.progress()
        for cluster in rows[-1]["controls"] if rows else []:
            out[cluster] = node.peer_id
    return out


def _trained_since(nodes: list[Node], cluster: str, epoch: int, updates: int = 25,
                   target: float | None = TARGET_LOSS) -> bool:
    """The cluster's last stage, configured in an epoch after `epoch`, made `updates` updates there
    and its loss over its last micro-batches is under `target` (None: any)."""
    for node in nodes:
        if node.proc.poll() is not None:
            continue
        rows = [r for r in node.progress() if r.get("cluster") == cluster and r["last"] and r["epoch"] > epoch]
        if rows and rows[-1]["updates"] >= rows[0]["updates"] + updates and (
                target is None or (rows[-1]["loss"] or 9) < target):
            return True
    return False


def _epoch(nodes: list[Node], cluster: str) -> int:
    return max((r["epoch"] for n in nodes for r in n.progress() if r.get("cluster") == cluster), default=-1)


@pytest.mark.scenario  # 15-30 s of processes: run by CI after the suite (pyproject.toml)
@pytest.mark.timeout(240)
def test_seven_nodes_form_two_clusters_and_a_standby_and_survive_a_killed_controller_and_stage_node(swarm):
    """The issue's test: SIGKILL the node that holds cluster 0's controller role and a plain stage node
    of cluster 1; both clusters go on training (two nodes hold the model) and reach the target."""
    nodes = swarm(7, ["--run-id", "cli", "--nodes", "7", "--clusters", "2", *USER_MODEL])
    plan = nodes[0].find("plan")["plan"]
    assert all(n.find("plan")["plan"] == plan for n in nodes)
    c0, c1 = plan["clusters"]
    assert len(c0) == len(c1) == 3 and len(plan["standby"]) == 1
    assert sorted([*c0, *c1, *plan["standby"]]) == sorted(n.peer_id for n in nodes)
    _wait(lambda: _trained_since(nodes, "c0", -1) and _trained_since(nodes, "c1", -1), 90, nodes,
          "both clusters to reach the target loss")
    assert _controllers(nodes) == {"c0": min(c0), "c1": min(c1)}
    epochs = {"c0": _epoch(nodes, "c0"), "c1": _epoch(nodes, "c1")}
    by_id = {n.peer_id: n for n in nodes}
    for victim in (min(c0), max(c1)):  # cluster 0's controller, a plain stage of cluster 1
        by_id[victim].proc.send_signal(signal.SIGKILL)
    live = [n for n in nodes if n.peer_id not in (min(c0), max(c1))]
    _wait(lambda: _controllers(live) == {"c0": sorted(c0)[1], "c1": min(c1)}, 30, nodes,
          "cluster 0's next node to take the controller role over")
    _wait(lambda: _trained_since(live, "c0", epochs["c0"]) and _trained_since(live, "c1", epochs["c1"]), 90,
          nodes, "both clusters to train on to the target")


@pytest.mark.scenario  # 15-30 s of processes: run by CI after the suite (pyproject.toml)
@pytest.mark.timeout(180)
def test_pipeline_run_takes_its_clusters_and_spec_from_a_plan_file_and_replans_for_a_late_node(swarm, tmp_path):
    """A plan written beforehand (`pipeline plan --write-plan`'s format) names the nodes by peer id:
    each starts with its key file and the plan, nothing else about the run. A node that comes later
    makes the run re-plan with a second cluster (every node checks and follows version 2)."""
    from potluck.cli.plan_file import PlanFile, PlannedStage
    from potluck.cli.spec import RunSpec
    from potluck.net.identity import Identity
    keys, ids = [], []
    for i in range(3):
        identity = Identity.generate()
        identity.save(tmp_path / f"node{i}.key")
        keys.append(["--identity", str(tmp_path / f"node{i}.key")])
        ids.append(str(identity.peer_id))
    spec = RunSpec("tests.user_model:make_layers", "tests.user_model:batches", "tests.user_model:loss", lr=0.01)
    sample = next(user_model.batches(0, 0))[0]
    costs = model_costs(user_model.make_layers(), sample)
    PlanFile("planned", spec, tuple(costs), 1.0, sample.shape[0], STALENESS_BOUND,
             ((PlannedStage(ids[0], 0, 1), PlannedStage(ids[1], 1, 3)),), (ids[2],)).write(tmp_path / "plan.json")
    nodes = swarm(3, ["--plan", str(tmp_path / "plan.json")], keys)
    assert [n.peer_id for n in nodes] == ids
    assert all(n.find("plan")["plan"] == {"version": 1, "clusters": [sorted(ids[:2])], "standby": [ids[2]]}
               for n in nodes)
    _wait(lambda: _trained_since(nodes, "c0", -1), 60, nodes, "the planned cluster to reach the target loss")
    assert _controllers(nodes) == {"c0": min(ids[:2])}
    assert nodes[2].progress()[-1]["role"] == "standby"
    # a fourth node started later with the same plan file waits as a standby too; with it the two
    # spare nodes hold a copy of the model, so the planner publishes version 2 with two clusters
    first = _epoch(nodes, "c0")
    late = Node(["--host", "127.0.0.1", "--flops", "1e6", "--memory", str(_memory_mib()), "--heartbeat", "0.5",
                 "--failure-timeout", "1.5", "--report-every", "0.5", "--plan", str(tmp_path / "plan.json"),
                 "--initial-peers", nodes[0].find("address")["address"]], tmp_path / "node3.log")
    swarm.nodes.append(late)
    nodes.append(late)
    _wait(lambda: all(n.find("replanned") for n in nodes), 60, nodes, "every node to follow plan version 2")
    assert late.find("plan")["joined_late"]
    plans = [n.find("replanned")["plan"] for n in nodes]
    assert all(p == plans[0] for p in plans) and plans[0]["version"] == 2
    assert sorted(len(c) for c in plans[0]["clusters"]) == [2, 2] and not plans[0]["standby"]
    _wait(lambda: all(_trained_since(nodes, c, first, 10, None) for c in ("c0", "c1")), 60, nodes,
          "both clusters of version 2 to train")



def wide_layers() -> list:
    """tests.user_model:make_layers with twice the hidden units: a node started with the wrong --model."""
    from torch import nn
    hidden = 2 * user_model.HIDDEN
    return [nn.Sequential(nn.Linear(user_model.FEATURES, hidden), nn.ReLU()),
            nn.Sequential(nn.Linear(hidden, hidden), nn.ReLU()), nn.Linear(hidden, user_model.CLASSES)]


# A node of another model must be told this soon after it joined the swarm (it prints its peer id).
MISMATCH_DEADLINE = 10.0


@pytest.mark.timeout(180)
def test_a_node_of_another_model_stops_at_once_naming_the_tensor(swarm, tmp_path):
    """Two nodes train the user's model; a third joins with a wider --model. Before, it waited for
    profiles of its own kind (or, counted by the others, was planned in and handed layers it could
    not hold); now it exits with one line naming the first tensor that differs, within
    MISMATCH_DEADLINE of joining, and the run goes on without it."""
    nodes = swarm(2, ["--run-id", "wrong", "--nodes", "2", *USER_MODEL])
    _wait(lambda: _trained_since(nodes, "c0", -1, 5, None), 60, nodes, "the run to train")
    wrong = Node(["--host", "127.0.0.1", "--flops", "1e6", "--memory", str(_memory_mib()), "--run-id", "wrong",
                  "--nodes", "2", *USER_MODEL, "--model", "tests.test_pipeline_cli:wide_layers",
                  "--initial-peers", nodes[0].find("address")["address"]], tmp_path / "wrong.log")
    swarm.nodes.append(wrong)
    _wait(lambda: wrong.find("peer_id") or wrong.proc.poll() is not None, 60, [wrong], "the node to join")
    try:
        code = wrong.proc.wait(MISMATCH_DEADLINE)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"not told within {MISMATCH_DEADLINE} s: {wrong.log.read_text()[-2000:]}") from None
    errors = [line for line in wrong.log.read_text().splitlines() if line.startswith("potluck pipeline: error:")]
    hidden = 2 * user_model.HIDDEN
    assert code == 1 and len(errors) == 1, wrong.log.read_text()[-2000:]
    assert (f"parameter 0 '0.0.weight': yours is float32 [{hidden}, {user_model.FEATURES}], the run's is "
            f"float32 [{user_model.HIDDEN}, {user_model.FEATURES}]") in errors[0]
    epoch = _epoch(nodes, "c0")
    _wait(lambda: _trained_since(nodes, "c0", epoch - 1, 5, None), 60, nodes, "the run to train on")
