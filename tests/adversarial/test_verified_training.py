"""Verified training (issue 30, BTARD-style): a member that sends gradients other than those of its
public batches is caught by peers that recompute them, and banned; honest members never are.

Four peers on the emulated network train a small classifier with `verify=Verified(...)` and a
validation fraction of 1 (every round, each peer recomputes one other member's gradient). Before
verified training nothing checked a gradient against its data: a member that scaled its
gradients, or computed them on other data, stayed in every group for the whole run.
"""

from __future__ import annotations

import asyncio
import random

import pytest
import torch

import potluck
from potluck.averaging.accountability import ban_list
from potluck.core.runner import acquire_runner, release_runner
from potluck.core.virtual_time import virtual_time_loop
from potluck.net.emulated import EmulatedNetwork
from potluck.optim import Optimizer, Verified
from potluck.optim.verified import batch_indices
from tests.adversarial.members import join

BATCH, TARGET, EPOCHS = 8, 32, 6


def dataset() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(256, 16, generator=g)
    y = (x[:, 0] > 0).long() + 2 * (x[:, 1] > 0).long()
    return list(zip(x, y, strict=True))


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))


def loss(model: torch.nn.Module, batch) -> torch.Tensor:
    x, y = batch
    return torch.nn.functional.cross_entropy(model(x), y)


def noisy_loss(model: torch.nn.Module, batch) -> torch.Tensor:
    """Not a function of the model and the batch alone (as dropout is not)."""
    x, y = batch
    return torch.nn.functional.cross_entropy(model(x + 0.1 * torch.randn_like(x)), y)


async def scene(lie: str | None, data, accuser: int | None = None, lossf=loss, forge: bool = False,
                after=None) -> tuple[list[Optimizer], list[int], list[set[str]]]:
    network = EmulatedNetwork(latency=0.01, seed=1)
    peers: list[potluck.Peer] = []
    for _ in range(4):
        await join(network, peers)
    models = [make_model() for _ in peers]
    optimizers = [Optimizer(peer, "verified", model.parameters(), lambda p: torch.optim.SGD(p, 0.1),
                            target_batch_size=TARGET, batch_size_per_step=BATCH, load_state=False, start=False,
                            verify=Verified(model, lossf, data, fraction=1.0))
                  for peer, model in zip(peers, models, strict=True)]
    for i, opt in enumerate(optimizers):
        opt.validation.rng = random.Random(i)  # repeatable draws (peers draw from the OS by default)
    liar = 3 if lie else None
    if liar is not None:
        optimizers[liar].validation.self_checked = True  # a liar skips the check of its own gradients
    if accuser is not None:  # it finds every member it validates lying, and tells the others
        async def always_off(case) -> float:
            if forge:  # and changes the blocks it shows, to make the lie visible
                case.blocks[0].values.add_(1.0)
            return 1.0
        optimizers[accuser].validation._recompute = always_off
        optimizers[accuser].validation.self_checked = True

    errors: list[BaseException] = []

    async def train(i: int) -> None:
        try:
            await steps(i)
        except RuntimeError as e:
            errors.append(e)

    async def steps(i: int) -> None:
        other = torch.Generator().manual_seed(99)
        while optimizers[i].local_epoch < EPOCHS:
            batch = optimizers[i].batch()
            if i == liar and lie == "other data":
                picks = torch.randint(len(data), (BATCH,), generator=other).tolist()
                batch = torch.utils.data.default_collate([data[k] for k in picks])
            scale = 1.5 if i == liar and lie == "scaled" else 1.0
            (scale * lossf(models[i], batch)).backward()
            await asyncio.sleep(0.02)
            await optimizers[i].astep()
    try:
        for opt in optimizers:
            await opt.astart()
        honest = [i for i in range(4) if i != liar]
        lying = asyncio.ensure_future(train(liar)) if liar is not None else None
        await asyncio.wait_for(asyncio.gather(*(train(i) for i in honest)), 600)
        for opt in optimizers:  # let validations under way finish
            if opt.validation.task is not None:
                await asyncio.gather(opt.validation.task, return_exceptions=True)
        for _ in range(100):  # and the accusations they sent
            await asyncio.sleep(0.1)
            if not any(opt.validation.tasks for opt in optimizers):
                break
        if lying is not None:
            lying.cancel()
            await asyncio.gather(lying, return_exceptions=True)
        if after is not None:
            await after(optimizers, peers)
        bans = [{str(p) for p in ban_list(peer.transport)} for peer in peers]
        scene.errors = errors
        return optimizers, honest, bans
    finally:
        for opt in optimizers:
            opt.shutdown()
        for peer in peers:
            await peer.ashutdown()


