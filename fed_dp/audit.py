"""The statistics of a one-run privacy audit (docs/how-to/audit.md): an ε estimate and an ε lower bound from canaries.

Canaries (Andrew et al. 2024, "One-shot empirical privacy estimation for federated learning"): m candidate
directions c_i (random unit vectors); each is inserted, with probability ½ independently, as an extra user
whose clipped update is always ζ·c_i; the others are held out. After one run every candidate gets a score
(e.g. the cosine of the final model's change with c_i). Inserted canaries score higher the more the run leaks.

* ε estimate (:func:`gaussian_fit_epsilon`): fit a Gaussian to each group of scores; μ = (mean of the inserted
  − mean of the held-out) / (std of the held-out) is the separation of two unit-variance Gaussians, so the run
  is estimated as μ-GDP and converted to (ε, δ) with :func:`gdp_epsilon`. An estimate, not a bound.
* ε lower bound (:func:`one_run_lower_bound`): Steinke, Nasr & Jagielski 2023, "Privacy auditing with one (1)
  training run", Theorem 3.3 (approximate DP): guess "inserted" for the k highest scores and "held out" for the
  k lowest (r = 2k guesses, v correct). For an (ε, δ)-DP run,

      P[v correct or more] ≤ f(v) + 2mδ · max_{1≤i≤v} (f(v − i) − f(v)) / i,
      f(u) = P[Binomial(r, e^ε/(1 + e^ε)) ≥ u],

  so every ε whose bound is below β = 1 − confidence is rejected; the lower bound is the largest rejected ε.
  Several guess counts are tried with a Bonferroni correction (each at β / their number), so the bound keeps
  its confidence whatever count wins.
* The bound's cap (:func:`lower_bound_cap`): the bound when every guess is correct, the most m candidates can
  certify at δ (3.755 for m = 1,000 at δ = 10⁻⁵, 2.863 at δ = 10⁻⁴; more canaries barely help, since the
  2mδ term grows with m). At an accounted ε at or above the cap the bound cannot contradict the accounting,
  so its verdict is "inconclusive" (:func:`lower_bound_verdict`).
* Hypothesis test of the mechanism (:func:`mechanism_test`): when the real users send nothing (the audit's
  mechanism-only mode), independent Gaussian noise is added and users are sampled independently each round
  with probability q, the canaries' scores on the noisy sums ỹ_t are, for orthonormal canaries c_i,

      u_i = Σ_{t≤T} ⟨c_i, ỹ_t⟩ / ζ = K_i·[i inserted] + σ√T·ξ_i ,   K_i ~ Binomial(T, q),  ξ_i ~ N(0, 1),

  all independent (⟨c_i, c_j⟩ = [i = j]; the noise of round t is N(0, σ²ζ²I), whose projection on the
  orthonormal c_i is N(0, σ²ζ²I_m)). The Gaussian-fit separation μ̂ = (mean of the inserted u − mean of the
  held-out u) / (std of the held-out u) then has an exactly known law: given S = Σ_{inserted} K_i ~
  Binomial(n₁T, q), μ̂/√w is noncentral t with n₀ − 1 degrees of freedom and noncentrality
  S/(n₁σ√T·√w), w = 1/n₁ + 1/n₀ (numerator and denominator are independent: the held-out mean and standard
  deviation of i.i.d. Gaussians are). Its mean is close to q√T/σ. The one-sided p-value
  P[μ̂ ≥ measured | the accounted σ, q, T] sums that law over S. Less noise than accounted (or a larger
  signal: a canary counted more often, or unclipped) makes μ̂ larger and the p-value small.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch
from scipy import stats

from fed_dp.validation import check_int

__all__ = ["gaussian_fit_epsilon", "gdp_delta", "gdp_epsilon", "lower_bound_cap", "lower_bound_verdict",
           "mechanism_test", "one_run_lower_bound", "p_value"]

#: The fractions of the candidates guessed on (half "inserted", half "held out") by the lower bound.
GUESS_FRACTIONS = (0.02, 0.05, 0.1, 0.2)


def _normal_cdf(x: float) -> float:
    return 0.5 * math.erfc(-x / math.sqrt(2))


def _log_normal_cdf(x: float) -> float:
    """log Φ(x), also far in the lower tail (the asymptotic series of Mills' ratio below x = −20)."""
    if x > -20:
        return math.log(_normal_cdf(x))
    return -x * x / 2 - math.log(-x * math.sqrt(2 * math.pi)) + math.log1p(-1 / x**2 + 3 / x**4)


def gdp_delta(mu: float, epsilon: float) -> float:
    """δ(ε) of μ-GDP (Dong, Roth & Su 2022, Cor. 2.13): Φ(−ε/μ + μ/2) − e^ε·Φ(−ε/μ − μ/2) (the second term
    in log space, so large ε and μ do not overflow)."""
    if mu <= 0:
        return 0.0
    return _normal_cdf(-epsilon / mu + mu / 2) - math.exp(epsilon + _log_normal_cdf(-epsilon / mu - mu / 2))


def gdp_epsilon(mu: float, delta: float) -> float:
    """The smallest ε with δ(ε) ≤ ``delta`` for μ-GDP (bisection: δ(ε) decreases in ε); ∞ for μ = ∞."""
    if not 0 < delta < 1:
        raise ValueError(f"delta must be in (0, 1), got {delta!r}")
    if math.isinf(mu):
        return math.inf
    if mu <= 0 or gdp_delta(mu, 0.0) <= delta:
        return 0.0
    low, high = 0.0, 1.0
    while gdp_delta(mu, high) > delta:
        high *= 2
        if high > 1e6:
            return math.inf
    for _ in range(100):
        middle = (low + high) / 2
        low, high = (middle, high) if gdp_delta(mu, middle) > delta else (low, middle)
    return high


def gaussian_fit_epsilon(inserted: torch.Tensor, held_out: torch.Tensor, delta: float) -> tuple[float, float]:
    """(ε estimate, μ) from the two groups of scores (see the module docstring)."""
    if inserted.numel() < 2 or held_out.numel() < 2:
        raise ValueError("the Gaussian fit needs at least two inserted and two held-out canaries")
    spread = float(held_out.double().std())
    gap = float(inserted.double().mean() - held_out.double().mean())
    mu = math.inf if spread == 0 and gap > 0 else 0.0 if spread == 0 else max(gap / spread, 0.0)
    return gdp_epsilon(mu, delta), mu


def _binomial_tail(r: int, p: float) -> list[float]:
    """f(u) = P[Binomial(r, p) ≥ u] for u = 0..r+1 (log-space terms, summed from the top)."""
    if p >= 1:
        return [1.0] * (r + 1) + [0.0]
    log_p, log_q = math.log(p), math.log1p(-p)
    pmf = [math.exp(math.lgamma(r + 1) - math.lgamma(k + 1) - math.lgamma(r - k + 1) + k * log_p + (r - k) * log_q)
           for k in range(r + 1)]
    tail = [0.0] * (r + 2)
    for k in range(r, -1, -1):
        tail[k] = tail[k + 1] + pmf[k]
    return [min(1.0, t) for t in tail]


def p_value(m: int, r: int, v: int, epsilon: float, delta: float) -> float:
    """Steinke et al. 2023, Thm 3.3: an upper bound on P[≥ v of r guesses correct] for an (ε, δ)-DP run with m
    candidates each inserted with probability ½."""
    if not 0 <= v <= r <= m:
        raise ValueError(f"need 0 <= v <= r <= m, got v={v}, r={r}, m={m}")
    tail = _binomial_tail(r, 1 / (1 + math.exp(-epsilon)))
    slack = max(((tail[v - i] - tail[v]) / i for i in range(1, v + 1)), default=0.0)
    return min(1.0, tail[v] + 2 * m * delta * slack)


def _largest_rejected_epsilon(m: int, r: int, v: int, delta: float, beta: float) -> float:
    """sup{ε : p_value(ε) < β} (0 when even ε = 0 is not rejected); p_value increases in ε."""
    if p_value(m, r, v, 0.0, delta) >= beta:
        return 0.0
    low, high = 0.0, 1.0
    while p_value(m, r, v, high, delta) < beta:
        low, high = high, high * 2
        if high > 1e3:
            return low
    for _ in range(60):
        middle = (low + high) / 2
        low, high = (middle, high) if p_value(m, r, v, middle, delta) < beta else (low, middle)
    return low


def _guess_counts(m: int, guess_fractions: Sequence[float]) -> list[int]:
    """k = ⌊f·m/2⌋ for each fraction f (those with k ≥ 1): k guesses "inserted" and k "held out"."""
    return [k for k in (int(fraction * m / 2) for fraction in guess_fractions) if k >= 1]


def _check_confidence(confidence: float) -> None:
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence!r}")


