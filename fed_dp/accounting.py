"""User-level ε with dp_accounting: accountants, the per-round ε schedule, calibration of σ for a configuration, and
the per-round ledger (docs/explanation/mechanism.md: Samplers and their accounting; Accounting, calibration, budget).
The σ search itself is ``fed_dp.calibration``, on the configuration's mechanism (:func:`calibrate_noise_multiplier`
builds it), as dp_accounting keeps its ``mechanism_calibration`` apart from its accountants.

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
  bounds the true ε at t′. The ledger uses these values; its budget check replaces such a bound
  by the round's exact ε when the bound alone would refuse the round (``PrivacyLedger.check_next_round``).
"""

from __future__ import annotations

import bisect
import functools
import logging
import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import dp_accounting
import numpy as np
from dp_accounting import rdp
from dp_accounting.pld import common as pld_common
from dp_accounting.pld import privacy_loss_distribution

from fed_dp import calibration
# The calibration's constants, defined in fed_dp.calibration since the search moved there, stay importable here.
from fed_dp.calibration import (CALIBRATION_TOLERANCE, COARSE_CALIBRATION_TOLERANCE,  # noqa: F401
                                COARSE_PLD_DISCRETIZATION, MIN_CALIBRATED_NOISE, PLD_DISCRETIZATION,
                                RDP_MODEL_HALF_WIDTH, SPARSE_RDP_ORDERS)
from fed_dp.config import PrivacyConfig
from fed_dp.sampling import NeighboringRelation, dp_event, neighboring_relation
from fed_dp.validation import check_int

#: PLD schedules are exact at rounds 1 … PLD_DENSE_ROUNDS, then at rounds growing by PLD_ROUND_RATIO, and at T.
PLD_DENSE_ROUNDS = 10
PLD_ROUND_RATIO = 1.25
#: Peak memory of dp_accounting's self-composition per point of the composed dense PMF (FFT buffers and copies):
#: measured 97 bytes (peak RSS 358 MB at 0.60 million points, 887 MB at 6.0 million), rounded up.
PLD_BYTES_PER_POINT = 100
#: A PLD whose composition would take more memory than this is refused before anything is computed.
MAX_PLD_BYTES = 4 * 2**30
#: Wall-clock seconds of one self-composition and ε per point, measured on 2 CPU cores (for messages only).
PLD_SECONDS_PER_POINT = 2e-6
#: A plan whose ε after T rounds exceeds this is warned about before round 1 (:func:`check_plan`): e^100 ≈ 2.7·10⁴³
#: bounds no adversary's odds (σ = 1e-30 gave ε ≈ 2.75·10⁶⁰ without a word).
MEANINGLESS_EPSILON = 100.0


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
    config: PrivacyConfig, *, value_discretization_interval: float = PLD_DISCRETIZATION,
    orders: Sequence[float] | None = None,
) -> dp_accounting.PrivacyAccountant:
    """A fresh accountant of ``config.accountant`` kind under the sampler's neighbouring relation
    (:func:`fed_dp.calibration.new_accountant`).

    ``value_discretization_interval`` applies to PLD only and ``orders`` to RDP only (None: dp_accounting's
    default orders); a reported ε uses the defaults. The σ search builds its accountants, the coarser ones
    included, from a mechanism with ``fed_dp.calibration.new_accountant``, not through this function.
    """
    return calibration.new_accountant(config.accountant, neighboring_relation(config),
                                      value_discretization_interval=value_discretization_interval, orders=orders)


@functools.lru_cache(maxsize=4096)
def epsilon(config: PrivacyConfig, rounds: int | None = None) -> float:
    """User-level ε at ``config.delta`` after ``rounds`` rounds (default: the planned T).

    Memoized on the (frozen, hashable) config and the round count: a PLD evaluation costs about half a
    second whatever the round count (building the sampled-Gaussian PLD dominates), and a comparison of
    several optimizers asks for the same values once per optimizer.
    """
    if config.noise_multiplier == 0:  # the non-private baseline: no noise, no privacy
        return math.inf
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
    rounds = check_int("rounds", rounds, minimum=1)
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


Progress = Callable[[int, int], None]
"""``progress(rounds_done, rounds_total)``: called while a long schedule is computed."""

#: An RDP schedule reports progress every this many rounds.
RDP_PROGRESS_STEP = 4096


