"""The audit's statistics, each checked against an independent computation or by Monte Carlo."""

from __future__ import annotations

import math

import dp_accounting
import pytest
import torch
from scipy import stats

from fed_dp.audit import gaussian_fit_epsilon, gdp_delta, gdp_epsilon, one_run_lower_bound, p_value


@pytest.mark.parametrize("mu", [0.3, 1.0, 2.5])
def test_gdp_epsilon_equals_the_gaussian_mechanisms_pld(mu):
    """μ-GDP is exactly the Gaussian mechanism of sensitivity 1 and noise σ = 1/μ: dp_accounting's PLD of
    GaussianDpEvent(1/μ) gives the same ε(δ) (up to its discretization)."""
    accountant = dp_accounting.pld.PLDAccountant(value_discretization_interval=1e-5)
    accountant.compose(dp_accounting.GaussianDpEvent(1 / mu))
    assert gdp_epsilon(mu, 1e-5) == pytest.approx(accountant.get_epsilon(1e-5), abs=2e-3)
    assert gdp_delta(mu, gdp_epsilon(mu, 1e-5)) == pytest.approx(1e-5, rel=1e-6)
    assert gdp_epsilon(0.0, 1e-5) == 0.0 and gdp_epsilon(math.inf, 1e-5) == math.inf


@pytest.mark.parametrize("mu, epsilon", [(30.0, 400.0), (60.0, 1500.0), (5.0, 20.0)])
def test_gdp_delta_does_not_overflow_for_large_mu_and_epsilon(mu, epsilon):
    """Far in the tail e^ε overflows a float; δ(ε) = Φ(a) − exp(ε + log Φ(b)) computed by scipy's logcdf."""
    a, b = -epsilon / mu + mu / 2, -epsilon / mu - mu / 2
    expected = stats.norm.cdf(a) - math.exp(epsilon + stats.norm.logcdf(b))
    assert gdp_delta(mu, epsilon) == pytest.approx(expected, rel=1e-6, abs=1e-300)


def test_p_value_is_the_binomial_tail_plus_the_delta_term():
    """Pure DP: P[Binomial(r, e^ε/(1+e^ε)) ≥ v] (scipy); with δ: + 2mδ·max_i (P[v−i ≤ Bin < v])/i."""
    m, r, v, eps, delta = 1000, 100, 80, 1.0, 1e-4
    p = 1 / (1 + math.exp(-eps))
    assert p_value(m, r, v, eps, 0.0) == pytest.approx(stats.binom.sf(v - 1, r, p), rel=1e-9)
    slack = max((stats.binom.cdf(v - 1, r, p) - stats.binom.cdf(v - i - 1, r, p)) / i for i in range(1, v + 1))
    assert p_value(m, r, v, eps, delta) == pytest.approx(stats.binom.sf(v - 1, r, p) + 2 * m * delta * slack, rel=1e-9)


def test_perfect_and_random_guessing():
    inserted = torch.rand(1000, generator=torch.Generator().manual_seed(0)) < 0.5
    perfect = one_run_lower_bound(inserted.double(), inserted, 1e-5)
    assert perfect["correct"] == perfect["guesses"] == 200 and 3.5 < perfect["epsilon_lower_bound"] < 4.5
    random = one_run_lower_bound(torch.randn(1000, generator=torch.Generator().manual_seed(1)), inserted, 1e-5)
    assert random["epsilon_lower_bound"] < 0.5
    with pytest.raises(ValueError, match="same length"):
        one_run_lower_bound(torch.zeros(5), torch.zeros(4, dtype=torch.bool), 1e-5)


def test_the_lower_bound_is_sound_and_the_estimate_is_close_by_monte_carlo():
    """Scores of a μ-GDP mechanism (inserted ~ N(μ, 1), held out ~ N(0, 1)), 200 independent runs of 1000
    candidates: the 95% lower bound exceeds the true ε(δ) in at most 5% of runs (plus 3 standard errors: 9.6%),
    and the Gaussian-fit estimate lands within 15% of the true ε on average."""
    mu, delta, runs = 1.0, 1e-5, 200
    truth = gdp_epsilon(mu, delta)
    generator = torch.Generator().manual_seed(7)
    above, estimates = 0, []
    for _ in range(runs):
        inserted = torch.rand(1000, generator=generator) < 0.5
        scores = torch.randn(1000, generator=generator, dtype=torch.float64) + mu * inserted
        above += one_run_lower_bound(scores, inserted, delta)["epsilon_lower_bound"] > truth
        estimates.append(gaussian_fit_epsilon(scores[inserted], scores[~inserted], delta)[0])
    assert above / runs <= 0.05 + 3 * math.sqrt(0.05 * 0.95 / runs)
    assert sum(estimates) / runs == pytest.approx(truth, rel=0.15)
