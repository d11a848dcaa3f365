"""Tests for potluck.optim.large_batch: LAMB and LARS against per-parameter references written from
the papers, their trust ratios, resuming from a state_dict, convergence on small problems, the
warmup schedule's values, and refusal of bad hyperparameters."""

from __future__ import annotations

import io
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch

from potluck.optim.large_batch import (
    LAMB,
    LARS,
    WarmupSchedule,
    is_bias_or_norm,
    linear_scaling,
    warmup_linear_scaling,
)

STEPS = 5


# -- references: one parameter at a time, in float64, straight from the papers ---------------------
def reference_lamb(w: torch.Tensor, grads: list[torch.Tensor], adapt: bool, lr: float,
                   betas: tuple[float, float], eps: float, weight_decay: float, clamp_value: float) -> torch.Tensor:
    """You et al. 2019, Algorithm 2, with phi(z) = min(z, clamp_value)."""
    w, m, v = w.double().clone(), torch.zeros_like(w, dtype=torch.float64), torch.zeros_like(w, dtype=torch.float64)
    for t, g in enumerate(grads, start=1):
        g = g.double()
        m = betas[0] * m + (1 - betas[0]) * g
        v = betas[1] * v + (1 - betas[1]) * g * g
        r = (m / (1 - betas[0] ** t)) / ((v / (1 - betas[1] ** t)).sqrt() + eps)
        if not adapt:
            w = w - lr * r
            continue
        u = r + weight_decay * w
        w_norm, u_norm = min(w.norm().item(), clamp_value), u.norm().item()
        ratio = w_norm / u_norm if w_norm > 0 and u_norm > 0 else 1.0
        w = w - lr * ratio * u
    return w


def reference_lars(w: torch.Tensor, grads: list[torch.Tensor], adapt: bool, lr: float, momentum: float,
                   weight_decay: float, trust_coefficient: float, eps: float, nesterov: bool) -> torch.Tensor:
    """You et al. 2017, Algorithm 1 (the learning rate inside the momentum), plus Nesterov."""
    w, v = w.double().clone(), torch.zeros_like(w, dtype=torch.float64)
    for g in grads:
        g = g.double()
        if adapt:
            w_norm, g_norm = w.norm().item(), g.norm().item()
            local_lr = trust_coefficient * w_norm / (g_norm + weight_decay * w_norm + eps) \
                if w_norm > 0 and g_norm > 0 else 1.0
            step = lr * local_lr * (g + weight_decay * w)
        else:
            step = lr * g
        v = momentum * v + step
        w = w - (momentum * v + step if nesterov else v)
    return w


def make_params() -> dict[str, torch.Tensor]:
    """A weight, a bias (1-D, excluded by default), a zero-initialised weight, a large weight
    (over LAMB's clamp) and a weight put in an `adapt=False` group."""
    gen = torch.Generator().manual_seed(0)
    return {"weight": torch.randn(6, 4, generator=gen), "bias": torch.randn(6, generator=gen),
            "zero": torch.zeros(3, 3), "large": 20.0 * torch.randn(5, 5, generator=gen),
            "plain": torch.randn(4, 2, generator=gen)}


def make_grads(params: dict[str, torch.Tensor], seed: int = 1) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [{name: torch.randn(p.shape, generator=gen) for name, p in params.items()} for _ in range(STEPS)]


def build(opt_factory: Callable[[list[dict[str, Any]]], torch.optim.Optimizer],
          params: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], torch.optim.Optimizer]:
    """Copies of `params` that require grad, and an optimizer over them in two groups."""
    live = {name: p.clone().requires_grad_() for name, p in params.items()}
    groups = [{"params": [live[n] for n in ("weight", "bias", "zero", "large")]},
              {"params": [live["plain"]], "adapt": False}]
    return live, opt_factory(groups)