def _rdp_epsilons(events: Callable[[int], dp_accounting.DpEvent], relation: NeighboringRelation, delta: float,
                  rounds: range, progress: Progress | None = None) -> list[float]:
    """ε at ``delta`` after each of ``rounds`` with dp_accounting's RDP, ``events(t)`` the event of t rounds: the unit
    event's RDP vector once, then ``rdp.compute_epsilon(orders, n_t · rdp_unit, δ)`` per round (the last (unit, n_t)
    is reused: consecutive rounds share it under min-sep and cyclic sampling). Memory: the list of values, nothing
    per round besides."""
    units: dict[dp_accounting.DpEvent, tuple[list[float], np.ndarray]] = {}
    last_key, last_value = None, math.nan
    out = []
    for t in rounds:
        key = _unit_and_count(events(t))
        if key != last_key:
            unit, count = key
            if unit not in units:
                accountant = calibration.new_accountant("rdp", relation)
                accountant.compose(unit)
                units[unit] = (accountant.orders.tolist(), accountant.rdp)
            orders, unit_rdp = units[unit]
            last_key, last_value = key, float(rdp.compute_epsilon(orders, (count * unit_rdp).tolist(), delta)[0])
        out.append(last_value)
        if progress is not None and (t % RDP_PROGRESS_STEP == 0 or t == rounds[-1]):
            progress(t, rounds[-1])
    return out


def _sampled_gaussian_pld(config: PrivacyConfig, unit: dp_accounting.PoissonSampledDpEvent) -> Any:
    """The PLD of one Poisson-sampled Gaussian, built with the arguments ``PLDAccountant`` uses."""
    return privacy_loss_distribution.from_gaussian_mechanism(
        standard_deviation=unit.event.noise_multiplier,
        value_discretization_interval=PLD_DISCRETIZATION,
        sampling_prob=unit.sampling_probability,
        neighboring_relation=neighboring_relation(config),
    )


def _composed_unit(event: dp_accounting.DpEvent) -> tuple[dp_accounting.PoissonSampledDpEvent, int] | None:
    """(unit, n) when ``event`` is n self-compositions of a Poisson-sampled Gaussian (what :func:`_pld_epsilons`
    composes itself); None for any other event (a fresh accountant, no self-composition of a dense PMF)."""
    unit, count = _unit_and_count(event)
    if isinstance(unit, dp_accounting.PoissonSampledDpEvent) and isinstance(
        unit.event, dp_accounting.GaussianDpEvent
    ) and 0 < unit.sampling_probability and unit.event.noise_multiplier > 0:
        return unit, count
    return None


def pld_composition_points(unit_pld: Any, count: int) -> int:
    """Points of the largest dense PMF that dp_accounting's ``self_compose(count)`` of ``unit_pld`` builds: its
    own truncation bounds (``dp_accounting.pld.common.compute_self_convolve_bounds`` with the default tail mass
    10⁻¹⁵) for each of the PLD's two PMFs, computed without composing."""
    points = 0
    for pmf in (unit_pld._pmf_remove, unit_pld._pmf_add):  # noqa: SLF001 (dp_accounting >= 0.6, < 0.7)
        probs = pmf.to_dense_pmf()._probs  # noqa: SLF001
        low, high = pld_common.compute_self_convolve_bounds(probs, count, 1e-15)
        points = max(points, high - low + 1, len(probs))
    return points


def _check_pld_memory(config: PrivacyConfig, rounds: int, unit_pld: Any, count: int) -> None:
    """Refuse (ValueError) a PLD whose composition after ``rounds`` rounds would need over MAX_PLD_BYTES."""
    points = pld_composition_points(unit_pld, count)
    need = points * PLD_BYTES_PER_POINT
    if need > MAX_PLD_BYTES:
        raise ValueError(
            f"PLD accounting of {rounds:,} rounds composes a privacy-loss distribution of {points:,} points, about "
            f"{need / 2**30:.1f} GB of memory (limit {MAX_PLD_BYTES / 2**30:.0f} GB) and {points * PLD_SECONDS_PER_POINT / 60:.0f}+ "
            "minutes per exact round; refusing before computing it. Use accountant 'rdp' (--accountant rdp: its "
            "memory does not grow with T, and its epsilon is an upper bound too, a little larger), or fewer rounds")


