"""The model's state as a run shares it (`ModelState`): the parameters, the wrapped optimizer's
statistics and any tensors a training mode adds (DiLoCo's outer momentum), averaged in place by
one `Averager` and served to newcomers from it.

Every write to these tensors happens under the averager's lock (`lock()`), so that a round or a
newcomer's snapshot never sees half of one, and counts as a new generation (`generation`): a
digest hashed before a write says nothing about the state after it.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from typing import Any

import torch

from potluck.averaging.averager import Averager
from potluck.core.digests import Hasher
from potluck.core.peer_like import PeerLike
from potluck.core.staging import host_slices
from potluck.optim.schema import MAX_MANIFEST_SCHEMA_BYTES, RunSchema, fits

__all__ = ["ModelState", "tensor_digest"]


def tensor_digest(tensors: list[torch.Tensor]) -> str:
    """A digest of the tensors' bytes (on any device): equal only if they are equal to the bit."""
    hasher = Hasher()
    for t in tensors:
        for piece in host_slices(t):
            hasher.update(piece)
    return hasher.hexdigest(16)


class ModelState:
    """The tensors a run's peers keep identical, their averager, and the epoch they are labelled
    with. `extra`: tensors of the training mode that belong to the state (averaged and downloaded
    with it); `versions_follow_epochs`: the version donors announce is the epoch (sync mode),
    rather than the averager's own count of rounds; `schema`: the run's, which newcomers are told
    with the state (its fingerprint, and the whole where it fits: MAX_MANIFEST_SCHEMA_BYTES)."""

    def __init__(self, peer: PeerLike, run_id: str, inner: torch.optim.Optimizer, extra: list[torch.Tensor],
                 averaging: dict[str, Any], grid: tuple[int, ...] | None, versions_follow_epochs: bool,
                 schema: RunSchema | None = None):
        self.inner = inner
        self.params = [p for g in inner.param_groups for p in g["params"] if p.requires_grad]
        self.extra = extra
        self.versions_follow_epochs = versions_follow_epochs
        self.generation = 0  # writes to the state so far
        self._described: dict[str, Any] = {} if schema is None else {"fp": schema.fingerprint}
        if schema is not None and fits(schema, MAX_MANIFEST_SCHEMA_BYTES):
            self._described["schema"] = json.loads(json.dumps(schema.to_wire()))  # as a reader decodes it: lists
        self._init_optimizer_state()
        # The parameters and statistics themselves: averaged in place, served to newcomers.
        self.averager = Averager(peer, self.tensors(), run_id, name="state", grid=grid, **averaging)
        self.averager.state_metadata = self.metadata(0)

    def tensors(self) -> list[torch.Tensor]:
        return [p.detach() for p in self.params] + self.optimizer_tensors() + self.extra

    def serve(self, params: list[torch.Tensor]) -> None:
        """Newcomers download `params` (one tensor per parameter, alike) in place of the
        parameters, with the rest of the state: DiLoCo's outer parameters, the point every member
        of the last round shares. Given the local ones, which the donor's inner steps since that
        round moved, a newcomer's outer point differed from everyone's, and its first round of
        every fragment was followed by a repair round (about 4 s each over 100 Mbit/s links,
        blocking every member). The caller writes `params` only under `lock()`."""
        if [(p.shape, p.dtype) for p in params] != [(p.shape, p.dtype) for p in self.params]:
            raise ValueError("the tensors served in place of the parameters must be alike to them")
        self.averager.served_tensors = [p.detach() for p in params] + self.optimizer_tensors() + self.extra

    def copy_params_to(self, tensors: list[torch.Tensor]) -> None:
        """Copy the parameters into `tensors` (served ones: under the lock, never seen half-written)."""
        with self.lock(), torch.no_grad():
            torch._foreach_copy_(tensors, [p.detach() for p in self.params])

    @contextlib.contextmanager
    def lock(self) -> Iterator[list[torch.Tensor]]:
        """Hold the state still (no round or snapshot reads it meanwhile); yields its tensors."""
        with self.averager.get_tensors() as tensors:
            yield tensors

    def metadata(self, epoch: int) -> dict[str, Any]:
        """What newcomers download with the state: its epoch and the run's schema."""
        return {"epoch": epoch, **self._described}

    def label(self, epoch: int) -> None:
        """What newcomers download is labelled with the epoch of the parameters."""
        self.averager.state_metadata = self.metadata(epoch)
        if self.versions_follow_epochs:
            self.averager.round = epoch  # the version donors announce

    def inner_step(self, closes_epoch: int | None = None) -> None:
        """The wrapped optimizer's step, under the lock (newcomers never see half of it, nor the
        new parameters labelled with the old epoch: `closes_epoch`, the epoch they begin)."""
        with self.lock():
            self.generation += 1
            self.inner.step()
            if closes_epoch is not None:
                self.label(closes_epoch)
        self.inner.zero_grad(set_to_none=True)  # consumed

    def digest(self) -> str:
        """A digest of the parameters and optimizer statistics, exact to the bit."""
        with self.lock() as tensors:
            return tensor_digest(tensors)

    def _init_optimizer_state(self) -> None:
        """Create the wrapped optimizer's statistics now (zeros), so every peer averages and
        downloads the same set of tensors from the first epoch on. One parameter at a time and
        with a learning rate of 0: no copy of the model, and the parameters stay as they are."""
        if any(self.inner.state.get(p) for p in self.params):
            return
        rates = [group.get("lr") for group in self.inner.param_groups]
        try:
            for group in self.inner.param_groups:
                group["lr"] = 0.0
            for p in self.params:
                p.grad = torch.zeros_like(p)
                self.inner.step()
                p.grad = None
        finally:
            for group, rate in zip(self.inner.param_groups, rates, strict=True):
                group["lr"] = rate
        with torch.no_grad():
            for state in self.inner.state.values():
                for value in state.values():
                    if isinstance(value, torch.Tensor) and value.is_floating_point():
                        value.zero_()

    def _optimizer_slots(self) -> list[tuple[dict, str]]:
        return [(state, name) for p in self.params for state in [self.inner.state.get(p, {})]
                for name in sorted(state) if isinstance(state[name], torch.Tensor)
                and state[name].is_floating_point()]

    def optimizer_tensors(self) -> list[torch.Tensor]:
        return [state[name] for state, name in self._optimizer_slots()]

    def load_inner(self, state_dict: dict[str, Any]) -> None:
        """Load the wrapped optimizer's state into the tensors it has now: the averager averages
        and serves those very tensors."""
        self.generation += 1
        kept = self.optimizer_tensors()
        with self.lock(), torch.no_grad():
            self.inner.load_state_dict(state_dict)
            slots = self._optimizer_slots()
            if [t.shape for t in kept] != [state[name].shape for state, name in slots]:
                raise ValueError("the optimizer state does not fit this model's")
            for old, (state, name) in zip(kept, slots, strict=True):
                old.copy_(state[name])
                state[name] = old

    def load_params(self, saved: list[torch.Tensor]) -> None:
        """Copy `saved` (one tensor per parameter, shapes checked) into the parameters."""
        if len(saved) != len(self.params):
            raise ValueError(f"{len(saved)} parameters given; this model has {len(self.params)}")
        if any(p.shape != s.shape for p, s in zip(self.params, saved, strict=True)):
            raise ValueError("parameter shapes do not fit this model")
        with self.lock(), torch.no_grad():
            self.generation += 1
            for p, s in zip(self.params, saved, strict=True):
                p.copy_(s)