def one_run_lower_bound(scores: torch.Tensor, inserted: torch.Tensor, delta: float, *, confidence: float = 0.95,
                        guess_fractions: Sequence[float] = GUESS_FRACTIONS) -> dict[str, float]:
    """ε lower bound at ``confidence`` from the scores of m candidates and which were inserted (module docstring).

    For each fraction f, k = ⌊f·m/2⌋ guesses "inserted" (highest scores) and k "held out" (lowest); each count
    is tested at β/len(guess_fractions). Returns the best ``epsilon_lower_bound`` with its ``guesses`` r and
    ``correct`` v."""
    if scores.shape != inserted.shape or scores.ndim != 1:
        raise ValueError("scores and inserted must be vectors of the same length (one entry per candidate)")
    _check_confidence(confidence)
    m = scores.numel()
    order = torch.argsort(scores.double(), descending=True)
    ranked = inserted.bool()[order]
    beta = (1 - confidence) / len(guess_fractions)
    best = {"epsilon_lower_bound": 0.0, "guesses": 0, "correct": 0}
    for k in _guess_counts(m, guess_fractions):
        correct = int(ranked[:k].sum()) + int((~ranked[m - k :]).sum())
        bound = _largest_rejected_epsilon(m, 2 * k, correct, delta, beta)
        if bound > best["epsilon_lower_bound"]:
            best = {"epsilon_lower_bound": bound, "guesses": 2 * k, "correct": correct}
    return best


