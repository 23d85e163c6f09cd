"""Diagnostics (docs/explanation/server-optimizers.md): the fraction of coordinates with ν̂ − Φ̂ < 0 reproduces
the reference figures by simulation, the quantile summaries match numpy, and the alignment ratio has its
closed-form values. Expectations are computed in the test (numpy quantiles, closed forms, a stationary
approximation of the EMA of squares)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy import stats

from fed_dp.aggregation import private_average
from fed_dp.diagnostics import alignment_ratio, second_moment_summary
from fed_dp.noise import Privatizer
from fed_dp.optimizers import Adam, AdaGrad, RoundRelease

F64 = torch.float64
QUANTILES = {"min": 0.0, "q25": 0.25, "median": 0.5, "q75": 0.75, "max": 1.0}


def _expected_summary(prefix: str, values: np.ndarray) -> dict[str, float]:
    return {f"{prefix}_{name}": float(np.quantile(values, q)) for name, q in QUANTILES.items()}


# --- the negative-fraction figure (a Monte Carlo reconstruction, independent of this code) ---------------------------------------------------------
def _stationary_fraction_approximations(dim: int, cohort: int, sigma: float, clip: float, beta2: float):
    """P(ν̂ − Φ < 0) at stationarity, for g̃ = ḡ + n, n ~ N(0, Φ), Φ = (σζ/B)², ḡ_j² = ζ²/d.

    ν̂ is (at stationarity) the EMA Σ_k (1−β₂)β₂^k g̃²_{t−k}, with mean ḡ² + Φ and variance
    (1−β₂)/(1+β₂)·Var(g̃²) = (1−β₂)/(1+β₂)·(2Φ² + 4ḡ²Φ).

    * Gaussian approximation: ν̂ − Φ ≈ N(ḡ², that variance), fraction = Φ_N(−ḡ²/sd).
    * Moment-matched (Satterthwaite) approximation, which keeps the positive skew of a sum of squares:
      ν̂ ≈ Φ·X/k with X ~ noncentral χ²(k, λ), k = (1+β₂)/(1−β₂), λ = k·ḡ²/Φ (same mean and variance),
      fraction = P(X < k).
    """
    phi = (sigma * clip / cohort) ** 2
    signal = clip**2 / dim
    sd = math.sqrt((1 - beta2) / (1 + beta2) * (2 * phi**2 + 4 * signal * phi))
    gaussian = stats.norm.cdf(-signal / sd)
    k = (1 + beta2) / (1 - beta2)
    skewed = stats.ncx2.cdf(k, k, k * signal / phi)
    return float(gaussian), float(skewed)


@pytest.mark.parametrize("dim, seed_figure", [(1_024, 0.0), (10_240, 0.18), (102_400, 0.48)])
def test_fraction_of_nu_hat_below_phi_reproduces_reference_figures(dim, seed_figure):
    cohort, sigma, clip, beta2 = 32, 1.0, 1.0, 0.99
    burn_in, recorded = 700, 25  # β₂^700 ≈ 9e-4: the EMA has forgotten its start
    privatizer = Privatizer(None, noise_std=sigma * clip, dim=dim, seed=1000 + dim, dtype=torch.float32)
    g_bar = torch.full((dim,), clip / math.sqrt(dim), dtype=torch.float32)  # ‖ḡ‖ = ζ, spread evenly
    fast = Adam(bias_correction=True, beta2=beta2, lr=0.01, record_diagnostics=False)
    recording = Adam(bias_correction=True, beta2=beta2, lr=0.01)
    assert fast == recording  # the same optimizer; only the diagnostics differ
    params = torch.zeros(dim, dtype=torch.float32)
    state = fast.init(params)
    fractions = []
    for t in range(burn_in + recorded):
        g_tilde = -private_average(-cohort * g_bar, privatizer, cohort)  # ḡ + N(0, (σζ/B)²)
        phi = privatizer.noise_variance() / cohort**2
        assert phi == pytest.approx((sigma * clip / cohort) ** 2, rel=1e-12)
        opt = fast if t < burn_in else recording
        _, state, metrics = opt.update(RoundRelease(grad=g_tilde, noise_variance=phi), state, params)
        if t >= burn_in:
            fractions.append(metrics["fraction_nu_hat_below_phi"])
    fraction = sum(fractions) / len(fractions)
    gaussian, skewed = _stationary_fraction_approximations(dim, cohort, sigma, clip, beta2)
    # Tolerances. Monte Carlo error: ~sqrt(p(1−p)/d) ≤ 0.005 (rounds are strongly correlated over ~1/(1−β₂)
    # = 100 rounds, so the 25 recorded rounds add little). The moment-matched χ² approximation ignores
    # that the true third cumulant of the EMA is ~1.3× that of χ²_k, worth < 0.01 here; the Gaussian one
    # ignores all skew (≈ 0.015 low at d = 102,400). Hence 0.02 against the χ² approximation, 0.03 against
    # the Gaussian one and against the seed figures (quoted to two digits).
    assert abs(fraction - skewed) <= 0.02, (fraction, skewed)
    assert abs(fraction - gaussian) <= 0.03, (fraction, gaussian)
    assert abs(fraction - seed_figure) <= 0.03, (fraction, seed_figure)
    if dim == 1_024:
        assert fraction < 0.005


def test_fraction_and_quantiles_after_one_adam_bc_step():
    # t = 1: ν̂₁ = g̃², Φ̂₁ = Φ₁, so everything is known in closed form
    gen = torch.Generator().manual_seed(7)
    g = torch.randn(1001, generator=gen, dtype=F64)
    phi = 0.3
    opt = Adam(bias_correction=True)
    params = torch.zeros_like(g)
    _, _, metrics = opt.update(RoundRelease(grad=g, noise_variance=phi), opt.init(params), params)
    nu_hat = g.square().numpy()
    expected = _expected_summary("nu_hat", nu_hat) | _expected_summary("nu_hat_minus_phi", nu_hat - phi)
    for key, value in expected.items():
        assert metrics[key] == pytest.approx(value, rel=1e-9, abs=1e-12), key
    assert metrics["fraction_nu_hat_below_phi"] == pytest.approx(float((nu_hat < phi).mean()), abs=1e-15)
    assert 0.3 < metrics["fraction_nu_hat_below_phi"] < 0.7  # P(χ²₁ < 0.3) ≈ 0.42: not a trivial case


def test_adagrad_bc_diagnostics_use_accumulator_and_summed_variances():
    opt = AdaGrad(bias_correction=True)
    g1 = torch.tensor([0.1, 0.5, 1.0, 2.0], dtype=F64)
    g2 = torch.tensor([0.2, 0.1, 0.3, 0.0], dtype=F64)
    params = torch.zeros(4, dtype=F64)
    state = opt.init(params)
    _, state, _ = opt.update(RoundRelease(grad=g1, noise_variance=0.2), state, params)
    _, state, metrics = opt.update(RoundRelease(grad=g2, noise_variance=0.3), state, params)
    accumulated = (g1.square() + g2.square()).numpy()  # [0.05, 0.26, 1.09, 4.0]
    assert metrics["fraction_nu_hat_below_phi"] == 0.5  # b₂ = 0.5: two coordinates below
    assert metrics["nu_hat_minus_phi_median"] == pytest.approx(float(np.median(accumulated - 0.5)), rel=1e-12)


def test_no_diagnostics_when_disabled_and_no_phi_keys_without_phi():
    params = torch.zeros(3)
    opt = Adam(record_diagnostics=False)
    _, _, metrics = opt.update(RoundRelease(grad=torch.ones(3)), opt.init(params), params)
    assert metrics == {}
    summary = second_moment_summary(torch.tensor([1.0, 2.0, 3.0]), None)
    assert set(summary) == {f"nu_hat_{n}" for n in QUANTILES}


# --- second_moment_summary vs numpy ---------------------------------------------------------------------
@pytest.mark.parametrize("n", [10, 101, 1234])
def test_second_moment_summary_quantiles_match_numpy(n):
    gen = torch.Generator().manual_seed(n)
    nu = torch.rand(n, generator=gen, dtype=F64) * 3
    phi = torch.rand(n, generator=gen, dtype=F64)  # a per-coordinate Φ̂ (STP)
    summary = second_moment_summary(nu, phi)
    x, p = nu.numpy(), phi.numpy()
    expected = _expected_summary("nu_hat", x) | _expected_summary("nu_hat_minus_phi", x - p)
    for key, value in expected.items():
        assert summary[key] == pytest.approx(value, rel=1e-12, abs=1e-15), key
        # torch.quantile as a second reference
    assert summary["nu_hat_q25"] == pytest.approx(torch.quantile(nu, 0.25).item(), rel=1e-12)
    assert summary["fraction_nu_hat_below_phi"] == pytest.approx(float((x < p).mean()), abs=1e-15)


def test_second_moment_summary_known_vector():
    nu = torch.tensor([4.0, 0.0, 2.0, 1.0, 3.0])  # sorted 0..4: quartiles 1, 2, 3
    summary = second_moment_summary(nu, 2.5)
    assert [summary[f"nu_hat_{k}"] for k in QUANTILES] == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert [summary[f"nu_hat_minus_phi_{k}"] for k in QUANTILES] == [-2.5, -1.5, -0.5, 0.5, 1.5]
    assert summary["fraction_nu_hat_below_phi"] == 0.6


def test_second_moment_summary_large_vector_path_matches_numpy():
    # more than 1e6 entries takes the sort-based path; with n − 1 divisible by 4 the quantiles are exact
    n = 1_000_001
    gen = torch.Generator().manual_seed(3)
    nu = torch.rand(n, generator=gen, dtype=F64)
    summary = second_moment_summary(nu, 0.25)
    x = nu.numpy()
    expected = _expected_summary("nu_hat", x) | _expected_summary("nu_hat_minus_phi", x - 0.25)
    for key, value in expected.items():
        assert summary[key] == pytest.approx(value, rel=1e-12, abs=1e-15), key
    assert summary["fraction_nu_hat_below_phi"] == pytest.approx(float((x < 0.25).mean()), abs=1e-15)


@pytest.mark.parametrize("n", [1234, 1_000_001])
def test_second_moment_summary_of_float32_values_equals_that_of_their_float64_copy(n):
    # the selection runs in float32 for float32 values: the order statistics, and so every quantile, must be
    # exactly those of the same values in float64 (both interpolation paths: n ≤ 10⁶ and beyond)
    gen = torch.Generator().manual_seed(n)
    nu = torch.rand(n, generator=gen) ** 3
    assert nu.dtype == torch.float32
    assert second_moment_summary(nu, 0.01) == second_moment_summary(nu.double(), 0.01)


# --- alignment ratio --------------------------------------------------------------------------------------
def test_alignment_ratio_identical_full_norm_updates_is_one():
    clip, users, dim = 0.8, 7, 50
    gen = torch.Generator().manual_seed(11)
    direction = torch.randn(dim, generator=gen, dtype=F64)
    u = clip * direction / direction.norm()
    total = torch.stack([u] * users).sum(0)
    assert alignment_ratio(total, users, clip) == pytest.approx(1.0, rel=1e-12)
    # half-norm aligned updates: 1/2
    assert alignment_ratio(total / 2, users, clip) == pytest.approx(0.5, rel=1e-12)


@pytest.mark.parametrize("users", [1, 4, 25])
def test_alignment_ratio_orthogonal_updates_is_one_over_sqrt_n(users):
    clip, dim = 1.3, 40
    total = (clip * torch.eye(dim, dtype=F64)[:users]).sum(0)
    assert alignment_ratio(total, users, clip) == pytest.approx(1 / math.sqrt(users), rel=1e-12)


def test_alignment_ratio_random_high_dimensional_updates_is_about_one_over_sqrt_n():
    clip, users, dim = 1.0, 16, 100_000
    gen = torch.Generator().manual_seed(12)
    rows = torch.randn(users, dim, generator=gen, dtype=F64)
    rows = clip * rows / rows.norm(dim=1, keepdim=True)
    # nearly orthogonal: ‖Σu‖² = nζ²(1 + O(n/sqrt(d)))
    assert alignment_ratio(rows.sum(0), users, clip) == pytest.approx(1 / math.sqrt(users), rel=0.02)


def test_alignment_ratio_empty_cohort_is_nan():
    assert math.isnan(alignment_ratio(torch.zeros(3), 0, 1.0))


@pytest.mark.parametrize("n", [1, 2, 7, 4_001, 1_000_000])
def test_summary_equals_torch_quantile(n):
    """The selection-based summary returns torch.quantile's values exactly (linear interpolation)."""
    from fed_dp.diagnostics import _QUANTILES, _summary

    values = torch.rand(n, generator=torch.Generator().manual_seed(n))
    expected = torch.quantile(values.double(), torch.tensor(_QUANTILES, dtype=torch.float64))
    assert list(_summary("x", values).values()) == [float(v) for v in expected]


