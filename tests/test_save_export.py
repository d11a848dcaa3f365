"""Keeping the result of a run, one documented way per mode: `ps worker --save`, `pipeline run --save`
then `pipeline export`, and the Optimizer's checkpoints (`examples/train_digits.py --save/--resume`).
Every saved model loads in a fresh process with nothing but PyTorch and gives the test accuracy the
run ended with; a resumed Optimizer run goes on from its epoch and rejoins the swarm."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests import forkserver, user_model
from tests.conftest import ROOT
from tests.test_optimizer import Member, digest, train

ENV = dict(os.environ, PYTHONPATH=str(ROOT / "src"), OMP_NUM_THREADS="1")
SPEC = ["--model", "tests.user_model:make_layers", "--data", "tests.user_model:batches", "--loss",
        "tests.user_model:loss", "--lr", "0.01", "--seed", "3"]
# What the fresh process runs: plain PyTorch (torch.load + load_state_dict) and the user's own code.
LOAD = """
import json, sys, torch
from torch import nn
from tests import user_model
from potluck.cli.tasks import accuracy, load_data, make_model
out = {}
for name in ("ps", "pipeline"):
    model = nn.Sequential(*user_model.make_layers())
    model.load_state_dict(torch.load(sys.argv[1] + f"/{name}.pt", weights_only=True))
    out[name] = user_accuracy(model)
