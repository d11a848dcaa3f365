"""Mixture-of-experts layers whose experts live on expert servers, found through the DHT.

A gating network scores each grid dimension separately (product keys: an expert's score is the sum
of its coordinates' scores), a beam search over the DHT finds each sample's best live experts, and
the calls run in parallel. Experts that fail or miss the deadline are dropped and the remaining
weights renormalized (softmax over the experts that answered), down to `k_min` per sample. Once
every sample has `k_min` answers, the rest get a short grace period (`timeout_after_k_min`), so
one slow expert does not hold every batch until `forward_timeout`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from potluck.core.peer_like import PeerLike
from potluck.moe.errors import NotEnoughExperts
from potluck.moe.expert import (
    AUTOGRAD_ANCHOR,
    DEFAULT_TIMEOUT,
    LOOKUP_TIMEOUT,
    ForwardReply,
    abackward,
    aforward,
    new_call_id,
)
from potluck.moe.grid import Children, ExpertLocation, GridDirectory, beam_search, parse_uid

__all__ = ["RemoteMixtureOfExperts", "RemoteSwitchMixtureOfExperts"]

logger = logging.getLogger(__name__)

# Grid prefixes read from the DHT are reused for this long: a batch's searches (and the next few
# batches) share lookups, while a dead server's records still expire from view within seconds.
DEFAULT_CACHE_SECONDS = 2.0
# A server whose call failed is skipped by searches for this long, so a killed server costs one
# failed call per client rather than one per batch until its announcement expires.
DEAD_SERVER_SECONDS = 10.0
# Once every sample has k_min answers, the other calls get this much longer (hivemind's
# timeout_after_k_min). A healthy expert answers within a round trip plus its server's queue, far
# under a second on a LAN and about that over the internet; a stalled one then costs each batch
# this long instead of the whole forward_timeout (60 s by default).
DEFAULT_TIMEOUT_AFTER_K_MIN = 1.0
# A batch's outputs are allocated at the width its experts answer with (batch x k x width): an
# output wider than the input needs answers for at least 1 / MAX_OUTPUT_SPREAD of the slots, so
# that the allocation stays within this factor of the bytes the answers brought.
MAX_OUTPUT_SPREAD = 8


@dataclass
class _Dispatch:
    """One call: the samples (rows) sent to one expert and the slot each answer fills."""

    location: ExpertLocation
    rows: list[int]
    slots: list[int]
    call_id: int = field(default_factory=new_call_id)
    ok: bool = False
    kept: bool = True  # the server kept the forward graph (else backward sends the inputs again)
    needs_grad: bool = True  # whether the caller wants the gradient of the inputs


class _MixtureCall(torch.autograd.Function):
    """Every expert call of one batch, forward and backward, as one autograd node."""

    @staticmethod
    def forward(ctx: Any, anchor: torch.Tensor, x: torch.Tensor, layer: _RemoteMixtureBase,
                dispatches: list[_Dispatch], k: int) -> tuple[torch.Tensor, torch.Tensor]:
        for d in dispatches:
            d.needs_grad = ctx.needs_input_grad[1]
        results = layer.call_forward(x, dispatches)
        out_shape = _output_shape(x, dispatches, results, k)
        mask = torch.zeros(x.shape[0], k, dtype=torch.bool)
        if out_shape is None:
            outputs = torch.zeros(x.shape[0], k, *x.shape[1:], dtype=x.dtype)
        else:
            outputs = torch.zeros(x.shape[0], k, *out_shape, dtype=x.dtype)
        for d, result in zip(dispatches, results, strict=True):
            if isinstance(result, BaseException) or result.outputs[0].shape[1:] != out_shape:
                if not isinstance(result, BaseException) and out_shape is not None:
                    logger.warning("expert %s answered with shape %s; expected %s", d.location.uid,
                                   list(result.outputs[0].shape), list(out_shape))
                continue
            d.ok, d.kept = True, result.kept
            rows, slots = torch.tensor(d.rows), torch.tensor(d.slots)
            outputs[rows, slots] = result.outputs[0].to(x.dtype)
            mask[rows, slots] = True
        ctx.layer, ctx.dispatches = layer, dispatches
        ctx.save_for_backward(x)
        ctx.mark_non_differentiable(mask)
        return outputs, mask

    @staticmethod
    def backward(ctx: Any, grad_outputs: torch.Tensor, _grad_mask: Any) -> tuple[Any, ...]:
        (x,) = ctx.saved_tensors
        layer: _RemoteMixtureBase = ctx.layer
        done = [d for d in ctx.dispatches if d.ok]
        results = layer.call_backward(x, grad_outputs, done)
        grad_x = torch.zeros_like(x)
        for d, result in zip(done, results, strict=True):
            if isinstance(result, BaseException):
                logger.info("expert %s failed its backward call: %s", d.location.uid, result)
                continue
            if result[0] is not None:
                grad_x.index_add_(0, torch.tensor(d.rows), result[0].to(x.dtype))
        return None, grad_x, None, None, None


def _output_shape(x: torch.Tensor, dispatches: list[_Dispatch], results: list[Any], k: int) -> torch.Size | None:
    """The shape of one sample's expert output, as the answers give it: the shape of the most rows
    answered (answers of another shape are dropped). The batch's outputs take batch x k times it,
    so a shape wider than the input's must come with answers for at least 1 / MAX_OUTPUT_SPREAD of
    those slots: one expert answering one row with a wide output made the layer allocate the
    whole batch's outputs at that width (1 GiB for a 256 KiB answer)."""
    rows: Counter[torch.Size] = Counter()
    for d, r in zip(dispatches, results, strict=True):
        if not isinstance(r, BaseException):
            rows[r.outputs[0].shape[1:]] += len(d.rows)
    if not rows:
        return None
    shape, answered = max(rows.items(), key=lambda item: (item[1], -item[0].numel()))
    if shape.numel() > x[0].numel() and x.shape[0] * k > MAX_OUTPUT_SPREAD * answered:
        logger.warning("experts answered %d of %d slots with outputs of shape %s, wider than the inputs: "
                       "dropped", answered, x.shape[0] * k, list(shape))
        return None
    return shape


