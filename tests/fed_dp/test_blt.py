"""Tests of fed_dp.blt: BLT strategies, their sensitivity under min-separation, error and optimization.

Expectations are computed independently here in numpy: dense matrices built by explicit loops, dense
inverses, and a brute-force maximum over every participation pattern (and over vector contributions) for
the sensitivity. Never with the functions under test.
"""

from __future__ import annotations

import itertools
import json
import math

import numpy as np
import pytest
import torch

from fed_dp import blt as blt_module
from fed_dp.blt import BLTStrategy, blt_coefs, blt_error, blt_loss, initial_blt, optimize_blt
from fed_dp.factorization import optimize_toeplitz, prefix_sum_workload, strategy_loss

F64 = torch.float64


# ------------------------------------------------------------------------------------------------
# Independent references
# ------------------------------------------------------------------------------------------------


def ref_coefs(theta, omega, rounds):
    """c_0 = 1, c_t = Σ_j θ_j ω_j^(t−1), by explicit loops."""
    return np.array([1.0] + [sum(th * om ** (t - 1) for th, om in zip(theta, omega)) for t in range(1, rounds)])


def ref_dense(theta, omega, rounds, normalized=True):
    """C̃[t, j] = c_{t−j} (j ≤ t), divided by its largest column norm when ``normalized``."""
    c = ref_coefs(theta, omega, rounds)
    C = np.zeros((rounds, rounds))
    for t in range(rounds):
        for j in range(t + 1):
            C[t, j] = c[t - j]
    return C / np.linalg.norm(C, axis=0).max() if normalized else C


def ref_workload(rounds, momentum=0.0):
    A = np.zeros((rounds, rounds))
    for t in range(rounds):
        for j in range(t + 1):
            A[t, j] = sum(momentum**k for k in range(t - j + 1))
    return A


def patterns(rounds, separation):
    """Every non-empty subset of range(rounds) with consecutive gaps ≥ separation."""
    out = []
    for size in range(1, rounds + 1):
        for p in itertools.combinations(range(rounds), size):
            if all(b - a >= separation for a, b in zip(p, p[1:])):
                out.append(p)
        if not any(len(p) == size for p in out):
            break
    return out


def brute_force_sens_sq(C, separation, rows=None):
    """max over valid patterns P of ‖Σ_{i∈P} C[:rows, i]‖² (columns beyond ``rows`` cannot participate)."""
    rows = C.shape[0] if rows is None else rows
    return max(float(np.sum(C[:rows, list(p)].sum(axis=1) ** 2)) for p in patterns(rows, separation))


def brute_force_signed_sens_sq(C, separation, rows=None):
    """max over valid patterns P and signs s_i = ±1 of ‖Σ_{i∈P} s_i C[:rows, i]‖²: the exact worst case of scalar
    contributions in [−1, 1] (a convex quadratic peaks at a vertex), which equal signs miss when C has
    negative entries."""
    rows = C.shape[0] if rows is None else rows
    best = 0.0
    for p in patterns(rows, separation):
        for signs in itertools.product([1.0, -1.0], repeat=len(p) - 1):
            best = max(best, float(np.sum((C[:rows, list(p)] @ np.array((1.0,) + signs)) ** 2)))
    return best


def ref_envelope_dense(theta, omega, rounds):
    """Ĉ[t, j] = ĉ_{t−j} with ĉ_r = max_{r≤s<T} |c_s|, divided by ‖c‖ (the normalization of C), by loops."""
    c = ref_coefs(theta, omega, rounds)
    hat = [max(abs(v) for v in c[r:]) for r in range(rounds)]
    C = np.zeros((rounds, rounds))
    for t in range(rounds):
        for j in range(t + 1):
            C[t, j] = hat[t - j]
    return C / np.linalg.norm(c)


def earliest_pattern_sq(C, separation, rows=None):
    rows = C.shape[0] if rows is None else rows
    return float(np.sum(C[:rows, list(range(0, rows, separation))].sum(axis=1) ** 2))


STRATEGIES = [  # θ > 0, Σθ ≤ 1: c positive and nonincreasing, where the sensitivity formula is exact
    BLTStrategy((0.3, 0.2), (0.9, 0.5), 13),
    BLTStrategy((0.45,), (0.97,), 12),
    BLTStrategy((0.05, 0.25, 0.7), (0.2, 0.6, 0.995), 11),  # Σθ = 1: c_1 = c_0, the boundary case
]

