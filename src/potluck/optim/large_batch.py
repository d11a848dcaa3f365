"""Large-batch tools: the LAMB and LARS optimizers and the linear learning-rate scaling rule with
warmup, for collaborative runs whose global batch (`target_batch_size`) is far larger than the
batch a recipe was tuned for. See docs/large_batch.md for when to use which.

Both optimizers scale each layer's step by a trust ratio, so that the layer moves by a set fraction
of its own size (times the learning rate) whatever the size of its gradient. Imports torch only.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch.optim.lr_scheduler import LambdaLR

# LAMB's upper bound on the weight norm in the trust ratio (phi in You et al. 2019): it keeps a
# layer with very large weights from taking a very large step. 10 is the value used by the common
# public implementations of the paper (and no bound is needed below: phi(0) = 0 falls back to 1).
LAMB_CLAMP_VALUE = 10.0
# LARS's trust coefficient eta, the usual default of LARS implementations: at lr=1 one step moves
# an adapted layer by about 0.1% of its norm.
LARS_TRUST_COEFFICIENT = 0.001
DECAYS = ("none", "cosine", "linear")


def is_bias_or_norm(param: torch.Tensor) -> bool:
    """True for 1-D (and 0-D) parameters: biases and normalization scales/shifts.

    They are few, their norm says nothing about the layer's scale, and decaying them hurts, so by
    convention (the large-batch ImageNet and BERT recipes) they get neither weight decay nor a
    trust ratio.
    """
    return param.ndim <= 1


ParamFilter = Callable[[torch.Tensor], bool]



def _evaluate(closure: Callable[[], Any] | None) -> Any:
    """The closure's loss, computed with gradients on (as torch optimizers do), or None."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()

class _LayerwiseOptimizer(torch.optim.Optimizer):
    """What LAMB and LARS share: validation of every group and the choice of adapted parameters.

    A parameter is adapted (weight decay + trust ratio) when its group has `adapt=True` and
    `exclude_from_trust_ratio(param)` is false; otherwise it takes the plain Adam/SGD step.
    """

    def __init__(self, params: Iterable[Any], defaults: dict[str, Any],
                 exclude_from_trust_ratio: ParamFilter | None):
        if exclude_from_trust_ratio is not None and not callable(exclude_from_trust_ratio):
            raise ValueError("exclude_from_trust_ratio must be a callable param -> bool, or None")
        # Not a group option: a function does not belong in state_dict; the constructor restores it.
        self.exclude_from_trust_ratio = exclude_from_trust_ratio
        super().__init__(params, {**defaults, "adapt": True})

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        # Checked here rather than in __init__ so that per-group overrides are refused too.
        self._check_group({**self.defaults, **param_group})
        super().add_param_group(param_group)

    def _check_group(self, group: dict[str, Any]) -> None:
        raise NotImplementedError

    def _adapts(self, group: dict[str, Any], param: torch.Tensor) -> bool:
        excluded = self.exclude_from_trust_ratio is not None and self.exclude_from_trust_ratio(param)
        return bool(group["adapt"]) and not excluded

    def _params_with_grad(self, group: dict[str, Any]) -> list[torch.Tensor]:
        params = [p for p in group["params"] if p.grad is not None]
        if any(p.grad.is_sparse for p in params):
            raise RuntimeError(f"{type(self).__name__} does not support sparse gradients")
        return params


class LAMB(_LayerwiseOptimizer):
    """LAMB (You et al. 2019, "Large Batch Optimization for Deep Learning", Algorithm 2).

    Adam whose per-layer step (the Adam direction plus decoupled weight decay) is rescaled to
    `lr * min(||w||, clamp_value)`: Adam's tuned learning rate then survives batch sizes in the
    tens of thousands (BERT pre-training in 76 minutes). Use it where you would use Adam/AdamW.

    Args:
        params: parameters or param groups; a group may set `adapt=False` to take plain Adam steps.
        lr, betas, eps: as for Adam (eps is added to the square root of the second moment).
        weight_decay: decoupled decay, added to the direction before the trust ratio.
        clamp_value: upper bound on the weight norm in the trust ratio.
        exclude_from_trust_ratio: parameters it returns True for get no weight decay and no trust
            ratio; by default biases and norm layers (1-D). None adapts every parameter.
    """

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-6, weight_decay: float = 0.0, clamp_value: float = LAMB_CLAMP_VALUE,
                 exclude_from_trust_ratio: ParamFilter | None = is_bias_or_norm):
        defaults = {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay,
                    "clamp_value": clamp_value}
        super().__init__(params, defaults, exclude_from_trust_ratio)

    def _check_group(self, group: dict[str, Any]) -> None:
        _check_nonnegative("lr", group["lr"])
        betas = group["betas"]
        if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"betas must be two numbers in [0, 1), not {betas!r}")
        _check_positive("eps", group["eps"])
        _check_nonnegative("weight_decay", group["weight_decay"])
        _check_positive("clamp_value", group["clamp_value"])

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One LAMB step for every parameter with a gradient; returns the closure's loss."""
        loss = _evaluate(closure)
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in self._params_with_grad(group):
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] += 1
                m, v = state["exp_avg"], state["exp_avg_sq"]
                m.lerp_(p.grad, 1.0 - beta1)
                v.mul_(beta2).addcmul_(p.grad, p.grad, value=1.0 - beta2)
                # The bias-corrected Adam direction m_hat / (sqrt(v_hat) + eps).
                m_hat = m / (1.0 - beta1 ** state["step"])
                v_hat = v / (1.0 - beta2 ** state["step"])
                update = m_hat / v_hat.sqrt().add_(group["eps"])
                if self._adapts(group, p):
                    update.add_(p, alpha=group["weight_decay"])
                    weight_norm = p.norm().clamp(max=group["clamp_value"])
                    update.mul_(_ratio_or_one(weight_norm, update.norm()))
                p.add_(update, alpha=-group["lr"])
        return loss


