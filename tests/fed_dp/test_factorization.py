"""Tests of fed_dp.factorization: banded (Toeplitz) matrix-factorization strategies.

Expectations are computed independently in numpy (explicit loops and dense inverses), never with the
functions under test.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from fed_dp import factorization as strategy_module
from fed_dp.factorization import (
    BandedStrategy,
    banded_from_dense,
    identity_strategy,
    momentum_workload,
    optimize_toeplitz,
    prefix_sum_workload,
    sqrt_prefix_sum_coefs,
    strategy_loss,
    toeplitz_inverse_coefs,
    toeplitz_loss,
    toeplitz_strategy,
)

F64 = torch.float64


# ------------------------------------------------------------------------------------------------
# Independent reference implementations (numpy, dense)
# ------------------------------------------------------------------------------------------------


def ref_toeplitz(coefs, rounds: int) -> np.ndarray:
    """Dense un-normalized C̃ with C̃[t, t − r] = c_r, by explicit loops."""
    coefs = np.asarray(coefs, dtype=np.float64)
    C = np.zeros((rounds, rounds))
    for t in range(rounds):
        for r in range(len(coefs)):
            if t - r >= 0:
                C[t, t - r] = coefs[r]
    return C


def ref_workload(rounds: int, momentum: float = 0.0) -> np.ndarray:
    """A[t, j] = Σ_{k=0}^{t−j} μ^k for j ≤ t, by explicit loops (μ = 0: prefix-sum ones)."""
    A = np.zeros((rounds, rounds))
    for t in range(rounds):
        for j in range(t + 1):
            A[t, j] = sum(momentum**k for k in range(t - j + 1))
    return A


def ref_loss(C: np.ndarray, A: np.ndarray) -> float:
    """max column norm² · (1/T)·‖A C⁻¹‖_F² with a dense numpy inverse."""
    sens = np.linalg.norm(C, axis=0).max()
    return float(sens**2 * np.sum((A @ np.linalg.inv(C)) ** 2) / C.shape[0])


def ref_normalize(C: np.ndarray) -> np.ndarray:
    return C / np.linalg.norm(C, axis=0, keepdims=True)


def random_coefs(bands: int, seed: int) -> np.ndarray:
    """Well-conditioned coefficients: c_0 = 1 dominates, so C̃⁻¹ does not blow up."""
    rng = np.random.default_rng(seed)
    coefs = rng.uniform(-0.5, 0.5, size=bands) / bands
    coefs[0] = 1.0
    return coefs


def random_banded(rounds: int, bands: int, seed: int) -> np.ndarray:
    """A general (non-Toeplitz) lower-triangular b-banded matrix with a positive diagonal."""
    rng = np.random.default_rng(seed)
    C = np.zeros((rounds, rounds))
    for t in range(rounds):
        C[t, t] = rng.uniform(1.0, 2.0)
        for j in range(max(0, t - bands + 1), t):
            C[t, j] = rng.uniform(-0.4, 0.4) / bands
    return C


def cached_coefs(folder, rounds: int, bands: int, momentum: float) -> np.ndarray:
    key = "prefix-sum" if momentum == 0.0 else f"momentum{momentum!r}"
    payload = json.loads((folder / f"toeplitz-T{rounds}-b{bands}-{key}.json").read_text())
    return np.array(payload["coefs"], dtype=np.float64)


def assert_valid_structure(C: np.ndarray, bands: int) -> None:
    rounds = C.shape[0]
    rows, cols = np.indices((rounds, rounds))
    assert np.all(C[cols > rows] == 0.0), "not lower-triangular"
    assert np.all(C[rows - cols >= bands] == 0.0), "nonzero outside the bands"
    np.testing.assert_allclose(np.linalg.norm(C, axis=0), 1.0, rtol=0, atol=1e-12)
    assert np.all(np.diag(C) > 0)


# ------------------------------------------------------------------------------------------------
# Structure of the constructors
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("rounds,bands", [(1, 1), (6, 1), (6, 3), (6, 6), (40, 7)])
def test_toeplitz_strategy_is_normalized_banded_toeplitz(rounds, bands):
    coefs = random_coefs(bands, seed=rounds + bands)
    strategy = toeplitz_strategy(coefs, rounds)
    C = strategy.dense().numpy()
    assert (strategy.rounds, strategy.bands) == (rounds, bands)
    assert_valid_structure(C, bands)
    np.testing.assert_allclose(C, ref_normalize(ref_toeplitz(coefs, rounds)), rtol=1e-14, atol=1e-15)


def test_band_layout_matches_dense():
    coefs = random_coefs(4, seed=3)
    strategy = toeplitz_strategy(coefs, 9)
    C = strategy.dense().numpy()
    band = strategy.band.numpy()
    for t in range(9):
        for r in range(4):
            assert band[t, r] == (C[t, t - r] if t - r >= 0 else 0.0)


def test_banded_from_dense_normalizes_general_matrix():
    C_raw = random_banded(30, 5, seed=0)
    strategy = banded_from_dense(torch.tensor(C_raw, dtype=F64), 5)
    C = strategy.dense().numpy()
    assert_valid_structure(C, 5)
    np.testing.assert_allclose(C, ref_normalize(C_raw), rtol=1e-14, atol=1e-15)


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_optimized_strategy_structure(tmp_path, momentum):
    strategy = optimize_toeplitz(32, 6, momentum=momentum, cache_dir=tmp_path)
    C = strategy.dense().numpy()
    assert_valid_structure(C, 6)
    coefs = cached_coefs(tmp_path, 32, 6, momentum)
    assert coefs[0] > 0
    assert math.isclose(np.linalg.norm(coefs), 1.0, rel_tol=1e-12)
    np.testing.assert_allclose(C, ref_normalize(ref_toeplitz(coefs, 32)), rtol=1e-13, atol=1e-15)


def test_identity_strategy():
    strategy = identity_strategy(7)
    assert strategy.bands == 1
    assert torch.equal(strategy.dense(), torch.eye(7, dtype=F64))
    assert torch.equal(strategy.inverse_row_sq_norms(), torch.ones(7, dtype=F64))


def test_strategy_keeps_its_own_copy_of_band():
    band = torch.ones(5, 1, dtype=F64)
    strategy = BandedStrategy(band)
    band[0, 0] = 2.0
    assert strategy.band[0, 0] == 1.0


# ------------------------------------------------------------------------------------------------
# Row norms of C⁻¹
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "make",
    [
        lambda: toeplitz_strategy(random_coefs(6, seed=1), 50),
        lambda: toeplitz_strategy(random_coefs(50, seed=2), 50),
        lambda: banded_from_dense(torch.tensor(random_banded(50, 9, seed=4), dtype=F64), 9),
        lambda: banded_from_dense(torch.tensor(random_banded(50, 2, seed=5), dtype=F64), 2),
    ],
)
def test_inverse_row_sq_norms_match_dense_inverse(make):
    strategy = make()
    expected = np.sum(np.linalg.inv(strategy.dense().numpy()) ** 2, axis=1)
    got = strategy.inverse_row_sq_norms()
    assert got.dtype == F64
    np.testing.assert_allclose(got.numpy(), expected, rtol=1e-12, atol=0)
    got[0] = -1.0  # the returned tensor is a copy: the cache is not affected
    np.testing.assert_allclose(strategy.inverse_row_sq_norms().numpy(), expected, rtol=1e-12, atol=0)


def test_toeplitz_strategies_take_the_o_t_b_path_and_agree_with_the_general_recurrence(tmp_path):
    """C = C̃·diag(s) is recognized for Toeplitz-built strategies only; both paths give the same row norms."""
    optimized = optimize_toeplitz(300, 16, momentum=0.5, cache_dir=tmp_path)
    assert optimized._scaled_toeplitz() is not None
    assert toeplitz_strategy(random_coefs(6, seed=1), 50)._scaled_toeplitz() is not None
    assert banded_from_dense(torch.tensor(random_banded(50, 9, seed=4), dtype=F64), 9)._scaled_toeplitz() is None
    general = BandedStrategy(optimized.band.clone())
    object.__setattr__(general, "_scaled_toeplitz", lambda: None)  # force the O(T²·b) recurrence, same matrix
    np.testing.assert_allclose(optimized.inverse_row_sq_norms().numpy(), general.inverse_row_sq_norms().numpy(),
                               rtol=1e-11)


# ------------------------------------------------------------------------------------------------
# Workloads and losses
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("momentum", [0.0, 0.5, 0.9])
def test_workloads_match_reference(momentum):
    np.testing.assert_allclose(momentum_workload(12, momentum).numpy(), ref_workload(12, momentum), rtol=1e-14)
    np.testing.assert_array_equal(prefix_sum_workload(12).numpy(), ref_workload(12))


def test_strategy_loss_matches_reference_and_identity_closed_form():
    rounds = 25
    A = ref_workload(rounds)
    eye = np.eye(rounds)
    assert math.isclose(strategy_loss(torch.tensor(eye), torch.tensor(A)), (rounds + 1) / 2, rel_tol=1e-13)
    C = random_banded(rounds, 4, seed=7)  # not column-normalized: sens² matters
    expected = ref_loss(C, A)
    assert math.isclose(strategy_loss(torch.tensor(C), torch.tensor(A)), expected, rel_tol=1e-12)
    assert math.isclose(strategy_loss(torch.tensor(3.0 * C), torch.tensor(A)), expected, rel_tol=1e-12)


@pytest.mark.parametrize("momentum", [0.0, 0.9])
@pytest.mark.parametrize("rounds,bands", [(1, 1), (30, 1), (30, 5), (30, 30)])
def test_toeplitz_loss_matches_dense_loss_of_scaled_toeplitz(momentum, rounds, bands):
    coefs = random_coefs(bands, seed=10 * bands + rounds)
    coefs[0] = 0.8  # not unit: the loss must be scale invariant
    C_scaled = ref_toeplitz(coefs, rounds) / np.linalg.norm(coefs)
    expected = ref_loss(C_scaled, ref_workload(rounds, momentum))
    got = toeplitz_loss(torch.tensor(coefs, dtype=F64), rounds, momentum)
    assert got.dtype == F64
    assert math.isclose(float(got), expected, rel_tol=1e-11)


def test_toeplitz_inverse_coefs_match_dense_inverse():
    coefs = random_coefs(5, seed=11)
    expected = np.linalg.inv(ref_toeplitz(coefs, 20))[:, 0]
    got = toeplitz_inverse_coefs(torch.tensor(coefs, dtype=F64), 20)
    np.testing.assert_allclose(got.numpy(), expected, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("bands,rounds", [(1, 6), (4, 12), (12, 12)])
def test_gradcheck_toeplitz_inverse_function(bands, rounds):
    coefs = torch.tensor(random_coefs(bands, seed=bands), dtype=F64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda c: toeplitz_inverse_coefs(c, rounds), (coefs,))


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_gradcheck_toeplitz_loss(momentum):
    coefs = torch.tensor(random_coefs(5, seed=21), dtype=F64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda c: toeplitz_loss(c, 16, momentum), (coefs,))


# ------------------------------------------------------------------------------------------------
# Optimization quality
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_optimized_strategy_beats_baselines(tmp_path, momentum):
    rounds, bands = 64, 8
    A = ref_workload(rounds, momentum)
    optimized = ref_loss(optimize_toeplitz(rounds, bands, momentum=momentum, cache_dir=tmp_path).dense().numpy(), A)
    identity = ref_loss(np.eye(rounds), A)
    all_ones = ref_loss(ref_normalize(ref_toeplitz(np.ones(bands), rounds)), A)
    initial = ref_loss(ref_normalize(ref_toeplitz(sqrt_prefix_sum_coefs(bands).numpy(), rounds)), A)
    if momentum == 0.0:
        assert math.isclose(identity, (rounds + 1) / 2, rel_tol=1e-12)
    assert optimized < identity
    assert optimized < all_ones
    assert optimized <= initial
    assert optimized < 0.99 * initial  # a real improvement, not a no-op optimizer


def test_sqrt_prefix_sum_coefs_are_binomial():
    expected = [math.comb(2 * r, r) / 4**r for r in range(10)]
    np.testing.assert_allclose(sqrt_prefix_sum_coefs(10).numpy(), expected, rtol=1e-15)


@pytest.mark.parametrize("momentum", [0.0, 0.9])
@pytest.mark.parametrize("rounds,bands", [(20, 4), (64, 8), (64, 16)])
def test_column_normalization_does_not_increase_loss(tmp_path, momentum, rounds, bands):
    A = ref_workload(rounds, momentum)
    optimize_toeplitz(rounds, bands, momentum=momentum, cache_dir=tmp_path)
    for coefs in (cached_coefs(tmp_path, rounds, bands, momentum), sqrt_prefix_sum_coefs(bands).numpy()):
        C_tilde = ref_toeplitz(coefs, rounds)
        scaled = ref_loss(C_tilde / np.linalg.norm(coefs), A)
        normalized = ref_loss(toeplitz_strategy(coefs, rounds).dense().numpy(), A)
        assert normalized <= scaled * (1 + 1e-12)


# ------------------------------------------------------------------------------------------------
# Cache
# ------------------------------------------------------------------------------------------------


def test_cache_is_reused_without_reoptimizing(tmp_path, monkeypatch):
    first = optimize_toeplitz(24, 4, cache_dir=tmp_path)
    files = list(tmp_path.iterdir())
    assert [f.name for f in files] == ["toeplitz-T24-b4-prefix-sum.json"]  # no temp file left behind
    payload = json.loads(files[0].read_text())
    assert (payload["rounds"], payload["bands"], payload["workload"]) == (24, 4, "prefix-sum")
    assert math.isclose(payload["loss"], float(toeplitz_loss(torch.tensor(payload["coefs"], dtype=F64), 24)), rel_tol=1e-12)

    def must_not_run(*args, **kwargs):
        raise AssertionError("optimizer invoked although a cached strategy exists")

    monkeypatch.setattr(strategy_module, "_minimize_toeplitz_loss", must_not_run)
    second = optimize_toeplitz(24, 4, cache_dir=tmp_path)
    assert torch.equal(first.band, second.band)
    with pytest.raises(AssertionError, match="optimizer invoked"):
        optimize_toeplitz(24, 5, cache_dir=tmp_path)  # a different key is not served from the cache


def test_cache_keys_rounds_bands_and_workload(tmp_path):
    results = {
        "toeplitz-T24-b4-prefix-sum.json": optimize_toeplitz(24, 4, cache_dir=tmp_path),
        "toeplitz-T25-b4-prefix-sum.json": optimize_toeplitz(25, 4, cache_dir=tmp_path),
        "toeplitz-T24-b3-prefix-sum.json": optimize_toeplitz(24, 3, cache_dir=tmp_path),
        "toeplitz-T24-b4-momentum0.9.json": optimize_toeplitz(24, 4, momentum=0.9, cache_dir=tmp_path),
    }
    assert sorted(f.name for f in tmp_path.iterdir()) == sorted(results)
    prefix, momentum = (cached_coefs(tmp_path, 24, 4, mu) for mu in (0.0, 0.9))
    assert not np.allclose(prefix, momentum)
    assert optimize_toeplitz(24, 4, momentum=0.9, cache_dir=tmp_path).band.equal(
        results["toeplitz-T24-b4-momentum0.9.json"].band
    )


def test_cache_dir_from_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("FED_DP_CACHE_DIR", str(tmp_path / "env-cache"))
    optimize_toeplitz(10, 2)
    assert (tmp_path / "env-cache" / "toeplitz-T10-b2-prefix-sum.json").is_file()


def test_bands_one_is_identity_and_writes_nothing(tmp_path):
    strategy = optimize_toeplitz(10, 1, cache_dir=tmp_path)
    assert torch.equal(strategy.dense(), torch.eye(10, dtype=F64))
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "corrupt",
    [
        lambda p: "{not json",
        lambda p: json.dumps({**p, "bands": 5}),
        lambda p: json.dumps({**p, "coefs": p["coefs"][:-1]}),
        lambda p: json.dumps({**p, "coefs": [-c for c in p["coefs"]]}),
        lambda p: json.dumps({**p, "coefs": [float("nan")] * 4}),
        lambda p: json.dumps([1, 2, 3]),
    ],
)
def test_corrupted_cache_raises_naming_the_file(tmp_path, monkeypatch, corrupt):
    optimize_toeplitz(24, 4, cache_dir=tmp_path)
    path = tmp_path / "toeplitz-T24-b4-prefix-sum.json"
    path.write_text(corrupt(json.loads(path.read_text())))
    monkeypatch.setattr(strategy_module, "_minimize_toeplitz_loss", None)  # recomputing would crash
    with pytest.raises(ValueError, match="toeplitz-T24-b4-prefix-sum.json"):
        optimize_toeplitz(24, 4, cache_dir=tmp_path)


# ------------------------------------------------------------------------------------------------
# Validation
# ------------------------------------------------------------------------------------------------


def test_banded_from_dense_rejects_bad_matrices():
    C = random_banded(6, 2, seed=1)
    upper = C.copy()
    upper[1, 3] = 0.5
    with pytest.raises(ValueError, match=r"lower-triangular.*C\[1, 3\]"):
        banded_from_dense(torch.tensor(upper), 2)
    with pytest.raises(ValueError, match=r"outside its 1 bands.*C\[1, 0\]"):
        banded_from_dense(torch.tensor(C), 1)
    nonpositive = C.copy()
    nonpositive[4, 4] = -1.0
    with pytest.raises(ValueError, match=r"positive diagonal.*C\[4, 4\]"):
        banded_from_dense(torch.tensor(nonpositive), 2)
    with pytest.raises(ValueError, match="square"):
        banded_from_dense(torch.ones(3, 4, dtype=F64), 1)
    with pytest.raises(ValueError, match="bands"):
        banded_from_dense(torch.tensor(C), 7)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"rounds": 4, "bands": 5}, "bands"),
        ({"rounds": 4, "bands": 0}, "bands"),
        ({"rounds": 0, "bands": 1}, "rounds"),
        ({"rounds": 4, "bands": 2, "momentum": 1.0}, "momentum"),
        ({"rounds": 4, "bands": 2, "momentum": -0.1}, "momentum"),
        ({"rounds": 4.0, "bands": 2}, "rounds"),
    ],
)
def test_optimize_toeplitz_rejects_bad_arguments(tmp_path, kwargs, match):
    with pytest.raises(ValueError, match=match):
        optimize_toeplitz(**kwargs, cache_dir=tmp_path)


def test_other_argument_validation():
    with pytest.raises(ValueError, match="momentum"):
        momentum_workload(4, 1.0)
    with pytest.raises(ValueError, match="momentum"):
        toeplitz_loss(torch.ones(2, dtype=F64), 4, momentum=1.5)
    with pytest.raises(ValueError, match="bands"):
        toeplitz_strategy([1.0, 0.5, 0.1], 2)
    with pytest.raises(ValueError, match="positive"):
        toeplitz_strategy([-1.0, 0.5], 4)
    with pytest.raises(ValueError, match="rounds"):
        identity_strategy(0)
    with pytest.raises(ValueError, match="float64"):
        toeplitz_loss(torch.ones(2, dtype=torch.float32), 4)


@pytest.mark.parametrize(
    "band,match",
    [
        (torch.ones(4, dtype=F64), "2-D"),
        (torch.ones(4, 1, dtype=torch.float32), "float64"),
        (torch.ones(2, 3, dtype=F64), "bands ≤ rounds"),
        (torch.full((4, 1), float("inf"), dtype=F64), "finite"),
        (torch.full((4, 1), -1.0, dtype=F64), "positive"),
        (torch.tensor([[1.0, 0.5], [1.0, 0.0], [1.0, 0.0]], dtype=F64), "outside"),
        (torch.full((4, 1), 2.0, dtype=F64), "banded_from_dense"),
    ],
)
def test_banded_strategy_validation(band, match):
    with pytest.raises(ValueError, match=match):
        BandedStrategy(band)


# ------------------------------------------------------------------------------------------------
# Serialization
# ------------------------------------------------------------------------------------------------


def test_to_dict_from_dict_exact_round_trip():
    strategy = banded_from_dense(torch.tensor(random_banded(17, 4, seed=9), dtype=F64), 4)
    restored = BandedStrategy.from_dict(json.loads(json.dumps(strategy.to_dict())))
    assert restored.band.dtype == F64
    assert torch.equal(restored.band, strategy.band)
    with pytest.raises(ValueError, match="shape"):
        BandedStrategy.from_dict({**strategy.to_dict(), "rounds": 16})


def test_banded_error_is_k_times_the_dense_loss_and_needs_separation_at_least_b(tmp_path):
    from fed_dp.factorization import banded_error

    strategy = optimize_toeplitz(40, 4, cache_dir=tmp_path)
    C = strategy.dense().numpy()
    for separation, k in ((4, 10), (7, 6), (40, 1)):
        for momentum in (0.0, 0.5):
            expected = k * ref_loss(C, ref_workload(40, momentum))  # unit columns m ≥ b apart: sens² = k
            assert banded_error(strategy, separation=separation, momentum=momentum) == pytest.approx(expected, rel=1e-10)
    assert banded_error(identity_strategy(40), separation=1) == pytest.approx(40 * 41 / 2)  # C = I: T·‖A‖²/T
    with pytest.raises(ValueError, match="must be >= bands"):
        banded_error(strategy, separation=3)