MIXED = [  # θ of both signs: c not monotone, or negative, or c_1 > c_0; the formula is an upper bound
    BLTStrategy((1.5, -0.4), (0.6, 0.9), 11),  # c_1 = 1.1 > c_0, c < 0 from t = 4
    BLTStrategy((-0.8, 0.5), (0.2, 0.97), 11),  # c_1 = −0.3, then positive: a dip
    BLTStrategy((0.3, -0.9), (0.95, 0.7), 10),  # c_1 = −0.6, c ends positive
    BLTStrategy((1.0, -1.9, 1.4), (0.6, 0.8, 0.9), 12),  # a shoulder, like the optimized min-sep BLTs
]


# ------------------------------------------------------------------------------------------------
# The matrix
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_dense_is_toeplitz_lower_triangular_with_largest_column_norm_one(strategy):
    C = strategy.dense().numpy()
    T = strategy.rounds
    np.testing.assert_allclose(C, ref_dense(strategy.theta, strategy.omega, T), rtol=1e-13, atol=1e-15)
    np.testing.assert_allclose(blt_coefs(strategy.theta, strategy.omega, T),
                               ref_coefs(strategy.theta, strategy.omega, T), rtol=1e-13)
    norms = np.linalg.norm(C, axis=0)
    assert norms[0] == pytest.approx(1.0, abs=1e-13) and norms.max() == pytest.approx(1.0, abs=1e-13)
    assert np.all(np.diff(norms) <= 1e-15)  # later columns are truncations of column 0
    c = C[:, 0]
    assert np.all(c > 0) and np.all(np.diff(c) <= 1e-15)  # positive, nonincreasing
    assert strategy.scale == pytest.approx(np.linalg.norm(ref_coefs(strategy.theta, strategy.omega, T)), rel=1e-13)


@pytest.mark.parametrize("strategy", STRATEGIES + MIXED)
def test_inverse_coefficients_and_row_norms_match_the_dense_inverse(strategy):
    C = ref_dense(strategy.theta, strategy.omega, strategy.rounds)
    inverse = np.linalg.inv(C)
    np.testing.assert_allclose(strategy.inverse_coefs(), inverse[:, 0] / strategy.scale, rtol=1e-10, atol=1e-13)
    np.testing.assert_allclose(strategy.inverse_row_sq_norms().numpy(), np.sum(inverse**2, axis=1), rtol=1e-10)


# ------------------------------------------------------------------------------------------------
# Sensitivity: the privacy-critical formula, against brute force
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("separation", [1, 2, 3, 5, 20])
def test_sensitivity_equals_brute_force_over_patterns_after_every_round(strategy, separation):
    C = ref_dense(strategy.theta, strategy.omega, strategy.rounds)
    got = strategy.sensitivity_squared(separation)
    assert got.shape == (strategy.rounds,)
    for t in range(1, strategy.rounds + 1):
        # The release after t rounds is rows < t; a participation at round ≥ t has not happened yet.
        assert got[t - 1] == pytest.approx(brute_force_sens_sq(C, separation, rows=t), rel=1e-12), (separation, t)
    assert got[0] == pytest.approx(1 / strategy.scale**2, rel=1e-12)  # round 1 releases row 0 only: (c_0/n_0)²
    assert got[-1] >= 1 - 1e-12  # column 0 alone has norm 1 over all T rows
    assert np.all(np.diff(got) >= 0)


@pytest.mark.parametrize("strategy", STRATEGIES[:2])
def test_vector_contributions_never_exceed_the_scalar_bound_and_attain_it(strategy):
    """‖Σ_{i∈P} C[:, i] u_iᵀ‖_F² over unit u_i: ≤ sens² for every pattern (X = CᵀC ≥ 0), = for equal u_i."""
    separation = 3
    C = ref_dense(strategy.theta, strategy.omega, strategy.rounds)
    bound = strategy.sensitivity_squared(separation)[-1]
    rng = np.random.default_rng(0)
    worst = 0.0
    for p in patterns(strategy.rounds, separation):
        for _ in range(3):
            u = rng.standard_normal((len(p), 5))
            u /= np.linalg.norm(u, axis=1, keepdims=True)
            worst = max(worst, float(np.sum((C[:, list(p)] @ u) ** 2)))
            assert np.sum((C[:, list(p)] @ u) ** 2) <= bound * (1 + 1e-12)
    earliest = list(range(0, strategy.rounds, separation))
    equal = np.ones((len(earliest), 5)) / math.sqrt(5)
    assert np.sum((C[:, earliest] @ equal) ** 2) == pytest.approx(bound, rel=1e-12)
    assert worst < bound  # random directions do not reach it: the bound is the worst case, not typical


