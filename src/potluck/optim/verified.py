"""Verified training (BTARD-SGD's accountability; opt-in, sync mode): a peer that sends gradients
other than those of its batches is caught, and banned, by peers that recompute them.

- **Public batches.** Each peer's batch for each step is drawn from a dataset every peer holds
  (the same bytes: its digest is part of the run schema), by a seed anyone can compute: the run,
  the epoch, the peer and the step's index among the batches behind its gradients
  (`batch_indices`). `Optimizer.batch()` hands it to the training loop. The loss must be a
  deterministic function of the model and the batch: no dropout, whose masks come from torch's
  global generator, which the training thread and the validator's share (`Verified.check`
  refuses dropout layers; a peer's first validation is of its own gradients, and stops the
  peer with that error if it cannot recompute them).
- **Sealed pieces.** What each member sends in a round, and the samples it claimed behind it,
  are bound by its signature (`potluck.averaging.accountability`: seals). The checks that
  members run on reducers fetch one block of every sender's piece of every shard, sealed: the
  validator holds proof of part of every member's gradient at no extra traffic.
- **Validation.** After a round, a peer draws (from its own randomness, after the pieces were
  sent: nobody knows in advance who is checked) whether to validate, and whom: on average it
  spends `fraction` of its compute on it. It recomputes that member's gradient at the round's
  parameters (a replica of the model: the peer trains on meanwhile) and compares it with the
  sealed blocks, within `tolerance` (relative L2 error; float nondeterminism between runs of the
  same batch is far below it: benchmarks/verified.py measures both).
- **Consequences.** A mismatch bans the member from this peer's groups for the run, and the
  evidence (the sealed blocks, the claim, the round's parameters) goes to the round's other
  members and the run's other live peers (`Accusation`): each checks it itself (the parameters
  against its own digest of that epoch's, the seals against the member's key, the gradient by
  recomputing it) and bans the member, or the accuser if the accusation is false. Nobody bans
  on another's word. A peer checks one accusation per epoch about a round it was not in (it
  cannot tell that round's group is real, so a made-up one costs it one recomputation at most).

What it cannot do: a member is validated only at parameters the validator holds too (the digest
in its claim); one that claims others is not validated that round (honest peers' parameters
differ only after a failed round, until the next state averaging). Validators see one block per
shard: a member that falsifies a small part of its gradient is caught with the probability that
a checked block falls in it. docs/security.md states the rates.

Costs: `fraction` of the compute; one model of memory for the replica, and two model-sized
vectors while a validation runs; the digest of the parameters once per round; an accusation
carries the round's parameters (a request stays under the transport's 256 MiB: models up to about
60M float32 parameters). A straggler drops the gradients it accumulated before catching up: they
are not of the new epoch's batches.
"""

from __future__ import annotations

import asyncio
import collections
import copy
import hashlib
import logging
import math
import random
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.data import default_collate

from potluck.averaging.accountability import (
    DIGEST_BYTES,
    MAX_BANNED,
    VERIFY_BLOCK,
    SealedBlock,
    ban_list,
    claim_digest,
    sealed_block,
)
from potluck.averaging.allreduce import CHUNK_ELEMENTS, Group
from potluck.averaging.allreduce.group import MAX_GROUP_SIZE
from potluck.averaging.matchmaking import MAX_METADATA_BYTES
from potluck.core.bounded import drop_oldest
from potluck.core.errors import NetworkError, PotluckError
from potluck.core.runner import retrieve_exception, run_in_thread
from potluck.core.staging import host_slices
from potluck.core.wire import Bytes, Int, List, Message, Nested, Number, Opaque, Raw
from potluck.net.identity import SIGNATURE_BYTES, PeerID
from potluck.optim.progress import RoundNote
from potluck.optim.state import tensor_digest

__all__ = ["TOLERANCE", "Accusation", "Validation", "Verified", "batch_indices"]

logger = logging.getLogger(__name__)