class LARS(_LayerwiseOptimizer):
    """LARS (You et al. 2017, "Large Batch Training of Convolutional Networks", Algorithm 1).

    SGD with momentum whose per-layer learning rate is `lr * trust_coefficient * ||w|| /
    (||g|| + weight_decay * ||w||)`: every adapted layer moves by about `lr * trust_coefficient *
    ||w||` per step whatever its gradient's size, so the layers whose gradients are large next to
    their weights (the cause of divergence at large batch) no longer set the usable rate. Use it
    where you would use SGD with momentum, e.g. conv nets. Excluded parameters take plain SGD
    steps with `lr`, so `lr` must suit them too.

    Args:
        params: parameters or param groups; a group may set `adapt=False` to take plain SGD steps.
        lr: the global learning rate (gamma in the paper); required.
        momentum, nesterov: as for SGD; the learning rate sits inside the momentum buffer.
        weight_decay: L2 decay (beta in the paper), added to the gradient.
        trust_coefficient: eta, how far one step may move a layer relative to its norm.
        eps: keeps the denominator of the trust ratio away from zero.
        exclude_from_trust_ratio: as for `LAMB`; by default biases and norm layers.
    """

    def __init__(self, params: Iterable[Any], lr: float, momentum: float = 0.9, weight_decay: float = 0.0,
                 trust_coefficient: float = LARS_TRUST_COEFFICIENT, eps: float = 1e-8, nesterov: bool = False,
                 exclude_from_trust_ratio: ParamFilter | None = is_bias_or_norm):
        defaults = {"lr": lr, "momentum": momentum, "weight_decay": weight_decay,
                    "trust_coefficient": trust_coefficient, "eps": eps, "nesterov": nesterov}
        super().__init__(params, defaults, exclude_from_trust_ratio)

    def _check_group(self, group: dict[str, Any]) -> None:
        _check_nonnegative("lr", group["lr"])
        if not 0.0 <= group["momentum"] < 1.0:
            raise ValueError(f"momentum must be in [0, 1), not {group['momentum']!r}")
        _check_nonnegative("weight_decay", group["weight_decay"])
        _check_positive("trust_coefficient", group["trust_coefficient"])
        _check_nonnegative("eps", group["eps"])
        if group["nesterov"] and group["momentum"] == 0.0:
            raise ValueError("nesterov needs a positive momentum")

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One LARS step for every parameter with a gradient; returns the closure's loss."""
        loss = _evaluate(closure)
        for group in self.param_groups:
            momentum = group["momentum"]
            for p in self._params_with_grad(group):
                if self._adapts(group, p):
                    weight_norm, grad_norm = p.norm(), p.grad.norm()
                    local_lr = _ratio_or_one(
                        group["trust_coefficient"] * weight_norm,
                        grad_norm + group["weight_decay"] * weight_norm + group["eps"],
                        defined=(weight_norm > 0) & (grad_norm > 0))
                    update = p.grad.add(p, alpha=group["weight_decay"]).mul_(local_lr * group["lr"])
                else:
                    update = p.grad.mul(group["lr"])
                if momentum > 0.0:
                    state = self.state[p]
                    if "momentum_buffer" not in state:
                        state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    buffer = state["momentum_buffer"].mul_(momentum).add_(update)
                    update = update.add_(buffer, alpha=momentum) if group["nesterov"] else buffer
                p.sub_(update)
        return loss


