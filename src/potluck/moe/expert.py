"""`RemoteExpert`: an `nn.Module` whose forward and backward run on an expert server.

The forward call returns the outputs; the backward call sends the output gradients with the same
call id, so the server can reuse the forward's graph, and returns the input gradients. Both are
one `torch.autograd.Function`, so a remote expert composes with local layers like any module.
"""

from __future__ import annotations

import dataclasses
import secrets
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from potluck.core.errors import NetworkError, RemoteError
from potluck.core.peer_like import PeerLike
from potluck.moe.errors import BadExpertRequest, ExpertError, ExpertNotFound, NotEnoughExperts, StashMissing
from potluck.moe.grid import ExpertLocation, locate
from potluck.moe.messages import (
    MAX_CALL_ID,
    BackwardReply,
    BackwardRequest,
    ExpertInfo,
    ForwardReply,
    ForwardRequest,
    InfoRequest,
)
from potluck.moe.server import METHOD_BACKWARD, METHOD_FORWARD, METHOD_INFO, CallerRateLimited

__all__ = ["AUTOGRAD_ANCHOR", "DEFAULT_TIMEOUT", "ForwardReply", "RemoteExpert", "abackward", "aforward", "ainfo",
           "new_call_id"]

# Seconds a forward or backward call may take when the caller sets no timeout (the server may be
# batching other clients' work first, so this is generous).
DEFAULT_TIMEOUT = 60.0
# Bound on a DHT lookup of an expert's location.
LOOKUP_TIMEOUT = 10.0

_ERRORS: dict[str, type[ExpertError]] = {
    cls.__name__: cls for cls in (BadExpertRequest, CallerRateLimited, ExpertError, ExpertNotFound, NotEnoughExperts,
                                  StashMissing)}


def new_call_id() -> int:
    return secrets.randbelow(MAX_CALL_ID)


def _translate(error: RemoteError, uid: str) -> Exception:
    """The server's expert errors as local exceptions of the same kind; other errors unchanged.
    A BadExpertRequest keeps its field (the text after "malformed <request>: ")."""
    cls = _ERRORS.get(error.remote_type)
    if cls is BadExpertRequest:
        text = str(error).removeprefix(f"remote {error.remote_type}: ").removeprefix("malformed ")
        what, _, detail = text.partition(": ")
        return BadExpertRequest(what, detail, uid)
    return cls(str(error)) if cls is not None else error


async def _call(transport: Any, location: ExpertLocation, method: str, request: Any, timeout: float) -> Any:
    try:
        return await transport.call(location.peer_id, method, request.to_wire(), timeout=timeout)
    except RemoteError as e:
        raise _translate(e, location.uid) from None


async def aforward(transport: Any, location: ExpertLocation, call_id: int, inputs: Sequence[torch.Tensor],
                   timeout: float = DEFAULT_TIMEOUT, needs_grad: Sequence[bool] | None = None) -> ForwardReply:
    """Run the expert's forward pass on its server; the call id pairs it with the backward call.

    `needs_grad` says which inputs will want gradients (default: all), so the server keeps only that work.
    A refused request raises BadExpertRequest; a malformed reply, MalformedMessage.
    """
    inputs = tuple(x.detach() for x in inputs)
    flags = tuple(bool(n) for n in needs_grad) if needs_grad is not None else (True,) * len(inputs)
    reply = await _call(transport, location, METHOD_FORWARD, ForwardRequest(location.uid, call_id, inputs, flags),
                        timeout)
    return ForwardReply.from_wire(reply, rows=inputs[0].shape[0] if inputs and inputs[0].dim() else 0, uid=location.uid)


async def abackward(transport: Any, location: ExpertLocation, call_id: int, inputs: Sequence[torch.Tensor],
                    grad_outputs: Sequence[torch.Tensor], timeout: float = DEFAULT_TIMEOUT,
                    needs_grad: Sequence[bool] | None = None, kept: bool = True) -> list[torch.Tensor | None]:
    """Send output gradients; input gradients come back (None for inputs without gradients).

    The inputs go along only if the server did not keep the forward graph (`kept`, from the forward
    reply) or has dropped it since (it then answers StashMissing and we resend).
    """
    inputs = tuple(x.detach() for x in inputs)
    flags = tuple(bool(n) for n in needs_grad) if needs_grad is not None else (True,) * len(inputs)
    request = BackwardRequest(location.uid, call_id, tuple(g.detach() for g in grad_outputs),
                              None if kept else inputs, flags)
    try:
        reply = await _call(transport, location, METHOD_BACKWARD, request, timeout)
    except StashMissing:
        reply = await _call(transport, location, METHOD_BACKWARD, dataclasses.replace(request, inputs=inputs), timeout)
    return list(BackwardReply.from_wire(reply, inputs=inputs, uid=location.uid).grads)