async def _gather_after_k_min(calls: Sequence[Awaitable[Any]], rows: Sequence[Sequence[int]], samples: int,
                             k_min: int, grace: float | None) -> list[Any]:
    """Each call's result or exception (like `gather(..., return_exceptions=True)`), where call i
    answers for the samples `rows[i]`. Once every sample has `k_min` answers, the calls still running
    get `grace` seconds more (None: no limit beyond their own timeouts); then they are cancelled and
    count as failed with a TimeoutError."""
    tasks = [asyncio.ensure_future(call) for call in calls]
    index = {task: i for i, task in enumerate(tasks)}
    answered = [0] * samples
    pending, deadline = set(tasks), None
    loop = asyncio.get_running_loop()
    try:
        while pending:
            wait = None if deadline is None else max(0.0, deadline - loop.time())
            done, pending = await asyncio.wait(pending, timeout=wait, return_when=asyncio.FIRST_COMPLETED)
            if not done:
                break  # the grace period is over
            for task in done:
                if task.exception() is None:
                    for row in rows[index[task]]:
                        answered[row] += 1
            if deadline is None and grace is not None and all(a >= k_min for a in answered):
                deadline = loop.time() + grace
    finally:
        for task in pending:
            task.cancel()
    if pending:
        logger.info("%d expert calls dropped: no answer %.1f s after every sample had %d", len(pending), grace, k_min)
        await asyncio.wait(pending)
    late = TimeoutError(f"no answer within {grace} s after every sample had k_min={k_min} answers")
    return [late if task in pending else (task.exception() or task.result()) for task in tasks]


