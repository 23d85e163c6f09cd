"""User-level ε with dp_accounting: accountants, calibration of σ, and the per-round ledger (ALGORITHMS §4).

The event always comes from :func:`fed_dp.sampling.dp_event` on the run's
:class:`~fed_dp.config.PrivacyConfig`; nothing here re-derives an accountant. PLD is the default
(tighter); RDP is offered, and required for sampling without replacement (replace-one adjacency).

Per-round ε (:func:`epsilon_schedule`) costs O(T), not T accountant runs:

* RDP, exact at every round. The event after t rounds is ``SelfComposed(unit, n_t)`` (or a single event);
  dp_accounting's RDP of a self-composition is ``n_t`` times the RDP of its unit (that is how its
  ``RdpAccountant`` composes), so the unit's RDP vector is computed once and every round's ε is
  ``dp_accounting.rdp.compute_epsilon(orders, n_t · rdp_unit, δ)``: the same floating-point numbers as a
  fresh accountant on the t-round event.
* PLD, exact at the rounds of :func:`pld_exact_rounds` (1 … 10, then rounds growing by a factor 1.25, and T),
  where the t-round PLD is ``dp_accounting``'s PLD of the unit event self-composed n_t times, built with the
  same calls and discretization as its ``PLDAccountant`` (so the same numbers). A round in between reports
  the ε of the next exact round: an upper bound, because the release after t rounds is a post-processing
  of the release after t′ > t rounds, so the true ε is nondecreasing in t, and PLD's (pessimistic) ε at t′
  bounds the true ε at t′. The ledger and its budget check use these values.
"""

from __future__ import annotations

import functools
import logging
import math
from dataclasses import dataclass
from typing import Any

import dp_accounting
import numpy as np
from dp_accounting import pld, rdp
from dp_accounting.pld import privacy_loss_distribution

from fed_dp.config import PrivacyConfig
from fed_dp.sampling import dp_event, neighboring_relation

#: Smallest σ that calibration considers; a target ε reachable only below it is refused.
MIN_CALIBRATED_NOISE = 1e-2
#: Tolerance of calibration in σ: the σ returned is within this of the smallest σ that meets the target.
CALIBRATION_TOLERANCE = 1e-6
#: dp_accounting's PLDAccountant default value discretization; every reported PLD ε uses it.
PLD_DISCRETIZATION = 1e-4
#: A 10× coarser PLD, used only to locate σ before the exact search (it is never reported).
COARSE_PLD_DISCRETIZATION = 1e-3
#: PLD schedules are exact at rounds 1 … PLD_DENSE_ROUNDS, then at rounds growing by PLD_ROUND_RATIO, and at T.
PLD_DENSE_ROUNDS = 10
PLD_ROUND_RATIO = 1.25


