"""Small tensor helpers shared by several layers."""

from __future__ import annotations

import math

import torch


def all_finite(t: torch.Tensor) -> bool:
    """True if `t` has no NaN or infinity.

    `amax`/`amin` propagate NaN and keep infinities, and need no temporary tensor; measured
    several times faster than `torch.isfinite(t).all()` on the CPU builds we use.
    """
    if t.numel() == 0:
        return True
    if t.is_complex():
        t = torch.view_as_real(t)
    if not t.is_floating_point():
        return True
    t = t.detach()
    return math.isfinite(t.amax().item()) and math.isfinite(t.amin().item())
