"""PowerSGD averaging rounds (two butterfly all-reduces) on the emulated network."""

from __future__ import annotations

import asyncio

import pytest
import torch

from potluck.averaging.lowrank import PHASE1_SUFFIX, PHASE2_SUFFIX, powersgd_allreduce
from potluck.compression import PowerSGD
from potluck.core.errors import AveragingError
from potluck.core.virtual_time import run_virtual
from tests.test_allreduce import CODEC, make_group, swarm

SHAPES = [(40, 30), (8, 6), (30,)]  # compressed at rank 3; (8, 6) at rank 6 and the bias are not
WEIGHTS = [1.0, 2.0, 3.0, 4.0]


def states_for(n: int, rank: int, error_feedback: bool = True, shapes=SHAPES) -> list[list[PowerSGD]]:
    return [[PowerSGD(s, rank=6 if s == (8, 6) else rank, seed=k, error_feedback=error_feedback)
             for k, s in enumerate(shapes)] for _ in range(n)]


def low_rank_grads(gen: torch.Generator, n: int, rank: int = 3) -> list[list[torch.Tensor]]:
    """Per-peer gradients whose (40, 30) matrices share one rank-`rank` column space, so their
    weighted mean over any subset is carried exactly by PowerSGD at that rank."""
    left = torch.randn(40, rank, generator=gen)
    return [[left @ torch.randn(rank, 30, generator=gen), torch.randn(8, 6, generator=gen), torch.randn(30, generator=gen)]
            for _ in range(n)]


def weighted_mean(grads, members, k):
    total = sum(WEIGHTS[i] for i in members)
    return sum(grads[i][k] * (WEIGHTS[i] / total) for i in members)


async def round_(services, group, states, grads, members=None, **kwargs):
    kwargs.setdefault("timeout", 60.0)
    kwargs.setdefault("sender_timeout", 2.0)
    members = range(len(services)) if members is None else members
    return await asyncio.gather(*(powersgd_allreduce(services[i], group, states[i], grads[i], WEIGHTS[i], CODEC,
                                                     **kwargs) for i in members), return_exceptions=True)


def assert_identical(outcomes):
    first = outcomes[0]
    for out in outcomes:
        assert not isinstance(out, BaseException), out
        assert out[1] == first[1]
        assert all(torch.equal(a, b) for a, b in zip(out[0], first[0], strict=True)), "peers differ"


@pytest.mark.timeout(60)
def test_rank_that_carries_the_mean_gives_the_exact_weighted_mean():
    """Rank 3 on rank-3 data (and full rank on (8, 6), which goes uncompressed) is exact."""
    async def main():
        net, transports, services = await swarm(4)
        group = make_group(transports, ["node"] * 4, sum(torch.Size(s).numel() for s in SHAPES))
        grads = low_rank_grads(torch.Generator().manual_seed(1), 4)
        originals = [[g.clone() for g in gs] for gs in grads]
        states = states_for(4, 3)
        assert [s.compressed for s in states[0]] == [True, False, False]
        outcomes = await round_(services, group, states, grads)
        assert_identical(outcomes)
        assert outcomes[0][1] == (0, 1, 2, 3)
        for k in range(len(SHAPES)):
            truth = weighted_mean(grads, range(4), k)
            torch.testing.assert_close(outcomes[0][0][k], truth, rtol=1e-5, atol=1e-5)
        assert all(torch.equal(a, b) for gs, os in zip(grads, originals) for a, b in zip(gs, os)), "grads written to"
    run_virtual(main())


def run_steps(error_feedback: bool, steps: int):
    """4 peers, rank 2 on noisy full-rank gradients, several rounds; returns the relative error
    of sum(result) against sum(true weighted mean) after each step, and the final states."""
    shape = (32, 24)

    async def main():
        net, transports, services = await swarm(4)
        gen = torch.Generator().manual_seed(7)
        target = torch.randn(shape, generator=gen)
        states = states_for(4, 2, error_feedback, shapes=[shape])
        sum_approx = torch.zeros(shape, dtype=torch.float64)
        sum_true = torch.zeros(shape, dtype=torch.float64)
        history = []
        for step in range(steps):
            group = make_group(transports, ["node"] * 4, shape[0] * shape[1], gid=b"step%d" % step)
            grads = [[target + 0.5 * torch.randn(shape, generator=gen)] for _ in range(4)]
            outcomes = await round_(services, group, states, grads)
            assert_identical(outcomes)
            sum_approx += outcomes[0][0][0].double()
            sum_true += weighted_mean(grads, range(4), 0).double()
            history.append(((sum_approx - sum_true).norm() / sum_true.norm()).item())
        return history, states, sum_approx, sum_true
    return run_virtual(main())