async def ainfo(transport: Any, location: ExpertLocation, timeout: float = DEFAULT_TIMEOUT) -> ExpertInfo:
    """The expert's declared inputs and outputs (batch dim excluded), its server's rows per call and
    its optimizer steps."""
    return ExpertInfo.from_wire(await _call(transport, location, METHOD_INFO, InfoRequest(location.uid), timeout),
                                uid=location.uid)


async def alocate(dht: Any, uid: str, timeout: float = LOOKUP_TIMEOUT) -> ExpertLocation:
    """Where `uid` is served, from the DHT; ExpertNotFound if no live server announced it."""
    found = await dht.aget(uid, latest=True, timeout=timeout)
    location = locate(uid, found, dht.get_time())
    if location is None:
        raise ExpertNotFound(f"no live server announces expert {uid!r} in the DHT (with a well-formed record "
                             "it signed about itself)")
    return location


# A tensor that requires grad, passed to every remote call so autograd calls backward even when no
# input requires grad (the expert's own weights live on the server).
AUTOGRAD_ANCHOR = torch.empty(0, requires_grad=True)


class _RemoteCall(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, anchor: torch.Tensor, expert: RemoteExpert,
                *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        call_id = new_call_id()
        reply = expert.call_forward(call_id, inputs, ctx.needs_input_grad[2:])
        ctx.expert, ctx.call_id, ctx.needs, ctx.kept = expert, call_id, ctx.needs_input_grad[2:], reply.kept
        ctx.save_for_backward(*inputs)
        return tuple(reply.outputs)

    @staticmethod
    def backward(ctx: Any, *grad_outputs: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        expert: RemoteExpert = ctx.expert
        grads = expert.call_backward(ctx.call_id, ctx.saved_tensors, grad_outputs, ctx.needs, ctx.kept)
        return (None, None, *grads)


class RemoteExpert(nn.Module):
    """An expert served by another peer, used like a local module (forward and backward).

    Args:
        peer: this process's started `potluck.Peer`.
        uid: the expert's uid (e.g. `ffn.3.14`); its server is looked up in the DHT.
        location: where it is served, if already known (skips the lookup).
        forward_timeout, backward_timeout: seconds per call (None: `DEFAULT_TIMEOUT`).
    """

    def __init__(self, peer: PeerLike, uid: str, *, location: ExpertLocation | None = None,
                 forward_timeout: float | None = None, backward_timeout: float | None = None):
        super().__init__()
        self.peer = peer
        self.uid = uid
        self._location = location
        self._pinned = location is not None  # a given location is kept; a looked-up one is refreshed on failure
        self.forward_timeout = forward_timeout or DEFAULT_TIMEOUT
        self.backward_timeout = backward_timeout or DEFAULT_TIMEOUT

    def _run(self, coro: Any, timeout: float) -> Any:
        return self.peer.run(coro, timeout + 5)

    @property
    def location(self) -> ExpertLocation:
        if self._location is None:
            self._location = self.peer.run(alocate(self.peer.dht, self.uid), LOOKUP_TIMEOUT + 5)
        return self._location

    def _forget_location(self) -> None:
        if not self._pinned:
            self._location = None

    def info(self) -> ExpertInfo:
        """The expert's declared inputs/outputs and the server's limits."""
        return self._run(ainfo(self.peer.transport, self.location, self.forward_timeout), self.forward_timeout)

    def call_forward(self, call_id: int, inputs: Sequence[torch.Tensor], needs_grad: Sequence[bool]) -> ForwardReply:
        """The forward call `call_id` on the expert's server (`aforward`), from this thread. A
        location that fails is looked up again next time (the expert may have moved)."""
        try:
            return self._run(aforward(self.peer.transport, self.location, call_id, inputs, self.forward_timeout,
                                      needs_grad), self.forward_timeout)
        except BadExpertRequest:
            raise  # our request was wrong, not the location
        except (NetworkError, ExpertNotFound):
            self._forget_location()
            raise

    def call_backward(self, call_id: int, inputs: Sequence[torch.Tensor], grad_outputs: Sequence[torch.Tensor],
                      needs_grad: Sequence[bool], kept: bool) -> list[torch.Tensor | None]:
        """The backward call of forward call `call_id` (`abackward`), from this thread."""
        return self._run(abackward(self.peer.transport, self.location, call_id, inputs, grad_outputs,
                                   self.backward_timeout, needs_grad, kept), self.backward_timeout * 2)

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
        self.location  # noqa: B018 - look it up before autograd starts
        outputs = _RemoteCall.apply(AUTOGRAD_ANCHOR, self, *inputs)
        return outputs[0] if len(outputs) == 1 else outputs

    def extra_repr(self) -> str:
        return f"uid={self.uid!r}"