class _ExcludedRdpOrderFilter(logging.Filter):
    """Drops dp_accounting's "failed to converge ... Excluding this order" warnings.

    They say that the RDP accountant skipped an order whose series did not converge; skipping an order
    can only make the RDP ε larger (more conservative), never smaller. The calibration search evaluates
    dozens of σ and would print them by the hundred. Every other warning passes through.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        return "Excluding this order" not in record.getMessage()


logging.getLogger("absl").addFilter(_ExcludedRdpOrderFilter())


class BudgetExceededError(RuntimeError):
    """Raised instead of running a round whose release would exceed the configured ε budget."""


def make_accountant(
    config: PrivacyConfig, *, value_discretization_interval: float = PLD_DISCRETIZATION
) -> dp_accounting.PrivacyAccountant:
    """A fresh accountant of ``config.accountant`` kind under the sampler's neighbouring relation.

    ``value_discretization_interval`` applies to PLD only; anything but the default is for locating σ
    during calibration, never for a reported ε.
    """
    relation = neighboring_relation(config)
    if config.accountant == "pld":
        return pld.PLDAccountant(neighboring_relation=relation, value_discretization_interval=value_discretization_interval)
    return rdp.RdpAccountant(neighboring_relation=relation)


@functools.lru_cache(maxsize=4096)
def epsilon(config: PrivacyConfig, rounds: int | None = None) -> float:
    """User-level ε at ``config.delta`` after ``rounds`` rounds (default: the planned T).

    Memoized on the (frozen, hashable) config and the round count: a PLD evaluation costs about half a
    second whatever the round count (building the sampled-Gaussian PLD dominates), and a comparison of
    several optimizers asks for the same values once per optimizer.
    """
    accountant = make_accountant(config)
    accountant.compose(dp_event(config, rounds))
    return float(accountant.get_epsilon(config.delta))


# --------------------------------------------------------------------------------------------------
# Per-round schedule in O(T)
# --------------------------------------------------------------------------------------------------


def pld_exact_rounds(rounds: int) -> tuple[int, ...]:
    """The rounds at which a PLD schedule of T = ``rounds`` is computed exactly.

    1, 2, …, min(T, PLD_DENSE_ROUNDS), then ⌈r·PLD_ROUND_RATIO⌉ from the last one on, and T: about
    10 + log(T/10)/log(1.25) rounds (41 for T = 10,000). Between two of them, the next one's ε is reported.
    """
    if not (isinstance(rounds, int) and rounds >= 1):
        raise ValueError(f"rounds must be an integer >= 1, got {rounds!r}")
    exact = list(range(1, min(rounds, PLD_DENSE_ROUNDS) + 1))
    while exact[-1] < rounds:
        exact.append(min(rounds, max(exact[-1] + 1, math.ceil(exact[-1] * PLD_ROUND_RATIO))))
    return tuple(exact)


@dataclass(frozen=True)
class EpsilonSchedule:
    """ε after each round t = 1 … T of one configuration, and the rounds at which it is exact.

    ``epsilons[t − 1]`` is dp_accounting's ε of ``dp_event(config, t)`` at every t in ``exact_rounds``
    (every round for RDP); at any other round it is the ε of the next exact round, an upper bound on the
    true ε after t rounds (see the module docstring).
    """

    accountant: str
    delta: float
    epsilons: tuple[float, ...]
    exact_rounds: tuple[int, ...]

    def at(self, rounds: int) -> float:
        """ε after ``rounds`` rounds (1 ≤ rounds ≤ T)."""
        if not (isinstance(rounds, int) and 1 <= rounds <= len(self.epsilons)):
            raise ValueError(f"rounds must be an integer in 1 … {len(self.epsilons)}, got {rounds!r}")
        return self.epsilons[rounds - 1]


def _unit_and_count(event: dp_accounting.DpEvent) -> tuple[dp_accounting.DpEvent, int]:
    """``SelfComposed(unit, n)`` → (unit, n); any other event → (event, 1)."""
    if isinstance(event, dp_accounting.SelfComposedDpEvent):
        return event.event, event.count
    return event, 1


def _rdp_epsilons(config: PrivacyConfig, rounds: range) -> dict[int, float]:
    """ε after each of ``rounds`` with dp_accounting's RDP: the unit event's RDP vector once, then
    ``rdp.compute_epsilon(orders, n_t · rdp_unit, δ)`` per distinct (unit, n_t)."""
    units: dict[dp_accounting.DpEvent, tuple[list[float], np.ndarray]] = {}
    values: dict[tuple[dp_accounting.DpEvent, int], float] = {}
    out = {}
    for t in rounds:
        key = _unit_and_count(dp_event(config, t))
        if key not in values:
            unit, count = key
            if unit not in units:
                accountant = make_accountant(config)
                accountant.compose(unit)
                units[unit] = (accountant.orders.tolist(), accountant.rdp)
            orders, unit_rdp = units[unit]
            values[key] = float(rdp.compute_epsilon(orders, (count * unit_rdp).tolist(), config.delta)[0])
        out[t] = values[key]
    return out


def _sampled_gaussian_pld(config: PrivacyConfig, unit: dp_accounting.PoissonSampledDpEvent) -> Any:
    """The PLD of one Poisson-sampled Gaussian, built with the arguments ``PLDAccountant`` uses."""
    return privacy_loss_distribution.from_gaussian_mechanism(
        standard_deviation=unit.event.noise_multiplier,
        value_discretization_interval=PLD_DISCRETIZATION,
        sampling_prob=unit.sampling_probability,
        neighboring_relation=neighboring_relation(config),
    )


def _pld_epsilons(config: PrivacyConfig, rounds: tuple[int, ...]) -> dict[int, float]:
    """ε after each of ``rounds`` with dp_accounting's PLD.

    For ``SelfComposed(PoissonSampled(q, Gaussian(σ)), n)`` the unit PLD is built once and composed n times
    exactly as ``PLDAccountant`` does (identity ∘ unit^n, same discretization): the same numbers for a
    fraction of the cost. Any other event goes to a fresh accountant (:func:`epsilon`), once per event.
    """
    bases: dict[dp_accounting.DpEvent, Any] = {}
    values: dict[dp_accounting.DpEvent, float] = {}
    out = {}
    for t in rounds:
        event = dp_event(config, t)
        if event not in values:
            unit, count = _unit_and_count(event)
            if isinstance(unit, dp_accounting.PoissonSampledDpEvent) and isinstance(
                unit.event, dp_accounting.GaussianDpEvent
            ) and 0 < unit.sampling_probability and unit.event.noise_multiplier > 0:
                if unit not in bases:
                    bases[unit] = _sampled_gaussian_pld(config, unit)
                composed = privacy_loss_distribution.identity(
                    value_discretization_interval=PLD_DISCRETIZATION
                ).compose(bases[unit].self_compose(count))
                values[event] = float(composed.get_epsilon_for_delta(config.delta))
            else:
                values[event] = epsilon(config, t)
        out[t] = values[event]
    return out


@functools.lru_cache(maxsize=64)
def epsilon_schedule(config: PrivacyConfig) -> EpsilonSchedule:
    """ε after every round 1 … T of ``config`` (memoized per config); see the module docstring.

    RDP: exact at every round, O(T) conversions of one RDP vector. PLD: exact at
    :func:`pld_exact_rounds` (and at every round whose event equals an exact round's, e.g. min-sep rounds
    with the same participation count); elsewhere the next exact round's ε, an upper bound.
    """
    config.require_resolved("the ε schedule")
    rounds = config.rounds
    if config.accountant == "rdp":
        values = _rdp_epsilons(config, range(1, rounds + 1))
        return EpsilonSchedule("rdp", config.delta, tuple(values[t] for t in range(1, rounds + 1)),
                               tuple(range(1, rounds + 1)))
    computed = pld_exact_rounds(rounds)
    values = _pld_epsilons(config, computed)
    by_event = {dp_event(config, t): values[t] for t in computed}
    epsilons, exact, following = [], [], 0
    for t in range(1, rounds + 1):
        while computed[following] < t:
            following += 1
        value = by_event.get(dp_event(config, t))
        if value is None:
            value = values[computed[following]]
        else:
            exact.append(t)
        epsilons.append(value)
    return EpsilonSchedule("pld", config.delta, tuple(epsilons), tuple(exact))


# --------------------------------------------------------------------------------------------------
# Calibration
# --------------------------------------------------------------------------------------------------


def _calibrate(config: PrivacyConfig, target_epsilon: float, bracket: Any, *,
               value_discretization_interval: float = PLD_DISCRETIZATION, tol: float = CALIBRATION_TOLERANCE) -> float:
    """dp_accounting.calibrate_dp_mechanism with ``config``'s own event builder and accountant."""
    return float(
        dp_accounting.calibrate_dp_mechanism(
            lambda: make_accountant(config, value_discretization_interval=value_discretization_interval),
            lambda sigma: dp_event(config.replace(noise_multiplier=float(sigma))),
            target_epsilon,
            config.delta,
            bracket_interval=bracket,
            tol=tol,
        )
    )


