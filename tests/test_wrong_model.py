"""A peer that joins a run with another model (issue 29): refused at once, never slowing the others.

The swarm runs on the emulated network under the virtual clock, so every rate is exact and the
same run with and without the wrong peer is compared to the epoch; the same peer over real TCP
stops with the clear error too.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest
import torch

import potluck
from potluck.core.dht_time import event_loop_clock
from potluck.net.emulated import EmulatedNetwork
from potluck.optim import Optimizer
from potluck.optim.schema import ModelMismatch
from tests.emulated_swarm import run_on_shared_runner

RUN = "spirals"
BATCH, TARGET = 8, 128
HIDDEN, WRONG_HIDDEN = 32, 64
HONEST_COMPUTE, WRONG_COMPUTE = 0.02, 0.05  # seconds per batch; the wrong peer is throttled, as in the issue
SECONDS = 12.0  # of virtual time the honest peers train in each run
# What the wrong peer must be told: the first differing tensor, its own and the run's.
EXPECTED = (f"parameter 0 '0.weight': yours is float32 [{WRONG_HIDDEN}, 16], "
            f"the run's is float32 [{HIDDEN}, 16]")


def make_model(hidden: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 4))


def batch(generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(BATCH, 16, generator=generator)
    return x, (x[:, 0] > 0).long() + 2 * (x[:, 1] > 0).long()


async def emulated_run(wrong: bool) -> dict[str, Any]:
    """Two honest peers train for SECONDS of virtual time (and a wrong peer beside them, if
    `wrong`); their epochs then, and when (and with what) the wrong peer's step() failed."""
    loop = asyncio.get_running_loop()
    network = EmulatedNetwork(latency=0.01, seed=1)
    peers: list[potluck.Peer] = []
    hiddens = [HIDDEN, HIDDEN] + ([WRONG_HIDDEN] if wrong else [])
    for _ in hiddens:
        peers.append(await potluck.Peer.create(peers[0].addresses if peers else [], transport=network.transport(),
                                               clock=event_loop_clock()))
    models = [make_model(h) for h in hiddens]
    opts = [Optimizer(p, RUN, m.named_parameters(), lambda ps: torch.optim.SGD(ps, 0.1), target_batch_size=TARGET,
                      batch_size_per_step=BATCH, load_state=False, start=False) for p, m in zip(peers, models)]
    for opt in opts:
        await opt.astart()
    start = loop.time()
    failed: dict[int, tuple[float, str]] = {}

    async def train(i: int, compute: float) -> None:
        generator = torch.Generator().manual_seed(i)
        try:
            while loop.time() - start < SECONDS:
                x, y = batch(generator)
                torch.nn.functional.cross_entropy(models[i](x), y).backward()
                await asyncio.sleep(compute)
                await opts[i].astep()
        except ModelMismatch as e:
            failed[i] = (loop.time() - start, str(e))

    try:
        await asyncio.gather(*(train(i, WRONG_COMPUTE if h != HIDDEN else HONEST_COMPUTE)
                               for i, h in enumerate(hiddens)))
        return {"epochs": [o.local_epoch for o in opts[:2]], "failed": failed,
                "online": [sorted(r.peer_id for r in o.progress().reports) for o in opts[:2]]}
    finally:
        for opt in opts:
            opt.shutdown()
        for peer in peers:
            await peer.ashutdown()


@pytest.mark.timeout(120)
def test_a_wrong_model_is_refused_at_once_and_the_honest_rate_holds():
    """Two honest peers and a slower one whose model is wider. Before: the wrong peer was counted
    in the global batch and the round's group, so each round waited for it; it trained on without
    an error. Now the honest peers complete as many epochs in the same virtual time as without it
    (at least 0.9x), and the wrong peer's step() raises within seconds, naming the first
    differing tensor and what the run has."""
    alone = run_on_shared_runner(emulated_run(wrong=False), timeout=120)
    beside = run_on_shared_runner(emulated_run(wrong=True), timeout=120)
    assert min(alone["epochs"]) >= 10, alone
    assert min(beside["epochs"]) >= 0.9 * min(alone["epochs"]), (alone, beside)
    assert list(beside["failed"]) == [2], beside["failed"]  # the wrong peer, and only it
    seconds, message = beside["failed"][2]
    assert seconds <= 5.0, beside["failed"]  # virtual seconds: exact
    assert EXPECTED in message and "\n" not in message
    assert len(beside["online"][0]) == 2  # not in the honest peers' view


