"""Independent moment estimation (docs/explanation/server-optimizers.md): the joint query [Σu ; α·Σu²], its sensitivity,
the noise it gets, and the replace-one "for free" thresholds, which are re-derived NUMERICALLY here
(dense grid search in 1-D, random-restart constrained optimization in 2-D and 3-D) instead of trusted.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy.optimize import minimize

from fed_dp.config import PrivacyConfig
from fed_dp.moment_estimation import (
    free_threshold,
    joint_privatizer,
    joint_sensitivity,
    noise_stds,
    split_query,
    stack_query,
)
from fed_dp.noise import Privatizer, make_privatizer
from fed_dp.sampling import NeighboringRelation

ADD_REMOVE = NeighboringRelation.ADD_OR_REMOVE_ONE
REPLACE = NeighboringRelation.REPLACE_ONE
F64 = torch.float64


# --- noise scales ------------------------------------------------------------------------------------
@pytest.mark.parametrize("sigma, clip, alpha, dim", [(1.1, 0.5, 2.0, 10), (0.7, 3.0, 0.1, 1), (2.0, 1.0, 5.0, 1000)])
def test_noise_stds_add_remove(sigma, clip, alpha, dim):
    first = sigma * clip * math.sqrt(1 + alpha**2 * clip**2)
    got = noise_stds(sigma, clip, alpha, ADD_REMOVE, dim)
    assert got[0] == pytest.approx(first, rel=1e-14)
    assert got[1] == pytest.approx(first / alpha, rel=1e-14)


def test_noise_stds_replace_one_below_threshold_is_that_of_the_first_moment_alone():
    """Config σ means std σζ on Σu alone (sensitivity 2ζ under replace-one, accounted as Gaussian(σ/2)).
    In the free regime Δ = 2ζ, so the joint query needs exactly that same σζ on Σu."""
    sigma, clip = 1.3, 0.8
    alpha = 0.9 * math.sqrt(0.5) / clip  # α²ζ² = 0.405 < 1/2
    got = noise_stds(sigma, clip, alpha, REPLACE, 5)
    assert got == pytest.approx((sigma * clip, sigma * clip / alpha), rel=1e-14)


def test_noise_stds_replace_one_above_threshold_keeps_the_noise_to_sensitivity_ratio():
    sigma, clip, alpha = 1.3, 0.8, 2.0  # α²ζ² = 2.56 > 1/2
    delta = 2 * clip * math.sqrt(1 + alpha**2 * clip**2)
    got = noise_stds(sigma, clip, alpha, REPLACE, 5)
    assert got[0] / delta == pytest.approx((sigma * clip) / (2 * clip), rel=1e-14)  # = σ/2, the accounted multiplier


def test_stacked_query_noise_has_sigma_delta_and_sigma_delta_over_alpha():
    """Monte Carlo: the noise on the two halves after split_query has std σΔ and σΔ/α.

    5-sigma bound on a sample std of n i.i.d. Gaussians: |s/σ − 1| < 5/sqrt(2n)."""
    dim, sigma, clip, alpha = 100_000, 1.2, 0.6, 2.5
    gen = torch.Generator().manual_seed(51)
    users = torch.randn(8, dim, generator=gen, dtype=F64) * 0.01
    total, total_sq = users.sum(0), users.square().sum(0)
    std_first, std_second = noise_stds(sigma, clip, alpha, ADD_REMOVE, dim)
    privatizer = Privatizer(None, noise_std=std_first, dim=2 * dim, seed=52, dtype=F64)
    noisy = privatizer.privatize(stack_query(total, total_sq, alpha))
    first, second = split_query(noisy, alpha)
    noise_first, noise_second = first - total, second - total_sq
    bound = 5 / math.sqrt(2 * dim)
    delta = clip * math.sqrt(1 + alpha**2 * clip**2)
    assert abs(noise_first.std().item() / (sigma * delta) - 1) < bound
    assert abs(noise_second.std().item() / (sigma * delta / alpha) - 1) < bound
    assert abs(noise_first.mean().item()) < 5 * sigma * delta / math.sqrt(dim)
    # the two halves' noises are independent
    corr = torch.corrcoef(torch.stack([noise_first, noise_second]))[0, 1].item()
    assert abs(corr) < 5 / math.sqrt(dim)


def test_stack_and_split_round_trip_and_validate():
    gen = torch.Generator().manual_seed(53)
    a, b = torch.randn(7, generator=gen, dtype=F64), torch.rand(7, generator=gen, dtype=F64)
    stacked = stack_query(a, b, 3.0)
    assert stacked.shape == (14,)
    assert torch.equal(stacked[:7], a) and torch.allclose(stacked[7:], 3.0 * b, rtol=1e-15, atol=0)
    first, second = split_query(stacked, 3.0)
    assert torch.equal(first, a) and torch.allclose(second, b, rtol=1e-15, atol=0)
    with pytest.raises(ValueError):
        stack_query(a, b[:6], 3.0)
    with pytest.raises(ValueError):
        split_query(torch.ones(7), 3.0)
    with pytest.raises(ValueError, match="alpha"):
        stack_query(a, b, 0.0)


# --- sensitivity under add/remove ----------------------------------------------------------------------
@pytest.mark.parametrize("dim", [1, 3, 50])
def test_add_remove_sensitivity_bounds_every_contribution_and_is_attained(dim):
    clip, alpha = 0.7, 1.9
    delta = joint_sensitivity(clip, alpha, ADD_REMOVE, dim)
    assert delta == pytest.approx(clip * math.sqrt(1 + alpha**2 * clip**2), rel=1e-14)
    gen = torch.Generator().manual_seed(54 + dim)
    directions = torch.randn(20_000, dim, generator=gen, dtype=F64)
    # random norms in [0, ζ], plus concentrated (axis-aligned) vectors, the worst case for ‖u²‖
    norms = clip * torch.rand(20_000, 1, generator=gen, dtype=F64)
    u = directions / directions.norm(dim=1, keepdim=True) * norms
    u = torch.cat([u, clip * torch.eye(dim, dtype=F64)])
    joint = torch.sqrt(u.square().sum(1) + alpha**2 * u.square().square().sum(1))
    assert joint.max().item() <= delta * (1 + 1e-12)
    # attained by u = ζ·e₁ (the last rows)
    assert joint[-dim:].max().item() == pytest.approx(delta, rel=1e-12)


# --- the replace-one "for free" thresholds, re-derived numerically ---------------------------------------
def _max_1d(a: float, clip: float, points: int = 2001) -> float:
    """max over u, u' ∈ [−ζ, ζ] of (u − u')² + α²(u² − u'²)² on a dense grid (a = α²ζ²)."""
    u = np.linspace(-clip, clip, points)
    U, V = np.meshgrid(u, u)
    alpha2 = a / clip**2
    return float(((U - V) ** 2 + alpha2 * (U**2 - V**2) ** 2).max())


def _max_multi_d(a: float, clip: float, dim: int, restarts: int, seed: int) -> float:
    """Random-restart SLSQP for max over ‖u‖, ‖u'‖ ≤ ζ of ‖u − u'‖² + α²‖u² − u'²‖² (a = α²ζ²).

    Each optimum is projected back onto the balls before it is evaluated, so constraint slack in the
    solver can never inflate the maximum."""
    rng = np.random.default_rng(seed)
    alpha2 = a / clip**2

    def value(x: np.ndarray) -> float:
        u, v = x[:dim], x[dim:]
        return float(((u - v) ** 2).sum() + alpha2 * ((u**2 - v**2) ** 2).sum())

    constraints = [
        {"type": "ineq", "fun": lambda x: clip**2 - (x[:dim] ** 2).sum()},
        {"type": "ineq", "fun": lambda x: clip**2 - (x[dim:] ** 2).sum()},
    ]
    best = 0.0
    for _ in range(restarts):
        start = rng.uniform(-clip, clip, 2 * dim)
        result = minimize(lambda x: -value(x), start, method="SLSQP", constraints=constraints)
        x = result.x.copy()
        for half in (slice(0, dim), slice(dim, 2 * dim)):
            norm = np.linalg.norm(x[half])
            if norm > clip:
                x[half] *= clip / norm
        best = max(best, value(x))
    return best


CLIP = 0.7


def test_free_threshold_is_tight_in_one_dimension():
    tau = free_threshold(1)
    at = _max_1d(tau, CLIP)
    above = _max_1d(1.05 * tau, CLIP)
    assert at <= 4 * CLIP**2 * (1 + 1e-6), "joint sensitivity 2ζ is not valid at the threshold"
    assert above > 4 * CLIP**2 * (1 + 1e-3), "the threshold is not tight: 5% above it is still free"
    # and the larger (triangle) bound really upper-bounds the max above the threshold
    assert above <= joint_sensitivity(CLIP, math.sqrt(1.05 * tau) / CLIP, REPLACE, 1) ** 2 * (1 + 1e-12)


@pytest.mark.parametrize("dim", [2, 3])
def test_free_threshold_is_tight_in_several_dimensions(dim):
    tau = free_threshold(dim)
    at = _max_multi_d(tau, CLIP, dim, restarts=60, seed=60 + dim)
    above = _max_multi_d(1.05 * tau, CLIP, dim, restarts=60, seed=70 + dim)
    assert at <= 4 * CLIP**2 * (1 + 1e-6), "joint sensitivity 2ζ is not valid at the threshold"
    assert above > 4 * CLIP**2 * (1 + 1e-4), "the threshold is not tight: 5% above it is still free"
    assert above <= joint_sensitivity(CLIP, math.sqrt(1.05 * tau) / CLIP, REPLACE, dim) ** 2 * (1 + 1e-12)


@pytest.mark.parametrize("a", [0.5, 0.525, 0.75, 1.0, 2.0])
def test_explicit_worst_pair_in_two_dimensions(a):
    """A closed-form witness for d ≥ 2: u = ζ(c, −s), u' = ζ(−s, c) gives ζ²·(2 + 2·sin 2φ + 2a·cos² 2φ),
    maximized at sin 2φ = 1/(2a) to ζ²·(2 + 2a + 1/(2a)) for a ≥ 1/2, which equals 4ζ² exactly at a = 1/2
    and exceeds it above. (The pair u = ζe₁, u' = ζe₂ only gives ζ²·(2 + 2a), free up to a = 1.)"""
    phi = 0.5 * math.asin(1 / (2 * a))
    c, s = math.cos(phi), math.sin(phi)
    u, v = CLIP * np.array([c, -s]), CLIP * np.array([-s, c])
    value = ((u - v) ** 2).sum() + a / CLIP**2 * ((u**2 - v**2) ** 2).sum()
    assert value == pytest.approx(CLIP**2 * (2 + 2 * a + 1 / (2 * a)), rel=1e-12)
    assert (value <= 4 * CLIP**2 * (1 + 1e-12)) == (a <= free_threshold(2))
    # the numeric search finds at least this much
    assert _max_multi_d(a, CLIP, 2, restarts=15, seed=95) >= value * (1 - 1e-6)


def test_the_one_dimensional_threshold_does_not_hold_in_two_dimensions():
    # the 1-D value would be far from free for d ≥ 2 (the optimizer finds a pair exceeding 4ζ²)
    assert _max_multi_d(free_threshold(1), CLIP, 2, restarts=20, seed=80) > 4 * CLIP**2 * 1.1


@pytest.mark.parametrize("dim", [1, 2, 3, 100])
def test_joint_sensitivity_replace_one_below_and_above_threshold(dim):
    tau = free_threshold(dim)
    below_alpha = math.sqrt(tau * (1 - 1e-9)) / CLIP
    assert joint_sensitivity(CLIP, below_alpha, REPLACE, dim) == pytest.approx(2 * CLIP, rel=1e-14)
    above_alpha = math.sqrt(tau * 1.5) / CLIP
    expected = 2 * CLIP * math.sqrt(1 + above_alpha**2 * CLIP**2)
    assert joint_sensitivity(CLIP, above_alpha, REPLACE, dim) == pytest.approx(expected, rel=1e-14)


@pytest.mark.parametrize("a", [0.2, 0.75, 2.0, 6.0])
def test_replace_one_bound_covers_the_numeric_max_for_any_alpha(a):
    """Whatever α, the returned Δ² bounds the numeric max over replace-one pairs (d = 1 grid, d = 2 search)."""
    alpha = math.sqrt(a) / CLIP
    assert _max_1d(a, CLIP, points=1501) <= joint_sensitivity(CLIP, alpha, REPLACE, 1) ** 2 * (1 + 1e-9)
    assert _max_multi_d(a, CLIP, 2, restarts=15, seed=90) <= joint_sensitivity(CLIP, alpha, REPLACE, 2) ** 2 * (1 + 1e-9)


# --- the joint privatizer of a configuration ---------------------------------------------------------------
def _config(**changes) -> PrivacyConfig:
    base = dict(num_users=100, expected_cohort=10, rounds=5, noise_multiplier=1.3, clip_norm=0.5, delta=1e-5)
    return PrivacyConfig(**{**base, **changes})


def test_joint_privatizer_add_remove_noise_std_and_dimension():
    config, alpha, dim = _config(), 3.0, 20
    privatizer = joint_privatizer(config, dim, alpha, seed=1)
    assert privatizer.dim == 2 * dim
    assert privatizer.noise_std == pytest.approx(1.3 * 0.5 * math.sqrt(1 + (alpha * 0.5) ** 2), rel=1e-14)


def test_joint_privatizer_replace_one_free_regime_adds_only_the_first_moment_noise():
    config = _config(sampler="without-replacement", accountant="rdp")
    dim, clip = 20, config.clip_norm
    alpha = 0.9 * math.sqrt(free_threshold(dim)) / clip  # inside the free regime
    plain = make_privatizer(config, dim, seed=1)
    assert plain.noise_std == pytest.approx(config.noise_multiplier * clip, rel=1e-14)  # σζ
    joint = joint_privatizer(config, dim, alpha, seed=1)
    assert joint.noise_std == pytest.approx(plain.noise_std, rel=1e-12)


def test_validation():
    with pytest.raises(ValueError, match="dim"):
        free_threshold(0)
    with pytest.raises(ValueError, match="clip_norm"):
        joint_sensitivity(0.0, 1.0, ADD_REMOVE, 3)
    with pytest.raises(ValueError, match="alpha"):
        joint_sensitivity(1.0, -1.0, ADD_REMOVE, 3)
    with pytest.raises(ValueError, match="noise_multiplier"):
        noise_stds(0.0, 1.0, 1.0, ADD_REMOVE, 3)
