"""Fault-tolerant butterfly all-reduce: every survivor ends with bit-identical tensors, or all fail.

The group's flat vector is split into one contiguous shard per reducing member. Every sender
streams its piece of each shard to that shard's reducer in chunks; the reducer averages a chunk as
soon as every expected sender's piece of it is in and streams the result back on the same stream,
so sending, reducing and receiving overlap.

Failures are settled by a coordinator (the first listening member that is alive):
  1. each reducer reports which senders delivered its whole shard;
  2. the coordinator decides the sender set S* (the intersection) and gives the shards of dead
     reducers to survivors; every reducer (re)computes its shards over exactly S*, and says FINAL;
  3. once every live receiver holds every shard FINAL, the coordinator commits; only then do
     members use the result.
As they report, reducers send an early FINAL over the senders they report complete (member.py,
reducer.py): a decision that names them needs no second FINAL, and members have checked it by then.
A shard's value is a deterministic function of S* and the senders' pieces (fixed sender order,
separate multiply and add, so any peer recomputing it gets the same bits). Members long-poll the
coordinator; when its connection breaks they turn to the next one, which asks everyone where they
stand and adopts the newest decision (or commit) any of them saw. Every stage has a deadline.

Modules, each importing only those above it:
  group          `Group`: who averages together, in which role, and who reduces what
  messages       the wire: RPC methods and declared messages
  buffers        `BufferPool`: buffers reused from round to round
  transfer_stats `TransferStats`: a member's bytes and busy time, for its bandwidth estimates
  reduction      the math: bounded weights, the chunk reduction, the codec's wire forms
  reducer        `ShardReducer`: one shard's reduction (reports through `ReducerHost`)
  coordinator    `Coordinator`: the step's decisions (reaches its member through `CoordinatorHost`)
  member         `AllReduceRun`: one member's side of a step (reaches the network through `RunService`)
  service        `AllReduceService`: the RPC handlers on one transport, and the steps under way
"""

from potluck.averaging.allreduce.buffers import MAX_POOLED_BYTES, BufferPool
from potluck.averaging.allreduce.group import Group
from potluck.averaging.allreduce.member import CHUNK_ELEMENTS, SENDER_TIMEOUT, AllReduceRun, chunk_elements
from potluck.averaging.allreduce.reduction import ARITHMETIC
from potluck.averaging.allreduce.service import AllReduceService
from potluck.averaging.allreduce.transfer_stats import TransferStats

__all__ = [
    "ARITHMETIC", "CHUNK_ELEMENTS", "MAX_POOLED_BYTES", "SENDER_TIMEOUT", "AllReduceRun", "AllReduceService",
    "BufferPool", "Group", "TransferStats", "chunk_elements",
]