def test_summary_beyond_quantile_limit_takes_nearest_order_statistics():
    from fed_dp.diagnostics import _QUANTILES, _summary

    values = torch.randn(1_000_003, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    ordered = values.sort().values
    expected = [float(ordered[round(q * (values.numel() - 1))]) for q in _QUANTILES]
    assert list(_summary("x", values).values()) == expected


def test_one_phi_for_every_coordinate_shifts_the_quantiles_of_nu_hat():
    """A scalar Φ̂ takes the shortcut (quantiles of ν̂ minus Φ̂); the same Φ̂ written per coordinate is summarized
    directly: the two agree, on both sides of 10⁶ coordinates (interpolated and nearest order statistics)."""
    for n in (5_001, 1_000_003):
        nu = torch.rand(n, generator=torch.Generator().manual_seed(n), dtype=F64) * 2
        shortcut = second_moment_summary(nu, 0.7)
        direct = second_moment_summary(nu, torch.full((n,), 0.7, dtype=F64))
        assert shortcut.keys() == direct.keys()
        for key, value in direct.items():
            assert shortcut[key] == pytest.approx(value, rel=1e-12, abs=1e-15), key
        assert 0.3 < shortcut["fraction_nu_hat_below_phi"] < 0.4


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("n", [1234, 2_000_001])
def test_the_summary_on_a_gpu_equals_the_cpus(n):
    """On a GPU the order statistics come from a sort on the device: the same values as numpy's partition here."""
    gen = torch.Generator().manual_seed(n)
    nu = torch.rand(n, generator=gen) ** 3
    assert second_moment_summary(nu.cuda(), 0.01) == second_moment_summary(nu, 0.01)