@pytest.mark.timeout(120)
def test_low_rank_is_identical_everywhere_and_error_feedback_converges():
    """Bit-identical results on every peer; with error feedback nothing is lost, only held back."""
    history, states, sum_approx, sum_true = run_steps(True, 40)
    without = run_steps(False, 40)[0]
    assert history[-1] < history[9] / 2 and history[-1] < without[-1] / 4, (history[::10], without[::10])
    # sum(result) = sum(true weighted mean) - weighted mean of the residuals held back.
    total = sum(WEIGHTS)
    held = sum(s[0].residual.double() * (w / total) for s, w in zip(states, WEIGHTS))
    assert torch.allclose(sum_approx + held, sum_true, atol=1e-3)


@pytest.mark.timeout(60)
def test_member_with_bad_gradient_abstains_gets_the_result_and_keeps_its_residual():
    async def main():
        net, transports, services = await swarm(4)
        size = sum(torch.Size(s).numel() for s in SHAPES)
        gen = torch.Generator().manual_seed(3)
        states = states_for(4, 2)  # rank 2 on rank-3 data: residuals are not zero
        await round_(services, make_group(transports, ["node"] * 4, size, gid=b"a"), states,
                     low_rank_grads(gen, 4))
        held = states[3][0].residual.clone()
        assert held.norm() > 0
        grads = low_rank_grads(gen, 4)
        grads[3][0][0, 0] = float("nan")
        outcomes = await round_(services, make_group(transports, ["node"] * 4, size, gid=b"b"), states, grads)
        assert_identical(outcomes)
        assert outcomes[0][1] == (0, 1, 2)
        torch.testing.assert_close(outcomes[3][0][2], weighted_mean(grads, [0, 1, 2], 2))  # uncompressed: exact
        assert torch.equal(states[3][0].residual, held)  # its NaN gradient dropped, its backlog kept
        assert torch.equal(states[3][0]._q, states[0][0]._q)  # the next step's basis still agrees
    run_virtual(main())


@pytest.mark.timeout(60)
def test_member_left_out_of_phase1_does_not_contribute_in_phase2_and_holds_back_its_gradient():
    """One contributor set for the whole result: a member dropped from phase 1 (here it sends
    nothing, like a late one) sits out phase 2 too, and keeps its whole M as residual."""
    async def main():
        net, transports, services = await swarm(4)
        size = sum(torch.Size(s).numel() for s in SHAPES)
        gen = torch.Generator().manual_seed(4)
        states = states_for(4, 2)
        await round_(services, make_group(transports, ["node"] * 4, size, gid=b"a"), states, low_rank_grads(gen, 4))
        old = states[3][0].residual.clone()
        original = services[3].run

        async def late_in_phase1(group, vector, *args, **kwargs):
            return await original(group, None if group.group_id.endswith(PHASE1_SUFFIX) else vector, *args, **kwargs)
        services[3].run = late_in_phase1
        grads = low_rank_grads(gen, 4)
        outcomes = await round_(services, make_group(transports, ["node"] * 4, size, gid=b"b"), states, grads)
        assert_identical(outcomes)
        assert outcomes[0][1] == (0, 1, 2)
        torch.testing.assert_close(outcomes[0][0][2], weighted_mean(grads, [0, 1, 2], 2))
        torch.testing.assert_close(states[3][0].residual, old + grads[3][0], rtol=0, atol=1e-6)
        assert torch.equal(states[3][0]._q, states[0][0]._q)
    run_virtual(main())


def crash_before_phase2(net, services, victim):
    """Make member `victim` die when it starts phase 2, i.e. after its phase 1 is done."""
    original = services[victim].run

    async def run(group, *args, **kwargs):
        if group.group_id.endswith(PHASE2_SUFFIX):
            net.crash(group.peers[victim])
            raise asyncio.CancelledError  # the process is gone
        return await original(group, *args, **kwargs)
    services[victim].run = run


