"""The statistics of a one-run privacy audit (docs/how-to/audit.md): an ε estimate, an ε lower bound and two
hypothesis tests (of the noise and of the clip) from canaries, their power, and their joint correction.

Canaries (Andrew et al. 2024, "One-shot empirical privacy estimation for federated learning"): m candidate
directions c_i (random unit vectors); each is inserted, with probability ½ independently, as an extra user
whose clipped update is always ζ·c_i (``fed_dp.simulations.audit`` trains such users through the clients'
own code, so that their clip is exercised); the others are held out. After one run every candidate gets a score
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
* Hypothesis test of the mechanism (:func:`mechanism_test`): when the real users add nothing along the
  candidates (they send zero updates, or never reach the canaries' coordinates), independent Gaussian noise is
  added and users are sampled independently each round with probability q, the canaries' scores on the noisy
  sums ỹ_t are, for orthonormal canaries c_i,

      u_i = Σ_{t≤T} ⟨c_i, ỹ_t⟩ / ζ = K_i·[i inserted] + σ√T·ξ_i ,   K_i ~ Binomial(T, q),  ξ_i ~ N(0, 1),

  all independent (⟨c_i, c_j⟩ = [i = j]; the noise of round t is N(0, σ²ζ²I), whose projection on the
  orthonormal c_i is N(0, σ²ζ²I_m)). The Gaussian-fit separation μ̂ = (mean of the inserted u − mean of the
  held-out u) / (std of the held-out u) then has an exactly known law: given S = Σ_{inserted} K_i ~
  Binomial(n₁T, q), μ̂/√w is noncentral t with n₀ − 1 degrees of freedom and noncentrality
  S/(n₁σ√T·√w), w = 1/n₁ + 1/n₀ (numerator and denominator are independent: the held-out mean and standard
  deviation of i.i.d. Gaussians are). Its mean is close to q√T/σ. The one-sided p-value
  P[μ̂ ≥ measured | the accounted σ, q, T] sums that law over S. Less noise than accounted (or a larger
  signal: a canary counted more often, or unclipped) makes μ̂ larger and the p-value small.
* Power of the mechanism test (:func:`mechanism_test_power`, :func:`detectable_noise_scale`): a mechanism that
  adds c times the accounted noise (c < 1: under-noised) gives the same law with σ replaced by cσ, so μ̂/√w is
  the noncentral t mixture with noncentrality S/(n₁cσ√T√w). With μ* the critical value of the test (the μ where
  the null p-value equals its level α), the power is P_c[μ̂ > μ*] = Σ_S P[S]·P[t_{n₀−1}(S/(n₁cσ√T√w)) > μ*/√w]
  (the binomial tails beyond 10⁻¹⁴ are left out, so the power errs downwards), and the smallest under-noising
  detected with 80% power is the largest c with power ≥ 0.8. μ̂ does not change when the noise and the signal
  are scaled together, so noise c·σ is the same alternative as every canary's contribution multiplied by 1/c
  (a clip at ζ/c): the same power.
* Clip test (:func:`clip_test`): a clip skipped for a canary is an event of one round, so this test looks at
  every round's coefficients v_{i,t} = ⟨c_i, ỹ_t⟩/ζ rather than at their sum over T rounds (which adds σ√T of
  noise to the event). Under the same law, for an inserted canary, v_{i,t} = B_{i,t} + σ·ξ_{i,t} with
  B_{i,t} ~ Bernoulli(q) (sampled in round t or not), so

      P[v ≥ x] = q·Φ̄((x − 1)/σ) + (1 − q)·Φ̄(x/σ),

  and by the union bound P[max_{inserted i, t ≤ T} v_{i,t} ≥ x] ≤ n₁T·P[v ≥ x] whatever the dependence
  between canaries and rounds (sampling without replacement included). Its p-value is n₁T·P[v ≥ measured
  maximum]; its critical value x* solves n₁T·P[v ≥ x*] = α, and x* ≤ 1 + σ·Φ̄⁻¹(α/(n₁T)). A release of a
  canary whose clip was skipped that carries e·ζ along c_i instead of ζ has v ≥ e + σ·ξ, so one such release
  is flagged with probability at least Φ̄((x* − e)/σ): the mean-based mechanism test dilutes one canary's
  excess over n₁ canaries and T rounds, this maximum does not.
* The verdicts are corrected together (Bonferroni, :func:`bonferroni_confidence`): an audit that reports F
  verdicts (the lower bound of each threat model, and the mechanism and clip tests where their law holds) runs
  each at level (1 − c)/F, i.e. each lower bound at confidence 1 − (1 − c)/F (its cap too) and each test with
  p < (1 − c)/F, so that an honest run gets any "leaks more than accounted" verdict with probability at most
  1 − c (the union bound over the F verdicts; no assumption on how they depend on each other, and the two lower
  bounds and the two tests are strongly dependent). The ε estimate has no verdict and is not in the family.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from scipy import optimize, stats

from fed_dp.validation import check_int

__all__ = ["bonferroni_confidence", "clip_test", "confidence_label", "detectable_noise_scale", "gaussian_fit_epsilon",
           "gdp_delta", "gdp_epsilon", "lower_bound_cap", "lower_bound_verdict", "mechanism_test",
           "mechanism_test_power", "one_run_lower_bound", "p_value"]

#: The fractions of the candidates guessed on (half "inserted", half "held out") by the lower bound.
GUESS_FRACTIONS = (0.02, 0.05, 0.1, 0.2)


def _normal_cdf(x: float) -> float:
    return 0.5 * math.erfc(-x / math.sqrt(2))


def _normal_sf(x: float) -> float:
    """Φ̄(x) = 1 − Φ(x), accurate far in the upper tail."""
    return 0.5 * math.erfc(x / math.sqrt(2))


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


def confidence_label(confidence: float) -> str:
    """0.95 → "95%", 0.9875 → "98.75%" (four significant digits: a corrected level is not rounded away)."""
    return f"{100 * confidence:.4g}%"


def _leaks(confidence: float) -> str:
    return f"leaks more than accounted at confidence {confidence_label(confidence)}"


def bonferroni_confidence(confidence: float, tests: int) -> float:
    """The confidence of each of ``tests`` verdicts that hold together at ``confidence``: 1 − (1 − c)/F
    (Bonferroni; module docstring)."""
    _check_confidence(confidence)
    tests = check_int("tests", tests, minimum=1)
    return 1 - (1 - confidence) / tests


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
        return _leaks(confidence)
    return "inconclusive" if epsilon_accounted >= cap else "consistent"


def _check_mechanism(noise_multiplier: float, rounds: int, sampling_rate: float) -> int:
    if not (noise_multiplier > 0 and math.isfinite(noise_multiplier)):
        raise ValueError(f"noise_multiplier must be a finite number > 0, got {noise_multiplier!r}")
    if not 0 < sampling_rate <= 1:
        raise ValueError(f"sampling_rate must be in (0, 1], got {sampling_rate!r}")
    return check_int("rounds", rounds, minimum=1)


def _groups(scores: torch.Tensor, inserted: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    if scores.shape != inserted.shape or scores.ndim != 1:
        raise ValueError("scores and inserted must be vectors of the same length (one entry per candidate)")
    mask = inserted.bool()
    return mask, int(mask.sum()), int((~mask).sum())


@dataclass(frozen=True)
class _SeparationLaw:
    """The law of μ̂ for n₁ inserted and n₀ held-out canaries under the accounted σ, q, T (module docstring):
    S ~ Binomial(n₁T, q) on ``counts`` with probabilities ``weights`` (``beyond``: the mass left out, ≤ 2·10⁻¹⁴),
    w = 1/n₁ + 1/n₀ and ``scale`` σ√T."""

    n1: int
    n0: int
    w: float
    scale: float
    counts: np.ndarray
    weights: np.ndarray
    beyond: float

    @classmethod
    def of(cls, n1: int, n0: int, noise_multiplier: float, rounds: int, sampling_rate: float) -> "_SeparationLaw":
        rounds = _check_mechanism(noise_multiplier, rounds, sampling_rate)
        if n1 < 1 or n0 < 3:
            raise ValueError(f"the test needs at least 1 inserted and 3 held-out canaries, got {n1} and {n0}")
        trials = n1 * rounds
        if sampling_rate == 1:
            counts, weights, beyond = np.array([float(trials)]), np.array([1.0]), 0.0
        else:
            tail = 1e-14
            low, high = stats.binom.ppf(tail, trials, sampling_rate), stats.binom.isf(tail, trials, sampling_rate)
            counts = np.arange(low, high + 1)
            weights = stats.binom.pmf(counts, trials, sampling_rate)
            beyond = max(0.0, 1.0 - float(weights.sum()))
        return cls(n1, n0, 1 / n1 + 1 / n0, noise_multiplier * math.sqrt(rounds), counts, weights, beyond)

    def sf(self, mu: float, noise_scale: float = 1.0, *, upper: bool = True) -> float:
        """P[μ̂ ≥ mu] when the mechanism adds ``noise_scale`` × the accounted noise; ``upper``: the mass left out
        counts as ≥ mu (an upper bound: the p-value), else as < mu (a lower bound: the power)."""
        root_w = math.sqrt(self.w)
        noncentrality = self.counts / (self.n1 * noise_scale * self.scale * root_w)
        tail = float(np.dot(self.weights, stats.nct.sf(mu / root_w, self.n0 - 1, noncentrality)))
        return min(1.0, tail + (self.beyond if upper else 0.0))

    def critical(self, alpha: float) -> float:
        """μ*: the μ̂ above which the test rejects at level α (sf(μ*) = α; sf decreases in μ)."""
        low = high = float(self.counts.mean()) / (self.n1 * self.scale)  # ≈ the expected μ̂
        step = 1 + 10 * math.sqrt(self.w)
        while self.sf(low) < alpha:
            low -= step
        while self.sf(high) > alpha:
            high += step
        return optimize.brentq(lambda mu: self.sf(mu) - alpha, low, high, xtol=1e-10)


def mechanism_test(scores: torch.Tensor, inserted: torch.Tensor, *, noise_multiplier: float, rounds: int,
                   sampling_rate: float, confidence: float = 0.95) -> dict[str, float | str]:
    """One-sided test of the canaries' separation μ̂ on the noisy sums against the accounted mechanism.

    ``scores``: u_i = Σ_t ⟨c_i, ỹ_t⟩/ζ of orthonormal candidates c_i over the ``rounds`` noisy sums ỹ_t of a
    run whose real users add nothing along the candidates; ``noise_multiplier`` σ: the accounted noise std on
    the sum over ζ; ``sampling_rate`` q: each user's probability to be in a round's cohort. Under the accounted
    mechanism μ̂/√w is a noncentral t mixed over S ~ Binomial(n₁T, q) (module docstring); the p-value is
    P[μ̂ ≥ measured] = Σ_S P[S]·P[t_{n₀−1}(S/(n₁σ√T√w)) ≥ μ̂/√w] (the binomial tails beyond 10⁻¹⁴ are
    counted as rejections, so the p-value errs upwards). Returns ``mu`` (μ̂), ``mu_expected`` (q√T/σ),
    ``held_out_spread`` (std of the held-out u / σ√T: 1 under the accounted noise), ``p_value`` and ``verdict``
    ("leaks more than accounted at confidence c" when p < 1 − c, else "consistent"). Its power, from the same
    law: :func:`mechanism_test_power`, :func:`detectable_noise_scale`.

    For sampling without replacement (K_i Binomial marginally, negatively correlated between users) the
    variance of S is smaller than the binomial's, so the p-value is conservative."""
    _check_confidence(confidence)
    mask, n1, n0 = _groups(scores, inserted)
    law = _SeparationLaw.of(n1, n0, noise_multiplier, rounds, sampling_rate)
    u = scores.double()
    spread = float(u[~mask].std())
    mu = float(u[mask].mean() - u[~mask].mean()) / spread
    p = law.sf(mu)
    alpha = 1 - confidence
    return {"mu": mu, "mu_expected": sampling_rate * math.sqrt(rounds) / noise_multiplier,
            "held_out_spread": spread / law.scale, "p_value": p, "confidence": confidence,
            "verdict": _leaks(confidence) if p < alpha else "consistent"}


