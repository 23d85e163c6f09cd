"""Tests of fed_dp.accounting: user-level ε, calibration of σ, and the per-round privacy ledger.

Every expected ε is computed here with dp_accounting on an event built by hand (docs/explanation/mechanism.md, Samplers and their accounting), or
is an independent literature figure. PLD evaluations are slow at small σ, so the PLD
cases use moderate σ and few rounds; RDP is used where the property does not depend on the accountant.
"""

from __future__ import annotations

import json
import math

import dp_accounting
import pytest
from dp_accounting import pld, rdp

import fed_dp.calibration as calibration
from fed_dp.accounting import (
    CALIBRATION_TOLERANCE,
    COARSE_PLD_DISCRETIZATION,
    MIN_CALIBRATED_NOISE,
    PLD_DISCRETIZATION,
    BudgetExceededError,
    PrivacyLedger,
    calibrate_noise_multiplier,
    epsilon,
)
from fed_dp.calibration import Mechanism, _certified_sigma, _coarse_epsilon, _rdp_prediction, _richardson_pld_root, _secant_root
from fed_dp.config import PrivacyConfig
from fed_dp.sampling import dp_event, neighboring_relation

ADD_REMOVE = dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE
REPLACE_ONE = dp_accounting.NeighboringRelation.REPLACE_ONE
REL = 1e-9


def direct_epsilon(event, accountant: str, delta: float, relation=ADD_REMOVE) -> float:
    acc = pld.PLDAccountant(neighboring_relation=relation) if accountant == "pld" else rdp.RdpAccountant(
        neighboring_relation=relation)
    acc.compose(event)
    return acc.get_epsilon(delta)


def poisson_event(q: float, sigma: float, rounds: int):
    return dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), rounds)


# ------------------------------------------------------------------------------------------------
# Reference figures from the seed papers and dp_accounting (independent of this code)
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("accountant, expected", [("rdp", 5.63), ("pld", 5.19)])
def test_reference_figure_poisson(accountant, expected):
    cfg = PrivacyConfig(num_users=10_000, expected_cohort=100, rounds=10_000, noise_multiplier=1.1,
                        delta=1e-5, accountant=accountant)
    assert cfg.sampling_rate == 0.01
    assert round(epsilon(cfg), 2) == expected


# ------------------------------------------------------------------------------------------------
# Calibration
# ------------------------------------------------------------------------------------------------


