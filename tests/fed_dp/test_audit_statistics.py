"""The audit's statistics, each checked against an independent computation or by Monte Carlo."""

from __future__ import annotations

import math

import dp_accounting
import pytest
import torch
from scipy import stats

from fed_dp.audit import (bonferroni_confidence, clip_test, confidence_label, detectable_noise_scale,
                          gaussian_fit_epsilon, gdp_delta, gdp_epsilon, lower_bound_cap, lower_bound_verdict,
                          mechanism_test, mechanism_test_power, one_run_lower_bound, p_value)


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


def test_the_lower_bound_cap_is_the_bound_of_perfect_guesses():
    """Issue 25's figures: the bound cannot exceed 3.755 at δ = 1e-5 or 2.863 at δ = 1e-4 with 1,000 canaries,
    and more canaries barely raise it (5.22 at 10,000); perfect scores reach the cap exactly."""
    assert lower_bound_cap(1000, 1e-5) == pytest.approx(3.755, abs=1e-3)
    assert lower_bound_cap(1000, 1e-4) == pytest.approx(2.863, abs=1e-3)
    assert lower_bound_cap(10_000, 1e-5) == pytest.approx(5.22, abs=1e-2)
    inserted = torch.rand(1000, generator=torch.Generator().manual_seed(0)) < 0.5
    perfect = one_run_lower_bound(inserted.double(), inserted, 1e-5)
    assert perfect["epsilon_lower_bound"] == lower_bound_cap(1000, 1e-5)
    assert lower_bound_cap(1000, 1e-5, confidence=0.99) < lower_bound_cap(1000, 1e-5)
    assert lower_bound_verdict(3.0, 3.755, 4.0, 0.95) == "inconclusive"  # accounted ε above the cap
    assert lower_bound_verdict(3.755, 3.755, 3.755, 0.95) == "inconclusive"  # at the cap
    assert lower_bound_verdict(1.0, 3.755, 2.0, 0.95) == "consistent"
    assert lower_bound_verdict(2.5, 3.755, 2.0, 0.95) == "leaks more than accounted at confidence 95%"


def _simulated_coefficients(generator, *, runs, dim, canaries, rounds, q, noise_sigma, inserted=None):
    """The accounted mechanism written out, ``runs`` times at once: orthonormal canaries c_i (one draw), each
    inserted with probability ½ per run (or as ``inserted`` says, in every run); in each of T rounds every
    inserted canary is sampled with probability q and the noisy sum is ỹ_t = Σ_{sampled} c_i + noise_sigma·g_t,
    g_t ~ N(0, I_d) (ζ = 1). Returns every round's coefficients C·ỹ_t, (runs, T, m), and which canaries were
    inserted, (runs, m)."""
    c = torch.linalg.qr(torch.randn(dim, canaries, generator=generator, dtype=torch.float64))[0].T
    if inserted is None:
        inserted = torch.rand(runs, canaries, generator=generator) < 0.5
    else:
        inserted = inserted.expand(runs, canaries)
    sampled = inserted[:, None, :] & (torch.rand(runs, rounds, canaries, generator=generator) < q)
    noise = torch.randn(runs, rounds, dim, generator=generator, dtype=torch.float64)
    noisy = sampled.double() @ c + noise_sigma * noise
    return noisy @ c.T, inserted


def _simulated_scores(generator, **options):
    """The scores u = Σ_t C·ỹ_t of :func:`_simulated_coefficients`, and which canaries were inserted."""
    coefficients, inserted = _simulated_coefficients(generator, **options)
    return coefficients.sum(dim=1), inserted


def _simulated_mechanism_tests(generator, *, runs, dim, canaries, rounds, q, sigma, noise_sigma):
    """:func:`mechanism_test` of the accounted ``sigma`` on each run of :func:`_simulated_scores`."""
    scores, inserted = _simulated_scores(generator, runs=runs, dim=dim, canaries=canaries, rounds=rounds, q=q,
                                         noise_sigma=noise_sigma)
    return [mechanism_test(scores[r], inserted[r], noise_multiplier=sigma, rounds=rounds, sampling_rate=q)
            for r in range(runs)]


