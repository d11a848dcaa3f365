"""PowerSGD: rank-r gradient compression for a two-round all-reduce, with error feedback.

One `PowerSGD` per gradient tensor, the same on every peer. A step, with the caller's (weighted)
all-reduce between the phases:

    p = state.phase1(grad)             # local P = (M + residual) @ Q, shape (n, rank)
    q = state.phase2(allreduce(p))     # orthonormalize the mean P; local Q = M^T P, shape (m, rank)
    approx = state.finish(allreduce(q))  # mean-gradient estimate P Q^T, shape of grad, float32

Why it works: with the same P on every peer, P (mean Q)^T = P P^T (mean M), the projection of
the true mean onto span(P), whatever each peer's Q was. The persistent state (residual, Q) only
changes in `finish`, so a step that fails between phases is simply restarted with `phase1`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from potluck.compression.checks import check_float_tensor, finite_float32, type_name, value_range
from potluck.core.errors import CompressionError
from potluck.core.tensors import all_finite

__all__ = ["PowerSGD"]

# A column that keeps less than this fraction of its length once the earlier columns are
# projected out is treated as dependent: twice-iterated Gram-Schmidt is only accurate above it.
_INDEPENDENT_FRACTION = 1e-3
# After scaling a matrix to max |entry| 1, a column this short is zero in all but rounding.
_DEGENERATE_NORM = 2.0**-60


class PowerSGD:
    """The compression state of one gradient tensor.

    Tensors with 2+ dims are viewed as (shape[0], rest) matrices. 1-D tensors, and matrices
    where rank * (n + m) >= n * m (small ones, or rank >= min(n, m)), are not compressed: their
    phase1 returns the gradient itself, phase2 an empty tensor, finish the averaged gradient, so
    a caller drives every tensor through the same three calls.

    The residual is this peer's own: M - P P^T M (the paper's local error, not M - P (mean Q)^T,
    which would also pile up this peer's disagreement with the others step after step). Q starts
    from a normal matrix seeded by `seed`, which must match on all peers (use a per-tensor seed
    agreed by the group); afterwards Q is the orthonormalized all-reduced Q, identical everywhere.
    """

    def __init__(self, shape: Sequence[int], rank: int, *, seed: int = 0, error_feedback: bool = True):
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
            raise CompressionError(f"powersgd: rank must be a positive int, got {rank!r:.50}")
        self.shape = torch.Size(shape)
        self.rank = rank
        self.error_feedback = error_feedback
        rows = self.shape[0] if len(self.shape) >= 2 else 0
        cols = self.shape.numel() // rows if rows else 0
        self.matrix_shape = (rows, cols)
        self.compressed = rows > 0 and cols > 0 and rank * (rows + cols) < rows * cols
        self._q = torch.empty(0)
        self._residual: torch.Tensor | None = None
        if self.compressed:
            generator = torch.Generator().manual_seed(seed)
            self._q = _orthonormal(torch.randn(cols, rank, generator=generator))
            if error_feedback:
                self._residual = torch.zeros(rows, cols)
        # Per-step scratch, set by phase1 / phase2.
        self._phase = 0
        self._m: torch.Tensor | None = None
        self._p: torch.Tensor | None = None
        self._local_q: torch.Tensor | None = None
        self._mean: torch.Tensor | None = None

    def reset(self) -> None:
        """Forget the residual and any unfinished step (e.g. after loading a state from peers)."""
        if self._residual is not None:
            self._residual.zero_()
        self._phase = 0
        self._m = self._p = self._local_q = self._mean = None

    @property
    def residual(self) -> torch.Tensor | None:
        """What error feedback has held back so far, as an (n, m) matrix (None if not kept)."""
        return self._residual

    def phase1(self, grad: torch.Tensor) -> torch.Tensor:
        """The local P to be averaged; starts a new step (abandoning any unfinished one)."""
        x = finite_float32(grad, "powersgd").values
        if x.shape != self.shape:
            raise CompressionError(f"powersgd: expected a gradient of shape {list(self.shape)}, got {list(x.shape)}")
        self._phase = 1
        if not self.compressed:
            return x.clone()
        if self._q.device != x.device:  # follow the gradients (e.g. onto a GPU) once
            self._q = self._q.to(x.device)
            self._residual = None if self._residual is None else self._residual.to(x.device)
        m = x.reshape(self.matrix_shape)
        if self._residual is not None:
            m = m + self._residual
            value_range(m, "powersgd")  # finite parts can still overflow when added
        self._m = m
        return m @ self._q

    def phase2(self, mean_p: torch.Tensor) -> torch.Tensor:
        """The local Q to be averaged, from the all-reduced P."""
        self._expect_phase(1, "phase2")
        if not self.compressed:
            self._mean = self._checked(mean_p, tuple(self.shape), "averaged gradient")
            self._phase = 2
            return torch.empty(0)
        self._p = _orthonormal(self._checked(mean_p, (self.matrix_shape[0], self.rank), "averaged P"))
        self._local_q = self._m.T @ self._p
        self._phase = 2
        return self._local_q.clone()  # the caller may average it in place

    def finish(self, mean_q: torch.Tensor) -> torch.Tensor:
        """The compressed estimate of the mean gradient; commits the residual and Q."""
        self._expect_phase(2, "finish")
        if not self.compressed:
            self._checked(mean_q, (0,), "averaged Q")
            result = self._mean
        else:
            mean_q = self._checked(mean_q, (self.matrix_shape[1], self.rank), "averaged Q")
            result = (self._p @ mean_q.T).reshape(self.shape)
            if not all(map(math.isfinite, torch.aminmax(result.reshape(-1)))):
                raise CompressionError("powersgd: the averaged P and Q multiply to non-finite values")
            if self._residual is not None:
                self._residual = self._m - self._p @ self._local_q.T
            self._q = _orthonormal(mean_q)  # same span, bounded scale for the next P = M Q
        self._phase = 0
        self._m = self._p = self._local_q = self._mean = None
        return result

    def _expect_phase(self, phase: int, call: str) -> None:
        if self._phase != phase:
            raise RuntimeError(f"powersgd: {call} called out of order; a step is phase1, phase2, finish")

    @staticmethod
    def _checked(tensor: object, shape: tuple[int, ...], what: str) -> torch.Tensor:
        """An all-reduced tensor from the network: float, the expected shape, finite."""
        if not isinstance(tensor, torch.Tensor):
            raise CompressionError(f"powersgd: {what} must be a tensor, got {type_name(tensor)}")
        x = check_float_tensor(tensor, "powersgd").to(torch.float32)
        if tuple(x.shape) != shape:
            raise CompressionError(f"powersgd: {what} must have shape {list(shape)}, got {list(x.shape)}")
        if not all_finite(x):
            raise CompressionError(f"powersgd: {what} holds non-finite values")
        return x

    @property
    def wire_elements(self) -> int:
        """Numbers this tensor sends per step (both rounds), against shape.numel() uncompressed."""
        rows, cols = self.matrix_shape
        return self.rank * (rows + cols) if self.compressed else self.shape.numel()


def _orthonormal(matrix: torch.Tensor) -> torch.Tensor:
    """Orthonormal columns spanning `matrix`, by twice-iterated Gram-Schmidt in plain torch.

    Not torch.linalg.qr: LAPACK's threaded QR stalls for milliseconds per call on a busy
    machine. A column that adds no new direction (zero gradient, rank below `rank`) is replaced
    by the standard basis vector that adds most, so the columns are always orthonormal and the
    result is a deterministic function of the input (all peers get the same one).
    """
    rows, cols = matrix.shape
    scale = matrix.abs().max().item() if matrix.numel() else 0.0
    basis = matrix / scale if scale > 0 else torch.zeros_like(matrix)  # entries <= 1: no overflow
    for i in range(cols):
        done = basis[:, :i]
        length = basis[:, i].norm().item()
        column = _project_out(basis[:, i], done)
        norm = column.norm().item()
        if norm <= max(_INDEPENDENT_FRACTION * length, _DEGENERATE_NORM):
            candidates = _project_out(torch.eye(rows, i + 1, dtype=matrix.dtype, device=matrix.device), done)
            column = candidates[:, candidates.norm(dim=0).argmax()]
            norm = column.norm().item()
        basis[:, i] = column / norm
    return basis


def _project_out(vectors: torch.Tensor, done: torch.Tensor) -> torch.Tensor:
    """`vectors` minus their components along the orthonormal columns of `done` (twice, which
    makes the result orthogonal to working precision even after heavy cancellation)."""
    for _ in range(2):
        vectors = vectors - done @ (done.T @ vectors)
    return vectors