def _pld_epsilons(config: PrivacyConfig, rounds: tuple[int, ...], progress: Progress | None = None) -> dict[int, float]:
    """ε after each of ``rounds`` with dp_accounting's PLD.

    For ``SelfComposed(PoissonSampled(q, Gaussian(σ)), n)`` the unit PLD is built once and composed n times
    exactly as ``PLDAccountant`` does (identity ∘ unit^n, same discretization): the same numbers for a
    fraction of the cost. Any other event goes to a fresh accountant (:func:`epsilon`), once per event.
    Before composing anything, a composition that would need more than MAX_PLD_BYTES is refused (ValueError,
    :func:`pld_composition_points`); one composition is held at a time.
    """
    bases: dict[dp_accounting.DpEvent, Any] = {}
    largest = _composed_unit(dp_event(config, max(rounds)))
    if largest is not None:
        unit, count = largest
        bases[unit] = _sampled_gaussian_pld(config, unit)
        _check_pld_memory(config, max(rounds), bases[unit], count)
    values: dict[dp_accounting.DpEvent, float] = {}
    out = {}
    for t in rounds:
        event = dp_event(config, t)
        if event not in values:
            composed_unit = _composed_unit(event)
            if composed_unit is not None:
                unit, count = composed_unit
                if unit not in bases:
                    bases[unit] = _sampled_gaussian_pld(config, unit)
                composed = privacy_loss_distribution.identity(
                    value_discretization_interval=PLD_DISCRETIZATION
                ).compose(bases[unit].self_compose(count))
                values[event] = float(composed.get_epsilon_for_delta(config.delta))
                del composed
            else:
                values[event] = epsilon(config, t)
        out[t] = values[event]
        if progress is not None:
            progress(t, max(rounds))
    return out


def checked_epsilon(config: PrivacyConfig) -> float:
    """ε after the planned T rounds, as :func:`epsilon`, but a PLD too large for memory is refused first
    (ValueError saying how large and what to do) instead of exhausting the machine."""
    config.require_resolved("the epsilon")
    if config.accountant == "pld" and _composed_unit(dp_event(config)) is not None:
        return _pld_epsilons(config, (config.rounds,))[config.rounds]
    return epsilon(config)


#: From this many rounds on, an ε schedule takes minutes to compute (RDP: about 70 µs a round on a 2-core machine;
#: PLD's exact rounds grow costlier with T): :func:`accounting_note` says so before it is computed.
LONG_ROUNDS = 100_000
#: Memory of a schedule per round (a float and its slot in the list, then in the tuple) and the most a schedule may
#: take: beyond, :func:`compute_epsilon_schedule` refuses the plan before computing it.
SCHEDULE_BYTES_PER_ROUND = 40
MAX_SCHEDULE_BYTES = MAX_PLD_BYTES


def accounting_note(rounds: int, accountant: str | None = None) -> str | None:
    """What to say before computing an ε schedule of ``rounds`` rounds with ``accountant`` (``"pld"`` or ``"rdp"``)
    when it has :data:`LONG_ROUNDS` rounds or more (that it can take minutes); None for a shorter plan. It needs
    those two numbers only; a ``PrivacyConfig`` in place of both, what it took before, is still accepted with a
    DeprecationWarning."""
    if isinstance(rounds, PrivacyConfig):
        warnings.warn("accounting_note(config) is deprecated: pass accounting_note(config.rounds, config.accountant)",
                      DeprecationWarning, stacklevel=2)
        rounds, accountant = rounds.rounds, rounds.accountant
    if rounds < LONG_ROUNDS:
        return None
    return f"accounting {rounds:,} rounds with {accountant} can take minutes"


def _check_schedule_size(rounds: int) -> None:
    """Refuse (ValueError naming privacy.rounds) a plan of ``rounds`` rounds whose schedule of one ε per round would
    not fit in :data:`MAX_SCHEDULE_BYTES`: ``rounds = 1e9`` would fill the memory after hours of accounting."""
    need = rounds * SCHEDULE_BYTES_PER_ROUND
    if need > MAX_SCHEDULE_BYTES:
        raise ValueError(
            f"rounds (privacy.rounds) = {rounds:,}: the ledger's ε schedule holds one value per round, "
            f"{need / 2**30:.0f} GB for this plan (limit {MAX_SCHEDULE_BYTES / 2**30:.0f} GB, "
            f"{MAX_SCHEDULE_BYTES // SCHEDULE_BYTES_PER_ROUND:,} rounds), and accounting it would take hours. "
            "Plan the rounds the run will really take (federated runs take 10² … 10⁵); an ε budget "
            "(privacy.epsilon-budget) stops a run early if needed")


@functools.lru_cache(maxsize=64)
def epsilon_schedule(config: PrivacyConfig) -> EpsilonSchedule:
    """ε after every round 1 … T of ``config`` (memoized per config); see :func:`compute_epsilon_schedule`."""
    return compute_epsilon_schedule(config)