def _coarse_epsilon(config: PrivacyConfig, sigma: float) -> float:
    accountant = make_accountant(config, value_discretization_interval=COARSE_PLD_DISCRETIZATION)
    accountant.compose(dp_event(config.replace(noise_multiplier=sigma)))
    return float(accountant.get_epsilon(config.delta))


def _pld_bracket(config: PrivacyConfig, target_epsilon: float, rdp_sigma: float) -> Any:
    """An interval [lo, hi] around the coarse-PLD solution, found without evaluating PLD at tiny σ.

    PLD is tighter than RDP, so σ_PLD ≤ σ_RDP: hi starts at σ_RDP and lo halves from σ_RDP/2 until
    ε_PLD(lo) > target. (Evaluating PLD at very small σ over many rounds needs tens of GiB, which is why
    dp_accounting's default bracket search from σ = 0 is not used.)
    """
    hi = rdp_sigma
    while _coarse_epsilon(config, hi) > target_epsilon:  # rare: PLD discretization
        hi *= 1.25
    lo = hi / 2
    while _coarse_epsilon(config, lo) <= target_epsilon:
        hi, lo = lo, lo / 2
        if lo < MIN_CALIBRATED_NOISE:
            raise ValueError(f"target epsilon {target_epsilon} needs σ < {MIN_CALIBRATED_NOISE}; choose a smaller epsilon")
    return dp_accounting.ExplicitBracketInterval(lo, hi)