@pytest.mark.parametrize("strategy", MIXED)
@pytest.mark.parametrize("separation", [1, 2, 3, 5, 20])
def test_sensitivity_bounds_brute_force_with_signs_for_mixed_signs(strategy, separation):
    """θ of both signs: sens_t² from the envelope ĉ = max_{s≥r}|c_s| is ≥ the brute-force maximum over
    every pattern and every sign of the contributions, after every round; it is the earliest pattern of Ĉ."""
    theta, omega, T = strategy.theta, strategy.omega, strategy.rounds
    C, envelope = ref_dense(theta, omega, T), ref_envelope_dense(theta, omega, T)
    assert np.linalg.norm(C, axis=0).max() == pytest.approx(1.0, abs=1e-13)  # one participation: 1, any c
    got = strategy.sensitivity_squared(separation)
    for t in range(1, T + 1):
        worst = brute_force_signed_sens_sq(C, separation, rows=t)
        assert got[t - 1] >= worst * (1 - 1e-12), (separation, t)
        assert got[t - 1] == pytest.approx(earliest_pattern_sq(envelope, separation, rows=t), rel=1e-12)
    assert np.all(np.diff(got) >= 0)


@pytest.mark.parametrize("strategy", MIXED)
def test_vector_contributions_never_exceed_the_bound_for_mixed_signs(strategy):
    separation = 3
    C = ref_dense(strategy.theta, strategy.omega, strategy.rounds)
    bound = strategy.sensitivity_squared(separation)[-1]
    rng = np.random.default_rng(1)
    for p in patterns(strategy.rounds, separation):
        for _ in range(3):
            u = rng.standard_normal((len(p), 4))
            u /= np.linalg.norm(u, axis=1, keepdims=True)
            assert np.sum((C[:, list(p)] @ u) ** 2) <= bound * (1 + 1e-12)


def test_earliest_pattern_of_c_itself_underestimates_mixed_signs():
    """Why the envelope: for these c the earliest pattern with equal contributions is not the worst case, so
    the θ > 0 formula applied to c directly would understate the sensitivity (and ε)."""
    for strategy, separation in ((MIXED[0], 2), (MIXED[0], 3), (MIXED[1], 3), (MIXED[2], 2)):
        C = ref_dense(strategy.theta, strategy.omega, strategy.rounds)
        worst = brute_force_signed_sens_sq(C, separation)
        assert earliest_pattern_sq(C, separation) < worst - 0.2
        assert strategy.sensitivity_squared(separation)[-1] >= worst * (1 - 1e-12)


def test_blt_sensitivity_exceeds_bandmf_shortcut():
    """Columns m apart overlap for a BLT (it is not banded), so sens² > ⌈T/m⌉, BandMF's value."""
    strategy = BLTStrategy((0.45,), (0.97,), 12)
    for separation in (2, 3, 4):
        k = math.ceil(12 / separation)
        assert strategy.sensitivity_squared(separation)[-1] > k + 0.1


def test_sensitivity_for_large_separation_is_one_participation():
    strategy = BLTStrategy((0.3, 0.2), (0.9, 0.5), 13)
    np.testing.assert_allclose(strategy.sensitivity_squared(13), np.cumsum(strategy.dense().numpy()[:, 0] ** 2))
    assert strategy.sensitivity_squared(50)[-1] == pytest.approx(1.0)


# ------------------------------------------------------------------------------------------------
# Error objective
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("momentum", [0.0, 0.8])
@pytest.mark.parametrize("strategy", STRATEGIES + MIXED)
def test_loss_equals_dense_error_with_brute_force_sensitivity(strategy, momentum):
    """sens² · ‖A C⁻¹‖_F²/T, sens² the brute-force maximum (θ > 0) or the envelope's earliest pattern (mixed)."""
    T, separation = strategy.rounds, 3
    C = ref_dense(strategy.theta, strategy.omega, T)
    A = ref_workload(T, momentum)
    if strategy in STRATEGIES:
        sens_sq = brute_force_sens_sq(C, separation)
    else:
        sens_sq = earliest_pattern_sq(ref_envelope_dense(strategy.theta, strategy.omega, T), separation)
    expected = sens_sq * np.sum((A @ np.linalg.inv(C)) ** 2) / T
    theta, omega = torch.tensor(strategy.theta, dtype=F64), torch.tensor(strategy.omega, dtype=F64)
    assert float(blt_loss(theta, omega, T, separation=separation, momentum=momentum)) == pytest.approx(expected, rel=1e-10)
    assert blt_error(strategy, separation=separation, momentum=momentum) == pytest.approx(expected, rel=1e-10)