# Relative L2 error (|sent - recomputed| / |recomputed|, over the blocks checked) within which a
# member's gradient counts as its batches'. Float nondeterminism between two computations of the
# same batches (thread counts, kernels) measured about 1e-7 (benchmarks/verified.py); a gradient
# scaled by 1.001 is off by 1e-3.
TOLERANCE = 1e-4
# A validator recomputes at most this many times the batches of a full global batch of one
# member (a claim is at most the global batch; batches with non-finite gradients are skipped,
# as their owner skipped them): the cost of one validation is bounded whatever a member claims.
MAX_BATCHES_FACTOR = 2
# Epochs of our own parameters' digests kept to check accusations against: a validation takes
# about one round's compute, so its accusation comes a round or two after the round it is about.
EVIDENCE_EPOCHS = 8
# Accusations remembered, one per (accuser, epoch): a member accuses at most once per epoch.
MAX_HEARD = 1024
# Tensors of a model an accusation may carry (its parameters at the round), and chunks of one
# member's piece (1M chunks of 2^18 floats: far beyond any model that fits a peer).
MAX_PARAM_TENSORS = 100_000
MAX_PIECE_CHUNKS = 2**20
# Longest a member takes to check an accusation (it recomputes one member's gradients).
CHECK_SECONDS = 600.0


@dataclass(frozen=True)
class Verified:
    """The options of verified training (see the module docstring).

    Args:
        model: the trained model; validators recompute gradients on a copy of it.
        loss: `loss(model, batch) -> scalar tensor`, the loss every peer trains on (the
            training loop calls it on `Optimizer.batch()` and calls backward on the result).
        dataset: samples, `dataset[i]` for i < len(dataset): the same on every peer.
        fraction: expected share of this peer's compute spent validating others (0 < f <= 1).
        tolerance: relative error within which a recomputed gradient matches (see TOLERANCE).
        collate: turns a list of samples into a batch (torch's default_collate).
        digest: the dataset's digest, if known (say, of its file); else it is hashed at start.
    """

    model: torch.nn.Module
    loss: Callable[[torch.nn.Module, Any], torch.Tensor]
    dataset: Sequence[Any]
    fraction: float = 0.1
    tolerance: float = TOLERANCE
    collate: Callable[[list[Any]], Any] = default_collate
    digest: str | None = field(default=None)

    def check(self) -> None:
        dropout = [name for name, m in self.model.named_modules()
                   if isinstance(m, torch.nn.modules.dropout._DropoutNd) and m.p > 0]
        if dropout:
            raise ValueError(f"verified training needs a deterministic loss, and {dropout[0]!r} is a dropout layer: "
                             "set its p to 0 (others could not recompute its random masks)")
        if not 0 < self.fraction <= 1:
            raise ValueError(f"Verified.fraction must be in (0, 1], not {self.fraction}")
        if not self.tolerance > 0:
            raise ValueError(f"Verified.tolerance must be positive, not {self.tolerance}")
        if len(self.dataset) == 0:
            raise ValueError("Verified.dataset is empty")

    def dataset_digest(self) -> str:
        """The given digest, or a BLAKE2b of every sample's tensors (and other values' repr)."""
        if self.digest is not None:
            return self.digest
        h = hashlib.blake2b(digest_size=16)
        for i in range(len(self.dataset)):
            _hash_sample(h, self.dataset[i])
        return h.hexdigest()


def _hash_sample(h: Any, sample: Any) -> None:
    if isinstance(sample, torch.Tensor):
        h.update(str((sample.dtype, tuple(sample.shape))).encode())
        for piece in host_slices(sample.detach()):
            h.update(piece)
    elif isinstance(sample, (tuple, list)):
        for part in sample:
            _hash_sample(h, part)
    elif isinstance(sample, dict):
        for key in sorted(sample):
            h.update(repr(key).encode())
            _hash_sample(h, sample[key])
    else:
        h.update(repr(sample).encode())


def _seed(run_id: str, epoch: int, peer: str, step: int) -> bytes:
    return hashlib.sha256(b"potluck.batch" + struct.pack("<QQ", epoch, step) + run_id.encode() + b"\0"
                          + peer.encode()).digest()


def batch_indices(run_id: str, epoch: int, peer: str, step: int, batch_size: int, size: int) -> list[int]:
    """The samples of `peer`'s batch number `step` of `epoch` in run `run_id`, from a dataset of
    `size`: SHA-256 in counter mode, the same on every machine and torch version."""
    seed = _seed(run_id, epoch, peer, step)
    indices: list[int] = []
    counter = 0
    while len(indices) < batch_size:
        block = hashlib.sha256(seed + struct.pack("<Q", counter)).digest()
        counter += 1
        indices.extend(int.from_bytes(block[k:k + 8], "little") % size for k in range(0, 32, 8))
    return indices[:batch_size]