class Trainer:
    """A peer over real TCP on 127.0.0.1 training a model of `hidden` units in its own thread."""

    def __init__(self, index: int, initial: list[str], hidden: int):
        self.peer = potluck.Peer(host="127.0.0.1", initial_peers=initial)
        self.model = make_model(hidden)
        self.opt = Optimizer(self.peer, RUN, self.model.named_parameters(), lambda p: torch.optim.SGD(p, 0.1),
                             target_batch_size=TARGET, batch_size_per_step=BATCH, load_state=False)
        self.index = index
        self.error: ModelMismatch | None = None
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._train, daemon=True)

    def _train(self) -> None:
        generator = torch.Generator().manual_seed(self.index)
        try:
            while not self.stop.is_set():
                x, y = batch(generator)
                torch.nn.functional.cross_entropy(self.model(x), y).backward()
                time.sleep(0.01)
                self.opt.step()
        except ModelMismatch as e:
            self.error = e

    def close(self) -> None:
        self.stop.set()
        self.thread.join(60)
        self.opt.shutdown()
        self.peer.shutdown()


@pytest.mark.timeout(120)
def test_a_wrong_model_over_tcp_stops_with_the_clear_error_while_the_others_train():
    """The same over real TCP: the wrong peer's step() raises the one-line error once the
    honest peers have completed rounds; they train on, counting only each other."""
    trainers: list[Trainer] = []
    try:
        trainers.append(Trainer(0, [], HIDDEN))
        trainers += [Trainer(1, trainers[0].peer.addresses, HIDDEN), Trainer(2, trainers[0].peer.addresses,
                                                                                WRONG_HIDDEN)]
        for t in trainers:
            t.thread.start()
        wrong = trainers[2]
        wrong.thread.join(60)
        assert not wrong.thread.is_alive() and wrong.error is not None, "the wrong peer was never told"
        assert EXPECTED in str(wrong.error) and "\n" not in str(wrong.error)
        epoch = trainers[0].opt.local_epoch
        deadline = time.monotonic() + 60
        while min(t.opt.local_epoch for t in trainers[:2]) < epoch + 3 and time.monotonic() < deadline:
            time.sleep(0.1)  # polling the honest peers' epochs: nothing to wait on instead
        assert min(t.opt.local_epoch for t in trainers[:2]) >= epoch + 3
        assert all(t.error is None for t in trainers[:2])
    finally:
        for t in trainers:
            t.close()


def test_a_run_is_confirmed_by_two_live_members_that_record_the_same_round():
    """`confirmed_runs`: a round counts only when two live peers of one fingerprint each publish
    it, each listing the other; records one identity publishes alone, however many, confirm
    nothing, nor do members that are not live under that fingerprint."""
    from potluck.optim.progress import PublishedRounds, RoundRecord, confirmed_runs

    def published(me: str, members: tuple[str, ...], fingerprint: str = "a" * 32, rounds: int = 1) -> PublishedRounds:
        records = tuple(RoundRecord(e, 0, tuple((m, 8) for m in members), round=f"r{e}") for e in range(rounds))
        return PublishedRounds(records, None, fingerprint)
    live = {"p": "a" * 32, "q": "a" * 32, "r": "b" * 32}
    assert confirmed_runs({"p": published("p", ("p", "q")), "q": published("q", ("p", "q"))}, live) == \
        {"a" * 32: {"p", "q"}}
    assert confirmed_runs({"p": published("p", ("p", "q"), rounds=16)}, live) == {}  # q never recorded it
    assert confirmed_runs({"p": published("p", ("p",)), "q": published("q", ("q",))}, live) == {}  # not each other
    assert confirmed_runs({"p": published("p", ("p", "r")), "r": published("r", ("p", "r"))}, live) == {}  # r is b's
    assert confirmed_runs({"p": published("p", ("p", "q")), "q": published("q", ("p", "q"))}, {"p": "a" * 32}) == {}


def test_the_schema_names_what_differs_and_leaves_out_what_each_peer_may_choose():
    """What must match and what each peer may choose (docs/security.md, "A wrong model")."""
    from potluck.optim import Sync
    from potluck.optim.modes import run_schema

    def schema(hidden: int = HIDDEN, target: int = TARGET, named: bool = True, lr: float = 0.1,
               weight_decay: float = 0.0, **sync: Any):
        model = make_model(hidden)
        optimizer = torch.optim.SGD(model.named_parameters() if named else model.parameters(), lr,
                                    weight_decay=weight_decay)
        return run_schema(optimizer, Sync(**sync), target, "none", "mean")
    run = schema()
    assert schema(lr=0.01).fingerprint == schema(delay_updates=True).fingerprint == run.fingerprint
    assert schema(target=2 * TARGET).difference(run) == f"setting 'target_batch_size': yours is {2 * TARGET}, " \
                                                        f"the run's is {TARGET}"
    assert schema(weight_decay=0.1).difference(run) == \
        "setting 'optimizer.0.weight_decay': yours is 0.1, the run's is 0.0"
    assert schema(average_state_every=2).fingerprint != run.fingerprint
    assert "without a name" in schema(named=False).difference(run)
    assert schema(WRONG_HIDDEN).difference(run).startswith(EXPECTED)