def test_gradcheck_loss_and_impulse_response():
    theta = torch.tensor([0.3, 0.15, 0.1], dtype=F64, requires_grad=True)
    omega = torch.tensor([0.9, 0.5, 0.99], dtype=F64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda th, om: blt_loss(th, om, 40, separation=6, momentum=0.6), (theta, omega))
    theta = torch.tensor([1.0, -1.9, 1.4], dtype=F64, requires_grad=True)  # mixed signs: through the envelope
    omega = torch.tensor([0.6, 0.8, 0.9], dtype=F64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda th, om: blt_loss(th, om, 40, separation=6), (theta, omega))
    b = torch.tensor([1.0, -0.3, 0.1], dtype=F64, requires_grad=True)
    a = torch.tensor([1.0, -0.5, 0.2, 0.05], dtype=F64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda b, a: blt_module._ImpulseResponse.apply(b, a, 25), (b, a))


# ------------------------------------------------------------------------------------------------
# Validation
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("theta, omega, rounds, match", [
    ((float("inf"),), (0.5,), 5, r"theta\[0\]"),
    ((0.2, -float("inf")), (0.5, 0.5), 5, r"theta\[1\]"),
    ((0.2,), (1.0,), 5, r"omega\[0\]"),
    ((0.2,), (0.0,), 5, r"omega\[0\]"),
    ((0.2,), (-0.5,), 5, r"omega\[0\]"),
    ((0.2, 0.1), (0.5,), 5, "equal length"),
    ((), (), 5, "non-empty"),
    ((0.2,), (0.5,), 0, "rounds"),
    ((float("nan"),), (0.5,), 5, r"theta\[0\]"),
    ((1e200,), (0.5,), 50, "norm"),  # finite θ whose c overflows: n_0 = inf would make the sensitivity NaN
    ((-1.9,), (0.5,), 2000, "overflows"),  # an unstable inverse: h grows like 2.4^t, the noise would be inf
])
def test_strategy_validation_names_the_field(theta, omega, rounds, match):
    with pytest.raises(ValueError, match=match):
        BLTStrategy(theta, omega, rounds)


# ------------------------------------------------------------------------------------------------
# Optimization and the cache
# ------------------------------------------------------------------------------------------------


def test_optimized_blt_beats_its_start_independent_noise_and_short_bandmf(tmp_path):
    T = 200
    for separation in (T, 20):
        k = math.ceil(T / separation)
        best = optimize_blt(T, 3, separation=separation, cache_dir=tmp_path)
        error = blt_error(best, separation=separation)
        theta, omega = initial_blt(T, 3)
        assert error < blt_error(BLTStrategy(tuple(theta), tuple(omega), T), separation=separation)
        independent = k * np.sum(ref_workload(T) ** 2) / T  # C = I: sens² = k, ‖A‖_F²/T
        assert error < independent / 5
        if separation == T:  # one participation: a BLT approximates the unbanded optimum, 8 bands cannot
            bandmf = strategy_loss(optimize_toeplitz(T, 8, cache_dir=tmp_path).dense(), prefix_sum_workload(T))
            assert error < bandmf


def test_min_sep_blt_within_ten_percent_of_bandmf_at_its_own_separation(tmp_path):
    """Issue 13's target: T = 2,000, participations ≥ 64 rounds apart (32 of them), 3 buffers: error within 10% of
    BandMF with 64 bands. The θ > 0 class stops at 1.111× (its optimum for 2 to 5 buffers); mixed signs reach
    1.084×."""
    from fed_dp.factorization import banded_error

    T, b = 2000, 64
    bandmf = banded_error(optimize_toeplitz(T, b, cache_dir=tmp_path), separation=b)
    strategy = optimize_blt(T, 3, separation=b, cache_dir=tmp_path)
    assert blt_error(strategy, separation=b) <= 1.10 * bandmf
    assert min(strategy.theta) < 0  # it is the sign freedom that gets there


