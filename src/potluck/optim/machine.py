"""One peer made of a whole machine: `MachineOptimizer`, for a training script that `torchrun`
starts once per local GPU (or CPU process).

The local ranks average their gradients with torch.distributed (NCCL on GPUs, Gloo on CPU);
local rank 0 alone is in the swarm, with one identity, one DHT node and one share of every
all-reduce, through a `potluck.Optimizer` over its copy of the model that counts the machine's
samples; whenever that changes the parameters (an epoch's update, a state round, a download,
DiLoCo's inner steps) it broadcasts them to the other ranks. So every rank holds the same
parameters after every step, and the swarm's size and traffic grow with machines, not GPUs.

A model sharded with FSDP (`torch.distributed.fsdp.fully_shard`, for models that do not fit one
GPU) works too: its gradients are averaged by FSDP's reduce-scatter; rank 0 keeps the full
parameters (and the optimizer's state) in host memory, gathers each gradient there one tensor at a
time, and after a change hands each rank its shards again (`distribute_tensor` from rank 0).

A local rank that dies takes its machine out: every local collective waits with a deadline
(`local_timeout`, plus a round's budget where rank 0 may be in one), the first that fails makes
every surviving rank raise `LocalGroupLost`, and rank 0 leaves the run (its progress and state
records stop) before it raises. The rest of the swarm goes on without the machine.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from potluck.core.errors import PotluckError
from potluck.core.peer_like import PeerLike
from potluck.optim.context import MAX_ROUND_WINDOW_FACTOR
from potluck.optim.optimizer import Optimizer

__all__ = ["LOCAL_TIMEOUT", "LocalGroupLost", "MachineOptimizer"]

logger = logging.getLogger(__name__)

# Seconds a local collective may take beyond the work it waits for: local ranks of one machine
# run the same step, so they meet within a batch's compute time; a rank that is gone (killed,
# out of memory) shows as a closed connection at once, a hung one by this deadline.
LOCAL_TIMEOUT = 60.0

_OK, _FAILED = 0, 1  # the status word rank 0 broadcasts after each step


class LocalGroupLost(PotluckError):
    """A local rank of this machine died or hung (or rank 0 failed): the machine left the run."""


class MachineOptimizer:
    """`potluck.Optimizer` for a machine's local ranks (one process per GPU, started by
    `torchrun`, after `torch.distributed.init_process_group`).

    The two-line change from a `torchrun` script with a torch optimizer:

        peer = potluck.Peer(initial_peers=PEERS) if dist.get_rank() == 0 else None
        opt = MachineOptimizer(peer, "my-run", model.parameters(), torch.optim.AdamW(model.parameters()),
                               target_batch_size=4096, batch_size_per_step=32)

    Args:
        peer: a started `potluck.Peer` on local rank 0, None on the others.
        run_id, optimizer, target_batch_size, **options: as for `potluck.Optimizer` (rank 0 builds it).
        params: this rank's parameters (the same model on every rank).
        batch_size_per_step: samples behind each rank's `step()`; the machine counts
            world_size times as many.
        grads_reduced: True when the gradients are already averaged across the local ranks
            (the model is wrapped in DistributedDataParallel); otherwise `step()` averages them.
            A model sharded with `fully_shard` (DTensor parameters) needs nothing: FSDP averages.
        group: the process group of this machine's ranks (default: the whole world).
        local_timeout: seconds each local collective may wait beyond rank 0's round.
    """

    def __init__(self, peer: PeerLike | None, run_id: str, params: Iterable[Any], optimizer: Any,
                 target_batch_size: int, batch_size_per_step: int, *, grads_reduced: bool = False,
                 group: Any = None, local_timeout: float = LOCAL_TIMEOUT, **options: Any):
        if not dist.is_initialized():
            raise RuntimeError("MachineOptimizer needs torch.distributed.init_process_group() first (torchrun)")
        self.group = group
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        self._root = dist.get_global_rank(group, 0) if group is not None else 0
        if (peer is None) != (self.rank != 0):
            raise ValueError("give the peer on local rank 0 and None on the other local ranks")
        self.params = [p for p in params if p.requires_grad]
        from torch.distributed.tensor import DTensor  # here: its import costs every process 0.6 s
        self.sharded = any(isinstance(p, DTensor) for p in self.params)
        if self.sharded and not all(isinstance(p, DTensor) for p in self.params):
            raise ValueError("shard the whole model with fully_shard, or none of it")
        self.grads_reduced = grads_reduced or self.sharded
        self.local_timeout = local_timeout
        # Rank 0 may spend a whole round in step(): the others wait for it that long.
        self._round_budget = MAX_ROUND_WINDOW_FACTOR * options.get("matchmaking_time", 1.0) \
            + options.get("averaging_timeout", 30.0) \
            + options.get("load_state_timeout", 30.0) + local_timeout
        self.optimizer: Optimizer | None = None
        self.local_epoch = 0
        self.lost = False
        # what rank 0's Optimizer steps: the parameters, or (sharded) full copies in host memory
        self._full: list[torch.Tensor] = []
        if self.sharded:
            gathered = self._gather([p.detach() for p in self.params], "gathering the parameters")
            self._full = [torch.nn.Parameter(t) for t in gathered] if self.rank == 0 else []
        if self.rank == 0:
            self.optimizer = Optimizer(peer, run_id, self._full or self.params, optimizer, target_batch_size,
                                       batch_size_per_step * self.world_size, **options)
            self.local_epoch = self.optimizer.local_epoch
        self._sync_parameters(self.local_epoch, changed=True, budget=self._round_budget)  # a newcomer's download

    def step(self) -> None:
        """Average the local ranks' gradients, step the machine's Optimizer on rank 0 and give
        every rank its parameters. Raises `LocalGroupLost` if a local rank is gone."""
        if self.lost:
            raise LocalGroupLost("this machine already left the run")
        if not self.grads_reduced and self.world_size > 1:
            self._average_gradients()
        if self.sharded:
            grads = self._gather([p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params],
                                 "gathering the gradients")
            for full, g in zip(self._full, grads, strict=False):  # rank 0 only
                full.grad = g
            for p in self.params:
                p.grad = None  # consumed, as on rank 0
        status, changed = _OK, False
        if self.optimizer is not None:
            before = self.optimizer.context.state.generation
            try:
                self.optimizer.step()
            except Exception:
                status = _FAILED
                self._header(status, 0, False, self.local_timeout)  # the others stop too
                self._leave()
                raise
            changed = self.optimizer.context.state.generation != before
            self.local_epoch = self.optimizer.local_epoch
        else:
            for p in self.params:
                p.grad = None  # consumed, as on rank 0
        self._sync_parameters(self.local_epoch, changed, self._round_budget)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    def shutdown(self) -> None:
        """Leave the run (rank 0). The process group stays the caller's: destroy it
        (`dist.destroy_process_group()`) before the process exits, as torch asks."""
        if self.optimizer is not None:
            self.optimizer.shutdown()

    # -- local collectives, each with a deadline -----------------------------------------------------
    def _wait(self, work: Any, seconds: float, what: str) -> None:
        try:
            if not work.wait(timeout=timedelta(seconds=seconds)):
                raise RuntimeError(f"no answer within {seconds:.0f} s")
        except Exception as e:
            self._leave()
            raise LocalGroupLost(f"local rank {self.rank}: {what} failed ({str(e).splitlines()[0][:200]}); "
                                 "a local rank is gone, this machine leaves the run") from e

    def _gather(self, shards: list[torch.Tensor], what: str) -> list[torch.Tensor]:
        """The full tensors of DTensor `shards`, one at a time (an all-gather each), as host
        copies on rank 0 ([] on the others). These collectives wait as long as the process group's
        own timeout (`init_process_group(timeout=...)`), not `local_timeout`."""
        out = []
        try:
            for t in shards:
                full = t.full_tensor()
                if self.rank == 0:
                    out.append(full.detach().to("cpu", copy=True))
                del full
        except Exception as e:
            self._leave()
            raise LocalGroupLost(f"local rank {self.rank}: {what} failed ({str(e).splitlines()[0][:200]}); "
                                 "a local rank is gone, this machine leaves the run") from e
        return out

    def _scatter(self) -> None:
        """Every rank's shards of rank 0's full host parameters (`distribute_tensor` from rank 0)."""
        from torch.distributed.tensor import distribute_tensor
        try:
            with torch.no_grad():
                for i, p in enumerate(self.params):
                    local = p.to_local()
                    full = self._full[i].detach().to(local.device) if self.rank == 0 else \
                        torch.empty(p.shape, dtype=p.dtype, device=local.device)
                    local.copy_(distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=0).to_local())
        except Exception as e:
            self._leave()
            raise LocalGroupLost(f"local rank {self.rank}: receiving the parameters failed "
                                 f"({str(e).splitlines()[0][:200]}); this machine leaves the run") from e

    def _average_gradients(self) -> None:
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        flat = torch.cat([g.reshape(-1).to(torch.float32) for g in grads])  # 16-bit gradients summed in float32
        self._wait(dist.all_reduce(flat, group=self.group, async_op=True), self.local_timeout, "averaging gradients")
        flat /= self.world_size
        offset = 0
        for p in self.params:
            n = p.numel()
            p.grad = flat[offset:offset + n].view(p.shape).to(p.dtype)
            offset += n

    def _header(self, status: int, epoch: int, changed: bool, seconds: float) -> tuple[int, int, bool]:
        device = self.params[0].device if self.params and dist.get_backend(self.group) == "nccl" else "cpu"
        header = torch.tensor([status, epoch, int(changed)], dtype=torch.int64, device=device)
        self._wait(dist.broadcast(header, self._root, group=self.group, async_op=True), seconds, "waiting for rank 0")
        status, epoch, changed = (int(v) for v in header.tolist())
        return status, epoch, bool(changed)

    def _sync_parameters(self, epoch: int, changed: bool, budget: float) -> None:
        status, self.local_epoch, changed = self._header(_OK, epoch, changed, budget)
        if status != _OK:
            self._leave()
            raise LocalGroupLost("local rank 0 failed its step; this machine leaves the run")
        if not changed or (self.world_size == 1 and not self.sharded):
            return
        if self.sharded:
            self._scatter()
            return
        with torch.no_grad():
            for dtype in sorted({p.dtype for p in self.params}, key=str):
                same = [p for p in self.params if p.dtype == dtype]
                flat = torch.cat([p.detach().reshape(-1) for p in same])
                self._wait(dist.broadcast(flat, self._root, group=self.group, async_op=True), self.local_timeout,
                           "receiving the parameters")
                if self.rank != 0:
                    torch._foreach_copy_(same, [part.view(p.shape) for part, p in
                                                zip(flat.split([p.numel() for p in same]), same, strict=True)])

    def _leave(self) -> None:
        if not self.lost:
            self.lost = True
            logger.error("local rank %d: this machine leaves the run", self.rank)
            self.shutdown()
