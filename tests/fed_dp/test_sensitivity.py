"""BandMF multi-participation sensitivity under b-min-separation (docs/explanation/mechanism.md:
Noise; Samplers and their accounting).

For column-normalized, b-banded C and a user whose participations are pairwise ≥ b rounds apart, at most
k of them, sens(C)² = k: columns |i − j| ≥ b have disjoint support. The tests enumerate every such
participation pattern for small T by brute force with X = CᵀC built densely, bound the vector-valued
contribution by Σ_{i,j∈P} |X_ij| (‖Σ_{i∈P} C[:, i] x_iᵀ‖_F² = Σ_{i,j} X_ij ⟨x_i, x_j⟩ with ‖x_i‖ ≤ 1), and
check that the maximum is exactly k — and that with separation b − 1 the same brute force exceeds k, so
the check discriminates. The samplers' actual participation patterns are then checked against the same
bound with the k that their accounting event uses.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from fed_dp.config import PrivacyConfig
from fed_dp.sampling import make_sampler
from fed_dp.factorization import optimize_toeplitz, sqrt_prefix_sum_coefs, toeplitz_strategy


def patterns(rounds: int, separation: int, max_size: int):
    """Every non-empty subset of range(rounds) with pairwise gaps ≥ separation and ≤ max_size elements."""
    out = []

    def extend(current, start):
        if current:
            out.append(tuple(current))
        if len(current) == max_size:
            return
        for nxt in range(start, rounds):
            extend(current + [nxt], nxt + separation)

    extend([], 0)
    return out


def pattern_bound(X: np.ndarray, pattern) -> float:
    idx = np.asarray(pattern)
    return float(np.abs(X[np.ix_(idx, idx)]).sum())


def max_pattern_bound(X, rounds, separation, max_size):
    return max(pattern_bound(X, p) for p in patterns(rounds, separation, max_size))


def dense_gram(strategy) -> np.ndarray:
    C = strategy.dense().numpy()
    _T, b = strategy.rounds, strategy.bands
    # The object under test is what the bound assumes: lower-triangular, b-banded, unit columns.
    assert np.allclose(np.triu(C, 1), 0) and np.allclose(np.tril(C, -b), 0)
    assert np.all(np.diag(C) > 0)
    assert np.allclose(np.linalg.norm(C, axis=0), 1.0, atol=1e-12)
    assert np.abs(np.diag(C, -(b - 1))).min() > 1e-6  # the last band is really used
    return C.T @ C


def _strategies(tmp_path):
    yield "optimized-T12-b2", optimize_toeplitz(12, 2, cache_dir=tmp_path)
    yield "optimized-T14-b3", optimize_toeplitz(14, 3, cache_dir=tmp_path)
    yield "sqrt-prefix-T16-b4", toeplitz_strategy(sqrt_prefix_sum_coefs(4), 16)
    yield "momentum-T13-b3", optimize_toeplitz(13, 3, momentum=0.9, cache_dir=tmp_path)


def test_patterns_enumerator_is_complete():
    # Independent count: subsets of {0..T−1} with gaps ≥ s of every size, by brute force over bitmasks.
    T, s = 10, 3
    brute = 0
    for mask in range(1, 2**T):
        idx = [i for i in range(T) if mask >> i & 1]
        brute += all(j - i >= s for i, j in zip(idx, idx[1:]))
    assert len(patterns(T, s, T)) == brute


def test_sensitivity_squared_is_k_under_min_separation(tmp_path):
    for name, strategy in _strategies(tmp_path):
        T, b = strategy.rounds, strategy.bands
        X = dense_gram(strategy)
        k_max = math.ceil(T / b)  # the most participations b apart that fit in T rounds
        all_valid = patterns(T, b, T)
        assert max(len(p) for p in all_valid) == k_max
        for p in all_valid:  # each valid pattern costs exactly its number of participations
            assert pattern_bound(X, p) == pytest.approx(len(p), abs=1e-9), (name, p)
        for k in range(1, k_max + 1):
            assert max_pattern_bound(X, T, b, k) == pytest.approx(k, abs=1e-9), (name, k)


def test_separation_below_bands_exceeds_k(tmp_path):
    """Negative control: the same brute force with separation b − 1 gives more than k."""
    for name, strategy in _strategies(tmp_path):
        T, b = strategy.rounds, strategy.bands
        X = dense_gram(strategy)
        k = math.ceil(T / b)
        assert max_pattern_bound(X, T, b - 1, k) > k + 1e-3, name
        assert max_pattern_bound(X, T, b - 1, 2) > 2 + 1e-3, name  # even two participations


def test_vector_contributions_attain_k_and_no_more(tmp_path):
    """‖Σ_{i∈P} C[:, i] x_iᵀ‖_F² for unit x_i: = |P| for valid patterns whatever the x_i."""
    strategy = optimize_toeplitz(14, 3, cache_dir=tmp_path)
    C = strategy.dense().numpy()
    rng = np.random.default_rng(0)
    for p in patterns(14, 3, 5)[::7]:
        x = rng.standard_normal((len(p), 6))
        x /= np.linalg.norm(x, axis=1, keepdims=True)
        released = C[:, list(p)] @ x
        assert np.sum(released**2) == pytest.approx(len(p), abs=1e-9)
    # Adjacent participations (separation 1 < b) with equal x exceed |P| when C's sub-diagonal is positive.
    x = np.ones((2, 6)) / math.sqrt(6)
    released = C[:, [4, 5]] @ x
    assert np.sum(released**2) > 2 + 1e-3


@pytest.mark.parametrize("sampler", ["min-sep", "cyclic-poisson"])
def test_sampler_patterns_stay_within_the_accounted_k(sampler, tmp_path):
    """Every user's actual participations satisfy the bound with the k used by the accounting event."""
    T, b = 14, 3
    kwargs = dict(num_users=40, expected_cohort=10, rounds=T, noise_multiplier=1.0, delta=1e-5,
                  sampler=sampler, noise="bandmf", bands=b)
    if sampler == "min-sep":
        kwargs["expected_cohort"] = 13  # m = 40 // 13 = 3 = b groups, the tightest allowed
    cfg = PrivacyConfig(**kwargs)
    X = dense_gram(optimize_toeplitz(T, b, cache_dir=tmp_path))
    for seed in range(3):
        sampler_obj = make_sampler(cfg, seed=seed)
        rounds_of = {}
        for t in range(T):
            for u in sampler_obj.next_cohort().tolist():
                rounds_of.setdefault(u, []).append(t)
        for u, p in rounds_of.items():
            assert pattern_bound(X, p) <= cfg.participations() + 1e-9, (u, p)
            assert pattern_bound(X, p) == pytest.approx(len(p), abs=1e-9)
    assert cfg.participations() == math.ceil(T / cfg.min_separation)