def run(lie: str | None, accuser: int | None = None, lossf=loss, forge: bool = False, after=None):
    runner = acquire_runner(virtual_time_loop)
    try:
        return runner.run(scene(lie, dataset(), accuser, lossf, forge, after), timeout=600)
    finally:
        release_runner()


@pytest.mark.timeout(300)
def test_honest_verified_peers_validate_each_other_and_ban_nobody():
    optimizers, _, bans = run(None)
    assert sum(opt.validation.validated for opt in optimizers) >= 4
    for opt, banned in zip(optimizers, bans, strict=True):
        assert not opt.validation.caught
        assert not banned


@pytest.mark.timeout(300)
@pytest.mark.parametrize("lie", ["scaled", "other data"])
def test_a_member_whose_gradients_are_not_its_batches_is_caught_and_banned_by_every_honest_peer(lie):
    """One honest peer catches it; its evidence makes the others check and ban it too."""
    optimizers, honest, bans = run(lie)
    liar = str(optimizers[3].peer.peer_id)
    assert any(liar in optimizers[i].validation.caught for i in honest), "no honest peer caught the liar"
    for i in honest:
        assert bans[i] == {liar}, (i, bans[i])  # the liar, and no honest peer
        assert set(optimizers[i].validation.caught) <= {liar}


def test_public_batches_are_fixed_by_run_epoch_peer_and_step():
    a = batch_indices("run", 3, "peer", 5, 16, 1000)
    assert a == batch_indices("run", 3, "peer", 5, 16, 1000) and len(a) == 16 and all(0 <= i < 1000 for i in a)
    assert a != batch_indices("run", 3, "peer", 6, 16, 1000)
    assert a != batch_indices("run", 4, "peer", 5, 16, 1000)
    assert a != batch_indices("run", 3, "other", 5, 16, 1000)
    assert a != batch_indices("other", 3, "peer", 5, 16, 1000)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("forge", [False, True], ids=["true-blocks", "forged-blocks"])
def test_a_false_accuser_is_banned_by_the_members_it_told_and_the_accused_by_nobody(forge):
    """Peer 3 bans every member it validates and sends the others its evidence: each recomputes
    the accused's gradients itself, finds them right, and bans the accuser instead; or, where the
    accuser changed the blocks, finds that the accused's seals do not cover them."""
    optimizers, _, bans = run(None, accuser=3, forge=forge)
    accuser = str(optimizers[3].peer.peer_id)
    accused = set(optimizers[3].validation.caught)
    assert accused, "the false accuser accused nobody"
    told = [i for i in range(3) if optimizers[i].peer.peer_id not in accused]
    assert told and all(bans[i] == {accuser} for i in told), bans  # they checked, and banned the accuser
    for i in range(3):
        assert accuser in bans[i] or str(optimizers[i].peer.peer_id) in accused
        assert not bans[i] & accused  # no honest peer was banned on the accuser's word


@pytest.mark.timeout(300)
def test_a_loss_that_is_not_deterministic_stops_each_peer_with_a_clear_error_before_it_accuses_anyone():
    optimizers, _, bans = run(None, lossf=noisy_loss)
    assert not any(bans), bans
    assert scene.errors and all("must be a deterministic function" in str(e) for e in scene.errors)


def test_dropout_is_refused_when_the_optimizer_is_built():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.1))
    with pytest.raises(ValueError, match="dropout"):
        Verified(model, loss, dataset()).check()


