"""Which parameter-server runs a peer serves, asked without knowing the run (`core.names.PS_RUNS`).

A worker finds its servers under its run id in the DHT; with a wrong --run-id it finds nothing,
and nothing there says why. So every peer that hosts a `ParameterServer` answers one method that
belongs to no run, listing the runs it serves shard servers of (`ServedRuns`), and a worker that
finds no server of its run asks the peers it joined through (`ps.discovery`). The answer is only
advice to print: a malformed, oversized or missing one is ignored, and nothing else trusts it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any

from potluck.core.errors import NetworkError
from potluck.core.names import PS_RUNS
from potluck.net.connection import CallContext
from potluck.net.identity import PeerID
from potluck.net.transport import Transport
from potluck.ps.messages import MAX_SERVED_RUNS, RunsQuery, ServedRuns

logger = logging.getLogger(__name__)

# The longest the handler may run: it only reads a set, so a second is far more than it needs.
RUNS_HANDLER_SECONDS = 1.0


class ServedRunsService:
    """The runs this transport's shard servers serve, by server (several shards, of one run or
    more, share a peer), and the PS_RUNS handler that lists them. One per transport (`served_runs`)."""

    def __init__(self, transport: Transport):
        self.transport = transport
        self.servers: dict[object, str] = {}  # a server -> its run id

    def add(self, server: object, run_id: str) -> None:
        if not self.servers:
            self.transport.add_handler(PS_RUNS, self._handle, max_seconds=RUNS_HANDLER_SECONDS)
        self.servers[server] = run_id

    def remove(self, server: object) -> None:
        """`server` no longer serves (again: nothing happens)."""
        if self.servers.pop(server, None) is not None and not self.servers:
            self.transport.remove_handler(PS_RUNS)

    def listing(self, asked: str) -> ServedRuns:
        """The runs served, `asked` first if among them (so the cap never hides the answer)."""
        runs = set(self.servers.values())
        ordered = ([asked] if asked in runs else []) + sorted(runs - {asked})
        return ServedRuns(tuple(ordered[:MAX_SERVED_RUNS]))

    async def _handle(self, request: Any, ctx: CallContext) -> Any:
        return self.listing(RunsQuery.from_wire(request).run_id).to_wire()


def served_runs(transport: Transport) -> ServedRunsService:
    """The service of the peer behind `transport` (one per transport, like its other services)."""
    service = transport.services.get(PS_RUNS)
    if service is None:
        service = transport.services[PS_RUNS] = ServedRunsService(transport)
    return service


async def ask_served_runs(transport: Transport, peers: Sequence[PeerID], run_id: str,
                          timeout: float) -> dict[PeerID, tuple[str, ...]]:
    """The runs each of `peers` serves, asked at once within `timeout` seconds, for the peers that
    answered with a well-formed, non-empty list (no answer, an unknown method, a malformed reply:
    left out, as a peer that serves no run)."""
    async def ask(peer: PeerID) -> tuple[str, ...]:
        try:
            reply = await transport.call(peer, PS_RUNS, RunsQuery(run_id).to_wire(), timeout=timeout)
            return ServedRuns.from_wire(reply).runs
        except (NetworkError, TimeoutError) as e:  # MethodNotFound and MalformedMessage are NetworkErrors too
            logger.debug("%s did not say which parameter-server runs it serves: %s", peer, e)
            return ()
    others = [p for p in dict.fromkeys(peers) if p != transport.peer_id]
    answers = await asyncio.gather(*(ask(p) for p in others))
    return {p: runs for p, runs in zip(others, answers, strict=True) if runs}