def mechanism_test_power(inserted: int, held_out: int, *, noise_multiplier: float, rounds: int,
                         sampling_rate: float, confidence: float = 0.95, noise_scale: float = 0.5) -> float:
    """The probability that :func:`mechanism_test` flags a mechanism that adds ``noise_scale`` × the accounted
    noise (σ, q, T), with ``inserted`` and ``held_out`` canaries: P_c[μ̂ > μ*] from the exact law (module
    docstring), a lower bound by at most 10⁻¹⁴. ``noise_scale = 1`` gives the test's level (≤ 1 − confidence)."""
    _check_confidence(confidence)
    if not (noise_scale > 0 and math.isfinite(noise_scale)):
        raise ValueError(f"noise_scale must be a finite number > 0, got {noise_scale!r}")
    law = _SeparationLaw.of(inserted, held_out, noise_multiplier, rounds, sampling_rate)
    return law.sf(law.critical(1 - confidence), noise_scale, upper=False)


def detectable_noise_scale(inserted: int, held_out: int, *, noise_multiplier: float, rounds: int,
                           sampling_rate: float, confidence: float = 0.95, power: float = 0.8) -> float:
    """The largest noise scale c (a mechanism adding c × the accounted noise) that :func:`mechanism_test` flags
    with probability ≥ ``power``: under-noising by 1/c or more is detected with that power (module docstring);
    equivalently, every canary contributing ζ/c instead of ζ. 0 when no scale reaches ``power``."""
    _check_confidence(confidence)
    if not 0 < power < 1:
        raise ValueError(f"power must be in (0, 1), got {power!r}")
    law = _SeparationLaw.of(inserted, held_out, noise_multiplier, rounds, sampling_rate)
    critical = law.critical(1 - confidence)

    def power_at(scale: float) -> float:  # decreases in the noise scale
        return law.sf(critical, scale, upper=False)

    if power_at(1.0) >= power:
        return 1.0
    low = 0.5
    while power_at(low) < power:
        low /= 2
        if low < 1e-6:
            return 0.0
    return optimize.brentq(lambda scale: power_at(scale) - power, low, 1.0, xtol=1e-6)