def test_the_mechanism_tests_law_by_monte_carlo():
    """1,000 simulated runs of the accounted mechanism (σ = 0.4, q = 0.3, T = 4, 60 candidates, ~30 per group):
    the p-values are uniform (Kolmogorov-Smirnov), so the test flags 5% of honest runs (within 3 standard
    errors: 2.9%-7.1%) and μ̂ averages q√T/σ (within the noncentral t's small-sample bias, +3% at 29 degrees of
    freedom). σ is small so that the participation counts make 30% of μ̂'s variance: a law that left them out
    would flag about 8% of honest runs. With 4× less noise than accounted every run is flagged."""
    generator = torch.Generator().manual_seed(11)
    runs = 1000
    honest = _simulated_mechanism_tests(generator, runs=runs, dim=120, canaries=60, rounds=4, q=0.3, sigma=0.4,
                                        noise_sigma=0.4)
    p_values = [r["p_value"] for r in honest]
    assert stats.kstest(p_values, "uniform").pvalue > 1e-3
    flagged = sum(r["verdict"] != "consistent" for r in honest) / runs
    assert abs(flagged - 0.05) <= 3 * math.sqrt(0.05 * 0.95 / runs)
    assert sum(r["mu"] for r in honest) / runs == pytest.approx(honest[0]["mu_expected"], rel=0.05)
    assert honest[0]["mu_expected"] == pytest.approx(0.3 * 2 / 0.4)
    assert sum(r["held_out_spread"] for r in honest) / runs == pytest.approx(1.0, abs=0.02)
    broken = _simulated_mechanism_tests(generator, runs=50, dim=120, canaries=60, rounds=4, q=0.3, sigma=0.4,
                                        noise_sigma=0.1)
    assert all(r["verdict"] == "leaks more than accounted at confidence 95%" for r in broken)


def test_the_mechanism_test_refuses_what_it_cannot_test():
    scores, inserted = torch.randn(10), torch.arange(10) < 5
    with pytest.raises(ValueError, match="noise_multiplier"):
        mechanism_test(scores, inserted, noise_multiplier=0.0, rounds=1, sampling_rate=0.5)
    with pytest.raises(ValueError, match="at least 1 inserted and 3 held-out"):
        mechanism_test(scores, torch.arange(10) < 8, noise_multiplier=1.0, rounds=1, sampling_rate=0.5)
    with pytest.raises(ValueError, match="sampling_rate"):
        mechanism_test(scores, inserted, noise_multiplier=1.0, rounds=1, sampling_rate=0.0)
    everyone = mechanism_test(scores, inserted, noise_multiplier=1.0, rounds=4, sampling_rate=1.0)  # sampler "all"
    assert everyone["mu_expected"] == 2.0 and 0 <= everyone["p_value"] <= 1


def test_the_mechanism_tests_power_by_monte_carlo():
    """The power computed from the test's law is the rate at which it flags an under-noised mechanism: 30 inserted
    and 30 held-out canaries (σ = 0.4, q = 0.3, T = 4); at the noise scale c₈₀ that the law says is detected with
    80% power, 600 simulated runs adding c₈₀σ are flagged in 80% of them (within 3 standard errors: ±4.9 points).
    At c = 1 the power is the level, 5%, and it decreases in c."""
    law = {"noise_multiplier": 0.4, "rounds": 4, "sampling_rate": 0.3}
    scale = detectable_noise_scale(30, 30, **law, power=0.8)
    assert 0.3 < scale < 0.9
    assert mechanism_test_power(30, 30, **law, noise_scale=scale) == pytest.approx(0.8, abs=1e-4)
    assert mechanism_test_power(30, 30, **law, noise_scale=1.0) == pytest.approx(0.05, abs=1e-6)
    powers = [mechanism_test_power(30, 30, **law, noise_scale=c) for c in (0.25, 0.5, 0.75, 1.0)]
    assert powers == sorted(powers, reverse=True)
    runs = 600
    mask = torch.arange(60) < 30
    scores, inserted = _simulated_scores(torch.Generator().manual_seed(5), runs=runs, dim=120, canaries=60, rounds=4,
                                         q=0.3, noise_sigma=scale * 0.4, inserted=mask)
    flagged = sum(mechanism_test(scores[r], inserted[r], **law)["p_value"] < 0.05 for r in range(runs)) / runs
    assert abs(flagged - 0.8) <= 3 * math.sqrt(0.8 * 0.2 / runs)