def relative_error(blocks: Sequence[SealedBlock], vector: torch.Tensor) -> float:
    """|sent - recomputed| / |recomputed| over the blocks (inf where the recomputation is 0
    and the blocks are not)."""
    diff = ref = 0.0
    for b in blocks:
        mine = vector[b.offset:b.offset + b.values.numel()].to("cpu", torch.float64)  # (a GPU replica's too)
        diff += float((b.values.to("cpu", torch.float64) - mine).square().sum())
        ref += float(mine.square().sum())
    if ref == 0.0:
        return 0.0 if diff == 0.0 else math.inf
    return math.sqrt(diff / ref)


class BlockProof(Message, what="sealed block", positional=True):
    """A `SealedBlock` on the wire (its offset follows from the group: not sent)."""

    shard: int = Int(None, 0, MAX_GROUP_SIZE - 1)
    chunk: int = Int(None, 0, MAX_PIECE_CHUNKS)
    first: int = Int(None, 0, CHUNK_ELEMENTS // VERIFY_BLOCK - 1)
    weight: float = Number()
    digests: tuple[bytes, ...] = List(None, Bytes(None, DIGEST_BYTES, exact=True), MAX_PIECE_CHUNKS)
    blocks: tuple[bytes, ...] = List(None, Bytes(None, DIGEST_BYTES, exact=True), CHUNK_ELEMENTS // VERIFY_BLOCK)
    values: Any = Raw(None, torch.Tensor, "a tensor")
    seal: bytes = Bytes(None, SIGNATURE_BYTES, exact=True)


class Accusation(Message, what="accusation"):
    """A validator's evidence that member `accused` of `group` sent, in the round of `epoch`,
    gradients other than its batches': what it joined with (`claim`: its round note, which its
    seals cover), blocks of its pieces with its seals, and the round's parameters (which every
    member of the round holds a digest of)."""

    group: Group = Nested("g", Group)
    epoch: int = Int("e", 0, 2**62)
    accused: int = Int("a", 0, MAX_GROUP_SIZE - 1)
    blocks: tuple[BlockProof, ...] = List("b", Nested(None, BlockProof), MAX_GROUP_SIZE)
    params: tuple[torch.Tensor, ...] = List("p", Raw(None, torch.Tensor, "a tensor"), MAX_PARAM_TENSORS)
    claim: Any = Opaque("c", MAX_METADATA_BYTES)


@dataclass(frozen=True)
class Case:
    """A member's contribution to one round, as a validator holds it."""

    group: Group
    epoch: int
    peer: str
    claim: Any  # its round note, as gathered
    blocks: tuple[SealedBlock, ...]

    @property
    def samples(self) -> int:
        return RoundNote.read(self.claim).samples


def strict_float32(tensors: Sequence[torch.Tensor]) -> None:
    """Turn TF32 off where the model is on a CUDA device: validators on other hardware recompute a
    member's gradient to within `TOLERANCE`, and on an H200 (benchmarks/verified.py --device cuda)
    TF32 moved the demo CNN's gradient up to 2.7e-2 from the CPU's, and torch's default (cuDNN's
    convolutions in TF32) up to 8.4e-5; with TF32 off, 3e-7. Process-wide flags: the training
    loop's gradients must be computed the way validators recompute them."""
    if not any(t.is_cuda for t in tensors):
        return
    if torch.backends.cudnn.allow_tf32 or torch.backends.cuda.matmul.allow_tf32:
        logger.warning("verified training: turning TF32 off (torch.backends.cudnn.allow_tf32 and "
                       "torch.backends.cuda.matmul.allow_tf32), as others recompute gradients in float32")
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cuda.matmul.allow_tf32 = False


class Validation:
    """One peer's side of verified training: its batches, its validations of others, and its
    checks of their accusations (`attach` serves them)."""

    def __init__(self, options: Verified, run_id: str, batch_size: int, target_batch_size: int,
                 params: Sequence[torch.Tensor], means: bool = True):
        options.check()
        strict_float32(params)
        self.options = options
        self.run_id = run_id
        self.batch_size = batch_size
        self.target = target_batch_size
        self.means = means  # members send their mean gradient (robust aggregations), else their share of the sum
        self.params = list(params)
        self.digests: dict[int, str] = {}  # epoch -> digest of our parameters in its round
        self.groups: dict[bytes, Group] = {}  # group id -> the group, of our recent rounds (accusations name one)
        self.running: Callable[[bytes], Group | None] = lambda gid: None  # steps our all-reduce just ran
        self.heard: dict[tuple[PeerID, int], None] = {}  # (accuser, epoch) of accusations received
        # Epochs we checked an accusation about a round we were not in: one each (anyone holding a
        # member's sealed blocks can name a made-up group, so each costs us a recomputation at most
        # once an epoch: about what validating costs us anyway).
        self.foreign: dict[int, None] = {}
        self.audience: Callable[[], Sequence[str]] = lambda: ()  # the run's other live peers (told too)
        self.transport: Any = None
        self.method = f"potluck.verified/{run_id}"
        self.tasks: set[asyncio.Task] = set()
        self.max_batches = MAX_BATCHES_FACTOR * math.ceil(target_batch_size / batch_size)
        position = {id(p): i for i, p in enumerate(options.model.parameters())}
        missing = [i for i, p in enumerate(params) if id(p) not in position]
        if missing:
            raise ValueError("Verified.model must be the model whose parameters the Optimizer trains")
        self._positions = [position[id(p)] for p in params]
        self._replica: torch.nn.Module | None = None  # made at the first validation (one model of memory)
        self.task: asyncio.Future | None = None  # the validation under way (one at a time)
        # Whom and when to validate: unpredictable to the members (tests seed their own).
        self.rng: random.Random = random.SystemRandom()
        self.self_checked = False  # our first validation is of our own gradients
        self.broken: str | None = None  # why our own gradients could not be recomputed
        self.validated = 0  # validations done
        self.recomputed = 0  # samples recomputed in them (compare with the samples trained)
        # Members this peer caught, and member -> epoch of the round it was caught in (by us, or
        # proven to us): the latest MAX_BANNED of each, as the ban list itself keeps.
        self.caught: collections.deque[str] = collections.deque(maxlen=MAX_BANNED)
        self.banned_at: dict[str, int] = {}

    def _banned(self, peer: str, epoch: int) -> None:
        self.banned_at.setdefault(peer, epoch)
        drop_oldest(self.banned_at, MAX_BANNED)

    def batch(self, epoch: int, peer: str, step: int) -> Any:
        indices = batch_indices(self.run_id, epoch, peer, step, self.batch_size, len(self.options.dataset))
        return self.options.collate([self.options.dataset[i] for i in indices])

    # -- validating ---------------------------------------------------------------------------------------
    def draw(self, candidates: dict[str, int], my_samples: int, me: str) -> str | None:
        """Whom to validate after a round (None: nobody), among `candidates` (peer -> samples
        claimed): one at random, with a probability that spends `fraction` of our compute on
        average (a validation recomputes its member's samples; we computed `my_samples`). The
        first is ourselves (`me`, if a candidate): a loss that is not deterministic shows there
        before we accuse anyone."""
        if self.task is not None and not self.task.done():
            return None
        if not self.self_checked and me in candidates:
            self.self_checked = True
            return me
        candidates = {p: n for p, n in candidates.items() if p != me}
        if not candidates or not self.self_checked:
            return None
        peer = self.rng.choice(sorted(candidates))
        chance = self.options.fraction * max(my_samples, 1) / max(candidates[peer], 1)
        return peer if self.rng.random() < chance else None

    def snapshot(self, params: Sequence[torch.Tensor]) -> None:
        """Load the round's parameters into the replica (before our own step changes them)."""
        if self._replica is None:
            self._replica = copy.deepcopy(self.options.model)
        replica = list(self._replica.parameters())
        with torch.no_grad():
            for i, p in zip(self._positions, params, strict=True):
                replica[i].copy_(p)

    def contribution(self, epoch: int, peer: str, samples: int, factor: float) -> torch.Tensor:
        """What `peer` should have sent for `epoch` having claimed `samples`, at the replica's
        parameters: the mean of its batches' gradients (skipping non-finite ones, as it did) x
        `factor`, flat in float32 (in a worker thread)."""
        model = self._replica
        params = list(model.parameters())
        params = [params[i] for i in self._positions]
        total = [torch.zeros_like(p, dtype=torch.float32) for p in params]
        wanted, got = samples // self.batch_size, 0
        for step in range(self.max_batches):
            if got >= wanted:
                break
            for p in params:
                p.grad = None
            self.options.loss(model, self.batch(epoch, peer, step)).backward()
            grads = [torch.zeros_like(p) if p.grad is None else p.grad for p in params]
            if all(bool(torch.isfinite(g).all()) for g in grads):
                torch._foreach_add_(total, [g.float() for g in grads])
                got += 1
        for p in params:
            p.grad = None
        scale = factor / max(got, 1)
        return torch.cat([(t * scale).reshape(-1) for t in total])

    def record(self, epoch: int, digest: str) -> None:
        """The digest of our parameters in the round of `epoch` (accusations are checked against it)."""
        self.digests[epoch] = digest
        while len(self.digests) > EVIDENCE_EPOCHS:
            del self.digests[min(self.digests)]

    def remember(self, group: Group) -> None:
        """A group we averaged in: we take accusations about its rounds from its members only."""
        self.groups[group.group_id] = group
        drop_oldest(self.groups, EVIDENCE_EPOCHS)

    def _spawn(self, coro: Any) -> asyncio.Task:
        task = asyncio.ensure_future(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        task.add_done_callback(retrieve_exception)
        return task

    def start(self, case: Case) -> None:
        """Validate `case` in the background (the replica holds its round's parameters)."""
        self.task = self._spawn(self.validate(case))

    async def _recompute(self, case: Case) -> float:
        samples = case.samples
        factor = 1.0 if self.means else samples / self.target
        vector = await run_in_thread(self.contribution, case.epoch, case.peer, samples, factor)
        return relative_error(case.blocks, vector)

    async def validate(self, case: Case) -> float:
        """Recompute `case`'s contribution and compare it with its sealed blocks; on a mismatch,
        ban the member and send the evidence to the round's other members. Returns the error."""
        error = await self._recompute(case)
        self.validated += 1
        self.recomputed += case.samples
        if case.peer == str(self.transport.peer_id):
            if error > self.options.tolerance:
                self.broken = (f"this peer's own gradients could not be recomputed from its batches (relative error "
                               f"{error:.3g}): the loss must be a deterministic function of the model and the batch, "
                               f"computed on Optimizer.batch()")
            return error
        if error <= self.options.tolerance:
            logger.debug("epoch %d: validated %s (relative error %.3g)", case.epoch, case.peer, error)
            return error
        self.caught.append(case.peer)
        self._banned(case.peer, case.epoch)
        ban_list(self.transport).ban(PeerID.from_string(case.peer), f"epoch {case.epoch}: its gradients are not "
                                     f"those of its batches (relative error {error:.3g} > {self.options.tolerance:g})")
        accusation = Accusation(case.group, case.epoch, case.group.peers.index(PeerID.from_string(case.peer)),
                                tuple(BlockProof(b.shard, b.chunk, b.first, b.weight, b.digests, b.blocks,
                                                 b.values, b.seal) for b in case.blocks),
                                tuple(p.detach().clone() for p in self._replica_params()), case.claim)
        request = accusation.to_wire()
        me = self.transport.peer_id
        told = {m for m in case.group.peers if m != me and str(m) != case.peer}
        told |= {PeerID.from_string(p) for p in self.audience() if p not in (str(me), case.peer)}
        for member in told:
            self._spawn(self._tell(member, request))
        return error

    async def _tell(self, member: PeerID, request: Any) -> None:
        try:
            await self.transport.call(member, self.method, request, timeout=CHECK_SECONDS)
        except (NetworkError, PotluckError, TimeoutError) as e:
            logger.info("could not hand an accusation to %s: %s", member, e)

    def _replica_params(self) -> list[torch.Tensor]:
        params = list(self._replica.parameters())
        return [params[i] for i in self._positions]

    # -- accusations from others ------------------------------------------------------------------------
    def attach(self, transport: Any) -> None:
        self.transport = transport
        transport.add_handler(self.method, self._on_accusation, max_seconds=CHECK_SECONDS)

    def detach(self) -> None:
        if self.transport is not None:
            self.transport.remove_handler(self.method)
        for task in list(self.tasks):
            task.cancel()

    async def _on_accusation(self, request: Any, ctx: Any) -> dict:
        """Check a member's accusation ourselves: ban the accused if it holds, else the accuser."""
        accusation = Accusation.from_wire(request)
        group, accuser = accusation.group, ctx.peer_id
        known = self.groups.get(group.group_id) or self.running(group.group_id)
        if (known is not None and known != group) or accuser not in group.peers \
                or accusation.accused >= len(group.peers):
            raise PotluckError("an accusation must come from a member of its round, about a member")
        accused = group.peers[accusation.accused]
        banned = ban_list(self.transport)
        if accused == accuser or accuser in banned:
            raise PotluckError("not taking accusations from this peer")
        if accused in banned:
            return {"checked": False, "why": "banned already"}
        key = (accuser, accusation.epoch)
        if key in self.heard:
            raise PotluckError("one accusation per member and epoch")
        self.heard[key] = None
        drop_oldest(self.heard, MAX_HEARD)
        mine = self.digests.get(accusation.epoch)
        if mine is None or RoundNote.read(accusation.claim).params != mine:
            return {"checked": False, "why": "not at parameters we hold"}
        if known is None:  # a round we were not in: we cannot tell its group is real
            if accusation.epoch in self.foreign:
                raise PotluckError("checked an accusation about another round of that epoch already")
            self.foreign[accusation.epoch] = None
            while len(self.foreign) > EVIDENCE_EPOCHS:
                del self.foreign[min(self.foreign)]
        forged = await run_in_thread(self._forged, accusation, mine)  # hashes a model: off the loop
        if forged is not None:
            banned.ban(accuser, f"it sent an accusation of {accused} with {forged}")
            return {"checked": True, "upheld": False}
        while self.task is not None and not self.task.done():  # one use of the replica at a time
            await asyncio.wait([self.task])
        case = Case(group, accusation.epoch, str(accused), accusation.claim,
                    tuple(self._block(group, accusation.accused, b) for b in accusation.blocks))
        self.task = asyncio.ensure_future(self._check(case, accusation.params))
        error = await asyncio.shield(self.task)
        if error > self.options.tolerance:
            self._banned(str(accused), case.epoch)
            banned.ban(accused, f"epoch {case.epoch}: {accuser} showed that its gradients are not those of its "
                                f"batches, and we checked (relative error {error:.3g})")
            return {"checked": True, "upheld": True}
        banned.ban(accuser, f"epoch {case.epoch}: it accused {accused} falsely (we recomputed its gradients: "
                            f"relative error {error:.3g})")
        return {"checked": True, "upheld": False}

    async def _check(self, case: Case, params: Sequence[torch.Tensor]) -> float:
        await run_in_thread(self.snapshot, params)
        return await self._recompute(case)

    @staticmethod
    def _block(group: Group, sender: int, b: BlockProof) -> SealedBlock:
        offset = group.bounds(b.shard)[0] + b.chunk * CHUNK_ELEMENTS + b.first * VERIFY_BLOCK
        return SealedBlock(b.shard, sender, b.chunk, b.first, offset, b.weight, b.digests, b.blocks,
                           b.values, b.seal)

    def _forged(self, accusation: Accusation, mine: str) -> str | None:
        """What is wrong with an accusation's evidence (None: it proves what the accused sent, at
        our parameters of that round)."""
        params = accusation.params
        if len(params) != len(self.params) or any(
                p.dtype != q.dtype or p.shape != q.shape for p, q in zip(params, self.params, strict=True)):
            return "parameters of another model"
        if tensor_digest(list(params)) != mine:
            return "parameters other than the round's"
        group, claim = accusation.group, claim_digest(accusation.claim)
        if not accusation.blocks:
            return "no blocks"
        for b in accusation.blocks:
            if b.shard >= len(group.peers) or not group.part_sizes[b.shard]:
                return "a block of no shard"
            start, end = group.bounds(b.shard)
            lo = start + b.chunk * CHUNK_ELEMENTS + b.first * VERIFY_BLOCK
            values = b.values
            if values.dtype != torch.float32 or values.dim() != 1 or not 0 < values.numel() <= end - lo:
                return "a block outside its shard"
            why = sealed_block(group, claim, self._block(group, accusation.accused, b))
            if why is not None:
                return f"a block it cannot show the accused sent ({why})"
        return None
