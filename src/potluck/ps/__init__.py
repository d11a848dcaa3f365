"""`potluck.ps`: the classic design space: parameter-server training and hyperparameter sweeps.

- `messages`: the typed wire messages (push, pull, replica updates, layouts), checked at parse time.
- `server`: a parameter server (or one shard of it) in the consistency models of the primer:
  `sync`, `async`, `ssp` (bounded staleness) and `backup` workers; shards split by size over several servers, and
  the decentralized form in which every worker also serves one shard and keeps a replica of the
  next one.
- `worker`: the worker side: register, push gradients, receive fresh parameters, fail over to a
  shard's replica.
- `runs`: which runs a peer serves shard servers of, asked without knowing the run (a worker of
  a wrong --run-id asks the peers it joined through).
- `discovery`: shard servers announce themselves and the layout in the DHT; workers find it there
  (`potluck ps server` / `potluck ps worker`).
- `sweep`: hyperparameter trials (grid or random) handed out through the DHT with leases.
- `simulation`: a whole parameter-server swarm on the emulated network, for tests and
  `potluck compare`.

Imports from `core`, `net` and `dht` only (and torch); the CLI (`potluck ps`, `potluck sweep`, `potluck compare`)
sits above.
"""

import warnings

from potluck.ps.messages import ShardLayout
from potluck.ps.server import CONSISTENCY_MODELS, ParameterServer, PSInputError, ServerConfig, split_by_size
from potluck.ps.sweep import Range, SweepError, SweepSpec, Trial, TrialResult, run_sweep
from potluck.ps.worker import PSClient, PSWorker, ShardServerLost, start_parameter_servers

__all__ = ["CONSISTENCY_MODELS", "PSClient", "PSInputError", "PSWorker", "ParameterServer", "Range", "ServerConfig",
           "ShardLayout", "ShardServerLost", "SweepError", "SweepSpec", "Trial", "TrialResult",
           "run_sweep", "split_by_size", "start_parameter_servers"]


def __getattr__(name: str) -> object:
    """`MODES`, the old name of `CONSISTENCY_MODELS`, still answers for one release."""
    if name == "MODES":
        warnings.warn("potluck.ps.MODES is deprecated: it is called CONSISTENCY_MODELS now", DeprecationWarning,
                      stacklevel=2)
        return CONSISTENCY_MODELS
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