def _certified_pld_sigma(config: PrivacyConfig, target_epsilon: float, guess: float, slope: float) -> float:
    """The smallest σ with PLD ε(σ) ≤ target, to within CALIBRATION_TOLERANCE, starting near ``guess``.

    Newton steps on the exact (reported) PLD ε with the slope dε/dσ < 0 measured on the coarse PLD:
    from the last point evaluated, root = σ − gap/slope, then probe root + tol/2 (expected to meet the
    target) and root − tol/2 (expected to miss it). It tracks ``upper``, the smallest σ evaluated whose
    ε ≤ target, and ``lower``, the largest whose ε > target, and returns ``upper`` once
    upper − lower ≤ tol: a σ whose exact ε was evaluated and is ≤ target, as
    ``dp_accounting.calibrate_dp_mechanism`` guarantees, and tight to tol. From a guess within ~1e-4 this
    takes three evaluations. If four rounds do not certify, calibrate_dp_mechanism finishes the search
    on a bracket around the points seen.
    """
    tol = CALIBRATION_TOLERANCE
    lower, upper = 0.0, math.inf

    def gap(sigma: float) -> float:
        nonlocal lower, upper
        value = epsilon(config.replace(noise_multiplier=sigma)) - target_epsilon
        if value <= 0:
            upper = min(upper, sigma)
        else:
            lower = max(lower, sigma)
        return value

    point, value = guess, gap(guess)
    for _ in range(4):
        root = point - value / slope
        for sigma in (root + tol / 2, root - tol / 2):
            if upper - lower <= tol:
                return upper
            if lower < sigma < upper:
                point, value = sigma, gap(sigma)
                if value > 0:  # the root lies above: the next Newton step starts here
                    break
    if upper - lower <= tol:
        return upper
    return _calibrate(config, target_epsilon, _fine_bracket(config, target_epsilon, lower, upper, guess))


def _fine_bracket(config: PrivacyConfig, target_epsilon: float, lower: float, upper: float, guess: float) -> Any:
    """An explicit bracket for the exact PLD from what the Newton steps left: widen by 1% steps."""
    step = 1.01
    if lower <= 0:
        lower = guess if math.isfinite(upper) and guess < upper else (upper if math.isfinite(upper) else guess) / step
        while epsilon(config.replace(noise_multiplier=lower)) <= target_epsilon:
            lower /= step
            if lower < MIN_CALIBRATED_NOISE:
                raise ValueError(f"target epsilon {target_epsilon} needs σ < {MIN_CALIBRATED_NOISE}; choose a smaller epsilon")
    if not math.isfinite(upper):
        upper = lower * step
        while epsilon(config.replace(noise_multiplier=upper)) > target_epsilon:
            upper *= step
    return dp_accounting.ExplicitBracketInterval(lower, upper)


