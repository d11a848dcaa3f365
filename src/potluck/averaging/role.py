"""`Role`: how a peer takes part in averaging (the same three roles for an `Averager` and an `Optimizer`)."""

from __future__ import annotations

from enum import Enum


class Role(str, Enum):
    """How a peer takes part in averaging.

    NODE sends its tensors and reduces a share of the group's; CLIENT (behind NAT: nobody can dial
    it) only sends and receives; AUX reduces for others and holds no result (it trains nothing).
    A `str` Enum: `Role.NODE == "node"`, and `Role("node")` converts the wire value back.
    """

    NODE = "node"
    CLIENT = "client"
    AUX = "aux"

    def __str__(self) -> str:
        return self.value

    @classmethod
    def _missing_(cls, value: object) -> Role:
        raise ValueError(f"role must be one of {[r.value for r in cls]}, not {value!r}")