def _hand_event_at(cfg: PrivacyConfig, t: int):
    """The §4 event after t rounds, written out per sampler (independent of fed_dp.sampling)."""
    N, B, b, s = cfg.num_users, cfg.expected_cohort, cfg.bands, cfg.noise_multiplier
    if cfg.sampler == "poisson":
        return poisson_event(B / N, s, t)
    if cfg.sampler == "cyclic-poisson":
        return poisson_event(B * b / N, s, math.ceil(t / b))
    if cfg.sampler == "min-sep":
        return dp_accounting.GaussianDpEvent(s / math.sqrt(math.ceil(t / (N // B))))
    if cfg.sampler == "all":
        return dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(s), t)
    if cfg.sampler == "without-replacement":
        return dp_accounting.SelfComposedDpEvent(
            dp_accounting.SampledWithoutReplacementDpEvent(N, B, dp_accounting.GaussianDpEvent(s / 2)), t)
    raise AssertionError(cfg.sampler)


def _hand_event(cfg: PrivacyConfig, sigma: float):
    """The §4 event of cfg's full run at multiplier ``sigma``."""
    return _hand_event_at(cfg.replace(noise_multiplier=sigma), cfg.rounds)


CALIBRATION_CASES = [
    # PLD on Poisson: σ* ≈ 1.36, so PLD is never evaluated at very small σ (which is slow).
    pytest.param(PrivacyConfig(num_users=1000, expected_cohort=100, rounds=20, noise_multiplier=1.0,
                               delta=1e-5), 2.0, id="poisson-pld"),
    pytest.param(PrivacyConfig(num_users=1000, expected_cohort=10, rounds=50, noise_multiplier=1.0,
                               delta=1e-5, accountant="rdp"), 1.0, id="poisson-rdp"),
    pytest.param(PrivacyConfig(num_users=1000, expected_cohort=100, rounds=45, noise_multiplier=1.0,
                               delta=1e-5, sampler="min-sep", noise="bandmf", bands=3), 2.0,
                 id="bandmf-min-sep-pld"),
    pytest.param(PrivacyConfig(num_users=1000, expected_cohort=20, rounds=30, noise_multiplier=1.0,
                               delta=1e-5, sampler="cyclic-poisson", noise="bandmf", bands=4,
                               accountant="rdp"), 2.0, id="bandmf-cyclic-rdp"),
]


@pytest.mark.parametrize("cfg, target", CALIBRATION_CASES)
def test_calibration_round_trip_is_valid_and_tight(cfg, target):
    sigma = calibrate_noise_multiplier(cfg, target)
    # Valid: the calibrated σ meets the target, also according to dp_accounting on the hand-built event.
    assert epsilon(cfg.replace(noise_multiplier=sigma)) <= target
    assert direct_epsilon(_hand_event(cfg, sigma), cfg.accountant, cfg.delta) <= target
    # Tight: 0.1 % less noise already exceeds the target.
    assert direct_epsilon(_hand_event(cfg, sigma * (1 - 1e-3)), cfg.accountant, cfg.delta) > target


def test_calibration_ignores_the_config_sigma():
    cfg = PrivacyConfig(num_users=1000, expected_cohort=10, rounds=50, noise_multiplier=1.0, delta=1e-5,
                        accountant="rdp")
    assert calibrate_noise_multiplier(cfg, 1.0) == pytest.approx(
        calibrate_noise_multiplier(cfg.replace(noise_multiplier=7.0), 1.0), rel=1e-5)


@pytest.mark.parametrize("accountant", ["rdp", "pld"])
def test_calibration_refuses_unreachable_or_meaningless_targets(accountant):
    cfg = PrivacyConfig(num_users=1000, expected_cohort=100, rounds=20, noise_multiplier=1.0, delta=1e-5,
                        accountant=accountant)
    # A target so large that almost no noise reaches it: dp_accounting's own ε at σ = 0.01 is below it.
    huge = 2 * direct_epsilon(poisson_event(0.1, 0.01, 20), "rdp", 1e-5)
    with pytest.raises(ValueError, match="epsilon"):
        calibrate_noise_multiplier(cfg, huge)
    for bad in (0.0, -1.0, math.inf, math.nan):
        with pytest.raises(ValueError, match="epsilon"):
            calibrate_noise_multiplier(cfg, bad)


# --- calibration: certified, equal to dp_accounting's own search, in few evaluations ----------------------
TOL = CALIBRATION_TOLERANCE


def _fresh_accountant(cfg: PrivacyConfig):
    relation = REPLACE_ONE if cfg.sampler == "without-replacement" else ADD_REMOVE
    if cfg.accountant == "pld":
        return pld.PLDAccountant(neighboring_relation=relation)
    return rdp.RdpAccountant(neighboring_relation=relation)


def _hand_epsilon(cfg: PrivacyConfig, sigma: float) -> float:
    """ε of cfg's run at ``sigma``: a fresh dp_accounting accountant on the hand-built §4 event."""
    return _fresh_accountant(cfg).compose(_hand_event(cfg, sigma)).get_epsilon(cfg.delta)


def _reference_root(cfg: PrivacyConfig, target: float, lo: float, hi: float, tol: float) -> float:
    """dp_accounting.calibrate_dp_mechanism itself (Brent's method) on the hand-built event, fresh accountants."""
    return dp_accounting.calibrate_dp_mechanism(
        lambda: _fresh_accountant(cfg), lambda sigma: _hand_event(cfg, sigma), target, cfg.delta,
        bracket_interval=dp_accounting.ExplicitBracketInterval(lo, hi), tol=tol)


@pytest.fixture
def evaluations(monkeypatch):
    """Counts the accountants calibration builds (each composes one event: one ε evaluation), by kind:
    ``rdp``/``pld`` the reported accountants, ``rdp-orders`` RDP over a few orders, ``pld-coarse`` and
    ``pld-finer`` the PLD at COARSE_PLD_DISCRETIZATION and half of it. The memo of ε is cleared first."""
    counts: dict[str, int] = {}
    make = calibration.new_accountant

    def counting(kind, relation, **kwargs):
        if kwargs.get("orders") is not None:
            kind_counted = "rdp-orders"
        elif kind == "rdp":
            kind_counted = "rdp"
        else:
            kind_counted = {PLD_DISCRETIZATION: "pld", COARSE_PLD_DISCRETIZATION: "pld-coarse",
                            COARSE_PLD_DISCRETIZATION / 2: "pld-finer"}[
                kwargs.get("value_discretization_interval", PLD_DISCRETIZATION)]
        counts[kind_counted] = counts.get(kind_counted, 0) + 1
        return make(kind, relation, **kwargs)

    epsilon.cache_clear()
    monkeypatch.setattr(calibration, "new_accountant", counting)
    return counts


def mechanism(cfg: PrivacyConfig) -> Mechanism:
    """The mechanism ``calibrate_noise_multiplier`` calibrates for ``cfg`` (what the private helpers take)."""
    return Mechanism(event=lambda sigma: dp_event(cfg.replace(noise_multiplier=float(sigma))),
                     accountant=cfg.accountant, relation=neighboring_relation(cfg), delta=cfg.delta)


def _poisson(**changes) -> PrivacyConfig:
    return PrivacyConfig(**{**dict(num_users=1000, expected_cohort=100, rounds=20, noise_multiplier=1.0,
                                   delta=1e-5), **changes})


# (config, target ε, the most evaluations of the reported accountant that certify: two when the prediction
# is within 0.45·tol). Before this change: 13–15 full RDP evaluations (calibrate_dp_mechanism) for RDP, and
# for PLD as many RDP, about 12 coarse PLD and 3 PLD evaluations.
CERTIFIED_CASES = [
    pytest.param(_poisson(), 2.0, 2, id="poisson-pld"),
    pytest.param(_poisson(expected_cohort=10, rounds=1000, num_users=10_000, delta=1e-6), 1.0, 3,
                 id="poisson-pld-small-q"),
    pytest.param(_poisson(expected_cohort=10, rounds=50, accountant="rdp"), 1.0, 2, id="poisson-rdp"),
    pytest.param(_poisson(rounds=200, accountant="rdp"), 0.2, 2, id="poisson-rdp-small-epsilon"),
    pytest.param(_poisson(accountant="rdp"), 30.0, 2, id="poisson-rdp-large-epsilon"),
    pytest.param(_poisson(expected_cohort=10, rounds=100, sampler="without-replacement", accountant="rdp"), 1.5, 2,
                 id="without-replacement-rdp"),
    pytest.param(_poisson(num_users=50, expected_cohort=50, rounds=10, sampler="all"), 3.0, 2, id="all-pld"),
    pytest.param(_poisson(num_users=50, expected_cohort=50, rounds=10, sampler="all", accountant="rdp"), 3.0, 2,
                 id="all-rdp"),
    pytest.param(_poisson(expected_cohort=20, rounds=30, sampler="cyclic-poisson", noise="bandmf", bands=4), 2.0, 2,
                 id="cyclic-bandmf-pld"),
    pytest.param(_poisson(expected_cohort=20, rounds=30, sampler="cyclic-poisson", noise="bandmf", bands=4,
                          accountant="rdp"), 2.0, 2, id="cyclic-bandmf-rdp"),
    pytest.param(_poisson(rounds=45, sampler="min-sep", noise="bandmf", bands=3), 2.0, 2, id="min-sep-bandmf-pld"),
    pytest.param(_poisson(rounds=45, sampler="min-sep", noise="bandmf", bands=3, accountant="rdp"), 2.0, 2,
                 id="min-sep-bandmf-rdp"),
]


@pytest.mark.parametrize("cfg, target, most", CERTIFIED_CASES)
def test_calibration_is_certified_equals_dp_accounting_and_takes_few_evaluations(cfg, target, most, evaluations):
    sigma = calibrate_noise_multiplier(cfg, target)
    counts = dict(evaluations)
    # Certified with a fresh dp_accounting accountant on the hand-built event: meets the target, and 1e-6
    # less noise misses it.
    assert _hand_epsilon(cfg, sigma) <= target < _hand_epsilon(cfg, sigma - TOL)
    # The same σ as dp_accounting's own calibration to 1e-7, to within the tolerance.
    assert abs(sigma - _reference_root(cfg, target, 0.9 * sigma, 1.1 * sigma, 1e-7)) <= TOL + 1e-7
    # Few evaluations of the reported accountant: `most` besides the full RDP at σ = MIN_CALIBRATED_NOISE
    # (the refusal check) and, for RDP, one at the predicted root to find the optimal order.
    if cfg.accountant == "rdp":
        assert counts["rdp"] <= most + 2
        assert counts["rdp-orders"] <= 40  # under a millisecond or a few each
    else:
        assert counts["rdp"] == 1 and counts["pld"] <= most
        assert counts["pld-coarse"] <= 6 and counts["pld-finer"] == 1
        assert counts["rdp-orders"] <= 15


def test_the_calibration_benchmark_needs_two_exact_pld_evaluations(evaluations):
    """The `fed-dp benchmark --only accounting` case (q = 0.01, δ = 1e-6, T = 10,000, ε = 8): two evaluations
    of the reported PLD (before: three, and 12 coarse PLD and 13 RDP), and a certified σ."""
    cfg = PrivacyConfig(num_users=100_000, expected_cohort=1_000, rounds=10_000, noise_multiplier=1.0, delta=1e-6)
    sigma = calibrate_noise_multiplier(cfg, 8.0)
    assert dict(evaluations) == {"rdp": 1, "rdp-orders": 5, "pld-coarse": 3, "pld-finer": 1, "pld": 2}
    assert direct_epsilon(poisson_event(0.01, sigma, 10_000), "pld", 1e-6) <= 8.0
    assert direct_epsilon(poisson_event(0.01, sigma - TOL, 10_000), "pld", 1e-6) > 8.0


def test_the_main_job_calibration_needs_four_rdp_evaluations(evaluations):
    """The main job's calibration (RDP, q = 1,024/14,336, T = 200, δ = 1e-5, ε = 4): four full RDP evaluations
    (before: 15 inside calibrate_dp_mechanism), and the σ of calibrate_dp_mechanism to within the tolerance."""
    cfg = PrivacyConfig(num_users=14_336, expected_cohort=1_024, rounds=200, noise_multiplier=1.0, delta=1e-5,
                        accountant="rdp")
    sigma = calibrate_noise_multiplier(cfg, 4.0)
    assert evaluations["rdp"] == 4
    assert _hand_epsilon(cfg, sigma) <= 4.0 < _hand_epsilon(cfg, sigma - TOL)
    assert abs(sigma - _reference_root(cfg, 4.0, MIN_CALIBRATED_NOISE, 10.0, 1e-7)) <= TOL + 1e-7


def _precise_root(cfg: PrivacyConfig, target: float, sigma: float) -> float:
    """The root of the reported ε near a calibrated σ to 1e-10 (certified: it lies in (σ − tol, σ])."""
    return _reference_root(cfg, target, sigma - 2 * TOL, sigma + TOL, 1e-10)


@pytest.mark.parametrize("cfg", [
    pytest.param(_poisson(expected_cohort=10, rounds=50, accountant="rdp"), id="poisson"),
    pytest.param(_poisson(expected_cohort=20, rounds=30, sampler="cyclic-poisson", noise="bandmf", bands=4,
                          accountant="rdp"), id="cyclic-bandmf"),
])
def test_rdp_prediction_is_the_full_rdp_root_for_one_full_evaluation(cfg, evaluations):
    """RDP over a window of orders has the full RDP's root when the optimal order stays in the window."""
    target = 2.0
    root = _precise_root(cfg, target, calibrate_noise_multiplier(cfg, target))
    evaluations.clear()
    prediction, slope = _rdp_prediction(mechanism(cfg), target)
    assert evaluations["rdp"] == 1
    assert prediction == pytest.approx(root, abs=1e-8)
    h = 1e-5
    assert slope == pytest.approx((_hand_epsilon(cfg, root + h) - _hand_epsilon(cfg, root - h)) / (2 * h), rel=1e-3)


def test_richardson_prediction_of_the_pld_root_beats_the_coarse_root_tenfold():
    cfg = _poisson(expected_cohort=10, rounds=1000, num_users=1000, delta=1e-5)
    target = 3.0
    root = _precise_root(cfg, target, calibrate_noise_multiplier(cfg, target))
    coarse_root, gap, slope = _secant_root(lambda s: _coarse_epsilon(mechanism(cfg), s), target, 1.0, xtol=1e-5)
    prediction = _richardson_pld_root(mechanism(cfg), target, coarse_root, gap + target, slope)
    assert abs(prediction - root) < 0.45 * TOL
    assert abs(prediction - root) < abs(coarse_root - root) / 10


@pytest.mark.parametrize("offset, expected", [(0.0, 2), (0.3 * TOL, 2), (-0.3 * TOL, 2), (2e-5, 3), (-2e-5, 3)])
def test_certificate_costs_two_evaluations_from_a_close_prediction_three_from_a_far_one(offset, expected, evaluations):
    """Within 0.45·tol of the root: the two probes certify. Further: the first probe is where a Newton
    step starts (not the second probe too), then two probes."""
    cfg = _poisson(expected_cohort=10, rounds=50, accountant="rdp")
    target = 1.0
    root = _precise_root(cfg, target, calibrate_noise_multiplier(cfg, target))
    h = 1e-5
    slope = (_hand_epsilon(cfg, root + h) - _hand_epsilon(cfg, root - h)) / (2 * h)
    epsilon.cache_clear()
    evaluations.clear()
    sigma = _certified_sigma(mechanism(cfg), target, root + offset, slope)
    assert evaluations == {"rdp": expected}
    assert root <= sigma < root + TOL
    assert _hand_epsilon(cfg, sigma) <= target < _hand_epsilon(cfg, sigma - TOL)


def test_secant_root_on_a_power_law():
    """ε = c·σ^−1.7: log–log secant steps land on the root in a few evaluations, from far off too (steps
    of at most a factor 2), and the slope returned is dε/dσ there."""
    target, c, p = 2.0, 3.0, 1.7
    root = (c / target) ** (1 / p)
    for start, most in ((1.1 * root, 5), (100 * root, 12)):
        calls = []

        def eps(sigma):
            calls.append(sigma)
            return c * sigma ** -p

        sigma, gap, slope = _secant_root(eps, target, start, xtol=1e-9)
        assert sigma == pytest.approx(root, abs=1e-9) and gap == pytest.approx(0, abs=1e-8)
        assert slope == pytest.approx(-p * c * root ** (-p - 1), rel=1e-6)
        assert len(calls) <= most
        assert all(b / a >= 0.5 for a, b in zip(calls, calls[1:]))
    # A root below MIN_CALIBRATED_NOISE: the search stops there rather than go lower.
    sigma, gap, _ = _secant_root(lambda s: 1e-3 / s, 1.0, 1.0, xtol=1e-9)
    assert sigma == MIN_CALIBRATED_NOISE and gap < 0


# ------------------------------------------------------------------------------------------------
# Ledger
# ------------------------------------------------------------------------------------------------


def _ledger_config(**changes):
    base = dict(num_users=1000, expected_cohort=10, rounds=6, noise_multiplier=1.5, delta=1e-5)
    base.update(changes)
    return PrivacyConfig(**base)


@pytest.mark.parametrize("accountant", ["pld", "rdp"])
def test_ledger_epsilon_equals_dp_accounting_after_each_round(accountant):
    cfg = _ledger_config(accountant=accountant)
    ledger = PrivacyLedger(cfg)
    assert ledger.epsilon == 0.0 and ledger.rounds == 0
    previous = 0.0
    for t in range(1, cfg.rounds + 1):
        record = ledger.record_round()
        expected = direct_epsilon(poisson_event(0.01, 1.5, t), accountant, 1e-5)
        assert record.round == t  # the t-th release (rounds are numbered 1 … T)
        assert record.epsilon == pytest.approx(expected, rel=REL)
        assert ledger.epsilon == record.epsilon
        assert ledger.epsilon > previous  # monotone
        previous = ledger.epsilon
    assert ledger.rounds == cfg.rounds


def test_ledger_without_replacement_uses_replace_one_event():
    cfg = _ledger_config(sampler="without-replacement", accountant="rdp")
    ledger = PrivacyLedger(cfg)
    for t in range(1, 4):
        ledger.record_round()
        event = dp_accounting.SelfComposedDpEvent(
            dp_accounting.SampledWithoutReplacementDpEvent(1000, 10, dp_accounting.GaussianDpEvent(0.75)), t)
        assert ledger.epsilon == pytest.approx(direct_epsilon(event, "rdp", 1e-5, REPLACE_ONE), rel=REL)


def test_the_ledger_records_only_the_round_and_its_epsilon():
    """No cohort sizes (computed from the population outside the release): ε depends on the rounds only."""
    cfg = _ledger_config(accountant="rdp")
    ledger = PrivacyLedger(cfg)
    record = ledger.record_round()
    assert set(record.__dict__) == {"round", "epsilon"} and record.epsilon > 0


def test_budget_refuses_the_round_that_would_exceed_it_and_leaves_ledger_unchanged():
    e3 = direct_epsilon(poisson_event(0.01, 1.5, 3), "rdp", 1e-5)
    e4 = direct_epsilon(poisson_event(0.01, 1.5, 4), "rdp", 1e-5)
    assert e3 < e4
    cfg = _ledger_config(accountant="rdp", epsilon_budget=(e3 + e4) / 2)
    ledger = PrivacyLedger(cfg)
    for _ in range(3):
        ledger.check_next_round()
        ledger.record_round()
    before = ledger.records
    with pytest.raises(BudgetExceededError):
        ledger.check_next_round()
    with pytest.raises(BudgetExceededError):
        ledger.record_round()
    assert ledger.records == before and ledger.rounds == 3
    assert ledger.epsilon == pytest.approx(e3, rel=REL)


def test_budget_boundary_is_sharp():
    """A budget just above ε(2) allows two rounds; one just below it already refuses the second."""
    e2 = direct_epsilon(poisson_event(0.01, 1.5, 2), "rdp", 1e-5)
    ledger = PrivacyLedger(_ledger_config(accountant="rdp", epsilon_budget=e2 * (1 + 1e-9)))
    ledger.record_round()
    ledger.record_round()
    with pytest.raises(BudgetExceededError):
        ledger.record_round()
    ledger = PrivacyLedger(_ledger_config(accountant="rdp", epsilon_budget=e2 * (1 - 1e-9)))
    ledger.record_round()
    with pytest.raises(BudgetExceededError, match="budget"):
        ledger.record_round()
    assert ledger.rounds == 1


def test_ledger_refuses_rounds_past_the_plan():
    cfg = _ledger_config(accountant="rdp", rounds=3)
    ledger = PrivacyLedger(cfg)
    for _ in range(3):
        ledger.record_round()
    with pytest.raises(BudgetExceededError, match="planned"):
        ledger.check_next_round()
    with pytest.raises(BudgetExceededError):
        ledger.record_round()
    assert ledger.rounds == 3


@pytest.mark.parametrize("accountant", ["pld", "rdp"])
def test_ledger_json_round_trip_continues_like_uninterrupted(accountant):
    cfg = _ledger_config(accountant=accountant, rounds=5, epsilon_budget=50.0)
    uninterrupted = PrivacyLedger(cfg)
    for _ in range(5):
        uninterrupted.record_round()

    first = PrivacyLedger(cfg)
    for _ in range(3):
        first.record_round()
    restored = PrivacyLedger.from_dict(json.loads(json.dumps(first.to_dict())))
    assert restored.config == cfg
    assert restored.records == first.records
    for _ in range(2):
        restored.record_round()
    assert restored.records == uninterrupted.records
    with pytest.raises(BudgetExceededError):
        restored.record_round()


def test_min_sep_ledger_counts_participations_so_far():
    # m = 1000 // 100 = 10; after t rounds a user has ⌈t/10⌉ participations.
    cfg = PrivacyConfig(num_users=1000, expected_cohort=100, rounds=12, noise_multiplier=3.0, delta=1e-5,
                        sampler="min-sep", accountant="rdp")
    ledger = PrivacyLedger(cfg)
    for t in range(1, 13):
        ledger.record_round()
        k = math.ceil(t / 10)
        expected = direct_epsilon(dp_accounting.GaussianDpEvent(3.0 / math.sqrt(k)), "rdp", 1e-5)
        assert ledger.epsilon == pytest.approx(expected, rel=REL), t


# ------------------------------------------------------------------------------------------------
# Config-level refusals
# ------------------------------------------------------------------------------------------------


def test_without_replacement_with_pld_is_refused():
    with pytest.raises(ValueError, match="rdp"):
        PrivacyConfig(num_users=100, expected_cohort=10, rounds=5, noise_multiplier=1.0, delta=1e-5,
                      sampler="without-replacement", accountant="pld")
    with pytest.raises(ValueError, match="rdp"):
        PrivacyConfig(num_users=100, expected_cohort=10, rounds=5, noise_multiplier=1.0, delta=1e-5,
                      sampler="without-replacement")  # pld is the default


def test_restoring_a_ledger_with_a_wrong_epsilon_is_refused():
    from fed_dp.accounting import PrivacyLedger
    from fed_dp.config import PrivacyConfig

    config = PrivacyConfig(num_users=1000, expected_cohort=10, rounds=5, noise_multiplier=1.0, delta=1e-5, accountant="rdp")
    ledger = PrivacyLedger(config)
    for _ in range(3):
        ledger.record_round()
    data = ledger.to_dict()
    assert PrivacyLedger.from_dict(data).epsilon == ledger.epsilon
    data["records"][-1]["epsilon"] *= 0.5
    with pytest.raises(ValueError, match="does not match"):
        PrivacyLedger.from_dict(data)
    data = ledger.to_dict()
    del data["records"][1]
    with pytest.raises(ValueError, match="consecutive"):
        PrivacyLedger.from_dict(data)


# ------------------------------------------------------------------------------------------------
# Per-round schedule (O(T)): the same numbers as round-by-round dp_accounting
# ------------------------------------------------------------------------------------------------

from fed_dp.accounting import (  # noqa: E402
    PLD_DENSE_ROUNDS,
    PLD_ROUND_RATIO,
    epsilon_schedule,
    pld_exact_rounds,
)

SCHEDULE_CONFIGS = [
    pytest.param(dict(num_users=1000, expected_cohort=10, rounds=40, noise_multiplier=1.2), id="poisson"),
    pytest.param(dict(num_users=1000, expected_cohort=20, rounds=37, noise_multiplier=1.5, sampler="cyclic-poisson",
                      noise="bandmf", bands=4), id="cyclic-bandmf"),
    pytest.param(dict(num_users=1000, expected_cohort=100, rounds=35, noise_multiplier=3.0, sampler="min-sep",
                      noise="bandmf", bands=3), id="min-sep-bandmf"),
    pytest.param(dict(num_users=50, expected_cohort=50, rounds=25, noise_multiplier=4.0, sampler="all"), id="all"),
]


@pytest.mark.parametrize("kwargs", SCHEDULE_CONFIGS + [pytest.param(
    dict(num_users=1000, expected_cohort=10, rounds=30, noise_multiplier=1.1, sampler="without-replacement"),
    id="without-replacement")])
def test_rdp_schedule_equals_round_by_round_dp_accounting_exactly(kwargs):
    cfg = PrivacyConfig(delta=1e-5, accountant="rdp", **kwargs)
    schedule = epsilon_schedule(cfg)
    relation = REPLACE_ONE if cfg.sampler == "without-replacement" else ADD_REMOVE
    assert schedule.exact_rounds == tuple(range(1, cfg.rounds + 1))
    for t in range(1, cfg.rounds + 1):
        assert schedule.at(t) == direct_epsilon(_hand_event_at(cfg, t), "rdp", cfg.delta, relation), t
        assert schedule.at(t) == epsilon(cfg, t), t


@pytest.mark.parametrize("kwargs", SCHEDULE_CONFIGS)
def test_pld_schedule_is_exact_at_its_rounds_and_an_upper_bound_between(kwargs):
    cfg = PrivacyConfig(delta=1e-5, accountant="pld", **kwargs)
    schedule = epsilon_schedule(cfg)
    computed = pld_exact_rounds(cfg.rounds)
    assert set(computed) <= set(schedule.exact_rounds)
    values = schedule.epsilons
    assert list(values) == sorted(values)  # nondecreasing
    for t in range(1, cfg.rounds + 1):
        direct = direct_epsilon(_hand_event_at(cfg, t), "pld", cfg.delta)
        following = next(r for r in computed if r >= t)
        if t in schedule.exact_rounds:
            assert schedule.at(t) == direct, t  # the same numbers as a fresh PLDAccountant
        else:
            assert schedule.at(t) == schedule.at(following) >= direct, t  # the next exact value: an upper bound
            assert schedule.at(t) > direct, t  # and the bound is not vacuous: it is really conservative here


def test_min_sep_pld_schedule_is_exact_wherever_the_event_repeats():
    # m = 10: rounds 11..20 share one event (k = 2), so all of them are exact as soon as one of them is computed.
    cfg = PrivacyConfig(num_users=1000, expected_cohort=100, rounds=35, noise_multiplier=3.0, delta=1e-5,
                        sampler="min-sep", noise="bandmf", bands=3)
    assert epsilon_schedule(cfg).exact_rounds == tuple(range(1, 36))


def test_pld_exact_rounds_are_dense_then_geometric_and_end_at_T():
    for T in (1, 7, 10, 11, 100, 2000, 10_000):
        rounds = pld_exact_rounds(T)
        assert rounds[: min(T, PLD_DENSE_ROUNDS)] == tuple(range(1, min(T, PLD_DENSE_ROUNDS) + 1))
        assert rounds[-1] == T and list(rounds) == sorted(set(rounds))
        for a, b in zip(rounds, rounds[1:]):
            assert b <= max(a + 1, math.ceil(a * PLD_ROUND_RATIO))
    assert len(pld_exact_rounds(10_000)) <= 45
    with pytest.raises(ValueError, match="rounds"):
        pld_exact_rounds(0)


def test_pld_budget_check_decides_on_the_exact_epsilon_between_exact_rounds():
    """Issue 25 item 7 (there: round 14 at exact ε 1.9716 <= 2.0 was refused by its bound). Between exact rounds
    the schedule holds the next exact round's ε, an upper bound; when that bound is over the budget, the round's
    exact ε decides: a round whose exact ε fits runs and records that ε, the next one, over budget, is refused.
    Both exact values come from a fresh dp_accounting PLDAccountant here."""
    cfg = _ledger_config(accountant="pld", rounds=20)  # exact rounds 1..10, 13, 17, 20
    schedule = epsilon_schedule(cfg)
    assert 14 not in schedule.exact_rounds and 15 not in schedule.exact_rounds
    e14 = direct_epsilon(poisson_event(0.01, 1.5, 14), "pld", 1e-5)
    e15 = direct_epsilon(poisson_event(0.01, 1.5, 15), "pld", 1e-5)
    budget = (e14 + e15) / 2
    assert e14 < budget < e15 <= schedule.at(14)  # the bound alone would refuse round 14
    ledger = PrivacyLedger(cfg.replace(epsilon_budget=budget))
    for _ in range(13):
        ledger.record_round()
    assert [r.epsilon for r in ledger.records] == list(schedule.epsilons[:13])  # exact rounds: the schedule's
    assert ledger.check_next_round() == pytest.approx(e14, rel=REL)
    ledger.record_round()
    assert ledger.rounds == 14 and ledger.epsilon == pytest.approx(e14, rel=REL)
    with pytest.raises(BudgetExceededError, match="budget"):
        ledger.check_next_round()
    with pytest.raises(BudgetExceededError, match="budget"):
        ledger.record_round()
    assert ledger.rounds == 14
    assert PrivacyLedger.from_dict(ledger.to_dict()).epsilon == ledger.epsilon  # the exact value restores


def test_ledger_restores_a_checkpoint_that_recorded_the_exact_pld_value():
    """Ledgers written before the schedule stored dp_accounting's exact ε at every round; still accepted."""
    cfg = _ledger_config(accountant="pld", rounds=12)
    ledger = PrivacyLedger(cfg)
    for _ in range(11):
        ledger.record_round()
    data = ledger.to_dict()
    assert data["records"][-1]["epsilon"] == epsilon_schedule(cfg).at(12)
    data["records"][-1]["epsilon"] = direct_epsilon(poisson_event(0.01, 1.5, 11), "pld", 1e-5)
    assert PrivacyLedger.from_dict(data).rounds == 11
    data["records"][-1]["epsilon"] *= 1.01
    with pytest.raises(ValueError, match="does not match"):
        PrivacyLedger.from_dict(data)


def test_pld_calibration_is_certified_to_the_tolerance():
    cfg = PrivacyConfig(num_users=1000, expected_cohort=100, rounds=20, noise_multiplier=1.0, delta=1e-5)
    sigma = calibrate_noise_multiplier(cfg, 2.0)
    assert direct_epsilon(poisson_event(0.1, sigma, 20), "pld", 1e-5) <= 2.0
    assert direct_epsilon(poisson_event(0.1, sigma - 1e-6, 20), "pld", 1e-5) > 2.0


@pytest.mark.parametrize("slope_factor, offset", [(1.0, 0.0), (0.2, 0.0), (5.0, 3e-3), (1.0, -2e-2), (-1.0, 1e-2)])
def test_certified_search_returns_a_valid_tight_sigma_from_poor_starts(slope_factor, offset):
    """A wrong slope (even of the wrong sign) or a far guess costs evaluations, never validity:
    ε(σ) ≤ target < ε(σ − tol). Several of these cases end in the calibrate_dp_mechanism fallback."""
    cfg = PrivacyConfig(num_users=1000, expected_cohort=100, rounds=20, noise_multiplier=1.0, delta=1e-5)
    target = 2.0
    reference = calibrate_noise_multiplier(cfg, target)
    h = 1e-4
    slope = (direct_epsilon(poisson_event(0.1, reference + h, 20), "pld", 1e-5)
             - direct_epsilon(poisson_event(0.1, reference, 20), "pld", 1e-5)) / h
    sigma = _certified_sigma(mechanism(cfg), target, reference + offset, slope * slope_factor)
    assert direct_epsilon(poisson_event(0.1, sigma, 20), "pld", 1e-5) <= target
    assert direct_epsilon(poisson_event(0.1, sigma - 1e-6, 20), "pld", 1e-5) > target


# --- regression: sampling without replacement, recomputed independently -------------------------------------
def _log_wor_rdp_bound(q: float, sigma: float, alpha: int) -> float:
    """log A_α of Wang, Balle & Kasiviswanathan 2019, Theorem 9 (subsampling without replacement, integer α),
    for a base Gaussian of noise multiplier σ (its RDP ε(j) = j/(2σ²), ε(∞) = ∞), written out here from the
    paper: log(1 + q²·C(α,2)·min{4(e^{ε(2)} − 1), 2e^{ε(2)}} + Σ_{j≥3} 2·q^j·C(α,j)·e^{(j−1)ε(j)})."""
    e = lambda j: j / (2 * sigma**2)  # noqa: E731
    terms = [0.0, 2 * math.log(q) + math.log(math.comb(alpha, 2))
             + min(math.log(4) + e(2) + math.log1p(-math.exp(-e(2))), e(2) + math.log(2))]
    terms += [math.log(2) + j * math.log(q) + math.log(math.comb(alpha, j)) + (j - 1) * e(j) for j in range(3, alpha + 1)]
    top = max(terms)
    return top + math.log(sum(math.exp(t - top) for t in terms))


@pytest.mark.parametrize("num_users, cohort, sigma, rounds", [(1000, 10, 1.5, 100), (10_000, 100, 2.0, 500)])
def test_without_replacement_epsilon_equals_an_independent_computation(num_users, cohort, sigma, rounds):
    """fed-dp accounts a fixed-size cohort under replace-one adjacency as dp_accounting's
    SampledWithoutReplacement event of Gaussian(σ/2) (replacing one user moves the sum by 2ζ). Recomputed here
    without dp_accounting: the RDP bound of WBK19 Thm 9 at every integer order with noise multiplier σ/2, T-fold
    composition, and the RDP → (ε, δ) conversion of Canonne, Kamath & Steinke 2020 (Prop. 12),
    ε = T·RDP(α) + log((α−1)/α) − (log δ + log α)/(α − 1), minimized over α. For these parameters the
    optimum is an integer order at which dp_accounting's (tighter) Theorem 27 coincides with Theorem 9, so the
    two agree to 1e-9. A dp_accounting release that read the noise multiplier of this event differently (its
    issue 378, pull request 464: halving it for replace-one inside the accountant) would change ε by far more
    — the reason dp-accounting is pinned to the tested range in pyproject.toml."""
    config = PrivacyConfig(num_users=num_users, expected_cohort=cohort, rounds=rounds, noise_multiplier=sigma,
                           delta=1e-5, sampler="without-replacement", accountant="rdp")
    independent = min(rounds * _log_wor_rdp_bound(cohort / num_users, sigma / 2, a) / (a - 1)
                      + math.log((a - 1) / a) - (math.log(1e-5) + math.log(a)) / (a - 1) for a in range(2, 257))
    assert epsilon(config) == pytest.approx(independent, rel=1e-9)


# --- BLT planned for min-separation 1 (issue 27): warned about, with the σ of the plans that fit ---------------


def _unamplified_blt(**changes) -> PrivacyConfig:
    base = dict(num_users=1000, expected_cohort=50, rounds=40, target_epsilon=2.0, delta=1e-5, sampler="cyclic-poisson",
                noise="blt", buffers=4, accountant="rdp")
    return PrivacyConfig(**{**base, **changes})


def test_blt_with_separation_1_is_warned_about_naming_the_samplers_that_fit_and_their_sigma(tmp_path, monkeypatch):
    """Issue 27: BLT with the default cyclic-poisson sampler and bands = 1 silently planned with separation 1 and no
    amplification (σ = 91 for ε = 2 at StackOverflow's size, where min-sep needs 4.9 and independent Poisson noise
    0.71). Calibrating it now warns with the σ each plan needs for the same ε, from the project's calibration."""
    from fed_dp.accounting import UnamplifiedBLTWarning, calibrate_noise_multiplier, resolve_privacy

    monkeypatch.setenv("FED_DP_CACHE_DIR", str(tmp_path))
    config = _unamplified_blt()
    with pytest.warns(UnamplifiedBLTWarning) as caught:
        resolved = resolve_privacy(config)
    (warning,) = caught
    text = str(warning.message)
    min_sep = calibrate_noise_multiplier(config.replace(sampler="min-sep"), 2.0)
    poisson = calibrate_noise_multiplier(config.replace(sampler="poisson", noise="independent", buffers=None), 2.0)
    assert poisson < min_sep < resolved.noise_multiplier  # what the advice is for
    assert (f"noise 'blt' with sampler 'cyclic-poisson' and bands = 1 plans for min-separation 1: the BLT gets no "
            f"amplification from sampling and is accounted for a user in all T = 40 rounds, so epsilon 2 at delta "
            f"1e-05 needs sigma = {resolved.noise_multiplier:.4g}. For the same epsilon: sampler 'min-sep' "
            f"(separation N // B = 20): sigma = {min_sep:.4g}; noise 'independent' with sampler 'poisson' (amplified "
            f"by sampling): sigma = {poisson:.4g}") in text


def test_blt_with_separation_1_and_a_given_sigma_is_warned_about_for_its_own_epsilon(tmp_path, monkeypatch):
    """With σ given instead of a target ε, the same plan is warned about, for the ε that σ gives."""
    from fed_dp.accounting import UnamplifiedBLTWarning, calibrate_noise_multiplier, resolve_privacy

    monkeypatch.setenv("FED_DP_CACHE_DIR", str(tmp_path))
    config = _unamplified_blt().replace(target_epsilon=None, noise_multiplier=20.0)
    with pytest.warns(UnamplifiedBLTWarning) as caught:
        assert resolve_privacy(config) == config
    own = epsilon(config)
    min_sep = calibrate_noise_multiplier(config.replace(sampler="min-sep"), own)
    assert (f"so epsilon {own:.4g} at delta 1e-05 needs sigma = 20. For the same epsilon: sampler 'min-sep' "
            f"(separation N // B = 20): sigma = {min_sep:.4g}") in str(caught[0].message)


def test_blt_with_a_separation_above_1_is_not_warned_about(tmp_path, monkeypatch, recwarn):
    from fed_dp.accounting import UnamplifiedBLTWarning, resolve_privacy, unamplified_blt_advice

    monkeypatch.setenv("FED_DP_CACHE_DIR", str(tmp_path))
    for config in (_unamplified_blt(bands=5), _unamplified_blt(sampler="min-sep"),
                   _unamplified_blt(noise="independent", buffers=None)):
        assert unamplified_blt_advice(config) is None
        resolve_privacy(config)
    assert not [w for w in recwarn if issubclass(w.category, UnamplifiedBLTWarning)]


def test_the_calibration_constants_stay_importable_from_accounting():
    """The σ search moved to fed_dp.calibration; each constant fed_dp.accounting defined for it is still importable
    from there, as the calibration's own value."""
    import fed_dp.accounting as accounting

    for name in ("MIN_CALIBRATED_NOISE", "CALIBRATION_TOLERANCE", "PLD_DISCRETIZATION", "COARSE_PLD_DISCRETIZATION",
                 "COARSE_CALIBRATION_TOLERANCE", "SPARSE_RDP_ORDERS", "RDP_MODEL_HALF_WIDTH"):
        assert getattr(accounting, name) is getattr(calibration, name), name