def test_positive_class_optimum_is_worse_at_min_sep(tmp_path):
    """Restricted to θ > 0 (softmax parameters) the best of several starts is the two-exponential optimum,
    above 1.10× BandMF-64; the sign-free optimizer finds a lower error at the same (T, ℓ, m)."""
    T, b, buffers = 2000, 64, 3

    def positive(free):
        logits = torch.cat([free.new_zeros(1), free[:buffers]])
        return torch.softmax(logits, dim=0)[1:], torch.sigmoid(free[buffers:])

    best = math.inf
    for spread in (1.0, 0.5):
        theta, omega = initial_blt(T, buffers, spread)
        start = torch.tensor(np.concatenate([np.log(theta / (1 - theta.sum())), np.log(omega / (1 - omega))]), dtype=F64)
        free = blt_module.lbfgs_minimize(lambda x: torch.log(blt_loss(*positive(x), T, separation=b)), start,
                                          max_iter=300, tolerance_grad=1e-9, tolerance_change=1e-12)
        with torch.no_grad():
            best = min(best, float(blt_loss(*positive(free), T, separation=b)))
    signed = blt_error(optimize_blt(T, buffers, separation=b, cache_dir=tmp_path), separation=b)
    assert signed < 0.98 * best


def test_files_of_an_older_cache_version_are_not_read(tmp_path):
    old = tmp_path / "blt-T60-k2-m7-prefix-sum.json"  # version 1's name and format
    old.write_text(json.dumps({"format": "fed-dp/blt-strategy", "version": 1, "rounds": 60, "buffers": 2,
                               "separation": 7, "workload": "prefix-sum", "momentum": 0.0,
                               "theta": [0.3, 0.2], "omega": [0.9, 0.5]}))
    strategy = optimize_blt(60, 2, separation=7, cache_dir=tmp_path)
    assert strategy.theta != (0.3, 0.2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["blt-T60-k2-m7-prefix-sum.json", "blt-v2-T60-k2-m7-prefix-sum.json"]


def test_cache_is_reused_keyed_and_validated(tmp_path, monkeypatch):
    first = optimize_blt(60, 2, separation=7, cache_dir=tmp_path)
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["blt-v2-T60-k2-m7-prefix-sum.json"]
    monkeypatch.setattr(blt_module, "_minimize", lambda *a, **k: pytest.fail("re-optimized a cached strategy"))
    assert optimize_blt(60, 2, separation=7, cache_dir=tmp_path) == first
    monkeypatch.undo()
    optimize_blt(60, 2, separation=8, cache_dir=tmp_path)
    optimize_blt(60, 3, separation=7, cache_dir=tmp_path)
    optimize_blt(60, 2, separation=7, momentum=0.5, cache_dir=tmp_path)
    assert len(list(tmp_path.iterdir())) == 4
    payload = json.loads((tmp_path / "blt-v2-T60-k2-m7-prefix-sum.json").read_text())
    assert payload["theta"] == list(first.theta) and payload["omega"] == list(first.omega)


@pytest.mark.parametrize("corrupt", [
    lambda p: "not json",
    lambda p: json.dumps({**p, "rounds": 61}),
    lambda p: json.dumps({**p, "theta": p["theta"][:1]}),
    lambda p: json.dumps({**p, "theta": [float("inf"), 0.1]}),  # not a valid BLT
    lambda p: json.dumps({**p, "version": 1}),
    lambda p: json.dumps({**p, "omega": [1.5, 0.5]}),
    lambda p: json.dumps({k: v for k, v in p.items() if k != "omega"}),
])
def test_corrupt_cache_is_an_error_naming_the_file(tmp_path, monkeypatch, corrupt):
    optimize_blt(60, 2, separation=7, cache_dir=tmp_path)
    path = tmp_path / "blt-v2-T60-k2-m7-prefix-sum.json"
    path.write_text(corrupt(json.loads(path.read_text())))
    monkeypatch.setattr(blt_module, "_minimize", lambda *a, **k: pytest.fail("silently re-optimized"))
    with pytest.raises(ValueError, match="blt-v2-T60-k2-m7-prefix-sum.json"):
        optimize_blt(60, 2, separation=7, cache_dir=tmp_path)


def test_cache_dir_from_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("FED_DP_CACHE_DIR", str(tmp_path / "env"))
    optimize_blt(30, 1, separation=4)
    assert [p.name for p in (tmp_path / "env").iterdir()] == ["blt-v2-T30-k1-m4-prefix-sum.json"]


@pytest.mark.parametrize("kwargs, match", [
    (dict(rounds=0, buffers=2, separation=3), "rounds"),
    (dict(rounds=10, buffers=0, separation=3), "buffers"),
    (dict(rounds=10, buffers=2, separation=0), "separation"),
    (dict(rounds=10, buffers=2, separation=3, momentum=1.0), "momentum"),
])
def test_optimize_blt_rejects_bad_arguments(tmp_path, kwargs, match):
    with pytest.raises(ValueError, match=match):
        optimize_blt(cache_dir=tmp_path, **kwargs)