def calibrate_noise_multiplier(config: PrivacyConfig, target_epsilon: float) -> float:
    """Smallest σ (to within 1e-6) whose T-round ε at ``config.delta`` is at most ``target_epsilon``.

    RDP: ``dp_accounting.calibrate_dp_mechanism`` with the config's own event builder, which guarantees
    ε(σ) ≤ target. PLD, in three steps that never evaluate PLD at a tiny σ: the RDP answer bounds σ from
    above (PLD is tighter); calibrate_dp_mechanism on a 10× coarser PLD (cheap, never reported) locates σ
    to 1e-5; then :func:`_certified_pld_sigma` searches the exact PLD ε from there and returns a σ whose
    exact ε was evaluated and is ≤ target, with a σ less than 1e-6 below it that misses the target.
    ``config.noise_multiplier`` is ignored.
    """
    if not (isinstance(target_epsilon, (int, float)) and math.isfinite(target_epsilon) and target_epsilon > 0):
        raise ValueError(f"target epsilon must be a finite number > 0, got {target_epsilon!r}")
    if config.noise_multiplier is None:  # a config that asks for calibration: search from a placeholder σ
        config = config.replace(target_epsilon=None, noise_multiplier=1.0)
    config.require_resolved("calibration")
    rdp_config = config.replace(accountant="rdp")
    if epsilon(rdp_config.replace(noise_multiplier=MIN_CALIBRATED_NOISE)) <= target_epsilon:
        raise ValueError(
            f"target epsilon {target_epsilon} is reached already with σ = {MIN_CALIBRATED_NOISE}; "
            "such a target gives no meaningful protection — choose a smaller epsilon"
        )
    rdp_sigma = _calibrate(
        rdp_config, target_epsilon, dp_accounting.LowerEndpointAndGuess(MIN_CALIBRATED_NOISE, 1.0)
    )
    if config.accountant == "rdp":
        return rdp_sigma
    coarse = _calibrate(config, target_epsilon, _pld_bracket(config, target_epsilon, rdp_sigma),
                        value_discretization_interval=COARSE_PLD_DISCRETIZATION, tol=1e-5)
    step = 1e-3 * coarse
    slope = (_coarse_epsilon(config, coarse + step) - _coarse_epsilon(config, coarse)) / step
    return _certified_pld_sigma(config, target_epsilon, coarse, slope)


def resolve_privacy(config: PrivacyConfig, num_users: int | None = None) -> PrivacyConfig:
    """The config with its population and σ filled in: what samplers, noise and accounting run on.

    ``num_users`` is the task's population N; it fills ``config.num_users`` when that is None and must
    equal it otherwise. With ``target_epsilon``, σ is calibrated now (:func:`calibrate_noise_multiplier`:
    the smallest σ whose T-round ε at δ is at most the target) and the result carries that σ, with
    ``target_epsilon`` cleared. A config that is already resolved is returned as it is.
    """
    if num_users is not None:
        if config.num_users is not None and config.num_users != num_users:
            raise ValueError(
                f"privacy.num_users = {config.num_users} but the task has {num_users} users; the sampler must "
                "draw from the users that exist (leave num_users unset to take the task's population)"
            )
        if config.num_users is None:
            config = config.replace(num_users=num_users)
    if config.num_users is None:
        raise ValueError("the population size is unknown: give num_users (the number of users of the task)")
    if config.target_epsilon is not None:
        sigma = calibrate_noise_multiplier(config, config.target_epsilon)
        config = config.replace(target_epsilon=None, noise_multiplier=sigma)
    return config


@dataclass(frozen=True)
class RoundRecord:
    """One released round: its index (0-based) and ε after it (no cohort size: it is computed from the
    population, outside the accounted release, and is not part of what the ledger publishes)."""

    round: int
    epsilon: float