def _ratio_or_one(numerator: torch.Tensor, denominator: torch.Tensor,
                  defined: torch.Tensor | None = None) -> torch.Tensor:
    """numerator / denominator, or 1 where undefined (by default: either is zero).

    A zero-initialised layer, or a zero update, has no scale to adapt to, so it takes the plain
    step. Stays a tensor so that no step waits on the GPU.
    """
    if defined is None:
        defined = (numerator > 0) & (denominator > 0)
    return torch.where(defined, numerator / denominator, torch.ones_like(numerator))


def _check_positive(name: str, value: float) -> None:
    if not value > 0.0:
        raise ValueError(f"{name} must be positive, not {value!r}")


def _check_nonnegative(name: str, value: float) -> None:
    if not value >= 0.0:
        raise ValueError(f"{name} must be non-negative, not {value!r}")


def linear_scaling(base_lr: float, base_batch_size: int, batch_size: int) -> float:
    """The linear scaling rule (Goyal et al. 2017): k times the batch, k times the learning rate.

    `base_lr` is the rate a recipe was tuned with at `base_batch_size`; in potluck `batch_size` is
    the global batch, `target_batch_size`. It holds up to some batch size that depends on the
    model and data (8k for ResNet-50 on ImageNet), not beyond.
    """
    _check_positive("base_lr", base_lr)
    _check_positive("base_batch_size", base_batch_size)
    _check_positive("batch_size", batch_size)
    return base_lr * batch_size / base_batch_size


@dataclass
class WarmupSchedule:
    """The learning rate after `step` scheduler steps: a linear ramp from `start_lr` to `peak_lr`
    over `warmup_steps`, then constant (decay "none") or down to zero at `total_steps`.

    A callable object rather than a closure so that `LambdaLR.state_dict()` saves it.
    """

    start_lr: float
    peak_lr: float
    warmup_steps: int
    total_steps: int | None = None
    decay: str = "none"

    def lr_at(self, step: int) -> float:
        if step < self.warmup_steps:
            return self.start_lr + (self.peak_lr - self.start_lr) * step / self.warmup_steps
        if self.decay == "none" or self.total_steps is None:
            return self.peak_lr
        progress = min(1.0, (step - self.warmup_steps) / (self.total_steps - self.warmup_steps))
        if self.decay == "cosine":
            return self.peak_lr * 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.peak_lr * (1.0 - progress)

    def __call__(self, step: int) -> float:
        """The factor on `peak_lr` that `LambdaLR` expects."""
        return self.lr_at(step) / self.peak_lr


def warmup_linear_scaling(optimizer: torch.optim.Optimizer, base_lr: float, base_batch_size: int,
                          batch_size: int, warmup_steps: int, total_steps: int | None = None,
                          decay: str = "none", start_lr: float | None = None) -> LambdaLR:
    """A scheduler for the linear scaling rule with gradual warmup (Goyal et al. 2017).

    The full scaled rate is too large for the first steps, while weights change fast; ramping up
    to it over `warmup_steps` avoids the early divergence. The rate starts at `start_lr` (default
    `base_lr`, as in the paper; pass a small fraction of it for a gentler start), reaches
    `linear_scaling(base_lr, base_batch_size, batch_size)` after `warmup_steps` steps, and then
    stays there (`decay="none"`) or falls to zero at `total_steps` ("cosine" or "linear").

    Steps count `scheduler.step()` calls. `potluck.Optimizer` steps its scheduler once per
    collaborative epoch, i.e. once per global batch of `target_batch_size` samples, so give
    `warmup_steps` and `total_steps` in global batches and pass `batch_size=target_batch_size`.

    Every param group gets this same rate (their current `lr` is overwritten).
    """
    if decay not in DECAYS:
        raise ValueError(f"decay must be one of {DECAYS}, not {decay!r}")
    if not isinstance(warmup_steps, int) or warmup_steps < 0:
        raise ValueError(f"warmup_steps must be a non-negative int, not {warmup_steps!r}")
    if decay != "none" and (total_steps is None or total_steps <= warmup_steps):
        raise ValueError(f"decay {decay!r} needs total_steps > warmup_steps, not {total_steps!r}")
    if total_steps is not None and total_steps <= 0:
        raise ValueError(f"total_steps must be positive, not {total_steps!r}")
    peak_lr = linear_scaling(base_lr, base_batch_size, batch_size)
    start_lr = base_lr if start_lr is None else start_lr
    _check_nonnegative("start_lr", start_lr)
    schedule = WarmupSchedule(start_lr, peak_lr, warmup_steps, total_steps, decay)
    for group in optimizer.param_groups:
        # LambdaLR multiplies initial_lr by the schedule's factor, so both start at the peak.
        group["lr"] = group["initial_lr"] = peak_lr
    return LambdaLR(optimizer, schedule)