def lower_bound_cap(m: int, delta: float, *, confidence: float = 0.95,
                    guess_fractions: Sequence[float] = GUESS_FRACTIONS) -> float:
    """The largest ε lower bound :func:`one_run_lower_bound` can give for m candidates at δ and ``confidence``:
    its bound when all r = 2k guesses are correct (p_value decreases in v), at the best guess count."""
    m = check_int("m (canary candidates)", m, minimum=1)
    _check_confidence(confidence)
    beta = (1 - confidence) / len(guess_fractions)
    return max((_largest_rejected_epsilon(m, 2 * k, 2 * k, delta, beta) for k in _guess_counts(m, guess_fractions)),
               default=0.0)


def lower_bound_verdict(bound: float, cap: float, epsilon_accounted: float, confidence: float) -> str:
    """"leaks more than accounted at confidence c" when the bound exceeds the accounted ε; else "inconclusive"
    when the accounted ε is at or above the cap (no outcome could exceed it); else "consistent"."""
    if bound > epsilon_accounted:
        return f"leaks more than accounted at confidence {confidence:.0%}"
    return "inconclusive" if epsilon_accounted >= cap else "consistent"


def mechanism_test(scores: torch.Tensor, inserted: torch.Tensor, *, noise_multiplier: float, rounds: int,
                   sampling_rate: float, confidence: float = 0.95) -> dict[str, float | str]:
    """One-sided test of the canaries' separation μ̂ on the noisy sums against the accounted mechanism.

    ``scores``: u_i = Σ_t ⟨c_i, ỹ_t⟩/ζ of orthonormal candidates c_i over the ``rounds`` noisy sums ỹ_t of a
    run whose real users sent nothing; ``noise_multiplier`` σ: the accounted noise std on the sum over ζ;
    ``sampling_rate`` q: each user's probability to be in a round's cohort. Under the accounted mechanism
    μ̂/√w is a noncentral t mixed over S ~ Binomial(n₁T, q) (module docstring); the p-value is
    P[μ̂ ≥ measured] = Σ_S P[S]·P[t_{n₀−1}(S/(n₁σ√T√w)) ≥ μ̂/√w] (the binomial tails beyond 10⁻¹⁴ are
    counted as rejections, so the p-value errs upwards). Returns ``mu`` (μ̂), ``mu_expected`` (q√T/σ),
    ``held_out_spread`` (std of the held-out u / σ√T: 1 under the accounted noise), ``p_value`` and
    ``verdict``: "leaks more than accounted at confidence c" when p < 1 − c, else "consistent".

    For sampling without replacement (K_i Binomial marginally, negatively correlated between users) the
    variance of S is smaller than the binomial's, so the p-value is conservative."""
    _check_confidence(confidence)
    if scores.shape != inserted.shape or scores.ndim != 1:
        raise ValueError("scores and inserted must be vectors of the same length (one entry per candidate)")
    if not (noise_multiplier > 0 and math.isfinite(noise_multiplier)):
        raise ValueError(f"noise_multiplier must be a finite number > 0, got {noise_multiplier!r}")
    rounds = check_int("rounds", rounds, minimum=1)
    if not 0 < sampling_rate <= 1:
        raise ValueError(f"sampling_rate must be in (0, 1], got {sampling_rate!r}")
    mask = inserted.bool()
    n1, n0 = int(mask.sum()), int((~mask).sum())
    if n1 < 1 or n0 < 3:
        raise ValueError(f"the test needs at least 1 inserted and 3 held-out canaries, got {n1} and {n0}")
    u = scores.double()
    spread = float(u[~mask].std())
    mu = float(u[mask].mean() - u[~mask].mean()) / spread
    scale = noise_multiplier * math.sqrt(rounds)  # σ√T: the std of the noise in u
    w = 1 / n1 + 1 / n0
    trials = n1 * rounds
    if sampling_rate == 1:
        counts, weights, beyond = np.array([float(trials)]), np.array([1.0]), 0.0
    else:
        tail = 1e-14
        low, high = stats.binom.ppf(tail, trials, sampling_rate), stats.binom.isf(tail, trials, sampling_rate)
        counts = np.arange(low, high + 1)
        weights = stats.binom.pmf(counts, trials, sampling_rate)
        beyond = max(0.0, 1.0 - float(weights.sum()))
    noncentrality = counts / (n1 * scale * math.sqrt(w))
    p = min(1.0, float(np.dot(weights, stats.nct.sf(mu / math.sqrt(w), n0 - 1, noncentrality))) + beyond)
    verdict = f"leaks more than accounted at confidence {confidence:.0%}" if p < 1 - confidence else "consistent"
    return {"mu": mu, "mu_expected": sampling_rate * math.sqrt(rounds) / noise_multiplier,
            "held_out_spread": spread / scale, "p_value": p, "confidence": confidence, "verdict": verdict}