def test_a_member_a_witness_caught_lying_is_credited_nothing_in_any_epoch(tmp_path):
    """The ledger takes back a caught member's credit, past epochs included, on a witness's word
    (the witness checked the lie itself); a non-witness naming an honest member changes nothing."""
    from potluck.monitor.ledger import Ledger
    from potluck.optim.progress import RoundRecord

    members = ("w", "h", "liar")
    records = [RoundRecord(e, 0, tuple((m, 8) for m in members), round=f"r{e}") for e in range(3)]
    with Ledger(tmp_path / "run.db", "run", witnesses={"w"}) as ledger:
        ledger.observe(1.0, {}, {m: records[:2] for m in members})
        assert ledger.credits() == {"w": 16, "h": 16, "liar": 16}
        ledger.observe(2.0, {}, {m: records for m in members}, caught={"w": ["liar"], "liar": ["h"]})
        assert ledger.credits() == {"w": 24, "h": 24}
        assert [r.samples for r in sorted(ledger.epochs(), key=lambda r: r.epoch)] == [16, 16, 16]


@pytest.mark.timeout(300)
def test_accusations_about_rounds_a_peer_was_not_in_cost_it_one_check_an_epoch():
    """Anyone holding a member's sealed blocks can name a made-up group around them. Identities
    flooding a peer with such accusations get one checked per epoch (here: its parameters are
    not the round's, and its sender is banned); the rest are refused before any hashing."""
    from types import SimpleNamespace

    from potluck.averaging.accountability import (
        VERIFY_BLOCK,
        block_digests,
        chunk_digest,
        claim_digest,
        piece_root,
        seal_message,
    )
    from potluck.averaging.allreduce import Group
    from potluck.core.errors import PotluckError
    from potluck.net.identity import Identity
    from potluck.optim.progress import RoundNote
    from potluck.optim.verified import Accusation, BlockProof
    outcomes: list[str] = []
    sybils = [Identity.generate() for _ in range(5)]

    async def flood(optimizers, peers):
        target, accused = optimizers[0].validation, peers[1].transport.identity
        epoch = max(target.digests)
        claim = RoundNote(8, params=target.digests[epoch]).to_wire()
        params = tuple(torch.zeros_like(p) for p in target.params)  # not the round's
        size = sum(p.numel() for p in params)
        values = torch.randn(size)
        digests = (chunk_digest(values),)
        for k, sybil in enumerate(sybils):
            group = Group(bytes([k]) * 32, (sybil.peer_id, accused.peer_id), ("node", "node"), (size, 0))
            seal = accused.sign(seal_message(group.group_id, 0, 1, piece_root(1.0, digests), claim_digest(claim)))
            proof = BlockProof(0, 0, 0, 1.0, digests, tuple(block_digests(values)), values[:VERIFY_BLOCK], seal)
            request = Accusation(group, epoch, 1, (proof,), params, claim).to_wire()
            try:
                await target._on_accusation(request, SimpleNamespace(peer_id=sybil.peer_id))
                outcomes.append("checked")
            except PotluckError as e:
                outcomes.append(str(e))

    _, _, bans = run(None, after=flood)
    assert outcomes[0] == "checked" and all("already" in o for o in outcomes[1:]), outcomes
    assert bans[0] == {str(sybils[0].peer_id)}  # the checked one: parameters other than the round's


@pytest.mark.timeout(60)
def test_verified_runs_share_their_data_and_refuse_what_cannot_be_checked():
    """The dataset's digest and the batch size are part of the run schema (peers drawing other
    batches could not check each other); modes and codecs that hide the gradient are refused."""
    from potluck.optim import DiLoCo
    from tests.emulated_swarm import run_on_shared_runner

    async def main():
        network = EmulatedNetwork(latency=0.01, seed=1)
        peer = await join(network, [])

        def build(run: str, data, batch: int = BATCH, **options) -> Optimizer:
            model = make_model()
            return Optimizer(peer, run, model.parameters(), lambda p: torch.optim.SGD(p, 0.1), TARGET, batch,
                             load_state=False, start=False, verify=Verified(model, loss, data), **options)
        try:
            same, other = build("a", dataset()), build("b", dataset())
            assert same.schema.fingerprint == other.schema.fingerprint
            assert build("c", dataset()[:-1]).schema.fingerprint != same.schema.fingerprint
            assert build("d", dataset(), batch=4).schema.fingerprint != same.schema.fingerprint
            with pytest.raises(ValueError, match="mode='sync'"):
                build("e", dataset(), mode=DiLoCo())
            with pytest.raises(ValueError, match="compression='none'"):
                build("f", dataset(), compression="blockwise8")
        finally:
            await peer.ashutdown()
    run_on_shared_runner(main())