digits = make_model()
digits.load_state_dict(torch.load(sys.argv[1] + "/digits/model.pt", weights_only=True))
_, _, x_test, y_test = load_data()
out["digits"] = accuracy(digits, x_test, y_test)
print(json.dumps(out))
"""


def user_accuracy(model: torch.nn.Module) -> float:
    """Accuracy on a fixed set of the user model's points (its teacher's labels)."""
    x = torch.randn(512, user_model.FEATURES, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        return (model(x).argmax(1) == user_model._labels(x)).float().mean().item()


def potluck(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    done = forkserver.run([sys.executable, "-m", "potluck", *args], capture_output=True, text=True, env=ENV,
                          cwd=ROOT, timeout=timeout)
    assert done.returncode == 0, f"potluck {' '.join(args)}: {done.stdout[-1500:]}\n{done.stderr[-2500:]}"
    return done


def start(*command: str) -> subprocess.Popen:
    return forkserver.Popen(list(command), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV,
                            cwd=ROOT)


def finish(proc: subprocess.Popen, timeout: float = 150) -> str:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
    assert proc.returncode == 0, f"{proc.args}: {out[-1500:]}\n{err[-2500:]}"
    return out


@pytest.mark.timeout(300)
def test_each_mode_saves_a_model_that_plain_pytorch_loads_with_the_accuracy_the_run_ended_with(tmp_path):
    """The three runs at once (the machine is small): a ps server and worker --save; one pipeline
    node --save for a few seconds, then export; the digits example --save. A fresh process loads
    the three files with torch.load and gets the accuracy each run ended with."""
    python = sys.executable
    server = start(python, "-m", "potluck", "ps", "server", "--host", "127.0.0.1", "--run-id", "saved",
                   "--shard", "0", *SPEC)
    pipeline = start(python, "-m", "potluck", "pipeline", "run", "--host", "127.0.0.1", "--run-id", "saved-pipe",
                     "--nodes", "1", "--duration", "4", "--report-every", "0.5", "--save", str(tmp_path / "nodes"),
                     *SPEC)
    digits = start(python, "examples/train_digits.py", "--host", "127.0.0.1", "--target-batch-size", "256",
                   "--duration", "6", "--save", str(tmp_path / "digits"))
    try:
        address = re.search(r"--initial-peers (\S+)", server.stdout.readline() + server.stdout.readline()).group(1)
        worker = potluck("ps", "worker", "--host", "127.0.0.1", "--run-id", "saved", "--initial-peers", address,
                         "--steps", "40", "--save", str(tmp_path / "ps.pt"), *SPEC)
    finally:
        server.send_signal(2)
        server.communicate(timeout=30)
    assert "UserWarning" not in worker.stderr and "requires_grad" not in worker.stderr, worker.stderr
    sha = re.search(r"final parameters sha256 (\w+)", worker.stdout).group(1)
    rows = [json.loads(line) for line in finish(pipeline).splitlines()]
    final = [r for r in rows if r.get("final")]
    assert len(final) == 1 and final[0]["updates"] > 0 and final[0]["stopped_by"] == "duration", rows[-3:]
    exported = potluck("pipeline", "export", str(tmp_path / "nodes"), "--out", str(tmp_path / "pipeline.pt"))
    assert "layers 0-2 of cluster c0" in exported.stdout
    digits_out = finish(digits)
    ended = float(re.search(r"stopped at epoch \d+: test accuracy ([\d.]+)%", digits_out).group(1)) / 100

    loaded = subprocess.run([python, "-c", f"from tests.test_save_export import user_accuracy\n{LOAD}",
                             str(tmp_path)], capture_output=True, text=True, env=ENV, cwd=ROOT, timeout=120)
    assert loaded.returncode == 0, loaded.stderr[-2000:]
    accuracies = json.loads(loaded.stdout)
    # ps: the very parameters the worker ended with (its digest), so its accuracy
    from potluck.cli.ps import params_digest
    ps_model = torch.nn.Sequential(*user_model.make_layers())
    ps_model.load_state_dict(torch.load(tmp_path / "ps.pt", weights_only=True))
    assert params_digest(list(ps_model.parameters())) == sha
    assert accuracies["ps"] == user_accuracy(ps_model)
    # pipeline: the layers the node saved, run one after the other, give the exported model's accuracy
    (node_file,) = (tmp_path / "nodes").glob("*.pt")
    saved = torch.load(node_file, weights_only=True)
    layers = user_model.make_layers()
    for i, layer in enumerate(layers):
        layer.load_state_dict(saved["layers"][i])
    assert accuracies["pipeline"] == user_accuracy(torch.nn.Sequential(*layers))
    assert abs(accuracies["digits"] - ended) < 1e-6, (accuracies, ended)
    assert min(accuracies.values()) > 0.5, accuracies  # they trained: chance is 0.25 and 0.1


@pytest.mark.timeout(240)
def test_a_resumed_optimizer_peer_goes_on_from_its_epoch_and_rejoins_the_swarm(tmp_path):
    """Two peers train; one saves a checkpoint and leaves while the other goes on. Restarted with
    the checkpoint (a new process would do the same), it starts at its saved epoch, not 0, and
    trains with the swarm again: both end the same epochs with the same parameters."""
    members = [Member(0, [], "rejoin")]
    members.append(Member(1, members[0].peer.addresses, "rejoin"))
    try:
        train(members, 3, within=120)
        members[1].opt.save_checkpoint(tmp_path / "peer1.ckpt")
        members.pop().close()
        train(members[:1], 5, within=120)  # the swarm moves on without it
        back = Member(2, members[0].peer.addresses, "rejoin")
        members.append(back)
        back.opt.load_checkpoint(tmp_path / "peer1.ckpt")
        assert back.opt.local_epoch == 3
        final = 9
        train([members[0], back], final, within=150)
        # It may rejoin without the swarm's state (the donor was mid-round); the state averaging
        # every 4 epochs repairs that, unless one of the two misses that round (its gradient round
        # failed while the other's went on: seen in CI): then the next gradient round repairs it,
        # by a state averaging after its update, which the epoch's hooks do not see (one CI run: the
        # last epoch's digests differed, the parameters after it did not). So train on until the
        # last epoch's update itself found both alike.
        def apart() -> bool:
            return digest(back.model) != digest(members[0].model) \
                or back.digests.get(final) != members[0].digests.get(final)

        while apart() and final < 17:
            final += 4
            train([members[0], back], final, within=150)
        assert back.opt.local_epoch == members[0].opt.local_epoch == final
        together = [e for e in range(6, final + 1) if back.digests.get(e) == members[0].digests.get(e) is not None]
        assert together and together[-1] == final, \
            {e: (back.digests.get(e, "-")[:8], members[0].digests.get(e, "-")[:8]) for e in range(3, final + 1)}
        assert digest(back.model) == digest(members[0].model)
    finally:
        for m in members:
            m.close()


@pytest.mark.timeout(120)
def test_a_pipeline_node_sent_ctrl_c_saves_its_layers_and_ends_with_one_final_row(tmp_path):
    """Ctrl-C (SIGINT, twice: an impatient user) while the node trains: exit code 0, its layers
    saved, no traceback, and one final row, the last, that says a signal stopped it."""
    node = start(sys.executable, "-m", "potluck", "pipeline", "run", "--host", "127.0.0.1", "--run-id", "ctrl-c",
                 "--nodes", "1", "--report-every", "0.5", "--save", str(tmp_path / "nodes"), *SPEC)
    try:
        for line in node.stdout:  # until it trains
            if json.loads(line).get("updates", 0) > 0:
                break
        node.send_signal(signal.SIGINT)
        time.sleep(0.2)
        node.send_signal(signal.SIGINT)
        out, err = node.communicate(timeout=60)
    finally:
        if node.poll() is None:
            node.kill()
            node.communicate()
    assert node.returncode == 0 and "Traceback" not in err, err[-2500:]
    rows = [json.loads(line) for line in out.splitlines()]
    assert rows and rows[-1].get("final") and rows[-1]["stopped_by"] == "signal", rows[-3:]
    assert sum(bool(r.get("final")) for r in rows) == 1 and Path(rows[-1]["saved"]).is_file(), rows[-1]