def _round_tail(x: float, noise_multiplier: float, sampling_rate: float) -> float:
    """P[v ≥ x] for one inserted canary in one round, v = B + σ·ξ, B ~ Bernoulli(q) (module docstring)."""
    sampled, not_sampled = _normal_sf((x - 1) / noise_multiplier), _normal_sf(x / noise_multiplier)
    return sampling_rate * sampled + (1 - sampling_rate) * not_sampled


def clip_test(maxima: torch.Tensor, inserted: torch.Tensor, *, noise_multiplier: float, rounds: int,
              sampling_rate: float, confidence: float = 0.95,
              unclipped_score: float | None = None) -> dict[str, float | str]:
    """One-sided test of the largest coefficient of an inserted canary in any one noisy sum (module docstring).

    ``maxima``: max_{t ≤ T} ⟨c_i, ỹ_t⟩/ζ of each candidate over the ``rounds`` noisy sums; the other arguments
    are :func:`mechanism_test`'s. The p-value is min(1, n₁T·P[v ≥ max_{inserted} maxima_i]) with
    P[v ≥ x] = q·Φ̄((x − 1)/σ) + (1 − q)·Φ̄(x/σ) (union bound: valid for any dependence between the canaries and
    the rounds). Returns ``max_score``, ``threshold`` (x*: the coefficient above which the test rejects),
    ``p_value``, ``confidence``, ``verdict`` and, given ``unclipped_score`` e (what one release of a canary whose
    clip was skipped carries along its direction, over ζ, at least), that e and ``power_one_unclipped`` =
    Φ̄((x* − e)/σ): a lower bound on the probability that one such release is flagged."""
    _check_confidence(confidence)
    rounds = _check_mechanism(noise_multiplier, rounds, sampling_rate)
    mask, n1, _ = _groups(maxima, inserted)
    if n1 < 1:
        raise ValueError("the clip test needs at least 1 inserted canary")
    if unclipped_score is not None and not (unclipped_score >= 1 and math.isfinite(unclipped_score)):
        raise ValueError(f"unclipped_score must be a finite number >= 1 (a multiple of the clip norm), got "
                         f"{unclipped_score!r}")
    alpha, sigma, pairs = 1 - confidence, noise_multiplier, n1 * rounds
    largest = float(maxima.double()[mask].max())
    p = min(1.0, pairs * _round_tail(largest, sigma, sampling_rate))
    threshold = optimize.brentq(lambda x: pairs * _round_tail(x, sigma, sampling_rate) - alpha,
                                -10 * sigma, 1 + 40 * sigma, xtol=1e-12 * (1 + sigma))
    result: dict[str, float | str] = {
        "max_score": largest, "threshold": threshold, "p_value": p, "confidence": confidence,
        "verdict": _leaks(confidence) if p < alpha else "consistent"}
    if unclipped_score is not None:
        result["unclipped_score"] = float(unclipped_score)
        result["power_one_unclipped"] = _normal_sf((threshold - unclipped_score) / sigma)
    return result
