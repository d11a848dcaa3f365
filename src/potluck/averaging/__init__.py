"""Averaging: matchmaking through the DHT (incl. Moshpit grids), the fault-tolerant butterfly
all-reduce, DeDLOC load balancing, state download for newcomers, and the `Averager` on top.

Imports from `potluck.core`, `potluck.net`, `potluck.dht` and `potluck.compression` only.
"""

from potluck.averaging.allreduce import AllReduceService, Group
from potluck.averaging.averager import Averager, StepResult, moshpit_grid
from potluck.averaging.load_balancing import optimal_fractions, part_sizes
from potluck.averaging.matchmaking import FormedGroup, Matchmaker
from potluck.averaging.role import Role
from potluck.averaging.state_transfer import StateServer, download_state

__all__ = [
    "AllReduceService", "Averager", "FormedGroup", "Group", "Matchmaker", "Role", "StateServer", "StepResult",
    "download_state", "moshpit_grid", "optimal_fractions", "part_sizes",
]