def test_the_clip_tests_law_by_monte_carlo():
    """2,000 simulated runs of the accounted mechanism (as above with σ = 1, ~30 inserted canaries, T = 4): the clip
    test on the largest per-round coefficient flags 5% of them (within 3 standard errors; its union bound over
    4·n₁ independent canary-rounds gives 1 − (1 − 0.05/(4n₁))^(4n₁) ≈ 4.9%), so its law is neither loose nor
    wrong (a law with 0.9σ, or with the canary sampled in every round, fails this test),
    and the two tests together, each at 2.5% (Bonferroni), flag at most 5% of honest runs. One release of K·ζ
    along an inserted canary in one round (its clip skipped) is flagged at least as often as the computed power
    Φ̄((x* − K)/σ) says (K chosen where that power is about ½), and every time when K = x* + 8σ."""
    generator = torch.Generator().manual_seed(13)
    law = {"noise_multiplier": 1.0, "rounds": 4, "sampling_rate": 0.3}
    runs = 2000
    coefficients, inserted = _simulated_coefficients(generator, runs=runs, dim=120, canaries=60, rounds=4, q=0.3,
                                                     noise_sigma=1.0)
    maxima, scores = coefficients.max(dim=1).values, coefficients.sum(dim=1)
    clip = [clip_test(maxima[r], inserted[r], **law)["p_value"] for r in range(runs)]
    assert abs(sum(p < 0.05 for p in clip) / runs - 0.05) <= 3 * math.sqrt(0.05 * 0.95 / runs)
    each = 1 - bonferroni_confidence(0.95, 2)
    mechanism = [mechanism_test(scores[r], inserted[r], **law)["p_value"] for r in range(runs)]
    together = sum(min(p, q) < each for p, q in zip(clip, mechanism)) / runs
    assert together <= 0.05 + 3 * math.sqrt(0.05 * 0.95 / runs)
    bugged = 400  # runs with one skipped clip: round 2 of the first inserted canary carries K instead of 0 or 1
    first = inserted[:bugged].double().argmax(dim=1)
    threshold = clip_test(maxima[0], inserted[0], **law)["threshold"]
    for norm, always in ((threshold, False), (threshold + 8.0, True)):
        skipped = coefficients[:bugged].clone()
        skipped[torch.arange(bugged), 2, first] += norm - (skipped[torch.arange(bugged), 2, first] > 0.5).double()
        skipped_maxima = skipped.max(dim=1).values
        tests = [clip_test(skipped_maxima[r], inserted[r], **law, unclipped_score=norm) for r in range(bugged)]
        power = sum(t["power_one_unclipped"] for t in tests) / bugged
        flagged = sum(t["verdict"] != "consistent" for t in tests) / bugged
        if always:
            assert power > 1 - 1e-9 and flagged == 1.0
        else:
            assert 0.3 < power < 0.7 and flagged >= power - 3 * math.sqrt(power * (1 - power) / bugged)


def test_the_verdicts_are_corrected_together():
    """Bonferroni: F verdicts each at 1 − (1 − c)/F; the labels keep the corrected level's digits."""
    assert bonferroni_confidence(0.95, 4) == pytest.approx(0.9875)
    assert bonferroni_confidence(0.95, 1) == pytest.approx(0.95)
    assert confidence_label(0.9875) == "98.75%" and confidence_label(0.95) == "95%"
    assert lower_bound_verdict(2.5, 3.755, 2.0, 0.9875) == "leaks more than accounted at confidence 98.75%"
    with pytest.raises(ValueError, match="tests must be an integer >= 1"):
        bonferroni_confidence(0.95, 0)
    with pytest.raises(ValueError, match="confidence"):
        bonferroni_confidence(1.0, 2)


def test_the_clip_test_and_the_power_refuse_what_they_cannot_compute():
    scores, inserted = torch.randn(10), torch.arange(10) < 5
    with pytest.raises(ValueError, match="unclipped_score"):
        clip_test(scores, inserted, noise_multiplier=1.0, rounds=1, sampling_rate=0.5, unclipped_score=0.5)
    with pytest.raises(ValueError, match="at least 1 inserted"):
        clip_test(scores, torch.zeros(10, dtype=torch.bool), noise_multiplier=1.0, rounds=1, sampling_rate=0.5)
    with pytest.raises(ValueError, match="sampling_rate"):
        clip_test(scores, inserted, noise_multiplier=1.0, rounds=1, sampling_rate=1.5)
    with pytest.raises(ValueError, match="noise_scale"):
        mechanism_test_power(5, 5, noise_multiplier=1.0, rounds=1, sampling_rate=0.5, noise_scale=0.0)
    with pytest.raises(ValueError, match="power"):
        detectable_noise_scale(5, 5, noise_multiplier=1.0, rounds=1, sampling_rate=0.5, power=1.0)
    with pytest.raises(ValueError, match="at least 1 inserted and 3 held-out"):
        mechanism_test_power(5, 2, noise_multiplier=1.0, rounds=1, sampling_rate=0.5)
