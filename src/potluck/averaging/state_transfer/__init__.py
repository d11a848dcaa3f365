"""State download: a newcomer fetches the newest model state from several peers at once.

A donor runs a `StateServer` (`server`): it offers snapshots of its state, each described by a
manifest (version, metadata, tensor specs, chunk size and the SHA-256 of every chunk). A newcomer
(`download_state`, `download`) asks every donor for a manifest; where donors disagree, the
caller's `elect` chooses the state (or refuses to), else the state the most donors agree on, never
merely the highest version claimed; then it fetches its chunks from all of its holders at once,
checking each against its hash.

Donors are other peers, and one may lie. The caller can say which donors it trusts (`vouched`:
e.g. live peers in its progress view; identities it never heard of do not count) and check each
manifest (`check`: e.g. that its version is no further ahead than the swarm supports) and choose
among disagreeing donors by what it can verify of them (`elect`: the Optimizer counts the rounds
its witnesses recorded each state's holders in, `potluck.optim.vouching`); donors left out or
refused are logged, as are donors outvoted by a larger group, and any donor whose
chunk does not match its hash. See docs/security.md for what this does and does not stop.

Wire (`messages`; method names are the averager's, `potluck.core.names.AveragerNames`, so several
averagers coexist on one peer):
- `manifest` (unary): `ManifestRequest` (empty), answered with a `Manifest`.
- `chunks` (a stream): opened with `ChunkStreamOpen` (a snapshot id); every
  `ChunkRequest` (a chunk index) is answered, in order, with a `ChunkReply` (index, uint8 tensor).
A donor says it has a state to give with a `DonorRecord` in the DHT (the `Averager` reads them).

Modules, each importing only those above it: `messages` (the wire and its limits), `download`
(the newcomer's side), `server` (the donor's side).
"""

from potluck.averaging.state_transfer.download import PARALLEL_DONORS, Election, ManifestCheck, download_state
from potluck.averaging.state_transfer.messages import (
    CHUNK_BYTES,
    MAX_STATE_BYTES,
    DonorRecord,
    Manifest,
    ManifestRequest,
    read_donors,
)
from potluck.averaging.state_transfer.server import StateServer

__all__ = [
    "CHUNK_BYTES", "MAX_STATE_BYTES", "PARALLEL_DONORS", "DonorRecord", "Election", "Manifest", "ManifestCheck",
    "ManifestRequest", "StateServer", "download_state", "read_donors",
]