def snapshot(states):
    return [[(s.residual.clone() if s.residual is not None else None, s._q.clone()) for s in ss] for ss in states]


def assert_untouched(states, before):
    for ss, bs in zip(states, before, strict=True):
        for s, (residual, q) in zip(ss, bs, strict=True):
            assert (residual is None and s.residual is None) or torch.equal(s.residual, residual)
            assert torch.equal(s._q, q)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("victim", "allowed"), [(0, {"succeeded", "failed"}), (2, {"succeeded"}), (3, {"succeeded"})],
                         ids=["coordinator", "reducer", "client"])
def test_member_crashing_between_phases_leaves_survivors_consistent(victim, allowed):
    """Survivors all succeed with identical results over the phase-2 contributors, or all fail
    with their states untouched. A lost reducer or sender is repaired within phase 2; the
    phase-1 coordinator dying right after its commit can make phase 1 abort for the others
    (they never saw the commit), which must then be a clean failure everywhere."""
    roles = ["node", "node", "node", "client"]

    async def main():
        net, transports, services = await swarm(4, roles=roles)
        group = make_group(transports, roles, sum(torch.Size(s).numel() for s in SHAPES))
        grads = low_rank_grads(torch.Generator().manual_seed(5), 4)
        states = states_for(4, 3)
        await round_(services, make_group(transports, roles, group.total, gid=b"warm-up"), states, grads)
        before = snapshot(states)
        crash_before_phase2(net, services, victim)
        survivors = [i for i in range(4) if i != victim]
        start = asyncio.get_running_loop().time()
        outcomes = await round_(services, group, states, grads, timeout=30.0)
        assert asyncio.get_running_loop().time() - start < 30.0
        assert isinstance(outcomes[victim], asyncio.CancelledError)
        outcomes = [outcomes[i] for i in survivors]
        failed = [isinstance(o, AveragingError) for o in outcomes]
        assert all(isinstance(o, (AveragingError, tuple)) for o in outcomes), outcomes
        if any(failed):
            assert all(failed), outcomes
            assert_untouched([states[i] for i in survivors], [before[i] for i in survivors])
            return "failed"
        assert_identical(outcomes)
        assert outcomes[0][1] == tuple(survivors)
        for k in range(len(SHAPES)):  # rank-3 data: exact over the contributors, whoever shaped P
            torch.testing.assert_close(outcomes[0][0][k], weighted_mean(grads, survivors, k), rtol=1e-5, atol=1e-5)
        return "succeeded"
    assert run_virtual(main()) in allowed


@pytest.mark.timeout(60)
def test_phase2_failure_raises_everywhere_and_leaves_states_and_grads_untouched():
    """The only reducer dies after phase 1: no phase 2 is possible, everyone fails, restartable."""
    roles = ["node", "client", "client"]

    async def main():
        net, transports, services = await swarm(4, roles=roles + ["node"])  # 3 joins for the restart
        size = sum(torch.Size(s).numel() for s in SHAPES)
        gen = torch.Generator().manual_seed(6)
        states = states_for(4, 2)
        await round_(services[:3], make_group(transports[:3], roles, size, gid=b"warm-up"), states[:3],
                     low_rank_grads(gen, 3))
        before = snapshot(states)
        grads = low_rank_grads(gen, 4)
        originals = [[g.clone() for g in gs] for gs in grads]
        crash_before_phase2(net, services, 0)
        outcomes = await round_(services[:3], make_group(transports[:3], roles, size), states[:3], grads[:3],
                                timeout=30.0)
        assert isinstance(outcomes[0], asyncio.CancelledError)
        assert all(isinstance(o, AveragingError) for o in outcomes[1:]), outcomes
        assert_untouched(states[1:3], before[1:3])
        assert all(torch.equal(a, b) for gs, os in zip(grads, originals) for a, b in zip(gs, os))
        # Restartable: the survivors' next round, with a new reducer, works from the same states.
        rest = [3, 1, 2]
        outcomes = await round_([services[i] for i in rest], make_group([transports[i] for i in rest],
                                                                     ["node", "client", "client"], size, gid=b"again"),
                                [states[i] for i in rest], [grads[i] for i in rest])
        assert_identical(outcomes)
    run_virtual(main())