class PrivacyLedger:
    """Per-round record of what was released, with ε so far, and the budget check.

    ε after t rounds is :func:`epsilon_schedule` of the config at t: dp_accounting's ε of
    ``dp_event(config, t)``, the event of the sampler that actually ran (with PLD, between the schedule's
    exact rounds, the next exact round's ε: an upper bound). ``check_next_round`` raises
    :class:`BudgetExceededError` if running one more round would take ε above ``config.epsilon_budget``,
    before anything is released; with PLD it compares the conservative value. Dropped users do not
    change the ledger: the round releases with the same noise and counts in full.
    """

    def __init__(self, config: PrivacyConfig, records: tuple[RoundRecord, ...] = ()) -> None:
        self.config = config.require_resolved("the privacy ledger")
        self._records: list[RoundRecord] = list(records)

    @property
    def records(self) -> tuple[RoundRecord, ...]:
        return tuple(self._records)

    @property
    def rounds(self) -> int:
        return len(self._records)

    @property
    def epsilon(self) -> float:
        """ε spent so far (0 before the first round)."""
        return self._records[-1].epsilon if self._records else 0.0

    def epsilon_if_next_round(self) -> float:
        """ε after one more round, from the config's schedule (computed once per configuration)."""
        if self.rounds >= self.config.rounds:
            raise BudgetExceededError(
                f"all {self.config.rounds} planned rounds have run; the accounting covers no more"
            )
        return epsilon_schedule(self.config).at(self.rounds + 1)

    def check_next_round(self) -> float:
        """ε after one more round; raises BudgetExceededError when it would exceed the budget."""
        next_epsilon = self.epsilon_if_next_round()
        budget = self.config.epsilon_budget
        if budget is not None and next_epsilon > budget:
            raise BudgetExceededError(
                f"round {self.rounds + 1} would raise user-level ε from {self.epsilon:.4g} to "
                f"{next_epsilon:.4g}, above the budget {budget:.4g} (δ = {self.config.delta:g}); "
                "the round was not run. Stop here, or plan a larger noise_multiplier for the next run"
            )
        return next_epsilon

    def record_round(self) -> RoundRecord:
        """Account for one released round (after ``check_next_round`` passed) and return its record."""
        record = RoundRecord(self.rounds, self.check_next_round())
        self._records.append(record)
        return record

    def to_dict(self) -> dict[str, Any]:
        return {
            "config": self.config.to_dict(),
            "records": [r.__dict__.copy() for r in self._records],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "PrivacyLedger":
        """Restore a saved ledger; its rounds must be consecutive and its last ε is recomputed and checked.

        The stored ε must be the schedule's value after that many rounds, or dp_accounting's exact ε of
        that round's event (what ledgers recorded before the schedule existed). A checkpoint whose stored ε
        is neither (edited, or written by another configuration) is refused rather than trusted.
        """
        config = PrivacyConfig(**data["config"])
        records = tuple(RoundRecord(**r) for r in data["records"])
        if [r.round for r in records] != list(range(len(records))):
            raise ValueError("ledger records must be the consecutive rounds 0, 1, ...; this checkpoint is damaged")
        if len(records) > config.rounds:
            raise ValueError(f"ledger checkpoint holds {len(records)} rounds but the configuration plans {config.rounds}")
        if records:
            stored = records[-1].epsilon
            expected = epsilon_schedule(config).at(len(records))
            if not math.isclose(stored, expected, rel_tol=1e-9, abs_tol=1e-12):
                expected = epsilon(config, len(records))
            if not math.isclose(stored, expected, rel_tol=1e-9, abs_tol=1e-12):
                raise ValueError(
                    f"ledger checkpoint says ε = {records[-1].epsilon!r} after {len(records)} rounds, but "
                    f"dp_accounting gives {expected!r} for its configuration; refusing a ledger that does not match"
                )
        return cls(config, records)