def compute_epsilon_schedule(config: PrivacyConfig, progress: Progress | None = None) -> EpsilonSchedule:
    """ε after every round 1 … T of ``config``; see the module docstring. ``progress(t, T)`` is called after
    each exact PLD round and every RDP_PROGRESS_STEP RDP rounds.

    RDP: exact at every round, O(T) conversions of one RDP vector. PLD: exact at
    :func:`pld_exact_rounds` (and at every round whose event equals an exact round's, e.g. min-sep rounds
    with the same participation count); elsewhere the next exact round's ε, an upper bound. A PLD whose
    composition would need more than MAX_PLD_BYTES of memory is refused (ValueError) before any is computed.
    """
    config.require_resolved("the ε schedule")
    rounds = config.rounds
    _check_schedule_size(rounds)
    if config.noise_multiplier == 0:  # the non-private baseline: ε is infinite after every round
        return EpsilonSchedule(config.accountant, config.delta, (math.inf,) * rounds, tuple(range(1, rounds + 1)))
    if config.accountant == "rdp":
        values = _rdp_epsilons(lambda t: dp_event(config, t), neighboring_relation(config), config.delta,
                               range(1, rounds + 1), progress)
        return EpsilonSchedule("rdp", config.delta, tuple(values), tuple(range(1, rounds + 1)))
    computed = pld_exact_rounds(rounds)
    values = _pld_epsilons(config, computed, progress)
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


def calibrate_noise_multiplier(config: PrivacyConfig, target_epsilon: float) -> float:
    """Smallest σ (to within 1e-6) whose T-round ε at ``config.delta`` is at most ``target_epsilon``.

    The search is :func:`fed_dp.calibration.calibrate` on the configuration's mechanism: its event as a function
    of σ (:func:`fed_dp.sampling.dp_event` of the config with that σ), its accountant and neighbouring relation,
    and δ. The σ returned was evaluated with that accountant, the one that reports ε, and meets the target; a σ
    less than 1e-6 below it was evaluated and misses it. A target already met at σ = MIN_CALIBRATED_NOISE is
    refused. ``config.noise_multiplier`` is ignored.
    """
    if config.noise_multiplier is None:  # a config that asks for calibration: search from a placeholder σ
        config = config.replace(target_epsilon=None, noise_multiplier=1.0)
    config.require_resolved("calibration")
    mechanism = calibration.Mechanism(event=lambda sigma: dp_event(config.replace(noise_multiplier=float(sigma))),
                                      accountant=config.accountant, relation=neighboring_relation(config),
                                      delta=config.delta)
    return calibration.calibrate(mechanism, target_epsilon)


class UnamplifiedBLTWarning(UserWarning):
    """BLT noise planned for min-separation 1: no amplification and the sensitivity of T participations."""


def unamplified_blt_advice(config: PrivacyConfig) -> str | None:
    """What to use instead of BLT noise planned for min-separation 1 (None for any other plan).

    BLT's ε is Gaussian(σ/sens_T) with no amplification by sampling (``fed_dp.sampling.blt_dp_event``), and
    with min-separation 1 (cyclic-poisson with bands = 1, or min-sep with N // B = 1) sens_T is that of a user
    in every one of the T rounds: σ grows with T. For the same ε at δ (the target, else this plan's ε), the
    advice gives the σ this plan needs and, calibrated here (:func:`calibrate_noise_multiplier`), the σ of the
    plans that fit: BLT with sampler min-sep (separation N // B, when that exceeds 1) and independent noise with
    Poisson sampling (amplified)."""
    if config.noise != "blt" or config.min_separation != 1:
        return None
    target = config.target_epsilon if config.target_epsilon is not None else epsilon(config)
    mine = config.noise_multiplier if config.target_epsilon is None else calibrate_noise_multiplier(config, target)
    options = []
    separation = config.num_users // config.expected_cohort
    if separation > 1:
        min_sep = config.replace(sampler="min-sep", bands=1, max_participations=None)
        options.append(f"sampler 'min-sep' (separation N // B = {separation}): "
                       f"sigma = {calibrate_noise_multiplier(min_sep, target):.4g}")
    poisson = config.replace(sampler="poisson", noise="independent", buffers=None, bands=1, workload="prefix-sum",
                             momentum=0.0, max_participations=None)
    options.append(f"noise 'independent' with sampler 'poisson' (amplified by sampling): "
                   f"sigma = {calibrate_noise_multiplier(poisson, target):.4g}")
    return (f"noise 'blt' with sampler {config.sampler!r}" + (" and bands = 1" if config.sampler == "cyclic-poisson"
                                                              else "") +
            f" plans for min-separation 1: the BLT gets no amplification from sampling and is accounted for a "
            f"user in all T = {config.rounds} rounds, so epsilon {target:.4g} at delta {config.delta:g} needs "
            f"sigma = {mine:.4g}. For the same epsilon: " + "; ".join(options) +
            ". Use one of those (or cyclic-poisson with bands > 1)")