def test_strategy_cache_goes_to_the_given_directory(tmp_path, monkeypatch):
    monkeypatch.setenv("FED_DP_CACHE_DIR", str(tmp_path / "env"))
    optimize_toeplitz(12, 2)
    assert list((tmp_path / "env").glob("*.json"))


# ------------------------------------------------------------------------------------------------
# BLT: not banded, so its sensitivity is computed (fed_dp.blt) and the accounting must use it
# ------------------------------------------------------------------------------------------------

import dp_accounting  # noqa: E402
from dp_accounting import pld, rdp  # noqa: E402

from fed_dp.accounting import PrivacyLedger, calibrate_noise_multiplier, epsilon, epsilon_schedule  # noqa: E402
from fed_dp.blt import config_strategy  # noqa: E402
from fed_dp.sampling import dp_event  # noqa: E402

BLT_CONFIGS = {
    # m = N // B = 40 // 10 = 4 groups, T = 14: ⌈14/4⌉ = 4 participations
    "min-sep": dict(num_users=40, expected_cohort=10, rounds=14, sampler="min-sep"),
    # b = 3 groups, T = 13: ⌈13/3⌉ = 5 participations
    "cyclic-poisson": dict(num_users=60, expected_cohort=5, rounds=13, sampler="cyclic-poisson", bands=3),
}


def _blt_config(name, accountant="pld", sigma=2.0, **changes):
    return PrivacyConfig(**{**BLT_CONFIGS[name], "noise_multiplier": sigma, "delta": 1e-5, "noise": "blt",
                            "buffers": 2, "accountant": accountant, **changes})


def _direct(event, accountant):
    acc = pld.PLDAccountant() if accountant == "pld" else rdp.RdpAccountant()
    acc.compose(event)
    return acc.get_epsilon(1e-5)


def _max_over_patterns(C: np.ndarray, separation: int, t: int) -> float:
    """max over patterns in rounds < t with gaps ≥ separation of ‖Σ_{i∈P} C[:t, i]‖² (every pattern, any size)."""
    return max(float(np.sum(C[:t, list(p)].sum(axis=1) ** 2)) for p in patterns(t, separation, t))


def _signed_max_over_patterns(C: np.ndarray, separation: int, t: int) -> float:
    """The true worst case of scalar contributions in [−1, 1]: max over patterns and signs of ‖Σ_{i∈P} ±C[:t, i]‖²."""
    return max(float(np.sum((C[:t, list(p)] @ np.array((1.0,) + s)) ** 2))
               for p in patterns(t, separation, t) for s in itertools.product([1.0, -1.0], repeat=len(p) - 1))