class _RemoteMixtureBase(nn.Module):
    def __init__(self, peer: PeerLike, in_features: int, grid_size: Sequence[int], uid_prefix: str, k_best: int,
                 k_min: int, forward_timeout: float | None, backward_timeout: float | None,
                 beam_size: int | None, cache_seconds: float, timeout_after_k_min: float | None):
        super().__init__()
        if not grid_size or any(g < 1 for g in grid_size):
            raise ValueError(f"grid_size must be positive sizes, one per grid dimension; got {grid_size}")
        if not 1 <= k_min <= k_best:
            raise ValueError(f"need 1 <= k_min <= k_best; got k_min={k_min}, k_best={k_best}")
        if timeout_after_k_min is not None and not timeout_after_k_min >= 0:
            raise ValueError(f"timeout_after_k_min must be >= 0 seconds or None; got {timeout_after_k_min}")
        self.peer = peer
        self.in_features = in_features
        self.grid_size = tuple(grid_size)
        self.name = uid_prefix.rstrip(".")
        self.k_best, self.k_min = k_best, k_min
        self.forward_timeout = forward_timeout or DEFAULT_TIMEOUT
        self.backward_timeout = backward_timeout or DEFAULT_TIMEOUT
        self.timeout_after_k_min = timeout_after_k_min
        self.beam_size = beam_size or max(k_best, 2)
        self.gate = nn.Linear(in_features, sum(self.grid_size))
        self.directory = GridDirectory(peer.dht, cache_seconds, LOOKUP_TIMEOUT)
        self._dead: dict[Any, float] = {}
        self.last_answered: float = 0.0  # mean experts that answered per sample, last forward
        self.last_uids: list[list[str]] = []  # each sample's chosen experts, last forward

    def _run(self, coro: Any, timeout: float) -> Any:
        return self.peer.run(coro, timeout + LOOKUP_TIMEOUT + 5)

    def call_forward(self, x: torch.Tensor, dispatches: list[_Dispatch]) -> list[Any]:
        """Every dispatch's forward call, from this thread: each one's reply or exception."""
        return self._run(self._forward_all(x, dispatches), self.forward_timeout)

    def call_backward(self, x: torch.Tensor, grad_outputs: torch.Tensor, dispatches: list[_Dispatch]) -> list[Any]:
        """The backward calls of `dispatches` (forward calls that answered): each one's input
        gradients or exception."""
        return self._run(self._backward_all(x, grad_outputs, dispatches), self.backward_timeout * 2)

    # -- on the event loop --------------------------------------------------------------------------
    async def _search(self, scores: list[list[list[float]]], k: int) -> list[list[tuple[float, ExpertLocation]]]:
        now = time.monotonic()
        self._dead = {p: t for p, t in self._dead.items() if t > now}
        dead = set(self._dead)

        async def fetch(keys: list[str]) -> dict[str, Children]:
            found = await self.directory.children(keys)
            return {key: {c: loc for c, loc in entries.items() if loc is None or str(loc.peer_id) not in dead}
                    for key, entries in found.items()}
        return await beam_search(fetch, self.name, scores, k, self.beam_size)

    async def _forward_all(self, x: torch.Tensor, dispatches: list[_Dispatch]) -> list[Any]:
        transport = self.peer.transport

        async def one(d: _Dispatch) -> ForwardReply:
            try:
                return await aforward(transport, d.location, d.call_id, [x[d.rows]], self.forward_timeout,
                                      [d.needs_grad])
            except Exception as e:
                logger.info("expert %s dropped: %s", d.location.uid, e)
                self._dead[str(d.location.peer_id)] = time.monotonic() + DEAD_SERVER_SECONDS
                raise
        return await _gather_after_k_min([one(d) for d in dispatches], [d.rows for d in dispatches], len(x),
                                         self.k_min, self.timeout_after_k_min)

    async def _backward_all(self, x: torch.Tensor, grad_outputs: torch.Tensor,
                            dispatches: list[_Dispatch]) -> list[Any]:
        transport = self.peer.transport
        calls = [abackward(transport, d.location, d.call_id, [x[d.rows]],
                           [grad_outputs[torch.tensor(d.rows), torch.tensor(d.slots)]], self.backward_timeout,
                           [d.needs_grad], d.kept)
                 for d in dispatches]
        return await _gather_after_k_min(calls, [d.rows for d in dispatches], len(x), self.k_min,
                                         self.timeout_after_k_min)

    # -- shared steps -------------------------------------------------------------------------------
    def _route(self, flat: torch.Tensor, k: int) -> tuple[list[torch.Tensor], list[list[tuple[float, ExpertLocation]]]]:
        logits = self.gate(flat).split(self.grid_size, dim=-1)
        scores = [d.detach().float().cpu().tolist() for d in logits]
        chosen = self._run(self._search(scores, k), LOOKUP_TIMEOUT * len(self.grid_size))  # about a round per dim
        return list(logits), chosen

    def _dispatch(self, chosen: list[list[tuple[float, ExpertLocation]]],
                  k: int) -> tuple[list[_Dispatch], torch.Tensor]:
        by_uid: dict[str, _Dispatch] = {}
        self.last_uids = [[location.uid for _, location in experts] for experts in chosen]
        coords = torch.zeros(len(chosen), k, len(self.grid_size), dtype=torch.long)
        for row, experts in enumerate(chosen):
            for slot, (_, location) in enumerate(experts):
                d = by_uid.setdefault(location.uid, _Dispatch(location, [], []))
                d.rows.append(row)
                d.slots.append(slot)
                coords[row, slot] = torch.tensor(parse_uid(location.uid)[1])
        return list(by_uid.values()), coords

    def _call(self, flat: torch.Tensor, dispatches: list[_Dispatch], k: int) -> tuple[torch.Tensor, torch.Tensor]:
        return _MixtureCall.apply(AUTOGRAD_ANCHOR, flat, self, dispatches, k)

    def _check_answers(self, mask: torch.Tensor, need: int, what: str) -> None:
        answered = mask.sum(1)
        self.last_answered = float(answered.float().mean()) if len(answered) else 0.0
        short = int((answered < need).sum())
        if short:
            raise NotEnoughExperts(
                f"{short} of {len(answered)} samples got fewer than {need} expert answers ({what}); "
                f"are expert servers for '{self.name}.*' running and reachable? (on average "
                f"{self.last_answered:.2f} of {mask.shape[1]} answered)")