def resolve_privacy(config: PrivacyConfig, num_users: int | None = None) -> PrivacyConfig:
    """The config with its population and σ filled in: what samplers, noise and accounting run on.

    ``num_users`` is the task's population N; it fills ``config.num_users`` when that is None and must
    equal it otherwise. With ``target_epsilon``, σ is calibrated now (:func:`calibrate_noise_multiplier`:
    the smallest σ whose T-round ε at δ is at most the target) and the result carries that σ, with
    ``target_epsilon`` cleared. BLT noise planned for min-separation 1 is warned about first, whether σ is
    calibrated or given (:class:`UnamplifiedBLTWarning` with :func:`unamplified_blt_advice`: the σ of the plans
    that fit for the same ε).
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
    advice = unamplified_blt_advice(config) if config.noise_multiplier != 0 else None  # σ = 0 is not private
    if advice is not None:  # calibrated or given, the same plan costs the same: say so before a σ of, say, 91 runs
        warnings.warn(advice, UnamplifiedBLTWarning, stacklevel=2)
    if config.target_epsilon is not None:
        sigma = calibrate_noise_multiplier(config, config.target_epsilon)
        config = config.replace(target_epsilon=None, noise_multiplier=sigma)
    return config


class WeakGuaranteeWarning(UserWarning):
    """The plan runs, but its guarantee is weak or void: ε after T rounds above :data:`MEANINGLESS_EPSILON`, δ ≥ 1/N
    (allowed by ``allow_large_delta``), or an ε budget that stops the run before its last round."""


def rounds_within_budget(config: PrivacyConfig) -> int:
    """How many rounds the ledger of ``config`` releases before its ``epsilon_budget`` refuses one (T without a
    budget): the rounds whose schedule ε is within it, and, where a PLD schedule's upper bound is over it, those whose
    exact ε is (as :meth:`PrivacyLedger.check_next_round` decides)."""
    config.require_resolved("rounds_within_budget")
    if config.epsilon_budget is None:
        return config.rounds
    schedule = epsilon_schedule(config)
    allowed = bisect.bisect_right(schedule.epsilons, config.epsilon_budget)  # the schedule is nondecreasing
    while (allowed < config.rounds and not _is_exact_round(schedule, allowed + 1)
           and epsilon(config, allowed + 1) <= config.epsilon_budget):
        allowed += 1
    return allowed


def check_plan(config: PrivacyConfig) -> None:
    """Before round 1 (``fed_dp.round.init_server``, every engine): what the resolved plan promises, said once.

    * An ``epsilon_budget`` below ε after the first round: the run could release nothing (ValueError).
    * A budget below ε after T rounds: the run stops after k < T rounds (:class:`WeakGuaranteeWarning`, naming k).
    * ε after T rounds above :data:`MEANINGLESS_EPSILON` (e.g. a σ of 1e-30): warned, with the ε.
    * δ ≥ 1/N, which ``PrivacyConfig`` refuses unless ``allow_large_delta``: warned, naming N.

    The ε schedule it reads is the one the ledger uses (memoized): nothing is computed twice. The non-private
    baseline (σ = 0) has its own warning in the round loop."""
    config.require_resolved("the plan check")
    if config.non_private:
        return
    planned = epsilon_schedule(config).at(config.rounds)
    budget = config.epsilon_budget
    if budget is not None and planned > budget:
        allowed = rounds_within_budget(config)
        if allowed == 0:
            raise ValueError(
                f"epsilon_budget (privacy.epsilon-budget) = {budget:g} is below epsilon after round 1 "
                f"({epsilon_schedule(config).at(1):.4g} at delta {config.delta:g}, sigma {config.noise_multiplier:.4g}): "
                "the run could release no round at all. Raise the budget, or give target_epsilon "
                "(privacy.target-epsilon) at most the budget to calibrate sigma for it; nothing was run")
        warnings.warn(
            f"epsilon_budget (privacy.epsilon-budget) = {budget:g} stops this run after round {allowed} of "
            f"{config.rounds}: epsilon after all {config.rounds} rounds would be {planned:.4g} (sigma "
            f"{config.noise_multiplier:.4g}, delta {config.delta:g}). To train every round within it, give "
            "target_epsilon (privacy.target-epsilon) = the budget instead of a noise multiplier, or plan "
            f"rounds = {allowed}", WeakGuaranteeWarning, stacklevel=3)
    if planned > MEANINGLESS_EPSILON:
        warnings.warn(
            f"this plan's user-level epsilon after {config.rounds} rounds is {planned:.4g} at delta {config.delta:g} "
            f"(sigma {config.noise_multiplier:.4g}): above {MEANINGLESS_EPSILON:g}, a bound e^epsilon on anyone's "
            "odds means nothing. Raise noise_multiplier (privacy.noise-multiplier) or give target_epsilon "
            "(privacy.target-epsilon); for a non-private baseline say so with noise_multiplier = 0 (simulations only)",
            WeakGuaranteeWarning, stacklevel=3)
    if not config.delta < 1 / config.num_users:
        warnings.warn(
            f"delta = {config.delta:g} is not below 1/N = {1 / config.num_users:.4g} (N = {config.num_users} users), "
            "allowed by allow_large_delta: a mechanism that publishes each user's whole data with probability "
            "delta meets this (epsilon, delta), so the reported epsilon does not protect every user",
            WeakGuaranteeWarning, stacklevel=3)


def _is_exact_round(schedule: EpsilonSchedule, rounds: int) -> bool:
    """Whether the schedule's value after ``rounds`` rounds is dp_accounting's exact ε (its exact rounds are sorted)."""
    index = bisect.bisect_left(schedule.exact_rounds, rounds)
    return index < len(schedule.exact_rounds) and schedule.exact_rounds[index] == rounds


@dataclass(frozen=True)
class RoundRecord:
    """One released round: its number t (1 … T, the t-th release) and ε after it (no cohort size: it is computed from the
    population, outside the accounted release, and is not part of what the ledger publishes)."""

    round: int
    epsilon: float


class PrivacyLedger:
    """Per-round record of what was released, with ε so far, and the budget check.

    ε after t rounds is :func:`epsilon_schedule` of the config at t: dp_accounting's ε of
    ``dp_event(config, t)``, the event of the sampler that actually ran (with PLD, between the schedule's
    exact rounds, the next exact round's ε: an upper bound). ``check_next_round`` raises
    :class:`BudgetExceededError` if running one more round would take ε above ``config.epsilon_budget``,
    before anything is released. With PLD, when the schedule's upper bound of a round between exact rounds
    is over the budget, the round's exact ε (one fresh accountant, :func:`epsilon`) decides and is recorded,
    so a round within budget is never refused for the bound's slack. Dropped users do not change the ledger:
    the round releases with the same noise and counts in full.
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
        """ε after one more round; raises BudgetExceededError when it would exceed the budget.

        Between a PLD schedule's exact rounds the schedule holds the next exact round's ε, an upper bound (up
        to about 12% above the exact value). Only when that bound is over the budget is the round's exact ε
        computed (dp_accounting's PLD of ``dp_event(config, t)``, memoized) and used instead: the decision is
        then on the exact ε, and the value returned (and recorded) is that exact ε."""
        next_epsilon = self.epsilon_if_next_round()
        budget = self.config.epsilon_budget
        t = self.rounds + 1
        if budget is not None and next_epsilon > budget and not _is_exact_round(epsilon_schedule(self.config), t):
            next_epsilon = epsilon(self.config, t)
        if budget is not None and next_epsilon > budget:
            raise BudgetExceededError(
                f"round {self.rounds + 1} would raise user-level ε from {self.epsilon:.4g} to "
                f"{next_epsilon:.4g}, above the budget {budget:.4g} (δ = {self.config.delta:g}); "
                "the round was not run. Stop here, or plan a larger noise_multiplier for the next run"
            )
        return next_epsilon

    def record_round(self) -> RoundRecord:
        """Account for one released round (after ``check_next_round`` passed) and return its record."""
        record = RoundRecord(self.rounds + 1, self.check_next_round())
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
        if [r.round for r in records] != list(range(1, len(records) + 1)):
            raise ValueError("ledger records must be the consecutive rounds 1, 2, ...; this checkpoint is damaged")
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
