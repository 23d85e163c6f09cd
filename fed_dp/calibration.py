"""Calibration of σ: the smallest noise multiplier whose user-level ε meets a target (docs/explanation/mechanism.md:
Accounting, calibration, budget).

Kept apart from the accounting of a configuration, as dp_accounting keeps ``mechanism_calibration.py`` apart from
its accountants: nothing here reads a :class:`~fed_dp.config.PrivacyConfig`. A search sees a :class:`Mechanism`
— the dp_accounting event of the whole run as a function of σ (dp_accounting's ``make_event_from_param``), the
accountant kind and neighbouring relation that report ε, and δ — and returns σ (:func:`calibrate`).
``fed_dp.accounting.calibrate_noise_multiplier`` builds the mechanism of a configuration (its event from
``fed_dp.sampling.dp_event``) and calls it; ``fed_dp.accounting`` also builds its accountants here
(:func:`new_accountant`), so a calibrated σ is evaluated by the accountant that reports ε.

Every calibration ends in :func:`_certified_sigma`: the σ returned was evaluated with the accountant that reports
ε and meets the target, next to a σ' ≥ σ − tol evaluated and missing it. Everything before that only predicts
where to look, with cheap models (RDP over a few orders, a coarser PLD): a poor prediction costs evaluations,
never validity.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import dp_accounting
from dp_accounting import pld, rdp

#: Smallest σ that calibration considers; a target ε reachable only below it is refused.
MIN_CALIBRATED_NOISE = 1e-2
#: Tolerance of calibration in σ: the σ returned is within this of the smallest σ that meets the target.
CALIBRATION_TOLERANCE = 1e-6
#: dp_accounting's PLDAccountant default value discretization; every reported PLD ε uses it.
PLD_DISCRETIZATION = 1e-4
#: A 10× coarser PLD, used only to predict σ before the exact search (it is never reported).
COARSE_PLD_DISCRETIZATION = 1e-3
#: The secant search on the coarse PLD stops when its next step is shorter than this.
COARSE_CALIBRATION_TOLERANCE = 1e-5
#: Calibration first predicts the RDP root over these orders only (a few of dp_accounting's defaults) ...
SPARSE_RDP_ORDERS = (1.5, 2.0, 3.0, 4.0, 5.0, 6.0, 8.0, 10.0, 12, 16, 20, 24, 32, 48, 63, 128, 256)
#: ... then over the optimal order there and this many of dp_accounting's orders on each side of it.
RDP_MODEL_HALF_WIDTH = 3


def new_accountant(kind: str, relation: dp_accounting.NeighboringRelation, *,
                   value_discretization_interval: float = PLD_DISCRETIZATION,
                   orders: Sequence[float] | None = None) -> dp_accounting.PrivacyAccountant:
    """A fresh dp_accounting accountant: ``kind`` ``"pld"`` (``value_discretization_interval``) or ``"rdp"``
    (``orders``; None: dp_accounting's default orders), under the neighbouring ``relation``. Anything but the
    defaults is for predicting σ during calibration, never for a reported ε."""
    if kind == "pld":
        return pld.PLDAccountant(neighboring_relation=relation, value_discretization_interval=value_discretization_interval)
    return rdp.RdpAccountant(orders=orders, neighboring_relation=relation)


@dataclass(frozen=True)
class Mechanism:
    """What a calibration needs of a plan, and nothing else: ``event(σ)``, the dp_accounting event of the whole
    run with noise multiplier σ; ``accountant`` (``"pld"`` or ``"rdp"``) and ``relation``, the accountant that
    reports ε; ``delta``, δ of the target (ε, δ)."""

    event: Callable[[float], dp_accounting.DpEvent]
    accountant: str
    relation: dp_accounting.NeighboringRelation
    delta: float
    _seen: dict[float, float] = field(default_factory=dict, init=False, repr=False, compare=False)

    def epsilon(self, sigma: float) -> float:
        """ε at δ of ``event(σ)`` from a fresh accountant of the reporting kind: the ε a run with this σ reports
        (each σ evaluated once per mechanism)."""
        if sigma not in self._seen:
            accountant = new_accountant(self.accountant, self.relation)
            accountant.compose(self.event(sigma))
            self._seen[sigma] = float(accountant.get_epsilon(self.delta))
        return self._seen[sigma]


def _calibrate(mechanism: Mechanism, target_epsilon: float, bracket: Any, *,
               value_discretization_interval: float = PLD_DISCRETIZATION, tol: float = CALIBRATION_TOLERANCE) -> float:
    """dp_accounting.calibrate_dp_mechanism with the mechanism's own event builder and accountant."""
    return float(
        dp_accounting.calibrate_dp_mechanism(
            lambda: new_accountant(mechanism.accountant, mechanism.relation,
                                   value_discretization_interval=value_discretization_interval),
            lambda sigma: mechanism.event(float(sigma)),
            target_epsilon,
            mechanism.delta,
            bracket_interval=bracket,
            tol=tol,
        )
    )


def _composed_rdp(mechanism: Mechanism, sigma: float, orders: Sequence[float] | None = None) -> rdp.RdpAccountant:
    """An RDP accountant (over ``orders``; default: dp_accounting's, as a reported RDP ε uses) that has composed
    the mechanism's event at σ."""
    accountant = new_accountant("rdp", mechanism.relation, orders=orders)
    accountant.compose(mechanism.event(sigma))
    return accountant


def _coarse_epsilon(mechanism: Mechanism, sigma: float,
                    value_discretization_interval: float = COARSE_PLD_DISCRETIZATION) -> float:
    """PLD ε at σ with a coarser discretization than the reported one: to predict σ, never reported."""
    accountant = new_accountant(mechanism.accountant, mechanism.relation,
                                value_discretization_interval=value_discretization_interval)
    accountant.compose(mechanism.event(sigma))
    return float(accountant.get_epsilon(mechanism.delta))


def _secant_root(epsilon_at: Callable[[float], float], target_epsilon: float, start: float, *, xtol: float,
                 slope: float | None = None) -> tuple[float, float, float]:
    """Where a decreasing ε(σ) crosses the target, by secant steps on log ε against log σ from ``start``.

    ε is close to a power of σ (∝ 1/σ for a Gaussian), so in log–log coordinates the secant is nearly the
    curve. The second point is a Newton step from ``start`` with ``slope`` (an estimate of dε/dσ < 0), or
    without one with ε ∝ 1/σ; each later one is the root of the secant through the last two points (of
    ε ∝ 1/σ again where that secant does not fall). A step changes σ by at most a factor 2 and never goes
    below MIN_CALIBRATED_NOISE. It stops when the next step would be shorter than ``xtol`` (or after 50
    steps) and returns the last σ evaluated, its gap ε(σ) − target, and dε/dσ there from the last secant.
    A prediction only: nothing here is certified.
    """

    def log_gap(sigma: float) -> tuple[float, float]:  # (ε(σ), log ε(σ) − log target)
        value = epsilon_at(sigma)
        return value, math.log(max(value, 1e-12 * target_epsilon) / target_epsilon)

    sigma = float(start)
    value, gap = log_gap(sigma)
    power = slope * sigma / value if slope is not None and slope < 0 else -1.0  # d log ε / d log σ
    for _ in range(50):
        proposal = sigma * math.exp(min(max(-gap / power, -math.log(2)), math.log(2)))
        proposal = max(proposal, MIN_CALIBRATED_NOISE)
        if abs(proposal - sigma) <= xtol:
            break
        previous, previous_gap = sigma, gap
        sigma = proposal
        value, gap = log_gap(sigma)
        secant = (gap - previous_gap) / math.log(sigma / previous)
        power = secant if secant < 0 else -1.0
    return sigma, value - target_epsilon, power * value / sigma


def _restricted_rdp_root(mechanism: Mechanism, target_epsilon: float, orders: Sequence[float], start: float, *,
                         xtol: float, slope: float | None = None) -> tuple[float, float]:
    """The root of RDP ε restricted to ``orders``, and dε/dσ there, by :func:`_secant_root`.

    dp_accounting's RDP ε is the minimum over its orders α of a per-order bound ε_α(σ); over a subset of the
    orders the minimum is at least as large, and the same wherever the optimal order is in the subset. An
    evaluation over a few orders costs a millisecond or so, a full one tens of milliseconds.
    """
    sigma, _, slope = _secant_root(
        lambda s: float(_composed_rdp(mechanism, s, orders).get_epsilon(mechanism.delta)),
        target_epsilon, start, xtol=xtol, slope=slope)
    return sigma, slope


def _sparse_rdp_root(mechanism: Mechanism, target_epsilon: float) -> tuple[float, float]:
    """The root of RDP over SPARSE_RDP_ORDERS, searched from σ = 1, and dε/dσ there: at or above the full RDP
    root, within a few percent of it, for about ten evaluations of a millisecond or so."""
    return _restricted_rdp_root(mechanism, target_epsilon, SPARSE_RDP_ORDERS, 1.0, xtol=COARSE_CALIBRATION_TOLERANCE)


def _rdp_prediction(mechanism: Mechanism, target_epsilon: float) -> tuple[float, float]:
    """A prediction of the RDP root to ~1e-8, and dε/dσ there, for one full RDP evaluation.

    One full evaluation at :func:`_sparse_rdp_root` gives the optimal order there. The prediction is the root
    over a window of that order and RDP_MODEL_HALF_WIDTH orders on each side: the true root, if the optimal
    order there is inside the window. While the window's own optimal order at its root is at an end of the
    window (and not of all the orders), the window moves to centre on it and the root is searched again.
    """
    sigma, slope = _sparse_rdp_root(mechanism, target_epsilon)
    full = _composed_rdp(mechanism, sigma)
    orders = full.orders.tolist()
    order = full.get_epsilon_and_optimal_order(mechanism.delta)[1]
    for _ in range(len(orders)):
        i = orders.index(order)
        window = orders[max(0, i - RDP_MODEL_HALF_WIDTH): i + RDP_MODEL_HALF_WIDTH + 1]
        sigma, slope = _restricted_rdp_root(mechanism, target_epsilon, window, sigma,
                                            xtol=CALIBRATION_TOLERANCE / 100, slope=slope)
        model = _composed_rdp(mechanism, sigma, window)
        order = model.get_epsilon_and_optimal_order(mechanism.delta)[1]
        if window[0] < order < window[-1] or order in (orders[0], orders[-1]):
            break
    return sigma, slope


def _richardson_pld_root(mechanism: Mechanism, target_epsilon: float, sigma: float, coarse: float,
                         slope: float) -> float:
    """A prediction of the PLD root: a Newton step from σ (near the coarse root) on the reported PLD ε at σ,
    itself predicted by Richardson extrapolation in the discretization Δ from ``coarse``, the PLD ε at σ
    with Δ = COARSE_PLD_DISCRETIZATION, and the PLD ε at Δ/2.

    dp_accounting's pessimistic discretization overstates ε by about c·Δ² (measured on Poisson events from
    T = 5 to 10,000: the excess shrinks fourfold when Δ halves), so with Δ = COARSE_PLD_DISCRETIZATION the
    limit is ε₀ ≈ (4·ε(Δ/2) − ε(Δ))/3 and the reported ε(d) ≈ ε₀ + (ε(Δ) − ε₀)·(d/Δ)², d =
    PLD_DISCRETIZATION. Measured error of the predicted ε, in σ: 3e-9 to 2.3e-7 on most configurations
    tried, 6.6e-7 at q = 0.2, T = 5 and 6.7e-6 at q = 0.001, T = 10,000 (the certificate then takes a
    third evaluation).
    Costs one PLD evaluation, at Δ/2.
    """
    finer = _coarse_epsilon(mechanism, sigma, COARSE_PLD_DISCRETIZATION / 2)
    limit = (4 * finer - coarse) / 3
    predicted = limit + (coarse - limit) * (PLD_DISCRETIZATION / COARSE_PLD_DISCRETIZATION) ** 2
    return sigma - (predicted - target_epsilon) / slope


def _certified_sigma(mechanism: Mechanism, target_epsilon: float, root: float, slope: float) -> float:
    """The smallest σ whose ε (the mechanism's accountant, as reported) is ≤ target, to within
    CALIBRATION_TOLERANCE, from a prediction ``root`` of it and the slope dε/dσ < 0 of the model behind it.

    Probes root + 0.45·tol (expected to meet the target), then root − 0.45·tol (expected to miss it). It
    tracks ``upper``, the smallest σ evaluated whose ε ≤ target, and ``lower``, the largest whose ε >
    target, and returns ``upper`` once upper − lower ≤ tol: a σ whose ε was evaluated and is ≤ target, as
    ``dp_accounting.calibrate_dp_mechanism`` guarantees, with a σ less than tol below it that misses.
    When a probe shows the root above it, or more than tol below it, the next prediction is a Newton step
    from that probe, with the secant through the last two evaluations when they are more than 10·tol apart
    (rounding noise dominates closer) and fall, else with ``slope``. A prediction within 0.45·tol of the root
    costs two evaluations, one further off usually three. If four rounds do not certify,
    calibrate_dp_mechanism finishes the search on a bracket around the points seen.
    """
    tol = CALIBRATION_TOLERANCE
    guess, root, lower, upper = root, float(root), 0.0, math.inf
    seen: list[tuple[float, float]] = []  # (σ, ε(σ) − target) of every evaluation, in order

    def gap(sigma: float) -> float:
        nonlocal lower, upper
        value = mechanism.epsilon(sigma) - target_epsilon
        if value <= 0:
            upper = min(upper, sigma)
        else:
            lower = max(lower, sigma)
        seen.append((sigma, value))
        return value

    for _ in range(4):
        for sigma in (root + 0.45 * tol, root - 0.45 * tol):  # not ± tol/2: rounding could set them > tol apart
            if upper - lower <= tol:
                return upper
            if not lower < sigma < upper:
                continue
            value = gap(sigma)
            if value > 0 or value / slope > tol:  # the root is above this probe, or more than tol below it
                break
        if len(seen) >= 2 and abs(seen[-1][0] - seen[-2][0]) > 10 * tol:
            secant = (seen[-1][1] - seen[-2][1]) / (seen[-1][0] - seen[-2][0])
            slope = secant if secant < 0 else slope
        root = seen[-1][0] - seen[-1][1] / slope
    if upper - lower <= tol:
        return upper
    return _calibrate(mechanism, target_epsilon, _fine_bracket(mechanism, target_epsilon, lower, upper, guess))


def _fine_bracket(mechanism: Mechanism, target_epsilon: float, lower: float, upper: float, guess: float) -> Any:
    """An explicit bracket for the mechanism's accountant from what the Newton steps left: widen by 1% steps."""
    step = 1.01
    if lower <= 0:
        lower = guess if math.isfinite(upper) and guess < upper else (upper if math.isfinite(upper) else guess) / step
        while mechanism.epsilon(lower) <= target_epsilon:
            lower /= step
            if lower < MIN_CALIBRATED_NOISE:
                raise ValueError(f"target epsilon {target_epsilon} needs σ < {MIN_CALIBRATED_NOISE}; choose a smaller epsilon")
    if not math.isfinite(upper):
        upper = lower * step
        while mechanism.epsilon(upper) > target_epsilon:
            upper *= step
    return dp_accounting.ExplicitBracketInterval(lower, upper)


def calibrate(mechanism: Mechanism, target_epsilon: float) -> float:
    """Smallest σ (to within CALIBRATION_TOLERANCE = 1e-6) whose ε at ``mechanism.delta`` is at most
    ``target_epsilon`` (``fed_dp.accounting.calibrate_noise_multiplier`` calls it with a configuration's mechanism).

    The σ returned was evaluated with the mechanism's own accountant, the one that reports ε, and meets the
    target; a σ less than 1e-6 below it was evaluated and misses it (:func:`_certified_sigma`). Before
    that, cheap models predict σ, so that the certificate needs few evaluations of that accountant:

    * RDP (:func:`_rdp_prediction`): log–log secant steps on RDP over a few sparse orders, one full RDP
      evaluation there for the optimal order, secant steps on RDP over that order and its neighbours;
      then the certificate, usually two full evaluations. Four full RDP evaluations in all with the
      refusal check below (``dp_accounting.calibrate_dp_mechanism`` takes 13–15).
    * PLD: the sparse-order RDP root (:func:`_sparse_rdp_root`) starts log–log secant steps on a 10×
      coarser PLD (never reported); Richardson extrapolation from it and a 5× coarser PLD predicts the
      reported PLD's root (:func:`_richardson_pld_root`); the certificate takes two PLD evaluations when
      that prediction is within 0.45e-6 of the root, usually three otherwise. The search never evaluates
      PLD at a tiny σ.

    A target already met at σ = MIN_CALIBRATED_NOISE (by RDP, an upper bound on PLD) is refused.
    """
    if not (isinstance(target_epsilon, (int, float)) and math.isfinite(target_epsilon) and target_epsilon > 0):
        raise ValueError(f"target epsilon must be a finite number > 0, got {target_epsilon!r}")
    rdp_mechanism = replace(mechanism, accountant="rdp")
    if rdp_mechanism.epsilon(MIN_CALIBRATED_NOISE) <= target_epsilon:
        raise ValueError(
            f"target epsilon {target_epsilon} is reached already with σ = {MIN_CALIBRATED_NOISE}; "
            "such a target gives no meaningful protection — choose a smaller epsilon"
        )
    if mechanism.accountant == "rdp":
        return _certified_sigma(mechanism, target_epsilon, *_rdp_prediction(mechanism, target_epsilon))
    start, rdp_slope = _sparse_rdp_root(rdp_mechanism, target_epsilon)
    sigma, gap, slope = _secant_root(lambda s: _coarse_epsilon(mechanism, s), target_epsilon, start,
                                     xtol=COARSE_CALIBRATION_TOLERANCE, slope=rdp_slope)
    if gap <= 0 and sigma <= MIN_CALIBRATED_NOISE:
        raise ValueError(f"target epsilon {target_epsilon} needs σ < {MIN_CALIBRATED_NOISE}; choose a smaller epsilon")
    root = _richardson_pld_root(mechanism, target_epsilon, sigma, gap + target_epsilon, slope)
    return _certified_sigma(mechanism, target_epsilon, root, slope)