class RemoteMixtureOfExperts(_RemoteMixtureBase):
    """A mixture-of-experts layer over remote experts on a grid (`uid_prefix` + coordinates).

    Each sample goes to its `k_best` best-scoring live experts; their outputs are averaged with
    softmax weights of the gating scores, renormalized over the experts that answered in time.

    Args:
        peer: this process's started `potluck.Peer` (its DHT finds the experts).
        in_features: input width; inputs are [..., in_features].
        grid_size: the expert grid, e.g. (4, 4) for uids `ffn.0.0` ... `ffn.3.3`.
        uid_prefix: the grid's name, e.g. "ffn" or "ffn.": the part of its experts' uids before the
            coordinates. Not a run name: one run may hold several grids (one per layer), and a
            server may host experts of several grids.
        k_best: experts asked per sample. k_min: fewest answers a sample may have (else NotEnoughExperts).
        forward_timeout, backward_timeout: seconds per expert call (None: 60); late experts are dropped.
        timeout_after_k_min: once every sample has k_min answers (forward; backward: k_min gradients),
            the other calls get this many seconds more, then are dropped (None: wait for them all).
        beam_size: prefixes each search round looks up per sample (default max(k_best, 2)).
        cache_seconds: how long DHT prefix lookups are reused.
    """

    def __init__(self, peer: PeerLike, in_features: int, grid_size: Sequence[int], uid_prefix: str, k_best: int,
                 k_min: int = 1, forward_timeout: float | None = None, backward_timeout: float | None = None, *,
                 timeout_after_k_min: float | None = DEFAULT_TIMEOUT_AFTER_K_MIN, beam_size: int | None = None,
                 cache_seconds: float = DEFAULT_CACHE_SECONDS):
        super().__init__(peer, in_features, grid_size, uid_prefix, k_best, k_min, forward_timeout,
                         backward_timeout, beam_size, cache_seconds, timeout_after_k_min)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        logits, chosen = self._route(flat, self.k_best)
        dispatches, coords = self._dispatch(chosen, self.k_best)
        outputs, mask = self._call(flat, dispatches, self.k_best)
        self._check_answers(mask, self.k_min, f"k_min={self.k_min}")
        scores = sum(logit.gather(1, coords[:, :, d]) for d, logit in enumerate(logits))
        weights = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=1)
        mixed = (weights.reshape(*weights.shape, *[1] * (outputs.dim() - 2)) * outputs).sum(1)
        return mixed.reshape(*x.shape[:-1], *mixed.shape[1:])


class RemoteSwitchMixtureOfExperts(_RemoteMixtureBase):
    """Top-1 routing (Switch Transformer style) over remote experts, with a load-balancing loss.

    `forward` returns `(output, aux_loss)`: the chosen expert's output times its gate probability,
    and sum over grid dimensions of size * sum_i(fraction routed to i * mean gate probability of i),
    which is smallest (1 per dimension) when the load is balanced; add it to the training loss with
    a small weight (e.g. 0.01). A sample whose expert fails gets a zero output (a residual
    connection around the layer then carries it); if no sample got an answer, NotEnoughExperts.
    """

    def __init__(self, peer: PeerLike, in_features: int, grid_size: Sequence[int], uid_prefix: str,
                 forward_timeout: float | None = None, backward_timeout: float | None = None, *,
                 beam_size: int | None = None, cache_seconds: float = DEFAULT_CACHE_SECONDS):
        super().__init__(peer, in_features, grid_size, uid_prefix, 1, 1, forward_timeout, backward_timeout,
                         beam_size, cache_seconds, None)  # one expert per sample: no grace to give

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        flat = x.reshape(-1, self.in_features)
        logits, chosen = self._route(flat, 1)
        dispatches, coords = self._dispatch(chosen, 1)
        outputs, mask = self._call(flat, dispatches, 1)
        if len(mask) and not bool(mask.any()):
            self._check_answers(mask, 1, "no sample got an answer")
        self.last_answered = float(mask.float().mean()) if len(mask) else 0.0
        log_probs = [torch.log_softmax(logit, dim=-1) for logit in logits]
        gate = torch.exp(sum(lp.gather(1, coords[:, :, d]) for d, lp in enumerate(log_probs)))  # [B, 1]
        gate = gate * mask
        out = (gate.reshape(*gate.shape, *[1] * (outputs.dim() - 2)) * outputs).sum(1)
        aux = flat.new_zeros(())
        for d, lp in enumerate(log_probs):
            fraction = torch.zeros(self.grid_size[d]).index_add_(
                0, coords[:, 0, d], torch.ones(len(coords))) / max(1, len(coords))
            aux = aux + self.grid_size[d] * (fraction * lp.exp().mean(0)).sum()
        return out.reshape(*x.shape[:-1], *out.shape[1:]), aux
