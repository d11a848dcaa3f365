"""PowerSGD averaging: one low-rank round over an already formed group, as two butterfly all-reduces.

    phase 1: all-reduce the concatenated local P = (M + residual) Q of every compressed tensor;
    phase 2: all-reduce the concatenated local Q = M^T orth(mean P), plus the uncompressed
             tensors (1-D, small, or rank too high to pay off) as they are;
    finish:  every tensor's estimate of the weighted mean, P (mean Q)^T (or the plain mean).

Both phases are weighted means with the caller's weight, and each is fault tolerant on its own
(see `potluck.averaging.allreduce`); each runs under a group id derived from the group's, so it never meets a plain
all-reduce of the same group. Both share one deadline, `timeout`, for the whole round.

Who contributes (the rule):
  * S1 = the senders phase 1 settled on, S2 = those of phase 2. Only members of S1 send in
    phase 2 (the others abstain, so nobody waits for them), hence S2 <= S1, and the round's
    contributors are S2. Every tensor of the result is over exactly S2: compressed ones are
    P P^T (weighted mean over S2 of M), since a Q-mean over any set projects that set's mean onto
    span(P) whoever shaped P; uncompressed ones travel in phase 2 for that very reason (averaged
    in phase 1 they would be over S1).
  * Every member that receives the result, contributor or not, calls `finish`, so Q (the next
    step's basis, which must match on all peers) stays identical everywhere. A member outside S2
    had nothing of its gradient averaged: its residual becomes its whole M (gradient plus old
    residual), so error feedback still delivers that gradient later, instead of keeping only the
    part outside span(P).
  * A member with a non-finite gradient or an invalid weight abstains from both phases (its
    gradient is dropped, its old residual kept) and still receives the group's result.
  * Phase 2 reducers are the phase-1 reducers in S1 (and aux members): a member dropped from S1
    is likely dead or stalled, and should not hold a shard the others must wait for.

Failure: either phase failing raises AveragingError on the members it fails on, before any
`finish`: the PowerSGD states keep their residual and Q (the next `phase1` restarts the step)
and the caller's gradients are never written to. Survivors of a committed phase 2 all get
bit-identical results (same mean P and mean Q bits, deterministic math).
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import torch

from potluck.averaging.allreduce import AllReduceService, Group
from potluck.averaging.load_balancing import part_sizes
from potluck.averaging.role import Role
from potluck.compression.powersgd import PowerSGD
from potluck.core.errors import AveragingError, CompressionError
from potluck.core.runner import run_in_thread
from potluck.core.tensors import all_finite

__all__ = ["powersgd_allreduce"]

PHASE1_SUFFIX = b"/powersgd-p"
PHASE2_SUFFIX = b"/powersgd-q"


def _phase_group(group: Group, suffix: bytes, size: int, reducers: set[int]) -> Group:
    """The group for one phase: a derived id, and the group's load split scaled to `size`
    elements, over `reducers` only (over all the group's reducers if none of them is left)."""
    shares = [s if i in reducers else 0 for i, s in enumerate(group.part_sizes)]
    if not any(shares):
        shares = list(group.part_sizes)
    total = sum(shares)
    return dataclasses.replace(group, group_id=group.group_id + suffix,
                               part_sizes=tuple(part_sizes(size, [s / total for s in shares])))


def _q_elements(state: PowerSGD) -> int:
    return state.matrix_shape[1] * state.rank if state.compressed else state.shape.numel()


async def powersgd_allreduce(service: AllReduceService, group: Group, states: Sequence[PowerSGD],
                             grads: Sequence[torch.Tensor] | None, weight: float, codec: Any, timeout: float,
                             sender_timeout: float | None = None) -> tuple[list[torch.Tensor] | None, tuple[int, ...]]:
    """One PowerSGD averaging round with `group` (see the module docstring).

    `states` hold one PowerSGD per tensor, built alike on every member (same shapes, rank and
    seed); `grads` are this member's gradients (None for an aux member, which only reduces).
    Returns the estimates of the weighted mean gradients (None for aux members) and the group
    positions of the members whose gradients they average. Raises AveragingError, leaving
    `states` restartable and `grads` untouched, if either phase fails.
    """
    me = group.peers.index(service.transport.peer_id)
    receives = group.roles[me] != Role.AUX
    if receives:
        if grads is None or len(grads) != len(states):
            raise ValueError("need one gradient per PowerSGD state")
        if any(s.shape != g.shape for s, g in zip(states, grads, strict=True)):
            raise ValueError("gradient shapes differ from the PowerSGD states'")
    abstain = not receives or not math.isfinite(weight) or weight < 0
    kwargs = {} if sender_timeout is None else {"sender_timeout": sender_timeout}
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    compressed = [s for s in states if s.compressed]
    p_size = sum(s.matrix_shape[0] * s.rank for s in compressed)
    q_size = sum(_q_elements(s) for s in states)

    def start() -> tuple[torch.Tensor | None, list[torch.Tensor], bool]:
        """phase1 on every state (zeros when abstaining, so M is just the old residual)."""
        if not receives:
            return None, [], True
        skip = abstain or not all(all_finite(g) for g in grads)
        local = [s.phase1(torch.zeros_like(g, dtype=torch.float32) if skip else g)
                 for s, g in zip(states, grads, strict=True)]
        p = [x.reshape(-1) for s, x in zip(states, local, strict=True) if s.compressed]
        return (torch.cat(p) if p else torch.empty(0)), local, skip

    try:
        p_vector, local, abstain = await run_in_thread(start)
    except CompressionError as e:  # gradient + residual overflowed: nothing was sent yet
        raise AveragingError(f"powersgd: {e}") from None
    senders = tuple(i for i in group.receivers)  # everyone may send in phase 2 if there is no phase 1
    mean_p = None
    if p_size:
        phase1 = _phase_group(group, PHASE1_SUFFIX, p_size, set(group.shards))
        mean_p, senders = await service.run(phase1, None if abstain else p_vector, weight, codec,
                                            max(0.1, deadline - loop.time()), **kwargs)

    def middle() -> torch.Tensor | None:
        """phase2 on the compressed states; the phase-2 vector: local Qs and uncompressed tensors."""
        if not receives:
            return None
        parts, offset = [], 0
        for s, x in zip(states, local, strict=True):
            if s.compressed:
                rows = s.matrix_shape[0]
                parts.append(s.phase2(mean_p[offset:offset + rows * s.rank].view(rows, s.rank)).reshape(-1))
                offset += rows * s.rank
            else:
                parts.append(x.reshape(-1))
        return torch.cat(parts)

    try:
        q_vector = await run_in_thread(middle)
    except CompressionError as e:
        raise AveragingError(f"powersgd: {e}") from None
    mine = me in senders and not abstain
    reducers = {j for j in group.shards if j in senders or group.roles[j] == Role.AUX}
    phase2 = _phase_group(group, PHASE2_SUFFIX, q_size, reducers)
    mean_q, contributors = await service.run(phase2, q_vector if mine else None, weight, codec,
                                             max(0.1, deadline - loop.time()), **kwargs)
    if not receives:
        return None, contributors
    contributed = me in contributors

    def finish() -> list[torch.Tensor]:
        results, offset = [], 0
        for s, g in zip(states, grads, strict=True):
            n = _q_elements(s)
            piece = mean_q[offset:offset + n]
            offset += n
            if not s.compressed:
                s.phase2(piece.view(s.shape))
                results.append(s.finish(torch.empty(0)))
                continue
            held = None  # outside S2 nothing of M was averaged: hold all of it back (M before finish)
            if not contributed and s.residual is not None:
                held = s.residual + (0 if abstain else g.detach().reshape(s.matrix_shape).to(s.residual))
            results.append(s.finish(piece.view(s.matrix_shape[1], s.rank)))
            if held is not None:
                s.residual.copy_(held)
        return results

    try:
        return await run_in_thread(finish), contributors
    except CompressionError as e:
        raise AveragingError(f"powersgd: {e}") from None
