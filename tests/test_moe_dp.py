"""Experts plus data parallelism in one model: two trainers share remote experts (trained by their
server) and train their own parameters (gate included) with `potluck.Optimizer`; real peers on
127.0.0.1, trainers in threads."""

from __future__ import annotations

import copy
import threading

import pytest
import torch
from torch import nn

import potluck
from potluck.cli.ps import params_digest
from potluck.moe import ExpertServer, RemoteMixtureOfExperts

HIDDEN, BATCH, EPOCHS, TRAINERS = 16, 8, 6, 2
GRID = (1, 4)


class Trainer:
    """One trainer: input layer -> remote mixture -> classifier; only the local layers and the gate
    are its parameters, and potluck.Optimizer keeps them in step with the other trainer's."""

    def __init__(self, index: int, initial: list[str]):
        self.index = index
        self.peer = potluck.Peer(host="127.0.0.1", initial_peers=initial)
        torch.manual_seed(0)  # every trainer starts from the same shared parameters
        self.moe = RemoteMixtureOfExperts(self.peer, HIDDEN, GRID, "ffn", k_best=GRID[1], forward_timeout=20,
                                          backward_timeout=20)
        self.model = nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.ReLU(), self.moe, nn.Linear(HIDDEN, 4))
        self.opt = potluck.Optimizer(self.peer, "moe-dp", self.model.parameters(),
                                     lambda p: torch.optim.Adam(p, 1e-2), target_batch_size=BATCH * 4 * TRAINERS,
                                     batch_size_per_step=BATCH, matchmaking_time=0.5, load_state=False)
        self.digests: dict[int, str] = {}  # the shared parameters right after each epoch
        self.error: BaseException | None = None

    def train(self) -> None:
        generator = torch.Generator().manual_seed(self.index)
        try:
            while self.opt.local_epoch < EPOCHS:
                x = torch.randn(BATCH, HIDDEN, generator=generator)
                y = (x[:, 0] > 0).long() + 2 * (x[:, 1] > 0).long()
                nn.functional.cross_entropy(self.model(x), y).backward()
                epoch = self.opt.local_epoch
                self.opt.step()
                if self.opt.local_epoch != epoch:
                    self.digests[self.opt.local_epoch] = params_digest(list(self.model.parameters()))
        except BaseException as e:  # reported by the test's thread
            self.error = e

    def close(self) -> None:
        self.opt.shutdown()
        self.peer.shutdown()


@pytest.mark.timeout(120)
def test_trainers_shared_parameters_stay_identical_while_their_experts_learn_on_the_server():
    server_peer = potluck.Peer(host="127.0.0.1")
    server = ExpertServer.from_type(server_peer, [f"ffn.0.{j}" for j in range(GRID[1])], "ffn", HIDDEN,
                                    lambda p: torch.optim.Adam(p, 1e-2))
    trainers: list[Trainer] = []
    try:
        experts_before = {uid: copy.deepcopy(h.module.state_dict()) for uid, h in server.experts.items()}
        trainers = [Trainer(i, server_peer.addresses) for i in range(TRAINERS)]
        start = params_digest(list(trainers[0].model.parameters()))
        assert not any(p is q for p in trainers[0].model.parameters() for h in server.experts.values()
                       for q in h.module.parameters())
        threads = [threading.Thread(target=t.train, daemon=True) for t in trainers]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(90)
        for t in trainers:
            assert t.error is None, t.error
            assert t.opt.local_epoch == EPOCHS
        for epoch in range(1, EPOCHS + 1):
            assert len({t.digests.get(epoch) for t in trainers}) == 1, f"trainers differ after epoch {epoch}"
        assert trainers[0].digests[EPOCHS] != start  # the shared parameters did learn
        for uid, hosted in server.experts.items():  # every expert was stepped by its server
            assert hosted.stats.updates > 0, uid
            changed = [not torch.equal(v, experts_before[uid][k]) for k, v in hosted.module.state_dict().items()]
            assert all(changed), uid
    finally:
        for t in trainers:
            t.close()
        server.shutdown()
        server_peer.shutdown()
