"""Expert servers as real processes (`potluck expert-server`), one killed with SIGKILL mid-training."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
import torch
from torch import nn

import potluck
from potluck.cli.tasks import load_data
from potluck.moe import RemoteMixtureOfExperts
from tests import forkserver
from tests.conftest import ROOT, PeerProcess

HIDDEN = 32


class ExpertServerProcess(PeerProcess):
    """`potluck expert-server` in a child process; knows its address once it says it is ready."""

    def __init__(self, *args: str):
        env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), OMP_NUM_THREADS="1")
        self.proc = forkserver.Popen([sys.executable, "-m", "potluck", "expert-server", "--host", "127.0.0.1", *args],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        self.address = None
        for line in self.proc.stdout:  # ends at EOF if the process dies, so this cannot hang forever
            if line.strip().startswith("--initial-peers"):
                self.address = line.split()[-1]
            if line.startswith("ready"):
                break
        if self.address is None:
            raise RuntimeError("expert server failed to start: " + self.proc.stderr.read())


@pytest.mark.timeout(120)
def test_training_continues_with_the_surviving_experts_after_a_server_is_killed():
    common = ["--hidden", str(HIDDEN), "--optimizer", "adam", "--lr", "0.003", "--announce-ttl", "30"]
    servers = [ExpertServerProcess("--experts", "ffn.0.[0:2]", *common)]
    try:
        servers.append(ExpertServerProcess("--experts", "ffn.1.[0:2]", "--initial-peers", servers[0].address, *common))
        x, y, _, _ = load_data()
        x = x.reshape(len(x), -1)
        torch.manual_seed(0)
        with potluck.Peer(initial_peers=[servers[0].address], host="127.0.0.1", client_mode=True) as peer:
            moe = RemoteMixtureOfExperts(peer, HIDDEN, (2, 2), "ffn", k_best=3, k_min=1, forward_timeout=10,
                                         backward_timeout=10)
            model = nn.Sequential(nn.Linear(64, HIDDEN), moe, nn.Linear(HIDDEN, 10))
            opt = torch.optim.Adam(model.parameters(), 3e-3)
            generator = torch.Generator().manual_seed(0)
            losses, answered = [], []
            kill_at, steps = 40, 120
            for step in range(steps):
                if step == kill_at:
                    servers[1].kill(signal.SIGKILL)
                    servers[1].proc.wait(10)
                batch = torch.randint(0, len(y), (64,), generator=generator)
                loss = nn.functional.cross_entropy(model(x[batch]), y[batch])
                opt.zero_grad()
                loss.backward()
                opt.step()
                losses.append(loss.item())
                answered.append(moe.last_answered)
        assert max(answered[:kill_at]) == 3  # before: every sample got its 3 best experts
        assert max(answered[kill_at + 1:]) <= 2  # after: only the survivor's two experts answer
        after_kill = sum(losses[kill_at:kill_at + 20]) / 20
        at_end = sum(losses[-20:]) / 20
        assert at_end < 0.8 * after_kill, [round(v, 2) for v in losses[::10]]  # the loss kept falling
        assert servers[0].proc.poll() is None
    finally:
        for s in servers:
            s.close()