def _brute_force_sens_sq(C: np.ndarray, separation: int, t: int) -> float:
    """The sensitivity² the accounting must use: the max over patterns for the Toeplitz matrix of the envelope
    ĉ_r = max_{s≥r}|c_s| of C's first column (= C for θ > 0; an upper bound on C's own worst case otherwise)."""
    c = C[:, 0]
    envelope = np.array([np.abs(c[r:]).max() for r in range(len(c))])
    lag = np.arange(len(c))[:, None] - np.arange(len(c))[None, :]
    return _max_over_patterns(np.where(lag >= 0, envelope[np.clip(lag, 0, None)], 0.0), separation, t)


@pytest.mark.parametrize("name", sorted(BLT_CONFIGS))
def test_blt_event_after_every_round_uses_the_brute_force_sensitivity(name, tmp_path, monkeypatch):
    monkeypatch.setenv("FED_DP_CACHE_DIR", str(tmp_path))
    cfg = _blt_config(name)
    C = config_strategy(cfg).dense().numpy()
    assert np.linalg.norm(C, axis=0).max() == pytest.approx(1.0)  # the noise is calibrated to one participation
    for t in range(1, cfg.rounds + 1):
        sens = math.sqrt(_brute_force_sens_sq(C, cfg.min_separation, t))
        event = dp_event(cfg, t)
        assert event == dp_accounting.GaussianDpEvent(event.noise_multiplier)
        assert event.noise_multiplier == pytest.approx(cfg.noise_multiplier / sens, rel=1e-12), t
        assert sens**2 >= _signed_max_over_patterns(C, cfg.min_separation, t) * (1 - 1e-12), t  # sound for C
    k = math.ceil(cfg.rounds / cfg.min_separation)
    assert _brute_force_sens_sq(C, cfg.min_separation, cfg.rounds) > k  # BandMF's √k would under-count here


@pytest.mark.parametrize("name", sorted(BLT_CONFIGS))
@pytest.mark.parametrize("accountant", ["rdp", "pld"])
def test_blt_epsilon_schedule_and_ledger_match_dp_accounting(name, accountant, tmp_path, monkeypatch):
    monkeypatch.setenv("FED_DP_CACHE_DIR", str(tmp_path))
    cfg = _blt_config(name, accountant)
    C = config_strategy(cfg).dense().numpy()
    schedule = epsilon_schedule(cfg)
    ledger = PrivacyLedger(cfg)
    for t in range(1, cfg.rounds + 1):
        sigma_eff = cfg.noise_multiplier / math.sqrt(_brute_force_sens_sq(C, cfg.min_separation, t))
        direct = _direct(dp_accounting.GaussianDpEvent(sigma_eff), accountant)
        record = ledger.record_round()
        assert record.epsilon == schedule.at(t)
        if t in schedule.exact_rounds:
            assert schedule.at(t) == pytest.approx(direct, rel=1e-9), t
        else:
            assert schedule.at(t) >= direct
    assert epsilon(cfg) == pytest.approx(_direct(dp_accounting.GaussianDpEvent(
        cfg.noise_multiplier / math.sqrt(_brute_force_sens_sq(C, cfg.min_separation, cfg.rounds))), accountant), rel=1e-9)


@pytest.mark.parametrize("name", sorted(BLT_CONFIGS))
def test_blt_sampler_patterns_stay_within_the_accounted_sensitivity(name, tmp_path, monkeypatch):
    """Every user's actual participations, with equal contributions, move the release by at most sens_T."""
    monkeypatch.setenv("FED_DP_CACHE_DIR", str(tmp_path))
    cfg = _blt_config(name)
    C = config_strategy(cfg).dense().numpy()
    accounted = cfg.noise_multiplier / dp_event(cfg).noise_multiplier  # sens_T
    for seed in range(3):
        sampler = make_sampler(cfg, seed=seed)
        rounds_of = {}
        for t in range(cfg.rounds):
            for u in sampler.next_cohort().tolist():
                rounds_of.setdefault(u, []).append(t)
        assert rounds_of
        for p in rounds_of.values():
            assert all(b - a >= cfg.min_separation for a, b in zip(p, p[1:]))
            assert np.sum(C[:, p].sum(axis=1) ** 2) <= accounted**2 * (1 + 1e-12)


def test_blt_calibration_round_trip(tmp_path, monkeypatch):
    monkeypatch.setenv("FED_DP_CACHE_DIR", str(tmp_path))
    cfg = _blt_config("min-sep")
    C = config_strategy(cfg).dense().numpy()
    sens = math.sqrt(_brute_force_sens_sq(C, cfg.min_separation, cfg.rounds))
    sigma = calibrate_noise_multiplier(cfg, 3.0)
    assert _direct(dp_accounting.GaussianDpEvent(sigma / sens), "pld") <= 3.0
    assert _direct(dp_accounting.GaussianDpEvent((sigma - 1e-6) / sens), "pld") > 3.0