def advance(live: dict[str, torch.Tensor], opt: torch.optim.Optimizer,
            grads: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    for step_grads in grads:
        for name, p in live.items():
            p.grad = step_grads[name].clone()
        opt.step()
    return {name: p.detach().clone() for name, p in live.items()}


def run(opt_factory: Callable[[list[dict[str, Any]]], torch.optim.Optimizer], params: dict[str, torch.Tensor],
        grads: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return advance(*build(opt_factory, params), grads)


def adapted(name: str) -> bool:
    return name in ("weight", "zero", "large")


# -- agreement with the references -----------------------------------------------------------------
@pytest.mark.timeout(10)
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_lamb_matches_per_parameter_reference(weight_decay: float) -> None:
    params, grads = make_params(), make_grads(make_params())
    hp = {"lr": 0.05, "betas": (0.9, 0.99), "eps": 1e-6, "weight_decay": weight_decay, "clamp_value": 10.0}
    result = run(lambda groups: LAMB(groups, **hp), params, grads)
    for name, w in params.items():
        expected = reference_lamb(w, [g[name] for g in grads], adapted(name), **hp)
        torch.testing.assert_close(result[name].double(), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.timeout(10)
@pytest.mark.parametrize(("weight_decay", "nesterov"), [(0.0, False), (0.01, False), (0.01, True)])
def test_lars_matches_per_parameter_reference(weight_decay: float, nesterov: bool) -> None:
    params, grads = make_params(), make_grads(make_params())
    hp = {"lr": 2.0, "momentum": 0.9, "weight_decay": weight_decay, "trust_coefficient": 0.02, "eps": 1e-8,
          "nesterov": nesterov}
    result = run(lambda groups: LARS(groups, **hp), params, grads)
    for name, w in params.items():
        expected = reference_lars(w, [g[name] for g in grads], adapted(name), **hp)
        torch.testing.assert_close(result[name].double(), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.timeout(10)
def test_exclusion_none_adapts_one_dimensional_params_too() -> None:
    bias, grad = torch.full((4,), 3.0), torch.tensor([1.0, -2.0, 0.5, 4.0])
    p = bias.clone().requires_grad_()
    p.grad = grad.clone()
    LAMB([p], lr=0.1, exclude_from_trust_ratio=None).step()
    expected = reference_lamb(bias, [grad], True, 0.1, (0.9, 0.999), 1e-6, 0.0, 10.0)
    torch.testing.assert_close(p.detach().double(), expected)
    assert is_bias_or_norm(bias) and not is_bias_or_norm(torch.zeros(2, 2))


# -- trust ratio ---------------------------------------------------------------------------------
def one_step(opt_cls: type, w: torch.Tensor, g: torch.Tensor, **hp: Any) -> torch.Tensor:
    """The change one step makes to `w` (a fresh optimizer, so its first step)."""
    p = w.clone().requires_grad_()
    p.grad = g.clone()
    opt_cls([p], **hp).step()
    return p.detach() - w


@pytest.mark.timeout(10)
def test_zero_weights_take_the_plain_step() -> None:
    w, g = torch.zeros(4, 3), torch.linspace(-1.0, 1.0, 12).reshape(4, 3)
    # LAMB's first step is lr * g / (|g| + eps): trust ratio 1, not ||w|| / ||u|| = 0.
    torch.testing.assert_close(one_step(LAMB, w, g, lr=0.1), -0.1 * g / (g.abs() + 1e-6))
    torch.testing.assert_close(one_step(LARS, w, g, lr=0.1), -0.1 * g)
    # A zero gradient leaves the weights alone (ratio 1 times a zero update, no NaN).
    assert torch.equal(one_step(LARS, torch.ones(2, 2), torch.zeros(2, 2), lr=0.1), torch.zeros(2, 2))
    assert torch.equal(one_step(LAMB, torch.ones(2, 2), torch.zeros(2, 2), lr=0.1), torch.zeros(2, 2))


@pytest.mark.timeout(10)
@pytest.mark.parametrize("scale", [0.01, 0.5, 1.0])  # ||w|| stays under the clamp (10)
def test_lamb_step_length_is_lr_times_weight_norm(scale: float) -> None:
    gen = torch.Generator().manual_seed(2)
    w, g = scale * torch.randn(8, 8, generator=gen), torch.randn(8, 8, generator=gen)
    # The update u is scaled by ||w|| / ||u||, so the step's length is lr * ||w|| whatever g is.
    change = one_step(LAMB, w, g, lr=0.01, weight_decay=0.1)
    assert change.norm().item() == pytest.approx(0.01 * w.norm().item(), rel=1e-5)


@pytest.mark.timeout(10)
def test_lamb_weight_norm_is_clamped() -> None:
    gen = torch.Generator().manual_seed(3)
    w, g = torch.randn(8, 8, generator=gen), torch.randn(8, 8, generator=gen)
    w *= 50.0 / w.norm()
    change = one_step(LAMB, w, g, lr=0.01, clamp_value=10.0)
    assert change.norm().item() == pytest.approx(0.01 * 10.0, rel=1e-5)


@pytest.mark.timeout(10)
def test_lars_step_length_is_lr_times_trust_coefficient_times_weight_norm() -> None:
    gen = torch.Generator().manual_seed(4)
    w, g = 3.0 * torch.randn(8, 8, generator=gen), 100.0 * torch.randn(8, 8, generator=gen)
    change = one_step(LARS, w, g, lr=0.5, momentum=0.0, trust_coefficient=0.001)
    assert change.norm().item() == pytest.approx(0.5 * 0.001 * w.norm().item(), rel=1e-5)
    # The direction is the gradient's.
    cosine = torch.nn.functional.cosine_similarity(change.flatten(), -g.flatten(), dim=0)
    assert cosine.item() == pytest.approx(1.0, abs=1e-6)


@pytest.mark.timeout(10)
def test_excluded_params_get_no_weight_decay_and_no_trust_ratio() -> None:
    bias, grad = torch.full((4,), 100.0), torch.tensor([1.0, -2.0, 0.5, 4.0])
    # Plain Adam's first step, ignoring both the large norm and the weight decay.
    torch.testing.assert_close(one_step(LAMB, bias, grad, lr=0.1, weight_decay=0.5),
                               -0.1 * grad / (grad.abs() + 1e-6))
    torch.testing.assert_close(one_step(LARS, bias, grad, lr=0.1, weight_decay=0.5), -0.1 * grad)


# -- state_dict ------------------------------------------------------------------------------------
@pytest.mark.timeout(10)
@pytest.mark.parametrize("opt_factory", [
    lambda groups: LAMB(groups, lr=0.05, weight_decay=0.01),
    lambda groups: LARS(groups, lr=1.0, weight_decay=0.01, nesterov=True),
], ids=["lamb", "lars"])
def test_state_dict_round_trip_resumes_identically(opt_factory: Callable) -> None:
    params = make_params()
    live, opt = build(opt_factory, params)
    first = advance(live, opt, make_grads(params))
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    buffer.seek(0)
    later = make_grads(params, seed=7)
    # A fresh optimizer over copies of the parameters loads the saved state ...
    live2, resumed_opt = build(opt_factory, first)
    resumed_opt.load_state_dict(torch.load(buffer))
    resumed = advance(live2, resumed_opt, later)
    # ... and lands exactly where the original does when it goes on.
    expected = advance(live, opt, later)
    for name in params:
        assert torch.equal(resumed[name], expected[name])
    # Loading the state matters: a fresh optimizer lands elsewhere.
    fresh = run(opt_factory, first, later)
    assert not torch.equal(fresh["weight"], expected["weight"])


@pytest.mark.timeout(10)
def test_scheduler_state_dict_round_trip_resumes_the_schedule() -> None:
    def make() -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
        opt = LAMB([torch.zeros(2, 2, requires_grad=True)])
        return opt, warmup_linear_scaling(opt, 0.1, 32, 256, warmup_steps=4, total_steps=10, decay="cosine")
    opt, sched = make()
    for _ in range(6):
        opt.step()
        sched.step()
    opt2, sched2 = make()
    opt2.load_state_dict(opt.state_dict())
    sched2.load_state_dict(sched.state_dict())
    assert sched2.last_epoch == 6
    for o, s in ((opt, sched), (opt2, sched2)):
        o.step()
        s.step()
    assert opt2.param_groups[0]["lr"] == pytest.approx(opt.param_groups[0]["lr"])
    assert opt2.param_groups[0]["lr"] == pytest.approx(WarmupSchedule(0.1, 0.8, 4, 10, "cosine").lr_at(7))


# -- convergence -----------------------------------------------------------------------------------
def train(model: torch.nn.Module, opt: torch.optim.Optimizer, loss_fn: Callable[[], torch.Tensor],
          steps: int) -> tuple[float, float]:
    first = loss_fn().item()
    for _ in range(steps):
        opt.zero_grad()
        loss = loss_fn()
        loss.backward()
        opt.step()
    return first, loss_fn().item()


@pytest.mark.timeout(15)
def test_lamb_fits_a_regression_problem() -> None:
    torch.manual_seed(0)
    x = torch.randn(256, 10)
    y = x @ torch.randn(10, 1) + 0.01 * torch.randn(256, 1)
    model = torch.nn.Sequential(torch.nn.Linear(10, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    opt = LAMB(model.parameters(), lr=0.02, weight_decay=0.01)
    first, last = train(model, opt, lambda: torch.nn.functional.mse_loss(model(x), y), steps=200)
    assert last < 0.05 * first


@pytest.mark.timeout(15)
def test_lars_fits_a_classification_problem() -> None:
    torch.manual_seed(0)
    x = torch.randn(256, 2)
    labels = ((x[:, 0] * x[:, 1]) > 0).long()  # XOR of the signs: needs the hidden layer
    model = torch.nn.Sequential(torch.nn.Linear(2, 32), torch.nn.ReLU(), torch.nn.Linear(32, 2))
    opt = LARS(model.parameters(), lr=1.0, momentum=0.9, weight_decay=1e-4, trust_coefficient=0.001)
    first, last = train(model, opt, lambda: torch.nn.functional.cross_entropy(model(x), labels), steps=300)
    assert last < 0.2 * first
    assert (model(x).argmax(1) == labels).float().mean().item() > 0.95


# -- linear scaling and warmup ----------------------------------------------------------------------
@pytest.mark.timeout(10)
def test_linear_scaling_rule() -> None:
    assert linear_scaling(0.1, 256, 8192) == pytest.approx(3.2)
    assert linear_scaling(0.1, 256, 256) == pytest.approx(0.1)
    assert linear_scaling(0.1, 256, 64) == pytest.approx(0.025)


def lrs_at(steps: list[int], **kwargs: Any) -> list[float]:
    """The optimizer's learning rate after each number of scheduler steps."""
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=123.0)
    sched = warmup_linear_scaling(opt, **kwargs)
    seen, done = [], 0
    for target in steps:
        for _ in range(target - done):
            opt.step()
            sched.step()
        done = target
        seen.append(opt.param_groups[0]["lr"])
    return seen


SCHEDULE = {"base_lr": 0.1, "base_batch_size": 256, "batch_size": 4096, "warmup_steps": 10}  # peak 1.6


@pytest.mark.timeout(10)
@pytest.mark.parametrize(("decay", "middle", "end"), [("none", 1.6, 1.6), ("cosine", 0.8, 0.0), ("linear", 0.8, 0.0)])
def test_warmup_schedule_values(decay: str, middle: float, end: float) -> None:
    # Steps 0, warmup/2, warmup, halfway through the decay, total_steps and past it.
    got = lrs_at([0, 5, 10, 20, 30, 35], total_steps=30, decay=decay, **SCHEDULE)
    assert got == pytest.approx([0.1, 0.85, 1.6, middle, end, end], abs=1e-9)


@pytest.mark.timeout(10)
def test_warmup_from_a_small_start_and_without_warmup() -> None:
    assert lrs_at([0, 5, 10], start_lr=0.0, **SCHEDULE) == pytest.approx([0.0, 0.8, 1.6])
    no_warmup = {**SCHEDULE, "warmup_steps": 0}
    assert lrs_at([0, 3], **no_warmup) == pytest.approx([1.6, 1.6])
    cosine = lrs_at([0, 5, 10], total_steps=10, decay="cosine", **no_warmup)
    assert cosine == pytest.approx([1.6, 0.8, 0.0], abs=1e-9)


@pytest.mark.timeout(10)
def test_warmup_sets_every_group() -> None:
    a, b = torch.zeros(2, 2, requires_grad=True), torch.zeros(2, requires_grad=True)
    opt = LAMB([{"params": [a], "lr": 5.0}, {"params": [b], "lr": 0.5, "adapt": False}])
    warmup_linear_scaling(opt, 0.1, 256, 512, warmup_steps=2)
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([0.1, 0.1])


# -- refusal ----------------------------------------------------------------------------------------
def p() -> list[torch.Tensor]:
    return [torch.zeros(2, 2, requires_grad=True)]


@pytest.mark.timeout(10)
@pytest.mark.parametrize(("make", "message"), [
    (lambda: LAMB(p(), lr=-1.0), "lr"),
    (lambda: LAMB(p(), lr=math.nan), "lr"),
    (lambda: LAMB(p(), betas=(1.0, 0.999)), "betas"),
    (lambda: LAMB(p(), betas=(0.9, -0.1)), "betas"),
    (lambda: LAMB(p(), betas=(0.9,)), "betas"),
    (lambda: LAMB(p(), eps=0.0), "eps"),
    (lambda: LAMB(p(), weight_decay=-0.1), "weight_decay"),
    (lambda: LAMB(p(), clamp_value=0.0), "clamp_value"),
    (lambda: LAMB(p(), exclude_from_trust_ratio="bias"), "exclude_from_trust_ratio"),
    (lambda: LAMB([{"params": p(), "lr": -0.5}]), "lr"),
    (lambda: LARS(p(), lr=-0.1), "lr"),
    (lambda: LARS(p(), lr=0.1, momentum=1.0), "momentum"),
    (lambda: LARS(p(), lr=0.1, momentum=-0.5), "momentum"),
    (lambda: LARS(p(), lr=0.1, weight_decay=-1.0), "weight_decay"),
    (lambda: LARS(p(), lr=0.1, trust_coefficient=0.0), "trust_coefficient"),
    (lambda: LARS(p(), lr=0.1, eps=-1e-8), "eps"),
    (lambda: LARS(p(), lr=0.1, momentum=0.0, nesterov=True), "nesterov"),
    (lambda: LARS([{"params": p(), "momentum": 2.0}], lr=0.1), "momentum"),
    (lambda: linear_scaling(0.0, 256, 512), "base_lr"),
    (lambda: linear_scaling(0.1, 0, 512), "base_batch_size"),
    (lambda: linear_scaling(0.1, 256, -1), "batch_size"),
    (lambda: warmup_linear_scaling(LAMB(p()), 0.1, 256, 512, warmup_steps=-1), "warmup_steps"),
    (lambda: warmup_linear_scaling(LAMB(p()), 0.1, 256, 512, warmup_steps=1.5), "warmup_steps"),
    (lambda: warmup_linear_scaling(LAMB(p()), 0.1, 256, 512, 5, decay="step"), "decay"),
    (lambda: warmup_linear_scaling(LAMB(p()), 0.1, 256, 512, 5, decay="cosine"), "total_steps"),
    (lambda: warmup_linear_scaling(LAMB(p()), 0.1, 256, 512, 5, total_steps=5, decay="linear"), "total_steps"),
    (lambda: warmup_linear_scaling(LAMB(p()), 0.1, 256, 512, 5, total_steps=0), "total_steps"),
    (lambda: warmup_linear_scaling(LAMB(p()), 0.1, 256, 512, 5, start_lr=-0.1), "start_lr"),
])
def test_invalid_arguments_are_refused(make: Callable[[], Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make()


@pytest.mark.timeout(10)
def test_sparse_gradients_are_refused() -> None:
    for opt_cls, hp in ((LAMB, {}), (LARS, {"lr": 0.1})):
        w = torch.zeros(3, 2, requires_grad=True)
        w.grad = torch.zeros(3, 2).to_sparse()
        with pytest.raises(RuntimeError, match="sparse"):
            opt_cls([w], **hp).step()
